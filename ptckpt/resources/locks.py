"""File locks a process holds: flock(2), POSIX record locks, OFD locks and leases.

Dump half: :func:`dump_locks` reads the ``lock:`` lines of /proc/PID/fdinfo/FD
(fs/locks.c show_fd_locks, man 5 proc)::

    lock:   1: FLOCK  ADVISORY  WRITE 1234 fe:00:2162824 0 EOF
    lock:   2: POSIX  ADVISORY  READ 1234 fe:00:2162825 0 99
    lock:   3: OFDLCK ADVISORY  WRITE -1 fe:00:2162826 0 EOF

What the kernel lists there (checked on 6.18): only held locks (never a waiter)
whose struct file is this fd's open file description, and whose owner is this
process (its files_struct: POSIX) or this description (flock, OFD).  So

* flock and OFD locks show under every fd of the description: its dups, and
  the fds a forked child inherited (the pid column stays the taker's for
  flock; it is -1 for every OFD lock);
* a POSIX lock shows only under the fds of the description it was taken
  through, never under another open of the same file, and not in a forked
  child (POSIX locks are not inherited).  Locks the kernel merged keep the
  description of the first one: a lock on bytes 20-29 taken through fd 11
  next to one on 10-19 taken through fd 9 shows as 10-29 under fd 9 only.

:func:`dump_process_locks` therefore records each lock once: a POSIX lock under
the lowest fd of the same file (st_dev, st_ino) that is open for the lock's type
(a readable fd for a read lock, a writable one for a write lock); an flock or
OFD lock under the lowest fd of its description (kcmp).

A lease (``LEASE ACTIVE READ|WRITE``, fcntl F_SETLEASE) belongs to its open file
description, like an flock.  A lease being broken (``LEASE BREAKING UNLCK``, kind
"lease-breaking") or downgraded (``LEASE BREAKING READ``, "lease-downgrading": a
write lease an open for reading broke) is taken again and broken again the same
way by an open of ptckpt's that does not wait (the lease-break-time starts
anew); its type is the one its fd's open mode allows (a read lease needs
O_RDONLY).  An NFS delegation (``DELEG``), mandatory locks (kernels before 5.15)
and any form this version does not know cannot be held again: the dump functions
raise :class:`~ptckpt.errors.UnsupportedResource` naming the fd and the line,
so nothing is dropped silently.  :func:`unsupported_locks` lists them as
strings instead, for an inventory that reports rather than refuses.

Restore half: :func:`restore_locks_frozen` takes each lock again from inside
the restored process, by injection: flock(fd, LOCK_SH|LOCK_EX | LOCK_NB),
fcntl(fd, F_SETLK), fcntl(fd, F_OFD_SETLK) or fcntl(fd, F_SETLEASE) (which
fails while the file is open elsewhere for writing, or at all for a write
lease).  Nothing waits: a lock somebody
else holds raises :class:`~ptckpt.errors.RestoreFailed` naming the file, the
lock and the holders (found in every process's fdinfo, else with F_GETLK /
F_OFD_GETLK injected, else in /proc/locks).

Order matters at restore: closing *any* fd of a file drops every POSIX lock the
process holds on it, so the locks come last, after every fd is in place (and in
each process after its fork: POSIX locks are not inherited).  flock and OFD
locks belong to the description: when several processes share one (fork), it
is enough to take them once; taking them again through the same description
is harmless, through a separate open of the file it conflicts.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .. import procfs
from ..formats.model import HeldLock
from ..errors import PtckptError, RestoreFailed, UnsupportedResource
from ..tracee import RemoteSyscalls, same_open_file

# include/uapi/asm-generic/fcntl.h
F_GETLK, F_SETLK = 5, 6
F_OFD_GETLK, F_OFD_SETLK = 36, 37
F_RDLCK, F_WRLCK, F_UNLCK = 0, 1, 2
SEEK_SET = 0
# include/uapi/asm-generic/fcntl.h (flock(2))
LOCK_SH, LOCK_EX, LOCK_NB = 1, 2, 4
F_SETLEASE = 1024
F_SETOWN = 8
O_ACCMODE = 0o3
O_PATH = 0o10000000

# struct flock on x86_64: short l_type, short l_whence, 4 bytes of padding,
# off_t l_start (offset 8), off_t l_len, pid_t l_pid, 4 bytes of padding = 32 bytes.
_FLOCK = struct.Struct("<hh4xqqi4x")

KINDS = ("flock", "posix", "ofd", "lease", "lease-breaking", "lease-downgrading")
LEASES = ("lease", "lease-breaking", "lease-downgrading")
_KIND_OF_WORD = {"FLOCK": "flock", "POSIX": "posix", "OFDLCK": "ofd"}
_TYPE_OF_WORD = {"READ": "read", "WRITE": "write"}
_SHOWN = {"flock": "flock", "posix": "POSIX", "ofd": "OFD"}


@dataclass(frozen=True)
class FileLock:
    """One lock as /proc/PID/fdinfo/FD shows it.

    ``end`` is the last byte locked (inclusive, as fdinfo prints it), None for
    "to EOF and beyond"; an flock lock is always 0-None.  ``pid`` is the pid
    column as shown: the owner for POSIX, the taker for flock (possibly an
    ancestor), -1 for OFD locks.
    """

    kind: str               # "flock" | "posix" | "ofd" | one of LEASES
    type: str               # "read" | "write"
    start: int
    end: int | None
    pid: int

    def describe(self) -> str:
        """'POSIX write lock on bytes 200-EOF', 'exclusive flock (LOCK_EX)'."""
        if self.kind == "flock":
            return "exclusive flock (LOCK_EX)" if self.type == "write" else "shared flock (LOCK_SH)"
        if self.kind in LEASES:
            how = {"lease": "", "lease-breaking": " being broken", "lease-downgrading": " being downgraded"}
            return f"{self.type} lease{how[self.kind]} (F_SETLEASE)"
        end = "EOF" if self.end is None else str(self.end)
        return f"{_SHOWN.get(self.kind, self.kind)} {self.type} lock on bytes {self.start}-{end}"


class UnsupportedLock(ValueError):
    """A ``lock:`` line ptckpt cannot hold again; the message says what it is."""


def to_records(held: dict[int, list[FileLock]]) -> list[HeldLock]:
    """dump_process_locks' result as image records."""
    return [HeldLock(fd=fd, kind=l.kind, type=l.type, start=l.start, end=-1 if l.end is None else l.end,
                     pid=l.pid) for fd, locks in sorted(held.items()) for l in locks]


