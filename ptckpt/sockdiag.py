"""AF_UNIX sockets for checkpointing: sock_diag queries and receive queues (layer 2).

Three things live here:

* :func:`unix_sockets` asks NETLINK_SOCK_DIAG (SOCK_DIAG_BY_FAMILY, AF_UNIX,
  a dump over every state) for the sockets of our network namespace and
  parses the replies into :class:`UnixSock` records
  (include/uapi/linux/unix_diag.h, net/unix/diag.c);
* :func:`peek_queue` / :func:`snapshot_queue` read a socket's receive queue
  without consuming it (MSG_PEEK walked with SO_PEEK_OFF), on a copy of the
  target's fd (pidfd_getfd) while the target is stopped;
* :func:`send_queue` (restore side) refills the peer's receive queue.

Errors are translated at one choke point, :func:`_wrap_oserror`, which sits
on every public function:

* EPROTONOSUPPORT / EAFNOSUPPORT creating the netlink socket, ENOENT in the
  NLMSG_ERROR of the dump (no unix_diag handler: CONFIG_UNIX_DIAG off),
  EOPNOTSUPP / ENOPROTOOPT for SO_PEEK_OFF -> :class:`SockDiagUnavailable`
  (exit code MISSING_FEATURE)
* any other OSError -> :class:`SockDiagError`

:class:`SocketQueueError` (exit code UNSUPPORTED_RESOURCE) is raised directly
when a queue cannot be saved or refilled faithfully.  No bare OSError
leaves this module.

What the kernel does, as measured on Linux 6.18 (x86_64, root)
--------------------------------------------------------------

sock_diag (UNIX_DIAG_*):

* UNIX_DIAG_SHUTDOWN comes with every record: there is no UDIAG_SHOW_* bit
  for it.
* UNIX_DIAG_NAME is sun_path as bound: b"\\0..." for an abstract name (the
  NULs count), the path plus its NUL terminator for a bound path (stripped
  here).  The path is the one given to bind(): a relative one stays
  relative to the binder's cwd at the time.  vfs_dev/vfs_ino (UNIX_DIAG_VFS)
  are the socket file's st_dev/st_ino.  The kernel sends the internal dev_t
  (major << 20 | minor, so 0xfe00000 for 254:0), not the userspace encoding
  (0xfe00); it is converted here so that it compares equal to os.stat().
* An accepted server-side socket shows the listener's name and the
  listener's vfs_dev/vfs_ino, because it shares the listener's address.
  Name and vfs alone do not tell a listener from its connections;
  ``listening`` (state TCP_LISTEN) does.
* UNIX_DIAG_ICONS of a listener lists the CLIENT-side inodes of the pending
  (not yet accepted) connections, in connect order.  The server-side
  embryos have no inode until accept() grafts them onto a socket, and the
  dump skips inode-less sockets, so embryos never appear.  A pending
  client is TCP_ESTABLISHED with peer 0 (sock_i_ino of the embryo).  Only
  after accept() is its peer the accepted socket's inode.  Whatever a
  client sent before accept() waits in the embryo's queue: no fd reaches
  it, so it cannot be peeked.  The client's wqueue (its sk_wmem_alloc,
  e.g. 768 for a 5-byte send) is the only trace of it.
* A SOCK_DGRAM socket is TCP_CLOSE until connect(); connect() makes BOTH
  it and its target TCP_ESTABLISHED (unix_dgram_connect), though the target
  stays unconnected (peer 0).  ``peer`` is what tells a connected datagram
  socket; ``state`` does not.
* UNIX_DIAG_RQLEN: for a listener, (pending connections, listen backlog).
  Otherwise rqueue is SIOCINQ (unix_inq_len): the bytes queued for
  SOCK_STREAM and SOCK_SEQPACKET, but only the length of the FIRST datagram
  for SOCK_DGRAM.  wqueue is SIOCOUTQ, the sender's sk_wmem_alloc: the
  truesize of everything this socket sent that its peer has not read yet
  (memory, not bytes: about 2304 for a 1000-byte message).

SO_PEEK_OFF (socket option 42 on x86_64, SOL_SOCKET):

* Default -1 (disabled); any value, -1 included, can be set and read back.
* With it >= 0, MSG_PEEK starts that many bytes into the queue and moves it
  forward by the bytes copied: for SOCK_STREAM across skbs; for
  SOCK_DGRAM/SOCK_SEQPACKET by the copied part of one datagram, so a
  truncated peek (buffer too small, MSG_TRUNC) leaves the offset inside the
  datagram.  Here the offset is then set back and the peek repeated with a
  big enough buffer (MSG_TRUNC in the flags makes recvmsg return the full
  length).
* Zero-length datagrams (SOCK_DGRAM and SOCK_SEQPACKET both allow them) do
  not move the offset.  The kernel marks a zero-length skb "peeked" the
  first time any MSG_PEEK returns it (net/core/datagram.c), and an
  offset-based peek skips peeked zero-length skbs from then on.  So a walk
  sees each zero-length message once, and a second walk misses those the
  first one saw.  A plain MSG_PEEK (offset -1) always returns the head,
  peeked or not.  This module therefore peeks the head plainly first: a
  zero-length head message (maybe peeked by the target itself) is
  recorded, and the walk that follows skips it.  A zero-length message in
  the middle of the queue that was peeked before (by an earlier
  snapshot_queue, or by a target using SO_PEEK_OFF) cannot be seen; the
  data a reader gets later is unchanged either way.
* SOCK_SEQPACKET whose peer has closed or shut down (RCV_SHUTDOWN): a
  non-blocking recv at the end of the queue returns 0 instead of EAGAIN.
  That cannot be told from a zero-length message by its result or flags.
  SO_PASSCRED is therefore turned on during the walk (and put back): a
  queued message then always comes with SCM_CREDENTIALS, the end does not.
* A pending socket error (sk_err, e.g. ECONNRESET when the peer closed with
  unread data in its own queue) is returned, and cleared, by the first
  datagram peek.  For a stream socket it only comes once the queue is read
  to its end, so a stream is peeked only up to SIOCINQ bytes and its error
  stays pending.  A consumed error is retried past once and reported in
  QueueSnapshot.pending_error: userspace cannot put it back.
* File descriptors in flight (SCM_RIGHTS) are copied into the peeking
  process (unix_peek_fds).  They are closed again at once and counted, or
  kept for the caller (snapshot_queue(keep_fds=True)).  A stream peek stops
  after each skb that carries fds; and it passes the fds of the next skb that
  has any even when it copies no byte of it (a 1-byte peek of "ab" queued
  before "cd"+fds passes the fds), so no peek tells where that skb begins.
* SOCK_STREAM out-of-band data (MSG_OOB, CONFIG_AF_UNIX_OOB): an
  offset-based peek returns the urgent byte inline at its place, though a
  reader without SO_OOBINLINE never gets it inline.  Its presence is
  checked with MSG_OOB|MSG_PEEK (that does not consume it) and reported.
* Listening sockets have no data queue: peeking gives EINVAL (stream) or
  ENOTCONN (seqpacket); an unconnected seqpacket socket gives ENOTCONN.
  All of these give [].

Restore side (:func:`send_queue`):

* Queued unix skbs are charged to the SENDER's sk_wmem_alloc, so the
  sender's SO_SNDBUF bounds what a peer can have queued.  The receiver's
  SO_RCVBUF plays no part, even when forced to its minimum.  A datagram
  larger than SO_SNDBUF - 32 fails with EMSGSIZE.
* A datagram socket whose receiver is not connected back to it (a client of
  a bound server) also meets the receiver's queue length limit
  (net.unix.max_dgram_qlen + 1 = 11 messages by default, fixed when the
  receiving socket is created).  Socketpairs and mutually connected sockets
  have no such limit.
* send_queue grows SO_SNDBUF with SO_SNDBUFFORCE (CAP_NET_ADMIN; without it
  SO_SNDBUF, capped by net.core.wmem_max) while EAGAIN/EMSGSIZE stop it,
  and puts the original value back at the end.  Queued data stays when the
  buffer shrinks.
"""

