"""Inet and netlink sockets through `ptckpt dump` and `ptckpt restore`, end to end: real
processes (fixtures/tcppair.c, udpserver.c, tcplisten.c, netkinds.py), the real kernel,
the CLI as a user runs it.

What each test leaves behind is cleaned up in finalisers, even when it fails: the
processes (spawn, plus `doomed` for restored copies at other pids and their pid
namespace's init), the network locks of the test's own images (`own_locks`), and the
nft table a test adds to drop SYNs (`drop_syns`).  Other tests (other files, running
meanwhile) may hold ptckpt locks of their own: only locks whose image directory lies
under this test's tmp_path are looked at.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ptckpt import inetdiag, netlock
from ptckpt.formats.image import ImageReader
from ptckpt.resources import tcp

from conftest import needs_network_lock, kill_pids, pid_alive, reap_orphans, wait_pid_free, wait_until
from test_restore import _one_line, _restore

pytestmark = needs_network_lock()

# README, "Exit codes": the contract, so the numbers themselves.
EXIT_UNSUPPORTED = 13      # a resource this version cannot checkpoint (named)
EXIT_CONNECTION = 21       # an established TCP connection the dump was not asked to take

FNV_OFFSET, FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


def _recv_until(peer, end: bytes) -> bytes:
    """What `peer` receives up to and including `end` (an EOF before it fails the test)."""
    got = b""
    while not got.endswith(end):
        chunk = peer.recv(100)
        assert chunk, f"EOF after {got!r}"
        got += chunk
    return got


def fnv1a(data: bytes) -> str:
    h = FNV_OFFSET
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# --- fixtures and helpers -------------------------------------------------------------

@pytest.fixture
def own_locks(tmp_path) -> Iterator[Callable[[], list[netlock.LockInfo]]]:
    """own_locks() -> the ptckpt network locks whose image lies under this test's tmp_path.
    At teardown any still there is removed (a failed test must not leave one)."""
    def mine() -> list[netlock.LockInfo]:
        return [i for i in netlock.list_locks() if i.image_dir.startswith(str(tmp_path))]
    yield mine
    for info in mine():
        netlock.unlock(info)


@pytest.fixture
def doomed() -> Iterator[list[int]]:
    """A list of pids (restored copies at pids spawn does not know, pid namespace inits)
    that are SIGKILLed and reaped at teardown."""
    pids: list[int] = []
    yield pids
    kill_pids(pids)

    def all_gone() -> bool:
        reap_orphans()
        return not any(pid_alive(p) for p in pids)

    wait_until(all_gone, 5, message=lambda: f"restored processes to die: "
                                            f"{[p for p in pids if pid_alive(p)]}")


@pytest.fixture
def drop_syns() -> Iterator[Callable[[int], None]]:
    """drop_syns(port): packets to 127.0.0.1:port are dropped on input, in an nft table of
    the test's own (not a ptckpt-* one), removed at teardown."""
    table = f"test_inet_drop_{os.getpid()}"
    made = []

    def drop(port: int) -> None:
        script = (f"table inet {table} {{\n chain input {{\n"
                  f"  type filter hook input priority -10; policy accept;\n"
                  f"  ip daddr 127.0.0.1 tcp dport {port} drop\n }}\n}}\n")
        subprocess.run(["nft", "-f", "-"], input=script, text=True, check=True, capture_output=True)
        made.append(table)

    yield drop
    for t in made:
        subprocess.run(["nft", "delete", "table", "inet", t], capture_output=True)


def dump(ptckpt, pid: int, image: Path, *flags: str):
    return ptckpt("dump", pid, "-D", image, *flags)


def dump_ok(ptckpt, pid: int, image: Path, *flags: str) -> None:
    res = dump(ptckpt, pid, image, *flags)
    assert res.returncode == 0, res.stderr


M32 = pytest.mark.proc_differs("maps", reason="a restored 32-bit process shows [vsyscall] (test_compat32)")


def _build(request, name: str, build: str) -> str:
    """The fixture `name` as built for `build`: "x86_64" or "-m32" (conftest.fixture_bins32)."""
    return name if build == "x86_64" else str(request.getfixturevalue("fixture_bins32")[name])


def killed(*targets) -> None:
    """After a dump --kill: the processes are gone and their pids free for the restore."""
    for t in targets:
        pid = t if isinstance(t, int) else t.pid
        if not isinstance(t, int):
            t.wait_exit(10)
        wait_pid_free(pid)


def table_exists(lock_id: str) -> bool:
    return subprocess.run(["nft", "list", "table", "inet", netlock.TABLE_PREFIX + lock_id],
                          capture_output=True).returncode == 0