def from_records(records) -> dict[int, list[FileLock]]:
    """{fd: [FileLock]} from the image records."""
    out: dict[int, list[FileLock]] = {}
    for r in records:
        out.setdefault(r.fd, []).append(FileLock(r.kind, r.type, r.start, None if r.end < 0 else r.end, r.pid))
    return out


def parse_lock(text: str) -> FileLock | None:
    """One ``lock:`` value of fdinfo (or a line of /proc/locks): its FileLock.

    None for a blocked request ("1: -> POSIX ..."), which is not a held lock
    (fdinfo does not list them; /proc/locks does).  Raises UnsupportedLock for
    a lease, a delegation, a mandatory lock or a form not known here.
    """
    words = text.split()
    if words and words[0].endswith(":"):
        words = words[1:]                          # the "1:" counter
    if words and words[0] == "->":
        return None
    shown = " ".join(words)
    if len(words) < 7:
        raise UnsupportedLock(f"a lock line ptckpt cannot read ({shown!r})")
    kind_word, mode, type_word = words[0], words[1], words[2]
    if kind_word == "DELEG":
        raise UnsupportedLock(f"an NFS delegation ({shown}); delegations are not checkpointed")
    if kind_word == "LEASE":
        # fs/locks.c lock_get_status: ACTIVE, BREAKING (then the type it breaks to) or
        # BREAKER (/proc/locks only: the open that waits)
        kind = {("ACTIVE", "READ"): "lease", ("ACTIVE", "WRITE"): "lease",
                ("BREAKING", "UNLCK"): "lease-breaking", ("BREAKING", "READ"): "lease-downgrading"}.get(
                    (mode, type_word))
        if kind is None:
            raise UnsupportedLock(f"a lease in a state ptckpt cannot make again ({shown})")
        try:
            return FileLock(kind, "read" if type_word == "READ" and kind == "lease" else "write", 0, None,
                            int(words[3]))
        except ValueError:
            raise UnsupportedLock(f"a lock line ptckpt cannot read ({shown!r})") from None
    kind = _KIND_OF_WORD.get(kind_word)
    if kind is None:
        raise UnsupportedLock(f"a {kind_word} lock ({shown})")
    if mode != "ADVISORY":
        raise UnsupportedLock(f"a {mode.lower()} lock ({shown}); only advisory locks "
                              f"are checkpointed")
    type_ = _TYPE_OF_WORD.get(type_word)
    if type_ is None:
        raise UnsupportedLock(f"a {kind_word} lock of type {type_word} ({shown})")
    try:
        pid = int(words[3])
        start = int(words[5])
        end = None if words[6] == "EOF" else int(words[6])
    except ValueError:
        raise UnsupportedLock(f"a lock line ptckpt cannot read ({shown!r})") from None
    return FileLock(kind, type_, start, end, pid)


