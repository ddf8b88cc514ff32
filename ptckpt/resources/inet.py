"""Inet sockets held inside a tree: TCP, UDP, UDP-Lite, ICMP "ping" and raw sockets over
IPv4 and IPv6.

Dump half: :class:`InetDump` looks at every AF_INET/AF_INET6 socket of a frozen tree
through a copy of its fd (pidfd_getfd) and decides, before it changes anything, how
each comes back (:class:`~ptckpt.formats.model.InetMode`):

* unbound, bound and listening TCP sockets and UDP sockets: PLAIN, from their
  addresses, options (:mod:`.sockopts`), backlog, and for UDP the datagrams queued
  (peeked with SO_PEEK_OFF, each with its sender), multicast memberships and a
  classic BPF filter; UDP-Lite sockets the same way (their checksum coverage is an
  option);
* ping sockets (SOCK_DGRAM, IPPROTO_ICMP / IPPROTO_ICMPV6): PLAIN too, from their
  echo id (the "port" getsockname reports: bound, or taken by the first send), the
  peer they are connected to (getpeername refuses one with no port: it is read from
  /proc/PID/net/icmp and icmp6) and their options.  A reply or error queued and not
  read yet is refused: a ping socket has no SO_PEEK_OFF, so no dump can read its
  queue without taking it from the program;
* raw sockets (SOCK_RAW, any protocol): PLAIN, from their protocol, bound address (a
  raw socket has no port: the one getsockname gives is its protocol), peer (read from
  /proc/PID/net/raw and raw6, as getpeername refuses a peer with no port), options (their
  own among them: IP_HDRINCL, ICMP_FILTER, ICMPV6_FILTER, IPV6_CHECKSUM, ...), groups and
  filter.  Making one needs CAP_NET_RAW: a dump without it refuses them, as the restore
  by the same user would fail.  A packet queued and not read is refused: a raw socket has
  no SO_PEEK_OFF, and no packet can be queued again on it without every other raw
  socket of that protocol seeing it too;
* established and half-closed TCP connections: REPAIRED with ``--tcp-established``
  (locked with :mod:`ptckpt.netlock` as soon as the tree is frozen,
  :meth:`InetDump.lock_frozen`, then read in repair mode, :mod:`.tcp`), CLOSED
  with ``--tcp-close`` (as CRIU: over, both ways shut, no error pending), else refused naming the connection and the ways out
  (:class:`~ptckpt.errors.ConnectionNotAllowed`);
* connections in a listener's accept queue: PENDING.  The dump takes them out of
  the queue (accept on its copy of the listener) to read what their peers sent;
  the restore queues them again by connecting their client end to the restored
  listener and sending it.  That works when the client end is in the tree too, or
  is a socket its process already closed (an orphan on this host); a client held
  by a process outside the tree is refused (``--tcp-close`` drops such
  connections).  A leave-running dump cannot put them back and refuses them.
* SYN_SENT, urgent data not read yet, a reset connection with a pending error or
  unread bytes, an eBPF filter, a source-filtered multicast membership: refused by
  name.

Restore half: :class:`InetRestore` makes them all in ptckpt (inside the tree's new
network namespace when there is one), before any stub exists; the stubs inherit
them (restore.build_handoff).  Repaired connections stay in repair mode until
:meth:`InetRestore.finish`, called when the processes are rebuilt: the network
lock goes, repair mode ends with a window probe.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import fcntl
import ipaddress
import logging
import os
import select
import socket
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .. import inetdiag, netlock, procfs, rawpkt
from ..errors import ConnectionNotAllowed, PtckptError, RestoreFailed, UnsupportedResource
from ..formats.model import Fd, FdKind, InetMode, InetSocket
from ..tracee import pidfd_getfd
from . import sockopts, tcp

log = logging.getLogger("ptckpt.inet")

INET_FAMILIES = {"AF_INET": socket.AF_INET, "AF_INET6": socket.AF_INET6}
RCV_SHUTDOWN, SEND_SHUTDOWN = 1, 2
O_ACCMODE = 0o3
PENDING_BASE = 1 << 62          # ids of accept-queue connections (they have no inode)
SO_PEEK_OFF = 42
_TCP, _UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
UDPLITE, ICMP, ICMPV6 = 136, socket.IPPROTO_ICMP, socket.IPPROTO_ICMPV6
DATAGRAM_PROTOCOLS = (_UDP, UDPLITE)            # datagrams peeked and refilled, multicast
PING_PROTOCOLS = {socket.AF_INET: ICMP, socket.AF_INET6: ICMPV6}
PROTOCOL_NAMES = {_TCP: "TCP", _UDP: "UDP", UDPLITE: "UDP-Lite", ICMP: "ICMP", ICMPV6: "ICMPv6"}
_MAXSEG = (socket.IPPROTO_TCP, socket.TCP_MAXSEG)


def inet_family(f: Fd) -> int:
    """AF_INET or AF_INET6 for an inet socket fd (from the dump's socket details), else 0."""
    if f.kind is not FdKind.SOCKET:
        return 0
    return INET_FAMILIES.get(dict(f.details).get("family", ""), 0)


def is_inet(f: Fd) -> bool:
    if not inet_family(f):
        return False
    kind = dict(f.details).get("type", "")
    proto = dict(f.details).get("protocol", "")
    ping = str(PING_PROTOCOLS[inet_family(f)])
    return (kind == "SOCK_STREAM" and proto in ("0", "6")) or kind == "SOCK_RAW" or (
        kind == "SOCK_DGRAM" and proto in ("0", "17", str(UDPLITE), ping))


def is_ping(proto: int) -> bool:
    return proto in (ICMP, ICMPV6)


def is_raw(r: InetSocket) -> bool:
    return r.type == socket.SOCK_RAW


def proto_name(type_: int, proto: int) -> str:
    """'UDP', 'TCP', ...; a raw socket: 'raw IP protocol 17' (what it sends and receives)."""
    if type_ == socket.SOCK_RAW:
        return f"raw IP protocol {proto}"
    return PROTOCOL_NAMES.get(proto, str(proto))


def endpoint(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def describe(r: InetSocket) -> str:
    """'TCP 127.0.0.1:8080 -> 127.0.0.1:45000 (ESTABLISHED)', as show and messages print it."""
    proto = proto_name(r.type, r.protocol)
    if is_raw(r):
        here = r.src or "unbound"
        there = f" -> {r.dst}" if r.state == tcp.ESTABLISHED else ""
        return f"{proto} {here}{there}"
    here = endpoint(r.src, r.sport) if r.src or r.sport else "unbound"
    connected = r.dport or r.protocol != _TCP and r.state == tcp.ESTABLISHED
    there = f" -> {endpoint(r.dst, r.dport)}" if connected else ""
    state = tcp.state_name(r.state) if r.protocol == _TCP else ("connected" if connected else "")
    return f"{proto} {here}{there}" + (f" ({state})" if state else "")


@dataclass(frozen=True)
class Policy:
    """What a dump does with TCP connections (the dump's flags)."""

    established: bool = False        # --tcp-established: dump them with TCP_REPAIR
    close: bool = False              # --tcp-close: they come back closed; pending ones are dropped
    leave_running: bool = True       # the target runs on after the dump


# --- dump half -----------------------------------------------------------------------

@dataclass
class _Sock:
    """One inet socket of the tree during the dump (a copy of one holder's fd)."""

    pid: int
    fd: Fd
    sock: socket.socket
    family: int
    proto: int
    state: int
    type: int = socket.SOCK_STREAM
    src: str = ""
    sport: int = 0
    dst: str = ""
    dport: int = 0
    mode: InetMode = InetMode.PLAIN
    pending: list = field(default_factory=list)     # listener: inetdiag records of its accept queue


@dataclass
class InetDump:
    """The inet sockets of a frozen tree: records, and what the dump holds while it runs
    (the network lock, the connections in repair mode, accept-queue connections)."""

    policy: Policy
    image_dir: str
    lock: netlock.NetLock | None = None           # the image's: held until a restore
    queue_lock: netlock.NetLock | None = None     # accept-queue connections: held while the dump runs
    clients: set[int] = field(default_factory=set)   # inodes of client ends of queued connections
    orphans: list[tuple[socket.socket, object]] = field(default_factory=list)
    silence: list[socket.socket] = field(default_factory=list)    # dumped connections (copies)
    accepted: list[socket.socket] = field(default_factory=list)
    copies: list[socket.socket] = field(default_factory=list)
    queued: int = 0                                  # accept-queue connections taken so far

    locked_at: float = 0.0                           # time.time() of lock_frozen's lock

    def lock_frozen(self, members: Sequence[int], root: int, claimed: set[tuple[int, int]] = frozenset()) -> int:
        """The tree is frozen, nothing captured yet: lock at once the connections the capture
        will read in repair mode (--tcp-established), as CRIU locks the network right after
        its freeze, so that a group's members are all frozen and locked before any reads a
        byte.  Found from the members' fds (/proc) and the kernel's socket table; the client
        ends of connections waiting in a listener's accept queue are the capture's (a lock of
        their own, only while it reads them).  The capture adds what it finds besides and
        drops what it does not read (a plugin's external connection; one claimed already, in
        pre_dump, is in `claimed` as (pid, fd), and not locked here at all).  Without
        --tcp-established, or with no socket in the tree, nothing is done.  The number of
        connections locked."""
        if not self.policy.established:
            return 0
        held: dict[int, tuple[int, int]] = {}
        not_ours: set[int] = set()          # the root's stdio, a plugin's claimed connection
        for pid in members:
            for ino, fd in procfs.socket_fds(pid).items():
                if (pid == root and fd <= 2) or (pid, fd) in claimed:
                    not_ours.add(ino)
                held.setdefault(ino, (pid, fd))
        for ino in not_ours:
            del held[ino]
        if not held:
            return 0
        diag = _Index(inetdiag.inet_sockets(protocols=(_TCP,)))
        mine = [d for d in diag.socks if d.ino in held]
        clients: set[int] = set()
        for d in mine:
            if d.state == tcp.LISTEN and d.rqueue:
                for child in inetdiag.pending_children(d, diag.socks):
                    peer = diag.peer(child)
                    if peer is not None and peer.ino:
                        clients.add(peer.ino)
        conns = []
        for d in mine:
            if d.state in tcp.REPAIRABLE and d.ino not in clients:
                pid, fd = held[d.ino]
                with socket.socket(fileno=pidfd_getfd(pid, fd)) as copy:
                    reuse = copy.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
                conns.append(netlock.Connection(d.family, d.src, d.sport, d.dst, d.dport, ino=d.ino,
                                                reuseaddr=reuse))
        if conns:
            self.lock = netlock.lock(conns, image_dir=self.image_dir)
            self.locked_at = time.time()
            log.info("locked %d connection(s) of the frozen tree", len(conns))
        return len(conns)

    def capture_frozen(self, fds: Mapping[int, Sequence[Fd]], skip: set[int]) -> list[InetSocket]:
        """Records for every inet socket description of the tree (those in `skip` are the
        root's stdio).  Refusals come before anything is changed (but for lock_frozen's lock,
        which the dump's failure lifts)."""
        holders: dict[int, tuple[int, Fd]] = {}
        for pid, flist in fds.items():
            for f in flist:
                if is_inet(f) and f.desc not in skip and not f.external:
                    holders.setdefault(f.desc, (pid, f))
        if not holders:
            self._settle_lock([])
            return []
        socks = [self._open(pid, f) for pid, f in holders.values()]
        diag = _Index(inetdiag.inet_sockets() if any(s.proto == _TCP for s in socks) else [])
        inodes = {s.fd.ino for s in socks}
        for s in socks:
            self._classify(s, diag, inodes, fds)
        records = self._lock_and_read([s for s in socks if s.mode is InetMode.REPAIRED
                                       or s.pending], diag, inodes)
        return [records.get(s.fd.ino) or self._plain(s, diag) for s in socks] + records.get("pending", [])

    # -- reading -------------------------------------------------------------------

    def _open(self, pid: int, f: Fd) -> _Sock:
        copy = pidfd_getfd(pid, f.fd)
        try:
            sock = socket.socket(fileno=copy)
        except OSError:
            os.close(copy)
            raise
        self.copies.append(sock)
        s = _Sock(pid, f, sock, sock.family, sock.proto or (_TCP if sock.type == socket.SOCK_STREAM else _UDP),
                  state=tcp.CLOSE, type=sock.type)
        if s.type == socket.SOCK_RAW:
            # the "port" getsockname gives is the protocol, the peer has no port (getpeername
            # says ENOTCONN): the kernel's table of raw sockets has the peer and the state
            s.proto = sock.proto
            s.src = sock.getsockname()[0]
            if s.src in ("0.0.0.0", "::"):
                s.src = ""
            row = ping_table(pid, s.family, raw=True).get(f.ino)
            if row is not None and row[0] == tcp.ESTABLISHED:
                s.state, s.dst = tcp.ESTABLISHED, row[1]
            return s
        with contextlib.suppress(OSError):
            s.src, s.sport = sock.getsockname()[:2]
        with contextlib.suppress(OSError):
            s.dst, s.dport = sock.getpeername()[:2]
        if s.proto == _TCP:
            s.state = tcp.tcp_info_head(sock)[0]
        elif is_ping(s.proto):
            # connected to a peer with no port: getpeername says ENOTCONN; the kernel's
            # table of ping sockets has the peer and the state
            row = ping_table(pid, s.family).get(f.ino)
            if row is not None and row[0] == tcp.ESTABLISHED:
                s.state, s.dst, s.dport = tcp.ESTABLISHED, row[1], 0
        elif s.dport:
            s.state = tcp.ESTABLISHED
        elif s.sport:
            # connected to port 0 (connect to 0.0.0.0:0 gives 127.0.0.1 port 0): getpeername
            # says ENOTCONN; the kernel's table has the peer and the state
            d = next(iter(inetdiag.inet_sockets(protocols=(s.proto,), families=(s.family,),
                                                inodes={f.ino})), None)
            if d is not None and d.state == tcp.ESTABLISHED:
                s.state, s.dst = tcp.ESTABLISHED, d.dst
        if s.sport == 0 and s.src in ("0.0.0.0", "::"):
            s.src = ""
        return s

    def _refuse(self, s: _Sock, what: str) -> None:
        raise UnsupportedResource(s.pid, f"fd {s.fd.fd} ({_short(s)}): {what}")

    def _classify(self, s: _Sock, diag, inodes: set[int], fds) -> None:
        """Decide how `s` comes back; refuse what cannot (nothing is changed here)."""
        if s.type == socket.SOCK_RAW:
            self._classify_raw(s)
            return
        if is_ping(s.proto):
            events = _poll(s.sock, select.POLLRDHUP)
            if events & select.POLLERR:
                self._refuse(s, "an error queued and not read yet (IP_RECVERR; a ping socket's error "
                                "queue cannot be read without taking it: let the program read it, or dump "
                                "again once it did)")
            if events & select.POLLIN and not events & select.POLLRDHUP:
                self._refuse(s, "an ICMP reply queued and not read yet (a ping socket cannot be peeked "
                                "past its first reply, so no dump can copy its queue without taking it "
                                "from the program: dump again once it read its replies)")
            return
        if s.proto in DATAGRAM_PROTOCOLS:
            if tcp.ioctl_int(s.sock, tcp.SIOCOUTQ):
                self._refuse(s, "a datagram being built and not sent yet (UDP_CORK or MSG_MORE: dump "
                                "again once it is sent)")
            return
        if s.state == tcp.LISTEN:
            if _listener_counts(s.sock)[1]:
                self._classify_pending(s, diag, inodes, fds)
            return
        if s.state in tcp.REPAIRABLE:
            conn = f"{endpoint(s.src, s.sport)} -> {endpoint(s.dst, s.dport)} ({tcp.state_name(s.state)})"
            if tcp.urgent_pending(s.sock):
                self._refuse(s, "urgent (out-of-band) data not read yet (its urgent pointer cannot be made "
                                "again: let the program read it first)")
            if self.policy.close:
                s.mode = InetMode.CLOSED
            elif self.policy.established:
                s.mode = InetMode.REPAIRED
            else:
                raise ConnectionNotAllowed(s.pid, s.fd.fd, conn)
            return
        if s.state == tcp.CLOSE:
            events = _poll(s.sock, select.POLLRDHUP)
            if events & select.POLLERR or tcp.ioctl_int(s.sock, tcp.SIOCINQ):
                self._refuse(s, "a reset TCP connection with a pending error or unread bytes")
            if events & select.POLLRDHUP:
                # a connection that is over: both ways shut by the kernel when it ended,
                # reads give end of file, sends EPIPE; made as --tcp-close makes one
                if not _segments(s.sock):
                    self._refuse(s, "a TCP socket shut down (shutdown) before it was ever connected "
                                    "(its shut send side does not show, and no restore makes one so)")
                s.mode = InetMode.CLOSED
            return
        d = diag.by_ino.get(s.fd.ino)
        to = f" to {endpoint(d.dst, d.dport)}" if d is not None and d.dport else ""
        self._refuse(s, f"a TCP socket in state {tcp.state_name(s.state)}{to} (a connection being set up "
                        f"cannot be frozen: dump again once it is established)")

    def _classify_raw(self, s: _Sock) -> None:
        """A raw socket: made again by ptckpt at restore, which needs CAP_NET_RAW (a dump
        without it refuses, as the restore would); its queues cannot be refilled."""
        try:
            socket.socket(s.family, socket.SOCK_RAW, s.proto).close()
        except PermissionError:
            self._refuse(s, "a raw socket, which only a restore with CAP_NET_RAW can make again, and "
                            "this dump has not got it (dump and restore as root, or with CAP_NET_RAW)")
        events = _poll(s.sock, select.POLLRDHUP)
        if events & select.POLLERR:
            self._refuse(s, "an error queued and not read yet (IP_RECVERR; a raw socket's error queue "
                            "cannot be read without taking it: let the program read it, or dump again "
                            "once it did)")
        if events & select.POLLIN and not events & select.POLLRDHUP or tcp.ioctl_int(s.sock, tcp.SIOCINQ):
            self._refuse(s, "packets queued and not read yet (a raw socket cannot be peeked past its "
                            "first packet, nor its queue filled again without other sockets seeing the "
                            "packets: dump again once the program read them)")
        if tcp.ioctl_int(s.sock, tcp.SIOCOUTQ):
            self._refuse(s, "a packet being built and not sent yet (MSG_MORE: dump again once it is sent)")

    def _classify_pending(self, s: _Sock, diag, inodes: set[int], fds) -> None:
        listener = diag.by_ino.get(s.fd.ino)
        children = inetdiag.pending_children(listener, diag.socks) if listener else []
        if self.policy.close:
            log.info("fd %d: %d connections not yet accepted are dropped (--tcp-close)", s.fd.fd, len(children))
            return
        if self.policy.leave_running:
            self._refuse(s, f"{len(children) or 'some'} connections not yet accepted, in a dump that "
                            f"leaves the program running (it cannot put them back in its queue: dump "
                            f"with --kill, and the restore queues them again, or with --tcp-close to drop them)")
        if not self.policy.established:
            first = children[0] if children else None
            raise ConnectionNotAllowed(s.pid, s.fd.fd, f"{endpoint(first.src, first.sport)} <- "
                                       f"{endpoint(first.dst, first.dport)}" if first else _short(s),
                                       " (waiting in the accept queue)")
        for child in children:
            peer = diag.peer(child)
            if peer is None or (peer.ino and peer.ino not in inodes):
                held = _holder(peer.ino, set(fds)) if peer is not None else "on another host"
                self._refuse(s, f"a connection from {endpoint(child.dst, child.dport)} waiting in its accept "
                                f"queue, whose client end is {held} (it cannot be queued again: let the "
                                f"program accept it first, or --tcp-close drops it)")
            if peer.ino:
                self.clients.add(peer.ino)
        s.pending = children

    def _lock_and_read(self, socks: list[_Sock], diag, inodes: set[int]) -> dict:
        """Lock the connections (those lock_frozen did not), then read each one in repair mode
        and take the accept queues."""
        # A queued connection and its client end are made again by a real connect at restore:
        # they are locked only while the dump reads them.  The others until their restore.
        conns: list[netlock.Connection] = []
        queued: list[netlock.Connection] = []
        for s in socks:
            if s.mode is InetMode.REPAIRED:
                (queued if s.fd.ino in self.clients else conns).append(netlock.Connection(
                    s.family, s.src, s.sport, s.dst, s.dport, ino=s.fd.ino,
                    reuseaddr=s.sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)))
            for child in s.pending:
                queued.append(netlock.Connection(child.family, child.src, child.sport, child.dst, child.dport))
        if queued:
            self.queue_lock = netlock.lock(queued, image_dir=self.image_dir)
        self._settle_lock(conns)
        out: dict = {}
        for s in socks:
            if s.mode is InetMode.REPAIRED:
                out[s.fd.ino] = self._read_repaired(s, diag, inodes)
        for s in socks:
            if s.pending:
                out.setdefault("pending", []).extend(self._take_queue(s, diag, inodes))
        return out

    def _settle_lock(self, conns: list[netlock.Connection]) -> None:
        """The image's lock holds exactly `conns`: lock_frozen's lock, with what it lacks
        added; if it holds one the capture does not read (a plugin claimed it as external),
        a lock of `conns` replaces it (made before the old one goes: nothing passes between)."""
        if self.lock is None:
            if conns:
                self.lock = netlock.lock(conns, image_dir=self.image_dir)
            return
        keys = {c.key for c in conns}
        if all(c.key in keys for c in self.lock.connections):
            self.lock = netlock.add(self.lock, conns)
            return
        old = self.lock
        self.lock = netlock.lock(conns, image_dir=self.image_dir) if conns else None
        netlock.unlock(old)

    def _read_repaired(self, s: _Sock, diag, inodes: set[int]) -> InetSocket:
        """Read a locked connection in repair mode, for as short a time as the reading takes:
        a target that resumes in repair mode (its dumper killed) could not use the socket."""
        options = sockopts.read_options(s.sock)          # before repair mode changes SO_REUSEADDR
        with tcp.repaired(s.sock):
            state = tcp.read_stream_frozen(s.sock)
        self.silence.append(s.sock)
        peer = diag.peer(s)
        return InetSocket(ino=s.fd.ino, family=s.family, type=socket.SOCK_STREAM, protocol=_TCP,
                          mode=InetMode.REPAIRED, src=s.src, sport=s.sport, dst=s.dst, dport=s.dport,
                          shutdown=diag.shutdown(s), options=options,
                          peer=peer.ino if peer is not None and peer.ino in inodes else 0, **state)

    def _take_queue(self, s: _Sock, diag, inodes: set[int]) -> list[InetSocket]:
        """Accept every connection waiting on listener `s` (on ptckpt's copy), in queue order,
        and read what its peer sent: PENDING records."""
        out = []
        for _ in s.pending:
            if not _poll(s.sock) & select.POLLIN:
                break
            child, _addr = s.sock.accept()
            self.accepted.append(child)
            child.setblocking(False)
            data = bytearray()
            with contextlib.suppress(BlockingIOError):
                while chunk := child.recv(1 << 20):
                    data += chunk
            src, sport = child.getsockname()[:2]
            dst, dport = child.getpeername()[:2]
            peer = diag.peer(_Ends(src, sport, dst, dport))
            self.queued += 1
            out.append(InetSocket(ino=PENDING_BASE + self.queued, family=child.family,
                                  type=socket.SOCK_STREAM, protocol=_TCP,
                                  state=tcp.tcp_info_head(child)[0], mode=InetMode.PENDING, src=src,
                                  sport=sport, dst=dst, dport=dport, recv_queue=bytes(data),
                                  listener=s.fd.ino, peer=peer.ino if peer is not None and peer.ino in inodes else 0))
            tcp.repair_on(child)             # closed silently when the dump ends
            if peer is not None and not peer.ino:
                # its client closed already: that orphan is reset when the dump ends (killed),
                # so that the restore's stand-in client can take its address again
                self.orphans.append((child, tcp.read_stream_frozen(child)))
        return out

    def _plain(self, s: _Sock, diag: "_Index") -> InetSocket:
        options = sockopts.read_options(s.sock)
        if s.proto == _TCP and s.type == socket.SOCK_STREAM and s.state == tcp.CLOSE:
            options = _without_stale_maxseg(s.sock, options)
        try:
            program, _locked = sockopts.read_filter(s.sock)
        except sockopts.EbpfFilter:
            self._refuse(s, "an eBPF socket filter (SO_ATTACH_BPF), which cannot be read back")
        groups: tuple = ()
        datagrams: tuple = ()
        if s.proto in DATAGRAM_PROTOCOLS or s.type == socket.SOCK_RAW:
            try:
                groups = sockopts.multicast_groups(s.sock, sockopts.host_groups())
            except sockopts.SourceFilter as why:
                self._refuse(s, f"a source-filtered multicast membership ({why})")
            if s.type != socket.SOCK_RAW:
                datagrams = tuple(peek_datagrams(s.sock))
        backlog = _listener_counts(s.sock)[0] if s.proto == _TCP and s.state == tcp.LISTEN else 0
        if s.type == socket.SOCK_RAW:
            return InetSocket(ino=s.fd.ino, family=s.family, type=socket.SOCK_RAW, protocol=s.proto,
                              state=s.state, src=s.src, dst=s.dst, shutdown=_ping_shutdown(s.sock),
                              options=options, multicast=groups, filter=program)
        return InetSocket(ino=s.fd.ino, family=s.family,
                          type=socket.SOCK_STREAM if s.proto == _TCP else socket.SOCK_DGRAM,
                          protocol=s.proto, state=s.state if s.proto != _TCP or s.state == tcp.LISTEN else tcp.CLOSE,
                          mode=InetMode.CLOSED if s.mode is InetMode.CLOSED else InetMode.PLAIN,
                          src=s.src, sport=s.sport, dst=s.dst, dport=s.dport,
                          shutdown=diag.shutdown(s), backlog=backlog, options=options,
                          datagrams=datagrams, multicast=groups, filter=program)

    # -- the end of the dump ---------------------------------------------------------

    def release(self, *, killed: bool) -> None:
        """The dump is on disk.  Leave-running: the lock goes.  Killed (its processes are dead
        by now, ptckpt's copies keep the sockets): every dumped connection is closed in repair
        mode, so nothing goes to its peer; the lock stays until a restore releases it.  (Were
        ptckpt killed before that, the kernel's close would send FINs, which the lock drops.)"""
        if not killed:
            self._unlock()
        else:
            for sock in self.silence:
                with contextlib.suppress(OSError):
                    tcp.repair_on(sock)
            self._reset_orphans()
        self._close()
        if self.queue_lock is not None:
            netlock.unlock(self.queue_lock)
            self.queue_lock = None

    def abort(self) -> None:
        """The dump failed: every connection as it was (none is left in repair mode: each was
        only while it was read), the lock gone."""
        self._unlock()
        self._close()
        if self.queue_lock is not None:
            netlock.unlock(self.queue_lock)
            self.queue_lock = None

    def _reset_orphans(self) -> None:
        """A reset (with the right sequence number) ends each orphaned client at once."""
        for child, state in self.orphans:
            src, sport = child.getsockname()[:2]
            dst, dport = child.getpeername()[:2]
            with contextlib.suppress(PtckptError):
                rawpkt.send_tcp(src, sport, dst, dport, seq=state["snd_seq"], ack=0, flags=rawpkt.TCP_RST,
                                window=0, mark=netlock.PTCKPT_MARK)
        self.orphans.clear()
    def _unlock(self) -> None:
        if self.lock is not None:
            netlock.unlock(self.lock)
            self.lock = None

    def _close(self) -> None:
        for sock in self.accepted + self.copies:
            sock.close()
        self.accepted.clear()
        self.copies.clear()
        self.silence.clear()


def _segments(sock: socket.socket) -> int:
    """tcp_info's tcpi_segs_out + tcpi_segs_in: 0 for a TCP socket never connected."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 144)
    return sum(struct.unpack_from("II", info, 136)) if len(info) >= 144 else 1


def _without_stale_maxseg(sock: socket.socket, options: tuple) -> tuple:
    """A closed TCP socket answers TCP_MAXSEG with the MSS the program set (before a
    connect, kept) or else with the MSS of the connection it had (tcpi_snd_mss, up to
    65483 on loopback, more than a setsockopt takes): the latter is no setting of the
    program's and is left out (the next connect works it out again)."""
    snd_mss = struct.unpack_from("I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 20), 16)[0]
    return tuple(o for o in options if o[:2] != _MAXSEG or sockopts.option_value([o], *_MAXSEG) != snd_mss)


def _short(s: _Sock) -> str:
    proto = proto_name(s.type, s.proto)
    if s.type == socket.SOCK_RAW:
        return f"{proto} {s.src or 'unbound'}" + (f" -> {s.dst}" if s.state == tcp.ESTABLISHED else "")
    here = endpoint(s.src, s.sport) if s.sport else "unbound"
    connected = s.dport or s.proto != _TCP and s.state == tcp.ESTABLISHED
    return f"{proto} {here}" + (f" -> {endpoint(s.dst, s.dport)}" if connected else "")


def _poll(sock: socket.socket, extra: int = 0) -> int:
    p = select.poll()
    p.register(sock.fileno(), select.POLLIN | select.POLLERR | extra)
    events = p.poll(0)
    return events[0][1] if events else 0


def _listener_counts(sock: socket.socket) -> tuple[int, int]:
    """(backlog, connections in the accept queue) of a listener: tcp_info's tcpi_sacked and
    tcpi_unacked hold them for a socket in LISTEN (net/ipv4/tcp.c tcp_get_info)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 32)
    unacked, sacked = struct.unpack_from("II", info, 24)
    return sacked, unacked


@dataclass(frozen=True)
class _Ends:
    src: str
    sport: int
    dst: str
    dport: int


class _Index:
    """The inet_diag view of the network namespace, indexed once (a dump of a thousand
    connections asks it a thousand questions)."""

    def __init__(self, socks: list):
        self.socks = socks
        self.by_ino = {d.ino: d for d in socks if d.ino}
        self.by_ends = {}
        for d in socks:
            if d.state not in (tcp.LISTEN, tcp.TIME_WAIT):
                self.by_ends.setdefault((_norm(d.src), d.sport, _norm(d.dst), d.dport), d)

    def peer(self, conn):
        """The socket at the other end of a connection on this host (by the reversed
        4-tuple), or None: the peer is elsewhere."""
        return self.by_ends.get((_norm(conn.dst), conn.dport, _norm(conn.src), conn.sport))

    def shutdown(self, s: _Sock) -> int:
        if is_ping(s.proto):
            return _ping_shutdown(s.sock)
        d = self.by_ino.get(s.fd.ino)
        if d is None and s.proto in DATAGRAM_PROTOCOLS and s.sport:
            d = next(iter(inetdiag.inet_sockets(protocols=(s.proto,), families=(s.family,), inodes={s.fd.ino})), None)
        return d.shutdown if d is not None else 0


def _ping_shutdown(sock: socket.socket) -> int:
    """RCV_SHUTDOWN of a ping socket (sock_diag has no handler for them): datagram_poll
    reports it as POLLRDHUP, both ways shut as POLLHUP.  A send side shut alone shows
    nowhere but in a send, which a dump cannot try: it comes back open."""
    events = _poll(sock, select.POLLRDHUP)
    if events & select.POLLHUP:
        return RCV_SHUTDOWN | SEND_SHUTDOWN
    return RCV_SHUTDOWN if events & select.POLLRDHUP else 0


def ping_table(pid: int | str, family: int, raw: bool = False) -> dict[int, tuple[int, str]]:
    """{inode: (state, peer address)} of the ping sockets (`raw`: the raw sockets) of the
    network namespace of `pid`, from /proc/PID/net/icmp or icmp6 (raw, raw6: the same
    columns) (net/ipv4/ping.c ping_v4_format_sock: addresses as
    the hex of their 32-bit words in host byte order, then ":port" (the echo id), the
    state, queues, ..., the inode as the tenth field)."""
    name = ("raw" if raw else "icmp") + ("" if family == socket.AF_INET else "6")
    out: dict[int, tuple[int, str]] = {}
    try:
        lines = procfs.read_net_table(pid, name)[1:]
    except (OSError, PtckptError):
        return out
    for line in lines:
        fields = line.split()
        if len(fields) < 10:
            continue
        words = fields[2].split(":")[0]
        raw = b"".join(struct.pack("<I", int(words[i:i + 8], 16)) for i in range(0, len(words), 8))
        out[int(fields[9])] = (int(fields[3], 16), socket.inet_ntop(family, raw))
    return out


def _norm(addr: str) -> str:
    """An address as one text for both spellings of an IPv4 one (::ffff:a.b.c.d)."""
    try:
        x = ipaddress.ip_address(addr)
    except ValueError:
        return addr
    if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped:
        x = x.ipv4_mapped
    return str(x)


def _holder(ino: int, members: set[int]) -> str:
    if not ino:
        return "outside this host's sockets"
    found = procfs.fd_holders({f"socket:[{ino}]"}, members | {os.getpid()})
    for pid, fd in next(iter(found.values()), []):
        return f"held by pid {pid} fd {fd} ({procfs.comm_or_unknown(pid)}), outside the tree"
    return "held by no process of the tree"


# --- UDP queues -----------------------------------------------------------------------

def peek_datagrams(sock: socket.socket) -> list[tuple[str, int, bytes]]:
    """Every datagram queued on a UDP socket, with its sender, without consuming any:
    MSG_PEEK walked with SO_PEEK_OFF (each peek moves the offset past one datagram);
    the socket's own peek offset is put back."""
    old = sock.getsockopt(socket.SOL_SOCKET, SO_PEEK_OFF)
    out: list[tuple[str, int, bytes]] = []
    size = 65536
    try:
        offset = 0
        sock.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, 0)
        while True:
            try:
                data, _anc, flags, addr = sock.recvmsg(size, 0, socket.MSG_PEEK | socket.MSG_DONTWAIT
                                                       | socket.MSG_TRUNC)
            except BlockingIOError:
                break
            if flags & socket.MSG_TRUNC:         # a bigger datagram: again from its start
                size = max(size * 2, len(data) + 1)
                sock.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, offset)
                continue
            if not data and out and _zero_length_loop(out):
                break
            out.append((addr[0], addr[1], data))
            offset += len(data)
    finally:
        sock.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, old)
    return out


