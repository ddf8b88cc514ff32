"""Unix sockets held inside a tree: their names, connections and queued data.

Dump half: :func:`dump_unix_sockets` reads each AF_UNIX socket of the tree
through sock_diag (:mod:`ptckpt.sockdiag`: type, state, bound name, peer,
backlog, shutdown, pending connections) and copies its receive queue without
consuming it (MSG_PEEK with SO_PEEK_OFF on a pidfd_getfd copy).  A socket whose
peer lives outside the tree, or that an outside socket is connected to (or waits
to be accepted by), is refused naming both ends.  A bound path is compared with
the socket's file (UNIX_DIAG_VFS): the file's mode and owner are kept, or the
name is marked deleted when the path was unlinked or names another file now.  A
relative name keeps the directory it was bound in (the socket file's path, through
SIOCUNIXFILE): the binder may have moved to another cwd since.

Connections waiting in a listener's accept queue become pending records, in queue
order.  What their clients sent waits in the server ends, which no fd reaches: when
a client sent something or closed, the dump accepts them all on its copy of the
listener to peek at it (the dump's last step; a leave-running dump is refused then,
since an accepted connection cannot be put back).

Restore half: :func:`create_unix_sockets` makes them again in ptckpt, before
any stub exists: listeners bound and listening; a connected pair with no
names as a socketpair; an accepted connection by connecting a fresh client to
the listener of its name (a stand-in listener when the original was closed)
and accepting it, so both ends keep their names; then the pending connections,
their clients (a stand-in, closed again, for one that had closed) connecting
and sending what they had sent; datagram sockets bound and connected by name.
Then every queue is refilled from the other end (or sent to the socket's name),
and shutdowns are applied.  A deleted name is bound at its path (what is there
now moved aside meanwhile, and its directories made again for the while when they are
gone too), its socket file then moved to a name of ptckpt's, which connections to that
socket use (several sockets may have had the name), and unlinked once every connection
by name is made.
The stubs inherit the sockets and dup3() them into place (restore.build_handoff).

Fds in flight (SCM_RIGHTS): :func:`peek_queues_frozen` peeks at every queue once,
before the tree's fds are numbered, keeping the fds the peeks pass (copies in ptckpt;
the queue is left as it was, so a leave-running dump is exact).  Those files are
numbered and dumped with the tree's as if ptckpt held them (pipes with their bytes,
unix sockets with their own queues, files by path and offset, deleted files), and
recorded as IN_FLIGHT_FD; each queue item names the descriptions it carries
(UnixSocket.queue_fds).  The restore opens them with the tree's and sends each item
with its fds again.  Other kinds in flight (epoll, eventfd, inet sockets ...) are
refused by name.  In a stream, a peek cannot tell where the skb that carries fds
begins: bytes queued without fds just before it come back in one piece with it (a
reader then gets the fds with its first read of those bytes).

Socket options (SO_PASSCRED, SO_PASSSEC, buffer sizes ...: :mod:`.sockopts`) are set
again once the connections are made and the queues refilled.  Queued messages that
carry their sender's credentials (SCM_CREDENTIALS) for a reader with SO_PASSCRED on
keep them (UnixSocket.queue_creds, pids as the tree sees them): the kernel takes
only a live pid in SCM_CREDENTIALS, so those queues are filled once the tree's
processes exist (:class:`QueuedCredentials`); a sender outside the tree is refused.

Not kept: the sender address of each queued datagram; the credentials of messages
queued for a reader without SO_PASSCRED (it would see them if it turned it on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import select
import socket
import stat as _stat
from collections.abc import Mapping, Sequence

from .. import procfs, sockdiag
from ..errors import RestoreFailed, SharedOutside, UnsupportedResource
from ..formats.model import Fd, FdKind, InFlightFd, UnixSocket
from ..tracee import pidfd_getfd
from . import sockopts
from .files import dump_fd, is_unix

TCP_ESTABLISHED, TCP_CLOSE, TCP_LISTEN = 1, 7, 10
RCV_SHUTDOWN, SEND_SHUTDOWN = 1, 2
O_ACCMODE = 0o3


# --- dump half -----------------------------------------------------------------

IN_FLIGHT_KINDS = frozenset({FdKind.REGULAR, FdKind.DIRECTORY, FdKind.CHARDEV, FdKind.PIPE,
                             FdKind.FIFO})      # and unix sockets


@dataclasses.dataclass
class InFlight:
    """What the tree's unix sockets hold queued, peeked once while it is frozen, with the
    fds in flight (SCM_RIGHTS) that the peeks installed in ptckpt (this process, `holder`):
    `fds` describes them as ptckpt's own fds, to be numbered with the tree's."""

    queues: dict[int, sockdiag.QueueSnapshot] = dataclasses.field(default_factory=dict)
    fds: list[Fd] = dataclasses.field(default_factory=list)
    carrier: dict[int, tuple[int, Fd]] = dataclasses.field(default_factory=dict)  # fd -> socket
    holder: int = dataclasses.field(default_factory=os.getpid)

    def close(self) -> None:
        for snap in self.queues.values():
            for passed in snap.passed:
                for fd in passed:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        self.queues.clear()

    def records(self) -> list[InFlightFd]:
        return [InFlightFd(f) for f in self.fds]

    def without(self, external: set[int]) -> "InFlight":
        """The fds in flight but those carried (maybe through other fds in flight) by the
        sockets of inodes `external` (claimed by a plugin: not this dump's to take)."""
        def root(n: int) -> Fd:
            pid, carrier = self.carrier[n]
            return root(carrier.fd) if pid == self.holder else carrier
        kept = [f for f in self.fds if root(f.fd).ino not in external]
        return dataclasses.replace(self, fds=kept) if len(kept) != len(self.fds) else self


def peek_queues_frozen(fds: Mapping[int, Sequence[Fd]], root: int) -> InFlight:
    """Peek at the queue of every unix socket of the frozen tree (but the root's stdio),
    keeping the fds in flight; those that are unix sockets are peeked at too."""
    out = InFlight()
    todo = [(pid, f) for pid, flist in fds.items() for f in flist
            if is_unix(f) and not (pid == root and f.fd <= 2)]
    try:
        while todo:
            pid, f = todo.pop(0)
            if f.ino in out.queues:
                continue
            copy = pidfd_getfd(pid, f.fd) if pid != out.holder else os.dup(f.fd)
            try:
                snap = out.queues[f.ino] = sockdiag.snapshot_queue(copy, keep_fds=True)
            finally:
                os.close(copy)
            for n in (n for passed in snap.passed for n in passed):
                g = dump_fd(out.holder, n)
                out.fds.append(g)
                out.carrier[n] = (pid, f)
                if is_unix(g):
                    todo.append((out.holder, g))
    except BaseException:
        out.close()
        raise
    return out


def refuse_in_flight(flight: InFlight) -> None:
    """An fd in flight of a kind a restore cannot pass again is refused, naming the socket
    that carries it (and, for one carried by an fd in flight itself, the first socket)."""
    for f in flight.fds:
        if f.kind in IN_FLIGHT_KINDS or is_unix(f):
            continue
        pid, carrier = flight.carrier[f.fd]
        while pid == flight.holder:
            pid, carrier = flight.carrier[carrier.fd]
        raise UnsupportedResource(pid, f"{_kind_name(f)} {f.path} in flight (SCM_RIGHTS) in fd "
                                       f"{carrier.fd} ({carrier.path})")


def _kind_name(f: Fd) -> str:
    if f.kind is FdKind.SOCKET:
        return f"a {dict(f.details).get('family', 'socket')} socket"
    return f.kind.name.lower()


def dump_unix_sockets(fds: Mapping[int, Sequence[Fd]], skip: set[int],
                      leave_running: bool = False, flight: InFlight | None = None,
                      external: bool = False) -> list[UnixSocket]:
    """A UnixSocket for every AF_UNIX socket the tree holds (descriptions in `skip` are the
    root's stdio, which a restore takes from ptckpt restore instead), and a pending one for
    each connection waiting in the accept queue of one of its listeners.  `flight` holds
    the queues peeked already (peek_queues_frozen), and the numbered fds in flight."""
    holders: dict[int, tuple[int, Fd]] = {}
    for pid, flist in fds.items():
        for f in flist:
            if is_unix(f) and f.desc not in skip:
                holders.setdefault(f.ino, (pid, f))
    if not holders:
        return []
    diag = sockdiag.unix_sockets()
    members = set(fds)
    _refuse_outside(holders, diag, members, external)
    names = {d.name: d.ino for d in diag.values() if d.listening and d.name}
    flight = flight or InFlight()
    desc_of = {f.fd: f.desc for f in flight.fds}
    out: list[UnixSocket] = []
    embryo_of: dict[int, int] = {}                # pending client inode -> its embryo's number
    for ino, (pid, f) in holders.items():
        d = diag.get(ino)
        if d is not None and d.listening and d.icons:
            pending = _take_pending(pid, f, d, holders, diag, leave_running, PENDING_BASE + len(out))
            embryo_of.update({e.peer: e.ino for e in pending if e.peer})
            out += pending
    for ino, (pid, f) in holders.items():
        d = diag.get(ino)
        if d is None:
            raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}): a unix socket sock_diag does not list")
        peer = diag.get(d.peer)
        queue, passed, creds = _queue(pid, f, flight, members)
        out.append(UnixSocket(
            ino=ino, type=d.type, state=d.state, name=d.name or b"",
            peer=d.peer if d.peer in holders else embryo_of.get(ino, 0),
            peer_name=(peer.name or b"") if peer else b"",
            backlog=d.wqueue if d.listening else 0,
            shutdown=d.shutdown,
            queue=() if d.listening else queue,
            listener=names.get(d.name, 0) if d.name and not d.listening and d.peer else 0,
            options=_options(pid, f),
            queue_fds=tuple(tuple(desc_of[n] for n in p) for p in passed) if any(passed) else (),
            queue_creds=() if d.listening else creds,
            **_socket_file(pid, d, _name_dir(pid, f, d)),
        ))
    return out


