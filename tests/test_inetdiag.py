"""ptckpt.inetdiag against real TCP and UDP sockets on the loopback device.

No mocks: each test makes real sockets on 127.0.0.1 / ::1 with kernel-chosen
ports, asks inet_diag about them and checks the fields against what the
sockets themselves report (fstat inode, SO_COOKIE, SIOCOUTQ).  Every socket
is made through the `make` fixture, which closes it at teardown.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Callable, Iterator

import pytest

from ptckpt import inetdiag
from ptckpt.inetdiag import (
    ALL_STATES,
    RCV_SHUTDOWN,
    SEND_SHUTDOWN,
    TCP_CLOSE,
    TCP_CLOSE_WAIT,
    TCP_ESTABLISHED,
    TCP_FIN_WAIT2,
    TCP_LISTEN,
    TCP_SYN_RECV,
    TCP_TIME_WAIT,
    InetSock,
    find_connection,
    inet_sockets,
    pending_children,
)

from conftest import wait_until

V4, V6 = socket.AF_INET, socket.AF_INET6
TCP, UDP = socket.IPPROTO_TCP, socket.IPPROTO_UDP
SO_COOKIE = 57          # asm-generic/socket.h
SIOCOUTQ = 0x5411


# --- helpers ------------------------------------------------------------------

@pytest.fixture
def make() -> Iterator[Callable[..., socket.socket]]:
    """make(family=V4, type=SOCK_STREAM) -> a socket closed at teardown;
    make.track(sock) registers one made elsewhere (accept, create_connection)."""
    made: list[socket.socket] = []

    def factory(family: int = V4, type: int = socket.SOCK_STREAM) -> socket.socket:
        s = socket.socket(family, type)
        made.append(s)
        return s

    def track(s: socket.socket) -> socket.socket:
        made.append(s)
        return s

    factory.track = track
    yield factory
    for s in made:
        s.close()


def ino(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


def cookie(s: socket.socket) -> int:
    return struct.unpack("=Q", s.getsockopt(socket.SOL_SOCKET, SO_COOKIE, 8))[0]


def diag(s: socket.socket, **kwargs) -> InetSock:
    """The one record of socket s (found by inode)."""
    found = inet_sockets(inodes={ino(s)}, **kwargs)
    assert len(found) == 1, found
    return found[0]


def listener(make, family: int = V4, addr: str = "127.0.0.1", backlog: int = 8,
             v6only: bool | None = None, port: int = 0) -> socket.socket:
    s = make(family)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
    s.bind((addr, port))
    s.listen(backlog)
    return s


def connect(make, addr: str, port: int, family: int = V4) -> socket.socket:
    c = make(family)
    c.connect((addr, port))
    return c


def accept(make, lsock: socket.socket) -> socket.socket:
    return make.track(lsock.accept()[0])


def port_of(s: socket.socket) -> int:
    return s.getsockname()[1]


def on_port(port: int, **kwargs) -> list[InetSock]:
    return [s for s in inet_sockets(protocols=(TCP,), **kwargs) if port in (s.sport, s.dport)]


def tcp_pair(make, family: int = V4, addr: str = "127.0.0.1"):
    """(listener, client, accepted) connected over loopback."""
    lsock = listener(make, family, addr)
    c = connect(make, addr, port_of(lsock), family)
    return lsock, c, accept(make, lsock)


# --- listeners and pending connections ------------------------------------------

def test_listener_fields(make):
    lsock = listener(make, backlog=7)
    rec = diag(lsock)
    assert (rec.family, rec.protocol, rec.state) == (V4, TCP, TCP_LISTEN)
    assert rec.tcp_state_name == "LISTEN"
    assert (rec.src, rec.sport, rec.dst, rec.dport) == ("127.0.0.1", port_of(lsock), "0.0.0.0", 0)
    assert (rec.rqueue, rec.wqueue) == (0, 7)
    assert rec.uid == os.getuid()
    assert rec.cookie == cookie(lsock)
    assert (rec.ifindex, rec.shutdown, rec.v6only) == (0, 0, None)
    assert pending_children(rec, inet_sockets()) == []


def test_pending_children_counted_and_found(make):
    lsock = listener(make, backlog=7)
    port = port_of(lsock)
    clients = []
    for i in range(3):
        c = connect(make, "127.0.0.1", port)
        c.sendall(b"x" * (i + 1))
        clients.append(c)
    by_port = {port_of(c): i + 1 for i, c in enumerate(clients)}

    def settled():
        socks = inet_sockets(protocols=(TCP,))
        rec = next(s for s in socks if s.ino == ino(lsock))
        kids = pending_children(rec, socks)
        return (rec, kids) if sum(k.rqueue for k in kids) == 6 else None
    rec, kids = wait_until(settled, timeout=5)
    assert (rec.rqueue, rec.wqueue) == (3, 7)
    assert {k.dport: k.rqueue for k in kids} == by_port
    for k in kids:
        assert (k.ino, k.state, k.src, k.sport, k.dst) == (0, TCP_ESTABLISHED, "127.0.0.1",
                                                           port, "127.0.0.1")
    # accept() hands them out in connect order, whatever the listing order
    first = accept(make, lsock)
    assert first.getpeername()[1] == port_of(clients[0])
    # a client that sends FIN before accept: CLOSE_WAIT, still pending, FIN counted
    clients[2].shutdown(socket.SHUT_WR)

    def after():
        socks = inet_sockets(protocols=(TCP,))
        rec = next(s for s in socks if s.ino == ino(lsock))
        kids = {k.dport: k for k in pending_children(rec, socks)}
        closing = kids.get(port_of(clients[2]))
        return (rec, kids) if closing is not None and closing.state == TCP_CLOSE_WAIT else None
    rec, kids = wait_until(after, timeout=5)
    assert rec.rqueue == 2
    assert set(kids) == {port_of(clients[1]), port_of(clients[2])}
    waiting = kids[port_of(clients[2])]
    assert (waiting.rqueue, waiting.shutdown) == (3 + 1, RCV_SHUTDOWN)


def test_request_sockets_are_not_pending(make):
    """TCP_DEFER_ACCEPT holds the connection as a request socket until data arrives."""
    lsock = make()
    lsock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, 5)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(4)
    port = port_of(lsock)
    c = connect(make, "127.0.0.1", port)
    socks = inet_sockets(protocols=(TCP,), families=(V4,))
    rec = next(s for s in socks if s.ino == ino(lsock))
    server_side = [s for s in socks if s.sport == port and s.dport == port_of(c)]
    assert [(s.state, s.ino) for s in server_side] == [(TCP_SYN_RECV, 0)]
    assert rec.rqueue == 0
    assert pending_children(rec, socks) == []
    c.sendall(b"go")

    def child():
        socks = inet_sockets(protocols=(TCP,), families=(V4,))
        rec = next(s for s in socks if s.ino == ino(lsock))
        return pending_children(rec, socks)
    (kid,) = wait_until(child, timeout=5)
    assert (kid.state, kid.dport, kid.rqueue) == (TCP_ESTABLISHED, port_of(c), 2)


def test_pending_children_prefer_the_exact_listener(make):
    """A 127.0.0.1 listener beats a 0.0.0.0 one of the same SO_REUSEPORT port."""
    wild = make()
    wild.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    wild.bind(("0.0.0.0", 0))
    wild.listen(4)
    port = port_of(wild)
    exact = make()
    exact.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    exact.bind(("127.0.0.1", port))
    exact.listen(4)
    for _ in range(2):
        connect(make, "127.0.0.1", port)
    socks = inet_sockets(protocols=(TCP,))
    rec_wild = next(s for s in socks if s.ino == ino(wild))
    rec_exact = next(s for s in socks if s.ino == ino(exact))
    assert (rec_wild.rqueue, rec_exact.rqueue) == (0, 2)        # the kernel agrees
    assert pending_children(rec_wild, socks) == []
    assert len(pending_children(rec_exact, socks)) == 2
    # without the rival in the list, the wildcard listener would claim them
    assert len(pending_children(rec_wild, [s for s in socks if s != rec_exact])) == 2


def test_pending_children_rejects_a_non_listener(make):
    _l, c, _a = tcp_pair(make)
    with pytest.raises(ValueError, match="not a TCP listener"):
        pending_children(diag(c), [])


# --- connections ------------------------------------------------------------------

def test_established_with_unread_data(make):
    lsock, c, a = tcp_pair(make)
    c.sendall(b"hello")
    rec_a = wait_until(lambda: (r := diag(a)).rqueue == 5 and r, timeout=5)
    rec_c = diag(c)
    assert (rec_a.state, rec_c.state) == (TCP_ESTABLISHED, TCP_ESTABLISHED)
    assert (rec_a.src, rec_a.sport, rec_a.dst, rec_a.dport) == (
        "127.0.0.1", port_of(lsock), "127.0.0.1", port_of(c))
    assert (rec_c.rqueue, rec_c.wqueue, rec_c.shutdown) == (0, 0, 0)
    assert rec_a.cookie == cookie(a) and rec_c.cookie == cookie(c)
    assert find_connection(V4, "127.0.0.1", port_of(c), "127.0.0.1", port_of(lsock)) == rec_c
    assert find_connection(V4, "127.0.0.1", port_of(lsock), "127.0.0.1", port_of(c)) == rec_a
    assert find_connection(V4, "127.0.0.1", port_of(c), "127.0.0.1", 1) is None


def test_unacked_data_shows_in_wqueue(make):
    _l, c, a = tcp_pair(make)
    c.setblocking(False)
    with pytest.raises(BlockingIOError):
        while True:
            c.send(b"z" * 65536)
    def outq() -> int:
        return struct.unpack("=i", fcntl.ioctl(c.fileno(), SIOCOUTQ, bytes(4)))[0]

    # the queue may still move while the peer's acks come in: compare once it holds still
    assert outq() > 0
    wait_until(lambda: (before := outq()) == diag(c).wqueue == outq() == before, timeout=5)
    assert diag(a).rqueue > 0


def test_half_closed(make):
    _l, c, a = tcp_pair(make)
    c.shutdown(socket.SHUT_WR)
    rec_a = wait_until(lambda: (r := diag(a)).state == TCP_CLOSE_WAIT and r, timeout=5)
    rec_c = wait_until(lambda: (r := diag(c)).state == TCP_FIN_WAIT2 and r, timeout=5)
    assert rec_c.shutdown == SEND_SHUTDOWN
    assert (rec_a.shutdown, rec_a.rqueue) == (RCV_SHUTDOWN, 1)     # the FIN counts as one
    assert rec_a.tcp_state_name == "CLOSE_WAIT" and rec_c.tcp_state_name == "FIN_WAIT2"
    a.shutdown(socket.SHUT_RD)
    assert diag(a).shutdown == RCV_SHUTDOWN


def test_time_wait(make):
    lsock, c, a = tcp_pair(make)
    cport, lport = port_of(c), port_of(lsock)
    c.close()
    wait_until(lambda: diag(a).state == TCP_CLOSE_WAIT, timeout=5)
    a.close()

    def tw():
        rec = find_connection(V4, "127.0.0.1", cport, "127.0.0.1", lport)
        return rec if rec is not None and rec.state == TCP_TIME_WAIT else None
    rec = wait_until(tw, timeout=5)
    assert (rec.ino, rec.tcp_state_name) == (0, "TIME_WAIT")
    assert rec not in pending_children(diag(lsock), inet_sockets())
    assert rec not in inet_sockets(states=ALL_STATES & ~(1 << TCP_TIME_WAIT))


def test_bound_but_not_listening(make):
    b = make()
    b.bind(("127.0.0.1", 0))
    assert inet_sockets(inodes={ino(b)}) == []
    assert inet_sockets(inodes={ino(b)}, states=1 << TCP_CLOSE) == []
    rec = diag(b, bound_inactive=True)
    assert (rec.state, rec.sport, rec.src, rec.rqueue, rec.wqueue) == (
        TCP_CLOSE, port_of(b), "127.0.0.1", 0, 0)
    b6 = make(V6)
    b6.bind(("::1", 0))
    assert diag(b6, bound_inactive=True).v6only is True   # bind(::1) sets it


def test_unbound_sockets_are_absent(make):
    t, u4, u6 = make(V4), make(V4, socket.SOCK_DGRAM), make(V6, socket.SOCK_DGRAM)
    inodes = {ino(t), ino(u4), ino(u6)}
    assert inet_sockets(inodes=inodes, states=0xFFFFFFFF) == []


def test_states_and_inodes_filters(make):
    lsock, c, a = tcp_pair(make)
    only_listen = inet_sockets(states=1 << TCP_LISTEN, inodes={ino(lsock), ino(c), ino(a)})
    assert [s.ino for s in only_listen] == [ino(lsock)]
    both = inet_sockets(inodes={ino(c), ino(a)})
    assert sorted(s.ino for s in both) == sorted([ino(c), ino(a)])
    assert inet_sockets(protocols=(UDP,), inodes={ino(c)}) == []
    assert inet_sockets(families=(V6,), inodes={ino(c)}) == []


def test_bound_to_device(make):
    s = make()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"lo")
    s.bind(("127.0.0.1", 0))
    s.listen()
    assert diag(s).ifindex == socket.if_nametoindex("lo")
    c = connect(make, "127.0.0.1", port_of(s))
    socks = inet_sockets(protocols=(TCP,))
    assert len(pending_children(diag(s), socks)) == 1
    assert find_connection(V4, "127.0.0.1", port_of(c), "127.0.0.1", port_of(s)) is not None


# --- UDP ----------------------------------------------------------------------------

def test_udp_bound_and_connected(make):
    server = make(V4, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    client = make(V4, socket.SOCK_DGRAM)
    client.bind(("127.0.0.1", 0))
    client.connect(server.getsockname())
    rec_s, rec_c = diag(server), diag(client)
    assert (rec_s.protocol, rec_s.state, rec_s.dst, rec_s.dport, rec_s.rqueue) == (
        UDP, TCP_CLOSE, "0.0.0.0", 0, 0)
    assert (rec_c.state, rec_c.dst, rec_c.dport) == (TCP_ESTABLISHED, "127.0.0.1", port_of(server))
    for payload in (b"a" * 10, b"b" * 1000, b""):
        client.send(payload)
    rec_s = wait_until(lambda: (r := diag(server)).rqueue and r, timeout=5)
    assert rec_s.rqueue >= 1010                 # memory of three skbs, not bytes
    assert diag(client).rqueue == 0


def test_udp_autobind_shows_up(make):
    target = make(V4, socket.SOCK_DGRAM)
    target.bind(("127.0.0.1", 0))
    u = make(V4, socket.SOCK_DGRAM)
    assert inet_sockets(inodes={ino(u)}) == []
    u.sendto(b"x", target.getsockname())
    rec = diag(u)
    assert (rec.src, rec.sport, rec.state) == ("0.0.0.0", port_of(u), TCP_CLOSE)


# --- IPv6 ---------------------------------------------------------------------------

def test_ipv6_dual_stack_and_v6only(make):
    dual = listener(make, V6, "::", v6only=False)
    only = listener(make, V6, "::", v6only=True)
    c4 = connect(make, "127.0.0.1", port_of(dual))
    c6 = connect(make, "::1", port_of(dual), V6)
    with pytest.raises(ConnectionRefusedError):
        connect(make, "127.0.0.1", port_of(only))
    socks = inet_sockets(protocols=(TCP,))
    rec_dual = next(s for s in socks if s.ino == ino(dual))
    rec_only = next(s for s in socks if s.ino == ino(only))
    assert (rec_dual.family, rec_dual.src, rec_dual.v6only, rec_dual.rqueue) == (V6, "::", False, 2)
    assert (rec_only.v6only, rec_only.rqueue) == (True, 0)
    kids = {k.dport: k for k in pending_children(rec_dual, socks)}
    assert set(kids) == {port_of(c4), port_of(c6)}
    mapped = kids[port_of(c4)]
    assert (mapped.family, mapped.src, mapped.dst) == (V6, "::ffff:127.0.0.1", "::ffff:127.0.0.1")
    assert kids[port_of(c6)].src == "::1"
    assert mapped.v6only is None                # not reported once connected
    # the IPv4 client is an AF_INET socket; the server side never is
    assert diag(c4).family == V4
    assert [s for s in inet_sockets(families=(V4,), protocols=(TCP,))
            if s.sport == port_of(dual)] == []
    assert find_connection(V6, "::ffff:127.0.0.1", port_of(dual),
                           "::ffff:127.0.0.1", port_of(c4)) == mapped
    assert find_connection(V6, "0:0::1", port_of(dual), "::1", port_of(c6)) is not None


def test_ipv6_udp(make):
    any6 = make(V6, socket.SOCK_DGRAM)
    any6.bind(("::", 0))
    loop6 = make(V6, socket.SOCK_DGRAM)
    loop6.bind(("::1", 0))
    loop6.connect(("::1", port_of(any6)))
    r_any, r_loop = diag(any6), diag(loop6)
    assert (r_any.family, r_any.src, r_any.state, r_any.v6only) == (V6, "::", TCP_CLOSE, False)
    assert (r_loop.dst, r_loop.state, r_loop.v6only) == ("::1", TCP_ESTABLISHED, None)


# --- arguments --------------------------------------------------------------------------

def test_bad_arguments():
    with pytest.raises(ValueError):
        inet_sockets(protocols=(socket.IPPROTO_ICMP,))
    with pytest.raises(ValueError):
        inet_sockets(families=(socket.AF_UNIX,))
    with pytest.raises(ValueError):
        find_connection(V4, "::1", 1, "127.0.0.1", 2)
    with pytest.raises(ValueError):
        find_connection(socket.AF_UNIX, "x", 1, "y", 2)


def test_state_names():
    assert inetdiag.TCP_STATE_NAMES[TCP_ESTABLISHED] == "ESTABLISHED"
    assert inetdiag.TCP_STATE_NAMES[inetdiag.TCP_NEW_SYN_RECV] == "NEW_SYN_RECV"
    assert ALL_STATES == 0x1FFE