from __future__ import annotations

import array
import contextlib
import errno as _errno
import fcntl
import os
import socket
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ptckpt.errors import ExitCode, OSErrorTranslator, PtckptError

# --- kernel constants ---------------------------------------------------------

NETLINK_SOCK_DIAG = 4               # include/uapi/linux/netlink.h
SOCK_DIAG_BY_FAMILY = 20            # include/uapi/linux/sock_diag.h

NLMSG_ERROR = 2                     # include/uapi/linux/netlink.h
NLMSG_DONE = 3
NLM_F_REQUEST = 0x01
NLM_F_MULTI = 0x02
NLM_F_DUMP_INTR = 0x10
NLM_F_ROOT = 0x100
NLM_F_MATCH = 0x200
NLM_F_DUMP = NLM_F_ROOT | NLM_F_MATCH

# include/uapi/linux/unix_diag.h
UDIAG_SHOW_NAME = 0x01
UDIAG_SHOW_VFS = 0x02
UDIAG_SHOW_PEER = 0x04
UDIAG_SHOW_ICONS = 0x08
UDIAG_SHOW_RQLEN = 0x10
UDIAG_SHOW_MEMINFO = 0x20
UDIAG_SHOW_UID = 0x40

UNIX_DIAG_NAME = 0
UNIX_DIAG_VFS = 1
UNIX_DIAG_PEER = 2
UNIX_DIAG_ICONS = 3
UNIX_DIAG_RQLEN = 4
UNIX_DIAG_MEMINFO = 5
UNIX_DIAG_SHUTDOWN = 6
UNIX_DIAG_UID = 7

# include/net/tcp_states.h: the states af_unix uses
TCP_ESTABLISHED = 1
TCP_CLOSE = 7
TCP_LISTEN = 10

# asm-generic/socket.h (x86_64)
SO_PEEK_OFF = 42
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33                 # not needed: unix queues ignore the receiver's SO_RCVBUF
SCM_PIDFD = 0x04                    # SO_PASSPIDFD's cmsg (6.5+): a pidfd, closed like fds

# asm-generic/ioctls.h, include/uapi/linux/sockios.h
SIOCINQ = 0x541B                    # FIONREAD
SIOCOUTQ = 0x5411                   # TIOCOUTQ

_SHOW_ALL = (UDIAG_SHOW_NAME | UDIAG_SHOW_VFS | UDIAG_SHOW_PEER | UDIAG_SHOW_ICONS
             | UDIAG_SHOW_RQLEN | UDIAG_SHOW_UID)
_ALL_STATES = 0xFFFFFFFF

