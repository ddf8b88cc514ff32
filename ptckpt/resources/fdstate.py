"""What the fd kinds of resources.anonfds share: the fd being dumped, libc calls, status flags.

Each kind (resources.eventfd, timerfd, signalfd, inotify, fanotify, memfd, mqueue) holds
its dump half and its restore half, and names them in its :data:`KIND` row, a
:class:`FdKindOps`; resources.anonfds lists the rows and dispatches through them.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import struct
import termios
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import procfs
from ..errors import PtckptError, UnsupportedResource
from ..formats.model import FdKind
from ..tracee import pidfd_getfd

O_ACCMODE = 0o3
O_CLOEXEC = os.O_CLOEXEC
O_NONBLOCK = os.O_NONBLOCK
O_PATH = 0o10000000
# Status flags F_SETFL can change and that mean something for these files.
_SETFL_MASK = os.O_NONBLOCK | os.O_APPEND | os.O_NOATIME

HUGETLBFS_MAGIC = 0x958458F6
MQUEUE_MAGIC = 0x19800202
DELETED = " (deleted)"


@dataclass(frozen=True)
class FdKindOps:
    """One kind's row: its FdKind, its image record, and its halves.

    `dump(target, fdinfo)` reads the state of the frozen target's fd (a :class:`Target`);
    `make(state, flags)` makes the object again in ptckpt and returns its fd (close-on-exec),
    with `ghosts` as a third argument when `takes_ghosts` (the deleted files made again);
    `describe(state)` names the object for messages.
    """

    kind: FdKind
    state: type
    dump: Callable[[Target, procfs.FdInfo], Any]
    make: Callable[..., int]
    describe: Callable[[Any], str]
    takes_ghosts: bool = False


# --- libc ----------------------------------------------------------------------

class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_long * 15)]


libc = ctypes.CDLL(None, use_errno=True)


def proto(name: str, restype, *argtypes):
    """The libc function `name`, typed."""
    fn = getattr(libc, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_fstatfs = proto("fstatfs", ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Statfs))


def check(res: int, what: str) -> int:
    """`res` of a libc call, or OSError(errno) naming the call."""
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return res


def fs_type(fd: int) -> int:
    """The file system magic (statfs f_type) of the file `fd` is open on."""
    buf = _Statfs()
    check(_fstatfs(fd, ctypes.byref(buf)), "fstatfs")
    return buf.f_type & 0xFFFFFFFF


# --- dump half -----------------------------------------------------------------

class Target(NamedTuple):
    """The fd being dumped, for messages."""

    pid: int
    fd: int
    link: str

    def unsupported(self, what: str) -> UnsupportedResource:
        return UnsupportedResource(self.pid, f"fd {self.fd} ({self.link}): {what}")


@contextlib.contextmanager
def reading(pid: int, fd: int, link: str) -> Iterator[None]:
    """OSError inside -> PtckptError naming the process and fd."""
    try:
        yield
    except OSError as err:
        raise PtckptError(f"process {pid} fd {fd} ({link}): cannot read its state: "
                          f"{err.strerror or err}") from None


@contextlib.contextmanager
def copy_of(t: Target) -> Iterator[int]:
    """A copy of the target's fd (same open file description), closed on exit."""
    copy = pidfd_getfd(t.pid, t.fd)
    try:
        yield copy
    finally:
        os.close(copy)


def field(t: Target, info: procfs.FdInfo, key: str) -> str:
    """The text of fdinfo line `key`; its absence makes the fd unsupported."""
    values = info.extra.get(key)
    if not values:
        raise t.unsupported(f"its fdinfo has no '{key}' line (kernel too old?)")
    return values[0].strip()


def refuse_unread_events(t: Target, what: str) -> None:
    """Queued events (FIONREAD) cannot be read without taking them from the process."""
    with copy_of(t) as copy:
        queued = struct.unpack("i", fcntl.ioctl(copy, termios.FIONREAD, b"\0" * 4))[0]
    if queued:
        raise t.unsupported(f"{queued} bytes of unread {what} events (they cannot be "
                            f"read without taking them from the process)")


# --- restore half --------------------------------------------------------------

@contextlib.contextmanager
def closing_on_error(fd: int) -> Iterator[int]:
    """`fd`, closed if the block raises."""
    try:
        yield fd
    except BaseException:
        os.close(fd)
        raise


def set_status_flags(fd: int, flags: int) -> None:
    """O_NONBLOCK, O_APPEND, O_NOATIME of the description as recorded."""
    current = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, current & ~_SETFL_MASK | flags & _SETFL_MASK)
