"""The process itself: identity and relations, credentials, rlimits, mm fields.

Dump half: :func:`dump_task`, :func:`dump_creds`, :func:`dump_rlimits`,
:func:`dump_mm_frozen` (brk and dumpable come from inside, by injection).
"""

from __future__ import annotations

import contextlib
import time

from .. import procfs
from ..formats.model import Creds, Mm, Rlimit, Task
from ..tracee import RemoteSyscalls

PR_GET_DUMPABLE = 3


def dump_task(pid: int, tids: list[int], remote: RemoteSyscalls | None = None) -> Task:
    status = procfs.read_status(pid)
    st = procfs.read_stat(pid)
    dumpable = 1
    if remote is not None:
        dumpable = remote.checked("prctl", PR_GET_DUMPABLE, step="dump task")
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
    )


def dump_creds(pid: int) -> Creds:
    s = procfs.read_status(pid)
    return Creds(
        uids=tuple(s.uids), gids=tuple(s.gids), groups=tuple(s.groups),
        cap_inh=s.cap_inh, cap_prm=s.cap_prm, cap_eff=s.cap_eff,
        cap_bnd=s.cap_bnd, cap_amb=s.cap_amb,
        no_new_privs=s.no_new_privs, seccomp=s.seccomp,
    )


def dump_rlimits(pid: int) -> list[Rlimit]:
    return [Rlimit(r.resource, r.cur, r.max) for r in procfs.read_limits(pid)]


def dump_mm_frozen(pid: int, remote: RemoteSyscalls) -> Mm:
    """mm_struct fields: /proc/PID/stat gives all but brk, which brk(0) returns from inside."""
    st = procfs.read_stat(pid)
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
