"""eventfd fds: the counter and its mode, and the object again.

Dump half (:func:`dump`, through resources.anonfds.dump_anon_fd), from its fdinfo and a
copy of the fd (pidfd_getfd), which shares the target's open file description:

eventfd: ``eventfd-count`` (hex) and ``eventfd-semaphore`` (6.18 has it, older kernels do
not; without it the mode is unknown and the fd is refused).

Restore half (:func:`make`, through resources.anonfds.create_anon_fd), with the
status flags (O_NONBLOCK ...) of the recorded description:

eventfd with its count and EFD_SEMAPHORE;

Limits: the eventfd-id (a counter of the boot) is new.
"""

from __future__ import annotations

import errno as _errno
import os

from .. import procfs
from ..formats.model import EventfdState, FdKind
from .fdstate import O_CLOEXEC, O_NONBLOCK, FdKindOps, Target, closing_on_error, field, set_status_flags

EFD_SEMAPHORE = 1
EFD_NONBLOCK = O_NONBLOCK
EFD_CLOEXEC = O_CLOEXEC
_EVENTFD_MAX = 2**64 - 2


# --- dump half -----------------------------------------------------------------

def dump(t: Target, info: procfs.FdInfo) -> EventfdState:
    count = int(field(t, info, "eventfd-count"), 16)
    semaphore = int(field(t, info, "eventfd-semaphore"))
    return EventfdState(count=count,
                        flags=(EFD_SEMAPHORE if semaphore else 0) | (info.flags & EFD_NONBLOCK))


# --- restore half --------------------------------------------------------------

def make(state: EventfdState, flags: int) -> int:
    if not 0 <= state.count <= _EVENTFD_MAX:
        raise OSError(_errno.EINVAL, f"count {state.count} out of range")
    fd = os.eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | (state.flags & EFD_SEMAPHORE))
    with closing_on_error(fd):
        if state.count:
            os.eventfd_write(fd, state.count)     # the initial value of eventfd() is 32 bits
        set_status_flags(fd, flags)
    return fd


def describe(state: EventfdState) -> str:
    return f"eventfd (count {state.count})"


KIND = FdKindOps(FdKind.EVENTFD, EventfdState, dump, make, describe)
