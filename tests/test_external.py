"""External connections and listeners (dump --external, restore --reconnect [--remap-addr]) on
real processes: fixtures/netpeer.py holds the socket at fd 9; the servers and clients on the
other side are the test's own."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from ptckpt.builtins import Listener, Reconnect, canonical_address
from ptckpt.errors import ExitCode, UsageError
from ptckpt.formats.image import ImageReader
from ptckpt.tracee import pidfd_getfd

from conftest import kill_pids, reap_orphans, wait_pid_free, wait_until


def _has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6(), reason="no IPv6 loopback")


class PingServer:
    """A TCP server that keeps every connection it accepts; ping() sends "PING <word>" on one
    and returns the line it gets back."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port = self.sock.getsockname()[1]
        self.host = host
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.settimeout(10)
            self.connections.append(conn)

    def ping(self, conn: socket.socket, word: str) -> str:
        conn.sendall(f"PING {word}\n".encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(100)
            if not chunk:
                break
            data += chunk
        return data.decode().strip()

    def close(self) -> None:
        self.sock.close()
        for c in self.connections:
            c.close()


@pytest.fixture
def ping_server():
    servers: list[PingServer] = []

    def make(host: str = "127.0.0.1") -> PingServer:
        servers.append(PingServer(host))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _hello(address, line: str) -> str:
    """Connect to a listener (a (host, port) or a unix path), send a line, return its reply."""
    family = socket.AF_UNIX if isinstance(address, str) else \
        socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(10)
        c.connect(address)
        c.sendall(line.encode() + b"\n")
        return c.recv(100).decode().strip()


def _dump(ptckpt, target, image: Path, *extra) -> None:
    res = ptckpt("dump", target.pid, "-D", image, "--kill", *extra)
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    wait_pid_free(target.pid)


def _restore(ptckpt, image: Path, *extra) -> None:
    res = ptckpt("restore", "-D", image, "--detach", *extra)
    assert res.returncode == 0, res.stderr


def _refused(res, code: int, *words: str) -> None:
    """One error line (other lines are notes about stale locks of other dumps) naming `words`."""
    assert res.returncode == code, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    [line] = [l for l in res.stderr.splitlines() if l.startswith("ptckpt: error:")]
    for w in words:
        assert w in line, line


def _external_notes(image: Path, pid: int) -> list[str]:
    with ImageReader(image) as reader:
        return [f.external for f in reader.process(pid).fds if f.external]


def _fd9(pid: int) -> tuple[int, int, object]:
    """(fdinfo flags, SO_REUSEADDR, local address) of the socket at fd 9 of `pid`."""
    with open(f"/proc/{pid}/fdinfo/9") as f:
        flags = int(next(l for l in f if l.startswith("flags:")).split()[1], 8)
    with socket.socket(fileno=pidfd_getfd(pid, 9)) as s:
        return flags, s.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR), s.getsockname()


# --- listeners ---------------------------------------------------------------------------

@pytest.mark.parametrize("host, extra", [("127.0.0.1", ()), pytest.param("::1", ("nonblock",), marks=needs_ipv6),
                                         ("127.0.0.1", ("nonblock", "noreuse"))],
                         ids=["ipv4", "ipv6-nonblock", "ipv4-noreuse"])
def test_external_listener_listens_again_at_its_fd(spawn, ptckpt, tmp_path, host, extra):
    target = spawn("netpeer.py", "listen", host, 0, *extra)
    port = int(next(l for l in target.preamble if l.startswith("PORT")).split()[1])
    try:
        if "noreuse" not in extra:       # (a connection it closed would keep the port in TIME_WAIT)
            assert _hello((host, port), "before") == "HELLO before 1"
        flags, reuse, local = _fd9(target.pid)
        v6only = ""
        if ":" in host:
            with socket.socket(fileno=pidfd_getfd(target.pid, 9)) as s:
                v6only = f" IPV6_V6ONLY={s.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)}"
        _dump(ptckpt, target, tmp_path / "img", "--external", "fd:9")
        bracket = f"[{host}]" if ":" in host else host
        note = f"listen:{bracket}:{port} backlog=5 SO_REUSEADDR={reuse}{v6only}"
        assert _external_notes(tmp_path / "img", target.pid) == [note]
        _refused(ptckpt("restore", "-D", tmp_path / "img"), ExitCode.PLUGIN, "fd 9", f"listen:{bracket}:{port}",
                 "no plugin claimed it")

        _restore(ptckpt, tmp_path / "img", "--reconnect")
        assert _fd9(target.pid)[1:] == (reuse, local), "bound to the same address, SO_REUSEADDR as it was"
        assert _fd9(target.pid)[0] & os.O_NONBLOCK == flags & os.O_NONBLOCK
        n = 1 if "noreuse" in extra else 2
        assert _hello((host, port), "after") == f"HELLO after {n}", "it accepts on the new listener"
        assert _hello((host, port), "again") == f"HELLO again {n + 1}"
    finally:
        kill_pids([target.pid])
        reap_orphans()


