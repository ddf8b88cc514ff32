"""ptckpt.netlock with real nft and real loopback TCP connections (no mocks).

Every test that makes a lock registers its id with the ``lock_ids`` fixture,
whose finaliser unlocks them all, even when the test fails (unlock is
idempotent, so a test may unlock them itself as well).  Only locks made here
are looked at: other ptckpt locks may exist on the host meanwhile.

Timing: loopback's retransmission timeout starts at 200 ms (TCP_RTO_MIN) and
doubles, and a send refused by the output hook (EPERM) is retried by the
probe timer; so a lock is held ~0.3 s, and after unlock the data is awaited
for up to 3 s.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator

import pytest

from conftest import ROOT, needs, proc_stat, wait_until
from ptckpt import netlock
from ptckpt.errors import ExitCode, UsageError
from ptckpt.netlock import PTCKPT_MARK, Connection, NetLockError, NetLockGone

pytestmark = needs("nft")

HELD = 0.3          # seconds a lock is held before checking that nothing arrived
ARRIVE = 3.0        # seconds allowed for data to arrive after unlock (retransmission)


# --- helpers ----------------------------------------------------------------------

@pytest.fixture
def lock_ids() -> Iterator[list[str]]:
    """A list to append lock ids to; each is unlocked at teardown, whatever happened."""
    ids: list[str] = []
    yield ids
    for lock_id in ids:
        netlock.unlock(lock_id)
    left = {i.id for i in netlock.list_locks()} & set(ids)
    assert not left, f"locks left behind: {left}"


@pytest.fixture
def make_lock(lock_ids: list[str], tmp_path) -> Callable[..., netlock.NetLock]:
    def make(conns, **kw) -> netlock.NetLock:
        kw.setdefault("image_dir", str(tmp_path))
        kw.setdefault("lock_id", f"test-{os.getpid()}-{len(lock_ids)}-{os.urandom(3).hex()}")
        lock_ids.append(kw["lock_id"])
        return netlock.lock(conns, **kw)
    return make


@pytest.fixture
def tcp_pair() -> Iterator[Callable[..., tuple[socket.socket, socket.socket]]]:
    """tcp_pair(kind) -> (client, server): an established loopback connection.

    kind: "v4" (127.0.0.1), "v6" (::1), "v4mapped" (an AF_INET6 client
    connected to ::ffff:127.0.0.1, an AF_INET server).
    """
    socks: list[socket.socket] = []

    def make(kind: str = "v4") -> tuple[socket.socket, socket.socket]:
        lfam, host = {"v4": (socket.AF_INET, "127.0.0.1"), "v6": (socket.AF_INET6, "::1"),
                      "v4mapped": (socket.AF_INET, "127.0.0.1")}[kind]
        listener = socket.socket(lfam, socket.SOCK_STREAM)
        socks.append(listener)
        listener.bind((host, 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        if kind == "v4mapped":
            client = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
            client.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            target = ("::ffff:127.0.0.1", port)
        else:
            client = socket.socket(lfam, socket.SOCK_STREAM)
            target = (host, port)
        socks.append(client)
        client.connect(target)
        server, _ = listener.accept()
        socks.append(server)
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return client, server

    yield make
    for s in socks:
        s.close()


def conn_of(sock: socket.socket, ino: int = 0, reuseaddr: int = 0) -> Connection:
    """The Connection of a socket as its own side sees it."""
    local, peer = sock.getsockname(), sock.getpeername()
    return Connection(sock.family, local[0], local[1], peer[0], peer[1], ino, reuseaddr)


def outq(sock: socket.socket) -> int:
    """Bytes sent and not yet acknowledged (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def nothing_arrives(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        data = sock.recv(100)
    except TimeoutError:
        return True
    raise AssertionError(f"{data!r} arrived on a locked connection")


def recv_within(sock: socket.socket, n: int, seconds: float) -> bytes:
    deadline = time.monotonic() + seconds
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(data))
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return data


def ours(lock_ids: list[str]) -> dict[str, netlock.LockInfo]:
    return {i.id: i for i in netlock.list_locks() if i.id in lock_ids}


# --- blocking -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["v4", "v6", "v4mapped"])
def test_lock_blocks_both_ways_until_unlock(kind, tcp_pair, make_lock):
    client, server = tcp_pair(kind)
    conn = conn_of(client)
    if kind == "v4mapped":
        assert conn.family == socket.AF_INET6 and conn.v4mapped and conn.key[0] == 4
    client.sendall(b"before")
    assert recv_within(server, 6, ARRIVE) == b"before"

    lock = make_lock([conn])
    client.sendall(b"ping")
    server.sendall(b"pong")
    assert nothing_arrives(server, HELD / 2) and nothing_arrives(client, HELD / 2)
    assert outq(client) == 4 and outq(server) == 4      # still queued at each sender

    netlock.unlock(lock)
    assert recv_within(server, 4, ARRIVE) == b"ping"
    assert recv_within(client, 4, ARRIVE) == b"pong"
    wait_until(lambda: outq(client) == 0 and outq(server) == 0, timeout=ARRIVE)


def test_other_connections_pass(tcp_pair, make_lock):
    a_client, a_server = tcp_pair("v4")
    b_client, b_server = tcp_pair("v4")
    make_lock([conn_of(a_client)])
    b_client.sendall(b"free")
    assert recv_within(b_server, 4, 1.0) == b"free"
    b_server.sendall(b"also")
    assert recv_within(b_client, 4, 1.0) == b"also"


@pytest.mark.parametrize("locked", ["sender", "receiver"])
def test_marked_packets_pass(locked, tcp_pair, make_lock):
    """Packets with PTCKPT_MARK pass a lock: through the output rule (the
    sender's side locked) or the input rule (the receiver's side locked: on
    loopback the mark survives to the input hook)."""
    sender, receiver = tcp_pair("v4")
    make_lock([conn_of(sender if locked == "sender" else receiver)])
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, PTCKPT_MARK)
    sender.sendall(b"marked")
    assert recv_within(receiver, 6, 1.0) == b"marked"
    receiver.sendall(b"plain")                          # unmarked: still dropped
    assert nothing_arrives(sender, HELD)


