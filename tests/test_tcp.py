"""TCP_REPAIR mechanics (ptckpt.resources.tcp) on real loopback connections, in-process:
a connection's state is read in repair mode, the socket closed silently, and a new one
built from the record goes on with the untouched peer: every byte in flight arrives,
half-closed connections keep their FINs."""

from __future__ import annotations

import functools
import socket
import time

import pytest

from ptckpt import rawpkt
from ptckpt.formats.model import InetMode, InetSocket
from ptckpt.resources import tcp

send = functools.partial(rawpkt.send_tcp, mark=0)


@pytest.fixture
def sockets():
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def _pair(made, family=socket.AF_INET, host="127.0.0.1", bufsize=0):
    with socket.socket(family) as listener:
        listener.bind((host, 0))
        listener.listen()
        c = socket.socket(family)
        made.append(c)
        if bufsize:
            c.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
        c.connect(listener.getsockname()[:2])
        a, _ = listener.accept()
        made.append(a)
    for s in (a, c):
        s.settimeout(5)
        if bufsize:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufsize)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufsize)
    return a, c


def _record(s: socket.socket) -> InetSocket:
    with tcp.repaired(s):
        state = tcp.read_stream_frozen(s)
    src, sport = s.getsockname()[:2]
    dst, dport = s.getpeername()[:2]
    return InetSocket(ino=0, family=s.family, type=1, protocol=6, mode=InetMode.REPAIRED,
                      src=src, sport=sport, dst=dst, dport=dport, **state)


def _swap(made, s: socket.socket) -> tuple[InetSocket, socket.socket]:
    """Dump s, close it silently (repair mode), build it again."""
    rec = _record(s)
    tcp.repair_on(s)
    s.close()
    new = tcp.make_stream(rec, rec.family, send)
    made.append(new)
    tcp.leave_repair(new, 0)
    new.settimeout(5)
    return rec, new


def _read_to_eof(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(1 << 20):
        out += chunk
    return bytes(out)


def _settle():
    time.sleep(0.05)


def test_established_with_data_both_ways(sockets):
    a, c = _pair(sockets, bufsize=4 << 20)
    a.sendall(b"x" * 1_500_000)
    c.sendall(b"y" * 700_000)
    _settle()
    rec, a2 = _swap(sockets, a)
    assert rec.state == tcp.ESTABLISHED and len(rec.recv_queue) == 700_000
    assert a2.recv(700_000, socket.MSG_WAITALL) == b"y" * 700_000
    assert c.recv(1_500_000, socket.MSG_WAITALL) == b"x" * 1_500_000
    a2.sendall(b"z")
    assert c.recv(1) == b"z"


def test_unacknowledged_and_unsent_data_are_sent_after_restore(sockets):
    """The peer's window is full: the send queue holds bytes sent but not acknowledged and
    bytes never sent; both arrive, in order, after the rebuild."""
    a, c = _pair(sockets)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    a.setblocking(False)
    data = bytes(range(256)) * 4096
    sent = 0
    try:
        while sent < len(data):
            sent += a.send(data[sent:sent + 65536])
    except BlockingIOError:
        pass
    _settle()
    rec, a2 = _swap(sockets, a)
    assert len(rec.send_queue) > 0 and rec.unsent > 0
    got = bytearray()
    while len(got) < sent:
        got += c.recv(1 << 20)
    assert bytes(got) == data[:sent]


def test_close_wait_keeps_the_peer_fin(sockets):
    a, c = _pair(sockets)
    c.sendall(b"abc")
    c.shutdown(socket.SHUT_WR)
    _settle()
    rec, a2 = _swap(sockets, a)
    assert rec.state == tcp.CLOSE_WAIT
    assert _read_to_eof(a2) == b"abc"
    assert tcp.tcp_info_head(a2)[0] == tcp.CLOSE_WAIT
    a2.sendall(b"more")
    assert c.recv(10) == b"more"


def test_fin_wait2_keeps_our_acknowledged_fin(sockets):
    a, c = _pair(sockets)
    a.sendall(b"abc")
    a.shutdown(socket.SHUT_WR)
    _settle()
    rec, a2 = _swap(sockets, a)
    assert rec.state == tcp.FIN_WAIT2
    assert tcp.tcp_info_head(a2)[0] == tcp.FIN_WAIT2
    assert _read_to_eof(c) == b"abc"
    c.sendall(b"back")
    assert a2.recv(10) == b"back"


def test_last_ack(sockets):
    a, c = _pair(sockets)
    c.shutdown(socket.SHUT_WR)
    _settle()
    _rec, a2 = _swap(sockets, a)
    a2.shutdown(socket.SHUT_WR)
    assert c.recv(10) == b""


def test_both_ends_rebuilt(sockets):
    a, c = _pair(sockets)
    a.sendall(b"1" * 30000)
    c.sendall(b"2" * 20000)
    c.shutdown(socket.SHUT_WR)
    _settle()
    ra, rc = _record(a), _record(c)
    for s in (a, c):
        tcp.repair_on(s)
        s.close()
    a2, c2 = tcp.make_stream(ra, ra.family, send), tcp.make_stream(rc, rc.family, send)
    sockets += [a2, c2]
    for s in (a2, c2):
        tcp.leave_repair(s, 0)
        s.settimeout(5)
    assert _read_to_eof(a2) == b"2" * 20000
    assert c2.recv(30000, socket.MSG_WAITALL) == b"1" * 30000


def test_ipv6(sockets):
    a, c = _pair(sockets, socket.AF_INET6, "::1")
    c.sendall(b"v6")
    c.shutdown(socket.SHUT_WR)
    _settle()
    _rec, a2 = _swap(sockets, a)
    assert _read_to_eof(a2) == b"v6"


def test_repair_mode_is_detected_and_reuseaddr_put_back(sockets):
    a, _c = _pair(sockets)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    assert not tcp.in_repair(a)
    with tcp.repaired(a):
        assert tcp.in_repair(a)
    assert not tcp.in_repair(a)
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1


def test_urgent_data_is_seen(sockets):
    a, c = _pair(sockets)
    a.settimeout(None)               # as ptckpt's fd copies: the call goes straight to the kernel
    assert not tcp.urgent_pending(a)
    c.send(b"!", socket.MSG_OOB)
    _settle()
    assert tcp.urgent_pending(a)
