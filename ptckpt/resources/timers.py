"""Timers of a process: POSIX timers (timer_create) and interval timers (setitimer).

Dump half: :func:`dump_timers_frozen` lists the POSIX timers from /proc/PID/timers (id,
signal and sigev_value, how they notify and whom, clock: man 5 proc) and asks the
process, by injection, what only it can tell: the interval and the time left
(timer_gettime) and the overrun count (timer_getoverrun); the three interval timers
(getitimer: REAL, VIRTUAL, PROF).

Restore half: :func:`restore_timers_frozen` makes every POSIX timer again with its own
id -- prctl(PR_TIMER_CREATE_RESTORE_IDS) makes timer_create take the id it is given
(Linux 6.13+; a kernel without it refuses the restore of a process with timers, by
name) -- with its clock, signal, value and target thread, and arms it with the time it
had left and its interval; then the interval timers.  The time the process spent
checkpointed does not count (as for its sleeps).  The overrun count of a timer is not
settable: it starts again from 0.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

from .. import procfs
from ..errors import RestoreFailed, UnsupportedResource
from ..formats.model import Itimer, PosixTimer
from ..tracee import RemoteSyscalls

PR_TIMER_CREATE_RESTORE_IDS = 77
SIGEV_SIGNAL, SIGEV_NONE, SIGEV_THREAD, SIGEV_THREAD_ID = 0, 1, 2, 4
_NOTIFY = {"signal": SIGEV_SIGNAL, "none": SIGEV_NONE, "thread": SIGEV_THREAD}
_ITIMERSPEC = struct.Struct("<qqqq")      # struct itimerspec: interval, value (timespec each)
_ITIMERVAL = struct.Struct("<qqqq")       # struct itimerval: interval, value (timeval each)
_SIGEVENT = struct.Struct("<QiiI")        # sigev_value, sigev_signo, sigev_notify, _tid (of 64 bytes)
ITIMER_NAMES = {0: "ITIMER_REAL", 1: "ITIMER_VIRTUAL", 2: "ITIMER_PROF"}
_NS, _US = 1_000_000_000, 1_000_000


def read_proc_timers(pid: int, procfs_root: str = "/proc") -> list[tuple[int, int, int, int, int, int]]:
    """(id, signo, sigev_value, notify, target tid or 0, clockid) per POSIX timer of `pid`,
    from /proc/PID/timers (fs/proc/base.c show_timer)::

        ID: 1
        signal: 14/0000000000000007
        notify: signal/tid.946
        ClockID: 0
    """
    try:
        text = procfs.read_timers(pid, procfs=procfs_root)
    except procfs.GONE_OR_MISSING:
        return []
    out, cur = [], {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        cur[key.strip()] = value.strip()
        if key.strip() == "ClockID":
            signo, _, sival = cur["signal"].partition("/")
            how, _, target = cur["notify"].partition("/")
            kind, _, who = target.partition(".")
            notify = _NOTIFY.get(how, SIGEV_SIGNAL) | (SIGEV_THREAD_ID if kind == "tid" else 0)
            out.append((int(cur["ID"]), int(signo), int(sival, 16), notify,
                        int(who) if kind == "tid" else 0, int(cur["ClockID"])))
            cur = {}
    return out


def dump_timers_frozen(pid: int, remote: RemoteSyscalls) -> tuple[list[PosixTimer], list[Itimer]]:
    timers = []
    with remote.scratch(_ITIMERSPEC.size) as spec:
        for tid_, signo, sival, notify, target, clockid in read_proc_timers(pid):
            remote.checked("timer_gettime", tid_, int(spec), step=f"read POSIX timer {tid_}")
            isec, insec, vsec, vnsec = _ITIMERSPEC.unpack(remote.mem.read(spec, _ITIMERSPEC.size))
            overrun = remote.checked("timer_getoverrun", tid_, step=f"read POSIX timer {tid_}")
            timers.append(PosixTimer(id=tid_, clockid=clockid, signo=signo, notify=notify, tid=target,
                                     value=sival, interval_ns=isec * _NS + insec, left_ns=vsec * _NS + vnsec,
                                     overrun=overrun))
    itimers = []
    with remote.scratch(_ITIMERVAL.size) as val:
        for which in ITIMER_NAMES:
            remote.checked("getitimer", which, int(val), step=f"read {ITIMER_NAMES[which]}")
            isec, iusec, vsec, vusec = _ITIMERVAL.unpack(remote.mem.read(val, _ITIMERVAL.size))
            if vsec or vusec or isec or iusec:
                itimers.append(Itimer(which=which, interval_us=isec * _US + iusec, left_us=vsec * _US + vusec))
    return timers, itimers


def check_dumpable(pid: int, timers: Sequence[PosixTimer], tids: Iterable[int]) -> None:
    """A timer signalling a thread that is not in the process cannot be made again."""
    tids = set(tids)
    for t in timers:
        if t.notify & SIGEV_THREAD_ID and t.tid not in tids:
            raise UnsupportedResource(pid, f"POSIX timer {t.id} signalling thread {t.tid}, which is not "
                                           f"one of its threads")


def restore_timers_frozen(remote: RemoteSyscalls, timers: Sequence[PosixTimer], itimers: Sequence[Itimer]) -> None:
    """The process's POSIX timers with their ids (its threads exist by now), then its interval
    timers; all armed with the time they had left."""
    if timers:
        if remote.syscall("prctl", PR_TIMER_CREATE_RESTORE_IDS, 1, 0, 0, 0) < 0:
            raise RestoreFailed(f"process {remote.task.tgid} has {len(timers)} POSIX timers and this kernel "
                                f"cannot give them their ids again (PR_TIMER_CREATE_RESTORE_IDS, Linux 6.13+)")
        try:
            for t in sorted(timers, key=lambda t: t.id):
                _create(remote, t)
        finally:
            remote.syscall("prctl", PR_TIMER_CREATE_RESTORE_IDS, 0, 0, 0, 0)
    with remote.scratch(_ITIMERVAL.size) as val:
        for it in itimers:
            remote.mem.write(val, _ITIMERVAL.pack(it.interval_us // _US, it.interval_us % _US,
                                                  it.left_us // _US, it.left_us % _US))
            remote.checked("setitimer", it.which, int(val), 0, step=f"restore {ITIMER_NAMES.get(it.which, it.which)}")


def _create(remote: RemoteSyscalls, t: PosixTimer) -> None:
    event = _SIGEVENT.pack(t.value, t.signo, t.notify, t.tid).ljust(64, b"\0")
    with remote.scratch(event) as sev, remote.scratch(struct.pack("<i", t.id)) as out:
        remote.checked("timer_create", t.clockid & 0xFFFFFFFF, int(sev), int(out),
                       step=f"create POSIX timer {t.id}")
        got = struct.unpack("<i", remote.mem.read(out, 4))[0]
    if got != t.id:
        raise RestoreFailed(f"POSIX timer {t.id} came back as {got}")
    if t.left_ns or t.interval_ns:
        spec = _ITIMERSPEC.pack(t.interval_ns // _NS, t.interval_ns % _NS,
                                max(t.left_ns, 1) // _NS, max(t.left_ns, 1) % _NS)
        with remote.scratch(spec) as buf:
            remote.checked("timer_settime", t.id, 0, int(buf), 0, step=f"arm POSIX timer {t.id}")