def assert_refused_cleanly(res, code: int, target_pids, image: Path, own_locks, *words: str) -> str:
    """A refused dump: exit `code`, one line on stderr naming `words`, no traceback, the
    target running, no image directory, no network lock of ours."""
    _one_line(res, code, *words)
    for pid in target_pids:
        assert pid_alive(pid), f"{pid} must still run after a refused dump"
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f)
        assert status["State"].split()[0] in ("S", "R"), f"{pid} left {status['State'].strip()}"
        assert status["TracerPid"].strip() == "0", f"{pid} left traced"
    assert not image.exists(), f"a refused dump left {image}"
    assert not list(image.parent.glob(f".{image.name}.tmp-*")), "a refused dump left its temporary directory"
    assert own_locks() == [], "a refused dump left a network lock"
    return [l for l in res.stderr.strip().splitlines() if not l.startswith("ptckpt: warning")][0]


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def ppid_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def tcp_sockets_of(pid: int) -> list[inetdiag.InetSock]:
    """The TCP sockets (inet_diag records) that pid holds open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with_link = os.readlink(f"/proc/{pid}/fd/{fd}")
        if m := re.fullmatch(r"socket:\[(\d+)\]", with_link):
            inodes.add(int(m.group(1)))
    return inetdiag.inet_sockets(protocols=(socket.IPPROTO_TCP,), inodes=inodes)


def no_failures(target) -> None:
    """No FAIL line in the fixture's log, nothing on its stderr (a restored copy writes
    to the same files)."""
    assert not [l for l in target.out_lines() if l.startswith("FAIL")], target.describe()
    assert target.stderr_text().strip() == "", target.describe()


# --- tcppair: an established, half-closed connection with a MiB unread each way ------

def tcppair_facts(t) -> dict:
    child = int(t.wait_for_line(r"^CHILD (\d+)$").group(1))
    lport, plocal, clocal = map(int, t.wait_for_line(r"^PORTS (\d+) (\d+) (\d+)$").groups())
    sent = {m.group(1): (int(m.group(2)), m.group(3))
            for m in (re.match(r"^SENT (parent|child) \d+ (\d+) ([0-9a-f]{16})$", l)
                      for l in t.stdout_lines()) if m}
    assert set(sent) == {"parent", "child"}, t.describe()
    return {"child": child, "lport": lport, "pport": plocal, "cport": clocal, "sent": sent}


def log_line(t, pattern: str, count: int = 1, timeout: float = 20) -> re.Match:
    """The count-th line of t's log matching pattern, awaited whoever writes it (the
    original, or a restored copy at another pid: Target.wait_for_line gives up when the
    original has ended)."""
    rx = re.compile(pattern)

    def found():
        matches = [m for m in map(rx.search, t.out_lines()) if m]
        return matches[count - 1] if len(matches) >= count else None

    return wait_until(found, timeout, message=lambda: f"line {pattern!r} #{count}\n{t.describe()}")


def assert_pair_received(t, facts, count: int = 1, timeout: float = 20) -> None:
    """Each side's RECEIVED equals the other's SENT; the parent sees eof, the child noeof."""
    parent = log_line(t, r"^RECEIVED parent \d+ (\d+) ([0-9a-f]{16}) (\w+)$", count, timeout)
    child = log_line(t, r"^RECEIVED child \d+ (\d+) ([0-9a-f]{16}) (\w+)$", count, timeout)
    n, h = facts["sent"]["child"]
    assert parent.groups() == (str(n), h, "eof"), (parent.group(0), facts["sent"])
    n, h = facts["sent"]["parent"]
    assert child.groups() == (str(n), h, "noeof"), (child.group(0), facts["sent"])


@pytest.mark.parametrize("build", ["x86_64", pytest.param("-m32", marks=M32)])
def test_tcppair_kill_and_restore_established(spawn, ptckpt, tmp_path, own_locks, request, build):
    """dump --kill --tcp-established, restore: both megabytes and the child's FIN arrive;
    the network lock of the dump holds until the restore, then goes (32-bit programs too)."""
    t = spawn(_build(request, "tcppair", build))
    facts = tcppair_facts(t)
    image = tmp_path / "img"
    dump_ok(ptckpt, t.pid, image, "--kill", "--tcp-established")
    killed(t, facts["child"])
    with ImageReader(image) as im:
        lock_id = im.inventory.netlock
    assert lock_id, "a killed tree with connections keeps its network lock in the image"
    assert table_exists(lock_id), "the lock is held between the dump and the restore"
    pid = _restore(ptckpt, image)
    assert pid == t.pid
    assert children_of(pid) == [facts["child"]]
    assert not table_exists(lock_id), "the restore removes the dump's lock"
    assert own_locks() == []
    os.kill(facts["child"], signal.SIGUSR1)
    t.signal(signal.SIGUSR1)
    assert_pair_received(t, facts)
    assert t.wait_exit(10) in (0, None), t.describe()
    no_failures(t)


def test_connections_are_locked_when_the_tree_is_frozen(spawn, tmp_path, own_locks):
    """--tcp-established locks the connections in the freeze, before the dump's after_freeze
    hook runs (where a group meets at its barrier "frozen"); the capture keeps that lock (no
    second table), and a leave-running dump lifts it at the end."""
    from ptckpt.pipeline.dump import dump as library_dump
    t = spawn("tcppair")
    facts = tcppair_facts(t)
    conns = {d.ino: d for p in (t.pid, facts["child"]) for d in tcp_sockets_of(p) if d.state in tcp.REPAIRABLE}
    assert len(conns) == 2, conns
    seen = {}

    def locked() -> set[int]:
        return {c.ino for info in own_locks() for c in info.connections}

    def after_freeze(result):
        seen["frozen"] = (locked(), [i.id for i in own_locks()], result.netlock_at)

    def before_release(result):
        seen["captured"] = (locked(), [i.id for i in own_locks()])

    t0 = time.time()
    library_dump(t.pid, str(tmp_path / "img"), tcp_established=True, after_freeze=after_freeze,
                 before_release=before_release)
    inos, tables, at = seen["frozen"]
    assert inos == set(conns), "both ends of the connection locked before after_freeze"
    assert len(tables) == 1 and t0 < at <= time.time()
    assert seen["captured"] == (set(conns), tables), "the capture read them under the freeze's lock"
    assert own_locks() == [], "a leave-running dump removes its lock at the end"
    os.kill(facts["child"], signal.SIGUSR1)
    t.signal(signal.SIGUSR1)
    assert_pair_received(t, facts)
    assert t.wait_exit(10) == 0, t.describe()
    no_failures(t)


def test_a_dump_failing_after_the_freeze_lifts_its_lock(spawn, tmp_path, own_locks):
    """The freeze's lock is undone with the freeze: a dump that fails after it (a group that
    gave up at its barrier) leaves no lock, and the connection goes on."""
    from ptckpt.pipeline.dump import dump as library_dump
    t = spawn("tcppair")
    facts = tcppair_facts(t)
    held = []

    def give_up(result):
        held.extend(own_locks())
        raise RuntimeError("the group gave up")

    with pytest.raises(RuntimeError, match="the group gave up"):
        library_dump(t.pid, str(tmp_path / "img"), tcp_established=True, after_freeze=give_up)
    assert len(held) == 1 and len(held[0].connections) == 2, held
    assert own_locks() == [] and not (tmp_path / "img").exists()
    os.kill(facts["child"], signal.SIGUSR1)
    t.signal(signal.SIGUSR1)
    assert_pair_received(t, facts)
    assert t.wait_exit(10) == 0, t.describe()
    no_failures(t)


def test_an_external_connection_locked_at_the_freeze_is_let_go_by_the_capture(spawn, tmp_path, own_locks):
    """--tcp-established --external tcp:...: the freeze cannot know the plugin's claim and
    locks the connection; the capture, which does not read it, lets it go (the image holds
    no lock of it), and it goes on."""
    from ptckpt.builtins import External
    from ptckpt.pipeline.dump import dump as library_dump
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        t = spawn("netkinds.py", "tcp-echo", port, ready=False)
        peer, _ = listener.accept()
    with peer:
        peer.settimeout(10)
        peer.sendall(b"hello\n")
        t.wait_for_line(r"^READY ")
        seen = {}
        library_dump(t.pid, str(tmp_path / "img"), tcp_established=True,
                     plugins=[External([f"tcp:127.0.0.1:{port}"])],
                     after_freeze=lambda r: seen.setdefault("frozen", own_locks()),
                     before_release=lambda r: seen.setdefault("captured", own_locks()))
        assert [c.dport for info in seen["frozen"] for c in info.connections] == [port]
        assert seen["captured"] == [], "claimed as external: no lock of it from the capture on"
        peer.sendall(b"after the dump\n")
        t.signal(signal.SIGUSR1)
        assert _recv_until(peer, b"echo after the dump\n") == b"from the program\necho after the dump\n"
    assert t.wait_exit(10) in (0, None)
    no_failures(t)
    assert own_locks() == []


@pytest.mark.parametrize("original", ["running", "finished"])
def test_tcppair_leave_running_then_restore_in_netns(spawn, ptckpt, tmp_path, own_locks, doomed,
                                                     original):
    """A leave-running dump with --tcp-established: the original goes on untouched (and
    the lock goes); the image restored in a new pid and network namespace delivers the
    same bytes, whether the original still runs (its ports taken here) or has finished."""
    t = spawn("tcppair")
    facts = tcppair_facts(t)
    image = tmp_path / "img"
    dump_ok(ptckpt, t.pid, image, "--tcp-established")
    assert pid_alive(t.pid) and pid_alive(facts["child"])
    assert own_locks() == [], "a leave-running dump removes its lock at the end"
    with ImageReader(image) as im:
        assert im.inventory.netlock == "", "a leave-running image records no lock"

    def signal_original():
        os.kill(facts["child"], signal.SIGUSR1)
        t.signal(signal.SIGUSR1)
        assert_pair_received(t, facts)
        assert t.wait_exit(10) == 0, t.describe()

    if original == "finished":
        signal_original()
        wait_pid_free(facts["child"])
    # The original appended to its output files since the dump: they are the test's logs.
    outer = _restore(ptckpt, image, "--pidns", "--netns", "--file-policy", f"{tmp_path}/=ignore")
    doomed.extend([outer, ppid_of(outer)])
    for ns in ("net", "pid"):
        assert os.readlink(f"/proc/{outer}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}"), ns
    kids = children_of(outer)
    assert len(kids) == 1, kids
    doomed.extend(kids)
    if original == "running":
        signal_original()
    os.kill(kids[0], signal.SIGUSR1)
    os.kill(outer, signal.SIGUSR1)
    assert_pair_received(t, facts, count=2)
    wait_until(lambda: not pid_alive(outer), 10, message="the restored parent to finish")
    no_failures(t)
    assert own_locks() == []


# --- udpserver: a hundred datagrams queued, with their senders -----------------------

@pytest.mark.parametrize("addr, build", [("127.0.0.1", "x86_64"), ("::1", "x86_64"),
                                         pytest.param("127.0.0.1", "-m32", marks=M32)],
                         ids=["ipv4", "ipv6", "ipv4-m32"])
def test_udpserver_queue_with_senders(spawn, ptckpt, tmp_path, own_locks, request, addr, build):
    """100 datagrams (empty ones too) from 4 sockets of the test, unread at the dump: the
    restored server reads them in order, each with its sender's address and port (a
    32-bit server too)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    t = spawn(_build(request, "udpserver", build), addr)
    port = int(t.wait_for_line(r"^PORT (\d+)$").group(1))
    senders = [socket.socket(family, socket.SOCK_DGRAM) for _ in range(4)]
    try:
        for s in senders:
            s.bind((addr, 0))
        expected = []
        rng = random.Random(13)
        for i in range(100):
            s = senders[i % 4]
            payload = rng.randbytes(rng.choice([0, 1, 7, 100, 999, 1472, 4000]))
            s.sendto(payload, (addr, port))   # loopback: queued before sendto returns
            expected.append(f"DGRAM {addr} {s.getsockname()[1]} {len(payload)} {fnv1a(payload)}")
        image = tmp_path / "img"
        dump_ok(ptckpt, t.pid, image, "--kill")
        killed(t)
        assert _restore(ptckpt, image) == t.pid
        t.signal(signal.SIGUSR1)
        t.wait_for_line(r"^DONE \d+$", where="out")
        got = [l for l in t.out_lines() if l.startswith("DGRAM ")]
        assert got == expected
        assert t.out_lines()[-1] == "DONE 100"
        assert t.wait_exit(10) in (0, None)
        no_failures(t)
        assert own_locks() == []
    finally:
        for s in senders:
            s.close()


