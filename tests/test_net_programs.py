"""Real network programs nobody here wrote, dumped and restored through the CLI.

* ``python3 -m http.server``: an idle server (only its listener) dumped --kill,
  restored in place, then the same image restored twice more with --pidns
  --netns: both copies listen on the same port at once, each in its own network
  namespace, and answer a GET made from inside it.
* redis-server with a client inside the dumped tree: 10,000 SETs written in
  one go, dumped (--tcp-established) while replies wait unread in the client's
  socket and most of the pipeline is still unsent in it; after the restore every
  reply arrives and the database holds every key.
* redis-server with the connection held by the test, outside the tree: the same
  socket goes on after the restore; the network lock kept it from being reset
  while the server was dead, and is gone once the restore is done.

redis-server and nft come from Debian packages (CI installs them with apt-get);
a test that needs one skips, saying so, when it is absent.  Every process a test
starts is killed at teardown: spawn's own cleanup (process group and session of
what it started) and the `kill_later` fixture for restored copies in pid
namespaces (their namespace's init).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from ptckpt import netns
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import InetMode

from conftest import needs, tool, kill_pids, pid_alive, proc_stat, reap_orphans, wait_pid_free, wait_until

REDIS = tool("redis-server")
NFT = tool("nft")


TCP_ESTABLISHED = 1
N_SETS = 10_000


# --- helpers -----------------------------------------------------------------------------

@pytest.fixture
def kill_later():
    """kill_later(pid, ...): SIGKILLed (and reaped) at teardown, even when the test fails."""
    pids: list[int] = []
    yield lambda *more: pids.extend(more)
    kill_pids(pids)
    try:
        wait_until(lambda: (reap_orphans(), not any(pid_alive(p) for p in pids))[1], 10)
    finally:
        reap_orphans()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_pid(res) -> int:
    assert res.returncode == 0, res.stderr
    return int(res.stdout.strip().splitlines()[-1])


def _init_of(pid: int) -> int:
    """The parent of a restored --pidns root: its namespace's init (killing it ends them all)."""
    st = proc_stat(pid)
    assert st is not None, f"pid {pid} is gone"
    return st.ppid


