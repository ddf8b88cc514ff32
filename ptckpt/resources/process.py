"""The process itself: identity and relations, credentials, rlimits, mm fields.

Dump half: :func:`dump_task`, :func:`dump_creds`, :func:`dump_rlimits`,
:func:`dump_mm_frozen` (brk and dumpable come from inside, by injection).
"""

from __future__ import annotations

import contextlib
import os
import resource
import struct
import time
from collections.abc import Mapping

from .. import procfs
from ..formats.model import Creds, Mm, Rlimit, Task
from ..tracee import RemoteSyscalls
from .files import ghost_dir_key

PR_GET_DUMPABLE = 3
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


def _prctl_get_int(remote: RemoteSyscalls, option: int, step: str) -> int:
    """prctl(option, &int) inside the tracee: the int it wrote."""
    with remote.scratch(8) as buf:
        remote.checked("prctl", option, int(buf), step=step)
        return struct.unpack("<i", remote.mem.read(buf, 4))[0]


def dump_task(pid: int, tids: list[int], status: procfs.Status, st: procfs.Stat,
              remote: RemoteSyscalls | None = None) -> Task:
    """`status` and `st` are one reading of /proc/PID/status and stat, shared by the dump halves."""
    dumpable, pdeath, subreaper = 1, 0, 0
    if remote is not None:
        dumpable = remote.checked("prctl", PR_GET_DUMPABLE, step="dump task")
        pdeath = _prctl_get_int(remote, PR_GET_PDEATHSIG, "dump task: pdeath_signal")
        subreaper = _prctl_get_int(remote, PR_GET_CHILD_SUBREAPER, "dump task: child subreaper")
    return Task(
        pid=pid,
        ppid=st.ppid,
        pgid=st.pgrp,
        sid=st.session,
        comm=st.comm,
        state=st.state,
        exe=procfs.read_exe(pid),
        cwd=procfs.read_cwd(pid),
        root=procfs.read_root(pid),
        umask=status.umask if status.umask is not None else 0o022,
        personality=procfs.read_personality(pid),
        nice=st.nice,
        sched_policy=st.policy,
        rt_priority=st.rt_priority,
        oom_score_adj=procfs.read_oom_score_adj(pid),
        timerslack_ns=procfs.read_timerslack_ns(pid),
        exit_signal=st.exit_signal,
        tids=tuple(tids),
        cmdline=tuple(procfs.read_cmdline(pid)),
        dumpable=dumpable,
        pdeath_signal=pdeath,
        child_subreaper=bool(subreaper),
    )


def dump_creds(s: procfs.Status) -> Creds:
    return Creds(
        uids=tuple(s.uids), gids=tuple(s.gids), groups=tuple(s.groups),
        cap_inh=s.cap_inh, cap_prm=s.cap_prm, cap_eff=s.cap_eff,
        cap_bnd=s.cap_bnd, cap_amb=s.cap_amb,
        no_new_privs=s.no_new_privs, seccomp=s.seccomp,
    )


def dump_rlimits(pid: int) -> list[Rlimit]:
    return [Rlimit(r.resource, r.cur, r.max) for r in procfs.read_limits(pid)]


def dump_mm_frozen(pid: int, st: procfs.Stat, remote: RemoteSyscalls) -> Mm:
    """mm_struct fields: /proc/PID/stat gives all but brk, which brk(0) returns from inside."""
    brk = remote.checked("brk", 0, step="dump mm")
    exe = ""
    with contextlib.suppress(Exception):
        exe = procfs.read_exe(pid)
    return Mm(
        start_code=st.start_code, end_code=st.end_code,
        start_data=st.start_data, end_data=st.end_data,
        start_brk=st.start_brk, brk=brk, start_stack=st.start_stack,
        arg_start=st.arg_start, arg_end=st.arg_end,
        env_start=st.env_start, env_end=st.env_end,
        exe_file=exe,
        auxv=tuple(procfs.read_auxv(pid)),
    )


def current_clocks() -> tuple[int, int, int]:
    """(CLOCK_REALTIME, CLOCK_MONOTONIC, CLOCK_BOOTTIME) in ns, taken while the target is frozen."""
    return (time.clock_gettime_ns(time.CLOCK_REALTIME),
            time.clock_gettime_ns(time.CLOCK_MONOTONIC),
            time.clock_gettime_ns(time.CLOCK_BOOTTIME))


# --- restore half ------------------------------------------------------------

PR_SET_MM = 35
PR_SET_MM_MAP = 14
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PRIO_PROCESS = 0
AT_FDCWD = -100 & (2**64 - 1)
_MM_MAP = struct.Struct("<11QQIi")   # struct prctl_mm_map (include/uapi/linux/prctl.h)


def restore_mm_frozen(remote: RemoteSyscalls, mm: Mm, step: str = "restore mm fields") -> None:
    """PR_SET_MM_MAP: code/data/brk/stack/arg/env areas, auxv and the exe link, in one call.

    The single-field PR_SET_MM forms need CAP_SYS_RESOURCE, which these
    machines do not grant; the whole-struct form does not.
    """
    auxv = b"".join(struct.pack("<QQ", t, v) for t, v in mm.auxv) + struct.pack("<QQ", 0, 0)
    exe_fd = -1
    if mm.exe_file:
        with remote.scratch(os.fsencode(mm.exe_file) + b"\0") as p:
            exe_fd = remote.checked("openat", AT_FDCWD, int(p), 0o2000000, 0,
                                    step=f"{step}: open exe {mm.exe_file}")
    try:
        with remote.scratch(auxv) as auxp:
            rec = _MM_MAP.pack(mm.start_code, mm.end_code, mm.start_data, mm.end_data,
                               mm.start_brk, mm.brk, mm.start_stack, mm.arg_start, mm.arg_end,
                               mm.env_start, mm.env_end, int(auxp), len(auxv), exe_fd)
            with remote.scratch(rec) as recp:
                remote.checked("prctl", PR_SET_MM, PR_SET_MM_MAP, int(recp), len(rec), 0, step=step)
    finally:
        if exe_fd >= 0:
            remote.syscall("close", exe_fd)


