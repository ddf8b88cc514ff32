"""ptckpt.sockdiag against real AF_UNIX sockets: sock_diag, peek_queue, send_queue.

No mocks: every test makes real sockets (socketpairs, bound and listening
ones, and a socketpair held by a child process reached through
pidfd_getfd) and checks what the kernel reports and what a reader later
gets.
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ptckpt import sockdiag
from ptckpt.errors import ExitCode, PtckptError
from ptckpt.sockdiag import (
    SO_PEEK_OFF,
    TCP_CLOSE,
    TCP_ESTABLISHED,
    TCP_LISTEN,
    QueueSnapshot,
    SockDiagError,
    SockDiagUnavailable,
    SocketQueueError,
    UnixSock,
    peek_queue,
    send_queue,
    snapshot_queue,
    socket_inode,
    unix_sockets,
)

STREAM, DGRAM, SEQPACKET = socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET
TYPES = pytest.mark.parametrize("stype", [STREAM, DGRAM, SEQPACKET],
                                ids=["stream", "dgram", "seqpacket"])

# What each side sends in the socketpair tests; zero-length messages only
# where the type keeps boundaries.
A_TO_B = [b"first", b"", b"\x00\xff binary \n", b"x" * 3000, b""]
B_TO_A = [b"reply-1", b"reply-22"]


# --- helpers ------------------------------------------------------------------

def peek_off(s: socket.socket) -> int:
    return s.getsockopt(socket.SOL_SOCKET, SO_PEEK_OFF)


def expected(stype: int, messages: list[bytes]) -> list[bytes]:
    """What peek_queue returns for these messages sent on a socket of stype."""
    if stype == STREAM:
        data = b"".join(messages)
        return [data] if data else []
    return list(messages)


def sendall(s: socket.socket, messages: list[bytes]) -> None:
    for m in messages:
        if s.type == STREAM:
            s.sendall(m)
        else:
            s.send(m)


def drain(s: socket.socket, stype: int) -> list[bytes]:
    """Consume the receive queue with plain non-blocking recvs, as the target would.

    Not for a shut-down seqpacket socket: its end reads as b"" forever."""
    out = []
    while len(out) < 100_000:
        try:
            data = s.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        if stype == STREAM and not data:
            break
        out.append(data)
    if stype == STREAM:
        joined = b"".join(out)
        return [joined] if joined else []
    return out


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Callable[[int], tuple[socket.socket, socket.socket]]:
    """pair(stype) -> a connected socketpair, closed at teardown."""
    made: list[socket.socket] = []

    def make(stype: int) -> tuple[socket.socket, socket.socket]:
        a, b = socket.socketpair(socket.AF_UNIX, stype)
        made.extend((a, b))
        return a, b

    yield make
    for s in made:
        s.close()


@pytest.fixture
def sockets() -> Iterator[Callable[..., socket.socket]]:
    """sockets(type) -> a new AF_UNIX socket, closed at teardown."""
    made: list[socket.socket] = []

    def make(stype: int) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, stype)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def abstract_name(tag: str) -> bytes:
    """A unique abstract name for this test run."""
    return f"\0ptckpt-test-{os.getpid()}-{tag}-{time.monotonic_ns()}".encode()


# --- child processes ------------------------------------------------------------

_SYS_pidfd_getfd = 438      # x86_64
_libc = ctypes.CDLL(None, use_errno=True)

# argv: socket type, SO_PEEK_OFF for b; stdin: a JSON line of hex messages
# to queue on b, then any line to make it read b and report.
CHILD = r"""
import json, socket, sys
stype = int(sys.argv[1])
a, b = socket.socketpair(socket.AF_UNIX, stype)
for m in json.loads(sys.stdin.readline()):
    a.send(bytes.fromhex(m))
b.send(b"back")
b.setsockopt(socket.SOL_SOCKET, 42, int(sys.argv[2]))
print(json.dumps({"a": a.fileno(), "b": b.fileno()}), flush=True)
sys.stdin.readline()
result = {"peek_off": b.getsockopt(socket.SOL_SOCKET, 42), "got": []}
while True:
    try:
        d = b.recv(1 << 20, socket.MSG_DONTWAIT)
    except BlockingIOError:
        break
    result["got"].append(d.hex())
print(json.dumps(result), flush=True)
"""


def readline(proc: subprocess.Popen, timeout: float = 5.0) -> str:
    """One line of the child's stdout, failing instead of hanging."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"child {proc.pid} printed nothing in {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"child {proc.pid} exited: {proc.stderr.read()}")
    return line