def _netns_ino(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _nft_tables() -> list[str]:
    out = subprocess.run([NFT, "list", "tables"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")


def _image_netlock(image: Path) -> str:
    with ImageReader(image) as img:
        return img.inventory.netlock


def _socket_fds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if link.startswith("socket:"):
            out.append(link)
    return out


def _ss(port: int) -> str:
    """`ss -tni` for the connections of port (what the kernel queues each way)."""
    ss = shutil.which("ss")
    if ss is None:
        return "(ss is not installed)"
    out = subprocess.run([ss, "-tni", f"( sport = :{port} or dport = :{port} )"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout + out.stderr


# --- HTTP ----------------------------------------------------------------------------------

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_get(port: int, path: str, timeout: float = 5.0) -> bytes:
    with _NO_PROXY.open(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
        assert reply.status == 200
        return reply.read()


def _http_get_in(pid: int, port: int, path: str) -> tuple[int, bytes]:
    """A GET made from inside pid's network namespace (this thread moves there, then back):
    (the namespace's inode as this thread saw it, the body)."""
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with netns.entered(fd):
            where = netns.current_netns_id()
            return where, _http_get(port, path)
    finally:
        os.close(fd)


def _http_get_in_each(pids: list[int], port: int, path: str) -> list[tuple[int, bytes]]:
    """_http_get_in for every pid at once, each from a thread of its own."""
    with concurrent.futures.ThreadPoolExecutor(len(pids)) as pool:
        return list(pool.map(lambda pid: _http_get_in(pid, port, path), pids))


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_http_server_restored_then_two_copies_in_their_own_netns(spawn, ptckpt, kill_later, tmp_path):
    www = tmp_path / "www"
    www.mkdir()
    body = b"".join(b"line %05d of a file http.server serves %s\n" % (i, os.urandom(8).hex().encode())
                    for i in range(2000))
    (www / "data.txt").write_bytes(body)
    port = _free_port()
    server = spawn(sys.executable, "-m", "http.server", port, "--bind", "127.0.0.1",
                   "--directory", www, out=False, ready=False)
    assert wait_until(lambda: not _refused(port), 10, message=f"http.server on port {port}")
    assert _http_get(port, "/data.txt") == body
    # The request's socket is closed once the GET is answered: only the listener remains.
    wait_until(lambda: len(_socket_fds(server.pid)) == 1, 5,
               message=lambda: f"http.server holds only its listener: {_socket_fds(server.pid)}")

    image = tmp_path / "img"
    res = ptckpt("dump", server.pid, "-D", image, "--kill")
    assert res.returncode == 0, res.stderr
    server.wait_exit(10)
    wait_pid_free(server.pid)
    with ImageReader(image) as img:
        listeners = [r for r in img.inet_sockets if r.state == 10]       # TCP_LISTEN
        assert [(r.src, r.sport, r.mode) for r in listeners] == [("127.0.0.1", port, InetMode.PLAIN)]
        assert img.inventory.netlock == ""                               # nothing to lock

    assert _last_pid(ptckpt("restore", "-D", image, "--detach")) == server.pid
    assert _http_get(port, "/data.txt") == body

    # Two more copies of the same image at once, each in a pid and network namespace of its own.
    # The first copy logged its request on the stderr all of them append to: that file changed.
    log_changed = f"{server.stderr_path}=ignore"
    copies = []
    for n in range(2):
        pidfile = tmp_path / f"copy{n}.pid"
        res = ptckpt("restore", "-D", image, "--pidns", "--netns", "--detach", "--pidfile", pidfile,
                     "--file-policy", log_changed)
        pid = _last_pid(res)
        kill_later(pid, _init_of(pid))
        assert int(pidfile.read_text()) == pid
        copies.append(pid)
    host = _netns_ino("self")
    inodes = [_netns_ino(pid) for pid in copies]
    assert len({server.pid, *copies}) == 3, "three different processes"
    assert len({host, *inodes}) == 3, f"host {host}, copies {inodes}: each copy has its own netns"
    for pid in copies:
        with open(f"/proc/{pid}/status") as f:
            nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
        assert int(nspid[-1]) == server.pid, "inside its namespace, each copy has the dumped pid"

    # Both copies answer at once, each from inside its namespace; the one in place answers here.
    answers = _http_get_in_each(copies, port, "/data.txt")
    assert [where for where, _ in answers] == inodes
    assert all(got == body for _, got in answers)
    assert _http_get(port, "/data.txt") == body

    # With the copy in place gone, nothing listens on the port here, and the copies still answer.
    kill_pids([server.pid])
    wait_pid_free(server.pid)
    assert _refused(port)
    assert _http_get_in_each(copies, port, "/data.txt") == [(ino, body) for ino in inodes]


# --- redis ---------------------------------------------------------------------------------

def _resp(*args: bytes) -> bytes:
    """A command in RESP (the redis protocol): an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _redis_argv(port: int) -> list[str]:
    return [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--daemonize", "no", "--io-threads", "1", "--enable-debug-command", "yes"]


class Redis:
    """A blocking RESP client over one socket (the test's own connection)."""

    def __init__(self, port: int, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, *args: bytes) -> None:
        self.sock.sendall(_resp(*args))

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"redis closed the connection (after {self.buf!r})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise AssertionError(f"redis error: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionError("redis closed the connection in a bulk reply")
                self.buf += chunk
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        raise AssertionError(f"unexpected reply line {line!r}")

    def call(self, *args: bytes):
        self.send(*args)
        return self.reply()


def _redis_up(port: int) -> bool:
    try:
        r = Redis(port, timeout=2)
    except ConnectionRefusedError:
        return False
    try:
        return r.call(b"PING") == "PONG"
    finally:
        r.close()


_CLIENT = r'''
import fcntl, os, select, socket, struct, sys, threading, time
port, out, go, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
FIONREAD = 0x541B

def report(line):
    with open(out, "a") as f:
        f.write(line + "\n")

def resp(*args):
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)

def connect():
    deadline = time.monotonic() + 20
    while True:
        s = socket.socket()
        # A send buffer of a fixed size (no autotuning): what redis does not read waits
        # in the client, in its socket and behind it, whatever the machine's tcp_wmem.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 << 10)
        try:
            s.connect(("127.0.0.1", port))
            return s
        except ConnectionRefusedError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)

def unread(s):
    return struct.unpack("i", fcntl.ioctl(s.fileno(), FIONREAD, b"\0\0\0\0"))[0]

pipeline = b"".join(resp(b"SET", b"key:%05d" % i, (b"value %05d " % i) * 40) for i in range(n))
a, b = connect(), connect()
report(f"CONNECTED {a.getsockname()[1]} {b.getsockname()[1]} {len(pipeline)}")

def put_redis_to_sleep():
    # As soon as the first replies come back (they stay unread), the server is
    # put to sleep from the other connection: the rest of the pipeline waits in
    # the sockets, most of it not even sent.
    select.select([a], [], [])
    b.sendall(resp(b"DEBUG", b"SLEEP", b"3"))
    time.sleep(0.3)
    report(f"ASLEEP {unread(a)}")

sleeper = threading.Thread(target=put_redis_to_sleep)
sleeper.start()
a.sendall(pipeline)                     # all 10,000 commands in one go, no reply read
sleeper.join()
report(f"SENT {unread(a)}")
while not os.path.exists(go):
    time.sleep(0.01)
want = b"+OK\r\n" * n
got = bytearray()
a.settimeout(30)
while len(got) < len(want):
    chunk = a.recv(1 << 20)
    if not chunk:
        break
    got += chunk
b.settimeout(30)
slept = b.recv(100)
verdict = "ALL-OK" if bytes(got) == want else "WRONG"
oks = got.count(b"+OK\r\n")
report(f"READ {len(got)} {verdict} {oks} SLEEP-REPLY {slept!r}")
a.sendall(resp(b"SET", b"client-after-restore", b"yes"))
a.settimeout(30)
report(f"AFTER {a.recv(100)!r}")
while True:
    time.sleep(1)
'''

_PARENT = r'''
import os, subprocess, sys, time
redis_argv, client = sys.argv[1].split("\x1f"), sys.argv[2:]
redis = subprocess.Popen(redis_argv, stdin=subprocess.DEVNULL)
kid = subprocess.Popen([sys.executable, "-c", client[0]] + client[1:], stdin=subprocess.DEVNULL)
print("READY", os.getpid(), redis.pid, kid.pid, flush=True)
while True:
    time.sleep(1)
'''


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def _line_of(path: Path, word: str) -> str | None:
    return next((line for line in _lines(path) if line.split()[:1] == [word]), None)


@needs("redis-server")
@needs("nft")              # --tcp-established takes the network lock
def test_redis_with_a_pipelining_client_inside_the_tree(spawn, ptckpt, tmp_path):
    port = _free_port()
    out, go = tmp_path / "client.out", tmp_path / "client.go"
    root = spawn(sys.executable, "-c", _PARENT, "\x1f".join(_redis_argv(port)),
                 _CLIENT, port, out, go, N_SETS, out=False, ready=False)
    ready = wait_until(lambda: next((line for line in root.stdout_lines() if line.startswith("READY")), None),
                       10, message=lambda: f"the parent's READY line\n{root.describe()}")
    parent, redis_pid, client_pid = map(int, ready.split()[1:])
    assert parent == root.pid
    connected = wait_until(lambda: _line_of(out, "CONNECTED"), 20,
                           message=lambda: f"the client's CONNECTED line\n{root.describe()}")
    aport, bport, pipeline_bytes = map(int, connected.split()[1:])
    asleep = wait_until(lambda: _line_of(out, "ASLEEP"), 10,
                        message=lambda: f"redis put to sleep\n{_lines(out)}\n{root.describe()}")
    assert _line_of(out, "SENT") is None, "the pipeline is still being sent (redis sleeps)"

    ss_before = _ss(port)
    res = ptckpt("dump", root.pid, "-D", tmp_path / "img", "--kill", "--tcp-established")
    assert res.returncode == 0, res.stderr
    root.wait_exit(10)
    for pid in (root.pid, redis_pid, client_pid):
        wait_pid_free(pid)

    with ImageReader(tmp_path / "img") as img:
        assert sorted(img.inventory.pids) == sorted([root.pid, redis_pid, client_pid])
        conns = {(r.sport, r.dport): r for r in img.inet_sockets if r.mode is InetMode.REPAIRED}
        lock = img.inventory.netlock
    client_end, server_end = conns[(aport, port)], conns[(port, aport)]
    print(f"\nthe pipeline: {pipeline_bytes} bytes, {N_SETS} SETs; client: {asleep}\n"
          f"ss -tni before the dump:\n{ss_before}"
          f"at the dump, client -> redis: {len(client_end.send_queue)} bytes in the client's send queue "
          f"({client_end.unsent} never sent), {len(server_end.recv_queue)} unread in redis's socket; "
          f"redis -> client: {len(client_end.recv_queue)} bytes of replies unread, "
          f"{len(server_end.send_queue)} in redis's send queue")
    assert (bport, port) in conns and (port, bport) in conns
    unread = client_end.recv_queue
    assert unread and unread == b"+OK\r\n" * (len(unread) // 5), \
        "replies waited unread in the client's socket"
    assert client_end.unsent > 0, ("part of the pipeline was not even sent (unless redis woke up "
                                   "before the dump froze it: DEBUG SLEEP 3 too short here?)")
    assert len(client_end.send_queue) + len(server_end.recv_queue) < pipeline_bytes
    assert lock, "the image names its network lock"
    assert f"table inet ptckpt-{lock}" in _nft_tables(), "the lock is held until the restore"

    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert _last_pid(res) == root.pid
    root.adopt(root.pid)
    assert f"table inet ptckpt-{lock}" not in _nft_tables(), "the restore released the lock"
    assert all(pid_alive(p) for p in (redis_pid, client_pid))
    wait_until(lambda: _line_of(out, "SENT"), 20,
               message=lambda: f"the rest of the pipeline sent after the restore\n{_lines(out)}")
    go.touch()
    read = wait_until(lambda: _line_of(out, "READ"), 30, message=lambda: f"the replies read\n{_lines(out)}")
    assert read.split()[1:4] == [str(5 * N_SETS), "ALL-OK", str(N_SETS)], read
    assert read.endswith("SLEEP-REPLY b'+OK\\r\\n'"), read
    after = wait_until(lambda: _line_of(out, "AFTER"), 10, message=lambda: f"{_lines(out)}")
    assert after == "AFTER b'+OK\\r\\n'"

    fresh = Redis(port)
    try:
        assert fresh.call(b"DBSIZE") == N_SETS + 1
        assert fresh.call(b"GET", b"key:00000") == b"value 00000 " * 40
        assert fresh.call(b"GET", b"key:09999") == b"value 09999 " * 40
        assert fresh.call(b"GET", b"client-after-restore") == b"yes"
    finally:
        fresh.close()


def _tcp_state(s: socket.socket) -> int:
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


@needs("redis-server")
@needs("nft")              # --tcp-established takes the network lock
def test_redis_connection_held_outside_goes_on_after_restore(spawn, ptckpt, tmp_path):
    port = _free_port()
    server = spawn(REDIS, *_redis_argv(port)[1:], out=False, ready=False)
    wait_until(lambda: _redis_up(port), 10, message=lambda: f"redis-server on {port}\n{server.describe()}")
    r = Redis(port)
    try:
        assert r.call(b"SET", b"greeting", b"hello from before the dump") == "OK"
        assert r.call(b"RPUSH", b"list", b"a", b"b") == 2
        image = tmp_path / "img"
        res = ptckpt("dump", server.pid, "-D", image, "--kill", "--tcp-established")
        assert res.returncode == 0, res.stderr
        server.wait_exit(10)
        wait_pid_free(server.pid)
        lock = _image_netlock(image)
        assert lock, "the image names its network lock"
        assert f"table inet ptckpt-{lock}" in _nft_tables(), "the lock is held while redis is dead"

        # While the server is dead the test talks to it: without the lock, the kernel would
        # answer with a reset (no socket at that port).  The command waits, retransmitted.
        r.send(b"PING")
        time.sleep(0.5)
        assert r.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0, "no reset"
        assert _tcp_state(r.sock) == TCP_ESTABLISHED
        r.sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            r.sock.recv(1)                  # nothing: no reply, no EOF, no reset
        r.sock.settimeout(20)

        t0 = time.monotonic()
        assert _last_pid(ptckpt("restore", "-D", image, "--detach")) == server.pid
        server.adopt(server.pid)
        assert f"table inet ptckpt-{lock}" not in _nft_tables(), "the restore released the lock"
        assert r.reply() == "PONG"          # the command sent while redis was dead
        waited = time.monotonic() - t0
        assert r.call(b"GET", b"greeting") == b"hello from before the dump"
        assert r.call(b"PING") == "PONG"
        for i in range(1, 4):
            assert r.call(b"INCR", b"counter") == i
        assert r.call(b"RPUSH", b"list", b"c") == 3
        assert r.call(b"LRANGE", b"list", b"0", b"-1") == [b"a", b"b", b"c"]
        assert r.call(b"DBSIZE") == 3
        print(f"\nthe PING sent while redis was dead was answered {waited:.2f} s after the restore began")
    finally:
        r.close()


@needs("redis-server")
def test_redis_chain_of_incremental_compressed_background_dumps(spawn, ptckpt, tmp_path):
    """redis with 300,000 keys: a full dump that tracks memory, keys changed, an increment
    (pre-copied while redis runs, compressed), then a restore of the chain answers with the
    keys as they were at the increment."""
    port = _free_port()
    server = spawn(REDIS, *_redis_argv(port)[1:], out=False, ready=False)
    wait_until(lambda: _redis_up(port), 10, message=lambda: f"redis-server on {port}\n{server.describe()}")

    def no_client():            # the test's connection gone on redis' side too: the dumps hold none
        def gone():
            with open("/proc/net/tcp") as f:
                rows = [line.split() for line in f.readlines()[1:]]
            return not [r for r in rows if int(r[1].split(":")[1], 16) == port and r[3] not in ("0A", "06")]
        wait_until(gone, 10, message="redis closed the test's connection")
    r = Redis(port)
    try:
        assert r.call(b"DEBUG", b"POPULATE", b"300000") == "OK"
        r.close()
        no_client()
        res = ptckpt("dump", server.pid, "-D", tmp_path / "a", "--track-mem", "--compress", "zstd:1")
        assert res.returncode == 0, res.stderr
        r = Redis(port)
        assert r.call(b"SET", b"key:7", b"changed after the first dump") == "OK"
        assert r.call(b"SET", b"fresh", b"new key") == "OK"
        r.close()
        no_client()
        res = ptckpt("dump", server.pid, "-D", tmp_path / "b", "--prev", tmp_path / "a", "--background",
                     "--compress", "zstd:1")
        assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
        with ImageReader(tmp_path / "b") as img:
            own = img.pages_length(server.pid)
            assert img.parent_pages(server.pid) and own < img.parent.pages_length(server.pid) // 4
            assert img.stored_length(server.pid) < own
    finally:
        r.close()
    os.kill(server.pid, signal.SIGKILL)
    server.wait_exit(10)
    wait_pid_free(server.pid)
    res = ptckpt("restore", "-D", tmp_path / "b", "--detach")
    assert res.returncode == 0, res.stderr
    server.adopt(int(res.stdout.split()[-1]))
    wait_until(lambda: _redis_up(port), 10, message="the restored redis answers")
    r = Redis(port)
    try:
        assert r.call(b"GET", b"key:7") == b"changed after the first dump"
        assert r.call(b"GET", b"fresh") == b"new key"
        assert r.call(b"GET", b"key:299999") == b"value:299999"
        assert r.call(b"DBSIZE") == 300001
    finally:
        r.close()