# --- tcplisten: a listener with options and a connection waiting to be accepted -----

def expected_opts(family: str) -> str:
    v6only = {"4": "-", "6": "1", "dual": "0"}[family]
    return ("OPTS reuseaddr=1 nodelay=1 keepalive=1 keepidle=77 keepintvl=11 keepcnt=5 defer=3 "
            f"rcvbuf=524288 nonblock=1 v6only={v6only} backlog=17")


def listener_queue(pid: int) -> int:
    """Connections waiting in the accept queue of pid's listener (inet_diag rqueue)."""
    (lst,) = [s for s in tcp_sockets_of(pid) if s.state == 10]
    return lst.rqueue


@pytest.mark.parametrize("family", ["4", "6", "dual"])
def test_tcplisten_pending_child_is_queued_again(spawn, ptckpt, tmp_path, own_locks, family):
    """The listener comes back with its options and backlog, and the child's connection
    (client end in the tree) waits in its accept queue again, with the hello line."""
    t = spawn("tcplisten", "--family", family)
    child = int(t.wait_for_line(r"^CHILD (\d+)$").group(1))
    (csock,) = tcp_sockets_of(child)
    cport = csock.sport
    image = tmp_path / "img"
    dump_ok(ptckpt, t.pid, image, "--kill", "--tcp-established")
    killed(t, child)
    assert _restore(ptckpt, image) == t.pid
    assert children_of(t.pid) == [child]
    assert own_locks() == []
    os.kill(child, signal.SIGUSR1)
    t.signal(signal.SIGUSR1)
    t.wait_for_line(r"^CHILD-GOT ", where="out")
    lines = t.out_lines()
    peer = {"4": "127.0.0.1", "6": "::1", "dual": "::ffff:127.0.0.1"}[family]
    assert lines[0] == expected_opts(family), "every option as before the dump"
    assert [l for l in lines if l.startswith("ACCEPTED ")] == \
        [f"ACCEPTED {peer} {cport} hello from {child}"]
    assert "QUEUED 1" in lines, "queued again before the program runs"
    assert "DONE 1" in lines
    assert f"CHILD-GOT reply to {cport}" in lines
    assert t.wait_exit(10) in (0, None)
    no_failures(t)


