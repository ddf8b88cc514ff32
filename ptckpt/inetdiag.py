"""TCP and UDP sockets (IPv4, IPv6) as inet_diag reports them (layer 2).

* :func:`inet_sockets` asks NETLINK_SOCK_DIAG (SOCK_DIAG_BY_FAMILY, struct
  inet_diag_req_v2, one dump per family x protocol) for the TCP and UDP
  sockets of a network namespace and parses the replies into
  :class:`InetSock` records (include/uapi/linux/inet_diag.h,
  net/ipv4/inet_diag.c, tcp_diag.c, udp_diag.c);
* :func:`find_connection` finds one TCP connection by its 4-tuple;
* :func:`pending_children` picks, from a listing, the connections a
  listener has completed but not yet handed to accept().

sock_diag answers for the network namespace of the netlink socket that
asks, i.e. of the calling thread when :func:`inet_sockets` runs: enter
another namespace (:func:`ptckpt.netns.entered`) to list its sockets.

The netlink plumbing (header, attributes, errors) is :mod:`ptckpt.sockdiag`'s.
Errors are translated at its choke point, ``_wrap_oserror``, on every public
function: EPROTONOSUPPORT / EAFNOSUPPORT creating the netlink socket and
ENOENT in the dump's NLMSG_ERROR (no inet_diag / tcp_diag / udp_diag
handler) -> :class:`SockDiagUnavailable` (exit code MISSING_FEATURE); any
other OSError -> :class:`SockDiagError`.  Bad arguments raise ValueError.

What the kernel does, as measured on Linux 6.18 (x86_64, root)
--------------------------------------------------------------

Which sockets are listed:

* An unbound socket (TCP or UDP) is absent: only hashed sockets are walked.
  A UDP socket appears once bound, or autobound by its first sendto
  (0.0.0.0:PORT, CLOSE).
* A TCP socket that is bound but neither listening nor connected is absent
  unless the request carries the TCP_BOUND_INACTIVE (13) bit in
  idiag_states (6.8+; ``bound_inactive=True`` here).  It is then reported
  with state CLOSE (7), its inode and its attributes; a request for CLOSE
  alone does not list it, and a request with all 32 bits set does.  Older
  kernels ignore the bit.
* A TCP socket bound by the user whose connect() failed (ECONNREFUSED) is
  absent even then: the kernel released the port (another socket can bind
  it) although getsockname() still reports it.
* Request sockets (a SYN answered, the final ACK not yet taken, e.g. held
  back by TCP_DEFER_ACCEPT) have sk_state NEW_SYN_RECV internally but are
  REPORTED as SYN_RECV (3), with ino 0 and no attributes.  Either the
  SYN_RECV or the NEW_SYN_RECV bit of idiag_states selects them; state 12
  never appears in a reply.
* TIME_WAIT sockets: ino 0, uid 0, no attributes (shutdown 0).  An orphan
  (its file closed) that reached FIN_WAIT2 is also a timewait mini-socket,
  reported as FIN_WAIT2 with ino 0 and no attributes.  An orphan still
  sending (closed with unacked data) is a full socket: FIN_WAIT1, ino 0,
  shutdown 3, wqueue = the bytes + 1 for the FIN.
* Connections of a dual-stack AF_INET6 socket (listener on ::, or a client
  connecting to ::ffff:a.b.c.d) are AF_INET6 sockets with v4-mapped
  addresses ("::ffff:127.0.0.1"): they appear in the AF_INET6 dump, never
  in the AF_INET one.

Fields:

* Listener: rqueue is the accept queue (connections completed, not
  accepted; request sockets do not count until completed), wqueue the
  backlog given to listen().
* Connections completed but not accepted are full sockets with ino 0 in
  ESTABLISHED, or CLOSE_WAIT once the client sent FIN (shutdown 1 then).
  Their rqueue holds what the client sent before accept().  The dump lists
  them in established-hash order, not in connect order: twelve connections
  made in a row came out shuffled, while accept() returned them in connect
  order (the accept queue is FIFO).  Nothing in inet_diag recovers that
  order; cookies are allocated lazily, at the first query, in listing order.
* TCP rqueue is rcv_nxt - copied_seq: the unread bytes, plus 1 once a FIN
  arrived (CLOSE_WAIT with 3 unread bytes shows 4).  wqueue is write_seq -
  snd_una: bytes sent and not yet acked plus unsent ones (on loopback 0
  unless the peer's window is full; then it equals SIOCOUTQ).
* INET_DIAG_SHUTDOWN comes with every full socket whether asked or not:
  shutdown(SHUT_WR) gives SEND_SHUTDOWN (2) on the closer (FIN_WAIT2) and
  RCV_SHUTDOWN (1) on its peer (CLOSE_WAIT); SHUT_RD gives 1 locally.
* INET_DIAG_SKV6ONLY is sent only for AF_INET6 sockets in LISTEN or CLOSE
  (listeners, bound-inactive TCP, unconnected UDP): v6only is None for a
  connected one.  Binding a specific, non-mapped IPv6 address (::1) sets
  v6only by itself (IPV6_V6ONLY then reads 1); a socket bound to :: shows
  its IPV6_V6ONLY option.
* UDP: an unconnected socket is CLOSE with dst 0.0.0.0:0 / :::0, a
  connected one ESTABLISHED with its peer.  rqueue is sk_rmem_alloc, the
  memory of the queued datagrams, not bytes (10-, 1000- and 0-byte
  datagrams: 3968); wqueue is sk_wmem_alloc, 0 on loopback once a send
  returned.
* ifindex (idiag_if) is the SO_BINDTODEVICE device (1 for lo), 0 if none.
* cookie: the socket cookie (SO_COOKIE), two u32 in host order, low first.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ptckpt.sockdiag import (
    _MISSING_ERRNOS_DIAG,
    _NLMSGHDR,
    NETLINK_SOCK_DIAG,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    SOCK_DIAG_BY_FAMILY,
    SockDiagError,
    _attributes,
    _wrap_oserror,
    netlink_dump,
)

# --- kernel constants ---------------------------------------------------------

# include/net/tcp_states.h
TCP_ESTABLISHED = 1
TCP_SYN_SENT = 2
TCP_SYN_RECV = 3
TCP_FIN_WAIT1 = 4
TCP_FIN_WAIT2 = 5
TCP_TIME_WAIT = 6
TCP_CLOSE = 7
TCP_CLOSE_WAIT = 8
TCP_LAST_ACK = 9
TCP_LISTEN = 10
TCP_CLOSING = 11
TCP_NEW_SYN_RECV = 12
TCP_BOUND_INACTIVE = 13     # inet_diag request bit only (6.8+): bound, not listening, not connected

TCP_STATE_NAMES = {
    TCP_ESTABLISHED: "ESTABLISHED", TCP_SYN_SENT: "SYN_SENT", TCP_SYN_RECV: "SYN_RECV",
    TCP_FIN_WAIT1: "FIN_WAIT1", TCP_FIN_WAIT2: "FIN_WAIT2", TCP_TIME_WAIT: "TIME_WAIT",
    TCP_CLOSE: "CLOSE", TCP_CLOSE_WAIT: "CLOSE_WAIT", TCP_LAST_ACK: "LAST_ACK",
    TCP_LISTEN: "LISTEN", TCP_CLOSING: "CLOSING", TCP_NEW_SYN_RECV: "NEW_SYN_RECV",
    TCP_BOUND_INACTIVE: "BOUND_INACTIVE",
}

# every real state, 1..12 (TIME_WAIT and NEW_SYN_RECV included, BOUND_INACTIVE not)
ALL_STATES = sum(1 << s for s in range(TCP_ESTABLISHED, TCP_NEW_SYN_RECV + 1))

# include/net/sock.h: sk_shutdown bits
RCV_SHUTDOWN = 1
SEND_SHUTDOWN = 2

# include/uapi/linux/inet_diag.h: attributes of a reply
INET_DIAG_SHUTDOWN = 8
INET_DIAG_PROTOCOL = 10
INET_DIAG_SKV6ONLY = 11

_INET_DIAG_REQ_V2 = struct.Struct("=BBBBI")       # family, protocol, ext, pad, states (+ sockid)
_INET_DIAG_SOCKID = struct.Struct(">HH16s16s")    # sport, dport, src, dst (network order)
_INET_DIAG_SOCKID_TAIL = struct.Struct("=I2I")    # if, cookie[2] (host order)
_INET_DIAG_MSG_HEAD = struct.Struct("=BBBB")      # family, state, timer, retrans
_INET_DIAG_MSG_TAIL = struct.Struct("=IIIII")     # expires, rqueue, wqueue, uid, inode
_SOCKID_SIZE = _INET_DIAG_SOCKID.size + _INET_DIAG_SOCKID_TAIL.size
_INET_DIAG_MSG_SIZE = _INET_DIAG_MSG_HEAD.size + _SOCKID_SIZE + _INET_DIAG_MSG_TAIL.size

_NL_TIMEOUT = 5.0
_DUMP_TRIES = 3

_ADDR_LEN = {socket.AF_INET: 4, socket.AF_INET6: 16}
_PROTOCOLS = frozenset({socket.IPPROTO_TCP, socket.IPPROTO_UDP, 136})   # 136: IPPROTO_UDPLITE


# --- records ------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class InetSock:
    """One TCP or UDP socket as inet_diag reports it (struct inet_diag_msg + attributes)."""

    family: int             # socket.AF_INET / AF_INET6 (sk_family: a dual-stack socket is AF_INET6)
    protocol: int           # socket.IPPROTO_TCP / IPPROTO_UDP
    state: int              # TCP_* (UDP: TCP_CLOSE, or TCP_ESTABLISHED once connected)
    src: str                # local address as socket.inet_ntop prints it
    sport: int
    dst: str                # peer address ("0.0.0.0" / "::" when none)
    dport: int
    ino: int                # socket inode; 0: no file (not accepted yet, TIME_WAIT, orphan)
    uid: int
    rqueue: int             # listener: accept queue length; TCP: bytes unread; UDP: rmem
    wqueue: int             # listener: backlog; TCP: bytes not acked; UDP: wmem
    ifindex: int            # SO_BINDTODEVICE index, 0 for none
    shutdown: int           # RCV_SHUTDOWN | SEND_SHUTDOWN, 0 if not reported
    cookie: int             # the socket cookie (SO_COOKIE)
    v6only: bool | None     # IPV6_V6ONLY of an AF_INET6 socket when reported, else None

    @property
    def tcp_state_name(self) -> str:
        """The state's name as in include/net/tcp_states.h, without TCP_ ("LISTEN")."""
        return TCP_STATE_NAMES.get(self.state, f"STATE_{self.state}")