# --- dump half -----------------------------------------------------------------

def dump_locks(pid: int, fd: int) -> list[FileLock]:
    """The locks held through fd's open file description, as its fdinfo lists them.

    A POSIX lock of the process taken through another open of the file is not
    here (see the module docstring).  Raises UnsupportedResource for a lease
    or a mandatory lock, procfs.FdGone if the fd is not open.
    """
    info = procfs.read_fdinfo(pid, fd)
    return _locks_of(pid, fd, info.extra.get("lock", []), info.flags)


def _locks_of(pid: int, fd: int, lines: Iterable[str], flags: int) -> list[FileLock]:
    out = []
    for text in lines:
        try:
            lock = parse_lock(text)
        except UnsupportedLock as err:
            raise UnsupportedResource(pid, f"fd {fd} ({_path(pid, fd)}): {err}") from None
        if lock is not None and lock.kind == "lease-breaking" and flags & O_ACCMODE == os.O_RDONLY:
            lock = FileLock(lock.kind, "read", lock.start, lock.end, lock.pid)   # what it was
        if lock is not None:
            out.append(lock)
    return out


def unsupported_locks(pid: int, fds: Iterable[int]) -> list[str]:
    """'fd 5 -> /path: a read lease (...)' for each lock line the restore cannot hold again."""
    out = []
    for fd in sorted(set(fds)):
        try:
            lines = procfs.read_fdinfo(pid, fd).extra.get("lock", [])
        except procfs.FdGone:
            continue
        for text in lines:
            try:
                parse_lock(text)
            except UnsupportedLock as err:
                out.append(f"fd {fd} -> {_path(pid, fd)}: {err}")
    return out


@dataclass(frozen=True)
class _OpenFile:
    fd: int
    file: tuple[int, int]       # (st_dev, st_ino)
    flags: int


def _may_lock(f: _OpenFile, type_: str) -> bool:
    """fcntl(2): a read lock needs an fd open for reading, a write lock one open for writing."""
    if f.flags & O_PATH:
        return False
    mode = f.flags & O_ACCMODE
    return mode in (os.O_RDONLY, os.O_RDWR) if type_ == "read" else mode in (os.O_WRONLY, os.O_RDWR)


def dump_process_locks(pid: int, fds: list[int]) -> dict[int, list[FileLock]]:
    """{fd: locks to take again through it} for the fds of `pid` that hold any; each lock once.

    A POSIX lock belongs to the process and the file: it goes under the lowest
    of `fds` that refers to the same file and is open for the lock's type (even
    another description than the one fdinfo shows it under), so that the
    restore takes it exactly once.  An flock or OFD lock belongs to the open
    file description: it goes under the lowest fd of that description.  Fds
    closed meanwhile are skipped; a lease or mandatory lock raises
    UnsupportedResource.
    """
    files: dict[int, _OpenFile] = {}
    seen: dict[int, list[FileLock]] = {}
    for fd in sorted(set(fds)):
        try:
            info = procfs.read_fdinfo(pid, fd)
        except procfs.FdGone:
            continue
        try:
            st = procfs.stat_fd(pid, fd)
        except procfs.GONE_OR_MISSING:
            continue
        files[fd] = _OpenFile(fd, (st.st_dev, st.st_ino), info.flags)
        locks = _locks_of(pid, fd, info.extra.get("lock", []), info.flags)
        if locks:
            seen[fd] = locks

    out: dict[int, list[FileLock]] = {}
    posix_done: set[tuple[tuple[int, int], FileLock]] = set()
    reps: list[int] = []            # the lowest fd of each description that holds flock/OFD locks
    for fd, locks in seen.items():
        here = files[fd]
        rep = None
        for lock in locks:
            if lock.kind == "posix":
                key = (here.file, lock)
                if key in posix_done:
                    continue
                posix_done.add(key)
                owner = next((f.fd for f in files.values()
                              if f.file == here.file and _may_lock(f, lock.type)), fd)
                out.setdefault(owner, []).append(lock)
                continue
            if rep is None:
                rep = next((r for r in reps if files[r].file == here.file
                            and same_open_file(pid, r, pid, fd)), fd)
                if rep == fd:
                    reps.append(fd)
            if rep == fd:
                out.setdefault(fd, []).append(lock)
    return {fd: sorted(locks, key=lambda l: (KINDS.index(l.kind), l.start))
            for fd, locks in sorted(out.items())}


# --- restore half --------------------------------------------------------------