@pytest.fixture
def child() -> Iterator[Callable[..., subprocess.Popen]]:
    """child(stype, messages, peek_off) -> a running `python3 -c CHILD` holding a
    socketpair (a, b) with messages queued on b; killed and reaped at teardown."""
    procs: list[subprocess.Popen] = []

    def start(stype: int, messages: list[bytes], peek_off: int = -1) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(stype), str(peek_off)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        proc.stdin.write(json.dumps([m.hex() for m in messages]) + "\n")
        proc.stdin.flush()
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()


def pidfd_getfd(pid: int, fd: int) -> int:
    """A copy of fd of process pid (pidfd_getfd(2), Linux 5.6+)."""
    pidfd = os.pidfd_open(pid)
    try:
        copy = _libc.syscall(_SYS_pidfd_getfd, pidfd, fd, 0)
        if copy < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return copy
    finally:
        os.close(pidfd)


def socket_inodes_of(pid: int) -> dict[int, int]:
    """fd -> socket inode for every socket fd of pid (/proc/PID/fd links "socket:[N]")."""
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[len("socket:["):-1])
    return out


# --- sock_diag ----------------------------------------------------------------------

@TYPES
def test_socketpair_peers_and_queue_lengths(pair, stype):
    a, b = pair(stype)
    to_b = A_TO_B if stype != STREAM else [m for m in A_TO_B if m]
    sendall(a, to_b)
    sendall(b, B_TO_A)
    ia, ib = socket_inode(a), socket_inode(b)

    socks = unix_sockets({ia, ib})

    assert set(socks) == {ia, ib}
    sa, sb = socks[ia], socks[ib]
    for s in (sa, sb):
        assert isinstance(s, UnixSock)
        assert s.type == stype
        assert s.state == TCP_ESTABLISHED
        assert s.name is None and s.path is None and not s.abstract and not s.listening
        assert (s.vfs_dev, s.vfs_ino) == (0, 0)
        assert s.icons == ()
        assert s.shutdown == 0
        assert s.uid == os.geteuid()
    assert sa.peer == ib and sb.peer == ia
    if stype == DGRAM:
        # SIOCINQ of a datagram socket: the length of the first datagram only
        assert sb.rqueue == len(to_b[0]) and sa.rqueue == len(B_TO_A[0])
    else:
        assert sb.rqueue == sum(map(len, to_b)) and sa.rqueue == sum(map(len, B_TO_A))
    # wqueue: the sender's sk_wmem_alloc (truesize), so more than the payload
    assert sa.wqueue > sum(map(len, to_b)) and sb.wqueue > sum(map(len, B_TO_A))
    assert sa.cookie and sb.cookie and sa.cookie != sb.cookie


def test_unix_sockets_unfiltered_holds_ours(pair):
    a, b = pair(STREAM)
    socks = unix_sockets()
    assert {socket_inode(a), socket_inode(b)} <= set(socks)
    assert all(ino == s.ino and ino for ino, s in socks.items())
    assert unix_sockets({socket_inode(a), 1}).keys() == {socket_inode(a)}
    assert unix_sockets(set()) == {}


def test_listener_bound_to_path_with_pending_connections(tmp_path, sockets):
    path = tmp_path / "listener.sock"
    lst = sockets(STREAM)
    lst.bind(os.fspath(path))
    lst.listen(4)
    c1, c2 = sockets(STREAM), sockets(STREAM)
    c1.connect(os.fspath(path))
    c2.connect(os.fspath(path))
    c1.send(b"sent before accept")
    il, i1, i2 = socket_inode(lst), socket_inode(c1), socket_inode(c2)

    socks = unix_sockets({il, i1, i2})

    listener = socks[il]
    st = os.stat(path)
    assert listener.listening and listener.state == TCP_LISTEN
    assert listener.name == os.fsencode(path) == listener.path and not listener.abstract
    assert (listener.vfs_dev, listener.vfs_ino) == (st.st_dev, st.st_ino)
    # icons: the CLIENT-side inodes, in connect order (embryos have no inode)
    assert listener.icons == (i1, i2)
    assert (listener.rqueue, listener.wqueue) == (2, 4)     # pending, backlog
    for ino in (i1, i2):
        client = socks[ino]
        assert client.state == TCP_ESTABLISHED
        assert client.peer == 0         # the embryo has no inode before accept()
        assert client.name is None
    # what c1 sent waits in the embryo's queue: only c1's wqueue shows it
    assert socks[i1].wqueue > 0 and socks[i2].wqueue == 0
    assert peek_queue(lst) == []

    server, _ = lst.accept()
    try:
        isrv = socket_inode(server)
        socks = unix_sockets({il, i1, i2, isrv})
        assert socks[il].icons == (i2,) and socks[il].rqueue == 1
        accepted = socks[isrv]
        assert accepted.peer == i1 and socks[i1].peer == isrv
        # the accepted socket shares the listener's address and socket file
        assert accepted.name == listener.name and not accepted.listening
        assert (accepted.vfs_dev, accepted.vfs_ino) == (st.st_dev, st.st_ino)
        assert accepted.rqueue == len(b"sent before accept")
        assert peek_queue(server) == [b"sent before accept"]
    finally:
        server.close()