_NLMSGHDR = struct.Struct("=IHHII")         # len, type, flags, seq, pid
_UNIX_DIAG_REQ = struct.Struct("=BBHIII2I") # family, protocol, pad, states, ino, show, cookie
_UNIX_DIAG_MSG = struct.Struct("=BBBBI2I")  # family, type, state, pad, ino, cookie
_NLATTR = struct.Struct("=HH")              # nla_len, nla_type
_NLMSGERR = struct.Struct("=i")             # struct nlmsgerr starts with int error
_U32 = struct.Struct("=I")
_TWO_U32 = struct.Struct("=II")
_INT = struct.Struct("=i")
_UCRED = struct.Struct("=iII")              # struct ucred: pid, uid, gid

_NL_BUFSIZE = 1 << 16       # netlink dump skbs are at most 32 KiB
_NL_TIMEOUT = 5.0           # seconds; a dump answers at once
_ANC_BUFSIZE = 8192         # 253 fds (SCM_MAX_FD) + creds + pidfd + a security label
_PEEK_BUFSIZE = 1 << 16     # first try for a datagram; grown on MSG_TRUNC
_STREAM_CHUNK = 1 << 20
_SNDBUF_MAX = (2**31 - 1) // 2   # SO_SNDBUFFORCE clamps to INT_MAX / 2 (then doubles)
_SNDBUF_GROWS = 8                # give up after that many grows without progress
_TRUESIZE_SLACK = 2048           # per-skb overhead estimate (1000 bytes cost 2304)


# --- errors of this layer -------------------------------------------------------

class SockDiagError(PtckptError):
    """A sock_diag query or a socket queue operation failed unexpectedly."""

    def __init__(self, what: str, reason: str, err: int | None = None):
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason
        self.errno = err


class SockDiagUnavailable(SockDiagError):
    """The kernel lacks a feature this module needs (unix_diag, SO_PEEK_OFF)."""

    exit_code = ExitCode.MISSING_FEATURE


class SocketQueueError(SockDiagError):
    """A socket queue cannot be saved or refilled faithfully."""

    exit_code = ExitCode.UNSUPPORTED_RESOURCE


# errnos that mean "this kernel cannot do it"; ENOENT only for the dump
# (sock_diag has no handler for AF_UNIX: unix_diag not built or not loadable)
_MISSING_ERRNOS = frozenset({_errno.EPROTONOSUPPORT, _errno.EAFNOSUPPORT,
                             _errno.EOPNOTSUPP, _errno.ENOPROTOOPT})
_MISSING_ERRNOS_DIAG = _MISSING_ERRNOS | {_errno.ENOENT}


_ERRORS = OSErrorTranslator(SockDiagError, SockDiagUnavailable, _MISSING_ERRNOS, "not supported by this kernel")
_translate = _ERRORS.translate
_wrap_oserror = _ERRORS.wrap


# --- records ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class UnixSock:
    """One AF_UNIX socket as sock_diag reports it (struct unix_diag_msg + attributes)."""

    ino: int                    # the socket inode ("socket:[ino]" in /proc/PID/fd)
    type: int                   # socket.SOCK_STREAM / SOCK_DGRAM / SOCK_SEQPACKET
    state: int                  # TCP_ESTABLISHED, TCP_LISTEN, TCP_CLOSE ...
    name: bytes | None          # b"\0..." abstract, path bytes (no NUL) bound, None unbound
    vfs_dev: int                # st_dev of a bound path's socket file (as os.stat), 0 if none
    vfs_ino: int                # st_ino of that file, 0 if none
    peer: int                   # peer socket inode, 0 if none
    icons: tuple[int, ...]      # listener: client-side inodes of pending connections
    rqueue: int                 # listener: pending connections; else SIOCINQ (see module doc)
    wqueue: int                 # listener: backlog; else SIOCOUTQ (sk_wmem_alloc)
    shutdown: int               # sk_shutdown: RCV_SHUTDOWN 1 | SEND_SHUTDOWN 2
    cookie: int = 0             # the socket cookie (SO_COOKIE), unique while it lives
    uid: int | None = None      # owner uid (UNIX_DIAG_UID, 5.3+)

    @property
    def listening(self) -> bool:
        """The socket is in TCP_LISTEN (listen() was called)."""
        return self.state == TCP_LISTEN

    @property
    def abstract(self) -> bool:
        """The socket has an abstract name (autobind names are abstract too)."""
        return self.name is not None and self.name.startswith(b"\0")

    @property
    def path(self) -> bytes | None:
        """The filesystem path it was bound to, or None (abstract or unbound)."""
        if self.name is None or self.abstract:
            return None
        return self.name


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    """Everything one non-consuming walk of a receive queue found."""

    type: int                             # SOCK_STREAM / SOCK_DGRAM / SOCK_SEQPACKET
    messages: tuple[bytes, ...]           # stream: at most one element, the whole byte stream
    senders: tuple[bytes | None, ...]     # dgram/seqpacket: sender sun_path per message
    fds: int                              # descriptors in flight (SCM_RIGHTS), seen and closed
    oob: bytes | None                     # stream: pending urgent byte (shown inline in messages)
    peek_off: int                         # the socket's SO_PEEK_OFF, left as it was
    pending_error: int                    # errno of a socket error the peek consumed, 0: none
    passed: tuple[tuple[int, ...], ...] = ()   # snapshot_queue(keep_fds=True): the fds in flight,
                                               # installed in this process, per message
    creds: tuple[tuple[int, int, int], ...] = ()   # (pid, uid, gid) queued messages carry, as
                                                   # far as the walk saw them (SO_PASSCRED on)
    passcred: bool = False                    # the socket's own SO_PASSCRED (its reader sees them)
    item_creds: tuple[tuple[int, int, int] | None, ...] = ()   # with passcred: per message (a
                                              # stream: per segment, which ends where they change)
                                              # the (pid, uid, gid) its reader gets, None: none

    @property
    def nbytes(self) -> int:
        """Total payload bytes queued."""
        return sum(len(m) for m in self.messages)


