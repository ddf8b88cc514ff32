"""ICMP "ping" sockets, UDP-Lite sockets and raw IP sockets through `ptckpt dump` and `ptckpt restore`
(fixtures/pingkinds.py): the restored program pings the loopback address on its restored
socket and checks the reply, or reads the UDP-Lite datagrams that were queued at the dump.
Raw sockets (fixtures/rawkinds.py) are used after the restore too.  Real processes, the real kernel; `spawn` kills what it started."""

from __future__ import annotations

import errno
import signal
import socket

import pytest

from ptckpt.formats.image import ImageReader

from conftest import needs
from test_restore import _dump_kill, _one_line, _restore

EXIT_UNSUPPORTED = 13
FAMILIES = {"4": socket.AF_INET, "6": socket.AF_INET6}


def _need_ping(family: str) -> None:
    proto = socket.IPPROTO_ICMP if family == "4" else socket.IPPROTO_ICMPV6
    try:
        socket.socket(FAMILIES[family], socket.SOCK_DGRAM, proto).close()
    except PermissionError:
        with open("/proc/sys/net/ipv4/ping_group_range") as f:
            pytest.skip(f"no ping sockets for this group (net.ipv4.ping_group_range {f.read().strip()})")


def _need_udplite(family: str) -> None:
    try:
        socket.socket(FAMILIES[family], socket.SOCK_DGRAM, 136).close()
    except OSError as err:
        if err.errno in (errno.EPROTONOSUPPORT, errno.ESOCKTNOSUPPORT):
            pytest.skip(f"this kernel has no UDP-Lite ({err.strerror})")
        raise


def _finish(t) -> list[str]:
    t.signal(signal.SIGUSR1)
    assert t.wait_exit(10) == 0, t.describe()
    assert not [line for line in t.out_lines() if line.startswith("FAIL")], t.describe()
    return t.out_lines()


@pytest.mark.parametrize("family", ["4", "6"])
def test_unbound_ping_socket(spawn, ptckpt, tmp_path, family):
    """zdtm's socket_icmp: an unbound ping socket with options; after the restore, an echo
    sent on it is answered on it."""
    _need_ping(family)
    t = spawn("pingkinds.py", "ping", family)
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as im:
        [rec] = im.inet_sockets
    assert rec.protocol == (socket.IPPROTO_ICMP if family == "4" else socket.IPPROTO_ICMPV6)
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    lines = _finish(t)
    assert lines[-2] == "OPTS ttl=33", lines          # IP_TTL / IPV6_UNICAST_HOPS came back
    assert lines[-1].startswith("REPLY ") and lines[-1].endswith(" 1"), lines


@pytest.mark.parametrize("family", ["4", "6"])
def test_bound_ping_socket_keeps_its_echo_id(spawn, ptckpt, tmp_path, family):
    _need_ping(family)
    t = spawn("pingkinds.py", "ping-bound", family)
    name = t.preamble[0]
    _dump_kill(ptckpt, t, tmp_path / "img")
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    assert _finish(t)[-2:] == [name, "REPLY 4321 1"]


@pytest.mark.parametrize("family", ["4", "6"])
def test_connected_ping_socket_stays_connected(spawn, ptckpt, tmp_path, family):
    """Connected to the loopback address and autobound by its first echo: after the
    restore send() without an address works, and the reply carries the same echo id."""
    _need_ping(family)
    t = spawn("pingkinds.py", "ping-connected", family)
    ident = t.preamble[0].split()[1]
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as im:
        [rec] = im.inet_sockets
    assert (rec.dst, rec.sport, rec.state) == ("127.0.0.1" if family == "4" else "::1", int(ident), 1)
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    assert _finish(t)[-1] == f"REPLY {ident} 2"


def test_ping_socket_in_a_new_netns(spawn, ptckpt, tmp_path):
    """Restored into a fresh network namespace (its loopback up): the echo is answered there."""
    _need_ping("4")
    t = spawn("pingkinds.py", "ping-connected", "4")
    ident = t.preamble[0].split()[1]
    _dump_kill(ptckpt, t, tmp_path / "img")
    assert _restore(ptckpt, tmp_path / "img", "--netns") == t.pid
    assert _finish(t)[-1] == f"REPLY {ident} 2"