def _flock_struct(lock: FileLock, type_: int | None = None) -> bytes:
    l_type = (F_WRLCK if lock.type == "write" else F_RDLCK) if type_ is None else type_
    length = 0 if lock.end is None else lock.end - lock.start + 1
    return _FLOCK.pack(l_type, SEEK_SET, lock.start, length, 0)


def restore_locks_frozen(remote: RemoteSyscalls, fd: int, locks: Sequence[FileLock]) -> None:
    """Take every lock of `locks` again through `fd`, from inside the stopped process.

    Never waits (LOCK_NB, F_SETLK, F_OFD_SETLK).  A lock held by somebody else
    raises RestoreFailed naming the file, the lock and the holders; any other
    failure (an fd not open for writing, ENOLCK) raises RestoreFailed with the
    error.  Call it after every fd of the process is in place (see the module
    docstring).
    """
    pid = remote.task.tgid
    for lock in locks:
        if lock.kind not in KINDS or lock.type not in ("read", "write"):
            raise RestoreFailed(f"pid {pid} fd {fd}: unknown lock {lock!r} in the image")
        res = _take(remote, fd, lock)
        if res >= 0:
            continue
        err = -res
        what = f"the {lock.describe()} on {_path(pid, fd)} (pid {pid} fd {fd})"
        if err in (errno.EAGAIN, errno.EACCES):
            raise RestoreFailed(f"cannot take again {what}: {_conflict_text(remote, fd, lock)}")
        hint = ""
        if err == errno.EBADF:
            hint = f"; the fd is not open for {'writing' if lock.type == 'write' else 'reading'}"
        raise RestoreFailed(f"cannot take again {what}: {errno.errorcode.get(err, str(err))} "
                            f"({os.strerror(err)}){hint}")


def _take(remote: RemoteSyscalls, fd: int, lock: FileLock) -> int:
    if lock.kind in LEASES:
        res = remote.syscall("fcntl", fd, F_SETLEASE, F_WRLCK if lock.type == "write" else F_RDLCK)
        if res >= 0 and lock.kind != "lease":
            _break_lease(remote, fd, lock)
        return res
    if lock.kind == "flock":
        op = (LOCK_EX if lock.type == "write" else LOCK_SH) | LOCK_NB
        return remote.syscall("flock", fd, op)
    cmd = F_SETLK if lock.kind == "posix" else F_OFD_SETLK
    with remote.scratch(_flock_struct(lock)) as p:
        return remote.syscall("fcntl", fd, cmd, int(p))


def _break_lease(remote: RemoteSyscalls, fd: int, lock: FileLock) -> None:
    """Start the break of the lease just taken through `fd` again: an open of ptckpt's that
    does not wait (EWOULDBLOCK), for writing (to break it) or reading (to downgrade it).
    The fd's owner is cleared first, so that the break signals nobody: the restored
    process had that signal already (its owner comes back later, from the image)."""
    pid = remote.task.tgid
    remote.checked("fcntl", fd, F_SETOWN, 0, step=f"clear the owner of fd {fd} before its lease break")
    mode = os.O_RDONLY if lock.kind == "lease-downgrading" else os.O_WRONLY
    try:
        os.close(os.open(f"/proc/{pid}/fd/{fd}", mode | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY))
    except BlockingIOError:
        return                                    # the break has begun
    except OSError as err:
        raise RestoreFailed(f"cannot break again the {lock.describe()} on {_path(pid, fd)} "
                            f"(pid {pid} fd {fd}): {err.strerror}") from None
    raise RestoreFailed(f"cannot break again the {lock.describe()} on {_path(pid, fd)} "
                        f"(pid {pid} fd {fd}): an open did not meet the lease")


def _conflict_text(remote: RemoteSyscalls, fd: int, lock: FileLock) -> str:
    pid = remote.task.tgid
    if lock.kind in LEASES:
        return ("the file is open elsewhere" + (" for writing" if lock.type == "read" else "")
                + " (" + (", ".join(f"pid {p} ({procfs.comm_or_unknown(p)}) fd {n}" for p, n in
                                    _openers(pid, fd)) or "by whom, unknown") + ")")
    holders = lock_holders(pid, fd, lock)
    if holders:
        return "held by " + "; ".join(
            f"pid {p} ({procfs.comm_or_unknown(p)}) fd {n}: {other.describe()}" for p, n, other in holders)
    if lock.kind != "flock":
        other = _getlk(remote, fd, lock)
        if other is not None:
            who = "an open file description (OFD lock)" if other.pid == -1 else f"pid {other.pid}"
            return f"held by {who}: {other.describe()} (F_GETLK in pid {pid})"
    lines = _proc_locks_lines(pid, fd, lock)
    if lines:
        return "held by another process: /proc/locks has " + "; ".join(lines)
    return "the lock is taken, but no holder was found any more (it may have just been released)"