# --- requests and replies ----------------------------------------------------------

def _ext_bit(attr: int) -> int:
    return 1 << (attr - 1)


def _dump_request(family: int, protocol: int, states: int, seq: int) -> bytes:
    """A SOCK_DIAG_BY_FAMILY dump request (struct inet_diag_req_v2, zero sockid)."""
    req = (_INET_DIAG_REQ_V2.pack(family, protocol, _ext_bit(INET_DIAG_SHUTDOWN), 0, states)
           + bytes(_SOCKID_SIZE))
    hdr = _NLMSGHDR.pack(_NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY,
                         NLM_F_REQUEST | NLM_F_DUMP, seq, 0)
    return hdr + req


def _ntop(family: int, raw: bytes) -> str:
    return socket.inet_ntop(family, raw[: _ADDR_LEN[family]])


def _parse_inet_diag_msg(data: bytes, offset: int, end: int, protocol: int) -> InetSock:
    """One struct inet_diag_msg and its attributes -> InetSock."""
    if end - offset < _INET_DIAG_MSG_SIZE:
        raise SockDiagError("inet_diag", f"short inet_diag_msg ({end - offset} bytes)")
    family, state, _timer, _retrans = _INET_DIAG_MSG_HEAD.unpack_from(data, offset)
    pos = offset + _INET_DIAG_MSG_HEAD.size
    sport, dport, src, dst = _INET_DIAG_SOCKID.unpack_from(data, pos)
    pos += _INET_DIAG_SOCKID.size
    ifindex, c0, c1 = _INET_DIAG_SOCKID_TAIL.unpack_from(data, pos)
    pos += _INET_DIAG_SOCKID_TAIL.size
    _expires, rqueue, wqueue, uid, ino = _INET_DIAG_MSG_TAIL.unpack_from(data, pos)
    shutdown = 0
    v6only = None
    for atype, payload in _attributes(data, offset + _INET_DIAG_MSG_SIZE, end):
        if atype == INET_DIAG_SHUTDOWN and payload:
            shutdown = payload[0]
        elif atype == INET_DIAG_SKV6ONLY and payload:
            v6only = bool(payload[0])
        elif atype == INET_DIAG_PROTOCOL and payload:
            protocol = payload[0]
    if family not in _ADDR_LEN:
        raise SockDiagError("inet_diag", f"unexpected address family {family}")
    return InetSock(family=family, protocol=protocol, state=state,
                    src=_ntop(family, src), sport=sport, dst=_ntop(family, dst), dport=dport,
                    ino=ino, uid=uid, rqueue=rqueue, wqueue=wqueue, ifindex=ifindex,
                    shutdown=shutdown, cookie=c0 | (c1 << 32), v6only=v6only)


