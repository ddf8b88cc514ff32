"""File descriptors: what each fd of a process is, with enough detail to reopen it.

Dump half: :func:`dump_fds`.  Kinds are decided by :func:`classify_fd` from
the /proc/PID/fd link text and the stat of the open file; the table of kinds
(ptckpt.kinds) says which kinds the restore side can recreate, and
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
import fcntl
import os
import socket
import stat as _stat
import struct
from collections.abc import Mapping, Sequence

from .. import kinds, procfs
from ..errors import PtckptError, RestoreFailed, UnsupportedResource
from ..formats.model import Fd, FdKind, FdOwner, GhostFile, ProcessImage, SavedFile, Task, Vma, VmaKind
from ..tracee import compat_openat, pidfd_getfd, same_open_file
from .fhandles import file_handle, open_file_handle
from .mqueue import is_mqueue
from . import filepolicy, nsfs
from .filepolicy import path_matches

O_PATH = 0o10000000
O_CLOEXEC = 0o2000000

_NS_PREFIXES = ("mnt:", "net:", "pid:", "user:", "uts:", "ipc:", "cgroup:", "time:")

# Kinds the restore side recreates (ptckpt.kinds, the table of every kind): sockets are
# judged by family, type and protocol (restorable_socket), namespace files by nsfs.
RESTORABLE_KINDS = frozenset(k for k, row in kinds.FD.items() if row.restored) - {FdKind.SOCKET, FdKind.NSFS}


def classify_fd(link: str, st: os.stat_result | None, flags: int, fstype: str = "") -> FdKind:
    """The kind of an fd from its /proc/PID/fd link, its stat and its open flags."""
    if link.startswith("pipe:["):
        return FdKind.PIPE
    if link.startswith("socket:["):
        return FdKind.SOCKET
    if link.startswith("anon_inode:"):
        return kinds.anon_inode_kind(link[len("anon_inode:"):])
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
    if fstype == "nsfs":              # opened through a bind mount: the link is its path
        return FdKind.NSFS
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


def dump_fds(pid: int) -> list[Fd]:
    """Every open fd of `pid` (works on a running or a frozen process)."""
    fstypes = procfs.mount_fstypes(pid)
    ctty = _controlling_tty(pid)
    return [f for f in (dump_fd(pid, fd, fstypes, ctty) for fd in procfs.list_fds(pid)) if f is not None]


def dump_fd(pid: int, fd: int, fstypes: Mapping[int, str] | None = None, ctty: int | None = None) -> Fd | None:
    """One open fd of `pid` (None: it was closed meanwhile); `ctty`: st_rdev of its
    controlling terminal (0: none; None: read it)."""
    if fstypes is None:
        fstypes = procfs.mount_fstypes(pid)
    if ctty is None:
        ctty = _controlling_tty(pid)
    try:
        link = procfs.readlink_fd(pid, fd)
        info = procfs.read_fdinfo(pid, fd)
    except procfs.FdGone:
        return None
    try:
        st = procfs.stat_fd(pid, fd)
    except (OSError, PtckptError):
        st = None
    kind = classify_fd(link, st, info.flags, fstypes.get(info.mnt_id, ""))
    if kind is FdKind.REGULAR and info.mnt_id not in fstypes and is_mqueue(pid, fd):
        kind = FdKind.MQUEUE          # mq_open()'s internal mount is in no mountinfo
    details = [(k, v.strip()) for k, values in info.extra.items() for v in values]
    if kind is FdKind.SOCKET:
        details.extend(_socket_details(pid, fd))
    elif kind is FdKind.NSFS:
        details.extend(nsfs.dump_details(pid, fd, link, st))
    if kind in TTY_KINDS and st is not None and st.st_rdev == ctty:
        details.append(CONTROLLING_TTY)
    return Fd(
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
        append_hash=(filepolicy.head_hash(f"/proc/{pid}/fd/{fd}", st.st_size)
                     if kind is FdKind.REGULAR and st is not None and info.flags & os.O_APPEND
                     and not link.endswith(DELETED) else 0),
    )


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
    """("ghost", st_dev, st_ino) of a deleted file an fd or a file mapping refers to: a
    regular file or directory, a device node opened, or anything an O_PATH fd holds (a
    symbolic link, FIFO or socket too)."""
    if isinstance(what, Fd):
        if what.path.endswith(DELETED) and what.kind in (FdKind.REGULAR, FdKind.DIRECTORY, FdKind.PATH,
                                                         FdKind.CHARDEV, FdKind.BLOCKDEV):
            return ("ghost", what.dev, what.ino)
        return None
    # A deleted POSIX shared memory object (shm_open, then shm_unlink: MPI's pattern) mapped
    # MAP_SHARED shows as shmem: a file of /dev/shm all the same, made again like any other.
    if (what.file_deleted and (what.kind in (VmaKind.FILE_PRIVATE, VmaKind.FILE_SHARED)
                               or what.kind is VmaKind.SHMEM and what.path.startswith("/dev/shm/"))
            and what.path.startswith("/") and not what.path.startswith(("/memfd:", "/SYSV", "/dev/zero"))
            and what.path != "/[aio]"):                   # an AIO ring: resources/aio.py
        return ("ghost", os.makedev(what.dev_major, what.dev_minor), what.inode)
    return None


_ENDED = ("a directory or file of process {pid} in /proc, and that process has ended (it reads "
          "ESRCH): no restore can open it again; leave it (chdir, close) before the dump")


def ended_process_file(path: str) -> int:
    """The pid of /proc/PID/... in `path` (an fd's or a cwd's link text) when that process
    has ended, else 0."""
    parts = path.removesuffix(DELETED).split("/")
    if len(parts) < 3 or parts[1] != "proc" or not parts[2].isdigit():
        return 0
    return 0 if procfs.pid_exists(parts[2]) else int(parts[2])


def ghost_dir_key(path: str) -> tuple[str, str] | None:
    """("ghost-dir", where it was) of a cwd or root that was removed (its /proc link text)."""
    return ("ghost-dir", path.removesuffix(DELETED)) if path.endswith(DELETED) else None


def dump_ghost_files(fds: dict[int, list[Fd]], vmas: dict[int, list[Vma]],
                     tasks: Mapping[int, Task] = {}) -> list[GhostFile]:
    """The contents of every deleted file the tree holds open or mapped, and every deleted
    directory it holds open or as cwd or root (once per file)."""
    out: dict[tuple, GhostFile] = {}
    dirs: dict[str, GhostFile] = {}
    for pid, task in tasks.items():
        for what, path in (("cwd", task.cwd), ("root", task.root)):
            if not ghost_dir_key(path):
                continue
            if ended := ended_process_file(path):
                raise UnsupportedResource(pid, f"{what} -> {path}: " + _ENDED.format(pid=ended))
            g = _read_ghost(pid, f"/proc/{pid}/{what}", path, what)
            other = dirs.setdefault(g.path, g)
            if (other.dev, other.ino) != (g.dev, g.ino):
                raise UnsupportedResource(pid, f"{what} -> {path}: two deleted directories of one name "
                                               f"are cwd or root in the tree (not supported)")
            out.setdefault(("ghost", g.dev, g.ino), g)
    for pid, flist in fds.items():
        for f in flist:
            key = ghost_key(f)
            if key and key not in out:
                out[key] = _read_ghost(pid, f"/proc/{pid}/fd/{f.fd}", f.path, f"fd {f.fd}")
    for pid, vlist in vmas.items():
        for v in vlist:
            key = ghost_key(v)
            if key and key not in out:
                link = procfs.map_file_path(pid, v.start, v.end, (v.dev_major, v.dev_minor), v.inode, v.path)
                out[key] = _read_ghost(pid, link, v.path,
                                       f"mapping {v.start:#x}-{v.end:#x}")
    return list(out.values())


def _read_ghost(pid: int, link: str, path: str, what: str) -> GhostFile:
    """A deleted file's (or directory's) identity, mode, owner, times, size and the bytes
    of its data extents, through a /proc link to it.  Holes stay holes: only the extents
    SEEK_DATA/SEEK_HOLE find are read.  A device node, FIFO, socket or symbolic link is
    not opened (a device's open has effects of its own): _special_ghost."""
    try:
        st = os.stat(link)
    except OSError as err:
        raise UnsupportedResource(pid, f"{what} -> {path}: the deleted file cannot be read "
                                       f"({err.strerror})") from None
    if not (_stat.S_ISREG(st.st_mode) or _stat.S_ISDIR(st.st_mode)):
        return _special_ghost(pid, link, st, path, what)
    try:
        fd = os.open(link, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise UnsupportedResource(pid, f"{what} -> {path}: the deleted file cannot be read "
                                       f"({err.strerror})") from None
    try:
        st = os.fstat(fd)
        if st.st_nlink and _stat.S_ISREG(st.st_mode) and path.endswith(DELETED):
            return _linked_ghost(pid, fd, st, path, what)
        extents = data_extents(fd, st.st_size) if _stat.S_ISREG(st.st_mode) else []
        stored = sum(length for _off, length in extents)
        if stored > GHOST_LIMIT:
            raise UnsupportedResource(pid, f"{what} -> {path}: a deleted file of {stored} bytes of data "
                                           f"(the image takes {GHOST_LIMIT >> 20} MiB at most)")
        chunks = [os.pread(fd, length, off) for off, length in extents]
        extents = [(off, len(c)) for (off, _n), c in zip(extents, chunks)]   # a file shrinking now
        xattrs = _xattrs(fd)
    finally:
        os.close(fd)
    return GhostFile(dev=st.st_dev, ino=st.st_ino, path=path.removesuffix(DELETED), mode=st.st_mode,
                     uid=st.st_uid, gid=st.st_gid, data=b"".join(chunks), mtime_ns=st.st_mtime_ns,
                     atime_ns=st.st_atime_ns, size=st.st_size, extents=tuple(extents), xattrs=xattrs)


def _xattrs(fd: int) -> tuple[tuple[str, bytes], ...]:
    """(name, value) of each extended attribute of an open file (none where unsupported)."""
    try:
        names = os.listxattr(fd)
    except OSError:
        return ()
    out = []
    for name in sorted(names):
        with contextlib.suppress(OSError):             # removed meanwhile
            out.append((name, os.getxattr(fd, name)))
    return tuple(out)


def _special_ghost(pid: int, link: str, st: os.stat_result, path: str, what: str) -> GhostFile:
    """What a deleted device node, FIFO, socket or symbolic link was, to be made again with
    mknod(2), mkfifo(3) or symlink(2): its type and permissions, owner, times, a device's
    numbers, a link's target (read through a copy of the fd: readlinkat(fd, ""))."""
    if (_stat.S_ISCHR(st.st_mode) or _stat.S_ISBLK(st.st_mode)) and not can_make_devices():
        raise UnsupportedResource(pid, f"{what} -> {path}: a deleted device node; a restore makes it "
                                       f"again with mknod, which needs CAP_MKNOD", way_out="dump and "
                                       "restore as root, or close it before the dump")
    target = ""
    if _stat.S_ISLNK(st.st_mode):
        fd = pidfd_getfd(pid, int(link.rsplit("/", 1)[1]))
        try:
            target = os.readlink("", dir_fd=fd)
        except OSError as err:
            raise UnsupportedResource(pid, f"{what} -> {path}: the deleted symbolic link cannot be read "
                                           f"({err.strerror})") from None
        finally:
            os.close(fd)
    return GhostFile(dev=st.st_dev, ino=st.st_ino, path=path.removesuffix(DELETED), mode=st.st_mode,
                     uid=st.st_uid, gid=st.st_gid, data=b"", mtime_ns=st.st_mtime_ns,
                     atime_ns=st.st_atime_ns, rdev=st.st_rdev, target=target)


CAP_MKNOD = 27


def can_make_devices() -> bool:
    """mknod(2) of a device node needs CAP_MKNOD (in the initial user namespace)."""
    return procfs.capable_in_initial_ns(CAP_MKNOD)


def _linked_ghost(pid: int, fd: int, st: os.stat_result, path: str, what: str) -> GhostFile:
    """A name deleted while the file has other links: its file handle, so that the restore
    opens that very file again (a copy would part from the other names)."""
    handle = file_handle(fd)
    if not handle:
        raise UnsupportedResource(pid, f"{what} -> {path}: a deleted name of a file with {st.st_nlink} "
                                       f"other link(s), on a file system that gives no file handle")
    return GhostFile(dev=st.st_dev, ino=st.st_ino, path=path.removesuffix(DELETED), mode=st.st_mode,
                     uid=st.st_uid, gid=st.st_gid, data=b"", mtime_ns=st.st_mtime_ns, atime_ns=st.st_atime_ns,
                     size=st.st_size, handle=handle)


def data_extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of each data extent of a file (lseek(2) SEEK_DATA / SEEK_HOLE; a
    filesystem without them reports the whole file as data)."""
    out, pos = [], 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:                          # ENXIO: only a hole is left
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end > start:
            out.append((start, end - start))
        pos = end
    return out


def _whole(g: GhostFile) -> bytes:
    """A recorded file's contents as one string of bytes, holes as zeros."""
    if not g.extents:
        return g.data
    buf, at = bytearray(g.size), 0
    for off, length in g.extents:
        buf[off:off + length] = g.data[at:at + length]
        at += length
    return bytes(buf)


def is_unix(f: Fd) -> bool:
    """An AF_UNIX socket (its family comes from the dump's socket details)."""
    return f.kind is FdKind.SOCKET and ("family", "AF_UNIX") in f.details


def restorable_socket(f: Fd) -> bool:
    """A socket of a family, type and protocol a restore makes again (ptckpt.kinds.SOCKETS;
    they come from the dump's socket details)."""
    return _socket_row(f).restored


def _socket_row(f: Fd) -> kinds.Kind:
    d = dict(f.details)
    return kinds.socket_kind(d.get("family", ""), d.get("type", ""), d.get("protocol", ""))


def unsupported_fds(fds: list[Fd], exempt: set[int] = frozenset()) -> list[str]:
    """'fd 7 -> anon_inode:[io_uring] (io_uring)' for each fd no restore can make again
    (descriptions in `exempt` are the shell job's stdio)."""
    out = []
    for f in fds:
        if f.desc in exempt:
            continue
        if f.kind is FdKind.TTY and f.path.endswith(DELETED):
            out.append(f"fd {f.fd} -> {f.path} (a deleted terminal device node: not supported; close it "
                       f"before the dump)")
        if ended := ended_process_file(f.path):
            out.append(f"fd {f.fd} -> {f.path} ({_ENDED.format(pid=ended)})")
            continue
        if f.kind is FdKind.PTY_SLAVE and not is_controlling_tty(f):
            out.append(f"fd {f.fd} -> {f.path} (a pty slave whose master is outside the tree, not the "
                       f"process's controlling terminal nor the stdio of the tree's root: dump the "
                       f"process holding its master too)")
            continue
        if f.kind in RESTORABLE_KINDS:
            continue
        if f.kind is FdKind.NSFS:
            why = nsfs.refusal(f)
            if why:
                out.append(why)
            continue
        if f.kind is FdKind.SOCKET:
            if restorable_socket(f):
                continue
            d = dict(f.details)
            family, kind = d.get("family", "an unknown family"), d.get("type", "")
            proto = f", protocol {d['protocol']}" if d.get("protocol") not in (None, "0") else ""
            out.append(f"fd {f.fd} -> {f.path} ({_socket_row(f).refusal}: {family} {kind}{proto})")
            continue
        row = kinds.FD.get(f.kind)
        why = row.refusal.format(fd=f.fd) if row is not None else "a kind this ptckpt does not know"
        out.append(f"fd {f.fd} -> {f.path} ({f.kind.name.lower()}: {why})")
    return out


# --- fd owners (F_SETOWN_EX, F_SETSIG, O_ASYNC) -------------------------------------

F_SETOWN_EX, F_GETOWN_EX, F_SETSIG, F_GETSIG = 15, 16, 10, 11
F_OWNER_TID, F_OWNER_PID, F_OWNER_PGRP = 0, 1, 2
O_ASYNC = 0o20000
_OWNER_KINDS = {F_OWNER_TID: "thread", F_OWNER_PID: "process", F_OWNER_PGRP: "process group"}


def dump_owners(pid: int, fds: list[Fd]) -> list[FdOwner]:
    """The owner (F_GETOWN_EX) and signal (F_GETSIG) of each fd that has one, read through a
    copy of the fd (pidfd_getfd: the same open file description, which holds them).  The
    pids are as ptckpt sees them."""
    out = []
    for f in fds:
        if f.kind in (FdKind.NSFS, FdKind.UNKNOWN) or f.external:
            continue
        try:
            copy = pidfd_getfd(pid, f.fd)
        except PtckptError:
            continue
        try:
            kind, who = struct.unpack("ii", fcntl.fcntl(copy, F_GETOWN_EX, bytes(8)))
            signo = fcntl.fcntl(copy, F_GETSIG)
        except OSError:
            continue
        finally:
            os.close(copy)
        if who or signo:
            out.append(FdOwner(fd=f.fd, owner_type=kind, pid=who, signo=signo))
    return out


def owners_outside(pid: int, owners: list[FdOwner], tree: Mapping[int, list[int]], pgids: set[int]) -> list[str]:
    """'fd N: its SIGIO owner (process 77, F_SETOWN) is outside the dumped tree ...' for each
    owner a restore cannot name again (`tree`: each member's pid -> its tids, `pgids`: the
    tree's groups).  A thread of another member is not made yet when this one's owners are
    set, so only its leader may be named."""
    out = []
    for o in owners:
        if not o.pid:
            continue
        ok = (o.pid in pgids if o.owner_type == F_OWNER_PGRP
              else o.pid in tree or o.pid in tree.get(pid, ()) if o.owner_type == F_OWNER_TID
              else o.pid in tree)
        if not ok:
            out.append(f"fd {o.fd}: its SIGIO owner ({_OWNER_KINDS.get(o.owner_type, o.owner_type)} {o.pid}, "
                       f"F_SETOWN) is outside the dumped tree; set it to a member, or none, before the dump")
    return out


def restore_owners_frozen(remote, fds: list[Fd], owners: list[FdOwner]) -> None:
    """F_SETOWN_EX and F_SETSIG on each fd that had them (pids as the restored tree sees
    them), and O_ASYNC, which open(2) ignores, on each fd that had it."""
    for o in owners:                      # (none on the shell job's stdio: see the dump)
        step = f"owner of fd {o.fd}"
        if o.pid:
            with remote.scratch(struct.pack("ii", o.owner_type, o.pid)) as p:
                remote.checked("fcntl", o.fd, F_SETOWN_EX, int(p), step=step)
        if o.signo:
            remote.checked("fcntl", o.fd, F_SETSIG, o.signo, step=step)
    for f in fds:
        if f.flags & O_ASYNC and not f.skipped and not f.external and not (f.fd <= 2 and f.kind in STDIO_KINDS):
            step = f"O_ASYNC on fd {f.fd}"
            remote.checked("fcntl", f.fd, F_SETFL, remote.checked("fcntl", f.fd, F_GETFL, step=step) | O_ASYNC,
                           step=step)


# --- restore half ------------------------------------------------------------

O_CREAT, O_EXCL, O_TRUNC, O_NOCTTY = 0o100, 0o200, 0o1000, 0o400
F_GETFD = 1
F_GETFL = 3
AT_FDCWD = -100 & (2**64 - 1)
STDIO_KINDS = frozenset({FdKind.TTY, FdKind.PTY_SLAVE, FdKind.PTY_MASTER, FdKind.PIPE,
                         FdKind.SOCKET})
BY_PATH_KINDS = frozenset({FdKind.REGULAR, FdKind.DIRECTORY, FdKind.CHARDEV, FdKind.PATH,
                           FdKind.FIFO})
O_NONBLOCK = 0o4000
F_SETFL = 4
O_APPEND, O_DIRECT = 0o2000, 0o40000
_SETFL_STATUS = O_APPEND | O_NONBLOCK | O_DIRECT   # set again on what ptckpt made (O_ASYNC: with its owner)


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
        if f.kind in BY_PATH_KINDS and f.path.endswith(DELETED):
            out.append(f"fd {f.fd} -> {f.path} (a deleted file the image does not hold)")
            continue
        if (f.kind in BY_PATH_KINDS or is_controlling_tty(f) or nsfs.own_entry(f)
                or (f.kind is FdKind.TTY and f.path.startswith("/"))):   # by path: its node
            continue
        out.append(f"fd {f.fd} -> {f.path} ({f.kind.name.lower()})")
    return out


def open_ghost_files(ghosts: Sequence[GhostFile], procs: Mapping[int, ProcessImage], ghost_paths: dict,
                     opened: dict) -> None:
    """The deleted files made again (create_ghost_files: `ghost_paths`) that ptckpt itself
    opens, into `opened`: a directory (a deleted cwd or root, fchdir()ed into), at its
    ghost_dir_key, and what the deleted mappings of `procs` map, at its ghost_key."""
    mapped = {ghost_key(v) for proc in procs.values() for v in proc.vmas}
    for g in ghosts:
        key = ("ghost", g.dev, g.ino)
        if _stat.S_ISDIR(g.mode):                 # a deleted cwd or root: fchdir()ed into
            opened[ghost_dir_key(g.path + DELETED)] = os.open(
                ghost_paths[key], os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        elif key in mapped:                       # what the deleted mappings map
            opened[key] = open_description(_ghost_fd(key), ghost_paths[key])


def _ghost_fd(key) -> Fd:
    """The open of a deleted file that a mapping needs (read-write: a shared mapping may write)."""
    return Fd(fd=-1, kind=FdKind.REGULAR, path=f"deleted file {key[1]:#x}:{key[2]}", flags=os.O_RDWR,
              pos=0, cloexec=True, mnt_id=0, dev=key[1], ino=key[2], mode=0, rdev=0, size=0, mtime_ns=0)


def open_description(f: Fd, path: str | None = None, *, compat: bool = False) -> int:
    """Open, in ptckpt, the file description an fd had: its path (or `path`), flags and offset.
    `compat`: a 32-bit process holds it: a file it opened without O_LARGEFILE is opened so
    again (an i386 openat: tracee.compat_openat)."""
    flags = f.flags & ~(O_CREAT | O_EXCL | O_TRUNC) | O_NOCTTY | O_CLOEXEC
    if f.kind is FdKind.REGULAR:
        flags &= ~os.O_TMPFILE        # made by O_TMPFILE (its O_DIRECTORY bit too): reopened as a file
    try:
        if compat and not f.flags & O_LARGEFILE:
            fd = compat_openat(path or f.path, flags)
        else:
            fd = os.open(path or f.path, flags)
    except OSError as err:
        raise RestoreFailed(f"cannot reopen {f.path} (fd {f.fd}): {err.strerror}") from None
    if f.kind in (FdKind.REGULAR, FdKind.DIRECTORY) and f.pos:
        os.lseek(fd, f.pos, os.SEEK_SET)
    return fd


class GhostPaths(dict):
    """{ghost_key: the path a ghost was made at again}; `made` lists every path made
    (the ghosts and the missing parent directories made for them) in the order made."""

    def __init__(self):
        super().__init__()
        self.made: list[str] = []
        self.fds: list[int] = []          # files still linked elsewhere, opened by handle


def create_ghost_files(ghosts: list[GhostFile]) -> GhostPaths:
    """Make each deleted file or directory again (a directory: empty), with its bytes, holes,
    mode, owner and times, where it was (or beside it when that name is taken now; missing
    parent directories made too): {ghost_key: path}.  The caller opens what it needs, then
    removes them all (remove_ghost_files), so they are deleted-but-open again."""
    out = GhostPaths()
    try:
        for n, g in sorted(enumerate(ghosts), key=lambda ng: ng[1].path.count("/")):
            if g.handle:
                out[("ghost", g.dev, g.ino)] = _open_linked(g, out.fds)
                continue
            path = g.path
            for attempt in range(100):
                try:
                    fd = _make_one(g, path)
                    break
                except FileExistsError:
                    path = f"{g.path}.ptckpt-ghost-{os.getpid()}-{n}-{attempt}"
                except FileNotFoundError:
                    _make_parents(os.path.dirname(path), out.made)
                except OSError as err:
                    raise RestoreFailed(f"cannot recreate the deleted file {g.path}: {err.strerror}") from None
            else:
                raise RestoreFailed(f"cannot recreate the deleted file {g.path}: every name is taken")
            out[("ghost", g.dev, g.ino)] = path
            out.made.append(path)
            if fd is None:
                _give_attributes(g, path)
            else:
                _fill_file(fd, g)
    except BaseException:
        remove_ghost_files(out)
        raise
    return out


def _open_linked(g: GhostFile, fds: list[int]) -> str:
    """The file a deleted name led to, which other names still hold: opened by its file
    handle; a /proc/self/fd path to reopen it by (its fd added to `fds`)."""
    try:
        fd = open_file_handle(g.dev, g.handle, os.O_PATH | O_CLOEXEC)
    except OSError as err:
        raise RestoreFailed(f"cannot open again the file {g.path} was a deleted name of (it had other "
                            f"links): {err.strerror or err}") from None
    fds.append(fd)
    return f"/proc/{os.getpid()}/fd/{fd}"


def _make_one(g: GhostFile, path: str) -> int | None:
    """Create a ghost's file (or directory) at `path`: an fd of it, to fill; None for a
    device node, FIFO, socket or symbolic link (never opened here: _give_attributes)."""
    if _stat.S_ISDIR(g.mode):
        os.mkdir(path, 0o700)
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_CLOEXEC)
    if _stat.S_ISLNK(g.mode):
        os.symlink(g.target, path)
        return None
    if not _stat.S_ISREG(g.mode):
        os.mknod(path, _stat.S_IFMT(g.mode) | 0o600, g.rdev)
        return None
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o600)


def _give_attributes(g: GhostFile, path: str) -> None:
    """A special ghost's owner, permissions (a link has none) and times, by its path."""
    with contextlib.suppress(OSError):
        os.chown(path, g.uid, g.gid, follow_symlinks=False)
    if not _stat.S_ISLNK(g.mode):
        os.chmod(path, _stat.S_IMODE(g.mode))
    if g.mtime_ns:
        os.utime(path, ns=(g.atime_ns, g.mtime_ns), follow_symlinks=False)


def _make_parents(directory: str, made: list[str]) -> None:
    """The missing directories down to `directory` (a deleted file's parent that was
    removed too), each added to `made` to be removed again."""
    if not directory or os.path.isdir(directory):
        return
    _make_parents(os.path.dirname(directory), made)
    os.mkdir(directory, 0o700)
    made.append(directory)


def file_holders(images: dict) -> dict[str, int]:
    """{path: a pid holding it} of every regular file open or mapped in the tree ({pid:
    ProcessImage}; not the deleted ones)."""
    out: dict[str, int] = {}
    for p, im in images.items():
        for f in im.fds:
            if f.kind is FdKind.REGULAR and not f.path.endswith(DELETED):
                out.setdefault(f.path, p)
        for v in im.vmas:
            if v.kind in (VmaKind.FILE_PRIVATE, VmaKind.FILE_SHARED) and not v.file_deleted:
                out.setdefault(v.path, p)
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
                                 data=_whole(g)))
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
    """Write a recorded file's bytes (at their extents: holes stay holes), owner and mode
    (in that order: chown clears set-user-ID and set-group-ID) and a ghost's times into
    `fd`, then close it."""
    try:
        extents = getattr(what, "extents", ()) or ((0, len(what.data)),)
        view = memoryview(what.data)
        for off, length in extents:
            part = view[:length]
            view = view[length:]
            while part:
                n = os.pwrite(fd, part, off)
                part, off = part[n:], off + n
        if isinstance(what, GhostFile) and what.size and _stat.S_ISREG(what.mode):
            os.ftruncate(fd, what.size)
        with contextlib.suppress(OSError):
            os.fchown(fd, what.uid, what.gid)
        os.fchmod(fd, what.mode & 0o7777)
        for name, value in getattr(what, "xattrs", ()):  # after the mode: an ACL's mask agrees with it
            try:
                os.setxattr(fd, name, value)
            except OSError as err:
                raise RestoreFailed(f"cannot give the deleted file {what.path} its extended attribute "
                                    f"{name}: {err.strerror}") from None
        if isinstance(what, GhostFile) and what.mtime_ns:
            os.utime(fd, ns=(what.atime_ns, what.mtime_ns))
    finally:
        os.close(fd)


