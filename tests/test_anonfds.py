"""eventfd, timerfd, signalfd, inotify, memfd and mqueue fds: dumped from a stopped child,
made again in the test process, and the new object behaves like the old one.

Every object is real: a python3 child makes it in a chosen state (CHILD below),
says READY with its fd numbers as JSON, and is stopped with SIGSTOP before the
dump.  Children are killed and reaped, message queues unlinked, by finalizers.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ptckpt import procfs
from ptckpt.errors import UnsupportedResource
from ptckpt.formats.model import FdKind
from ptckpt.resources import anonfds
from ptckpt.resources.anonfds import (
    EFD_SEMAPHORE, F_GET_SEALS, F_SEAL_GROW, F_SEAL_WRITE, IN_EXCL_UNLINK, IN_ONESHOT,
    TFD_TIMER_ABSTIME, EventfdState, InotifyState, InotifyWatch, MemfdState, MqueueState,
    SignalfdState, TimerfdState, create_anon_fd, dump_anon_fd, is_mqueue,
)

from conftest import proc_stat, wait_until

IN_MODIFY, IN_ATTRIB, IN_CREATE, IN_DELETE, IN_IGNORED = 0x2, 0x4, 0x100, 0x200, 0x8000

CHILD = r'''
import ctypes, fcntl, json, os, signal, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)

def check(res, what):
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return res

class MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(MqAttr)]
libc.mq_receive.restype = ctypes.c_ssize_t

def timer(clock, flags, value_ns, interval_ns, settime_flags=0):
    fd = check(libc.timerfd_create(clock, flags), "timerfd_create")
    spec = struct.pack("qqqq", interval_ns // 10**9, interval_ns % 10**9,
                       value_ns // 10**9, value_ns % 10**9)
    check(libc.timerfd_settime(fd, settime_flags, spec, None), "timerfd_settime")
    return fd

kind, args = sys.argv[1], sys.argv[2:]
out = {}
if kind == "eventfd":
    out["fd"] = os.eventfd(5, os.EFD_SEMAPHORE | os.EFD_NONBLOCK)
elif kind == "timerfd":
    out["armed"] = timer(1, 0, 2 * 10**9, 500_000_000)          # CLOCK_MONOTONIC
    fcntl.ioctl(out["armed"], 0x40085400, struct.pack("Q", 3))  # TFD_IOC_SET_TICKS: 3 unread
    out["fast"] = timer(1, 0, 10_000_000, 50_000_000)
    out["abs_expiry"] = time.clock_gettime_ns(0) + 60 * 10**9   # CLOCK_REALTIME, absolute
    out["abs"] = timer(0, 0, out["abs_expiry"], 0, settime_flags=1)
    out["expired"] = timer(1, os.O_NONBLOCK, 1_000_000, 0)      # one-shot, fired, not read
    time.sleep(0.01)
elif kind == "signalfd":
    mask = {signal.SIGUSR1, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, mask)
    bits = sum(1 << (s - 1) for s in mask)
    out["fd"] = check(libc.signalfd(-1, struct.pack("Q", bits) + bytes(120), os.O_NONBLOCK),
                      "signalfd")
elif kind == "inotify":
    base = args[0]
    fd = check(libc.inotify_init1(os.O_NONBLOCK), "inotify_init1")
    add = lambda p, m: check(libc.inotify_add_watch(fd, p.encode(), m), f"add_watch {p}")
    out["fd"] = fd
    out["d1"] = add(f"{base}/d1", 0x100 | 0x200)                      # IN_CREATE | IN_DELETE
    for n in range(10):                                               # wds 2..11: a gap
        check(libc.inotify_rm_watch(fd, add(f"{base}/x{n}", 0x4)), "rm_watch")
    out["f"] = add(f"{base}/f", 0x4 | 0x2 | 0x80000000)              # ATTRIB|MODIFY|ONESHOT
    out["d2"] = add(f"{base}/d2", 0x100 | 0x04000000)                # CREATE|EXCL_UNLINK
    try:
        while os.read(fd, 4096):                                      # the IN_IGNORED events
            pass
    except BlockingIOError:
        pass
elif kind == "inotify-deleted":
    base = args[0]
    fd = check(libc.inotify_init1(os.O_NONBLOCK), "inotify_init1")
    keep = os.open(f"{base}/gone", os.O_RDWR | os.O_CREAT)
    check(libc.inotify_add_watch(fd, f"{base}/gone".encode(), 0x2), "add_watch")  # IN_MODIFY
    os.unlink(f"{base}/gone")
    out["fd"], out["keep"] = fd, keep
elif kind == "inotify-pending":
    base = args[0]
    fd = check(libc.inotify_init1(os.O_NONBLOCK), "inotify_init1")
    check(libc.inotify_add_watch(fd, base.encode(), 0x100), "add_watch")         # IN_CREATE
    open(f"{base}/new", "w").close()
    out["fd"] = fd
elif kind == "memfd":
    fd = os.memfd_create("ptckpt test memfd", os.MFD_ALLOW_SEALING)
    os.write(fd, b"checkpointed memfd\n" * 100)
    os.ftruncate(fd, 16384)
    os.lseek(fd, 7, os.SEEK_SET)
    fcntl.fcntl(fd, 1033, 0x08 | 0x04)                           # F_ADD_SEALS: WRITE | GROW
    out["fd"] = fd
elif kind == "mqueue":
    name = args[0].encode()
    os.umask(0)
    q = check(libc.mq_open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o640,
                           ctypes.byref(MqAttr(0, 8, 64, 0))), "mq_open")
    for data, prio in ((b"low", 1), (b"high", 9), (b"mid", 5), (b"mid2", 5)):
        check(libc.mq_send(q, data, len(data), prio), "mq_send")
    out["fd"] = q
print(json.dumps(out), flush=True)
for line in sys.stdin:
    if line.strip() == "drain":
        attr = MqAttr()
        check(libc.mq_getattr(out["fd"], ctypes.byref(attr)), "mq_getattr")
        buf, prio, got = ctypes.create_string_buffer(attr.msgsize), ctypes.c_uint(), []
        for _ in range(attr.curmsgs):
            n = check(libc.mq_receive(out["fd"], buf, attr.msgsize, ctypes.byref(prio)), "mq_receive")
            got.append([prio.value, buf.raw[:n].decode()])
        print(json.dumps(got), flush=True)
'''


class Child:
    """A CHILD process holding one kind of object; `info` is what it printed."""

    def __init__(self, kind: str, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, kind, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise AssertionError(f"the {kind} child failed (exit status {self.proc.returncode})")
        self.info = json.loads(line)

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        wait_until(lambda: proc_stat(self.pid).state == "T", timeout=5,
                   message=f"child {self.pid} to stop")

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def ask(self, command: str):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def flags(self, fd: int) -> int:
        return procfs.read_fdinfo(self.pid, fd).flags

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()


@pytest.fixture
def child(request: pytest.FixtureRequest) -> Callable[..., Child]:
    """child(kind, *args): a started CHILD, killed and reaped at teardown."""
    def start(kind: str, *args: str) -> Child:
        c = Child(kind, *args)
        request.addfinalizer(c.close)
        return c
    return start


@pytest.fixture
def fds(request: pytest.FixtureRequest) -> Callable[[int], int]:
    """keep(fd) -> fd: closed at teardown."""
    def keep(fd: int) -> int:
        request.addfinalizer(lambda: os.close(fd))
        return fd
    return keep


def _fdinfo(fd: int) -> dict[str, list[str]]:
    return procfs.read_fdinfo(os.getpid(), fd).extra


# --- eventfd -------------------------------------------------------------------

def test_eventfd_semaphore(child, fds):
    c = child("eventfd")
    c.stop()
    fd = c.info["fd"]
    state = dump_anon_fd(c.pid, fd, FdKind.EVENTFD)
    assert state == EventfdState(count=5, flags=EFD_SEMAPHORE | os.O_NONBLOCK)
    assert _fdinfo_of(c.pid, fd)["eventfd-count"] == ["5"]      # the dump took nothing

    new = fds(create_anon_fd(state, c.flags(fd)))
    assert fcntl.fcntl(new, fcntl.F_GETFL) & os.O_NONBLOCK
    assert os.eventfd_read(new) == 1                             # semaphore: one at a time
    assert os.eventfd_read(new) == 1
    assert _fdinfo(new)["eventfd-count"] == ["3"]
    assert _fdinfo(new)["eventfd-semaphore"] == ["1"]


def test_eventfd_count_beyond_32_bits(fds):
    fd = fds(os.eventfd(0))
    os.eventfd_write(fd, 2**40 + 7)
    state = dump_anon_fd(os.getpid(), fd, FdKind.EVENTFD)
    assert state == EventfdState(count=2**40 + 7, flags=0)
    new = fds(create_anon_fd(state, os.O_RDWR))
    assert not fcntl.fcntl(new, fcntl.F_GETFL) & os.O_NONBLOCK
    assert os.eventfd_read(new) == 2**40 + 7


def _fdinfo_of(pid: int, fd: int) -> dict[str, list[str]]:
    return procfs.read_fdinfo(pid, fd).extra


# --- timerfd -------------------------------------------------------------------

def test_timerfd(child, fds):
    c = child("timerfd")
    time.sleep(0.12)                              # the fast timer expires a few times
    c.stop()
    i = c.info
    armed = dump_anon_fd(c.pid, i["armed"], FdKind.TIMERFD)
    fast = dump_anon_fd(c.pid, i["fast"], FdKind.TIMERFD)
    absolute = dump_anon_fd(c.pid, i["abs"], FdKind.TIMERFD)
    expired = dump_anon_fd(c.pid, i["expired"], FdKind.TIMERFD)

    assert (armed.clockid, armed.settime_flags, armed.interval_ns, armed.ticks) == (1, 0, 5 * 10**8, 3)
    assert 1.5e9 < armed.value_ns <= 2e9
    assert _fdinfo_of(c.pid, i["armed"])["ticks"] == ["3"]       # nothing was read
    assert fast.ticks >= 2 and 0 < fast.value_ns <= 50_000_000 and fast.interval_ns == 50_000_000
    assert absolute.clockid == 0 and absolute.settime_flags == TFD_TIMER_ABSTIME
    assert abs(absolute.expires_ns - i["abs_expiry"]) < 5_000_000
    assert expired == TimerfdState(clockid=1, flags=os.O_NONBLOCK, settime_flags=0, value_ns=0,
                                   interval_ns=0, ticks=1, expires_ns=0)
    assert not expired.armed

    new_abs = fds(create_anon_fd(absolute, c.flags(i["abs"])))
    assert _fdinfo(new_abs)["settime flags"] == ["01"]
    left = _gettime(new_abs)[1]
    assert abs(time.clock_gettime_ns(0) + left - i["abs_expiry"]) < 5_000_000

    new_expired = fds(create_anon_fd(expired, c.flags(i["expired"])))
    assert _read_u64(new_expired) == 1
    with pytest.raises(BlockingIOError):
        os.read(new_expired, 8)

    new_fast = fds(create_anon_fd(fast, c.flags(i["fast"])))
    assert _read_u64(new_fast) in (fast.ticks, fast.ticks + 1)   # +1 if it expired since

    new = fds(create_anon_fd(armed, c.flags(i["armed"])))
    start = time.monotonic()
    assert not fcntl.fcntl(new, fcntl.F_GETFL) & os.O_NONBLOCK
    assert _read_u64(new) == 3                                    # the unread expirations
    assert select.select([new], [], [], 3)[0] == [new]
    elapsed = time.monotonic() - start
    assert armed.value_ns / 1e9 - 0.02 < elapsed < armed.value_ns / 1e9 + 0.15
    assert _read_u64(new) == 1
    interval, left = _gettime(new)
    assert interval == 5 * 10**8 and 0.4e9 < left <= 0.5e9


def _gettime(fd: int) -> tuple[int, int]:
    """(interval, remaining) in ns, by timerfd_gettime."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(32)
    assert libc.timerfd_gettime(fd, buf) == 0
    isec, insec, vsec, vnsec = struct.unpack("qqqq", buf.raw)
    return isec * 10**9 + insec, vsec * 10**9 + vnsec


