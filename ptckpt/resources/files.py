"""File descriptors: what each fd of a process is, with enough detail to reopen it.

Dump half: :func:`dump_fds`.  Kinds are decided by :func:`classify_fd` from
the /proc/PID/fd link text and the stat of the open file; the table
``RESTORABLE_KINDS`` says which kinds the restore side can recreate, and
:func:`unsupported_fds` names the others (a dump refuses them, by name).
:func:`number_descriptions` gives fds that share one open file description
(dup, fork) one number across the tree, found with kcmp(2).

Restore half: a description held by several fds (or a pipe or socket, which
ptckpt builds itself) is opened once in ptckpt (:func:`open_description`) and
handed to the stubs, each of which dup3()s it to its fd numbers; every other fd
is reopened by path inside its process (:func:`restore_fds_frozen`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import stat as _stat
from collections.abc import Mapping

from .. import procfs
from ..errors import PtckptError, RestoreFailed, UnsupportedResource
from ..formats.model import Fd, FdKind, GhostFile, SavedFile, Vma, VmaKind
from ..tracee import pidfd_getfd, same_open_file
from .anonfds import ANON_FD_KINDS, is_mqueue
from .filepolicy import path_matches

O_PATH = 0o10000000
O_CLOEXEC = 0o2000000

_ANON_KINDS = {
    "[eventfd]": FdKind.EVENTFD,
    "[eventpoll]": FdKind.EPOLL,
    "[timerfd]": FdKind.TIMERFD,
    "[signalfd]": FdKind.SIGNALFD,
    "inotify": FdKind.INOTIFY,
    "[fanotify]": FdKind.FANOTIFY,
    "[io_uring]": FdKind.IO_URING,
    "[userfaultfd]": FdKind.USERFAULTFD,
    "[pidfd]": FdKind.PIDFD,
    "[perf_event]": FdKind.PERF_EVENT,
}
_NS_PREFIXES = ("mnt:", "net:", "pid:", "user:", "uts:", "ipc:", "cgroup:", "time:")

# Kinds the restore side recreates (regular files and directories by path,
# the stdio terminal/pipe of a shell job, character devices like /dev/null).
RESTORABLE_KINDS = frozenset({
    FdKind.REGULAR, FdKind.DIRECTORY, FdKind.CHARDEV, FdKind.TTY,
    FdKind.PTY_SLAVE, FdKind.PTY_MASTER, FdKind.PIPE, FdKind.FIFO, FdKind.PATH,
}) | ANON_FD_KINDS | {FdKind.EPOLL}


def classify_fd(link: str, st: os.stat_result | None, flags: int, fstype: str = "") -> FdKind:
    """The kind of an fd from its /proc/PID/fd link, its stat and its open flags."""
    if link.startswith("pipe:["):
        return FdKind.PIPE
    if link.startswith("socket:["):
        return FdKind.SOCKET
    if link.startswith("anon_inode:"):
        name = link[len("anon_inode:"):]
        if name.startswith("bpf"):
            return FdKind.BPF
        return _ANON_KINDS.get(name, FdKind.ANON_INODE)
    if link.startswith("pidfd:"):
        return FdKind.PIDFD
    if link.startswith(_NS_PREFIXES):
        return FdKind.NSFS
    if link.startswith("/memfd:"):
        return FdKind.MEMFD
    if flags & O_PATH:
        return FdKind.PATH
    if fstype == "mqueue":
        return FdKind.MQUEUE
    if st is None:
        return FdKind.UNKNOWN
    mode = st.st_mode
    if _stat.S_ISREG(mode):
        return FdKind.REGULAR
    if _stat.S_ISDIR(mode):
        return FdKind.DIRECTORY
    if _stat.S_ISFIFO(mode):
        return FdKind.FIFO
    if _stat.S_ISSOCK(mode):
        return FdKind.SOCKET
    if _stat.S_ISBLK(mode):
        return FdKind.BLOCKDEV
    if _stat.S_ISCHR(mode):
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        if major == 5 and minor == 2 or link.endswith("/ptmx"):
            return FdKind.PTY_MASTER
        if 136 <= major <= 143:
            return FdKind.PTY_SLAVE
        if major == 4 or (major == 5 and minor in (0, 1)):
            return FdKind.TTY
        return FdKind.CHARDEV
    return FdKind.UNKNOWN


def _socket_details(pid: int, fd: int) -> list[tuple[str, str]]:
    """Family, type, protocol and addresses of a socket fd, from a copy of it (pidfd_getfd)."""
    out: list[tuple[str, str]] = []
    try:
        copy = pidfd_getfd(pid, fd)
    except PtckptError:
        return out
    try:
        sock = socket.socket(fileno=copy)
    except OSError:
        os.close(copy)
        return out
    try:
        out.append(("family", sock.family.name if hasattr(sock.family, "name") else str(sock.family)))
        out.append(("type", sock.type.name if hasattr(sock.type, "name") else str(sock.type)))
        out.append(("protocol", str(sock.proto)))
        for key, getter in (("local", sock.getsockname), ("peer", sock.getpeername)):
            with contextlib.suppress(OSError):
                addr = getter()
                out.append((key, addr if isinstance(addr, str) else repr(addr)))
        with contextlib.suppress(OSError):
            out.append(("listening", str(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))))
    finally:
        sock.detach()
        os.close(copy)
    return out


def _mount_fstypes(pid: int) -> dict[int, str]:
    """mnt_id -> filesystem type from /proc/PID/mountinfo (man 5 proc: field 1 and after ' - ')."""
    out: dict[int, str] = {}
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/mountinfo", "rb") as f:
            for line in f:
                left, _, right = line.partition(b" - ")
                out[int(left.split(b" ", 1)[0])] = os.fsdecode(right.split(b" ", 1)[0])
    return out


def dump_fds(pid: int) -> list[Fd]:
    """Every open fd of `pid` (works on a running or a frozen process)."""
    fstypes = _mount_fstypes(pid)
    ctty = _controlling_tty(pid)
    out: list[Fd] = []
    for fd in procfs.list_fds(pid):
        try:
            link = procfs.readlink_fd(pid, fd)
            info = procfs.read_fdinfo(pid, fd)
        except procfs.FdGone:
            continue
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            st = None
        kind = classify_fd(link, st, info.flags, fstypes.get(info.mnt_id, ""))
        if kind is FdKind.REGULAR and info.mnt_id not in fstypes and is_mqueue(pid, fd):
            kind = FdKind.MQUEUE          # mq_open()'s internal mount is in no mountinfo
        details = [(k, v.strip()) for k, values in info.extra.items() for v in values]
        if kind is FdKind.SOCKET:
            details.extend(_socket_details(pid, fd))
        if kind in TTY_KINDS and st is not None and st.st_rdev == ctty:
            details.append(CONTROLLING_TTY)
        out.append(Fd(
            fd=fd,
            kind=kind,
            path=link,
            flags=info.flags,
            pos=info.pos,
            cloexec=bool(info.flags & O_CLOEXEC),
            mnt_id=info.mnt_id,
            dev=st.st_dev if st else 0,
            ino=st.st_ino if st else info.ino,
            mode=st.st_mode if st else 0,
            rdev=st.st_rdev if st else 0,
            size=st.st_size if st else 0,
            mtime_ns=st.st_mtime_ns if st else 0,
            details=tuple(details),
        ))
    return out


# An fd on the process's controlling terminal is marked so (a detail), and a restore
# opens /dev/tty for it in the restored process: its controlling terminal there.
TTY_KINDS = frozenset({FdKind.TTY, FdKind.PTY_SLAVE})
CONTROLLING_TTY = ("tty", "controlling")
CTTY_PATH = "/dev/tty"


def _controlling_tty(pid: int) -> int:
    """st_rdev of the controlling terminal of `pid` (/proc/PID/stat tty_nr), 0 for none."""
    try:
        tty_nr = procfs.read_stat(pid).tty_nr
    except PtckptError:
        return 0
    if not tty_nr:
        return 0
    major = (tty_nr >> 8) & 0xFFF
    minor = (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00)
    return os.makedev(major, minor)


def is_controlling_tty(f: Fd) -> bool:
    """fd `f` was on its process's controlling terminal (restored by opening /dev/tty)."""
    return f.kind in TTY_KINDS and CONTROLLING_TTY in f.details