PENDING_BASE = 1 << 62          # numbers of pending connections (their server end has no inode)


def _take_pending(pid: int, f: Fd, d, holders: Mapping, diag: Mapping, leave_running: bool,
                  first: int) -> list[UnixSocket]:
    """The connections waiting in listener `d`'s accept queue, in queue order (PENDING
    records).  What a client sent waits in the server end, which no fd reaches: when a
    client sent something (its SIOCOUTQ counts it) or has closed (it may have), the
    queue is read by accepting every connection on ptckpt's copy of the listener, which a
    leave-running dump cannot undo (refused)."""
    clients = [diag.get(c) if c else None for c in d.icons]
    queues: list[tuple[bytes, ...]] = [()] * len(clients)
    if any(c is None or c.wqueue for c in clients):
        if leave_running:
            raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}, listening on {_show(d.name)}) with "
                                           f"{len(clients)} connections not yet accepted whose clients "
                                           f"sent data or closed", why="a leave-running dump cannot read "
                                           "them without accepting them", way_out="dump with --kill")
        queues = _accept_all(pid, f, len(clients))
    return [UnixSocket(ino=first + n, type=d.type, state=TCP_ESTABLISHED, name=d.name or b"",
                       peer=c.ino if c is not None and c.ino in holders else 0,
                       peer_name=(c.name or b"") if c is not None else b"", backlog=0, shutdown=0,
                       queue=q, listener=d.ino, pending=True)
            for n, (c, q) in enumerate(zip(clients, queues))]