def _zero_length_loop(out) -> bool:
    """A run of 64 empty datagrams: a peek that does not move on (the kernel skips an empty
    datagram once peeked; a walk that sees them again is going round)."""
    return len(out) >= 64 and all(not d for _a, _p, d in out[-64:])


# --- restore half ---------------------------------------------------------------------

@dataclass
class InetRestore:
    """The tree's inet sockets made again in ptckpt: {desc: fd} for the stubs, and the
    repaired connections held until :meth:`finish`.  With `tcp_close` (restore
    --tcp-close) the connections dumped in repair mode come back closed instead, as dump
    --tcp-close makes them, and those that waited in an accept queue are dropped."""

    records: Sequence[InetSocket]
    netlock_id: str = ""
    tcp_close: bool = False
    repaired: list[tuple[socket.socket, int]] = field(default_factory=list)
    made: dict[int, socket.socket] = field(default_factory=dict)
    temps: list[socket.socket] = field(default_factory=list)

    def create(self, descs: Mapping[int, Fd]) -> dict[int, int]:
        """Make every socket of `descs` (their Fd.ino names the record): {desc: fd}; the
        caller owns the fds.  Listeners first, then the connections queued on them."""
        by_ino = {r.ino: r for r in self.records}
        pending = [r for r in self.records if r.mode is InetMode.PENDING and not self.tcp_close]
        clients = {p.ino: by_ino[p.peer] for p in pending if p.peer in by_ino}
        try:
            with rawpkt.RawSender(mark=netlock.PTCKPT_MARK) as raw:
                for r in self.records:
                    if r.mode is InetMode.PLAIN and r.protocol == _TCP and r.type == socket.SOCK_STREAM:
                        self.made[r.ino] = self._plain_tcp(r)
                for p in pending:
                    self._queue(p, clients.get(p.ino))
                for r in self.records:
                    if r.ino in self.made or r.mode is InetMode.PENDING:
                        continue
                    if r.mode is InetMode.REPAIRED and not self.tcp_close:
                        self.made[r.ino] = self._repaired(r, raw)
                    elif r.mode in (InetMode.CLOSED, InetMode.REPAIRED):
                        self.made[r.ino] = self._closed(r)
                    elif is_raw(r):
                        self.made[r.ino] = self._raw(r)
                    else:
                        self.made[r.ino] = self._datagram(r, raw)
            out: dict[int, int] = {}
            for d, f in descs.items():
                s = self.made.get(f.ino)
                if s is None:
                    raise RestoreFailed(f"fd {f.fd} ({f.path}): no record of its socket in the image")
                out[d] = os.dup(s.fileno())
                fcntl.fcntl(out[d], fcntl.F_SETFL, f.flags & ~O_ACCMODE)
            return out
        except OSError as err:
            self.abort()
            raise RestoreFailed(f"inet socket: {err.strerror or err}") from None
        except BaseException:
            self.abort()
            raise

    def _new(self, r: InetSocket) -> socket.socket:
        try:
            return socket.socket(r.family, r.type, r.protocol)
        except PermissionError as err:
            if not is_ping(r.protocol):
                raise
            raise OSError(err.errno, f"{describe(r)}: no ping socket for group {os.getgid()} in this network "
                                     f"namespace (add it to net.ipv4.ping_group_range)") from None

    def _plain_tcp(self, r: InetSocket) -> socket.socket:
        s = self._new(r)
        try:
            sockopts.apply_options(s, r.options)
            sockopts.attach_filter(s, r.filter)
            if r.sport:
                shared = self._shares_port(r)
                if shared:
                    # several sockets of the image on one address: they were bound with
                    # SO_REUSEPORT/SO_REUSEADDR, which some cleared afterwards
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                _bind(s, r)
                if r.state == tcp.LISTEN:
                    s.listen(r.backlog)
                if shared:
                    for opt in (socket.SO_REUSEPORT, socket.SO_REUSEADDR):
                        s.setsockopt(socket.SOL_SOCKET, opt,
                                     sockopts.option_value(r.options, socket.SOL_SOCKET, opt))
        except BaseException:
            s.close()
            raise
        return s

    def _shares_port(self, r: InetSocket) -> bool:
        return any(o is not r and o.mode is InetMode.PLAIN and o.protocol == r.protocol
                   and (o.src, o.sport) == (r.src, r.sport) for o in self.records)

    def _queue(self, p: InetSocket, client: InetSocket | None) -> None:
        """A connection waiting in a listener's accept queue, queued again: its client end
        (the tree's own, or a stand-in for a client that had closed) connects to the
        restored listener and sends what the server end had not read, then what it had
        itself not yet got through."""
        if client is not None:
            c = self._new(client)
            self.made[client.ino] = c
            sockopts.apply_options(c, [o for o in client.options if o[:2] != _MAXSEG])
            c.bind(_addr(client.family, client.src, client.sport))
            c.connect(_addr(client.family, client.dst, client.dport))
        else:
            c = self._new(p)
            self.temps.append(c)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            c.bind(_addr(p.family, p.dst, p.dport))
            c.connect(_addr(p.family, p.src, p.sport))
        data = p.recv_queue + (client.send_queue if client is not None else b"")
        if data:
            if c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < 2 * len(data):
                c.setsockopt(socket.SOL_SOCKET, sockopts.SO_SNDBUFFORCE, len(data) + 65536)
            c.sendall(data)
        closed = client is None or client.state in (tcp.FIN_WAIT1, tcp.FIN_WAIT2, tcp.CLOSING)
        if p.state in (tcp.CLOSE_WAIT,) or closed and client is not None:
            c.shutdown(socket.SHUT_WR)
        if client is None:
            c.shutdown(socket.SHUT_WR)

    def _repaired(self, r: InetSocket, raw: rawpkt.RawSender) -> socket.socket:
        reuse = sockopts.option_value(r.options, socket.SOL_SOCKET, socket.SO_REUSEADDR)

        def prepare(s: socket.socket) -> None:
            sockopts.apply_options(s, r.options, skip=frozenset({(socket.SOL_SOCKET, socket.SO_REUSEADDR), _MAXSEG}))

        def send_packet(src, sport, dst, dport, *, seq, ack, flags, window):
            raw.tcp(src, sport, dst, dport, seq=seq, ack=ack, flags=flags, window=window)

        s = tcp.make_stream(r, r.family, send_packet, prepare)
        # the window clamp the connection had grown to: connecting (in repair mode too) sets
        # it again from the buffer sizes of the moment, half of it or less
        clamp = sockopts.option_value(r.options, socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP)
        if clamp:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, clamp)
        if r.shutdown & RCV_SHUTDOWN and r.state not in (tcp.CLOSE_WAIT, tcp.LAST_ACK, tcp.CLOSING):
            s.shutdown(socket.SHUT_RD)
        self.repaired.append((s, reuse))
        return s

    def _closed(self, r: InetSocket) -> socket.socket:
        """dump --tcp-close, CRIU's meaning: a socket whose connection is over, both ways shut
        (state CLOSE, reads give end of file, poll POLLHUP, writes EPIPE), no error pending;
        made by connecting it in repair mode (no packet) and disconnecting it."""
        s = self._new(r)
        try:
            sockopts.apply_options(s, r.options, skip=frozenset({(socket.SOL_SOCKET, socket.SO_REUSEADDR), _MAXSEG}))
            tcp.repair_on(s)
            s.connect(_addr(r.family, r.dst or _loopback(r.family), r.dport or 9))
            s.setsockopt(socket.IPPROTO_TCP, tcp.TCP_REPAIR, tcp.REPAIR_OFF_NO_WP)
            _disconnect(s)
            with contextlib.suppress(OSError):    # both ways shut: EOF, not ENOTCONN
                s.shutdown(socket.SHUT_RDWR)
            s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)   # the disconnect's ECONNRESET, taken
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR,
                         sockopts.option_value(r.options, socket.SOL_SOCKET, socket.SO_REUSEADDR))
        except BaseException:
            s.close()
            raise
        return s

    def _datagram(self, r: InetSocket, raw: rawpkt.RawSender) -> socket.socket:
        """A UDP, UDP-Lite or ping socket: its options, address (a ping socket's port is its
        echo id), queued datagrams (UDP, UDP-Lite), peer, groups, filter and shutdown."""
        s = self._new(r)
        try:
            sockopts.apply_options(s, r.options)
            if r.sport:
                _bind(s, r)
            if r.datagrams:
                to = r.src if r.src and not ipaddress.ip_address(r.src).is_unspecified else _loopback(r.family)
                for sender, port, payload in r.datagrams:
                    raw.udp(sender, port, to, r.sport, payload, protocol=r.protocol)
                _check_refill(s, r)
            if r.dport or r.state == tcp.ESTABLISHED:
                s.connect(_addr(r.family, r.dst, r.dport))
            _groups_filter_shutdown(s, r)
        except BaseException:
            s.close()
            raise
        return s

    def _raw(self, r: InetSocket) -> socket.socket:
        """A raw socket: its protocol, options (IP_HDRINCL, ICMP_FILTER, ... among them),
        address (a raw socket has no port), peer, groups, filter and shutdown."""
        try:
            s = socket.socket(r.family, socket.SOCK_RAW, r.protocol)
        except PermissionError:
            raise OSError(_errno.EPERM, f"{describe(r)}: making a raw socket needs CAP_NET_RAW") from None
        try:
            sockopts.apply_options(s, r.options)
            if r.src:
                _bind(s, r)
            if r.state == tcp.ESTABLISHED:
                s.connect(_addr(r.family, r.dst, 0))
            _groups_filter_shutdown(s, r)
        except BaseException:
            s.close()
            raise
        return s

    def finish(self) -> None:
        """The processes are rebuilt and hold their sockets: the lock goes, then repair mode
        ends on every connection (a window probe each), with SO_REUSEADDR put back."""
        if self.netlock_id:
            netlock.unlock(self.netlock_id)
        for s, reuse in self.repaired:
            tcp.leave_repair(s, reuse)
        self.close()

    def abort(self) -> None:
        """A failed restore: every socket closed, the repaired ones silently (repair mode):
        their peers keep waiting under the lock, and a new restore can try again."""
        self.close()

    def close(self) -> None:
        for s in list(self.made.values()) + self.temps:
            s.close()
        self.made.clear()
        self.temps.clear()
        self.repaired.clear()