def test_queued_reply_is_refused(spawn, ptckpt, tmp_path):
    """A reply queued and not read: refused by name, one line; the program goes on and
    reads it."""
    _need_ping("4")
    t = spawn("pingkinds.py", "ping-queued", "4")
    res = ptckpt("dump", t.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, EXIT_UNSUPPORTED, f"process {t.pid}", "ICMP", "reply queued", "dump again")
    assert not (tmp_path / "img").exists()
    assert _finish(t)[-1].startswith("REPLY ")


@pytest.mark.parametrize("family", ["4", "6"])
def test_udplite_queue_and_coverage(spawn, ptckpt, tmp_path, family):
    """Two UDP-Lite sockets: the receiver's queued datagrams come back from the sender's
    address (crafted UDP-Lite datagrams), the checksum coverage options too."""
    _need_udplite(family)
    t = spawn("pingkinds.py", "udplite", family)
    _recv_port, send_port = t.preamble[0].split()[1:]
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as im:
        assert sorted(len(r.datagrams) for r in im.inet_sockets) == [0, 2]
        assert {r.protocol for r in im.inet_sockets} == {136}
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    assert _finish(t)[-4:] == ["OPTS send=20 recv=20", f"DGRAM {send_port} one",
                               f"DGRAM {send_port} two", f"DGRAM {send_port} three"]


# --- raw IP sockets (fixtures/rawkinds.py) ----------------------------------------------

def _need_raw() -> None:
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP).close()
    except PermissionError:
        pytest.skip("no CAP_NET_RAW here")


def test_raw_sockets_come_back(spawn, ptckpt, tmp_path):
    """zdtm's socket-raw and sock_ip_opts: raw sockets of both families and several
    protocols come back with their protocol, bound address, peer and options (IP_HDRINCL,
    IP_TTL, IP_TOS, IP_FREEBIND, IP_PKTINFO, ICMP_FILTER, ICMPV6_FILTER, IPV6_FREEBIND,
    IPV6_RECVPKTINFO, IPV6_CHECKSUM, ...), and work: a datagram built whole goes out, the
    connected ICMP socket gets its echo reply through its filter, the ICMPv6 one the one
    type its filter passes, the connected IPv6 one its own packet with its checksum."""
    _need_raw()
    t = spawn("rawkinds.py", "raw")
    before = t.stdout_lines()[:5]
    assert [line.split()[1] for line in before] == ["udp4", "icmp4", "raw4", "icmp6", "exp6"], before
    _dump_kill(ptckpt, t, tmp_path / "img")
    with ImageReader(tmp_path / "img") as im:
        recs = {(r.family, r.protocol): r for r in im.inet_sockets}
    assert {r.type for r in recs.values()} == {socket.SOCK_RAW}
    assert recs[(socket.AF_INET, socket.IPPROTO_ICMP)].dst == "127.0.0.1"
    assert (recs[(socket.AF_INET6, 253)].src, recs[(socket.AF_INET6, 253)].dst) == ("::1", "::1")
    assert _restore(ptckpt, tmp_path / "img") == t.pid
    lines = _finish(t)
    assert lines[-9:-4] == before, "same protocol, address and options"
    assert lines[-4:] == ["SENT udp4 built by hand", "ECHO icmp4 0 127.0.0.1", "GOT icmp6 200 type 200",
                          "GOT exp6 to myself"]


def test_raw_socket_with_a_queued_packet_is_refused(spawn, ptckpt, tmp_path):
    """A packet queued on a raw socket and not read: refused by name, one line; the program
    goes on and reads it."""
    _need_raw()
    t = spawn("rawkinds.py", "raw-queued")
    res = ptckpt("dump", t.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, EXIT_UNSUPPORTED, f"process {t.pid}", "raw IP protocol 17 127.0.0.13",
              "packets queued", "dump again")
    assert not (tmp_path / "img").exists()
    assert _finish(t)[-1] == "PACKET queued"


@needs("setpriv")
def test_raw_socket_refused_by_a_dump_without_cap_net_raw(spawn, ptckpt, tmp_path):
    """A dump that lacks CAP_NET_RAW refuses a raw socket (its restore, by the same user,
    could not make it); the program goes on."""
    _need_raw()
    t = spawn("rawkinds.py", "raw")
    res = ptckpt("dump", t.pid, "-D", tmp_path / "img", "--kill",
                 prefix=("setpriv", "--inh-caps=-net_raw", "--bounding-set=-net_raw"))
    _one_line(res, EXIT_UNSUPPORTED, f"process {t.pid}", "raw IP protocol", "CAP_NET_RAW")
    assert not (tmp_path / "img").exists()
    assert _finish(t)[-1] == "GOT exp6 to myself"
