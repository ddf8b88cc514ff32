"""``ptckpt check``: which kernel, CPU and privilege features this machine offers.

Each probe really tries the feature (in a short-lived child where it could
disturb ptckpt itself) rather than guessing from version numbers.
"""

from __future__ import annotations

import ctypes
import os
import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from . import procfs

if TYPE_CHECKING:
    from .kinds import Kind

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

NR_PIDFD_OPEN = 434
NR_PIDFD_GETFD = 438
NR_USERFAULTFD = 323
NR_KCMP = 312
CLONE_NEWPID = 0x20000000
PR_SET_MM = 35
PR_SET_MM_MAP = 14
PR_SET_MM_MAP_SIZE = 15
CAP_SYS_ADMIN = 21
CAP_SYS_RESOURCE = 24
CAP_CHECKPOINT_RESTORE = 40


@dataclass(frozen=True)
class Check:
    name: str
    present: bool
    detail: str
    cost: str           # what its absence costs
    required: bool      # dump or restore cannot work without it

    def as_dict(self) -> dict:
        return asdict(self)


def _syscall(nr: int, *args: int) -> int:
    res = _libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a) for a in args])
    return -ctypes.get_errno() if res == -1 else res


def _prctl(option: int, *args: int) -> int:
    args = (list(args) + [0, 0, 0, 0])[:4]
    return _libc.prctl(ctypes.c_int(option), *[ctypes.c_ulong(a) for a in args])


def _in_child(fn: Callable[[], bool]) -> bool:
    """Run fn in a forked child; True when it returned True (exit 0)."""
    pid = os.fork()
    if pid == 0:
        try:
            os._exit(0 if fn() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def _cap(bit: int) -> bool:
    return bool(procfs.read_status(os.getpid()).cap_eff >> bit & 1)


def _ptrace_seize() -> tuple[bool, object]:
    """(seize works, rseq query works or the error text)."""
    from . import tracee
    try:
        with tracee.probe_task() as task:
            task.get_xstate()
            try:
                task.get_rseq()
                return True, True
            except Exception:
                return True, False
    except Exception as err:
        return False, str(err)


def free_pid_after(last: int, pid_max: int, taken) -> int:
    """A pid a little past the last one handed out, wrapping below pid_max the way the
    kernel does (past the first 300, which it keeps for early daemons), not taken."""
    span = pid_max - 300
    want = last + 500
    while True:
        if want >= pid_max:
            want = 300 + (want - pid_max) % span
        if not taken(want):
            return want
        want += 1


def _clone3_set_tid() -> bool:
    def probe() -> bool:
        last = int(procfs.read_sysctl("kernel/ns_last_pid"))
        pid_max = int(procfs.read_sysctl("kernel/pid_max"))
        want = free_pid_after(last, pid_max, procfs.pid_exists)
        from .resources.pids import clone3_with_pid
        try:
            res = clone3_with_pid(want)
        except OSError:
            return False
        if res == 0:
            os._exit(0)
        os.waitpid(res, 0)
        return res == want
    return _in_child(probe)


def _pidns() -> bool:
    def probe() -> bool:
        if _libc.unshare(CLONE_NEWPID) != 0:
            return False
        pid = os.fork()
        if pid == 0:
            os._exit(0 if os.getpid() == 1 else 1)
        _, status = os.waitpid(pid, 0)
        return os.WEXITSTATUS(status) == 0
    return _in_child(probe)


def _pidfd_getfd() -> bool:
    pidfd = _syscall(NR_PIDFD_OPEN, os.getpid(), 0)
    if pidfd < 0:
        return False
    try:
        fd = _syscall(NR_PIDFD_GETFD, pidfd, 0, 0)
        if fd < 0:
            return False
        os.close(fd)
        return True
    finally:
        os.close(pidfd)


def _prctl_mm_map() -> bool:
    def probe() -> bool:
        size = ctypes.c_uint()
        if _prctl(PR_SET_MM, PR_SET_MM_MAP_SIZE, ctypes.addressof(size)) != 0:
            return False
        st = procfs.read_stat(os.getpid())
        brk = _syscall(12, 0)
        auxv = procfs.read_auxv_bytes(os.getpid())
        auxv_buf = ctypes.create_string_buffer(auxv, len(auxv))
        # struct prctl_mm_map (include/uapi/linux/prctl.h)
        mm = struct.pack("<11QQIi", st.start_code, st.end_code, st.start_data, st.end_data,
                         st.start_brk, brk, st.start_stack, st.arg_start, st.arg_end,
                         st.env_start, st.env_end, ctypes.addressof(auxv_buf), len(auxv), -1)
        buf = ctypes.create_string_buffer(mm, len(mm))
        return _prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.addressof(buf), len(mm)) == 0
    return _in_child(probe)