def _accept_all(pid: int, f: Fd, count: int) -> list[tuple[bytes, ...]]:
    """Accept `count` connections on a copy of the listener (frozen target: they are all
    queued) and peek what each holds; the accepted sockets are closed again."""
    copy = pidfd_getfd(pid, f.fd)
    out = []
    try:
        with socket.socket(fileno=os.dup(copy)) as listener:
            for _ in range(count):
                ready = select.select([listener], [], [], 0)[0]
                if not ready:
                    raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}): a pending connection "
                                                   f"went away while the tree was frozen")
                child, _addr = listener.accept()
                with child:
                    snap = sockdiag.snapshot_queue(child)     # it inherits the listener's SO_PASSCRED
                    _refuse_credentials(pid, f, snap)
                    out.append(tuple(sockdiag.peek_queue(child)))
    finally:
        os.close(copy)
    return out


def _socket_file(pid: int, d, name_dir: str = "") -> dict:
    """A bound path's socket file: its mode and owner, or deleted=True when the path names
    another file now, or none (unlinked); and name_dir, the directory a relative name was
    bound in, when it is known."""
    if not d.path:
        return {}
    where = {"name_dir": name_dir} if name_dir else {}
    base = os.fsencode(name_dir) if name_dir else f"/proc/{pid}/cwd".encode()
    path = d.path if d.path.startswith(b"/") else os.path.join(base, d.path)
    try:
        st = os.lstat(path)
    except OSError:
        return {"deleted": True, **where}
    if (st.st_dev, st.st_ino) != (d.vfs_dev, d.vfs_ino):
        return {"deleted": True, **where}
    return {"file_mode": st.st_mode, "file_uid": st.st_uid, "file_gid": st.st_gid, **where}


SIOCUNIXFILE = 0x89E0           # an O_PATH fd on a unix socket's file (CAP_NET_ADMIN)