def test_tcplisten_pending_refused_when_left_running(spawn, ptckpt, tmp_path, own_locks):
    """A leave-running dump cannot put a connection back in the queue it took it from."""
    t = spawn("tcplisten")
    child = int(t.wait_for_line(r"^CHILD (\d+)$").group(1))
    (csock,) = tcp_sockets_of(child)
    image = tmp_path / "img"
    res = dump(ptckpt, t.pid, image, "--tcp-established")
    assert_refused_cleanly(res, EXIT_UNSUPPORTED, [t.pid, child], image, own_locks,
                           f"process {t.pid}", "not yet accepted", "--kill", "--tcp-close")
    os.kill(child, signal.SIGUSR1)
    t.signal(signal.SIGUSR1)
    t.wait_for_line(r"^CHILD-GOT ", where="out")
    assert f"ACCEPTED 127.0.0.1 {csock.sport} hello from {child}" in t.out_lines()
    assert t.wait_exit(10) == 0
    no_failures(t)


def _outside_client(port: int) -> tuple[socket.socket, int]:
    c = socket.create_connection(("127.0.0.1", port), timeout=5)
    c.sendall(b"hello from outside\n")
    return c, c.getsockname()[1]


def test_tcplisten_outside_client_refused(spawn, ptckpt, tmp_path, own_locks):
    """A connection in the accept queue whose client is held outside the tree cannot be
    queued again: refused (13), naming the client; the listener then accepts it as if
    nothing happened."""
    t = spawn("tcplisten", "--no-child")
    port = int(t.wait_for_line(r"^PORT (\d+)$").group(1))
    client, cport = _outside_client(port)
    with client:
        wait_until(lambda: listener_queue(t.pid) == 1, 5, message="the connection in the accept queue")
        image = tmp_path / "img"
        res = dump(ptckpt, t.pid, image, "--kill", "--tcp-established")
        assert_refused_cleanly(res, EXIT_UNSUPPORTED, [t.pid], image, own_locks,
                               f"127.0.0.1:{cport}", "outside the tree")
        t.signal(signal.SIGUSR1)
        t.wait_for_line(r"^DONE \d+$", where="out")
        assert f"ACCEPTED 127.0.0.1 {cport} hello from outside" in t.out_lines()
        assert "DONE 1" in t.out_lines()
        assert client.recv(100) == f"reply to {cport}\n".encode()
    assert t.wait_exit(10) == 0
    no_failures(t)


