"""Unix sockets held inside a tree: their names, connections and queued data.

Dump half: :func:`dump_unix_sockets` reads each AF_UNIX socket of the tree
through sock_diag (:mod:`ptckpt.sockdiag`: type, state, bound name, peer,
backlog, shutdown) and copies its receive queue without consuming it (MSG_PEEK
with SO_PEEK_OFF on a pidfd_getfd copy).  A socket whose peer lives outside the
tree, or that an outside socket is connected to, is refused naming both ends;
so is a listener with connections not yet accepted.

Restore half: :func:`create_unix_sockets` makes them again in ptckpt, before
any stub exists: listeners bound and listening; a connected pair with no
names as a socketpair; an accepted connection by connecting a fresh client to
the listener of its name (a stand-in listener when the original was closed)
and accepting it, so both ends keep their names; datagram sockets bound and
connected by name.  Then every queue is refilled from the other end (or sent
to the socket's name), and shutdowns are applied.  The stubs inherit the
sockets and dup3() them into place (restore.build_handoff).

Socket options (SO_PASSCRED, SO_PASSSEC, buffer sizes ...: :mod:`.sockopts`) are set
again once the connections are made.

Not kept: the sender address of each queued datagram, fds in flight
(refused by sock_diag.peek), the owner and mode of a bound socket file (ptckpt
binds it again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import socket
import stat as _stat
from collections.abc import Mapping, Sequence

from .. import procfs, sockdiag
from ..errors import RestoreFailed, SharedOutside, UnsupportedResource
from ..formats.model import Fd, UnixSocket
from ..tracee import pidfd_getfd
from . import sockopts
from .files import is_unix

TCP_ESTABLISHED, TCP_CLOSE, TCP_LISTEN = 1, 7, 10
RCV_SHUTDOWN, SEND_SHUTDOWN = 1, 2
O_ACCMODE = 0o3


# --- dump half -----------------------------------------------------------------

def dump_unix_sockets(fds: Mapping[int, Sequence[Fd]], skip: set[int]) -> list[UnixSocket]:
    """A UnixSocket for every AF_UNIX socket the tree holds (descriptions in `skip` are the
    root's stdio, which a restore takes from ptckpt restore instead)."""
    holders: dict[int, tuple[int, Fd]] = {}
    for pid, flist in fds.items():
        for f in flist:
            if is_unix(f) and f.desc not in skip:
                holders.setdefault(f.ino, (pid, f))
    if not holders:
        return []
    diag = sockdiag.unix_sockets()
    members = set(fds)
    _refuse_outside(holders, diag, members)
    names = {d.name: d.ino for d in diag.values() if d.listening and d.name}
    out = []
    for ino, (pid, f) in holders.items():
        d = diag.get(ino)
        if d is None:
            raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}): a unix socket sock_diag does not list")
        if d.listening and d.icons:
            raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}, listening on {_show(d.name)}) with "
                                           f"{len(d.icons)} connections not yet accepted")
        peer = diag.get(d.peer)
        out.append(UnixSocket(
            ino=ino, type=d.type, state=d.state, name=d.name or b"",
            peer=d.peer if d.peer in holders else 0,
            peer_name=(peer.name or b"") if peer else b"",
            backlog=d.wqueue if d.listening else 0,
            shutdown=d.shutdown,
            queue=() if d.listening else tuple(_peek(pid, f)),
            listener=names.get(d.name, 0) if d.name and not d.listening and d.peer else 0,
            options=_options(pid, f),
        ))
    return out


