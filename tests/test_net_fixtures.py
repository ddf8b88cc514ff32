"""The network fixtures on their own (no checkpoint): tcppair, udpserver, tcplisten.

Each test drives a fixture through its whole life and checks its report
lines (fixtures/README.md has the protocols), so that a checkpoint test can
later rely on them: what a fixture reports after SIGUSR1 without a checkpoint
is what it must report after a restore.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import struct

import pytest

from conftest import EXIT_USAGE

DEFAULT_BYTES = (1 << 20) + 4321
PARENT_SEED, CHILD_SEED = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03
FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3
M64 = (1 << 64) - 1


def fnv1a(data: bytes, h: int = FNV_OFFSET) -> int:
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & M64
    return h


def xorshift_stream(seed: int, n: int) -> bytes:
    """tcppair's byte stream: the little-endian bytes of successive xorshift64 outputs."""
    words, x = [], seed
    for _ in range((n + 7) // 8):
        x ^= (x << 13) & M64
        x ^= x >> 7
        x ^= (x << 17) & M64
        words.append(x)
    return struct.pack(f"<{len(words)}Q", *words)[:n]


def lines_matching(t, pattern: str) -> list[re.Match]:
    rx = re.compile(pattern)
    return [m for m in map(rx.match, t.stdout_lines()) if m]


def one(t, pattern: str) -> re.Match:
    found = lines_matching(t, pattern)
    assert len(found) == 1, f"want one line {pattern!r} in:\n{t.stdout_text()}"
    return found[0]


# --- tcppair ----------------------------------------------------------------------------

SENT = r"^SENT (parent|child) (\d+) (\d+) ([0-9a-f]{16})$"
QUEUES = r"^QUEUES (parent|child) (\d+) inq=(\d+) outq=(\d+) sndbuf=(\d+) rcvbuf=(\d+)$"
RECEIVED = r"^RECEIVED (parent|child) (\d+) (\d+) ([0-9a-f]{16}) (eof|noeof)$"


def test_tcppair_exchanges_and_half_closes(spawn):
    t = spawn("tcppair")
    child = int(one(t, r"^CHILD (\d+)$").group(1))
    assert one(t, r"^READY (\d+)$").group(1) == str(t.pid)
    # The child's lines come before the parent's READY too.
    assert sorted(line.split()[0] for line in t.preamble) == \
        ["CHILD", "PORTS", "QUEUES", "QUEUES", "SENT", "SENT"]
    listen_port, parent_port, child_port = map(int, one(t, r"^PORTS (\d+) (\d+) (\d+)$").groups())
    assert listen_port == parent_port != child_port

    sent = {m.group(1): m for m in lines_matching(t, SENT)}
    queues = {m.group(1): m for m in lines_matching(t, QUEUES)}
    assert set(sent) == set(queues) == {"parent", "child"}
    assert int(sent["parent"].group(2)) == t.pid and int(sent["child"].group(2)) == child
    for role, seed in (("parent", PARENT_SEED), ("child", CHILD_SEED)):
        n = int(sent[role].group(3))
        assert n == DEFAULT_BYTES
        assert int(sent[role].group(4), 16) == fnv1a(xorshift_stream(seed, n))
    # At READY everything sent sits in the peer's receive queue, nothing in flight.
    assert int(queues["parent"].group(3)) == int(sent["child"].group(3))
    assert int(queues["child"].group(3)) == int(sent["parent"].group(3))
    assert queues["parent"].group(4) == queues["child"].group(4) == "0"
    for q in queues.values():
        assert int(q.group(5)) >= 4 << 20 and int(q.group(6)) >= 4 << 20

    t.signal(signal.SIGUSR1)
    os.kill(child, signal.SIGUSR1)
    assert t.wait_exit(timeout=10) == 0, t.describe()
    got = {m.group(1): m for m in lines_matching(t, RECEIVED)}
    assert got["parent"].group(3, 4, 5) == (sent["child"].group(3), sent["child"].group(4), "eof")
    assert got["child"].group(3, 4, 5) == (sent["parent"].group(3), sent["parent"].group(4), "noeof")
    assert int(got["child"].group(2)) == child
    assert len([line for line in t.out_lines() if line.startswith("RECEIVED ")]) == 2
    assert t.failure() is None


def test_tcppair_byte_count_argument(spawn):
    n = (2 << 20) + 1
    t = spawn("tcppair", n)
    child = int(one(t, r"^CHILD (\d+)$").group(1))
    sent = {m.group(1): int(m.group(3)) for m in lines_matching(t, SENT)}
    assert sent == {"parent": n, "child": n}
    t.signal(signal.SIGUSR1)
    os.kill(child, signal.SIGUSR1)
    assert t.wait_exit(timeout=10) == 0, t.describe()
    assert {m.group(1): int(m.group(3)) for m in lines_matching(t, RECEIVED)} == sent


def test_tcppair_refuses_less_than_a_mebibyte(spawn):
    t = spawn("tcppair", 1000, ready=False)
    assert t.wait_exit(timeout=5) == EXIT_USAGE


# --- udpserver -----------------------------------------------------------------------------

@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_udpserver_reports_every_datagram(spawn, addr):
    t = spawn("udpserver", addr)
    port = int(one(t, r"^PORT (\d+)$").group(1))
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    senders = []
    try:
        for _ in range(4):
            s = socket.socket(family, socket.SOCK_DGRAM)
            senders.append(s)
            s.bind((addr, 0))
        expected = []
        for i in range(100):
            s = senders[i % 4]
            data = bytes((i * 13 + k) & 0xFF for k in range((i * 97) % 3000))
            s.sendto(data, (addr, port))
            expected.append(f"DGRAM {addr} {s.getsockname()[1]} {len(data)} {fnv1a(data):016x}")
    finally:
        for s in senders:
            s.close()
    t.signal(signal.SIGUSR1)
    t.wait_for_line(r"^DONE ")
    assert t.wait_exit() == 0
    got = [line for line in t.stdout_lines() if line.startswith("DGRAM ")]
    assert got == expected
    assert one(t, r"^DONE (\d+)$").group(1) == "100"
    assert t.out_lines() == expected + ["DONE 100"]


def test_udpserver_sees_forged_senders(spawn):
    from ptckpt import rawpkt
    try:
        socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW).close()
    except PermissionError:
        pytest.skip("raw sockets need CAP_NET_RAW")
    t = spawn("udpserver")
    port = int(one(t, r"^PORT (\d+)$").group(1))
    forged = [("10.1.2.3", 1111, b"one"), ("192.0.2.9", 53, b""), ("203.0.113.77", 65535, bytes(60000))]
    for src, sport, data in forged:
        rawpkt.send_udp(src, sport, "127.0.0.1", port, data)
    t.signal(signal.SIGUSR1)
    t.wait_for_line(r"^DONE 3$")
    assert [line for line in t.stdout_lines() if line.startswith("DGRAM ")] == [
        f"DGRAM {src} {sport} {len(data)} {fnv1a(data):016x}" for src, sport, data in forged]


