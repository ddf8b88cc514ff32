"""File locks on real processes: what fdinfo shows, and the locks taken again by injection.

The targets are python3 scripts (idle_script) started by `spawn` in tmp_path,
which kills and reaps them at teardown.  Each opens its files at fixed fd
numbers *before* taking any lock (closing any fd of a file drops the POSIX
locks the process holds on it, dup2 over an fd included).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct

import pytest

from ptckpt import procfs
from ptckpt.errors import RestoreFailed
from ptckpt.resources import locks
from ptckpt.resources.locks import FileLock
from ptckpt.tracee import AddressSpace, Session, find_syscall_insn, remote_syscalls

from conftest import idle_script
from test_restore import _dump_kill, _restore

FLOCK = struct.Struct("<hh4xqqi4x")     # struct flock, x86_64: 32 bytes

# fd numbers of the targets: A (flock), B twice + a dup (POSIX), C + a dup (OFD),
# D twice (two POSIX read locks the kernel merges into one).
OPENS = """
import fcntl, os, struct, time
def at(path, flags, n):
    fd = os.open(path, flags)
    os.dup2(fd, n)
    os.close(fd)
at("A", os.O_RDWR, 10)
at("B", os.O_RDONLY, 11)
at("B", os.O_RDWR, 12)
os.dup2(12, 13)
at("C", os.O_RDWR, 14)
os.dup2(14, 15)
at("D", os.O_RDWR, 16)
at("D", os.O_RDWR, 17)
def lk(fd, cmd, typ, start, length):
    fcntl.fcntl(fd, cmd, struct.pack("<hh4xqqi4x", typ, 0, start, length, 0))