def number_descriptions(fds: dict[int, list[Fd]]) -> dict[int, list[Fd]]:
    """The same fds with `desc` set: one number (from 1) per open file description in the tree.

    Only fds of one file (st_dev, st_ino) can share a description, so kcmp(2)
    compares each fd with the descriptions already seen for its file.
    """
    seen: dict[tuple[int, int, str], list[tuple[int, int, int]]] = {}   # file -> [(pid, fd, desc)]
    count = 0
    out: dict[int, list[Fd]] = {}
    for pid, flist in fds.items():
        out[pid] = []
        for f in flist:
            key = (f.dev, f.ino, f.path if not f.ino else "")
            reps = seen.setdefault(key, [])
            desc = next((d for p, n, d in reps if same_open_file(p, n, pid, f.fd)), 0)
            if not desc:
                count += 1
                desc = count
                reps.append((pid, f.fd, desc))
            out[pid].append(dataclasses.replace(f, desc=desc))
    return out


DELETED = " (deleted)"
GHOST_LIMIT = 64 << 20          # bytes of one deleted file the image takes at most


def ghost_key(what: Fd | Vma) -> tuple[str, int, int] | None:
    """("ghost", st_dev, st_ino) of a deleted regular file an fd or a file mapping refers to."""
    if isinstance(what, Fd):
        if what.kind is FdKind.REGULAR and what.path.endswith(DELETED):
            return ("ghost", what.dev, what.ino)
        return None
    if (what.file_deleted and what.kind in (VmaKind.FILE_PRIVATE, VmaKind.FILE_SHARED)
            and what.path.startswith("/") and not what.path.startswith(("/memfd:", "/SYSV", "/dev/zero"))):
        return ("ghost", os.makedev(what.dev_major, what.dev_minor), what.inode)
    return None