# --- tcplisten -----------------------------------------------------------------------------

OPTS = ("OPTS reuseaddr=1 nodelay=1 keepalive=1 keepidle=77 keepintvl=11 keepcnt=5 defer=3 "
        "rcvbuf=524288 nonblock=1 v6only={v6only} backlog=17")
FAMILIES = {  # --family: (address to connect to, peer address as reported, v6only)
    "4": ("127.0.0.1", "127.0.0.1", "-"),
    "6": ("::1", "::1", "1"),
    "dual": ("127.0.0.1", "::ffff:127.0.0.1", "0"),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tcplisten_accepts_child_and_test_connection(spawn, family):
    connect_to, peer_addr, v6only = FAMILIES[family]
    t = spawn("tcplisten", "--family", family)
    port = int(one(t, r"^PORT (\d+)$").group(1))
    child = int(one(t, r"^CHILD (\d+)$").group(1))
    with socket.create_connection((connect_to, port), timeout=5) as mine:
        mine.sendall(b"hello from test\n")
        my_port = mine.getsockname()[1]
        t.signal(signal.SIGUSR1)
        os.kill(child, signal.SIGUSR1)
        t.wait_for_line(r"^DONE ")
        assert mine.recv(100) == f"reply to {my_port}\n".encode()
    assert t.wait_exit() == 0, t.describe()

    assert one(t, r"^OPTS ").string == OPTS.format(v6only=v6only)
    assert one(t, r"^QUEUED (\d+)$").group(1) == "2"
    accepted = lines_matching(t, r"^ACCEPTED (\S+) (\d+) (.*)$")
    assert [m.group(1) for m in accepted] == [peer_addr, peer_addr]
    by_line = {m.group(3): int(m.group(2)) for m in accepted}
    assert set(by_line) == {f"hello from {child}", "hello from test"}
    assert by_line["hello from test"] == my_port
    assert one(t, r"^DONE (\d+)$").group(1) == "2"
    assert one(t, r"^CHILD-GOT (.*)$").group(1) == f"reply to {by_line[f'hello from {child}']}"
    assert t.failure() is None


def test_tcplisten_without_child(spawn):
    t = spawn("tcplisten", "--no-child")
    assert not lines_matching(t, r"^CHILD ")
    port = int(one(t, r"^PORT (\d+)$").group(1))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as mine:
        mine.sendall(b"only me\n")
        t.signal(signal.SIGUSR1)
        assert mine.recv(100) == f"reply to {mine.getsockname()[1]}\n".encode()
    assert t.wait_exit() == 0, t.describe()
    assert one(t, r"^QUEUED (\d+)$").group(1) == "1"
    assert [m.group(3) for m in lines_matching(t, r"^ACCEPTED (\S+) (\d+) (.*)$")] == ["only me"]
    assert one(t, r"^DONE (\d+)$").group(1) == "1"


def test_tcplisten_bad_family_is_usage_error(spawn):
    t = spawn("tcplisten", "--family", "5", ready=False)
    assert t.wait_exit(timeout=5) == EXIT_USAGE
