"""Pipes and FIFOs held inside a tree: their buffered bytes, and the pipe again at restore.

Dump half: :func:`dump_pipes` copies each pipe's buffer with tee(2), which
duplicates the bytes into a pipe of ptckpt's without consuming them, so a
target left running reads exactly what it would have read.

Restore half: :func:`create_pipes` makes the pipe (or opens the FIFO) in ptckpt,
with its capacity and its bytes, and one open file description per end the
image recorded; the stubs inherit them and each holder dup3()s its own into place.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
import tempfile
from collections.abc import Iterable, Mapping, Sequence

from ..errors import PtckptError, RestoreFailed
from ..formats.model import Fd, FdKind, PipeBuffer
from ..tracee import pidfd_getfd

F_SETPIPE_SZ = 1031
F_GETPIPE_SZ = 1032
SPLICE_F_NONBLOCK = 0x02
O_ACCMODE = 0o3

_libc = ctypes.CDLL(None, use_errno=True)
_libc.tee.restype = ctypes.c_ssize_t
_libc.tee.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint]

PIPE_KINDS = frozenset({FdKind.PIPE, FdKind.FIFO})
DELETED = " (deleted)"


def is_reader(f: Fd) -> bool:
    return f.flags & O_ACCMODE in (os.O_RDONLY, os.O_RDWR)


def is_writer(f: Fd) -> bool:
    return f.flags & O_ACCMODE in (os.O_WRONLY, os.O_RDWR)


# --- dump half -----------------------------------------------------------------

def peek_pipe(fd: int) -> tuple[int, bytes]:
    """(capacity, buffered bytes) of the pipe whose read end `fd` is, left unconsumed."""
    capacity = _fcntl(fd, F_GETPIPE_SZ)
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if _fcntl(w, F_GETPIPE_SZ) < capacity:
            _fcntl(w, F_SETPIPE_SZ, capacity)
        n = _libc.tee(fd, w, capacity, SPLICE_F_NONBLOCK)
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EAGAIN:        # empty
                return capacity, b""
            raise OSError(err, f"tee: {os.strerror(err)}")
        chunks = []
        while n > 0:
            chunk = os.read(r, n)
            chunks.append(chunk)
            n -= len(chunk)
        return capacity, b"".join(chunks)
    finally:
        os.close(r)
        os.close(w)


def dump_pipes(fds: Mapping[int, Sequence[Fd]], internal: Iterable[int]) -> list[PipeBuffer]:
    """A PipeBuffer for each pipe or FIFO inode in `internal` (held only inside the tree).

    The bytes are read through a copy of a read end of the frozen tree (or, when the
    tree holds only write ends, a fresh read-only open of one: that does not touch
    the buffer either).
    """
    ends: dict[int, list[tuple[int, Fd]]] = {}
    for pid, flist in fds.items():
        for f in flist:
            if f.kind in PIPE_KINDS:
                ends.setdefault(f.ino, []).append((pid, f))
    out = []
    for ino in internal:
        holders = ends.get(ino)
        if not holders:
            continue
        readers = [(p, f) for p, f in holders if is_reader(f)]
        pid, f = (readers or holders)[0]
        try:
            copy = pidfd_getfd(pid, f.fd) if readers else os.open(
                f"/proc/{pid}/fd/{f.fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            raise PtckptError(f"cannot read the buffer of pid {pid} fd {f.fd} ({f.path}): "
                              f"{err.strerror}") from None
        try:
            capacity, data = peek_pipe(copy)
        finally:
            os.close(copy)
        out.append(PipeBuffer(ino=ino, capacity=capacity, data=data,
                              path=f.path if f.kind is FdKind.FIFO else ""))
    return out


# --- restore half --------------------------------------------------------------

def create_pipes(buffers: Sequence[PipeBuffer], descs: Mapping[int, Fd]) -> dict[int, int]:
    """Make every pipe and FIFO of the image in ptckpt: {desc number: fd of ptckpt}.

    `descs` maps each open file description (Fd.desc) of a pipe or FIFO to one of
    its fds.  Every description gets its own open of the pipe, with its flags;
    the buffer is refilled before anyone can read.  The caller owns the fds.
    """
    by_ino: dict[int, list[Fd]] = {}
    for f in descs.values():
        by_ino.setdefault(f.ino, []).append(f)
    out: dict[int, int] = {}
    try:
        for buf in buffers:
            holders = by_ino.get(buf.ino, [])
            if holders:
                out.update(_create_one(buf, holders))
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def _create_one(buf: PipeBuffer, holders: Sequence[Fd]) -> dict[int, int]:
    what = buf.path or f"pipe:[{buf.ino}]"
    made: dict[int, int] = {}
    try:
        if buf.path:
            # A FIFO: a reader and writer of our own keeps it open (so opening a
            # write end does not fail with ENXIO) and lets us fill it.
            keeper = (_ghost_fifo(buf.path, holders[0].mode) if buf.path.endswith(DELETED)
                      else os.open(buf.path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC))
            reader = writer = keeper
        else:
            reader, writer = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            keeper = -1
        try:
            if buf.capacity and _fcntl(writer, F_GETPIPE_SZ) != buf.capacity:
                _fcntl(writer, F_SETPIPE_SZ, buf.capacity)
            _fill(writer, buf.data, what)
            used = set()
            for f in holders:
                end = reader if f.flags & O_ACCMODE == os.O_RDONLY else writer
                if keeper < 0 and end not in used and (f.flags & O_ACCMODE) != os.O_RDWR:
                    fd = end                        # the pipe's own end serves its first holder
                    used.add(end)
                else:
                    fd = os.open(f"/proc/self/fd/{end}" if not buf.path or buf.path.endswith(DELETED)
                                 else buf.path,
                                 (f.flags & O_ACCMODE) | os.O_NONBLOCK | os.O_CLOEXEC)
                _set_flags(fd, f.flags)
                made[f.desc] = fd
        finally:
            for end in {reader, writer} - set(made.values()):
                os.close(end)
    except OSError as err:
        for fd in made.values():
            os.close(fd)
        raise RestoreFailed(f"cannot recreate {what}: {err.strerror}") from None
    return made


def _ghost_fifo(path: str, mode: int) -> int:
    """A FIFO that was deleted while open: made again where it was (beside it when that
    name is taken, in the temporary directory when its directory is gone too), opened,
    and unlinked."""
    path = path.removesuffix(DELETED)
    spare = f".ptckpt-fifo-{os.getpid()}-{secrets.token_hex(4)}"
    where = os.path.dirname(path)
    for name in (path, os.path.join(where, spare), os.path.join(tempfile.gettempdir(), spare)):
        try:
            os.mkfifo(name, mode & 0o7777)
            break
        except (FileExistsError, FileNotFoundError):
            continue
    try:
        return os.open(name, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    finally:
        os.unlink(name)


def _fill(fd: int, data: bytes, what: str) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            raise RestoreFailed(f"the {len(data)} buffered bytes of {what} do not fit its "
                                f"capacity") from None
        view = view[n:]


def _set_flags(fd: int, flags: int) -> None:
    """The description's status flags (O_NONBLOCK, O_DIRECT ...) as the image has them."""
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_ACCMODE)


def _fcntl(fd: int, cmd: int, arg: int = 0) -> int:
    return fcntl.fcntl(fd, cmd, arg)