def _read_u64(fd: int) -> int:
    return struct.unpack("Q", os.read(fd, 8))[0]


# --- signalfd ------------------------------------------------------------------

def test_signalfd(child, fds):
    c = child("signalfd")
    c.stop()
    fd = c.info["fd"]
    state = dump_anon_fd(c.pid, fd, FdKind.SIGNALFD)
    assert state.signals == {signal.SIGUSR1, signal.SIGTERM}
    assert state == SignalfdState(mask=(1 << signal.SIGUSR1 - 1) | (1 << signal.SIGTERM - 1),
                                  flags=os.O_NONBLOCK)

    new = fds(create_anon_fd(state, c.flags(fd)))
    assert _fdinfo(new)["sigmask"] == _fdinfo_of(c.pid, fd)["sigmask"]
    with pytest.raises(BlockingIOError):
        os.read(new, 128)
    # A SIGUSR1 blocked and pending for this thread is read through the new fd.
    old_handler = signal.signal(signal.SIGUSR1, lambda *_: None)   # in case it slips through
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
        info = os.read(new, 128)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        signal.signal(signal.SIGUSR1, old_handler)
    assert struct.unpack_from("I", info)[0] == signal.SIGUSR1


# --- inotify -------------------------------------------------------------------

def _inotify_tree(base: Path) -> None:
    (base / "d1").mkdir()
    (base / "d2").mkdir()
    (base / "f").write_text("watched\n")
    for n in range(10):
        (base / f"x{n}").touch()