def _name_dir(pid: int, f: Fd, d) -> str:
    """The directory a relative name was bound in: the socket file's path (SIOCUNIXFILE;
    ' (deleted)' when unlinked) less the name.  The binder's cwd may be another one by now
    (it chdir()ed after bind) and its /proc cwd would mislead.  "" for an absolute or no
    name, or when the kernel does not tell (then a restore takes the holder's cwd)."""
    if not d.path or d.path.startswith(b"/"):
        return ""
    copy = pidfd_getfd(pid, f.fd)
    try:
        with socket.socket(fileno=os.dup(copy)) as sock:
            file = fcntl.ioctl(sock.fileno(), SIOCUNIXFILE)
    except OSError:
        return ""
    finally:
        os.close(copy)
    try:
        link = os.fsencode(procfs.readlink_fd(os.getpid(), file))
    except (OSError, procfs.FdGone):
        return ""
    finally:
        os.close(file)
    link = link.removesuffix(b" (deleted)")
    tail = b"/" + os.path.normpath(d.path).lstrip(b"/")
    if not link.endswith(tail):
        return ""
    return os.fsdecode(link[:-len(tail)] or b"/")


def _refuse_outside(holders: dict[int, tuple[int, Fd]], diag: dict, members: set[int],
                    external: bool = False) -> None:
    """A connection that leaves the tree, in either direction, cannot be rebuilt from it;
    nor can one waiting to be accepted by a listener on the other side.  With `external`
    (--ext-unix-sk), a datagram socket connected to a socket outside bound to a path is
    connected to that path again at restore: the connection is one way, its peer is found
    by name."""
    for ino, (pid, f) in holders.items():
        d = diag.get(ino)
        if d is not None and d.peer and d.peer not in holders:
            by_name = external_peer(d, diag.get(d.peer))
            if external and by_name:
                continue
            hint = " (or --ext-unix-sk, to connect it to its name again at restore)" if by_name else ""
            raise SharedOutside(pid, f.fd, f.path, f"its peer socket:[{d.peer}]"
                                f"{_named(diag.get(d.peer))} is {_holder(d.peer, members)}{hint}")
        for c in d.icons if d is not None and d.listening else ():
            if c and c not in holders:
                raise SharedOutside(pid, f.fd, f.path, f"socket:[{c}]{_named(diag.get(c))} waits to be "
                                    f"accepted by it (pending connection) and is {_holder(c, members)}")
    for d in diag.values():
        if d.peer in holders and d.ino not in holders:
            pid, f = holders[d.peer]
            raise SharedOutside(pid, f.fd, f.path, f"socket:[{d.ino}]{_named(d)} is connected to it "
                                f"from {_holder(d.ino, members)}")
        if d.listening and d.ino not in holders:
            for c in d.icons:
                if c in holders:
                    pid, f = holders[c]
                    raise SharedOutside(pid, f.fd, f.path, f"it waits to be accepted by socket:[{d.ino}]"
                                        f"{_named(d)}, {_holder(d.ino, members)}")


def external_peer(d, peer) -> bool:
    """A datagram socket connected one way to a socket bound to a path, which a restore can
    connect to again by name (--ext-unix-sk)."""
    return (d.type == socket.SOCK_DGRAM and peer is not None and peer.peer != d.ino
            and _is_path(peer.name or b""))


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


def _queue(pid: int, f: Fd, flight: InFlight, members: set[int]) -> tuple[tuple[bytes, ...], tuple, tuple]:
    """The receive queue of a socket, the fds in flight with each item, and the senders'
    credentials its reader gets with each: from the peek of peek_queues_frozen, else
    peeked now (refused if fds ride in it)."""
    snap = flight.queues.get(f.ino)
    if snap is None:
        copy = pidfd_getfd(pid, f.fd)
        try:
            return tuple(sockdiag.peek_queue(copy)), (), ()
        finally:
            os.close(copy)
    if snap.oob is not None:
        raise sockdiag.SocketQueueError("peek of a socket receive queue",
                                        "an out-of-band (MSG_OOB) byte is pending; not supported")
    return snap.messages, snap.passed, _credentials(pid, f, snap, members)


def _credentials(pid: int, f: Fd, snap: sockdiag.QueueSnapshot, members: set[int]) -> tuple:
    """The (pid, uid, gid) the reader of a socket with SO_PASSCRED on gets with each queued
    message, () when it gets none.  A restore sends them again with the message, which the
    kernel allows only for a live pid: a sender outside the tree (gone since, most likely)
    is refused by name."""
    if not snap.passcred or not any(snap.item_creds):
        return ()
    for n, creds in enumerate(snap.item_creds):
        if creds is None and snap.messages[n]:
            raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}, SO_PASSCRED on) with a queued message "
                                           f"without its sender's credentials (sent before SO_PASSCRED "
                                           f"was on)", why="a restore cannot queue it again",
                                      way_out="let it read its queue first")
        if creds is not None and creds[0] not in members:
            cpid, uid, gid = creds
            raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}, SO_PASSCRED on) with queued messages "
                                           f"carrying the credentials of pid {cpid} (uid {uid} gid {gid}), "
                                           f"not a process of the tree", why="a restore can queue them again "
                                           "only with a live sender's pid", way_out="dump the sender's tree "
                                           "too, or let it read its queue first")
    return tuple(c or (0, 0, 0) for c in snap.item_creds)


