"""ptckpt.rawpkt: crafted UDP datagrams and TCP segments reach real loopback sockets.

The receivers are ordinary sockets of this process.  A datagram must arrive
with the forged sender address:port and the exact payload; a RST with the
receiver's rcv_nxt must reset an established connection.  Loopback verifies
checksums of these packets, so the same packets with one checksum byte flipped
must be ignored: that is the control proving the checksums are what counts.
"""

from __future__ import annotations

import errno
import socket
import struct

import pytest

from ptckpt import rawpkt
from ptckpt.errors import ExitCode, UsageError

TCP_REPAIR, TCP_REPAIR_QUEUE, TCP_QUEUE_SEQ, TCP_TIMESTAMP = 19, 20, 21, 24
TCP_RECV_QUEUE, TCP_SEND_QUEUE = 1, 2
TCP_REPAIR_OFF_NO_WP = -1

LOOPBACK = {4: "127.0.0.1", 6: "::1"}
FAMILY = {4: socket.AF_INET, 6: socket.AF_INET6}
# Forged senders: none of them is an address of this machine but the last.
SENDERS = {
    4: [("10.1.2.3", 1), ("192.0.2.77", 4242), ("198.51.100.200", 65535), ("127.0.0.9", 53)],
    6: [("2001:db8::1", 1), ("2001:db8:ffff::abcd", 4242), ("fd00::77", 65535), ("::1", 53)],
}
SIZES = [0, 1, 13, 1472, 9000, 32768, 60000]


def _raw_sockets_usable() -> bool:
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW).close()
    except PermissionError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _raw_sockets_usable(),
                                reason="raw sockets need CAP_NET_RAW")