# --- sock_diag --------------------------------------------------------------------

def _dump_request(seq: int) -> bytes:
    """A netlink SOCK_DIAG_BY_FAMILY dump request for every AF_UNIX socket."""
    req = _UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, _ALL_STATES, 0, _SHOW_ALL,
                              0xFFFFFFFF, 0xFFFFFFFF)
    hdr = _NLMSGHDR.pack(_NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                         NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
    return hdr + req


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _attributes(data: bytes, offset: int, end: int) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each netlink attribute in data[offset:end]."""
    while offset + _NLATTR.size <= end:
        nla_len, nla_type = _NLATTR.unpack_from(data, offset)
        if nla_len < _NLATTR.size or offset + nla_len > end:
            raise SockDiagError("sock_diag", f"malformed attribute (length {nla_len})")
        yield nla_type & 0x3FFF, data[offset + _NLATTR.size: offset + nla_len]
        offset += _align4(nla_len)


def _parse_name(raw: bytes) -> bytes:
    """sun_path as the kernel keeps it -> UnixSock.name (path without its NUL)."""
    if raw.startswith(b"\0"):
        return raw
    return raw.split(b"\0", 1)[0]


_KDEV_MINORBITS = 20      # include/linux/kdev_t.h: MINORBITS


def _user_dev(kdev: int) -> int:
    """A kernel-internal dev_t (MKDEV: major << 20 | minor) as st_dev encodes it."""
    if kdev == 0:
        return 0
    return os.makedev(kdev >> _KDEV_MINORBITS, kdev & ((1 << _KDEV_MINORBITS) - 1))


def _parse_unix_diag_msg(data: bytes, offset: int, end: int) -> UnixSock:
    """One struct unix_diag_msg and its attributes -> UnixSock."""
    _family, stype, state, _pad, ino, c0, c1 = _UNIX_DIAG_MSG.unpack_from(data, offset)
    name = None
    vfs_dev = vfs_ino = peer = rqueue = wqueue = shutdown = 0
    icons: tuple[int, ...] = ()
    uid = None
    for atype, payload in _attributes(data, offset + _UNIX_DIAG_MSG.size, end):
        if atype == UNIX_DIAG_NAME:
            name = _parse_name(payload)
        elif atype == UNIX_DIAG_VFS:
            vfs_ino, kdev = _TWO_U32.unpack_from(payload)
            vfs_dev = _user_dev(kdev)
        elif atype == UNIX_DIAG_PEER:
            (peer,) = _U32.unpack_from(payload)
        elif atype == UNIX_DIAG_ICONS:
            icons = tuple(x for (x,) in _U32.iter_unpack(payload[: len(payload) & ~3]))
        elif atype == UNIX_DIAG_RQLEN:
            rqueue, wqueue = _TWO_U32.unpack_from(payload)
        elif atype == UNIX_DIAG_SHUTDOWN:
            shutdown = payload[0]
        elif atype == UNIX_DIAG_UID:
            (uid,) = _U32.unpack_from(payload)
    return UnixSock(ino=ino, type=stype, state=state, name=name, vfs_dev=vfs_dev,
                    vfs_ino=vfs_ino, peer=peer, icons=icons, rqueue=rqueue,
                    wqueue=wqueue, shutdown=shutdown, cookie=c0 | (c1 << 32), uid=uid)


def _parse_replies(data: bytes, seq: int, out: list, parse, what: str) -> tuple[bool, bool]:
    """Append what `parse(data, body, end)` makes of each SOCK_DIAG_BY_FAMILY message in one
    netlink datagram to out; (done, interrupted)."""
    offset = 0
    interrupted = False
    while offset + _NLMSGHDR.size <= len(data):
        length, mtype, flags, mseq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            raise SockDiagError(what, f"malformed netlink message (length {length})")
        body = offset + _NLMSGHDR.size
        if mseq == seq:
            interrupted |= bool(flags & NLM_F_DUMP_INTR)
            if mtype == NLMSG_DONE:
                return True, interrupted
            if mtype == NLMSG_ERROR:
                (error,) = _NLMSGERR.unpack_from(data, body)
                if error:
                    raise OSError(-error, os.strerror(-error))
                return True, interrupted
            if mtype == SOCK_DIAG_BY_FAMILY:
                out.append(parse(data, body, offset + length))
        offset += _align4(length)
    return False, interrupted


def netlink_dump(nl: socket.socket, request: bytes, seq: int, parse, what: str) -> tuple[list, bool]:
    """Send one sock_diag dump request and read every reply up to NLMSG_DONE:
    (the records `parse(data, body, end)` made, whether the kernel flagged it interrupted)."""
    nl.sendto(request, (0, 0))
    buf = bytearray(_NL_BUFSIZE)
    out: list = []
    interrupted = False
    while True:
        nbytes, _anc, flags, _addr = nl.recvmsg_into([buf])
        if flags & socket.MSG_TRUNC:
            raise SockDiagError(what, "netlink reply truncated")
        done, intr = _parse_replies(bytes(buf[:nbytes]), seq, out, parse, what)
        interrupted |= intr
        if done:
            return out, interrupted


@_wrap_oserror("sock_diag query of AF_UNIX sockets", _MISSING_ERRNOS_DIAG)
def unix_sockets(inodes: set[int] | None = None) -> dict[int, UnixSock]:
    """Every AF_UNIX socket of our network namespace, by inode (sock_diag dump).

    With `inodes`, only those (the ones not found are simply absent).  A dump
    the kernel flags as interrupted (NLM_F_DUMP_INTR) is repeated.
    """
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(_NL_TIMEOUT)
        for seq in range(1, 4):
            socks, interrupted = netlink_dump(nl, _dump_request(seq), seq, _parse_unix_diag_msg, "sock_diag")
            if not interrupted:
                break
    return {s.ino: s for s in socks if s.ino and (inodes is None or s.ino in inodes)}


def socket_inode(sock: socket.socket | int) -> int:
    """The inode of a socket fd: the N of its "socket:[N]" link, UnixSock.ino."""
    fd = sock if isinstance(sock, int) else sock.fileno()
    try:
        return os.fstat(fd).st_ino
    except OSError as err:
        raise _translate(err, f"fstat of fd {fd}") from err


# --- borrowing a shared socket fd -----------------------------------------------------

@contextlib.contextmanager
def _borrowed(sock: socket.socket | int) -> Iterator[socket.socket]:
    """A temporary socket object on sock's fd that never waits in Python.

    The fd is the target's open file (a pidfd_getfd copy), so its status
    flags are shared: if wrapping it changed O_NONBLOCK (socket's default
    timeout), they are put back.  The fd itself is not closed.
    """
    fd = sock if isinstance(sock, int) else sock.fileno()
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    s = socket.socket(fileno=fd)
    try:
        if s.family != socket.AF_UNIX:
            raise ValueError(f"fd {fd} is not an AF_UNIX socket ({s.family!r})")
        if s.gettimeout() is not None:
            s.settimeout(None)      # calls go straight to the kernel; we pass MSG_DONTWAIT
        yield s
    finally:
        s.detach()
        if fcntl.fcntl(fd, fcntl.F_GETFL) != flags:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)


def _getint(s: socket.socket, opt: int) -> int:
    return s.getsockopt(socket.SOL_SOCKET, opt)


def _ioctl_int(s: socket.socket, request: int) -> int:
    (value,) = _INT.unpack(fcntl.ioctl(s.fileno(), request, bytes(_INT.size)))
    return value


# --- peeking --------------------------------------------------------------------

@dataclass(slots=True)
class _Walk:
    """What a queue walk has found so far (mutable; frozen into QueueSnapshot)."""

    messages: list[bytes]
    senders: list[bytes | None]
    fds: int = 0
    pending_error: int = 0
    keep: bool = False                      # keep the passed fds (else closed at once) ...
    passed: list[tuple[int, ...]] = field(default_factory=list)    # ... per message
    creds: list[tuple[int, int, int]] = field(default_factory=list)   # SCM_CREDENTIALS seen (pid != 0)
    item_creds: list[tuple[int, int, int] | None] = field(default_factory=list)   # per message


def _close_all(fds) -> None:
    for fd in fds:
        os.close(fd)


def _address(addr: object) -> bytes | None:
    """A recvmsg AF_UNIX address (None, str path, bytes abstract) as sun_path bytes."""
    if addr is None or addr == "" or addr == b"":
        return None
    return os.fsencode(addr) if isinstance(addr, str) else bytes(addr)


def _passed_fds(ancdata: list[tuple[int, int, bytes]],
                keep: bool) -> tuple[tuple[int, ...], tuple[int, int, int] | None]:
    """The fds a peek installed in this process (SCM_RIGHTS; closed at once unless `keep`,
    a pidfd always), and the SCM_CREDENTIALS (pid, uid, gid) that came with them, if any."""
    passed: list[int] = []
    creds = None
    for level, ctype, data in ancdata:
        if level != socket.SOL_SOCKET:
            continue
        if ctype in (socket.SCM_RIGHTS, SCM_PIDFD):
            fds = array.array("i")
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
            if ctype == socket.SCM_RIGHTS:
                passed += fds
            else:
                _close_all(fds)
        elif ctype == socket.SCM_CREDENTIALS and len(data) >= _UCRED.size:
            creds = _UCRED.unpack_from(data)
    if not keep:
        _close_all(passed)
    return tuple(passed), creds


_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC


# The errors sk_err holds for an AF_UNIX socket (a peer that went away).
_SOCKET_ERRORS = frozenset({_errno.ECONNRESET, _errno.ECONNREFUSED, _errno.ECONNABORTED,
                            _errno.EPIPE, _errno.ETIMEDOUT})


def _peek_once(s: socket.socket, buf: bytearray | memoryview, walk: _Walk,
               flags: int) -> tuple[int, bool, object, tuple[int, ...]] | None:
    """One MSG_PEEK: (length, had SCM_CREDENTIALS, sender, the fds it passed: kept ones
    when walk.keep, else closed) or None at EAGAIN.

    A pending socket error returned instead of data is recorded in walk and
    the peek repeated once (reading it cleared it).
    """
    for _attempt in range(2):
        try:
            nbytes, anc, msg_flags, addr = s.recvmsg_into([buf], _ANC_BUFSIZE, _PEEK | flags)
        except BlockingIOError:
            return None
        except OSError as err:
            if walk.pending_error or err.errno not in _SOCKET_ERRORS:
                raise
            walk.pending_error = err.errno
            continue
        passed, creds = _passed_fds(anc, walk.keep)
        if creds is not None and creds[0]:
            walk.creds.append(creds)
        walk.fds += len(passed)
        if msg_flags & socket.MSG_CTRUNC:
            walk.fds += 1       # ancillary data did not fit our buffer: assume fds
            if walk.keep:
                _close_all(passed)
                raise SocketQueueError("peek of a socket receive queue",
                                       "more fds in flight in one message than a peek can take")
        return nbytes, creds, addr, passed
    return None


def _peek_stream(s: socket.socket, walk: _Walk) -> None:
    """Walk a SOCK_STREAM queue (SO_PEEK_OFF at 0) up to its SIOCINQ length."""
    total = _ioctl_int(s, SIOCINQ)
    if total <= 0:
        return
    s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, 0)
    data = bytearray()                  # of the segment being read
    creds = None                        # ... and the credentials its bytes came with
    seen = 0
    buf = bytearray(min(total, _STREAM_CHUNK))
    while seen < total:
        view = memoryview(buf)[: min(len(buf), total - seen)]
        got = _peek_once(s, view, walk, 0)
        if got is None or got[0] == 0:
            break
        now = _sender(got[1])
        if data and now != creds:
            # A reader with SO_PASSCRED never gets two senders' bytes in one read (so
            # neither does a peek): a segment ends where the credentials change.
            walk.messages.append(bytes(data))
            walk.passed.append(())
            walk.item_creds.append(creds)
            data = bytearray()
        creds = now
        data += view[: got[0]]
        seen += got[0]
        if got[3] and walk.keep:
            # A peek stops after the skb carrying fds: the segment ends there.  Where that
            # skb begins no peek tells (one passes the fds of the next skb that has any,
            # however few bytes it copies), so bytes queued without fds just before it
            # join its segment.
            walk.messages.append(bytes(data))
            walk.passed.append(got[3])
            walk.item_creds.append(creds)
            data = bytearray()
    if seen != total:
        raise SockDiagError("peek of a stream socket",
                            f"the queue held {total} bytes but {seen} could be peeked "
                            "(is the target stopped?)")
    if data or not walk.messages:
        walk.messages.append(bytes(data))
        walk.passed.append(())
        walk.item_creds.append(creds)


def _sender(creds: tuple[int, int, int] | None) -> tuple[int, int, int] | None:
    """SCM_CREDENTIALS as a queued message's sender: None when it had none (pid 0)."""
    return creds if creds is not None and creds[0] else None


def _peek_datagram(s: socket.socket, stype: int, walk: _Walk) -> bool:
    """Peek one datagram at the current SO_PEEK_OFF into walk; False at the end.

    A truncated peek moved SO_PEEK_OFF only by what fit: the offset is set
    back and the peek repeated with a buffer of the full length.
    """
    offset = _getint(s, SO_PEEK_OFF)
    size = _PEEK_BUFSIZE
    while True:
        buf = bytearray(size)
        got = _peek_once(s, buf, walk, socket.MSG_TRUNC)
        if got is None:
            return False
        nbytes, creds, addr, passed = got
        if stype == socket.SOCK_SEQPACKET and not creds:
            return False                # end of queue of a shut-down seqpacket socket
        if nbytes <= size:
            walk.messages.append(bytes(buf[:nbytes]))
            walk.senders.append(_address(addr))
            walk.passed.append(passed)
            walk.item_creds.append(_sender(creds))
            return True
        if walk.keep:
            _close_all(passed)          # the repeated peek passes them again
        walk.fds -= len(passed)
        if offset >= 0:
            s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, offset)
        size = nbytes