def remove_ghost_files(paths: dict[tuple, str]) -> None:
    """Unlink the made ghost files, remove the made directories (and the parents made
    for them), the last made first."""
    if isinstance(paths, GhostPaths):
        for fd in paths.fds:
            os.close(fd)
        paths.fds = []
    for path in reversed(getattr(paths, "made", list(paths.values()))):
        with contextlib.suppress(OSError):               # gone already; ENOTEMPTY: not ours to empty
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)


O_LARGEFILE = 0o100000


def _reopen(remote, f: Fd, path: int, flags: int, step: str) -> int:
    """openat of `path` with `flags`.  An x86_64 open always adds O_LARGEFILE; a file a
    32-bit program opened without it is opened again through the compat openat, which
    does not (where the scratch memory lies below 4 GiB: a 32-bit process's restore)."""
    if not f.flags & O_LARGEFILE and remote.scratch_top < 2**32:
        return remote.checked_compat("openat", AT_FDCWD, path, flags, 0, step=step)
    return remote.checked("openat", AT_FDCWD, path, flags, 0, step=step)


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
    status_set: set[int] = set()
    for f in fds:
        if f.desc in handed and not f.skipped and not f.external:
            step = f"install fd {f.fd} ({f.path})"
            remote.checked("dup3", handed[f.desc], f.fd, O_CLOEXEC if f.cloexec else 0, step=step)
            if f.desc not in status_set:     # a description ptckpt made: its status flags as dumped
                status_set.add(f.desc)
                now = remote.checked("fcntl", f.fd, F_GETFL, step=step)
                if (now ^ f.flags) & _SETFL_STATUS:
                    remote.checked("fcntl", f.fd, F_SETFL, now & ~_SETFL_STATUS | f.flags & _SETFL_STATUS,
                                   step=step)
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
        path = CTTY_PATH if is_controlling_tty(f) else nsfs.reopen_path(f) if nsfs.own_entry(f) else f.path
        step = f"reopen fd {f.fd} ({path})"
        # A FIFO is opened non-blocking (a blocking open would wait for the other end
        # inside the injected syscall), then gets its own flags back.
        open_flags = flags | O_NONBLOCK if f.kind is FdKind.FIFO else flags
        with remote.scratch(os.fsencode(path) + b"\0") as p:
            got = _reopen(remote, f, int(p), open_flags | (O_CLOEXEC if f.cloexec else 0), step)
        if open_flags != flags:
            remote.checked("fcntl", got, F_SETFL, flags, step=step)
        if got != f.fd:
            remote.checked("dup3", got, f.fd, O_CLOEXEC if f.cloexec else 0, step=step)
            remote.checked("close", got, step=step)
        if f.kind in (FdKind.REGULAR, FdKind.DIRECTORY) and f.pos:
            remote.checked("lseek", f.fd, f.pos, 0, step=step)