def _check_arguments(protocols: Sequence[int], families: Sequence[int], states: int) -> None:
    for protocol in protocols:
        if protocol not in _PROTOCOLS:
            raise ValueError(f"protocol {protocol} is not TCP, UDP or UDP-Lite")
    for family in families:
        if family not in _ADDR_LEN:
            raise ValueError(f"family {family} is not AF_INET or AF_INET6")
    if not 0 <= states <= 0xFFFFFFFF:
        raise ValueError(f"states {states:#x} is not a 32-bit mask")


@_wrap_oserror("sock_diag query of inet sockets", _MISSING_ERRNOS_DIAG)
def inet_sockets(*, protocols: Iterable[int] = (socket.IPPROTO_TCP, socket.IPPROTO_UDP),
                 families: Iterable[int] = (socket.AF_INET, socket.AF_INET6),
                 states: int = ALL_STATES, inodes: set[int] | None = None,
                 bound_inactive: bool = False) -> list[InetSock]:
    """The TCP/UDP sockets of our network namespace, as the kernel lists them.

    One dump per family x protocol, in the order given; within a dump, the
    kernel's order (hash-table order, see module doc).  `states` is a mask
    of 1 << TCP_* (the default, ALL_STATES, is every state from ESTABLISHED
    to NEW_SYN_RECV; request sockets come as SYN_RECV).  `bound_inactive`
    adds TCP sockets that are bound but neither listening nor connected
    (the TCP_BOUND_INACTIVE pseudo-state of 6.8+; they are reported as
    CLOSE; older kernels ignore the bit).  With `inodes`, only sockets whose
    inode is in that set (so no inode-less ones).  A dump the kernel flags
    as interrupted (NLM_F_DUMP_INTR) is repeated.

    The namespace is the calling thread's, at the time of the call (the
    netlink socket's): call it inside :func:`ptckpt.netns.entered` to list
    another namespace.
    """
    protocols = tuple(protocols)
    families = tuple(families)
    _check_arguments(protocols, families, states)
    if bound_inactive:
        states |= 1 << TCP_BOUND_INACTIVE
    result: list[InetSock] = []
    seq = 0
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(_NL_TIMEOUT)
        for family in families:
            for protocol in protocols:
                for _attempt in range(_DUMP_TRIES):
                    seq += 1
                    socks, interrupted = netlink_dump(
                        nl, _dump_request(family, protocol, states, seq), seq,
                        lambda data, body, end: _parse_inet_diag_msg(data, body, end, protocol), "inet_diag")
                    if not interrupted:
                        break
                result.extend(s for s in socks if inodes is None or s.ino in inodes)
    return result