def test_abstract_and_autobound_names(sockets):
    name = abstract_name("abstract")
    s = sockets(SEQPACKET)
    s.bind(name)
    auto = sockets(DGRAM)
    auto.bind(b"")                      # autobind: "\0" + 5 hex digits
    socks = unix_sockets({socket_inode(s), socket_inode(auto)})
    named, autob = socks[socket_inode(s)], socks[socket_inode(auto)]
    assert named.name == name and named.abstract and named.path is None
    assert (named.vfs_dev, named.vfs_ino) == (0, 0)
    assert named.state == TCP_CLOSE and named.type == SEQPACKET
    assert autob.abstract and len(autob.name) == 6 and int(autob.name[1:], 16) >= 0


def test_dgram_connected_to_bound_server(tmp_path, sockets):
    path = os.fspath(tmp_path / "dgram.sock")
    server, client, other = sockets(DGRAM), sockets(DGRAM), sockets(DGRAM)
    server.bind(path)
    isrv, icl = socket_inode(server), socket_inode(client)
    assert unix_sockets({isrv})[isrv].state == TCP_CLOSE
    client.bind(abstract_name("client"))
    client.connect(path)
    msgs = [b"dgram one", b"", b"dgram three"]
    sendall(client, msgs)
    other.sendto(b"from unbound", path)

    socks = unix_sockets({isrv, icl})

    assert socks[icl].peer == isrv and socks[icl].state == TCP_ESTABLISHED
    # connect() of a datagram socket marks the receiver TCP_ESTABLISHED too,
    # though it stays unconnected (peer 0)
    assert socks[isrv].peer == 0 and socks[isrv].state == TCP_ESTABLISHED
    assert socks[isrv].path == os.fsencode(path)
    assert socks[isrv].rqueue == len(msgs[0])
    snap = snapshot_queue(server)
    assert list(snap.messages) == msgs + [b"from unbound"]
    assert snap.senders == (socks[icl].name,) * 3 + (None,)
    assert drain(server, DGRAM) == msgs + [b"from unbound"]


def test_sockets_of_another_process(child):
    proc = child(SEQPACKET, [b"hello", b"", b"world"])
    fds = json.loads(readline(proc))
    inodes = socket_inodes_of(proc.pid)
    ia, ib = inodes[fds["a"]], inodes[fds["b"]]

    socks = unix_sockets(set(inodes.values()))

    assert socks[ia].peer == ib and socks[ib].peer == ia
    assert socks[ib].type == SEQPACKET
    assert socks[ib].rqueue == len(b"helloworld") and socks[ia].rqueue == len(b"back")


# --- peek_queue ------------------------------------------------------------------

@TYPES
@pytest.mark.parametrize("original", [-1, 0, 3])
def test_peek_queue_exact_and_leaves_queue(pair, stype, original):
    a, b = pair(stype)
    to_b = A_TO_B if stype != STREAM else [m for m in A_TO_B if m]
    sendall(a, to_b)
    sendall(b, B_TO_A)
    b.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, original)
    passcred = b.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED)

    got_b = peek_queue(b)
    got_a = peek_queue(a.fileno())

    assert got_b == expected(stype, to_b)
    assert got_a == expected(stype, B_TO_A)
    assert peek_off(b) == original and peek_off(a) == -1
    assert b.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED) == passcred
    b.setsockopt(socket.SOL_SOCKET, SO_PEEK_OFF, -1)
    # the queue is unchanged: a reader gets exactly the same
    assert drain(b, stype) == expected(stype, to_b)
    assert drain(a, stype) == expected(stype, B_TO_A)


@TYPES
def test_peek_empty_queue(pair, stype):
    a, b = pair(stype)
    assert peek_queue(b) == []
    snap = snapshot_queue(a)
    assert snap == QueueSnapshot(type=stype, messages=(), senders=(), fds=0, oob=None,
                                 peek_off=-1, pending_error=0)