def payload(n: int, seed: int) -> bytes:
    """n deterministic bytes, different per seed."""
    block = bytes((i * 7 + seed * 31 + (i >> 8)) & 0xFF for i in range(4096))
    return (block * (n // 4096 + 1))[:n]


@pytest.fixture
def udp_receiver(request):
    """udp_receiver(addr) -> a bound UDP socket with a big receive buffer (closed at teardown)."""
    socks = []

    def make(addr: str, family: int | None = None) -> socket.socket:
        fam = family or (socket.AF_INET6 if ":" in addr else socket.AF_INET)
        s = socket.socket(fam, socket.SOCK_DGRAM)
        socks.append(s)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind((addr, 0))
        s.settimeout(2.0)
        return s

    yield make
    for s in socks:
        s.close()


def nothing_arrives(sock: socket.socket, wait: float = 0.2) -> bool:
    sock.settimeout(wait)
    try:
        sock.recvfrom(70000)
    except (socket.timeout, BlockingIOError):
        return True
    return False


# --- UDP -----------------------------------------------------------------------------

@pytest.mark.parametrize("version", [4, 6])
def test_udp_keeps_forged_sender_and_payload(udp_receiver, version):
    rx = udp_receiver(LOOPBACK[version])
    port = rx.getsockname()[1]
    sent = []
    with rawpkt.RawSender() as raw:
        for size in SIZES:
            for k, (addr, sport) in enumerate(SENDERS[version]):
                data = payload(size, k + size)
                raw.udp(addr, sport, LOOPBACK[version], port, data)
                sent.append((addr, sport, data))
    for addr, sport, data in sent:          # loopback keeps the order
        got, sender = rx.recvfrom(70000)
        assert (sender[0], sender[1]) == (addr, sport)
        assert got == data, f"payload of {len(data)} bytes from {addr}:{sport} differs"
    assert nothing_arrives(rx)


def test_send_udp_one_shot_and_mark(udp_receiver):
    rx = udp_receiver("127.0.0.1")
    rawpkt.send_udp("203.0.113.5", 7777, "127.0.0.1", rx.getsockname()[1], b"marked", mark=0x5EED)
    assert rx.recvfrom(100) == (b"marked", ("203.0.113.5", 7777))
    with rawpkt.RawSender(mark=0x5EED) as raw:
        assert raw._sock(socket.AF_INET).getsockopt(socket.SOL_SOCKET, rawpkt.SO_MARK) == 0x5EED
        assert raw._sock(socket.AF_INET6).getsockopt(socket.SOL_SOCKET, rawpkt.SO_MARK) == 0x5EED


def test_ipv4_mapped_pair_is_sent_as_ipv4(udp_receiver):
    # A dual-stack socket names IPv4 peers ::ffff:a.b.c.d; a restore hands those back.
    plain = udp_receiver("127.0.0.1")
    dual = udp_receiver("::", socket.AF_INET6)
    rawpkt.send_udp("::ffff:10.20.30.40", 1234, "::ffff:127.0.0.1", plain.getsockname()[1], b"v4")
    assert plain.recvfrom(100) == (b"v4", ("10.20.30.40", 1234))
    rawpkt.send_udp("::ffff:10.20.30.40", 1234, "127.0.0.1", dual.getsockname()[1], b"dual")
    got, sender = dual.recvfrom(100)
    assert (got, sender[:2]) == (b"dual", ("::ffff:10.20.30.40", 1234))


@pytest.mark.parametrize("version", [4, 6])
def test_udp_with_wrong_checksum_is_dropped(udp_receiver, version):
    rx = udp_receiver(LOOPBACK[version])
    port = rx.getsockname()[1]
    src = SENDERS[version][0][0]
    ep = rawpkt._endpoints(src, LOOPBACK[version])
    packet = bytearray(rawpkt._build_udp(ep, 999, port, b"checked"))
    csum_at = (20 if version == 4 else 40) + 6
    packet[csum_at] ^= 0x5A
    with rawpkt.RawSender() as raw:
        raw._send(ep, bytes(packet), "corrupted datagram")
        assert nothing_arrives(rx)
        packet[csum_at] ^= 0x5A
        raw._send(ep, bytes(packet), "datagram")
    assert rx.recvfrom(100)[0] == b"checked"


def test_internet_checksum_rfc1071_example():
    # RFC 1071 section 3: the words 0001 f203 f4f5 f6f7 sum to ddf2 (folded).
    assert rawpkt._csum(bytes.fromhex("0001f203f4f5f6f7")) == (~0xDDF2 & 0xFFFF)
    assert rawpkt._csum(b"\x01") == (~0x0100 & 0xFFFF)      # odd length: zero-padded


# --- TCP ------------------------------------------------------------------------------

@pytest.fixture
def tcp_connection(request):
    """tcp_connection(version) -> (client, accepted) established over loopback, 10 bytes exchanged."""
    socks = []

    def make(version: int) -> tuple[socket.socket, socket.socket]:
        lst = socket.socket(FAMILY[version], socket.SOCK_STREAM)
        socks.append(lst)
        lst.bind((LOOPBACK[version], 0))
        lst.listen()
        cli = socket.socket(FAMILY[version], socket.SOCK_STREAM)
        socks.append(cli)
        cli.connect(lst.getsockname())
        acc, _ = lst.accept()
        socks.append(acc)
        cli.sendall(b"0123456789")
        assert acc.recv(10) == b"0123456789"
        return cli, acc

    yield make
    for s in socks:
        s.close()


def repair_seqs(sock: socket.socket) -> tuple[int, int]:
    """(rcv_nxt, write_seq) of sock, read in TCP_REPAIR mode (then left without a window probe)."""
    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_RECV_QUEUE)
        rcv = sock.getsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ) & 0xFFFFFFFF
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR_QUEUE, TCP_SEND_QUEUE)
        snd = sock.getsockopt(socket.IPPROTO_TCP, TCP_QUEUE_SEQ) & 0xFFFFFFFF
    finally:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF_NO_WP)
    return rcv, snd


def recv_outcome(sock: socket.socket, wait: float = 0.3) -> bytes | str:
    sock.settimeout(wait)
    try:
        return sock.recv(100)
    except socket.timeout:
        return "alive"
    except ConnectionResetError:
        return "reset"


@pytest.mark.parametrize("version", [4, 6])
def test_rst_with_receivers_seq_resets_connection(tcp_connection, version):
    cli, acc = tcp_connection(version)
    rcv_nxt, _ = repair_seqs(acc)
    peer, local = acc.getpeername(), acc.getsockname()
    ep = rawpkt._endpoints(peer[0], local[0])
    bad = bytearray(rawpkt._build_tcp(ep, peer[1], local[1], rcv_nxt, 0, rawpkt.TCP_RST, 0,
                                      None, None, b""))
    bad[(20 if version == 4 else 40) + 16] ^= 0x55          # the TCP checksum
    with rawpkt.RawSender() as raw:
        raw._send(ep, bytes(bad), "RST with a wrong checksum")
    assert recv_outcome(acc) == "alive"
    rawpkt.send_tcp(peer[0], peer[1], local[0], local[1], seq=rcv_nxt, ack=0,
                    flags=rawpkt.TCP_RST, window=0)
    assert recv_outcome(acc) == "reset"