def _packed(family: int, address: str) -> bytes:
    """An address text as bytes, so that "::1" and "0::1" compare equal."""
    try:
        return socket.inet_pton(family, address)
    except (OSError, ValueError):
        raise ValueError(f"{address!r} is not an address of family {family}") from None


@_wrap_oserror("sock_diag lookup of a TCP connection", _MISSING_ERRNOS_DIAG)
def find_connection(family: int, src: str, sport: int, dst: str, dport: int) -> InetSock | None:
    """The TCP socket with exactly this local and remote address and port, any state.

    `family` is the socket's (a dual-stack AF_INET6 socket talking IPv4 has
    "::ffff:a.b.c.d" addresses).  None when there is none.  Should the
    4-tuple be listed twice (a TIME_WAIT socket being recycled), a socket
    with a file (ino != 0) comes first.  Costs one dump of that family's TCP
    sockets: the kernel's exact lookup (a non-dump request) misses sockets
    bound to a device (SO_BINDTODEVICE) and answers with the listener when
    no connection matches, so a dump filtered here is the safe way.
    """
    if family not in _ADDR_LEN:
        raise ValueError(f"family {family} is not AF_INET or AF_INET6")
    want = (_packed(family, src), sport, _packed(family, dst), dport)
    found = [s for s in inet_sockets(protocols=(socket.IPPROTO_TCP,), families=(family,))
             if (_packed(family, s.src), s.sport, _packed(family, s.dst), s.dport) == want]
    found.sort(key=lambda s: s.ino == 0)            # stable: kernel order otherwise
    return found[0] if found else None