def _addr(family: int, host: str, port: int):
    return (host, port) if family == socket.AF_INET else (host, port, 0, 0)


def _loopback(family: int) -> str:
    return "127.0.0.1" if family == socket.AF_INET else "::1"


IP_FREEBIND = 15


def _bind(s: socket.socket, r: InetSocket) -> None:
    """Bind `s` to the record's address.  An address that is not (or no longer, or not yet:
    an IPv6 one still tentative) one of this host's was bound with IP_FREEBIND or
    IP_TRANSPARENT, which the program may have turned off since: bound again with
    IP_FREEBIND for the bind alone, then set back as recorded."""
    addr = _addr(r.family, r.src or ("0.0.0.0" if r.family == socket.AF_INET else "::"), r.sport)
    try:
        try:
            s.bind(addr)
        except OSError as err:
            freebind = sockopts.option_value(r.options, socket.SOL_IP, IP_FREEBIND)
            if err.errno != _errno.EADDRNOTAVAIL or freebind:
                raise
            s.setsockopt(socket.SOL_IP, IP_FREEBIND, 1)
            s.bind(addr)
            s.setsockopt(socket.SOL_IP, IP_FREEBIND, freebind)
    except OSError as err:
        if err.errno == _errno.EADDRINUSE:
            raise OSError(err.errno, f"{describe(r)}: the address is in use (is the original still "
                                     f"running? restore it in a network namespace of its own: --netns)") from None
        raise OSError(err.errno, f"{describe(r)}: bind: {err.strerror}") from None