@pytest.mark.parametrize("stype", [STREAM, SEQPACKET], ids=["stream", "seqpacket"])
def test_peek_listening_and_unconnected(sockets, stype):
    lst = sockets(stype)
    lst.bind(abstract_name("listen"))
    lst.listen(2)
    client = sockets(stype)
    client.connect(lst.getsockname())
    assert peek_queue(lst) == []
    assert peek_queue(sockets(stype)) == []
    assert peek_queue(sockets(DGRAM)) == []


def test_peek_other_process_through_pidfd_getfd(child):
    msgs = [b"alpha", b"", b"x" * 70000, b"omega"]
    proc = child(SEQPACKET, msgs, peek_off=2)
    fds = json.loads(readline(proc))
    os.kill(proc.pid, signal.SIGSTOP)       # a frozen target
    copy = pidfd_getfd(proc.pid, fds["b"])
    try:
        got = peek_queue(copy)
        ino = socket_inode(copy)
    finally:
        os.close(copy)
        os.kill(proc.pid, signal.SIGCONT)
    assert got == msgs
    assert ino == socket_inodes_of(proc.pid)[fds["b"]]
    proc.stdin.write("go\n")
    proc.stdin.flush()
    result = json.loads(readline(proc))
    assert result["peek_off"] == 2          # the target's SO_PEEK_OFF was put back
    assert [bytes.fromhex(h) for h in result["got"]] == msgs


def test_peek_big_datagrams_grow_buffer(pair):
    a, b = pair(DGRAM)
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    msgs = [b"", b"a" * 100_000, b"", b"b" * 70_000, b"c"]
    sendall(a, msgs)
    assert peek_queue(b) == msgs
    assert peek_off(b) == -1
    assert drain(b, DGRAM) == msgs


@pytest.mark.parametrize("stype", [DGRAM, SEQPACKET], ids=["dgram", "seqpacket"])
def test_zero_length_messages_are_seen_once(pair, stype):
    """Kernel behaviour the module doc describes: a peeked zero-length skb is
    skipped by later offset peeks; only one at the head is found again."""
    a, b = pair(stype)
    msgs = [b"", b"one", b"", b"", b"two", b""]
    sendall(a, msgs)
    assert peek_queue(b) == msgs
    assert peek_queue(b) == [b"", b"one", b"two"]
    assert drain(b, stype) == msgs       # the data itself is untouched


def test_seqpacket_peer_closed(pair):
    a, b = pair(SEQPACKET)
    sendall(a, [b"last words", b"", b""])
    b.send(b"never read")               # a closes with this unread -> ECONNRESET on b
    a.close()
    snap = snapshot_queue(b)
    assert snap.messages == (b"last words", b"", b"")   # EOF is not a zero-length message
    assert snap.pending_error == errno.ECONNRESET      # consumed by the peek (kernel)
    assert b.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED) == 0
    assert [b.recv(100, socket.MSG_DONTWAIT) for _ in range(3)] == [b"last words", b"", b""]
    # the end of the queue reads as b"" too: just what peek had to tell apart
    assert b.recv(100, socket.MSG_DONTWAIT) == b""


def test_stream_peer_closed_error_stays_pending(pair):
    a, b = pair(STREAM)
    a.send(b"tail")
    b.send(b"never read")
    a.close()
    snap = snapshot_queue(b)
    assert snap.messages == (b"tail",) and snap.pending_error == 0
    assert b.recv(100, socket.MSG_DONTWAIT) == b"tail"
    with pytest.raises(ConnectionResetError):
        b.recv(100, socket.MSG_DONTWAIT)


def test_fds_in_flight_are_refused_and_not_leaked(pair):
    a, b = pair(DGRAM)
    r, w = os.pipe()
    try:
        a.sendmsg([b"with fds"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                   array.array("i", [r, w]).tobytes())])
        before = set(os.listdir("/proc/self/fd"))
        snap = snapshot_queue(b)
        assert set(os.listdir("/proc/self/fd")) == before
        assert snap.fds == 2 and snap.messages == (b"with fds",)
        with pytest.raises(SocketQueueError, match="file descriptor") as info:
            peek_queue(b)
        assert info.value.exit_code == ExitCode.UNSUPPORTED_RESOURCE
    finally:
        os.close(r)
        os.close(w)


