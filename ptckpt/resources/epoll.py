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

A target registered through an fd number the process has closed since (or
reused for another file) is still in the set as long as its file is open
elsewhere: fdinfo gives its number and inode, and kcmp(2) KCMP_EPOLL_TFD tells
which fd of the process holds that very file now (the `toff`-th item under one
number, counted in fdinfo's order, which is the kernel's).  The image records
that fd's description as the target's source, and the restore registers the
file under its old number the way the program did: the source is dup3()ed
onto the number (whatever is there set aside and put back), registered, and
the number closed again.  A file held by no fd of the process (only by another
process or a mapping) is refused at dump, by name.

Not kept: events already pending in the ready list (they are found again by
the next epoll_wait for level-triggered items; an edge already reported
but not yet collected is lost).
"""

from __future__ import annotations

import os
import select
import struct
from collections.abc import Sequence

from .. import procfs
from ..errors import RestoreFailed, UnsupportedResource
from ..formats.model import EpollState, EpollTarget, Fd
from ..tracee import epoll_holds

EPOLL_CTL_ADD = 1
F_DUPFD_CLOEXEC = 1030
O_CLOEXEC = 0o2000000
_EVENT = struct.Struct("<IQ")        # struct epoll_event is packed on x86_64: 12 bytes


def dump_epoll(pid: int, fd: int, fds: Sequence[Fd]) -> EpollState:
    """The registrations of epoll fd `fd` of `pid`; `fds` are the fds the process has
    (numbered: Fd.desc), to find the file of a target whose fd number was closed."""
    info = procfs.read_fdinfo(pid, fd)
    by_fd = {f.fd: f for f in fds}
    targets, sources, seen = [], [], {}
    for line in info.extra.get("tfd", []):
        fields = line.split()
        try:
            tfd = int(fields[0])
            events = int(fields[fields.index("events:") + 1], 16)
            data = int(fields[fields.index("data:") + 1], 16)
            ino = int(next(x for x in fields if x.startswith("ino:"))[4:], 16)
        except (ValueError, IndexError, StopIteration):
            raise UnsupportedResource(pid, f"fd {fd} (epoll): an fdinfo line it cannot read: {line!r}") from None
        toff = seen[tfd] = seen.get(tfd, -1) + 1
        targets.append(EpollTarget(tfd, events, data))
        if tfd in by_fd and epoll_holds(pid, tfd, pid, fd, tfd, toff):
            sources.append(0)
            continue
        holder = next((f for f in fds if f.ino == ino and epoll_holds(pid, f.fd, pid, fd, tfd, toff)), None)
        if holder is None:
            raise UnsupportedResource(pid, f"fd {fd} (epoll) watches a file (inode {ino}) registered as fd "
                                           f"{tfd}, which the process has closed since, and no fd of the "
                                           f"process holds that file now (another process or a mapping "
                                           f"does); keep an fd of it open in the process")
        sources.append(holder.desc)
    return EpollState(targets=tuple(targets), sources=tuple(sources) if any(sources) else ())


def create_epoll() -> int:
    """A new epoll instance in ptckpt (its registrations come later, inside a holder)."""
    ep = select.epoll()
    try:
        return os.dup(ep.fileno())          # one instance; ptckpt's handle on it is the dup
    finally:
        ep.close()


def restore_targets_frozen(remote, epfd: int, state: EpollState, fds: Sequence[Fd]) -> None:
    """EPOLL_CTL_ADD each target again, from inside the restored process, at its fd numbers;
    a target whose number was closed through the fd that holds its file now (`fds`: the
    process's fds, in place)."""
    fd_of = {f.desc: f.fd for f in fds if f.desc and not f.skipped}
    cloexec = {f.fd: f.cloexec for f in fds}
    sources = state.sources or (0,) * len(state.targets)
    for t, source in zip(state.targets, sources):
        step = f"epoll fd {epfd}: watch fd {t.tfd} (events {t.events:#x})"
        if not source:
            _add(remote, epfd, t, step)
            continue
        if source not in fd_of:
            raise RestoreFailed(f"{step}: the file it watched is held by no fd of this process")
        step += f" through fd {fd_of[source]}"
        spare = remote.syscall("fcntl", t.tfd, F_DUPFD_CLOEXEC, 0)     # what is at the number now
        spare = spare if spare >= 0 else None
        remote.checked("dup3", fd_of[source], t.tfd, 0, step=step)
        _add(remote, epfd, t, step)
        if spare is None:
            remote.checked("close", t.tfd, step=step)
        else:
            remote.checked("dup3", spare, t.tfd, O_CLOEXEC if cloexec.get(t.tfd) else 0, step=step)
            remote.checked("close", spare, step=step)


def _add(remote, epfd: int, t: EpollTarget, step: str) -> None:
    with remote.scratch(_EVENT.pack(t.events & 0xFFFFFFFF, t.data)) as ev:
        remote.checked("epoll_ctl", epfd, EPOLL_CTL_ADD, t.tfd, int(ev), step=step)