def _events(fd: int, timeout: float = 2.0) -> list[tuple[int, int, str]]:
    """The (wd, mask, name) events that arrive on `fd` within `timeout` (after the first)."""
    out = []
    while select.select([fd], [], [], timeout if not out else 0.05)[0]:
        data = os.read(fd, 65536)
        off = 0
        while off < len(data):
            wd, mask, _cookie, size = struct.unpack_from("iIII", data, off)
            name = data[off + 16:off + 16 + size].rstrip(b"\0").decode()
            out.append((wd, mask, name))
            off += 16 + size
    return out


def test_inotify_same_wds(child, fds, tmp_path):
    _inotify_tree(tmp_path)
    c = child("inotify", str(tmp_path))
    assert (c.info["d1"], c.info["f"], c.info["d2"]) == (1, 12, 13)
    c.stop()
    fd = c.info["fd"]
    state = dump_anon_fd(c.pid, fd, FdKind.INOTIFY)
    assert state == InotifyState(watches=(
        InotifyWatch(1, str(tmp_path / "d1"), IN_CREATE | IN_DELETE),
        InotifyWatch(12, str(tmp_path / "f"), IN_ATTRIB | IN_MODIFY | IN_ONESHOT),
        InotifyWatch(13, str(tmp_path / "d2"), IN_CREATE | IN_EXCL_UNLINK),
    ), flags=os.O_NONBLOCK)

    new = fds(create_anon_fd(state, c.flags(fd)))
    assert fcntl.fcntl(new, fcntl.F_GETFL) & os.O_NONBLOCK
    assert sorted(_fdinfo(new)["inotify"]) == sorted(_fdinfo_of(c.pid, fd)["inotify"])
    queued = struct.unpack("i", fcntl.ioctl(new, termios.FIONREAD, b"\0" * 4))[0]
    assert queued == 0                                  # the placeholders' IN_IGNORED are gone
    os.utime(tmp_path / "f")
    (tmp_path / "d1" / "born").touch()
    (tmp_path / "d2" / "also").touch()
    got = _events(new)
    assert (12, IN_ATTRIB, "") in got
    assert (12, IN_IGNORED, "") in got                  # IN_ONESHOT came back too
    assert (1, IN_CREATE, "born") in got
    assert (13, IN_CREATE, "also") in got


