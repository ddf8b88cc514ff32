"""eventfd, timerfd, signalfd, inotify, fanotify, memfd and mqueue fds: the registry of their kinds.

Each kind is one module of resources/ holding its dump half and its restore half side by
side (CRIU's one file per kind), and naming them in its ``KIND`` row (an
:class:`~.fdstate.FdKindOps`: the FdKind, the image record, ``dump(target, fdinfo)``,
``make(state, flags)``, ``describe(state)``).  This module lists the rows, one per kind,
and dispatches through them (resources.registry's "fd states" row).  Adding a kind: its
module, one row in :data:`KINDS` here, and one row in ptckpt/kinds.py.

Dump half: :func:`dump_anon_fd` reads the state of one such fd of a frozen target into a
frozen dataclass (one per kind, :data:`AnonFdState`), from the fd's fdinfo lines and a
copy of the fd (pidfd_getfd), which shares the target's open file description, so nothing
is done through it that the target could notice afterwards.

Restore half: :func:`create_anon_fd` makes an equivalent object in ptckpt and returns its
fd (close-on-exec; the caller installs it), with the status flags (O_NONBLOCK ...) of the
recorded description.  What each kind keeps, and what the kernel does not let it see or
set, is told by its module.
"""

from __future__ import annotations

from typing import Union

from .. import procfs
from ..errors import RestoreFailed, UnsupportedResource
from ..formats.model import (EventfdState, FanotifyState, FdKind, InotifyState, InotifyWatch, MemfdState,
                             MqueueState, SignalfdState, TimerfdState)
from . import eventfd, fanotify, inotify, memfd, mqueue, signalfd, timerfd
from .fdstate import FdKindOps, Target, fs_type, reading
from .fhandles import file_handle, open_file_handle

# The public names of the kinds' modules, as this module had them before the split.
from .eventfd import EFD_SEMAPHORE
from .inotify import IN_EXCL_UNLINK, IN_ONESHOT, deleted_watches_unheld, drain_inotify
from .fanotify import mark_fanotify
from .memfd import F_GET_SEALS, F_SEAL_GROW, F_SEAL_WRITE, reopen_memfd
from .mqueue import is_mqueue
from .timerfd import TFD_TIMER_ABSTIME

__all__ = ["ANON_FD_KINDS", "AnonFdState", "KINDS", "create_anon_fd", "deleted_watches_unheld", "describe",
           "drain_inotify", "dump_anon_fd", "file_handle", "fs_type", "is_mqueue", "mark_fanotify",
           "open_file_handle", "reopen_memfd", "EFD_SEMAPHORE", "F_GET_SEALS", "F_SEAL_GROW", "F_SEAL_WRITE",
           "IN_EXCL_UNLINK", "IN_ONESHOT", "TFD_TIMER_ABSTIME", "EventfdState", "FanotifyState",
           "InotifyState", "InotifyWatch", "MemfdState", "MqueueState", "SignalfdState", "TimerfdState"]

# One row per kind.
KINDS: tuple[FdKindOps, ...] = (
    eventfd.KIND,
    timerfd.KIND,
    signalfd.KIND,
    inotify.KIND,
    memfd.KIND,
    mqueue.KIND,
    fanotify.KIND,
)

_BY_KIND = {row.kind: row for row in KINDS}
_BY_STATE = {row.state: row for row in KINDS}

# EventfdState ... MqueueState are image records: formats/model.py.
AnonFdState = Union[EventfdState, TimerfdState, SignalfdState, InotifyState, MemfdState,
                    MqueueState, FanotifyState]

ANON_FD_KINDS = frozenset(_BY_KIND)


def dump_anon_fd(pid: int, fd: int, kind: FdKind) -> AnonFdState:
    """The state of fd `fd` of the frozen process `pid`, a `kind` of :data:`ANON_FD_KINDS`.

    Raises UnsupportedResource for a state that cannot be captured faithfully,
    PtckptError when reading it fails; both name the fd.
    """
    row = _BY_KIND.get(kind)
    if row is None:
        raise UnsupportedResource(pid, f"fd {fd} ({kind.name.lower()}) as an anonymous-fd kind")
    link = procfs.readlink_fd(pid, fd)
    info = procfs.read_fdinfo(pid, fd)
    with reading(pid, fd, link):
        return row.dump(Target(pid, fd, link), info)


def create_anon_fd(state: AnonFdState, flags: int, ghosts: dict | None = None) -> int:
    """Make the object of `state` in ptckpt: its fd (close-on-exec; the caller owns it).

    `flags` are the open flags of the recorded description: the access mode
    (memfd, mqueue) and the status flags such as O_NONBLOCK are set from them.
    `ghosts` gives the path of each deleted file made again ({("ghost", dev, ino): path}),
    where an inotify watch on a deleted file is put (the caller unlinks it afterwards,
    and once the tree is rebuilt reads away the events the restore queued:
    :func:`drain_inotify`).
    Raises RestoreFailed naming the object.
    """
    row = _BY_STATE.get(type(state))
    if row is None:
        raise TypeError(f"not an anonymous-fd state: {state!r}")
    try:
        if row.takes_ghosts:
            return row.make(state, flags, ghosts or {})
        return row.make(state, flags)
    except OSError as err:
        raise RestoreFailed(f"cannot recreate {describe(state)}: {err.strerror or err}") from None


def describe(state: AnonFdState) -> str:
    """A short name of the object for messages: 'eventfd (count 5)', 'mqueue /q' ..."""
    return _BY_STATE[type(state)].describe(state)
