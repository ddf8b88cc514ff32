"""timerfd fds: the clock, the remaining time, interval and unread ticks, and the timer again.

Dump half (:func:`dump`, through resources.anonfds.dump_anon_fd), from its fdinfo and a
copy of the fd (pidfd_getfd), which shares the target's open file description:

timerfd: clock and settime flags from fdinfo; the remaining time and the interval from
timerfd_gettime(2) on the copy. gettime first brings an expired periodic timer up to date
(the kernel adds the missed periods to its ticks, as a read would count them), so the
``ticks`` line read after it is every expiration not yet read. The pair is read twice and
kept only when no expiration fell in between.

Restore half (:func:`make`, through resources.anonfds.create_anon_fd), with the
status flags (O_NONBLOCK ...) of the recorded description:

timerfd on its clock, re-armed with its remaining time counted from now (relative timers:
the time the tree spent checkpointed does not count) or at its absolute expiry
(TFD_TIMER_ABSTIME), with its interval; unread expirations are set back with the
TFD_IOC_SET_TICKS ioctl (CONFIG_CHECKPOINT_RESTORE; it refuses 0);

Limits: a timer cancelled by a clock change (TFD_TIMER_CANCEL_ON_SET, ECANCELED pending) comes
back merely armed; an absolute CLOCK_MONOTONIC / BOOTTIME expiry is kept as a number,
meaningful on the same boot only.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import os
import struct
import time

from .. import procfs
from ..errors import PtckptError
from ..formats.model import FdKind, TimerfdState
from .fdstate import O_CLOEXEC, O_NONBLOCK, FdKindOps, Target, check, closing_on_error, copy_of, field, proto, set_status_flags

TFD_NONBLOCK = O_NONBLOCK
TFD_CLOEXEC = O_CLOEXEC
TFD_TIMER_ABSTIME = 1
TFD_TIMER_CANCEL_ON_SET = 2
TFD_IOC_SET_TICKS = 0x40085400      # _IOW('T', 0, __u64)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_c_int = ctypes.c_int
_timerfd_create = proto("timerfd_create", _c_int, _c_int, _c_int)
_timerfd_settime = proto("timerfd_settime", _c_int, _c_int, _c_int,
                         ctypes.POINTER(_Itimerspec), ctypes.POINTER(_Itimerspec))
_timerfd_gettime = proto("timerfd_gettime", _c_int, _c_int, ctypes.POINTER(_Itimerspec))


# --- dump half -----------------------------------------------------------------

def dump(t: Target, info: procfs.FdInfo) -> TimerfdState:
    clockid = int(field(t, info, "clockid"))
    settime_flags = int(field(t, info, "settime flags"), 8)
    with copy_of(t) as copy:
        spec, ticks, now = _timer_snapshot(t, copy, clockid)
    value = _ns(spec.it_value)
    return TimerfdState(clockid=clockid, flags=info.flags & TFD_NONBLOCK,
                        settime_flags=settime_flags, value_ns=value,
                        interval_ns=_ns(spec.it_interval) if value else 0,
                        ticks=ticks, expires_ns=now + value if value else 0)


def _timer_snapshot(t: Target, copy: int, clockid: int) -> tuple[_Itimerspec, int, int]:
    """(timerfd_gettime, ticks, clock now) read with no expiration in between.

    Every expiration adds to the ticks, so equal ticks before and after the
    gettime mean the remaining time and the ticks describe the same moment.
    """
    before = _ticks(copy)
    for _ in range(10):
        spec = _Itimerspec()
        check(_timerfd_gettime(copy, ctypes.byref(spec)), "timerfd_gettime")
        now = time.clock_gettime_ns(clockid)
        after = _ticks(copy)
        if after == before:
            return spec, after, now
        before = after
    raise PtckptError(f"process {t.pid} fd {t.fd} ({t.link}): the timer expires too often "
                      f"to be read consistently")


def _ticks(copy: int) -> int:
    values = procfs.read_fdinfo(os.getpid(), copy).extra.get("ticks")
    if not values:
        raise OSError(_errno.ENOTSUP, "fdinfo has no 'ticks' line")
    return int(values[0])


def _ns(ts: _Timespec) -> int:
    return ts.tv_sec * 1_000_000_000 + ts.tv_nsec


# --- restore half --------------------------------------------------------------

def make(state: TimerfdState, flags: int) -> int:
    fd = check(_timerfd_create(state.clockid, TFD_CLOEXEC | TFD_NONBLOCK), "timerfd_create")
    with closing_on_error(fd):
        if state.armed:
            absolute = bool(state.settime_flags & TFD_TIMER_ABSTIME)
            value = state.expires_ns if absolute else state.value_ns
            spec = _Itimerspec(_timespec(state.interval_ns), _timespec(value))
            check(_timerfd_settime(fd, state.settime_flags, ctypes.byref(spec), None),
                   "timerfd_settime")
        if state.ticks:
            # settime cleared the ticks; the ioctl sets them (and refuses 0).
            fcntl.ioctl(fd, TFD_IOC_SET_TICKS, struct.pack("Q", state.ticks))
        set_status_flags(fd, flags)
    return fd


def _timespec(ns: int) -> _Timespec:
    return _Timespec(ns // 1_000_000_000, ns % 1_000_000_000)


def describe(state: TimerfdState) -> str:
    return f"timerfd (clock {state.clockid})"


KIND = FdKindOps(FdKind.TIMERFD, TimerfdState, dump, make, describe)