def _refuse_outside(holders: dict[int, tuple[int, Fd]], diag: dict, members: set[int]) -> None:
    """A connection that leaves the tree, in either direction, cannot be rebuilt from it."""
    for ino, (pid, f) in holders.items():
        d = diag.get(ino)
        if d is not None and d.peer and d.peer not in holders:
            raise SharedOutside(pid, f.fd, f.path, f"its peer socket:[{d.peer}]"
                                f"{_named(diag.get(d.peer))} is {_holder(d.peer, members)}")
    for d in diag.values():
        if d.peer in holders and d.ino not in holders:
            pid, f = holders[d.peer]
            raise SharedOutside(pid, f.fd, f.path, f"socket:[{d.ino}]{_named(d)} is connected to it "
                                f"from {_holder(d.ino, members)}")


def _holder(ino: int, members: set[int]) -> str:
    found = procfs.fd_holders({f"socket:[{ino}]"}, members | {os.getpid()})
    for pid, fd in next(iter(found.values()), []):
        return f"held by pid {pid} fd {fd} ({procfs.comm_or_unknown(pid)}), outside the tree"
    return "held by no process of the tree"



def _named(d) -> str:
    return f" ({_show(d.name)})" if d is not None and d.name else ""


def _show(name: bytes | None) -> str:
    if not name:
        return "unnamed"
    return "@" + name[1:].decode(errors="replace") if name[:1] == b"\0" else name.decode(errors="replace")


def _options(pid: int, f: Fd) -> tuple:
    copy = pidfd_getfd(pid, f.fd)
    with socket.socket(fileno=copy) as sock:
        return sockopts.read_options(sock)


def _peek(pid: int, f: Fd) -> list[bytes]:
    copy = pidfd_getfd(pid, f.fd)
    try:
        return sockdiag.peek_queue(copy)
    finally:
        os.close(copy)


# --- restore half --------------------------------------------------------------

def create_unix_sockets(records: Sequence[UnixSocket], descs: Mapping[int, Fd],
                        cwd_of: Mapping[int, str] | None = None) -> dict[int, int]:
    """Make the image's unix sockets in ptckpt: {desc: fd}, one fd per description in `descs`
    (their Fd.ino names the socket).  `cwd_of` maps a socket inode to the directory a
    relative name was bound in.  The caller owns the fds."""
    by_ino = {r.ino: r for r in records}
    cwd_of = cwd_of or {}
    made: dict[int, socket.socket] = {}
    temps: list[socket.socket] = []
    refilled: set[int] = set()
    try:
        listeners: dict[bytes, socket.socket] = {}
        for r in records:
            if r.state == TCP_LISTEN:
                made[r.ino] = _new(r, cwd_of.get(r.ino))
                made[r.ino].listen(max(r.backlog, 1))
                listeners[r.name] = made[r.ino]
        for r in records:
            if r.ino in made:
                continue
            peer = by_ino.get(r.peer)
            if peer is not None and peer.peer == r.ino and not (r.name or peer.name):
                made[r.ino], made[peer.ino] = socket.socketpair(socket.AF_UNIX, r.type)
            elif r.type == socket.SOCK_DGRAM or r.state != TCP_ESTABLISHED:
                made[r.ino] = _new(r, cwd_of.get(r.ino))
            elif peer is not None:
                made.update(_accepted_pair(r, peer, listeners, temps, cwd_of))
            else:
                # Its peer was closed: a pair whose other end goes away again after the refill.
                made[r.ino], other = socket.socketpair(socket.AF_UNIX, r.type)
                temps.append(other)
                _refill(r, other)
                refilled.add(r.ino)
        for r in records:                            # datagram connections, by name
            if r.type == socket.SOCK_DGRAM and r.peer and r.peer_name:
                _call(f"connect to {_show(r.peer_name)}", made[r.ino].connect, _addr(r.peer_name))
        for r in records:
            if r.ino not in refilled:
                peer = by_ino.get(r.peer)
                mutual = peer is not None and (peer.peer == r.ino or r.type != socket.SOCK_DGRAM)
                _refill(r, made[r.peer] if mutual else None)
        for r in records:
            _shutdown(made[r.ino], r.shutdown)
            _call("set its options", sockopts.apply_options, made[r.ino], r.options)
        out: dict[int, int] = {}
        for d, f in descs.items():
            s = made.get(f.ino)
            if s is not None:
                out[d] = os.dup(s.fileno())
                fcntl.fcntl(out[d], fcntl.F_SETFL, f.flags & ~O_ACCMODE)
        return out
    finally:
        for s in list(made.values()) + temps:
            s.close()