def test_tcplisten_outside_client_dropped_with_tcp_close(spawn, ptckpt, tmp_path, own_locks):
    """--tcp-close drops such a connection; the restored listener works for a new one."""
    t = spawn("tcplisten", "--no-child")
    port = int(t.wait_for_line(r"^PORT (\d+)$").group(1))
    old, _old_port = _outside_client(port)
    with old:
        wait_until(lambda: listener_queue(t.pid) == 1, 5, message="the connection in the accept queue")
        image = tmp_path / "img"
        dump_ok(ptckpt, t.pid, image, "--kill", "--tcp-close")
        killed(t)
        assert _restore(ptckpt, image) == t.pid
        assert own_locks() == []
        new, new_port = _outside_client(port)
        with new:
            wait_until(lambda: listener_queue(t.pid) == 1, 5, message="the new connection queued")
            t.signal(signal.SIGUSR1)
            t.wait_for_line(r"^DONE \d+$", where="out")
            lines = t.out_lines()
            assert lines[0] == expected_opts("4")
            assert [l for l in lines if l.startswith("ACCEPTED ")] == \
                [f"ACCEPTED 127.0.0.1 {new_port} hello from outside"]
            assert "DONE 1" in lines
            assert new.recv(100) == f"reply to {new_port}\n".encode()
        # The dropped connection's client is told so (reset or EOF), not left hanging.
        try:
            assert old.recv(100) == b""
        except ConnectionResetError:
            pass
    assert t.wait_exit(10) == 0
    no_failures(t)


# --- a connection to a peer outside the tree ----------------------------------------------