def test_inotify_watch_on_deleted_file_is_recorded_with_its_inode(child, tmp_path):
    c = child("inotify-deleted", str(tmp_path))
    c.stop()
    fd = c.info["fd"]
    st = os.stat(f"/proc/{c.pid}/fd/{c.info['keep']}")          # the fd that keeps the file
    state = dump_anon_fd(c.pid, fd, FdKind.INOTIFY)
    assert state.watches == (InotifyWatch(1, str(tmp_path / "gone"), 0x2),)
    assert state.deleted == ((1, st.st_dev, st.st_ino),)
    # a dump refuses it unless the tree holds the file (then it is a ghost file of the image)
    assert anonfds.deleted_watches_unheld(state, {("ghost", st.st_dev, st.st_ino)}) == []
    assert "inotify watch 1 on the deleted file" in anonfds.deleted_watches_unheld(state, set())[0]


def test_inotify_with_queued_events_is_refused(child, tmp_path):
    c = child("inotify-pending", str(tmp_path))
    c.stop()
    fd = c.info["fd"]
    with pytest.raises(UnsupportedResource, match=rf"fd {fd} .*unread inotify events"):
        dump_anon_fd(c.pid, fd, FdKind.INOTIFY)


# --- memfd ---------------------------------------------------------------------

def test_memfd(child, fds):
    c = child("memfd")
    c.stop()
    fd = c.info["fd"]
    state = dump_anon_fd(c.pid, fd, FdKind.MEMFD)
    data = b"checkpointed memfd\n" * 100
    assert state == MemfdState(name="ptckpt test memfd", contents=data + bytes(16384 - len(data)),
                               size=16384, seals=F_SEAL_WRITE | F_SEAL_GROW, mode=0o777, pos=7)

    new = fds(create_anon_fd(state, c.flags(fd)))
    assert os.readlink(f"/proc/self/fd/{new}") == "/memfd:ptckpt test memfd (deleted)"
    assert fcntl.fcntl(new, F_GET_SEALS) == F_SEAL_WRITE | F_SEAL_GROW
    assert os.fstat(new).st_size == 16384
    assert os.lseek(new, 0, os.SEEK_CUR) == 7
    assert os.pread(new, 100, 0) == data[:100]
    with pytest.raises(PermissionError):
        os.write(new, b"x")
    with pytest.raises(PermissionError):
        os.ftruncate(new, 20000)
    os.ftruncate(new, 100)                               # shrinking was not sealed
    assert os.fstat(new).st_size == 100