def _peek_datagrams(s: socket.socket, stype: int, walk: _Walk) -> None:
    """Walk a SOCK_DGRAM/SOCK_SEQPACKET queue, one element per message.

    The head is peeked plainly first (SO_PEEK_OFF -1): if it is a
    zero-length message the target may have peeked (and so marked) it, and
    the offset walk would skip it (see module doc).
    """
    s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, -1)
    head = _Walk([], [], keep=walk.keep)
    if not _peek_datagram(s, stype, head):
        walk.pending_error = head.pending_error
        return
    walk.pending_error = head.pending_error
    if head.messages[0] == b"":
        walk.messages.append(b"")
        walk.senders.append(head.senders[0])
        walk.passed.append(head.passed[0])
        walk.item_creds.append(head.item_creds[0])
        walk.creds += head.creds
        walk.fds += head.fds
    elif walk.keep:
        _close_all(head.passed[0])      # the walk passes them again
    s.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, 0)
    while _peek_datagram(s, stype, walk):
        pass


def _oob_byte(s: socket.socket) -> bytes | None:
    """The pending urgent byte of a stream socket, not consumed; None if none."""
    try:
        data = s.recv(1, socket.MSG_OOB | socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError as err:
        if err.errno in (_errno.EINVAL, _errno.EOPNOTSUPP, _errno.EAGAIN):
            return None     # none pending, SO_OOBINLINE, or no CONFIG_AF_UNIX_OOB
        raise
    return data or None


@contextlib.contextmanager
def _saved_option(s: socket.socket, opt: int, value: int | None = None) -> Iterator[int]:
    """Keep a SOL_SOCKET int option (optionally set to value) and put it back after."""
    original = _getint(s, opt)
    try:
        if value is not None and value != original:
            s.setsockopt(socket.SOL_SOCKET, opt, value)
        yield original
    finally:
        if _getint(s, opt) != original:
            s.setsockopt(socket.SOL_SOCKET, opt, original)


def _listening(s: socket.socket, stype: int) -> bool:
    """True for a listening socket: it queues connections, not data."""
    return stype != socket.SOCK_DGRAM and bool(_getint(s, socket.SO_ACCEPTCONN))


def _peek_seqpacket(s: socket.socket, walk: _Walk) -> None:
    """Walk a SOCK_SEQPACKET queue with SO_PASSCRED on (end-of-queue marker);
    an unconnected socket (ENOTCONN before anything was seen) has no queue."""
    with _saved_option(s, socket.SO_PASSCRED, 1):
        try:
            _peek_datagrams(s, socket.SOCK_SEQPACKET, walk)
        except OSError as err:
            if err.errno != _errno.ENOTCONN or walk.messages:
                raise


@_wrap_oserror("peek of a socket receive queue")
def snapshot_queue(sock: socket.socket | int, keep_fds: bool = False) -> QueueSnapshot:
    """Read the whole receive queue of an AF_UNIX socket without consuming it.

    `sock` is typically a pidfd_getfd copy of a stopped target's fd.  The
    socket's SO_PEEK_OFF (and, for SOCK_SEQPACKET, SO_PASSCRED) are changed
    during the walk and put back in a finally.  What the queue gives to a
    later reader stays byte for byte the same; see the module doc for what
    the kernel lets a peek see (zero-length messages, pending errors, fds).

    With `keep_fds`, the fds in flight that the peek installed in this process are kept:
    snapshot.passed holds them, per message (a stream's messages are then its segments,
    each ending where fds ride); the caller closes them.
    """
    with _borrowed(sock) as s:
        stype = _getint(s, socket.SO_TYPE)
        passcred = bool(_getint(s, socket.SO_PASSCRED))
        walk = _Walk([], [], keep=keep_fds)
        oob = None
        try:
            with _saved_option(s, SO_PEEK_OFF) as peek_off:
                if _listening(s, stype):
                    pass
                elif stype == socket.SOCK_STREAM:
                    oob = _oob_byte(s)
                    _peek_stream(s, walk)
                elif stype == socket.SOCK_SEQPACKET:
                    _peek_seqpacket(s, walk)
                else:
                    _peek_datagrams(s, stype, walk)
        except BaseException:
            for passed in walk.passed:
                _close_all(passed)
            raise
        return QueueSnapshot(type=stype, messages=tuple(walk.messages),
                             senders=tuple(walk.senders) if stype != socket.SOCK_STREAM else (),
                             fds=walk.fds, oob=oob, peek_off=peek_off,
                             pending_error=walk.pending_error,
                             passed=tuple(walk.passed) if keep_fds else (),
                             creds=tuple(walk.creds), passcred=passcred,
                             item_creds=tuple(walk.item_creds) if passcred else ())


def peek_queue(sock: socket.socket | int) -> list[bytes]:
    """The messages queued for reading on an AF_UNIX socket, left in place.

    SOCK_STREAM: at most one element, the whole queued byte stream (a
    stream keeps no boundaries).  SOCK_DGRAM / SOCK_SEQPACKET: one element
    per message in queue order, zero-length ones included.  [] for an empty
    queue and for sockets without one (listening, unconnected).

    Raises SocketQueueError when the queue holds what plain bytes cannot
    restore: file descriptors in flight, or a pending MSG_OOB byte (use
    snapshot_queue to see those).
    """
    snap = snapshot_queue(sock)
    if snap.fds:
        raise SocketQueueError("peek of a socket receive queue",
                               f"{snap.fds} file descriptor(s) in flight (SCM_RIGHTS) "
                               "cannot be checkpointed")
    if snap.oob is not None:
        raise SocketQueueError("peek of a socket receive queue",
                               "an out-of-band (MSG_OOB) byte is pending; not supported")
    return list(snap.messages)


# --- refilling (restore side) -------------------------------------------------------

def _grow_sndbuf(s: socket.socket, want: int) -> bool:
    """Raise SO_SNDBUF to at least `want` bytes (the kernel's doubled value); False if
    it is already at its limit.  SO_SNDBUFFORCE first, plain SO_SNDBUF without
    CAP_NET_ADMIN."""
    current = _getint(s, socket.SO_SNDBUF)
    request = min(max(want, 2 * current) // 2 + 1, _SNDBUF_MAX)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, request)
    except PermissionError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, request)
    return _getint(s, socket.SO_SNDBUF) > current


def _restore_sndbuf(s: socket.socket, original: int) -> None:
    """Put SO_SNDBUF back to the value read before (the kernel doubles what is set)."""
    if _getint(s, socket.SO_SNDBUF) == original:
        return
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, original // 2)
    except PermissionError:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, original // 2)


def _room_needed(s: socket.socket, pending: Sequence[int]) -> int:
    """An SO_SNDBUF big enough for what is in flight plus `pending` message sizes."""
    return _ioctl_int(s, SIOCOUTQ) + sum(2 * n + _TRUESIZE_SLACK for n in pending)


_SEND = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL


def _full_error(done: int, total: int, stype: int, err: OSError) -> SocketQueueError:
    """The error for a queue that stopped taking data."""
    unit = "bytes" if stype == socket.SOCK_STREAM else "messages"
    hint = ""
    if stype == socket.SOCK_DGRAM and err.errno == _errno.EAGAIN:
        hint = ("; a datagram receiver not connected back holds at most "
                "net.unix.max_dgram_qlen + 1 messages (raise it before creating it)")
    return SocketQueueError("refill of a socket queue",
                            f"the peer took only {done} of {total} {unit} "
                            f"({err.strerror}){hint}", err.errno)


def _send_stream(s: socket.socket, data: bytes, anc: list = ()) -> None:
    """Queue a byte stream (every part with ancillary data `anc`: credentials), growing
    SO_SNDBUF when it fills."""
    view = memoryview(data)
    done = 0
    stuck = 0
    while done < len(data):
        try:
            part = view[done: done + _STREAM_CHUNK]
            done += s.sendmsg([part], anc, _SEND) if anc else s.send(part, _SEND)
            stuck = 0
        except BlockingIOError as err:
            stuck += 1
            if stuck > _SNDBUF_GROWS or not _grow_sndbuf(s, _room_needed(s, [len(data) - done])):
                raise _full_error(done, len(data), socket.SOCK_STREAM, err) from err


def _rights(fds: Sequence[int]) -> list:
    """The ancillary data passing `fds` (SCM_RIGHTS), or none."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []


def _credentials(creds: tuple[int, int, int] | None) -> list:
    """The ancillary data giving a message its sender's (pid, uid, gid) (SCM_CREDENTIALS:
    another pid than the sender's own needs CAP_SYS_ADMIN, and the pid must be alive)."""
    return [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, _UCRED.pack(*creds))] if creds else []