def test_connection_to_outside_peer(spawn, ptckpt, tmp_path, own_locks):
    """--tcp-established with the peer outside (the test): the restore into a new network
    namespace is refused (13: the peer is not there), the same image restored here goes on
    with the bytes queued both ways, and the peer never noticed."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        t = spawn("netkinds.py", "tcp-echo", listener.getsockname()[1], ready=False)
        peer, _ = listener.accept()
    with peer:
        peer.settimeout(10)
        peer.sendall(b"hello\n")
        t.wait_for_line(r"^READY ")
        peer.sendall(b"queued at the dump\n")       # in the program's receive queue
        image = tmp_path / "img"
        dump_ok(ptckpt, t.pid, image, "--kill", "--tcp-established")
        killed(t)
        with ImageReader(image) as im:
            lock_id = im.inventory.netlock
        assert lock_id and table_exists(lock_id)
        res = ptckpt("restore", "-D", image, "--netns", "--detach")
        _one_line(res, EXIT_UNSUPPORTED, f"127.0.0.1:{peer.getsockname()[1]}",
                  "outside the image", "--netns")
        assert not pid_alive(t.pid)
        assert table_exists(lock_id), "a refused restore keeps the lock for the next one"
        assert _restore(ptckpt, image) == t.pid
        assert not table_exists(lock_id) and own_locks() == []
        t.signal(signal.SIGUSR1)
        assert _recv_until(peer, b"echo queued at the dump\n") == b"from the program\necho queued at the dump\n"
    assert t.wait_exit(10) in (0, None)
    no_failures(t)
    assert t.out_lines() == ["GOT hello", "ECHOED queued at the dump"]


# --- refusals ---------------------------------------------------------------------------

def test_established_without_flags_is_refused(spawn, ptckpt, tmp_path, own_locks):
    """Neither --tcp-established nor --tcp-close: refused (21) naming the connection, its
    fd and the ways out."""
    t = spawn("tcppair")
    facts = tcppair_facts(t)
    image = tmp_path / "img"
    res = dump(ptckpt, t.pid, image)
    line = assert_refused_cleanly(res, EXIT_CONNECTION, [t.pid, facts["child"]], image, own_locks,
                                  f"127.0.0.1:{facts['pport']}", f"127.0.0.1:{facts['cport']}",
                                  "--tcp-established", "--tcp-close")
    m = re.search(r"process (\d+) fd (\d+)", line)
    assert m, line
    pid, fd = int(m.group(1)), int(m.group(2))
    assert pid in (t.pid, facts["child"])
    assert os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:["), "it names the socket's fd"
    assert f"--external fd:{fd}" in line
    # Left as it was: the exchange still completes.
    os.kill(facts["child"], signal.SIGUSR1)
    t.signal(signal.SIGUSR1)
    assert_pair_received(t, facts)
    assert t.wait_exit(10) == 0
    no_failures(t)


@pytest.mark.parametrize("mode,words", [
    ("packet", ["fd ", "packet socket", "not supported"]),
    ("urgent", ["fd ", "urgent", "not supported"]),
    ("netlink-unread", ["fd ", "netlink", "not read", "not supported"]),
    ("tcp-shut-unconnected", ["fd ", "shut down", "before it was ever connected", "not supported"]),
])
def test_refused_kinds(spawn, ptckpt, tmp_path, own_locks, mode, words):
    """Each refused by name (13) before anything changed: the program then sees its socket
    as it was.  (--tcp-established, so that only the kind itself can be the reason.)"""
    t = spawn("netkinds.py", mode)
    image = tmp_path / "img"
    res = dump(ptckpt, t.pid, image, "--kill", "--tcp-established")
    assert_refused_cleanly(res, EXIT_UNSUPPORTED, [t.pid], image, own_locks,
                           f"process {t.pid}", *words)
    t.signal(signal.SIGUSR1)
    assert t.wait_exit(10) == 0, t.describe()
    after = {"packet": ["ALIVE packet type=3"],
             "urgent": ["URGENT !", "DATA data"], "tcp-shut-unconnected": ["READ EOF"]}.get(mode)
    if after:
        assert t.out_lines()[-len(after):] == after
    else:
        assert re.fullmatch(r"LINKS [1-9]\d*", t.out_lines()[-1]), t.out_lines()
    no_failures(t)


def test_syn_sent_is_refused(spawn, ptckpt, tmp_path, own_locks, drop_syns):
    """A connect still waiting for its SYN-ACK (the test drops its SYNs with an nft rule of
    its own: the network is closed here, and 192.0.2.1, TEST-NET, is this VM's gateway,
    which answers with a reset)."""
    with socket.socket() as hold:               # a port nobody listens on
        hold.bind(("127.0.0.1", 0))
        port = hold.getsockname()[1]
        drop_syns(port)
        t = spawn("netkinds.py", "synsent", "127.0.0.1", port)
        assert t.stdout_lines()[0] == "STATE SYN_SENT"
        image = tmp_path / "img"
        res = dump(ptckpt, t.pid, image, "--kill", "--tcp-established")
        assert_refused_cleanly(res, EXIT_UNSUPPORTED, [t.pid], image, own_locks,
                               f"process {t.pid}", "SYN_SENT", "not supported")
        t.signal(signal.SIGUSR1)
        assert t.wait_exit(10) == 0
        assert t.out_lines()[-1] == "STATE SYN_SENT"


def test_reset_connection_with_pending_error_is_refused(spawn, ptckpt, tmp_path, own_locks):
    """A connect refused (RST) whose error the program has not collected yet."""
    with socket.socket() as hold:
        hold.bind(("127.0.0.1", 0))
        port = hold.getsockname()[1]
        t = spawn("netkinds.py", "synsent", "127.0.0.1", port)
        image = tmp_path / "img"
        res = dump(ptckpt, t.pid, image, "--kill", "--tcp-established")
        assert_refused_cleanly(res, EXIT_UNSUPPORTED, [t.pid], image, own_locks,
                               f"process {t.pid}", "pending error", "not supported")
        t.signal(signal.SIGUSR1)
        assert t.wait_exit(10) == 0
        assert t.out_lines()[-1] == "STATE CLOSE"


# --- kinds that come back ---------------------------------------------------------------

def round_trip(ptckpt, t, tmp_path, *flags: str) -> int:
    """dump --kill, restore, SIGUSR1; returns the number of log lines before the dump."""
    logged = len(t.out_lines())
    image = tmp_path / "img"
    dump_ok(ptckpt, t.pid, image, "--kill", *flags)
    killed(t)
    assert _restore(ptckpt, image) == t.pid
    t.signal(signal.SIGUSR1)
    return logged


def after_ready(t, logged: int) -> list[str]:
    """The log lines the restored copy wrote (after the first `logged`), once it exited 0."""
    assert t.wait_exit(10) in (0, None), t.describe()
    no_failures(t)
    return t.out_lines()[logged:]


@pytest.mark.parametrize("mode", ["tcp-unbound", "tcp-bound"])
def test_tcp_socket_not_connected_comes_back(spawn, ptckpt, tmp_path, own_locks, mode):
    """An unbound, and a bound but not listening, TCP socket: same getsockname, and usable."""
    t = spawn("netkinds.py", mode)
    name = t.stdout_lines()[0]
    if mode == "tcp-bound":
        assert re.fullmatch(r"NAME 127\.0\.0\.1 [1-9]\d*", name), name
    else:
        assert name == "NAME 0.0.0.0 0"
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == [name, "CONNECTED ping"], "same getsockname, and it still works"


def test_connected_udp_comes_back(spawn, ptckpt, tmp_path, own_locks):
    """Same getsockname and getpeername; datagrams queued at the dump and sent after the
    restore by the peer arrive; it still sends to its peer."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as peer:
        peer.bind(("127.0.0.1", 0))
        peer.settimeout(5)
        pport = peer.getsockname()[1]
        t = spawn("netkinds.py", "udp-connected", pport)
        name, peer_line = t.stdout_lines()[:2]
        assert peer_line == f"PEER 127.0.0.1 {pport}"
        mport = int(name.split()[2])
        for word in (b"one", b"two"):
            peer.sendto(word, ("127.0.0.1", mport))
        logged = len(t.out_lines())
        image = tmp_path / "img"
        dump_ok(ptckpt, t.pid, image, "--kill")
        killed(t)
        assert _restore(ptckpt, image) == t.pid
        for word in (b"three", b"END"):
            peer.sendto(word, ("127.0.0.1", mport))
        t.signal(signal.SIGUSR1)
        data, addr = peer.recvfrom(100)
        assert (data, addr) == (b"reply", ("127.0.0.1", mport)), "it still sends to its peer"
        lines = after_ready(t, logged)
        assert lines == [name, peer_line] + [f"DGRAM 127.0.0.1 {pport} {w}"
                                             for w in ("one", "two", "three", "END")] + ["DONE 3"]