_CHILD_STATES = frozenset({TCP_ESTABLISHED, TCP_CLOSE_WAIT})
_V4MAPPED_PREFIX = bytes(10) + b"\xff\xff"


def _wildcard(family: int) -> bytes:
    return bytes(_ADDR_LEN[family])


def _claim(listener: InetSock, child: InetSock) -> int:
    """How strongly `listener` matches a connection `child` (-1: not at all).

    The kernel's listener lookup prefers an exact local address over the
    wildcard one (inet_lhash2 by address first), and a listener bound to
    the child's device over one that is not.
    """
    if (listener.protocol != socket.IPPROTO_TCP or listener.state != TCP_LISTEN
            or listener.family != child.family or listener.sport != child.sport):
        return -1
    if listener.ifindex and listener.ifindex != child.ifindex:
        return -1
    laddr = _packed(listener.family, listener.src)
    caddr = _packed(child.family, child.src)
    if laddr == caddr:
        score = 4
    elif laddr == _wildcard(listener.family):
        if listener.v6only and caddr.startswith(_V4MAPPED_PREFIX):
            return -1
        score = 2
    else:
        return -1
    return score + (1 if listener.ifindex else 0)


def pending_children(listener: InetSock, socks: Iterable[InetSock]) -> list[InetSock]:
    """The connections of `listener` that are complete but not accepted yet.

    They are the TCP sockets of `socks` without a file (ino 0) in
    ESTABLISHED or CLOSE_WAIT (the client already sent FIN) whose local
    address and port are the listener's; a wildcard listener (0.0.0.0, ::)
    takes every local address of its family, and a dual-stack AF_INET6
    listener (v6only False) also the IPv4 ones, which appear as AF_INET6
    sockets with "::ffff:a.b.c.d" addresses.  A connection that another
    listener of `socks` matches more closely (an exact address, a bound
    device) is left to that one.  Members of one SO_REUSEPORT group match
    equally: each gets every connection of the group.

    Half-open requests (reported as SYN_RECV, including those held back by
    TCP_DEFER_ACCEPT) are not included: accept() cannot return them yet.
    The order is the kernel's listing order, which is NOT the accept order
    (see module doc): inet_diag gives no way to recover the latter.
    """
    if listener.protocol != socket.IPPROTO_TCP or listener.state != TCP_LISTEN:
        raise ValueError(f"not a TCP listener: {listener.tcp_state_name} "
                         f"{listener.src}:{listener.sport}")
    socks = list(socks)
    rivals = [s for s in socks
              if s.protocol == socket.IPPROTO_TCP and s.state == TCP_LISTEN
              and s.family == listener.family and s.sport == listener.sport
              and s.cookie != listener.cookie]
    children = []
    for sock in socks:
        if (sock.protocol != socket.IPPROTO_TCP or sock.ino != 0
                or sock.state not in _CHILD_STATES):
            continue
        claim = _claim(listener, sock)
        if claim >= 0 and all(_claim(r, sock) <= claim for r in rivals):
            children.append(sock)
    return children