def _userfaultfd() -> bool:
    fd = _syscall(NR_USERFAULTFD, os.O_CLOEXEC | 1)  # UFFD_USER_MODE_ONLY
    if fd < 0:
        return False
    os.close(fd)
    return True


def _userfaultfd_lazy() -> bool:
    from .lazypages import FEATURES, UFFD_API, UFFDIO_API, _ioctl
    fd = _syscall(NR_USERFAULTFD, os.O_CLOEXEC)
    if fd < 0:
        return False
    try:
        return not _ioctl(fd, UFFDIO_API, (ctypes.c_uint64 * 3)(UFFD_API, FEATURES, 0))
    finally:
        os.close(fd)


def _soft_dirty() -> bool:
    """A page just written has pagemap bit 55 set only when soft-dirty tracking exists."""
    buf = ctypes.create_string_buffer(3 * 4096)
    page = (ctypes.addressof(buf) + 4095) & ~4095
    ctypes.memset(page, 1, 4096)
    raw = procfs.read_pagemap(os.getpid(), page, page + 4096)
    return procfs.decode_pagemap_entry(procfs.pagemap_values(raw)[0]).soft_dirty


def _pagemap_scan() -> bool:
    """procfs tries the ioctl on /proc/self/pagemap once, at import."""
    return procfs.HAS_PAGEMAP_SCAN


def _process_vm_readv() -> bool:
    from .tracee import AddressSpace
    src = ctypes.create_string_buffer(b"ptckpt", 6)
    dst = bytearray(6)
    with AddressSpace(os.getpid()) as mem:
        mem.read_into(memoryview(dst), [(ctypes.addressof(src), 6)])
    return bytes(dst) == b"ptckpt"


def _cpu_flags() -> set[str]:
    return procfs.read_cpu_flags()


def _vdso() -> bool:
    return any(m.path == "[vdso]" for m in procfs.read_maps(os.getpid()))


def run_checks() -> list[Check]:
    out: list[Check] = []
    seize, rseq = _ptrace_seize()
    out.append(Check("ptrace seize/interrupt", seize, "PTRACE_SEIZE + PTRACE_INTERRUPT + GETREGSET(xstate)" if seize else str(rseq),
                     "no dump and no restore at all", True))
    out.append(Check("PTRACE_GET_RSEQ_CONFIGURATION", bool(seize and rseq is True), "Linux 5.13+",
                     "rseq registrations cannot be saved; glibc threads lose rseq on restore", False))
    out.append(Check("process_vm_readv/writev", _process_vm_readv(), "bulk memory transfer",
                     "memory would go through /proc/PID/mem only (slower)", True))
    flags = _cpu_flags()
    xs = [f for f in ("xsave", "xsaveopt", "xsavec", "avx", "avx2", "avx512f") if f in flags]
    out.append(Check("xsave", "xsave" in flags, "CPU features: " + " ".join(xs),
                     "extended register state (AVX ...) cannot be captured", True))
    out.append(Check("vdso", _vdso(), "[vdso] mapped in processes",
                     "no syscall instruction to inject at without patching text", False))
    out.append(Check("PAGEMAP_SCAN", _pagemap_scan(), "Linux 6.7+ page-table scan ioctl",
                     "pagemap is parsed page by page instead (slower dumps)", False))
    out.append(Check("clone3 set_tid", _clone3_set_tid(), "restore with the original pids",
                     "restore only into a fresh pid namespace (--pidns)", True))
    out.append(Check("pid namespaces", _pidns(), "unshare(CLONE_NEWPID)",
                     "no --pidns restores; a busy pid blocks a restore", False))
    out.append(Check("pidfd_getfd", _pidfd_getfd(), "copy fds between processes",
                     "sockets, pipes and memfds cannot be handed to a restored process", True))
    out.append(Check("PR_SET_MM_MAP", _prctl_mm_map(), "set brk, arg/env areas, auxv, exe",
                     "restored processes keep the stub's mm fields (wrong brk, /proc/PID/cmdline)", True))
    out.append(Check("userfaultfd", _userfaultfd(), "user-mode userfaultfd (dump --track-mem)",
                     "incremental dumps write every page (no memory tracking)", False))
    out.append(Check("userfaultfd events", _userfaultfd_lazy(), "kernel-mode faults, fork/remap/remove events "
                     "(restore --lazy)", "restore --lazy fills memory before the processes run", False))
    out.append(Check("soft-dirty", _soft_dirty(), "CONFIG_MEM_SOFT_DIRTY",
                     "not needed: memory tracking uses userfaultfd write-protection", False))
    out.append(Check("CAP_SYS_ADMIN", _cap(CAP_SYS_ADMIN), "capability",
                     "no clone3 set_tid outside a new user namespace, no namespaces", False))
    out.append(Check("CAP_SYS_RESOURCE", _cap(CAP_SYS_RESOURCE), "capability",
                     "rlimits cannot be raised above their hard limit; single-field PR_SET_MM refused", False))
    out.append(Check("CAP_CHECKPOINT_RESTORE", _cap(CAP_CHECKPOINT_RESTORE), "capability",
                     "set_tid and PR_SET_MM_MAP need CAP_SYS_ADMIN instead", False))
    out.append(Check("TCP_REPAIR", _tcp_repair(), "setsockopt(TCP_REPAIR) on a TCP socket (CAP_NET_ADMIN)",
                     "established TCP connections cannot be dumped (--tcp-established)", False))
    out += _network_lock()
    return out