def test_netlink_route_socket_comes_back(spawn, ptckpt, tmp_path, own_locks):
    """A bound NETLINK_ROUTE socket: same port id and groups, and RTM_GETLINK answered."""
    t = spawn("netkinds.py", "netlink-bound")
    name, links = t.stdout_lines()[:2]
    portid, groups = map(int, name.split()[1:])
    assert portid != 0 and groups == 0x81, name
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == [name, links], "same port id and groups; RTM_GETLINK answered"


def test_socket_options_come_back(spawn, ptckpt, tmp_path, own_locks):
    """Buffer sizes, TCP_NODELAY, keepalive and its timers, SO_REUSEADDR, IP_TOS."""
    t = spawn("netkinds.py", "sockopts")
    opts = t.stdout_lines()[0]
    assert "rcvbuf=600000" in opts and "nodelay=1" in opts and "keepalive=1" in opts, opts
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == [opts]


def test_socket_options_of_a_connection_come_back(spawn, ptckpt, tmp_path, own_locks):
    """The same options on a connection rebuilt with TCP_REPAIR (--tcp-established)."""
    t = spawn("netkinds.py", "sockopts-established")
    opts = t.stdout_lines()[0]
    logged = round_trip(ptckpt, t, tmp_path, "--tcp-established")
    assert after_ready(t, logged) == [opts, "CONNECTED ping"]