def _change_dir(remote: RemoteSyscalls, path: str, handed: Mapping) -> None:
    """chdir(path), or fchdir() to the directory a deleted one was made again as."""
    made = handed.get(ghost_dir_key(path))
    if made is not None:
        remote.checked("fchdir", made, step=f"fchdir to {path}")
        return
    with remote.scratch(os.fsencode(path) + b"\0") as p:
        remote.checked("chdir", int(p), step=f"chdir {path}")


def restore_root_frozen(remote: RemoteSyscalls, task: Task, handed: Mapping = {}) -> None:
    """chroot, once nothing more is opened by a path seen from ptckpt's root (the exe, the
    cwd: chroot does not move the cwd); a removed root through its directory made again."""
    if task.root and task.root != "/":
        made = handed.get(ghost_dir_key(task.root))
        root = f"/proc/self/fd/{made}" if made is not None else task.root
        with remote.scratch(os.fsencode(root) + b"\0") as p:
            remote.checked("chroot", int(p), step=f"chroot {task.root}")


def restore_task_frozen(remote: RemoteSyscalls, task: Task, handed: Mapping = {}) -> list[str]:
    """cwd, umask, personality, dumpable from inside; comm, nice, oom_score_adj,
    timerslack from outside.  Returns warnings (things that could not be set).

    A cwd that was removed is entered through the fd of its directory made again
    (``handed[files.ghost_dir_key(path)]``), which is removed by then.  The root is
    restore_root_frozen's."""
    warnings: list[str] = []
    pid = remote.task.tgid
    _change_dir(remote, task.cwd, handed)       # as ptckpt sees it; the root comes later
    remote.checked("umask", task.umask, step="umask")
    remote.checked("personality", task.personality, step="personality")
    remote.checked("prctl", PR_SET_DUMPABLE, task.dumpable, step="dumpable")
    if task.child_subreaper:
        remote.checked("prctl", PR_SET_CHILD_SUBREAPER, 1, step="child subreaper")
    with remote.scratch(task.comm.encode()[:15] + b"\0") as p:
        remote.checked("prctl", PR_SET_NAME, int(p), step="comm")
    for name, value in (("oom_score_adj", str(task.oom_score_adj)),
                        ("timerslack_ns", str(task.timerslack_ns))):
        try:
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write(value)
        except OSError as err:
            warnings.append(f"cannot set {name} to {value}: {err.strerror}")
    try:
        os.setpriority(os.PRIO_PROCESS, pid, task.nice)
    except OSError as err:
        warnings.append(f"cannot set nice {task.nice}: {err.strerror}")
    return warnings


def restore_rlimits(pid: int, rlimits) -> list[str]:
    """prlimit() from outside; a limit that cannot be raised is reported, not fatal."""
    warnings = []
    for r in rlimits:
        inf = resource.RLIM_INFINITY
        cur = inf if r.cur >= 2**63 else r.cur
        mx = inf if r.max >= 2**63 else r.max
        try:
            resource.prlimit(pid, r.resource, (cur, mx))
        except (OSError, ValueError) as err:
            warnings.append(f"rlimit {r.resource} ({cur}, {mx}) cannot be set "
                            f"(raising a hard limit needs CAP_SYS_RESOURCE): {err}")
    return warnings


def restore_pdeath_signal_frozen(remote: RemoteSyscalls, task: Task) -> None:
    """After the credentials: changing them clears the parent-death signal (prctl(2))."""
    if task.pdeath_signal:
        remote.checked("prctl", PR_SET_PDEATHSIG, task.pdeath_signal, step="pdeath_signal")


def restore_creds_frozen(remote: RemoteSyscalls, creds: Creds) -> list[str]:
    """Groups, gids, uids where permitted (last: after it the process may be unprivileged)."""
    warnings = []
    me = (os.getuid(), os.getgid())
    if creds.uids == (me[0],) * 4 and creds.gids == (me[1],) * 4 and not creds.groups:
        return warnings
    with remote.scratch(struct.pack(f"<{len(creds.groups)}I", *creds.groups) or 4) as gp:
        res = remote.syscall("setgroups", len(creds.groups), int(gp))
        if res < 0:
            warnings.append(f"setgroups{creds.groups} failed: {os.strerror(-res)}")
    res = remote.syscall("setresgid", *creds.gids[:3])
    if res < 0:
        warnings.append(f"setresgid{creds.gids[:3]} failed: {os.strerror(-res)}")
    remote.syscall("setfsgid", creds.gids[3])
    res = remote.syscall("setresuid", *creds.uids[:3])
    if res < 0:
        warnings.append(f"setresuid{creds.uids[:3]} failed: {os.strerror(-res)}")
    remote.syscall("setfsuid", creds.uids[3])
    return warnings