def test_external_listener_by_address_moves_with_remap_addr(spawn, ptckpt, tmp_path):
    target = spawn("netpeer.py", "listen", "127.0.0.1", 0)
    port = int(next(l for l in target.preamble if l.startswith("PORT")).split()[1])
    with socket.create_server(("127.0.0.1", 0)) as probe:
        new_port = probe.getsockname()[1]
    try:
        _dump(ptckpt, target, tmp_path / "img", "--external", f"listen:127.0.0.1:{port}")
        [note] = _external_notes(tmp_path / "img", target.pid)
        assert note.startswith(f"listen:127.0.0.1:{port} backlog=5")
        _refused(ptckpt("restore", "-D", tmp_path / "img", "--remap-addr",
                        f"listen:127.0.0.1:{port}=tcp:127.0.0.1:{new_port}"), ExitCode.USAGE,
                 "a listener moves to a listen:... or listen-unix:... address")
        _restore(ptckpt, tmp_path / "img", "--remap-addr", f"listen:127.0.0.1:{port}=listen:127.0.0.1:{new_port}")
        assert _hello(("127.0.0.1", new_port), "moved") == "HELLO moved 1"
        with pytest.raises(ConnectionRefusedError):
            _hello(("127.0.0.1", port), "old")
    finally:
        kill_pids([target.pid])
        reap_orphans()


def test_external_unix_listener_listens_again_on_its_path(spawn, ptckpt, tmp_path):
    path = str(tmp_path / "srv.sock")
    target = spawn("netpeer.py", "listen-unix", path, "nonblock")
    try:
        assert _hello(path, "before") == "HELLO before 1"
        _dump(ptckpt, target, tmp_path / "img", "--external", f"listen-unix:{path}")
        assert _external_notes(tmp_path / "img", target.pid) == [f"listen-unix:{path} backlog=5"]
        assert stat.S_ISSOCK(os.lstat(path).st_mode), "the dead listener's socket file is still there"
        _restore(ptckpt, tmp_path / "img", "--reconnect")
        assert _fd9(target.pid)[0] & os.O_NONBLOCK
        assert _hello(path, "after") == "HELLO after 2"
    finally:
        kill_pids([target.pid])
        reap_orphans()


FORKED = r'''
import os, socket, sys, time
s = socket.create_server(("127.0.0.1", 0), backlog=3)
os.dup2(s.fileno(), 9); s.close()
s = socket.socket(fileno=9)
print("PORT", s.getsockname()[1], flush=True)
kid = os.fork()
if kid == 0:
    while True: time.sleep(0.05)
print("KID", kid, flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
'''


def test_a_listener_shared_by_two_processes_comes_back_shared(spawn, ptckpt, tmp_path):
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    target = spawn(str(script))
    kid = int(next(l for l in target.preamble if l.startswith("KID")).split()[1])
    port = int(next(l for l in target.preamble if l.startswith("PORT")).split()[1])
    try:
        _dump(ptckpt, target, tmp_path / "img", "--external", "fd:9")
        wait_until(lambda: not os.path.exists(f"/proc/{kid}"), 5)
        assert _external_notes(tmp_path / "img", kid) == [f"listen:127.0.0.1:{port} backlog=3 SO_REUSEADDR=1"]
        _restore(ptckpt, tmp_path / "img", "--reconnect")
        assert os.readlink(f"/proc/{target.pid}/fd/9") == os.readlink(f"/proc/{kid}/fd/9"), \
            "one listener, held by both (a second bind would have failed)"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        kill_pids([target.pid, kid])
        reap_orphans()


# --- connections -------------------------------------------------------------------------