def test_tcp_maxseg_comes_back(spawn, ptckpt, tmp_path, own_locks):
    """TCP_MAXSEG set by the program (the MSS it will announce) is one of its options too."""
    t = spawn("netkinds.py", "maxseg")
    opts = t.stdout_lines()[0]
    assert opts == "OPTS maxseg=1200", opts
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == [opts]


def test_nonlocal_address_bound_with_freebind_comes_back(spawn, ptckpt, tmp_path, own_locks):
    """UDP sockets bound (IPv4 and IPv6) to an address of no interface with IP_FREEBIND,
    which the program turned off after its bind (zdtm sk-freebind-false): same address,
    IP_FREEBIND off again."""
    port = random.randrange(20000, 30000)
    t = spawn("netkinds.py", "freebind-off", port)
    names = t.stdout_lines()[:2]
    assert names == [f"NAME 192.0.2.1 {port} FREEBIND 0", f"NAME 2001:db8::42 {port} FREEBIND 0"], names
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == names


def test_restore_tcp_close_closes_connections_dumped_established(spawn, ptckpt, tmp_path, own_locks):
    """dump --tcp-established, restore --tcp-close (CRIU's restore option, zdtm
    socket-tcp-close0): the connection comes back closed, as a dump --tcp-close makes it,
    and the image's network lock goes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        t = spawn("netkinds.py", "tcp-close", listener.getsockname()[1], ready=False)
        server, _ = listener.accept()
        with server:
            server.sendall(b"hello\n")
            t.wait_for_line(r"^READY ")
            logged = len(t.out_lines())
            image = tmp_path / "img"
            dump_ok(ptckpt, t.pid, image, "--kill", "--tcp-established")
            killed(t)
            assert len(own_locks()) == 1, "the connection is locked until a restore"
            assert _restore(ptckpt, image, "--tcp-close") == t.pid
            t.signal(signal.SIGUSR1)
            lines = after_ready(t, logged)
            assert own_locks() == [], "the lock went with the restore"
    assert lines == ["READ1 EOF", "READ2 EOF", "STATE CLOSE", "SEND EPIPE"]


def test_tcp_connections_over_come_back_over(spawn, ptckpt, tmp_path, own_locks):
    """Connections that ended while the program held them (both ends shut their send side:
    zdtm socket-tcp-close2) come back over: end of file at reads, EPIPE at sends; a socket
    disconnected with connect(AF_UNSPEC) comes back unconnected (the MSS of the connection
    it had is no option of the program's), and the peer it reset, its error read, over."""
    t = spawn("netkinds.py", "tcp-over")
    assert t.stdout_lines()[0] == "STATE CLOSE CLOSE CLOSE CLOSE", t.describe()
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == ["STATE CLOSE READ EOF SEND EPIPE"] * 2 + [
        "STATE CLOSE READ ENOTCONN SEND EPIPE", "STATE CLOSE READ EOF SEND EPIPE"]


@pytest.mark.parametrize("proto", [17, 136], ids=["udp", "udplite"])
def test_shut_datagram_sockets_come_back(spawn, ptckpt, tmp_path, own_locks, proto):
    """UDP and UDP-Lite sockets shut down (zdtm socket_udplite): one connected to port 0
    (getpeername says ENOTCONN, yet it is connected), one never connected (its shutdown
    said ENOTCONN, yet shut it): same state, same poll events (POLLRDHUP, POLLHUP)."""
    t = spawn("netkinds.py", "dgram-shut", proto)
    shut = t.stdout_lines()[0]
    assert shut.startswith("SHUT 01 07 "), shut
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == [shut]


def test_buffer_locks_come_back(spawn, ptckpt, tmp_path, own_locks):
    """SO_BUF_LOCK as the program left it (zdtm sock_opts02): set alone, set by a buffer
    size, and cleared again after one (the size stays, the kernel may tune it again)."""
    t = spawn("netkinds.py", "buflock")
    locks = t.stdout_lines()[0]
    assert locks == "BUFLOCK 1 3 1 0 SNDBUF 200000", locks
    logged = round_trip(ptckpt, t, tmp_path)
    assert after_ready(t, logged) == [locks]


def test_tcp_close_connection_comes_back_closed(spawn, ptckpt, tmp_path, own_locks):
    """dump --tcp-close, CRIU's meaning (zdtm socket-dump-tcp-close): the restored program
    finds its connection over, both ways shut and no error pending: end of file at every read."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        t = spawn("netkinds.py", "tcp-close", listener.getsockname()[1], ready=False)
        server, _ = listener.accept()
        with server:
            server.sendall(b"hello\n")
            t.wait_for_line(r"^READY ")
            assert t.out_lines() == ["GOT hello"]
            logged = round_trip(ptckpt, t, tmp_path, "--tcp-close")
            lines = after_ready(t, logged)
    assert lines == ["READ1 EOF", "READ2 EOF", "STATE CLOSE", "SEND EPIPE"]