def _accepted_pair(a: UnixSocket, b: UnixSocket, listeners: dict, temps: list,
                   cwd_of: Mapping[int, str]) -> dict[int, socket.socket]:
    """Both ends of a connection made through a listener: the accepted end carries the
    listener's name.  A client connects to a listener of that name (the image's own, or a
    stand-in when it was closed) and the listener accepts: both ends keep their names."""
    server, client = (a, b) if a.listener or (a.name and not b.listener and not b.name) else (b, a)
    listener = listeners.get(server.name)
    if listener is None:
        listener = _new(dataclasses.replace(server, state=TCP_LISTEN), cwd_of.get(server.ino))
        listener.listen(1)
        temps.append(listener)
    c = _new(client, cwd_of.get(client.ino))
    try:
        _call(f"connect to {_show(server.name)}", c.connect, _addr(server.name))
        s, _ = listener.accept()
    except BaseException:
        c.close()
        raise
    return {client.ino: c, server.ino: s}


def _new(r: UnixSocket, cwd: str | None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, r.type)
    if r.name:
        try:
            _bind(s, r.name, cwd)
        except BaseException:
            s.close()
            raise
    return s


def _bind(s: socket.socket, name: bytes, cwd: str | None) -> None:
    """Bind to the image's name.  A path still holding the dead original's socket file is
    unlinked first (one a live socket is bound to is refused); a relative name is bound
    from the directory it was bound in."""
    with _in_directory(cwd if _is_path(name) and not name.startswith(b"/") else None):
        if _is_path(name):
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(name)
                if _stat.S_ISSOCK(st.st_mode):
                    if any(d.vfs_ino == st.st_ino and d.vfs_dev == st.st_dev
                           for d in sockdiag.unix_sockets().values()):
                        raise RestoreFailed(f"unix socket: {_show(name)} is bound by a live socket "
                                            f"(is the original still running?)")
                    os.unlink(name)           # the dead original's socket file
        _call(f"bind to {_show(name)}", s.bind, _addr(name))


@contextlib.contextmanager
def _in_directory(path: str | None):
    if path is None:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _is_path(name: bytes) -> bool:
    return bool(name) and name[:1] != b"\0"


def _addr(name: bytes):
    return name if name[:1] == b"\0" else os.fsdecode(name)


def _refill(r: UnixSocket, sender: socket.socket | None) -> None:
    """Put r's receive queue back: sent by its peer, or (a datagram socket) to its name."""
    if not r.queue:
        return
    if sender is None and r.type == socket.SOCK_DGRAM and r.name:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            for message in r.queue:
                _call(f"refill the queue of {_show(r.name)}", s.sendto, message, socket.MSG_DONTWAIT,
                      _addr(r.name))
        return
    if sender is None:
        raise RestoreFailed(f"socket:[{r.ino}] has {len(r.queue)} queued messages and no end to "
                            f"send them from")
    sockdiag.send_queue(sender, list(r.queue), r.type)


def _shutdown(s: socket.socket, how: int) -> None:
    if how & RCV_SHUTDOWN and how & SEND_SHUTDOWN:
        s.shutdown(socket.SHUT_RDWR)
    elif how & RCV_SHUTDOWN:
        s.shutdown(socket.SHUT_RD)
    elif how & SEND_SHUTDOWN:
        s.shutdown(socket.SHUT_WR)


def _call(what: str, fn, *args):
    try:
        return fn(*args)
    except OSError as err:
        raise RestoreFailed(f"unix socket: {what} failed: {err.strerror or err}") from None