def _check_refill(s: socket.socket, r: InetSocket) -> None:
    """Every datagram arrived, in order, from its sender (the kernel may drop one)."""
    got = peek_datagrams(s)
    want = [(ipaddress.ip_address(a), p, d) for a, p, d in r.datagrams]
    have = [(ipaddress.ip_address(a), p, d) for a, p, d in got]
    if have != want:
        raise OSError(_errno.EIO, f"{describe(r)}: {len(have)} of {len(want)} queued datagrams arrived "
                                  f"when refilling its queue")


_libc = sockopts._libc


def _disconnect(s: socket.socket) -> None:
    """connect(AF_UNSPEC): TCP disconnects, the socket reports ECONNRESET once."""
    import ctypes
    sa = ctypes.create_string_buffer(struct.pack("H14x", socket.AF_UNSPEC), 16)
    if _libc.connect(s.fileno(), sa, 16) < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def stale_lock_cleanup() -> list[str]:
    """Locks whose dumper died (ptckpt killed mid-dump): the connections they held go on.

    A lock whose owner is gone is stale unless its image is complete and names it (a
    dump --kill that finished: the lock waits for a restore).  For a stale lock, every
    connection still present in repair mode leaves it (the dumper died before it could),
    then the lock goes.  Returns one line per lock removed.

    Where nft cannot be used (not installed, or a user without CAP_NET_ADMIN) no lock
    can have been made by this user either: there is nothing to look for."""
    done = []
    try:
        found = netlock.list_locks()
    except netlock.NetLockUnavailable:
        return done
    for info in found:
        if netlock.owner_alive(info):
            continue
        present = _repair_leftovers(info)
        if not present and _image_holds(info):
            continue
        netlock.unlock(info)
        done.append(f"removed the network lock {info.id} of a dump that did not finish "
                    f"(pid {info.owner_pid}, {info.image_dir})"
                    + (f"; {present} connections left repair mode" if present else ""))
    return done