def _item(seq: Sequence, i: int):
    return seq[i] if i < len(seq) else None


def _send_messages(s: socket.socket, stype: int, messages: Sequence[bytes],
                   fds: Sequence[Sequence[int]] = (), address=None,
                   creds: Sequence[tuple[int, int, int] | None] = ()) -> None:
    """Queue datagrams one send each (with the fds in flight and the credentials beside
    each, and to `address` when given), growing SO_SNDBUF on EAGAIN / EMSGSIZE.  A stream's
    segments go the same way, a short send finished without the fds (they went with its
    first part) but with the same credentials."""
    i = 0
    stuck = 0
    while i < len(messages):
        try:
            who = _credentials(_item(creds, i))
            anc = _rights(_item(fds, i) or ()) + who
            args = (_SEND, address) if address is not None else (_SEND,)
            sent = s.sendmsg([messages[i]], anc, *args) if anc or address is not None else s.send(messages[i], _SEND)
            if stype == socket.SOCK_STREAM and sent < len(messages[i]):
                _send_stream(s, messages[i][sent:], who)
            i += 1
            stuck = 0
        except OSError as err:
            if err.errno not in (_errno.EAGAIN, _errno.EMSGSIZE):
                raise
            stuck += 1
            want = _room_needed(s, [len(m) for m in messages[i:]])
            if stuck > _SNDBUF_GROWS or not _grow_sndbuf(s, want):
                raise _full_error(i, len(messages), stype, err) from err


