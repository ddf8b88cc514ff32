"""ptckpt.netns against the real kernel: fresh namespaces, entering and leaving.

No mocks.  Every namespace fd and socket a test makes is closed at teardown
(fixtures `netns_fd` and `make`); the one subprocess (the capability-less
probe) is waited for with a timeout.
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from ptckpt import netns
from ptckpt.errors import ExitCode, NoSuchProcess
from ptckpt.inetdiag import inet_sockets
from ptckpt.netns import (
    NetnsError,
    NetnsUnavailable,
    current_netns_id,
    entered,
    loopback_up,
    new_netns,
    open_netns,
)
from conftest import needs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def netns_fd() -> Iterator[int]:
    """A fresh network namespace (lo up); its fd is closed at teardown."""
    fd = new_netns()
    yield fd
    os.close(fd)


@pytest.fixture
def make() -> Iterator[Callable[..., socket.socket]]:
    """make(family=AF_INET, type=SOCK_STREAM) -> a socket closed at teardown."""
    made: list[socket.socket] = []

    def factory(family: int = socket.AF_INET, type: int = socket.SOCK_STREAM) -> socket.socket:
        s = socket.socket(family, type)
        made.append(s)
        return s
    yield factory
    for s in made:
        s.close()


def ino(s: socket.socket) -> int:
    return os.fstat(s.fileno()).st_ino


def test_new_netns_does_not_move_the_caller(netns_fd):
    home = current_netns_id()
    assert os.fstat(netns_fd).st_ino != home
    assert current_netns_id() == home == current_netns_id("self") == current_netns_id(os.getpid())
    assert fcntl.fcntl(netns_fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    other = new_netns()
    try:
        assert os.fstat(other).st_ino not in (home, os.fstat(netns_fd).st_ino)
    finally:
        os.close(other)


def test_entered_and_back(netns_fd):
    home = current_netns_id()
    with entered(netns_fd):
        assert current_netns_id() == os.fstat(netns_fd).st_ino
        inner = open_netns()
        try:
            assert os.fstat(inner).st_ino == os.fstat(netns_fd).st_ino
        finally:
            os.close(inner)
    assert current_netns_id() == home
    with pytest.raises(KeyError):
        with entered(netns_fd):
            raise KeyError("boom")
    assert current_netns_id() == home


def test_same_port_inside_and_outside(netns_fd, make):
    """No conflict between namespaces; sock_diag inside sees only the inside."""
    outer = make()
    outer.bind(("127.0.0.1", 0))
    outer.listen()
    port = outer.getsockname()[1]
    with entered(netns_fd):
        inner = make()
        inner.bind(("127.0.0.1", port))
        inner.listen()
        client = make()
        client.connect(("127.0.0.1", port))          # lo is up: loopback works
        inside = inet_sockets()
    assert {s.ino for s in inside} >= {ino(inner), ino(client)}
    assert ino(outer) not in {s.ino for s in inside}
    assert all(s.sport == port or s.dport == port for s in inside)
    outside = {s.ino for s in inet_sockets()}
    assert ino(outer) in outside
    assert not outside & {ino(inner), ino(client)}


def test_ipv6_loopback_inside(netns_fd, make):
    with entered(netns_fd):
        server = make(socket.AF_INET6)
        server.bind(("::1", 0))
        server.listen()
        client = make(socket.AF_INET6)
        client.connect(server.getsockname()[:2])
    assert client.getpeername()[:2] == ("::1", server.getsockname()[1])


def test_children_inherit_the_namespace(netns_fd):
    with entered(netns_fd):
        out = subprocess.run(["readlink", "/proc/self/ns/net"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
    assert out == f"net:[{os.fstat(netns_fd).st_ino}]"


def test_only_the_calling_thread_moves(netns_fd):
    seen: dict[str, int] = {}

    def worker() -> None:
        with entered(netns_fd):
            seen["thread"] = current_netns_id()
            seen["self"] = current_netns_id("self")
    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=10)
    home = current_netns_id()
    assert seen == {"thread": os.fstat(netns_fd).st_ino, "self": home}


def test_loopback_up_is_idempotent(netns_fd, make):
    loopback_up(netns_fd)
    loopback_up(netns_fd)
    with entered(netns_fd):
        u = make(socket.AF_INET, socket.SOCK_DGRAM)
        u.bind(("127.0.0.1", 0))
        u.sendto(b"ping", u.getsockname())
        assert u.recv(16) == b"ping"


def test_bad_fds_and_pids(make):
    s = make()
    with pytest.raises(ValueError, match="not a namespace fd"):
        with entered(s.fileno()):
            pass
    pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with pytest.raises(ValueError, match="not of a network namespace"):
            loopback_up(pidns)
    finally:
        os.close(pidns)
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(NetnsError):                 # EBADF, translated
        with entered(r):
            pass
    with pytest.raises(NoSuchProcess):
        current_netns_id(2**22 + 1)                 # above pid_max's ceiling
    with pytest.raises(NoSuchProcess):
        open_netns(2**22 + 1)


@needs("setpriv")
def test_refused_without_capabilities():
    """Without CAP_SYS_ADMIN, unshare(CLONE_NEWNET) fails: NetnsUnavailable, exit 17."""
    probe = ("import sys\n"
             "from ptckpt import netns\n"
             "try:\n"
             "    netns.new_netns()\n"
             "except netns.NetnsUnavailable as e:\n"
             "    print(e); sys.exit(e.exit_code)\n")
    proc = subprocess.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all",
                           sys.executable, "-c", probe],
                          capture_output=True, text=True, timeout=20, cwd=ROOT)
    assert proc.returncode == ExitCode.MISSING_FEATURE, proc.stderr
    assert "refused by the kernel" in proc.stdout
    assert NetnsUnavailable.exit_code == ExitCode.MISSING_FEATURE
    assert netns.NetnsUnavailable.__mro__[1] is NetnsError