def test_add_blocks_more_connections(tcp_pair, make_lock, lock_ids):
    a_client, a_server = tcp_pair("v4")
    b_client, b_server = tcp_pair("v6")
    lock = make_lock([conn_of(a_client, ino=11)])
    lock2 = netlock.add(lock, [conn_of(a_client, ino=99), conn_of(b_server, ino=22, reuseaddr=1)])
    assert lock2.id == lock.id and len(lock2.connections) == 2      # a's duplicate skipped
    assert lock2.connections[0].ino == 11
    info = ours(lock_ids)[lock.id]
    assert {(c.ino, c.reuseaddr) for c in info.connections} == {(11, 0), (22, 1)}

    b_client.sendall(b"x")
    assert nothing_arrives(b_server, HELD)
    netlock.unlock(lock.id)
    assert recv_within(b_server, 1, ARRIVE) == b"x"
    with pytest.raises(NetLockGone) as exc:
        netlock.add(lock2, [conn_of(a_server)])
    assert exc.value.exit_code == ExitCode.MISSING_FEATURE and "\n" not in str(exc.value)
    with pytest.raises(NetLockGone):
        netlock.add(lock.id, [conn_of(a_server)])


# --- metadata -----------------------------------------------------------------------

def test_list_locks_round_trip(make_lock, lock_ids, tmp_path):
    image_dir = tmp_path / ("im age \"quoted\" 100% é\\" + "x" * 300)      # > one comment
    conns = [Connection(socket.AF_INET, "10.0.0.1", 40000, "10.0.0.2", 443, ino=2**40, reuseaddr=1),
             Connection(socket.AF_INET6, "2001:db8::1", 1, "2001:db8:0:0::2", 65535, ino=7),
             Connection(socket.AF_INET6, "::ffff:10.1.1.1", 5, "::ffff:10.1.1.2", 6, ino=8)]
    before = time.time()
    lock = make_lock(conns, image_dir=str(image_dir))
    info = ours(lock_ids)[lock.id]
    assert info.owner_pid == os.getpid()
    assert info.owner_start_time == int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    assert info.owner_pidns == os.stat("/proc/self/ns/pid").st_ino
    assert info.image_dir == str(image_dir) == lock.image_dir
    assert before - 1 <= info.created <= time.time() + 1
    assert set(info.connections) == set(conns) == set(lock.connections)
    assert netlock.owner_alive(info)
    # the same pid with another start time is another process (pid reuse)
    assert not netlock.owner_alive(dataclasses.replace(info, owner_start_time=info.owner_start_time + 1))
    # the table comment is there for people reading `nft list ruleset`
    text = subprocess.run(["nft", "list", "table", "inet", lock.table], capture_output=True,
                          text=True, check=True).stdout
    assert f'comment "ptckpt network lock, owner pid {os.getpid()}' in text