# --- mqueue --------------------------------------------------------------------

class _MqAttr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long),
                ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_MqAttr)]
_libc.mq_receive.restype = ctypes.c_ssize_t


def _mq_open(name: str, flags: int, attr: _MqAttr | None = None) -> int:
    q = _libc.mq_open(name.encode(), flags, 0o600, ctypes.byref(attr) if attr else None)
    if q < 0:
        raise OSError(ctypes.get_errno(), f"mq_open {name}")
    return q


def _mq_attr(q: int) -> _MqAttr:
    attr = _MqAttr()
    assert _libc.mq_getattr(q, ctypes.byref(attr)) == 0
    return attr


def _mq_receive_all(q: int) -> list[tuple[int, bytes]]:
    attr = _mq_attr(q)
    buf, prio, out = ctypes.create_string_buffer(attr.msgsize), ctypes.c_uint(), []
    for _ in range(attr.curmsgs):
        n = _libc.mq_receive(q, buf, attr.msgsize, ctypes.byref(prio))
        assert n >= 0, os.strerror(ctypes.get_errno())
        out.append((prio.value, buf.raw[:n]))
    return out


@pytest.fixture
def mq_name(request: pytest.FixtureRequest) -> str:
    """A fresh queue name, unlinked at teardown."""
    name = f"/ptckpt-test-{os.getpid()}-{time.monotonic_ns()}"
    request.addfinalizer(lambda: _libc.mq_unlink(name.encode()))
    return name