def _refuse_credentials(pid: int, f: Fd, snap: sockdiag.QueueSnapshot) -> None:
    """Messages waiting in a connection not yet accepted whose sender's credentials their
    reader gets (SO_PASSCRED on): the accept queue is filled before the tree's processes
    exist, so they are refused."""
    if snap.passcred and snap.creds:
        cpid, uid, gid = snap.creds[0]
        raise UnsupportedResource(pid, f"fd {f.fd} ({f.path}, SO_PASSCRED on) has a connection not yet "
                                       f"accepted with {len(snap.creds)} queued messages carrying their "
                                       f"sender's credentials (SCM_CREDENTIALS pid {cpid} uid {uid} "
                                       f"gid {gid}), which a restore cannot queue again; let it accept "
                                       f"and read them first")


# --- restore half --------------------------------------------------------------

class QueuedCredentials:
    """Receive queues whose messages carry their senders' credentials (SCM_CREDENTIALS, for
    a reader with SO_PASSCRED on).  The kernel takes only a live pid there, so they are
    filled once the tree's processes exist (:meth:`fill`, given the pids they got), and
    their sockets and the senders' are shut down and given their options only then.  It
    holds its own copies of those sockets and of the fds the messages pass."""

    def __init__(self) -> None:
        self.queues: list[tuple[UnixSocket, socket.socket, list[list[int]]]] = []
        self.ends: dict[int, tuple[UnixSocket, socket.socket]] = {}

    def __bool__(self) -> bool:
        return bool(self.queues)

    def add(self, r: UnixSocket, sender: socket.socket, fds: list[list[int]]) -> None:
        self.queues.append((r, _copy(sender), [[os.dup(n) for n in item] for item in fds]))

    def end(self, r: UnixSocket, s: socket.socket) -> None:
        """r's shutdown and options wait until its queue (or its peer's) is filled."""
        self.ends[r.ino] = (r, _copy(s))

    def fill(self, real: Mapping[int, int]) -> None:
        """Send every queue with its credentials, the tree's pids as `real` ({image pid:
        pid now}) gives them; then the shutdowns and options."""
        try:
            for r, sender, fds in self.queues:
                creds = [None if not c[0] else (_sender_pid(r, c[0], real), c[1], c[2]) for c in r.queue_creds]
                _call(f"refill the queue of socket:[{r.ino}] with its senders' credentials",
                      sockdiag.send_queue, sender, list(r.queue), r.type, fds, None, creds)
            for r, s in self.ends.values():
                _shutdown(s, r.shutdown)
                _call("set its options", sockopts.apply_options, s, r.options)
        finally:
            self.close()

    def close(self) -> None:
        for _r, s, fds in self.queues:
            s.close()
            for n in (n for item in fds for n in item):
                os.close(n)
        for _r, s in self.ends.values():
            s.close()
        self.queues, self.ends = [], {}


def _copy(s: socket.socket) -> socket.socket:
    return socket.socket(fileno=os.dup(s.fileno()))


def _sender_pid(r: UnixSocket, pid: int, real: Mapping[int, int]) -> int:
    if pid not in real:
        raise RestoreFailed(f"unix socket: socket:[{r.ino}] has messages from pid {pid}, which the "
                            f"restore did not make")
    return real[pid]


def queue_sender(r: UnixSocket, by_ino: Mapping[int, UnixSocket]) -> str | None:
    """What sends r's receive queue again at restore: "peer" (its peer, made too), "name" (a
    datagram socket's messages, sent to its name), "stand-in" (a socket whose peer had closed:
    made as one end of a pair whose other end sends, then goes), None (nothing can).
    A queue no socket of the image sends that way is refused (:func:`unsendable_queues`)."""
    peer = by_ino.get(r.peer)
    if r.state == TCP_LISTEN:
        return None
    if peer is not None and (peer.peer == r.ino or r.type != socket.SOCK_DGRAM):
        return "peer"
    if r.type == socket.SOCK_DGRAM:
        if r.name:
            return "name"
        # A datagram socket whose peer (a socketpair's other end, maybe) was closed; its own
        # connection, if any, went with it: the messages still there come from a stand-in.
        return "stand-in" if not r.peer_name and (peer is None or not r.peer) else None
    return "stand-in" if r.state == TCP_ESTABLISHED and peer is None else None