@_wrap_oserror("refill of a socket queue")
def send_queue(sock: socket.socket | int, messages: Sequence[bytes],
               type: int | None = None, fds: Sequence[Sequence[int]] = (), address=None,
               creds: Sequence[tuple[int, int, int] | None] = ()) -> None:
    """Send `messages` on a connected AF_UNIX socket so that they wait, with the
    same boundaries, in its PEER's receive queue (restore side).

    SOCK_STREAM: the concatenation is sent (a stream has no boundaries);
    SOCK_DGRAM / SOCK_SEQPACKET: one send per message, zero-length ones too.
    `type` defaults to the socket's SO_TYPE and must match it.  Never
    blocks (MSG_DONTWAIT): when the sender's buffer is full, SO_SNDBUF is
    grown (SO_SNDBUFFORCE as root) and the send retried; SO_SNDBUF is put
    back to its old value at the end.  Raises SocketQueueError when the
    peer cannot take everything (see module doc: max_dgram_qlen).

    `fds`, parallel to `messages`: the fds to pass with each (SCM_RIGHTS; a stream
    then sends its items one by one, so that each ends where its fds ride).  `address`:
    send every message there (an unconnected datagram socket).  `creds`, parallel to
    `messages`: the (pid, uid, gid) each is sent with (SCM_CREDENTIALS), None: ptckpt's.
    """
    with _borrowed(sock) as s:
        stype = _getint(s, socket.SO_TYPE)
        if type is not None and type != stype:
            raise ValueError(f"socket type is {stype}, not {type}")
        original = _getint(s, socket.SO_SNDBUF)
        try:
            if stype == socket.SOCK_STREAM and not any(fds) and not any(creds):
                _send_stream(s, b"".join(messages))
            else:
                _send_messages(s, stype, messages, fds, address, creds)
        finally:
            _restore_sndbuf(s, original)