def dump_ghost_files(fds: dict[int, list[Fd]], vmas: dict[int, list[Vma]]) -> list[GhostFile]:
    """The contents of every deleted file the tree holds open or mapped (once per file)."""
    out: dict[tuple, GhostFile] = {}
    for pid, flist in fds.items():
        for f in flist:
            key = ghost_key(f)
            if key and key not in out:
                out[key] = _read_ghost(pid, f"/proc/{pid}/fd/{f.fd}", f.path, f"fd {f.fd}")
    for pid, vlist in vmas.items():
        for v in vlist:
            key = ghost_key(v)
            if key and key not in out:
                out[key] = _read_ghost(pid, f"/proc/{pid}/map_files/{v.start:x}-{v.end:x}", v.path,
                                       f"mapping {v.start:#x}-{v.end:#x}")
    return list(out.values())


def _read_ghost(pid: int, link: str, path: str, what: str) -> GhostFile:
    try:
        fd = os.open(link, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise UnsupportedResource(pid, f"{what} -> {path}: the deleted file cannot be read "
                                       f"({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_size > GHOST_LIMIT:
            raise UnsupportedResource(pid, f"{what} -> {path}: a deleted file of {st.st_size} bytes "
                                           f"(the image takes {GHOST_LIMIT >> 20} MiB at most)")
        chunks, size = [], st.st_size
        while size > 0:
            chunk = os.read(fd, min(size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size -= len(chunk)
    finally:
        os.close(fd)
    return GhostFile(dev=st.st_dev, ino=st.st_ino, path=path.removesuffix(DELETED), mode=st.st_mode,
                     uid=st.st_uid, gid=st.st_gid, data=b"".join(chunks))


def is_unix(f: Fd) -> bool:
    """An AF_UNIX socket (its family comes from the dump's socket details)."""
    return f.kind is FdKind.SOCKET and ("family", "AF_UNIX") in f.details


def restorable_socket(f: Fd) -> bool:
    """A socket of a family and type a restore makes again: unix, TCP and UDP over IPv4 and
    IPv6, netlink (its family, type and protocol come from the dump's socket details)."""
    d = dict(f.details)
    family, kind, proto = d.get("family", ""), d.get("type", ""), d.get("protocol", "")
    if family in ("AF_UNIX", "AF_NETLINK"):
        return True
    return family in ("AF_INET", "AF_INET6") and (kind, proto) in (
        ("SOCK_STREAM", "0"), ("SOCK_STREAM", "6"), ("SOCK_DGRAM", "0"), ("SOCK_DGRAM", "17"))


def unsupported_fds(fds: list[Fd], exempt: set[int] = frozenset()) -> list[str]:
    """'fd 7 -> anon_inode:[io_uring] (io_uring)' for each fd no restore can make again
    (descriptions in `exempt` are the shell job's stdio)."""
    out = []
    for f in fds:
        if f.desc in exempt:
            continue
        if f.kind is FdKind.PTY_SLAVE and not is_controlling_tty(f):
            out.append(f"fd {f.fd} -> {f.path} (a pty slave whose master is outside the tree, not the "
                       f"process's controlling terminal nor the stdio of the tree's root: dump the "
                       f"process holding its master too)")
            continue
        if f.kind in RESTORABLE_KINDS:
            continue
        if f.kind is FdKind.SOCKET:
            if restorable_socket(f):
                continue
            d = dict(f.details)
            family, kind = d.get("family", "an unknown family"), d.get("type", "")
            noun = ("a packet socket" if family == "AF_PACKET" else "a raw socket" if kind == "SOCK_RAW"
                    else "a socket of this family and type")
            proto = f", protocol {d['protocol']}" if d.get("protocol") not in (None, "0") else ""
            out.append(f"fd {f.fd} -> {f.path} ({noun}: {family} {kind}{proto})")
            continue
        out.append(f"fd {f.fd} -> {f.path} ({f.kind.name.lower()})")
    return out


# --- restore half ------------------------------------------------------------

O_CREAT, O_EXCL, O_TRUNC, O_NOCTTY = 0o100, 0o200, 0o1000, 0o400
F_GETFD = 1
AT_FDCWD = -100 & (2**64 - 1)
STDIO_KINDS = frozenset({FdKind.TTY, FdKind.PTY_SLAVE, FdKind.PTY_MASTER, FdKind.PIPE,
                         FdKind.SOCKET})
BY_PATH_KINDS = frozenset({FdKind.REGULAR, FdKind.DIRECTORY, FdKind.CHARDEV, FdKind.PATH,
                           FdKind.FIFO})
O_NONBLOCK = 0o4000
F_SETFL = 4


def restore_plan_problems(fds: list[Fd], handed: Mapping[int, int] = {}) -> list[str]:
    """Fds this version cannot recreate, as 'fd N -> target (kind)' (checked before anything starts).

    `handed` are the descriptions ptckpt opens itself (pipes, sockets, shared files).
    fds 0-2 that were a terminal, pipe or socket are shell-job stdio: they get
    ptckpt restore's own.  Everything else must be reopened by path.
    """
    out = []
    for f in fds:
        if f.skipped or f.external or f.desc in handed or f.fd <= 2 and f.kind in STDIO_KINDS:
            continue
        if f.kind in BY_PATH_KINDS and f.path.endswith(" (deleted)"):
            out.append(f"fd {f.fd} -> {f.path} (a deleted file; ghost files are not restored yet)")
            continue
        if (f.kind in BY_PATH_KINDS or is_controlling_tty(f)
                or (f.kind is FdKind.TTY and f.path.startswith("/dev/"))):
            continue
        out.append(f"fd {f.fd} -> {f.path} ({f.kind.name.lower()})")
    return out


def open_description(f: Fd, path: str | None = None) -> int:
    """Open, in ptckpt, the file description an fd had: its path (or `path`), flags and offset."""
    flags = f.flags & ~(O_CREAT | O_EXCL | O_TRUNC) | O_NOCTTY | O_CLOEXEC
    try:
        fd = os.open(path or f.path, flags)
    except OSError as err:
        raise RestoreFailed(f"cannot reopen {f.path} (fd {f.fd}): {err.strerror}") from None
    if f.kind in (FdKind.REGULAR, FdKind.DIRECTORY) and f.pos:
        os.lseek(fd, f.pos, os.SEEK_SET)
    return fd


def create_ghost_files(ghosts: list[GhostFile]) -> dict[tuple, str]:
    """Make each deleted file again, with its bytes, mode and owner, where it was (or beside it
    when that name is taken now): {ghost_key: path}.  The caller opens what it needs, then
    unlinks them all (remove_ghost_files), so they are deleted-but-open again."""
    out: dict[tuple, str] = {}
    try:
        for n, g in enumerate(ghosts):
            path = g.path
            for attempt in range(100):
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, g.mode & 0o7777)
                    break
                except FileExistsError:
                    path = f"{g.path}.ptckpt-ghost-{os.getpid()}-{n}-{attempt}"
                except OSError as err:
                    raise RestoreFailed(f"cannot recreate the deleted file {g.path}: {err.strerror}") from None
            else:
                raise RestoreFailed(f"cannot recreate the deleted file {g.path}: every name is taken")
            out[("ghost", g.dev, g.ino)] = path
            _fill_file(fd, g)
    except BaseException:
        remove_ghost_files(out)
        raise
    return out


def dump_saved_files(pid_of: dict[str, int], patterns) -> list[SavedFile]:
    """dump --save-file: the contents of each file of the tree (open or mapped) whose path
    matches one of `patterns` ({path: a pid that holds it})."""
    out = []
    for path, pid in sorted(pid_of.items()):
        if any(path_matches(p, path) for p in patterns):
            g = _read_ghost(pid, path, path, f"--save-file {path}")
            st = os.stat(path)
            out.append(SavedFile(path=path, mode=g.mode, uid=g.uid, gid=g.gid, mtime_ns=st.st_mtime_ns,
                                 data=g.data))
    return out


def put_back_saved_files(saved: list[SavedFile]) -> None:
    """Write each saved file back (contents, mode, owner, mtime) before anything reopens it."""
    for s in saved:
        try:
            _fill_file(os.open(s.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_CLOEXEC, s.mode & 0o7777), s)
            os.utime(s.path, ns=(s.mtime_ns, s.mtime_ns))
        except OSError as err:
            raise RestoreFailed(f"cannot put back the saved file {s.path}: {err.strerror}") from None


def _fill_file(fd: int, what: GhostFile | SavedFile) -> None:
    """Write a recorded file's bytes, mode and owner into `fd`, then close it."""
    try:
        view = memoryview(what.data)
        while view:
            view = view[os.write(fd, view):]
        os.fchmod(fd, what.mode & 0o7777)
        with contextlib.suppress(OSError):
            os.fchown(fd, what.uid, what.gid)
    finally:
        os.close(fd)


def remove_ghost_files(paths: dict[tuple, str]) -> None:
    for path in paths.values():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def restore_fds_frozen(remote, fds: list[Fd], inherited: list[int], handed: Mapping[int, int] = {}, *,
                       extra: list[tuple[int, int]] = (), keep: set[int] = frozenset()) -> None:
    """Install every fd at its number: files by path at their offset, stdio from ptckpt restore.

    `handed` maps descriptions ptckpt opened to the fd number the stub
    inherited them at: those are dup3()ed into place.  `inherited` are the fds
    the stub has (ptckpt restore's stdio and the handed ones); those the image
    does not have are closed (but those in `keep`).  `extra` are (inherited fd, number)
    pairs to dup3() too: fds plugins give.  Skipped and external fds are not reopened.
    """
    wanted = {f.fd for f in fds if not f.skipped and not f.external} | {n for _src, n in extra}
    for f in fds:
        if f.desc in handed and not f.skipped and not f.external:
            remote.checked("dup3", handed[f.desc], f.fd, O_CLOEXEC if f.cloexec else 0,
                           step=f"install fd {f.fd} ({f.path})")
    cloexec = {f.fd: f.cloexec for f in fds}         # a plugin's fd in place of the image's keeps its flag
    for src, number in extra:
        remote.checked("dup3", src, number, O_CLOEXEC if cloexec.get(number) else 0,
                       step=f"install fd {number} (given by a plugin)")
    for fd in inherited:
        if fd not in wanted and fd not in keep:
            remote.checked("close", fd, step=f"close inherited fd {fd}")
    for f in sorted(fds, key=lambda f: f.fd):
        if f.desc in handed or f.skipped or f.external:   # skipped: dump --skip-file, left closed
            continue
        if f.fd <= 2 and f.kind in STDIO_KINDS:
            if f.fd not in inherited:
                raise RestoreFailed(f"fd {f.fd} was {f.path} ({f.kind.name.lower()}) and ptckpt "
                                    f"restore has no fd {f.fd} of its own to give it")
            if not f.cloexec:
                continue
            remote.checked("fcntl", f.fd, 2, 1, step=f"set FD_CLOEXEC on fd {f.fd}")   # F_SETFD
            continue
        flags = f.flags & ~(O_CREAT | O_EXCL | O_TRUNC | O_CLOEXEC) | O_NOCTTY
        path = CTTY_PATH if is_controlling_tty(f) else f.path
        step = f"reopen fd {f.fd} ({path})"
        # A FIFO is opened non-blocking (a blocking open would wait for the other end
        # inside the injected syscall), then gets its own flags back.
        open_flags = flags | O_NONBLOCK if f.kind is FdKind.FIFO else flags
        with remote.scratch(os.fsencode(path) + b"\0") as p:
            got = remote.checked("openat", AT_FDCWD, int(p), open_flags | (O_CLOEXEC if f.cloexec else 0),
                                 0, step=step)
        if open_flags != flags:
            remote.checked("fcntl", got, F_SETFL, flags, step=step)
        if got != f.fd:
            remote.checked("dup3", got, f.fd, O_CLOEXEC if f.cloexec else 0, step=step)
            remote.checked("close", got, step=step)
        if f.kind in (FdKind.REGULAR, FdKind.DIRECTORY) and f.pos:
            remote.checked("lseek", f.fd, f.pos, 0, step=step)