def unsendable_queues(records: Sequence[UnixSocket]) -> list[UnixSocket]:
    """The image's unix sockets whose queued messages no restore could send again."""
    by_ino = {r.ino: r for r in records}
    return [r for r in records if r.queue and not r.pending and queue_sender(r, by_ino) is None]


def create_unix_sockets(records: Sequence[UnixSocket], descs: Mapping[int, Fd],
                        cwd_of: Mapping[int, str] | None = None,
                        passing: Mapping[int, int] | None = None,
                        later: QueuedCredentials | None = None) -> dict[int, int]:
    """Make the image's unix sockets in ptckpt: {desc: fd}, one fd per description in `descs`
    (their Fd.ino names the socket).  `cwd_of` maps a socket inode to the directory a
    relative name was bound in.  `passing` has ptckpt's fd of every other description
    ({desc: fd}) a queue may carry in flight.  Queues with their senders' credentials go
    to `later`, to be filled when the tree exists.  The caller owns the fds."""
    by_ino = {r.ino: r for r in records}
    credited = {r.ino for r in records if r.queue_creds and any(c[0] for c in r.queue_creds)}
    if credited and later is None:
        raise RestoreFailed(f"unix socket: socket:[{min(credited)}] has messages with their "
                            f"senders' credentials, and nothing to fill its queue once they exist")
    cwd_of = cwd_of or {}
    made: dict[int, socket.socket] = {}
    temps: list[socket.socket] = []
    refilled: set[int] = set()
    senders: dict[int, socket.socket] = {}        # a socket whose peer had closed: its stand-in

    def fd_of(desc: int) -> int:
        if passing and desc in passing:
            return passing[desc]
        if desc in descs and descs[desc].ino in made:
            return made[descs[desc].ino].fileno()
        raise RestoreFailed(f"unix socket: a description in flight (desc {desc}) was not made")
    names = _Names(cwd_of, {r.ino: r.name_dir for r in records if r.name_dir})
    try:
        listeners = _make_listeners(records, made, names)
        _make_connected(records, by_ino, listeners, made, senders, temps, names)
        for e in (r for r in records if r.pending):  # accept queues, in queue order
            _queue_connection(e, by_ino.get(e.peer), made, names, temps)
            refilled.add(e.ino)
        for r in records:                            # datagram connections, by name (in the tree or not)
            if r.type == socket.SOCK_DGRAM and r.peer_name:
                names.connect(made[r.ino], r.peer_name, r.peer if r.peer in by_ino else 0, holder=r.ino)
        waits = _refill_queues(records, by_ino, made, senders, refilled, credited, later, fd_of, names, temps)
        for r in records:
            if r.ino in made and r.ino in waits:
                later.end(r, made[r.ino])
            elif r.ino in made:
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
        for s in temps:                              # stand-ins and closed clients go first
            s.close()
        names.unlink_deleted()
        for s in made.values():
            s.close()


def _make_listeners(records: Sequence[UnixSocket], made: dict, names: "_Names") -> dict[bytes, socket.socket]:
    """The listening sockets (the deleted names last), into `made`; {name: listener}."""
    listeners: dict[bytes, socket.socket] = {}
    for r in sorted((r for r in records if r.state == TCP_LISTEN), key=lambda r: r.deleted):
        made[r.ino] = _new(r, names)
        made[r.ino].listen(max(r.backlog, 1))
        listeners[r.name] = made[r.ino]
    return listeners


def _make_connected(records: Sequence[UnixSocket], by_ino: dict, listeners: dict, made: dict,
                    senders: dict, temps: list, names: "_Names") -> None:
    """Every other socket but the clients still in an accept queue, into `made`: a pair for
    two unnamed peers, a pair with a stand-in (in `senders` and `temps`) for one whose peer
    had closed, a socket of its own for a datagram or unconnected one, else a connection
    accepted from its listener."""
    waiting = {r.peer for r in records if r.pending}      # clients not yet accepted
    for r in records:
        if r.ino in made or r.pending or r.ino in waiting:
            continue
        peer = by_ino.get(r.peer)
        if peer is not None and peer.peer == r.ino and not (r.name or peer.name):
            made[r.ino], made[peer.ino] = socket.socketpair(socket.AF_UNIX, r.type)
        elif queue_sender(r, by_ino) == "stand-in" and (r.queue or r.type != socket.SOCK_DGRAM):
            # Its peer was closed: a pair whose other end goes away again after the refill.
            made[r.ino], other = socket.socketpair(socket.AF_UNIX, r.type)
            temps.append(other)
            senders[r.ino] = other
        elif r.type == socket.SOCK_DGRAM or r.state != TCP_ESTABLISHED:
            made[r.ino] = _new(r, names)
        else:
            made.update(_accepted_pair(r, peer, listeners, temps, names))