@pytest.mark.parametrize("version", [4, 6])
def test_data_segment_with_timestamp_option(tcp_connection, version):
    # The connection negotiated timestamps (net.ipv4.tcp_timestamps=1): a
    # segment whose TSval is far older than the last one seen fails PAWS and is
    # dropped, a current one is accepted: the option is where the kernel reads it.
    cli, acc = tcp_connection(version)
    peer, local = acc.getpeername(), acc.getsockname()
    rcv_nxt, snd_nxt = repair_seqs(acc)
    now = cli.getsockopt(socket.IPPROTO_TCP, TCP_TIMESTAMP) & 0xFFFFFFFF   # cli's TSval clock
    common = dict(seq=rcv_nxt, ack=snd_nxt, flags=rawpkt.TCP_ACK | rawpkt.TCP_PSH, window=512,
                  payload=b"abc")
    rawpkt.send_tcp(peer[0], peer[1], local[0], local[1],
                    tsval=(now - (1 << 30)) & 0xFFFFFFFF, tsecr=0, **common)
    assert recv_outcome(acc) == "alive"
    rawpkt.send_tcp(peer[0], peer[1], local[0], local[1], tsval=now + 5, tsecr=0, **common)
    assert recv_outcome(acc) == b"abc"


def test_tcp_header_layout():
    ep = rawpkt._endpoints("10.0.0.1", "10.0.0.2")
    pkt = rawpkt._build_tcp(ep, 1000, 2000, 0x01020304, 0x0A0B0C0D,
                            rawpkt.TCP_FIN | rawpkt.TCP_ACK, 4096, 77, 88, b"")
    ip, tcp = pkt[:20], pkt[20:]
    assert ip[0] == 0x45 and struct.unpack("!H", ip[2:4])[0] == len(pkt) == 52
    assert ip[9] == socket.IPPROTO_TCP and rawpkt._csum(ip) == 0
    sport, dport, seq, ack, word, window = struct.unpack("!HHIIHH", tcp[:16])
    assert (sport, dport, seq, ack, window) == (1000, 2000, 0x01020304, 0x0A0B0C0D, 4096)
    assert word >> 12 == 8 and word & 0x1FF == rawpkt.TCP_FIN | rawpkt.TCP_ACK
    assert tcp[20:32] == bytes([1, 1, 8, 10]) + struct.pack("!II", 77, 88)
    pseudo = ep.src + ep.dst + struct.pack("!BBH", 0, socket.IPPROTO_TCP, len(tcp))
    assert rawpkt._csum(pseudo + tcp) == 0
    plain = rawpkt._build_tcp(ep, 1, 2, 0, 0, rawpkt.TCP_SYN, 0, None, None, b"")
    assert len(plain) == 40 and plain[32] >> 4 == 5


# --- errors ----------------------------------------------------------------------------

def test_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError, match="bad source address"):
        rawpkt.send_udp("127.0.0.300", 1, "127.0.0.1", 2, b"")
    with pytest.raises(UsageError, match="different IP versions"):
        rawpkt.send_udp("::1", 1, "127.0.0.1", 2, b"")
    with pytest.raises(UsageError, match="port 70000"):
        rawpkt.send_udp("127.0.0.1", 70000, "127.0.0.1", 2, b"")
    with pytest.raises(UsageError, match="tsecr without tsval"):
        rawpkt.send_tcp("127.0.0.1", 1, "127.0.0.1", 2, seq=0, ack=0, flags=0, window=0, tsecr=1)
    with pytest.raises(UsageError, match="larger than 65535"):
        rawpkt.send_udp("127.0.0.1", 1, "127.0.0.1", 2, bytes(65508))


def test_oversized_ipv6_packet_is_a_raw_packet_error(udp_receiver):
    rx = udp_receiver("::1")
    with pytest.raises(rawpkt.RawPacketError, match=r"\[::1\]:9 -> \[::1\]") as info:
        rawpkt.send_udp("::1", 9, "::1", rx.getsockname()[1], bytes(65489))   # 65537 > lo MTU
    assert info.value.errno == errno.EMSGSIZE
    assert info.value.exit_code == ExitCode.IO_ERROR
    rawpkt.send_udp("::1", 9, "::1", rx.getsockname()[1], bytes(65488))        # the largest
    assert len(rx.recvfrom(70000)[0]) == 65488
