"""epoll instances: which fds each watches, for which events, with which data word.

Dump half: :func:`dump_epoll` reads the "tfd:" lines of /proc/PID/fdinfo/N
(fs/eventpoll.c, ep_show_fdinfo): the target fd number in the process that
registered it, the event mask (EPOLLET, EPOLLONESHOT ... included) and the data.

Restore half: the epoll instance itself is made in ptckpt (epoll_create1) and
handed to the stubs like any shared description; its registrations are made
again *inside* a process that holds it (:func:`restore_targets_frozen`), after
that process's fds are in place, because an epoll item is keyed by the
(file, fd number) pair of the registering process: EPOLL_CTL_MOD/DEL of the
program must find it under its own fd numbers.

Not kept: events already pending in the ready list (they are found again by
the next epoll_wait for level-triggered items; an edge already reported
but not yet collected is lost), and a target registered through an fd the
process has closed since (then the tfd number names nothing or another file:
refused at dump).
"""

from __future__ import annotations

import os
import select
import struct
from collections.abc import Sequence

from .. import procfs
from ..errors import UnsupportedResource
from ..formats.model import EpollState, EpollTarget

EPOLL_CTL_ADD = 1
_EVENT = struct.Struct("<IQ")        # struct epoll_event is packed on x86_64: 12 bytes


def dump_epoll(pid: int, fd: int, open_fds: set[int]) -> EpollState:
    """The registrations of epoll fd `fd` of `pid`; `open_fds` are the fds the process has."""
    info = procfs.read_fdinfo(pid, fd)
    targets = []
    for line in info.extra.get("tfd", []):
        fields = line.split()
        try:
            tfd = int(fields[0])
            events = int(fields[fields.index("events:") + 1], 16)
            data = int(fields[fields.index("data:") + 1], 16)
        except (ValueError, IndexError):
            raise UnsupportedResource(pid, f"fd {fd} (epoll): an fdinfo line it cannot read: {line!r}") from None
        if tfd not in open_fds:
            raise UnsupportedResource(pid, f"fd {fd} (epoll) watches fd {tfd}, which the process has "
                                           f"closed since (registered through an fd no longer open)")
        targets.append(EpollTarget(tfd, events, data))
    return EpollState(targets=tuple(targets))


def create_epoll() -> int:
    """A new epoll instance in ptckpt (its registrations come later, inside a holder)."""
    ep = select.epoll()
    try:
        return os.dup(ep.fileno())          # one instance; ptckpt's handle on it is the dup
    finally:
        ep.close()


def restore_targets_frozen(remote, epfd: int, targets: Sequence[EpollTarget]) -> None:
    """EPOLL_CTL_ADD each target again, from inside the restored process, at its fd numbers."""
    for t in targets:
        with remote.scratch(_EVENT.pack(t.events & 0xFFFFFFFF, t.data)) as ev:
            remote.checked("epoll_ctl", epfd, EPOLL_CTL_ADD, t.tfd, int(ev),
                           step=f"epoll fd {epfd}: watch fd {t.tfd} (events {t.events:#x})")