def _getlk(remote: RemoteSyscalls, fd: int, lock: FileLock) -> FileLock | None:
    """F_GETLK / F_OFD_GETLK injected: the first lock in the way, None if there is none now."""
    cmd = F_GETLK if lock.kind == "posix" else F_OFD_GETLK
    with remote.scratch(_flock_struct(lock)) as p:
        if remote.syscall("fcntl", fd, cmd, int(p)) < 0:
            return None
        l_type, _whence, start, length, l_pid = _FLOCK.unpack(remote.mem.read(p, _FLOCK.size))
    if l_type == F_UNLCK:
        return None
    return FileLock("ofd" if l_pid == -1 else "posix", "write" if l_type == F_WRLCK else "read",
                    start, None if length == 0 else start + length - 1, l_pid)


def _openers(pid: int, fd: int) -> list[tuple[int, int]]:
    """(pid, fd) of every other fd open on the file of pid's fd (a lease's conflicts)."""
    try:
        st = procfs.stat_fd(pid, fd)
    except (OSError, PtckptError):
        return []
    out = []
    for other in procfs.list_pids():
        try:
            for n in procfs.list_fds(other):
                if (other, n) != (pid, fd):
                    o = procfs.stat_fd(other, n)
                    if (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino):
                        out.append((other, n))
        except (OSError, PtckptError):
            continue
    return out


def _conflicts(want: FileLock, other: FileLock) -> bool:
    """Could `other` (held by another owner) keep `want` from being taken?"""
    if (want.kind == "flock") != (other.kind == "flock"):
        return False               # flock and record locks do not interact (local files)
    if want.type == "read" and other.type == "read":
        return False
    if want.kind == "flock":
        return True
    want_end = float("inf") if want.end is None else want.end
    other_end = float("inf") if other.end is None else other.end
    return want.start <= other_end and other.start <= want_end


def lock_holders(pid: int, fd: int, lock: FileLock) -> list[tuple[int, int, FileLock]]:
    """(pid, fd, lock) for each lock another owner holds that stands in the way of
    `lock` through pid's fd: found in the fdinfo of every process with an fd on
    the same file.  Processes that exit or deny access during the scan are skipped.
    """
    try:
        st = procfs.stat_fd(pid, fd)
    except (OSError, PtckptError):
        return []
    key = (st.st_dev, st.st_ino)
    found: dict[tuple[int, FileLock], int] = {}
    for other_pid in procfs.list_pids():
        try:
            fds = procfs.list_fds(other_pid)
        except (OSError, PtckptError):
            continue
        for n in fds:
            try:
                ost = procfs.stat_fd(other_pid, n)
                if (ost.st_dev, ost.st_ino) != key:
                    continue
                lines = procfs.read_fdinfo(other_pid, n).extra.get("lock", [])
            except (OSError, PtckptError):
                continue
            for text in lines:
                try:
                    other = parse_lock(text)
                except UnsupportedLock:
                    continue
                if other is None or not _conflicts(lock, other) or (other_pid, other) in found:
                    continue
                if _same_owner(pid, fd, lock, other_pid, n, other):
                    continue
                found[(other_pid, other)] = n
    return [(p, n, other) for (p, other), n in found.items()]


def _same_owner(pid: int, fd: int, lock: FileLock, other_pid: int, other_fd: int,
                other: FileLock) -> bool:
    if lock.kind == "posix" and other.kind == "posix":
        return other_pid == pid
    if lock.kind == other.kind:                 # flock or OFD: owned by the description
        try:
            return same_open_file(pid, fd, other_pid, other_fd)
        except PtckptError:
            return False
    return False


def _proc_locks_lines(pid: int, fd: int, lock: FileLock) -> list[str]:
    """Lines of /proc/locks on pid's fd's file that conflict with `lock` (pid column as shown)."""
    try:
        st = procfs.stat_fd(pid, fd)
        lines = procfs.read_locks()
    except (OSError, PtckptError):
        return []
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    out = []
    for line in lines:
        words = line.split()
        if where not in words:
            continue
        try:
            other = parse_lock(line)
        except UnsupportedLock:
            continue
        if other is not None and _conflicts(lock, other) and not (
                lock.kind == other.kind == "posix" and other.pid == pid):
            out.append(" ".join(words[1:]))
    return out


def _path(pid: int, fd: int) -> str:
    try:
        return procfs.readlink_fd(pid, fd)
    except PtckptError:
        return f"fd {fd}"

