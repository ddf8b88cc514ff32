"""Credentials: uids, gids, groups, the five capability sets, securebits, no_new_privs,
seccomp mode and filters -- all per thread in the kernel.

Dump half: :func:`dump_creds_frozen`, run in every thread (from /proc/PID/task/TID/status,
securebits by injection, the seccomp filters through ptrace); the leader's are the
process's CREDS, and :func:`thread_creds` keeps another thread's own in its THREAD record
where they differ.

Restore half: :func:`restore_seccomp_frozen` then :func:`restore_creds_frozen`, in
the leader and in every other thread, each with its own.  The order matters:

0. the seccomp filters first, while the thread is still privileged (installing one needs
   CAP_SYS_ADMIN or no_new_privs): the part of the chain every thread shares with TSYNC
   from the leader (so it is one filter, shared, as a process's is), then in each thread the
   rest of its own; the tracer has them suspended for what it injects afterwards;
1. groups, then with SECBIT_NO_SETUID_FIXUP set the uid and gid changes leave the
   capability sets alone;
2. the bounding set is cut (needs CAP_SETPCAP, still effective);
3. securebits take their dumped value (needs CAP_SETPCAP too);
4. capset() sets effective, permitted and inheritable;
5. the ambient set is raised (each needs to be permitted and inheritable);
6. no_new_privs, which cannot be cleared once set.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence

from .. import procfs
from ..errors import PrivilegeNeeded, TraceeError, UnsupportedResource
from ..formats.model import Creds, Thread
from .. import tracee
from ..tracee import RemoteSyscalls, Task

PR_CAPBSET_DROP = 24
PR_GET_SECUREBITS, PR_SET_SECUREBITS = 27, 28
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 47, 2
SECBIT_NO_SETUID_FIXUP = 1 << 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def cap_last_cap() -> int:
    return int(procfs.read_sysctl("kernel/cap_last_cap"))


def dump_creds_frozen(pid: int, s: procfs.Status, remote: RemoteSyscalls | None = None,
                      task: Task | None = None) -> Creds:
    """One thread's credentials: `s` its /proc status, read while frozen; securebits come from
    inside (`remote`, injecting into it), the seccomp filters through ptrace from `task`."""
    filters: list[tuple[int, bytes]] = []
    if s.seccomp == SECCOMP_MODE_FILTER and task is not None:
        filters = _seccomp_filters(pid, task)
    securebits = 0
    if remote is not None:
        securebits = remote.checked("prctl", PR_GET_SECUREBITS, step="dump creds: securebits")
    return Creds(
        seccomp_filters=tuple(prog for _flags, prog in filters),
        seccomp_flags=tuple(flags for flags, _prog in filters),
        uids=tuple(s.uids), gids=tuple(s.gids), groups=tuple(s.groups),
        cap_inh=s.cap_inh, cap_prm=s.cap_prm, cap_eff=s.cap_eff,
        cap_bnd=s.cap_bnd, cap_amb=s.cap_amb,
        no_new_privs=s.no_new_privs, seccomp=s.seccomp,
        securebits=securebits,
    )


SECCOMP_MODE_STRICT, SECCOMP_MODE_FILTER = 1, 2
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_TSYNC = 1
SECCOMP_RET_USER_NOTIF = 0x7FC00000
BPF_RET_K = 0x06
_SOCK_FILTER = struct.Struct("<HBBI")


def refuse_strict_mode(pid: int, statuses: Mapping[int, procfs.Status]) -> None:
    """Before anything is injected: a thread in seccomp strict mode is killed by any syscall
    but read, write, exit and sigreturn, unless the tracer suspends seccomp (as root)."""
    if tracee.SUSPEND_SECCOMP:
        return
    for tid, s in statuses.items():
        if s.seccomp == SECCOMP_MODE_STRICT:
            raise UnsupportedResource(pid, f"thread {tid} in seccomp strict mode (any syscall but read, "
                                      "write, exit and sigreturn kills it: nothing can be injected "
                                      "unless ptckpt runs as root)")


def _seccomp_filters(pid: int, task: Task) -> list[tuple[int, bytes]]:
    """A thread's filter chain, oldest first; refused when a filter hands syscalls to a
    user-space supervisor (its listener fd is not restored)."""
    try:
        chain = task.seccomp_filters()
    except TraceeError as err:
        if "EACCES" not in str(err) and "EPERM" not in str(err):
            raise
        raise PrivilegeNeeded(f"process {pid} runs under seccomp filters: reading them "
                              f"(PTRACE_SECCOMP_GET_FILTER) needs CAP_SYS_ADMIN; dump it as root") from None
    for _flags, prog in chain:
        for code, _jt, _jf, k in _SOCK_FILTER.iter_unpack(prog):
            if code == BPF_RET_K and k & 0xFFFF0000 == SECCOMP_RET_USER_NOTIF:
                raise UnsupportedResource(pid, "a seccomp filter that notifies a supervisor "
                                          "(SECCOMP_RET_USER_NOTIF): its listener is not restored")
    return chain


def restore_seccomp_frozen(remote: RemoteSyscalls, creds: Creds, *, first: int = 0,
                           upto: int | None = None, tsync: bool = True) -> None:
    """Install the filters `first`..`upto` of `creds`, oldest first: with `tsync` in every
    thread (TSYNC), else in the calling thread alone; before the credentials (installing
    needs CAP_SYS_ADMIN or no_new_privs).  The syscalls injected after them pass no filter:
    the restore traces with seccomp suspended (tracee.SUSPEND_SECCOMP)."""
    sync = SECCOMP_FILTER_FLAG_TSYNC if tsync else 0
    for prog, flags in list(zip(creds.seccomp_filters, creds.seccomp_flags))[first:upto]:
        with remote.scratch(prog) as pp, remote.scratch(struct.pack("<H6xQ", len(prog) // 8, int(pp))) as fp:
            remote.checked("seccomp", SECCOMP_SET_MODE_FILTER, flags | sync, int(fp),
                           step=f"seccomp filter of {len(prog) // 8} instructions")


def shared_filters(all_creds: Sequence[Creds]) -> int:
    """How many filters, oldest first, the chains of all of a process's threads share: those
    the leader installs for all with TSYNC; each thread adds the rest of its own alone."""
    chains = [list(zip(c.seccomp_filters, c.seccomp_flags)) for c in all_creds]
    n = min(map(len, chains), default=0)
    for i in range(n):
        if any(chain[i] != chains[0][i] for chain in chains):
            return i
    return n


def thread_creds(own: Creds, process: Creds) -> tuple[Creds, ...]:
    """What a THREAD record keeps of a thread's credentials `own`: () when they are its
    process's (the leader's), else them."""
    return () if own == process else (own,)


CAP_SETGID, CAP_SETUID = 6, 7


def check_restorable(pid: int, creds: Creds, threads: Sequence[Thread] = ()) -> None:
    """Refuse, before anything is made, credentials the restoring user could not take
    itself (an image of another user's or of root's process, or credentials edited in
    an image), the process's or one of its `threads`' own: a restore never gives more than
    the user has."""
    caps = procfs.read_status(os.getpid()).cap_eff
    if caps >> CAP_SETUID & 1 and caps >> CAP_SETGID & 1:
        return
    uids, gids = (*os.getresuid(), os.geteuid()), (*os.getresgid(), os.getegid())
    for c in (creds, *(c for t in threads for c in t.creds)):
        differ = [f"{what} {'/'.join(map(str, theirs))} (yours {'/'.join(map(str, mine))})"
                  for what, theirs, mine in (("uids", c.uids, uids), ("gids", c.gids, gids),
                                             ("groups", tuple(sorted(c.groups)), tuple(sorted(os.getgroups()))))
                  if tuple(theirs) != tuple(mine)]
        if differ:
            break
    if differ:
        raise PrivilegeNeeded(f"process {pid} of the image ran with {', '.join(differ)}: taking "
                              f"credentials that are not your own needs CAP_SETUID and CAP_SETGID; "
                              f"restore it as root, or as the user it ran as")


def restore_creds_frozen(remote: RemoteSyscalls, creds: Creds, *, uid_gid: bool = True) -> list[str]:
    """Make the calling thread's credentials `creds` (see the module's order).  A step
    the restoring user may not take is a warning; the caller decides what is fatal."""
    warnings: list[str] = []

    def call(name, *args, what):
        res = remote.syscall(name, *args)
        if res < 0:
            warnings.append(f"{what} failed: {os.strerror(-res)}")
        return res

    if uid_gid:
        # The thread holds ptckpt's own ids until now (it was forked from ptckpt, or from
        # the init of --pidns): only what differs is changed.  In the user namespace of
        # an unprivileged --pidns restore setgroups() is denied, and needed by nothing.
        same = (creds.uids == (*os.getresuid(), os.geteuid()) and creds.gids == (*os.getresgid(), os.getegid())
                and sorted(creds.groups) == sorted(os.getgroups()))
        if not same:
            call("prctl", PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP, what="securebits for the uid change")
            with remote.scratch(struct.pack(f"<{len(creds.groups)}I", *creds.groups) or 4) as gp:
                call("setgroups", len(creds.groups), int(gp), what=f"setgroups{creds.groups}")
            call("setresgid", *creds.gids[:3], what=f"setresgid{creds.gids[:3]}")
            remote.syscall("setfsgid", creds.gids[3])
            call("setresuid", *creds.uids[:3], what=f"setresuid{creds.uids[:3]}")
            remote.syscall("setfsuid", creds.uids[3])
    last = cap_last_cap()
    for cap in range(last + 1):
        if not creds.cap_bnd >> cap & 1:
            res = remote.syscall("prctl", PR_CAPBSET_DROP, cap)
            if res < 0:
                warnings.append(f"cannot drop capability {cap} from the bounding set: {os.strerror(-res)}")
                break
    if remote.syscall("prctl", PR_GET_SECUREBITS) != creds.securebits:
        call("prctl", PR_SET_SECUREBITS, creds.securebits, what=f"securebits {creds.securebits:#x}")
    header = struct.pack("<Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = b"".join(struct.pack("<III", creds.cap_eff >> s & 0xFFFFFFFF, creds.cap_prm >> s & 0xFFFFFFFF,
                                creds.cap_inh >> s & 0xFFFFFFFF) for s in (0, 32))
    with remote.scratch(header) as hp, remote.scratch(data) as dp:
        call("capset", int(hp), int(dp), what="capset (effective, permitted, inheritable)")
    for cap in range(last + 1):
        if creds.cap_amb >> cap & 1:
            call("prctl", PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0,
                 what=f"raise ambient capability {cap}")
    if creds.no_new_privs:
        call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0, what="no_new_privs")
    if creds.seccomp == SECCOMP_MODE_STRICT:       # per thread; the tracer has it suspended
        remote.checked("prctl", PR_SET_SECCOMP, SECCOMP_MODE_STRICT, 0, 0, 0, step="seccomp strict mode")
    return warnings