_CHILD = """
import socket, sys, time
from ptckpt import netlock
netlock.lock([netlock.Connection(socket.AF_INET, "127.0.0.1", 7, "127.0.0.2", 9, ino=123, reuseaddr=1)],
             image_dir=sys.argv[2], lock_id=sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def test_lock_of_killed_owner_is_listed_and_dead(lock_ids, tmp_path):
    lock_id = f"test-child-{os.getpid()}-{os.urandom(3).hex()}"
    lock_ids.append(lock_id)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, lock_id, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert child.stdout.readline() == "locked\n"
        info = ours(lock_ids)[lock_id]
        assert info.owner_pid == child.pid and netlock.owner_alive(info)
        child.send_signal(signal.SIGKILL)
        wait_until(lambda: proc_stat(child.pid).state == "Z", timeout=2.0)
        info = ours(lock_ids)[lock_id]             # survives its owner, metadata intact
        assert not netlock.owner_alive(info)       # a zombie is dead
        assert info.owner_pid == child.pid and info.image_dir == str(tmp_path)
        assert info.connections == (Connection(socket.AF_INET, "127.0.0.1", 7, "127.0.0.2", 9,
                                               ino=123, reuseaddr=1),)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert not netlock.owner_alive(info)           # reaped: no such process


def test_unlock_is_idempotent(make_lock, lock_ids):
    lock = make_lock([Connection(socket.AF_INET, "127.0.0.1", 1, "127.0.0.1", 2)])
    assert lock.id in ours(lock_ids)
    netlock.unlock(lock)
    netlock.unlock(lock)
    netlock.unlock(lock.id)
    netlock.unlock("test-never-made")
    assert lock.id not in ours(lock_ids)


def test_thousand_connections(make_lock, lock_ids, capsys):
    conns = [Connection(socket.AF_INET, "10.9.0.1", 10000 + i, "10.9.1.1", 443, ino=i, reuseaddr=i % 2)
             for i in range(500)]
    conns += [Connection(socket.AF_INET6, "fd00::1", 10000 + i, "fd00::2", 443, ino=1000 + i)
              for i in range(500)]
    t0 = time.perf_counter()
    lock = make_lock(conns)
    t1 = time.perf_counter()
    info = ours(lock_ids)[lock.id]
    t2 = time.perf_counter()
    netlock.unlock(lock)
    t3 = time.perf_counter()
    assert set(info.connections) == set(conns)
    with capsys.disabled():
        print(f"\nnetlock: 1000 connections: lock {(t1 - t0) * 1e3:.1f} ms, "
              f"list_locks {(t2 - t1) * 1e3:.1f} ms, unlock {(t3 - t2) * 1e3:.1f} ms")


# --- errors and availability --------------------------------------------------------

def test_available_here():
    assert netlock.available() is None


def test_existing_id_is_refused_in_one_line(make_lock):
    lock = make_lock([])
    with pytest.raises(NetLockError) as exc:
        netlock.lock([], image_dir="/", lock_id=lock.id)
    assert "File exists" in exc.value.reason and "\n" not in str(exc.value)
    assert exc.value.exit_code == ExitCode.MISSING_FEATURE


@pytest.mark.parametrize("args", [
    (socket.AF_INET, "::1", 1, "::1", 2),
    (socket.AF_INET6, "127.0.0.1", 1, "::1", 2),
    (socket.AF_INET6, "::ffff:1.2.3.4", 1, "::1", 2),
    (socket.AF_INET, "1.2.3.4", 70000, "1.2.3.4", 2),
    (socket.AF_UNIX, "1.2.3.4", 1, "1.2.3.4", 2),
    (socket.AF_INET, "not an address", 1, "1.2.3.4", 2),
])
def test_bad_connections_are_usage_errors(args):
    with pytest.raises(UsageError):
        Connection(*args)


def test_bad_lock_id():
    with pytest.raises(UsageError):
        netlock.lock([], image_dir="/", lock_id="bad id; flush ruleset")
    with pytest.raises(UsageError):
        netlock.unlock("x { }")


@needs("setpriv")
def test_without_cap_net_admin_available_says_why():
    code = "from ptckpt import netlock; print(netlock.available())"
    out = subprocess.run(["setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin",
                          sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout
    assert "Operation not permitted" in out and out.count("\n") == 1