@pytest.mark.parametrize("host, how", [("127.0.0.1", "fd"), ("127.0.0.1", "address"),
                                       pytest.param("::1", "fd", marks=needs_ipv6),
                                       pytest.param("::1", "address", marks=needs_ipv6)])
def test_external_client_talks_to_its_server_on_the_new_connection(spawn, ptckpt, tmp_path, ping_server,
                                                                   host, how):
    server = ping_server(host)
    target = spawn("netpeer.py", "client", host, server.port)
    try:
        wait_until(lambda: server.connections, 5)
        assert server.ping(server.connections[0], "one") == "PONG one 1"
        address = f"tcp:[{host}]:{server.port}" if ":" in host else f"tcp:{host}:{server.port}"
        _dump(ptckpt, target, tmp_path / "img", "--external", "fd:9" if how == "fd" else address)
        assert _external_notes(tmp_path / "img", target.pid) == [address]
        _restore(ptckpt, tmp_path / "img", "--reconnect")
        wait_until(lambda: len(server.connections) == 2, 5, message="the restore dials the server again")
        assert server.ping(server.connections[1], "two") == "PONG two 2", "its state went on, on the new socket"
        assert server.ping(server.connections[1], "three") == "PONG three 3"
        assert target.out_path.read_text().splitlines() == ["PONG one 1", "PONG two 2", "PONG three 3"]
    finally:
        kill_pids([target.pid])
        reap_orphans()


@needs_ipv6
def test_external_ipv6_client_remapped_to_another_server(spawn, ptckpt, tmp_path, ping_server):
    server, other = ping_server("::1"), ping_server("127.0.0.1")
    target = spawn("netpeer.py", "client", "::1", server.port)
    try:
        wait_until(lambda: server.connections, 5)
        _dump(ptckpt, target, tmp_path / "img", "--external", f"tcp:[0::1]:{server.port}")
        _restore(ptckpt, tmp_path / "img", "--remap-addr", f"tcp:[::1]:{server.port}=tcp:127.0.0.1:{other.port}")
        wait_until(lambda: other.connections, 5, message="the restore dials the new address")
        assert other.ping(other.connections[0], "moved") == "PONG moved 1"
        assert len(server.connections) == 1
    finally:
        kill_pids([target.pid])
        reap_orphans()


# --- addresses (no processes) -------------------------------------------------------------

def test_addresses_are_compared_in_their_canonical_form():
    assert canonical_address("tcp:0:0::1:80") == "tcp:[::1]:80"
    assert canonical_address("tcp:[0::1]:80") == "tcp:[::1]:80"
    assert canonical_address("listen:[::]:8080") == "listen:[::]:8080"
    assert canonical_address("unix:/run/a b.sock") == "unix:/run/a b.sock"
    assert canonical_address("tcp:localhost:80") == "tcp:localhost:80"
    with pytest.raises(UsageError, match="tcp:HOST:PORT"):
        canonical_address("tcp:80")


def test_listener_notes_and_remaps_parse():
    spec = Listener.from_note("listen:[::]:8080 backlog=7 SO_REUSEADDR=0 IPV6_V6ONLY=1")
    assert (spec.address, spec.backlog, spec.option("SO_REUSEADDR"), spec.option("IPV6_V6ONLY")) == \
           ("listen:[::]:8080", 7, "0", "1")
    spec = Listener.from_note("listen-unix:/tmp/with space/x=1.sock backlog=2 type=SOCK_SEQPACKET")
    assert (spec.address, spec.backlog, spec.option("type")) == ("listen-unix:/tmp/with space/x=1.sock", 2,
                                                                 "SOCK_SEQPACKET")
    assert Listener.from_note("listen:1.2.3.4:5").backlog == socket.SOMAXCONN
    r = Reconnect(["tcp:[0::1]:80=unix:/run/x", "listen:0.0.0.0:80=listen:[::]:81", "listen-unix:/a=listen:1.2.3.4:9"])
    assert r.remaps == {"tcp:[::1]:80": "unix:/run/x", "listen:0.0.0.0:80": "listen:[::]:81",
                        "listen-unix:/a": "listen:1.2.3.4:9"}
    for bad in ("tcp:1.2.3.4:80=listen:1.2.3.4:81", "listen:1.2.3.4:80=unix:/x", "tcp:1.2.3.4:80", "udp:x=udp:y"):
        with pytest.raises(UsageError, match="--remap-addr"):
            Reconnect([bad])