def test_mqueue(child, fds, mq_name):
    c = child("mqueue", mq_name)
    c.stop()
    fd = c.info["fd"]
    assert os.readlink(f"/proc/{c.pid}/fd/{fd}") == mq_name
    assert is_mqueue(c.pid, fd)
    expected = ((9, b"high"), (5, b"mid"), (5, b"mid2"), (1, b"low"))
    state = dump_anon_fd(c.pid, fd, FdKind.MQUEUE)
    assert state == MqueueState(name=mq_name, maxmsg=8, msgsize=64, flags=0, messages=expected,
                                mode=0o640, uid=os.getuid(), gid=os.getgid())
    assert dump_anon_fd(c.pid, fd, FdKind.MQUEUE) == state        # a second dump sees the same

    c.cont()                                                      # the child's queue is unchanged
    assert [tuple(m) for m in c.ask("drain")] == [(p, d.decode()) for p, d in expected]

    # The queue still exists, with other messages: emptied and refilled.
    other = fds(_mq_open(mq_name, os.O_RDWR | os.O_NONBLOCK))
    assert _libc.mq_send(other, b"junk", 4, 30) == 0
    new = fds(create_anon_fd(state, c.flags(fd)))
    assert _mq_attr(new).flags == 0                               # blocking, as recorded
    assert _mq_receive_all(new) == list(expected)

    # The queue is gone: made again with its attributes, mode and messages.
    assert _libc.mq_unlink(mq_name.encode()) == 0
    new = fds(create_anon_fd(state, c.flags(fd)))
    assert os.readlink(f"/proc/self/fd/{new}") == mq_name
    attr = _mq_attr(new)
    assert (attr.maxmsg, attr.msgsize, attr.curmsgs) == (8, 64, 4)
    assert os.stat(f"/proc/self/fd/{new}").st_mode & 0o777 == 0o640
    by_name = fds(_mq_open(mq_name, os.O_RDONLY | os.O_NONBLOCK))
    assert _mq_receive_all(by_name) == list(expected)


def test_mqueue_unlinked_and_nonblocking(fds, mq_name):
    q = fds(_mq_open(mq_name, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, _MqAttr(0, 4, 16, 0)))
    for data, prio in ((b"a", 2), (b"b", 7)):
        assert _libc.mq_send(q, data, len(data), prio) == 0
    assert _libc.mq_unlink(mq_name.encode()) == 0
    state = dump_anon_fd(os.getpid(), q, FdKind.MQUEUE)
    assert (state.name, state.unlinked, state.flags) == (mq_name, True, os.O_NONBLOCK)
    assert state.messages == ((7, b"b"), (2, b"a"))
    assert _mq_attr(q).curmsgs == 2                                # put back

    new = fds(create_anon_fd(state, os.O_RDONLY | os.O_NONBLOCK))
    assert os.readlink(f"/proc/self/fd/{new}").endswith(" (deleted)")
    assert _mq_attr(new).flags == os.O_NONBLOCK
    assert _mq_receive_all(new) == [(7, b"b"), (2, b"a")]
    with pytest.raises(FileNotFoundError):
        _mq_open(mq_name, os.O_RDONLY)
    assert not is_mqueue(os.getpid(), fds(os.eventfd(0)))