def _tcp_repair() -> bool:
    import socket
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, 19, 1)
        except OSError:
            return False
    return True


def _network_lock() -> list[Check]:
    """nftables for the network lock, and the locks of dumps that did not finish (removed
    here, as every dump and restore does: their dumper was killed)."""
    from . import netlock
    from .resources import inet
    why = netlock.available()
    out = [Check("network lock (nftables)", why is None, "nft: a table of ptckpt's own per dump" if why is None
                 else why, "established TCP connections cannot be dumped (--tcp-established)", False)]
    if why is None:
        removed = inet.stale_lock_cleanup()
        held = [i for i in netlock.list_locks() if not netlock.owner_alive(i)]
        out.append(Check("network lock leftovers", True,
                         "; ".join(removed) if removed else "none left by an interrupted dump",
                         "", False))
        for info in held:
            out.append(Check(f"network lock {info.id}", True,
                             f"holds {len(info.connections)} TCP connections of the image {info.image_dir} "
                             f"until it is restored (unlock by hand: nft delete table inet {info.table})", "", False))
    return out


def kinds_table() -> list[Kind]:
    """The whole table of kinds (``ptckpt check --kinds``): ptckpt.kinds' rows, then /proc
    status fields, fdinfo keys and VmFlags from the modules that check them (which import
    ptckpt.kinds: the table cannot gather them itself without a cycle), then the rows of
    resources.registry with their operations."""
    from . import claims
    from .kinds import ABIS, ANON_INODES, FD, MAPPINGS, NAMESPACES, SOCKETS, Kind
    from .resources import memory, registry
    rows = [*FD.values(), *(Kind("anon_inode", n, f"as fd kind {k.name.lower()}") for n, k in ANON_INODES.items()),
            *SOCKETS.values(), *MAPPINGS.values(), *ABIS.values(), *NAMESPACES.values()]
    rows += [Kind("status", k, c.by) for k, c in claims.STATUS.items()]
    rows += [Kind("fdinfo", k, c.by) for k, c in claims.FDINFO_COMMON.items()]
    rows += [Kind("fdinfo", f"{kind.lower()}: {k}", c.by) for kind, keys in claims.FDINFO_BY_KIND.items()
             for k, c in keys.items()]
    rows += [Kind("vmflag", k, v) for k, v in memory.VMFLAGS_MADE.items()]
    rows += [Kind("vmflag", k, f"follows from the mapping: {v}") for k, v in memory.VMFLAGS_DERIVED.items()]
    rows += [Kind("vmflag", k, "", v) for k, v in memory.VMFLAGS_REFUSED.items()]
    rows += [Kind("resource", row.name, f"resources.{row.module}: {', '.join(row.operations)}")
             for row in registry.ROWS]
    return rows
