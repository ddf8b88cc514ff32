"""membarrier(2) registrations: which expedited barriers a process registered for.

They live in its mm (mm->membarrier_state), are shown nowhere in /proc and are cleared by
execve, so a restored process starts without them, and its next
MEMBARRIER_CMD_PRIVATE_EXPEDITED fails with EPERM (liburcu, JIT runtimes and the like issue
such barriers; CRIU's zdtm static/membarrier checks them).

Dump half: :func:`dump_registrations_frozen` asks from inside with
MEMBARRIER_CMD_GET_REGISTRATIONS (kernel 6.3+), which returns the REGISTER_* commands the
calling process issued.  An older kernel answers EINVAL: then each private kind is probed
by issuing its barrier (it succeeds only once registered, CRIU's way), and the global kind,
which no call reveals, is counted as registered when the kernel offers it, since registering
it again only makes the process take part in other processes' global expedited barriers
(more ordering, never less).  Bits this module does not know are refused by name.

Restore half: :func:`restore_registrations_frozen` issues the same REGISTER_* commands,
once per process (the state is per mm, shared by its threads).
"""

from __future__ import annotations

from ..errors import UnsupportedResource
from ..tracee import RemoteSyscalls

CMD_QUERY = 0
CMD_GET_REGISTRATIONS = 1 << 9
# REGISTER_* command -> its name; each kind's barrier command is its REGISTER command >> 1
# (enum membarrier_cmd, include/uapi/linux/membarrier.h)
REGISTER = {
    1 << 2: "GLOBAL_EXPEDITED",
    1 << 4: "PRIVATE_EXPEDITED",
    1 << 6: "PRIVATE_EXPEDITED_SYNC_CORE",
    1 << 8: "PRIVATE_EXPEDITED_RSEQ",
}
REGISTER_GLOBAL_EXPEDITED = 1 << 2
KNOWN = sum(REGISTER)
EPERM, EINVAL, ENOSYS = 1, 22, 38


def names(mask: int) -> str:
    """'PRIVATE_EXPEDITED|GLOBAL_EXPEDITED' (unknown bits as hex)."""
    parts = [name for bit, name in REGISTER.items() if mask & bit]
    if mask & ~KNOWN:
        parts.append(f"{mask & ~KNOWN:#x}")
    return "|".join(parts) or "none"


def dump_registrations_frozen(pid: int, remote: RemoteSyscalls) -> int:
    """The REGISTER_* bits of the process (0: none, or no membarrier in this kernel)."""
    mask = remote.syscall("membarrier", CMD_GET_REGISTRATIONS, 0, 0)
    if mask == -EINVAL:
        mask = _probe_registrations(remote)
    elif mask < 0:
        remote.checked("membarrier", CMD_GET_REGISTRATIONS, 0, 0, step="dump membarrier registrations")
    if mask & ~KNOWN:
        raise UnsupportedResource(pid, f"a membarrier registration of a kind ptckpt does not know "
                                       f"({names(mask)})")
    return mask


def _probe_registrations(remote: RemoteSyscalls) -> int:
    """A kernel before 6.3: what QUERY offers, probed kind by kind (see the module's text)."""
    supported = remote.syscall("membarrier", CMD_QUERY, 0, 0)
    if supported in (-ENOSYS, -EINVAL):
        return 0                                   # no membarrier at all: nothing to register
    if supported < 0:
        remote.checked("membarrier", CMD_QUERY, 0, 0, step="dump membarrier: query")
    mask = 0
    for bit in REGISTER:
        if not supported & bit:
            continue
        if bit == REGISTER_GLOBAL_EXPEDITED:
            mask |= bit                            # not observable: registered again to be safe
            continue
        res = remote.syscall("membarrier", bit >> 1, 0, 0)
        if res == 0:
            mask |= bit
        elif res not in (-EPERM, -EINVAL):
            remote.checked("membarrier", bit >> 1, 0, 0, step=f"dump membarrier: probe {REGISTER[bit]}")
    return mask


def restore_registrations_frozen(remote: RemoteSyscalls, mask: int) -> None:
    """Register again; a kernel without one of the kinds fails the restore, naming it."""
    for bit, name in REGISTER.items():
        if mask & bit:
            remote.checked("membarrier", bit, 0, 0,
                           step=f"membarrier: register {name} again (the process had registered it)")