def _image_holds(info) -> bool:
    from ..formats.image import ImageReader
    try:
        return ImageReader.read_inventory(info.image_dir).netlock == info.id
    except PtckptError:
        return False


def _repair_leftovers(info) -> int:
    """Connections of the lock still alive: those still in repair mode leave it."""
    live = {}
    for conn in info.connections:
        if conn.ino:
            live[conn.ino] = conn
    if not live:
        return 0
    socks = {d.ino: d for d in inetdiag.inet_sockets(protocols=(_TCP,), inodes=set(live))}
    if not socks:
        return 0
    found = procfs.fd_holders({f"socket:[{ino}]" for ino in socks}, set())
    count = 0
    for link, holders in found.items():
        ino = int(link[8:-1])
        pid, fd = holders[0]
        with contextlib.suppress(PtckptError, OSError):
            copy = socket.socket(fileno=pidfd_getfd(pid, fd))
            with copy:
                if tcp.in_repair(copy):
                    tcp.leave_repair(copy, live[ino].reuseaddr)
                    count += 1
    return count


def _groups_filter_shutdown(s: socket.socket, r: InetSocket) -> None:
    """The last of a datagram or raw socket: its multicast groups, its filter, its shutdown
    (one answering ENOTCONN, as for a socket never connected, shut all the same)."""
    sockopts.join_groups(s, r.multicast)
    sockopts.attach_filter(s, r.filter)
    if r.shutdown:
        how = {RCV_SHUTDOWN: socket.SHUT_RD, SEND_SHUTDOWN: socket.SHUT_WR}.get(r.shutdown, socket.SHUT_RDWR)
        try:
            s.shutdown(how)
        except OSError as err:
            if err.errno != _errno.ENOTCONN:
                raise