def _refill_queues(records: Sequence[UnixSocket], by_ino: dict, made: dict, senders: dict,
                   refilled: set[int], credited: set[int], later: QueuedCredentials | None,
                   fd_of, names: "_Names", temps: list) -> set[int]:
    """The queued messages sent again from each socket's sender, but those with their
    senders' credentials, which go to `later`; the sockets whose shutdown and options wait
    for those."""
    waits: set[int] = set()
    for r in records:
        if r.ino not in refilled and r.queue:
            mutual = queue_sender(r, by_ino) == "peer"
            sender = senders.get(r.ino) or (made[r.peer] if mutual else None)
            if r.ino in credited:
                later.add(r, _credited_sender(r, sender, names, temps), [[fd_of(d) for d in item]
                                                                  for item in r.queue_fds])
                waits |= {r.ino, r.peer if mutual else 0}
            else:
                _refill(r, sender, fd_of, names)
    return waits


def _queue_connection(e: UnixSocket, client: UnixSocket | None, made: dict, names: "_Names",
                      temps: list) -> None:
    """A connection waiting in the accept queue of listener e.listener: its client end
    connects (a stand-in, closed again, when the client had closed) and sends what the
    client had sent, so that accept() returns it with that data."""
    listener = made.get(e.listener)
    if listener is None:
        raise RestoreFailed(f"unix socket: a pending connection of socket:[{e.listener}], which the "
                            f"image does not hold")
    if client is not None:
        c = made[client.ino] = _new(client, names)
    else:
        c = socket.socket(socket.AF_UNIX, e.type)
        temps.append(c)
    names.connect(c, e.name, e.listener, "(a connection not yet accepted)")
    if e.queue:
        sockdiag.send_queue(c, list(e.queue), e.type)


def _accepted_pair(a: UnixSocket, b: UnixSocket, listeners: dict, temps: list,
                   names: "_Names") -> dict[int, socket.socket]:
    """Both ends of a connection made through a listener: the accepted end carries the
    listener's name.  A client connects to a listener of that name (the image's own, or a
    stand-in when it was closed) and the listener accepts: both ends keep their names."""
    server, client = (a, b) if a.listener or (a.name and not b.listener and not b.name) else (b, a)
    listener = listeners.get(server.name)
    if listener is None:
        listener = _new(dataclasses.replace(server, state=TCP_LISTEN), names)
        listener.listen(1)
        temps.append(listener)
    c = _new(client, names)
    try:
        names.connect(c, server.name, server.ino if listener in temps else server.listener or server.ino)
        s, _ = listener.accept()
    except BaseException:
        c.close()
        raise
    return {client.ino: c, server.ino: s}


def _new(r: UnixSocket, names: "_Names") -> socket.socket:
    s = socket.socket(socket.AF_UNIX, r.type)
    if r.name:
        try:
            names.bind(s, r)
        except BaseException:
            s.close()
            raise
    return s