"""

HOLD = OPENS + """
fcntl.flock(10, fcntl.LOCK_EX)
lk(12, fcntl.F_SETLK, fcntl.F_RDLCK, 0, 100)
lk(12, fcntl.F_SETLK, fcntl.F_WRLCK, 200, 0)
lk(14, 37, fcntl.F_WRLCK, 0, 0)                      # F_OFD_SETLK
lk(16, fcntl.F_SETLK, fcntl.F_RDLCK, 10, 10)
lk(17, fcntl.F_SETLK, fcntl.F_RDLCK, 20, 10)
"""

LOCKED_FDS = list(range(10, 18))


def _expected(pid: int) -> dict[int, list[FileLock]]:
    return {
        10: [FileLock("flock", "write", 0, None, pid)],
        11: [FileLock("posix", "read", 0, 99, pid)],        # lowest readable fd of B
        12: [FileLock("posix", "write", 200, None, pid)],   # lowest writable fd of B
        14: [FileLock("ofd", "write", 0, None, -1)],
        16: [FileLock("posix", "read", 10, 29, pid)],
    }


@pytest.fixture
def files(tmp_path):
    for name in "ABCD":
        (tmp_path / name).write_bytes(b"x" * 1000)
    return tmp_path


@contextlib.contextmanager
def _injecting(pid: int):
    """A remote-syscall scope on the frozen leader of `pid`; the process runs on afterwards."""
    session = Session()
    try:
        tasks = session.freeze_process(pid)
        leader = next(t for t in tasks if t.tid == pid)
        with AddressSpace(pid) as mem:
            gadget = find_syscall_insn(mem, procfs.read_maps(pid))
            with remote_syscalls(leader, mem, gadget) as remote:
                yield remote
    finally:
        session.resume_all()


def _getlk(path, cmd: int, typ: int, start: int, length: int) -> tuple[int, int, int, int]:
    """(l_type, l_start, l_len, l_pid) of F_GETLK / F_OFD_GETLK from this (a third) process."""
    fd = os.open(path, os.O_RDWR)
    try:
        got = fcntl.fcntl(fd, cmd, FLOCK.pack(typ, 0, start, length, 0))
    finally:
        os.close(fd)
    l_type, _whence, l_start, l_len, l_pid = FLOCK.unpack(got)
    return l_type, l_start, l_len, l_pid


def _flock_blocked(path, op: int) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# --- dump half -------------------------------------------------------------------

def test_fdinfo_shows_locks_per_description(spawn, files):
    holder = spawn(str(idle_script(files, "hold.py", HOLD)), out=False)
    pid = holder.pid
    flock_a = [FileLock("flock", "write", 0, None, pid)]
    posix_b = [FileLock("posix", "read", 0, 99, pid), FileLock("posix", "write", 200, None, pid)]
    ofd_c = [FileLock("ofd", "write", 0, None, -1)]
    assert locks.dump_locks(pid, 10) == flock_a
    assert locks.dump_locks(pid, 11) == []             # another open of B: its POSIX locks are not there
    assert locks.dump_locks(pid, 12) == posix_b        # the description they were taken through
    assert locks.dump_locks(pid, 13) == posix_b        # and its dup
    assert locks.dump_locks(pid, 14) == locks.dump_locks(pid, 15) == ofd_c
    # 10-19 through fd 16 and 20-29 through fd 17 merge into one lock, kept by fd 16
    assert locks.dump_locks(pid, 16) == [FileLock("posix", "read", 10, 29, pid)]
    assert locks.dump_locks(pid, 17) == []
    assert locks.dump_locks(pid, 0) == []

    assert locks.dump_process_locks(pid, procfs.list_fds(pid)) == _expected(pid)
    assert locks.unsupported_locks(pid, procfs.list_fds(pid)) == []


def test_leases_are_dumped_also_while_broken(spawn, files):
    (files / "E").write_bytes(b"e")
    script = idle_script(files, "lease.py", "import fcntl, os, signal, time\n"
                         "signal.signal(signal.SIGIO, signal.SIG_IGN)\n"
                         "e = os.open('E', os.O_WRONLY)\n"
                         "fcntl.fcntl(e, fcntl.F_SETLEASE, fcntl.F_WRLCK)\n")
    holder = spawn(str(script), out=False)
    fd = next(n for n in procfs.list_fds(holder.pid)
              if procfs.readlink_fd(holder.pid, n) == str(files / "E"))
    assert locks.dump_locks(holder.pid, fd) == [FileLock("lease", "write", 0, None, holder.pid)]
    assert locks.dump_process_locks(holder.pid, procfs.list_fds(holder.pid)) == {
        fd: [FileLock("lease", "write", 0, None, holder.pid)]}
    with pytest.raises(BlockingIOError):          # starts the break, does not wait for it
        os.open(files / "E", os.O_RDONLY | os.O_NONBLOCK)
    assert locks.dump_locks(holder.pid, fd) == [FileLock("lease-downgrading", "write", 0, None, holder.pid)]
    assert locks.unsupported_locks(holder.pid, procfs.list_fds(holder.pid)) == []


def test_leases_come_back(spawn, ptckpt, files, tmp_path):
    """End to end: a read lease and a write lease are held again by the restored process,
    and so are one being broken and one being downgraded, with their breaks begun again."""
    for name in "RWBD":
        (files / name).write_bytes(name.encode())
    holder = spawn(str(idle_script(files, "leases.py", "import fcntl, os, signal, time\n"
                                   "signal.signal(signal.SIGIO, signal.SIG_IGN)\n"
                                   "r = os.open('R', os.O_RDONLY)\n"
                                   "fcntl.fcntl(r, fcntl.F_SETLEASE, fcntl.F_RDLCK)\n"
                                   "w = os.open('W', os.O_WRONLY)\n"
                                   "fcntl.fcntl(w, fcntl.F_SETLEASE, fcntl.F_WRLCK)\n"
                                   "b = os.open('B', os.O_RDONLY)\n"
                                   "fcntl.fcntl(b, fcntl.F_SETLEASE, fcntl.F_RDLCK)\n"
                                   "d = os.open('D', os.O_WRONLY)\n"
                                   "fcntl.fcntl(d, fcntl.F_SETLEASE, fcntl.F_WRLCK)\n")), out=False)
    for name, mode in (("B", os.O_WRONLY), ("D", os.O_RDONLY)):
        with pytest.raises(BlockingIOError):      # the break begins
            os.open(files / name, mode | os.O_NONBLOCK)
    _dump_kill(ptckpt, holder, tmp_path / "img")
    _restore(ptckpt, tmp_path / "img")
    with open("/proc/locks") as f:
        mine = sorted(line.split()[1:4] for line in f if line.split()[4] == str(holder.pid))
    assert mine == [["LEASE", "ACTIVE", "READ"], ["LEASE", "ACTIVE", "WRITE"],
                    ["LEASE", "BREAKING", "READ"], ["LEASE", "BREAKING", "UNLCK"]]
    with pytest.raises(BlockingIOError):          # the write lease holds: an open must break it
        os.open(files / "W", os.O_RDONLY | os.O_NONBLOCK)


def test_parse_lock_lines():
    p = locks.parse_lock
    assert p("1: FLOCK  ADVISORY  WRITE 1234 08:02:131 0 EOF") == FileLock("flock", "write", 0, None, 1234)
    assert p("2: POSIX  ADVISORY  READ 77 fe:00:5 0 99") == FileLock("posix", "read", 0, 99, 77)
    assert p("3: OFDLCK ADVISORY  WRITE -1 fe:00:5 200 EOF") == FileLock("ofd", "write", 200, None, -1)
    assert p("1: -> POSIX  ADVISORY  WRITE 88 fe:00:5 0 EOF") is None     # a waiter (/proc/locks)
    assert p("1: LEASE  ACTIVE    READ 5 fe:00:5 0 EOF") == FileLock("lease", "read", 0, None, 5)
    assert p("1: LEASE  ACTIVE    WRITE 5 fe:00:5 0 EOF") == FileLock("lease", "write", 0, None, 5)
    assert p("1: LEASE  BREAKING  UNLCK 5 fe:00:5 0 EOF") == FileLock("lease-breaking", "write", 0, None, 5)
    assert p("1: LEASE  BREAKING  READ 5 fe:00:5 0 EOF") == FileLock("lease-downgrading", "write", 0, None, 5)
    for line, why in [("1: LEASE  BREAKER   READ 5 fe:00:5 0 EOF", "a lease in a state"),
                      ("1: DELEG  ACTIVE    READ 5 fe:00:5 0 EOF", "delegation"),
                      ("1: POSIX  MANDATORY WRITE 5 08:02:9 0 EOF", "mandatory"),
                      ("1: FLOCK  ADVISORY  UNLCK 5 08:02:9 0 EOF", "UNLCK"),
                      ("1: FLOCK  ADVISORY", "cannot read")]:
        with pytest.raises(locks.UnsupportedLock, match=why):
            p(line)
    assert FileLock("posix", "write", 200, None, 1).describe() == "POSIX write lock on bytes 200-EOF"


# --- restore half -----------------------------------------------------------------

def test_locks_are_held_again_after_restore(spawn, files):
    holder = spawn(str(idle_script(files, "hold.py", HOLD)), out=False)
    image = locks.dump_process_locks(holder.pid, procfs.list_fds(holder.pid))
    holder.kill()
    assert not _flock_blocked(files / "A", fcntl.LOCK_EX)       # the holder took them along

    target = spawn(str(idle_script(files, "fresh.py", OPENS)), out=False)
    assert locks.dump_process_locks(target.pid, LOCKED_FDS) == {}
    with _injecting(target.pid) as remote:
        for fd, held in image.items():
            locks.restore_locks_frozen(remote, fd, held)

    pid = target.pid
    assert target.alive()
    assert locks.dump_process_locks(pid, procfs.list_fds(pid)) == _expected(pid)
    # Seen from this process, a third one:
    assert _flock_blocked(files / "A", fcntl.LOCK_SH)
    assert _getlk(files / "B", fcntl.F_GETLK, fcntl.F_WRLCK, 0, 1) == (fcntl.F_RDLCK, 0, 100, pid)
    assert _getlk(files / "B", fcntl.F_GETLK, fcntl.F_RDLCK, 100, 100)[0] == fcntl.F_UNLCK
    assert _getlk(files / "B", fcntl.F_GETLK, fcntl.F_RDLCK, 5000, 1) == (fcntl.F_WRLCK, 200, 0, pid)
    assert _getlk(files / "C", locks.F_OFD_GETLK, fcntl.F_RDLCK, 0, 0) == (fcntl.F_WRLCK, 0, 0, -1)
    assert _getlk(files / "D", fcntl.F_GETLK, fcntl.F_WRLCK, 0, 0) == (fcntl.F_RDLCK, 10, 20, pid)
    with open("/proc/locks") as f:
        mine = [line.split()[1:4] for line in f if line.split()[4] == str(pid)]
    assert sorted(mine) == sorted([["FLOCK", "ADVISORY", "WRITE"], ["POSIX", "ADVISORY", "READ"],
                                   ["POSIX", "ADVISORY", "WRITE"], ["POSIX", "ADVISORY", "READ"]])


BLOCK = OPENS + """
fcntl.flock(10, fcntl.LOCK_SH)
lk(12, fcntl.F_SETLK, fcntl.F_RDLCK, 50, 10)
lk(14, 37, fcntl.F_RDLCK, 0, 0)                      # F_OFD_SETLK
"""


def test_a_conflicting_holder_is_named(spawn, files):
    blocker = spawn(str(idle_script(files, "block.py", BLOCK)), out=False)
    target = spawn(str(idle_script(files, "fresh.py", OPENS)), out=False)
    cases = [
        (10, FileLock("flock", "write", 0, None, 1), "shared flock (LOCK_SH)"),
        (12, FileLock("posix", "write", 0, None, 1), "POSIX read lock on bytes 50-59"),
        (14, FileLock("ofd", "write", 100, 199, -1), "OFD read lock on bytes 0-EOF"),
    ]
    with _injecting(target.pid) as remote:
        for fd, want, held in cases:
            with pytest.raises(RestoreFailed) as err:
                locks.restore_locks_frozen(remote, fd, [want])
            msg = str(err.value)
            assert want.describe() in msg
            assert procfs.readlink_fd(target.pid, fd) in msg
            comm = procfs.read_comm(blocker.pid)
            assert f"held by pid {blocker.pid} ({comm}) fd {fd}: {held}" in msg, msg
        # a lock that does not conflict still goes through; one the fd cannot take is named
        locks.restore_locks_frozen(remote, 12, [FileLock("posix", "read", 0, None, 1)])
        with pytest.raises(RestoreFailed, match="EBADF.*not open for writing"):
            locks.restore_locks_frozen(remote, 11, [FileLock("posix", "write", 900, None, 1)])
    assert target.alive()
    assert locks.dump_process_locks(target.pid, LOCKED_FDS) == {
        11: [FileLock("posix", "read", 0, None, target.pid)]}
