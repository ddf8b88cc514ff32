"""memfd fds: name, contents, size, mode, seals and offset, and the memfd again.

Dump half (:func:`dump`, through resources.anonfds.dump_anon_fd), from its fdinfo and a
copy of the fd (pidfd_getfd), which shares the target's open file description:

memfd: name from the link ("/memfd:NAME (deleted)"), contents by pread on the copy (the
shared offset is not moved), size, mode, seals (F_GET_SEALS) and offset.

Restore half (:func:`make`, through resources.anonfds.create_anon_fd), with the
status flags (O_NONBLOCK ...) of the recorded description:

memfd with its name, contents, size, mode and offset, seals last;

Limits: read whole into memory; MFD_HUGETLB memfds are refused; each call makes its own object
(several descriptions of one memfd, or an fd and a mapping of it, must be given one object
by the caller); the seals are in force when this returns, so a memfd sealed
F_SEAL_FUTURE_WRITE that the target had mapped writable and shared cannot be mapped so
again.
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import stat as _stat

from .. import procfs
from ..errors import RestoreFailed
from ..formats.model import FdKind, MemfdState
from .fdstate import (HUGETLBFS_MAGIC, O_ACCMODE, O_CLOEXEC, FdKindOps, Target, closing_on_error, copy_of, fs_type,
                      set_status_flags)

MFD_CLOEXEC = 0x1
MFD_ALLOW_SEALING = 0x2
MFD_NOEXEC_SEAL = 0x8
MFD_EXEC = 0x10
F_ADD_SEALS = 1033
F_GET_SEALS = 1034
F_SEAL_SEAL = 0x01
F_SEAL_SHRINK = 0x02
F_SEAL_GROW = 0x04
F_SEAL_WRITE = 0x08
F_SEAL_FUTURE_WRITE = 0x10
F_SEAL_EXEC = 0x20


# --- dump half -----------------------------------------------------------------

def dump(t: Target, info: procfs.FdInfo) -> MemfdState:
    name = t.link.removeprefix("/memfd:").removesuffix(" (deleted)")
    with copy_of(t) as copy:
        if fs_type(copy) == HUGETLBFS_MAGIC:
            raise t.unsupported("a hugetlb memfd (MFD_HUGETLB)")
        st = os.fstat(copy)
        seals = fcntl.fcntl(copy, F_GET_SEALS)
        contents = _pread_all(copy, st.st_size)
    return MemfdState(name=name, contents=contents, size=st.st_size, seals=seals,
                      mode=_stat.S_IMODE(st.st_mode), pos=info.pos)


def _pread_all(fd: int, size: int) -> bytes:
    """The first `size` bytes of `fd`, without moving its offset."""
    chunks, done = [], 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 1 << 24), done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


# --- restore half --------------------------------------------------------------

def make(state: MemfdState, flags: int) -> int:
    noexec = bool(state.seals & F_SEAL_EXEC) and not state.mode & 0o111
    fd = _memfd_create(state.name, MFD_CLOEXEC | MFD_ALLOW_SEALING
                       | (MFD_NOEXEC_SEAL if noexec else MFD_EXEC))
    with closing_on_error(fd):
        if _stat.S_IMODE(os.fstat(fd).st_mode) != state.mode:
            os.fchmod(fd, state.mode)
        view = memoryview(state.contents)
        while view:
            view = view[os.write(fd, view):]
        os.ftruncate(fd, state.size)
        seals = state.seals & ~fcntl.fcntl(fd, F_GET_SEALS)
        if seals:
            fcntl.fcntl(fd, F_ADD_SEALS, seals)
        if flags & O_ACCMODE != os.O_RDWR:
            # Another access mode is another description of the same memfd.
            again = os.open(f"/proc/self/fd/{fd}", flags & O_ACCMODE | O_CLOEXEC)
            os.close(fd)
            fd = again
    with closing_on_error(fd):
        os.lseek(fd, state.pos, os.SEEK_SET)
        set_status_flags(fd, flags)
    return fd


def reopen_memfd(fd: int, state: MemfdState, flags: int) -> int:
    """Another open file description of the memfd `fd` (which holds state's contents
    already): its own access mode, offset and status flags, as another process's open of
    /proc/PID/fd/N made it.  The caller owns the fd."""
    try:
        again = os.open(f"/proc/self/fd/{fd}", flags & O_ACCMODE | O_CLOEXEC)
    except OSError as err:
        raise RestoreFailed(f"cannot open {describe(state)} again: {err.strerror or err}") from None
    with closing_on_error(again):
        os.lseek(again, state.pos, os.SEEK_SET)
        set_status_flags(again, flags)
    return again


def _memfd_create(name: str, mfd_flags: int) -> int:
    """memfd_create, without MFD_EXEC / MFD_NOEXEC_SEAL on kernels before 6.3."""
    try:
        return os.memfd_create(name, mfd_flags)
    except OSError as err:
        if err.errno != _errno.EINVAL or not mfd_flags & (MFD_EXEC | MFD_NOEXEC_SEAL):
            raise
        return os.memfd_create(name, mfd_flags & ~(MFD_EXEC | MFD_NOEXEC_SEAL))


def describe(state: MemfdState) -> str:
    return f"memfd:{state.name}"


KIND = FdKindOps(FdKind.MEMFD, MemfdState, dump, make, describe)