def test_oob_byte_is_reported(pair):
    a, b = pair(STREAM)
    a.send(b"abc")
    a.send(b"!", socket.MSG_OOB)
    a.send(b"def")
    snap = snapshot_queue(b)
    assert snap.oob == b"!"
    assert snap.messages == (b"abc!def",)     # the offset peek shows it inline
    with pytest.raises(SocketQueueError, match="MSG_OOB"):
        peek_queue(b)
    assert b.recv(1, socket.MSG_OOB) == b"!"   # still pending afterwards


def test_peek_never_waits_and_keeps_file_flags(pair):
    a, b = pair(DGRAM)
    b.settimeout(5.0)                         # sets O_NONBLOCK on the shared file
    flags = fcntl.fcntl(b.fileno(), fcntl.F_GETFL)
    start = time.monotonic()
    assert peek_queue(b) == []
    assert time.monotonic() - start < 1.0
    assert fcntl.fcntl(b.fileno(), fcntl.F_GETFL) == flags and b.gettimeout() == 5.0


# --- send_queue ------------------------------------------------------------------

@TYPES
def test_send_queue_then_peek_round_trip(pair, stype):
    a, b = pair(stype)
    msgs = [b"m1", b"", b"\x00" * 17, b"m4" * 500]
    send_queue(a, msgs, stype)
    want = expected(stype, msgs)
    assert peek_queue(b) == want
    assert drain(b, stype) == want


def test_large_stream_queue(pair):
    a, b = pair(STREAM)
    data = os.urandom(150 * 1024)
    send_queue(a.fileno(), [data])
    assert unix_sockets({socket_inode(b)})[socket_inode(b)].rqueue == len(data)
    assert peek_queue(b) == [data]
    assert drain(b, STREAM) == [data]


@pytest.mark.skipif(os.geteuid() != 0, reason="SO_SNDBUFFORCE needs CAP_NET_ADMIN")
@pytest.mark.parametrize("stype", [STREAM, DGRAM, SEQPACKET], ids=["stream", "dgram", "seqpacket"])
def test_send_queue_grows_and_restores_sndbuf(pair, stype):
    a, b = pair(stype)
    sndbuf = a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    # ~280 one-byte datagrams fill the default buffer (truesize ~768 each);
    # 2 MiB of stream is ten times what fits
    msgs = [b"%d" % i for i in range(1000)] if stype != STREAM else [os.urandom(2 << 20)]
    send_queue(a, msgs)
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == sndbuf
    assert peek_queue(b) == expected(stype, msgs)
    assert drain(b, stype) == expected(stype, msgs)


def test_send_queue_dgram_queue_length_limit(tmp_path, sockets):
    qlen = int(Path("/proc/sys/net/unix/max_dgram_qlen").read_text())
    path = os.fspath(tmp_path / "srv")
    server, client = sockets(DGRAM), sockets(DGRAM)
    server.bind(path)
    client.connect(path)
    start = time.monotonic()
    with pytest.raises(SocketQueueError, match="max_dgram_qlen") as info:
        send_queue(client, [b"m"] * (qlen + 5))
    assert time.monotonic() - start < 2.0
    assert info.value.exit_code == ExitCode.UNSUPPORTED_RESOURCE
    assert len(peek_queue(server)) == qlen + 1


def test_send_queue_type_mismatch(pair):
    a, _ = pair(DGRAM)
    with pytest.raises(ValueError):
        send_queue(a, [b"x"], STREAM)


def test_send_queue_peer_gone(pair):
    a, b = pair(SEQPACKET)
    b.close()
    with pytest.raises(SockDiagError) as info:
        send_queue(a, [b"x"])
    assert info.value.errno == errno.EPIPE


# --- errors ----------------------------------------------------------------------

def test_not_a_socket_is_a_ptckpt_error(tmp_path):
    with open(tmp_path / "f", "wb") as f:
        with pytest.raises(SockDiagError) as info:
            peek_queue(f.fileno())
    assert isinstance(info.value, PtckptError)
    assert info.value.errno == errno.ENOTSOCK


def test_translation_of_missing_features():
    missing = sockdiag._translate(OSError(errno.EPROTONOSUPPORT, "Protocol not supported"),
                                  "sock_diag query of AF_UNIX sockets")
    assert isinstance(missing, SockDiagUnavailable)
    assert missing.exit_code == ExitCode.MISSING_FEATURE
    assert "sock_diag query of AF_UNIX sockets: not supported" in str(missing)
    enoent = OSError(errno.ENOENT, "No such file or directory")
    assert isinstance(sockdiag._translate(enoent, "x", sockdiag._MISSING_ERRNOS_DIAG),
                      SockDiagUnavailable)
    other = sockdiag._translate(enoent, "x")
    assert type(other) is SockDiagError and other.errno == errno.ENOENT