class _Names:
    """Binds the image's socket names, and takes the deleted ones away again.

    A relative name is bound (and connected to) from the directory it was bound in
    (`name_dir`: socket inode -> directory, from the dump; else `cwd_of`: socket inode ->
    its holder's cwd).  A name whose file had been unlinked or replaced before the dump is
    bound at its path all the same, so that getsockname() gives it back, whatever holds
    that path now being moved aside for the while, and the directories it needs that are
    gone made for the while; once every connection by name is made,
    :meth:`unlink_deleted` removes those files and directories and puts back what was
    there, the last bound first."""

    def __init__(self, cwd_of: Mapping[int, str], name_dir: Mapping[int, str] | None = None):
        self.cwd_of = cwd_of
        self.name_dir = name_dir or {}
        self.socket_files: dict[int, str] = {}             # a deleted name's socket: its file now
        self.made_dirs: list[str] = []                     # directories made for deleted names

    def _cwd(self, name: bytes, ino: int, holder: int = 0) -> str | None:
        if not _is_path(name) or name.startswith(b"/"):
            return None
        return self.name_dir.get(ino) or self.cwd_of.get(ino) or self.cwd_of.get(holder)

    def target(self, name: bytes, ino: int, holder: int = 0) -> tuple[str | None, str | bytes]:
        """(directory to be in, address) that reaches socket `ino`, bound to `name`: a deleted
        name's socket file where it waits (several sockets may have had one name), else the
        name from the directory it was bound in (`ino` 0: a socket outside the tree; a
        relative name is then taken from the cwd of the holder of socket `holder`)."""
        if ino in self.socket_files:
            path = self.socket_files[ino]
            return os.path.dirname(path), os.path.basename(path)
        return self._cwd(name, ino, holder), _addr(name)

    def connect(self, s: socket.socket, name: bytes, ino: int, why: str = "", holder: int = 0) -> None:
        """Connect `s` to `name`, bound by socket `ino` (see target)."""
        where, addr = self.target(name, ino, holder)
        with _in_directory(where):
            _call(f"connect to {_show(name)}{' ' + why if why else ''}", s.connect, addr)

    def bind(self, s: socket.socket, r: UnixSocket) -> None:
        where = self._cwd(r.name, r.ino)
        if r.deleted and _is_path(r.name):
            self._make_dirs(os.path.dirname(os.path.join(where or os.getcwd(), os.fsdecode(r.name))))
        with _in_directory(where):
            if not _is_path(r.name):
                _call(f"bind to {_show(r.name)}", s.bind, _addr(r.name))
            elif r.deleted:
                self._bind_deleted(s, r.name, r.ino)
            else:
                _bind(s, r.name)
                if r.file_mode:
                    _call(f"set the mode of {_show(r.name)}", os.chmod, r.name, r.file_mode & 0o7777)
                    with contextlib.suppress(OSError):
                        os.chown(r.name, r.file_uid, r.file_gid)

    def _bind_deleted(self, s: socket.socket, name: bytes, ino: int) -> None:
        """Bind to a deleted name, then move its socket file away to a name of ptckpt's (in
        socket_files, where connections find it: the name may be another socket's too, or
        the file now there) and put back what was at the path."""
        path = os.path.abspath(os.fsdecode(name))
        n = len(self.socket_files)
        aside = None
        if os.path.lexists(path):
            aside = os.path.join(os.path.dirname(path), f".ptckpt-aside-{os.getpid()}-{n}")
            _call(f"move {path} aside to bind the deleted name {_show(name)}", os.rename, path, aside)
        try:
            _call(f"bind to the deleted name {_show(name)}", s.bind, _addr(name))
            kept = os.path.join(os.path.dirname(path), f".ptckpt-sock-{os.getpid()}-{n}")
            try:
                _call(f"move the socket file of the deleted name {_show(name)}", os.rename, path, kept)
            except BaseException:
                os.unlink(path)
                raise
        finally:
            if aside is not None:
                os.rename(aside, path)
        self.socket_files[ino] = kept

    def _make_dirs(self, path: str) -> None:
        """The directories down to `path` that are gone (a deleted name's directory may have
        been removed after it), made for the while; unlink_deleted removes them again."""
        path = os.path.abspath(path)
        if os.path.isdir(path):
            return
        self._make_dirs(os.path.dirname(path))
        _call(f"make the directory {path} (gone) for a deleted socket name", os.mkdir, path, 0o700)
        self.made_dirs.append(path)

    def unlink_deleted(self) -> None:
        for path in self.socket_files.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.socket_files.clear()
        while self.made_dirs:
            with contextlib.suppress(OSError):
                os.rmdir(self.made_dirs.pop())


def _bind(s: socket.socket, name: bytes) -> None:
    """Bind to the image's name.  A path still holding the dead original's socket file is
    unlinked first (one a live socket is bound to is refused)."""
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


def _refill(r: UnixSocket, sender: socket.socket | None, fd_of, names: "_Names") -> None:
    """Put r's receive queue back: sent by its peer, or (a datagram socket) to its name;
    with the fds in flight beside each item (fd_of: desc -> ptckpt's fd)."""
    fds = [[fd_of(d) for d in item] for item in r.queue_fds]
    if sender is None and r.type == socket.SOCK_DGRAM and r.name:
        where, addr = names.target(r.name, r.ino)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s, _in_directory(where):
            _call(f"refill the queue of {_show(r.name)}", sockdiag.send_queue, s, list(r.queue),
                  socket.SOCK_DGRAM, fds, addr)
        return
    if sender is None:
        raise RestoreFailed(f"socket:[{r.ino}] has {len(r.queue)} queued messages and no end to "
                            f"send them from")
    sockdiag.send_queue(sender, list(r.queue), r.type, fds)


def _credited_sender(r: UnixSocket, sender: socket.socket | None, names: "_Names",
                     temps: list) -> socket.socket:
    """What sends r's queue with credentials later: its peer (or a stand-in), or for a
    datagram socket without one, a socket connected to its name now (which may be a
    deleted one, gone again by then)."""
    if sender is not None:
        return sender
    if r.type != socket.SOCK_DGRAM or not r.name:
        raise RestoreFailed(f"socket:[{r.ino}] has {len(r.queue)} queued messages and no end to "
                            f"send them from")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    temps.append(s)
    names.connect(s, r.name, r.ino, "(to queue its messages again)")
    return s


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
