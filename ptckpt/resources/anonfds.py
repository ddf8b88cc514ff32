"""eventfd, timerfd, signalfd, inotify, fanotify, memfd and mqueue fds: their state, and the object again.

Dump half: :func:`dump_anon_fd` reads the state of one such fd of a frozen
target into a frozen dataclass (one per kind, :data:`AnonFdState`).  The
sources are the fd's fdinfo lines and a copy of the fd (pidfd_getfd), which
shares the target's open file description, so nothing is done through it that
the target could notice afterwards:

* eventfd:  ``eventfd-count`` (hex) and ``eventfd-semaphore`` (6.18 has it,
  older kernels do not; without it the mode is unknown and the fd is refused).
* timerfd:  clock and settime flags from fdinfo; the remaining time and the
  interval from timerfd_gettime(2) on the copy.  gettime first brings an
  expired periodic timer up to date (the kernel adds the missed periods to
  its ticks, as a read would count them), so the ``ticks`` line read after it
  is every expiration not yet read.  The pair is read twice and kept only when
  no expiration fell in between.
* signalfd: ``sigmask`` (hex).
* inotify:  one fdinfo line per watch (``wd``, ``ino``, ``sdev``, ``mask``
  and ``ignored_mask`` in hex, then ``fhandle-bytes``, ``fhandle-type``,
  ``f_handle``).  A watch holds an inode, not a path: the path is found by
  opening the file handle with open_by_handle_at(2) (needs CAP_DAC_READ_SEARCH)
  relative to a mount of the device ``sdev`` (the kernel's dev_t, major << 20
  | minor) found in ptckpt's /proc/self/mountinfo, and reading the link of
  the fd obtained; it is accepted only when that path, looked up again, is
  the very inode.  A watch on a deleted file (the handle opens an inode with
  no links left) is recorded at the path it had, with its (st_dev, st_ino):
  the dump keeps it only when the tree holds that file open or mapped, so the
  file is a ghost file of the image.  Unread events cannot be read without
  consuming them, so an inotify fd with queued events (FIONREAD) is refused.
* fanotify: ``fanotify flags:.. event-flags:..`` (fanotify_init's flags and
  event_f_flags), then one line per mark: on an inode (``ino``, ``sdev`` and a
  file handle, resolved to a path as for inotify), a mount (``mnt_id``, its
  mount point in ptckpt's mountinfo) or a file system (``sdev``, a mount of
  it), with ``mflags`` (the FAN_MARK_* flags it was added with that the kernel
  keeps), ``mask`` and ``ignored_mask``.  A group of the content or
  pre-content class (permission events: those read and not yet answered
  cannot be seen) and a group with unread events are refused.
* memfd:    name from the link ("/memfd:NAME (deleted)"), contents by pread
  on the copy (the shared offset is not moved), size, mode, seals
  (F_GET_SEALS) and offset.
* mqueue:   attributes by mq_getattr; the link is the queue's name as
  mq_open(3) takes it ("/name", " (deleted)" appended once mq_unlink()ed).
  Messages cannot be peeked, so they are all received through a fresh
  non-blocking description of the queue and sent back, in the order received
  (highest priority first, oldest first within one priority), with their
  priorities: the queue is the same afterwards.

Restore half: :func:`create_anon_fd` makes an equivalent object in ptckpt
and returns its fd (close-on-exec; the caller installs it), with the status
flags (O_NONBLOCK ...) of the recorded description:

* eventfd with its count and EFD_SEMAPHORE;
* timerfd on its clock, re-armed with its remaining time counted from now
  (relative timers: the time the tree spent checkpointed does not count) or
  at its absolute expiry (TFD_TIMER_ABSTIME), with its interval; unread
  expirations are set back with the TFD_IOC_SET_TICKS ioctl
  (CONFIG_CHECKPOINT_RESTORE; it refuses 0);
* signalfd with its mask;
* inotify with the same watches and the same watch descriptors.  The kernel
  hands out wds cyclically (idr_alloc_cyclic from 1: a removed wd is not
  reused, a fresh instance starts at 1), so a gap is skipped by adding and
  removing a placeholder watch (on a memfd of ptckpt's, an inode nobody else
  watches) once per missing number; the IN_IGNORED events this queues are
  read away before the fd is handed over; a watch on a deleted file is put on
  the ghost file made again (the very inode the restored fds open); the events
  the rest of the restore queues (its opens of the tree's files, the ghosts'
  unlinks) are read away once the tree is rebuilt (:func:`drain_inotify`);
* fanotify with its init flags and event flags; its marks are added by
  :func:`mark_fanotify` once the restore has opened every file of the tree
  (else its own opens would be queued as events);
* memfd with its name, contents, size, mode and offset, seals last;
* mqueue opened by name: created (O_EXCL, with its attributes, mode and
  owner) when it is gone, then filled with the messages.  When a queue of
  that name exists (it outlived the checkpointed processes), it is taken to
  be the original: it must have the same maxmsg and msgsize, and it is
  emptied and refilled, because a restart must begin from the checkpointed
  state.  A queue that was unlinked is made under a temporary name, filled,
  and unlinked again.  The description handed back is a fresh open of the
  queue with the recorded access mode.

Limits (what the kernel does not let us see or set):

* eventfd: the eventfd-id (a counter of the boot) is new.
* timerfd: a timer cancelled by a clock change (TFD_TIMER_CANCEL_ON_SET,
  ECANCELED pending) comes back merely armed; an absolute CLOCK_MONOTONIC /
  BOOTTIME expiry is kept as a number, meaningful on the same boot only.
* inotify: queued events are refused (not lost); the next wd the group would
  have handed out is max(wd) + 1 after restore, while the original may have
  been further on (its removed top wds leave no trace); add-time flags
  (IN_MASK_ADD, IN_ONLYDIR, IN_MASK_CREATE) are not kept (IN_ONESHOT and
  IN_EXCL_UNLINK are); a watch on a file system without file handles
  (procfs, sysfs ...), on a deleted file no fd or mapping of the tree holds
  (another process does), on a mount ptckpt does not
  see, or whose dentry the kernel can only give disconnected, is refused;
  events that happen to the watched files during the restore, until the tree
  is rebuilt, are read away with the restore's own; paths are ptckpt's view of
  the mounts (the target must share ptckpt's mount namespace).
* fanotify: marks by path (ptckpt's view of the mounts), so a mark on a deleted
  file or a mount ptckpt does not see is refused; a mark of a kind this version
  does not know (mount namespace marks) is refused; events that happen between
  the marks and the resume are the restored program's to read.
* memfd: read whole into memory; MFD_HUGETLB memfds are refused; each call
  makes its own object (several descriptions of one memfd, or an fd and a
  mapping of it, must be given one object by the caller); the seals are in
  force when this returns, so a memfd sealed F_SEAL_FUTURE_WRITE that the
  target had mapped writable and shared cannot be mapped so again.
* mqueue: the queue of ptckpt's IPC namespace is used at both ends; an
  mq_notify registration is refused; while the messages are out (between
  receive and send at dump, drain and refill at restore) a process outside
  the tree blocked in mq_timedsend/mq_timedreceive on the same queue could
  slip a message in or take one, which the dump detects (the message count
  differs afterwards) but cannot undo.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import fcntl
import os
import re
import stat as _stat
import struct
import termios
import time
from collections.abc import Iterator
from typing import NamedTuple, Union

from .. import procfs
from ..errors import PtckptError, RestoreFailed, UnsupportedResource
from ..formats.model import (FANOTIFY_MARK_KINDS, EventfdState, FanotifyMark, FanotifyState, FdKind,
                             InotifyState, InotifyWatch, MemfdState, MqueueState, SignalfdState,
                             TimerfdState)
from ..tracee import pidfd_getfd

# --- constants (include/uapi/linux/{eventfd,timerfd,signalfd,inotify,memfd,fcntl}.h) ---

O_ACCMODE = 0o3
O_CLOEXEC = os.O_CLOEXEC
O_NONBLOCK = os.O_NONBLOCK
O_PATH = 0o10000000
# Status flags F_SETFL can change and that mean something for these files.
_SETFL_MASK = os.O_NONBLOCK | os.O_APPEND | os.O_NOATIME

EFD_SEMAPHORE = 1
EFD_NONBLOCK = O_NONBLOCK
EFD_CLOEXEC = O_CLOEXEC

TFD_NONBLOCK = O_NONBLOCK
TFD_CLOEXEC = O_CLOEXEC
TFD_TIMER_ABSTIME = 1
TFD_TIMER_CANCEL_ON_SET = 2
TFD_IOC_SET_TICKS = 0x40085400      # _IOW('T', 0, __u64)

SFD_NONBLOCK = O_NONBLOCK
SFD_CLOEXEC = O_CLOEXEC

IN_NONBLOCK = O_NONBLOCK
IN_CLOEXEC = O_CLOEXEC
IN_ATTRIB = 0x00000004
IN_IGNORED = 0x00008000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ONESHOT = 0x80000000
_INOTIFY_EVENT = struct.Struct("iIII")     # wd, mask, cookie, len (then the name)

FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_CLASS_MASK = 0xC                 # FAN_CLASS_CONTENT 0x4, FAN_CLASS_PRE_CONTENT 0x8
FAN_MARK_ADD = 0x1
FAN_MARK_DONT_FOLLOW = 0x4
FAN_MARK_MOUNT = 0x10
FAN_MARK_IGNORED_MASK = 0x20
FAN_MARK_IGNORED_SURV_MODIFY = 0x40
FAN_MARK_FILESYSTEM = 0x100
FAN_MARK_EVICTABLE = 0x200
FAN_MARK_IGNORE = 0x400
_FAN_KIND_FLAG = {0: FAN_MARK_DONT_FOLLOW, 1: FAN_MARK_MOUNT, 2: FAN_MARK_FILESYSTEM}

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

HUGETLBFS_MAGIC = 0x958458F6
MQUEUE_MAGIC = 0x19800202
_EVENTFD_MAX = 2**64 - 2
_DELETED = " (deleted)"


# --- libc ----------------------------------------------------------------------

class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _MqAttr(ctypes.Structure):
    _fields_ = [("mq_flags", ctypes.c_long), ("mq_maxmsg", ctypes.c_long),
                ("mq_msgsize", ctypes.c_long), ("mq_curmsgs", ctypes.c_long),
                ("_reserved", ctypes.c_long * 4)]


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_long * 15)]


_libc = ctypes.CDLL(None, use_errno=True)


def _proto(name: str, restype, *argtypes):
    fn = getattr(_libc, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)
    return fn


_c_int, _c_uint, _c_char_p, _c_void_p = ctypes.c_int, ctypes.c_uint, ctypes.c_char_p, ctypes.c_void_p
_timerfd_create = _proto("timerfd_create", _c_int, _c_int, _c_int)
_timerfd_settime = _proto("timerfd_settime", _c_int, _c_int, _c_int,
                          ctypes.POINTER(_Itimerspec), ctypes.POINTER(_Itimerspec))
_timerfd_gettime = _proto("timerfd_gettime", _c_int, _c_int, ctypes.POINTER(_Itimerspec))
_signalfd = _proto("signalfd", _c_int, _c_int, _c_char_p, _c_int)
_inotify_init1 = _proto("inotify_init1", _c_int, _c_int)
_inotify_add_watch = _proto("inotify_add_watch", _c_int, _c_int, _c_char_p, ctypes.c_uint32)
_inotify_rm_watch = _proto("inotify_rm_watch", _c_int, _c_int, _c_int)
_fanotify_init = _proto("fanotify_init", _c_int, _c_uint, _c_uint)
_fanotify_mark = _proto("fanotify_mark", _c_int, _c_int, _c_uint, ctypes.c_uint64, _c_int, _c_char_p)
_open_by_handle_at = _proto("open_by_handle_at", _c_int, _c_int, _c_char_p, _c_int)
_name_to_handle_at = _proto("name_to_handle_at", _c_int, _c_int, _c_char_p, _c_char_p,
                            ctypes.POINTER(_c_int), _c_int)
AT_EMPTY_PATH = 0x1000
MAX_HANDLE_SZ = 128
_fstatfs = _proto("fstatfs", _c_int, _c_int, ctypes.POINTER(_Statfs))
# mq_open is variadic (mode, attr); on x86_64 integer and pointer arguments are
# passed the same way either way.
_mq_open = _proto("mq_open", _c_int, _c_char_p, _c_int, _c_uint, ctypes.POINTER(_MqAttr))
_mq_getattr = _proto("mq_getattr", _c_int, _c_int, ctypes.POINTER(_MqAttr))
_mq_send = _proto("mq_send", _c_int, _c_int, _c_char_p, ctypes.c_size_t, _c_uint)
_mq_receive = _proto("mq_receive", ctypes.c_ssize_t, _c_int, _c_void_p, ctypes.c_size_t,
                     ctypes.POINTER(_c_uint))
_mq_unlink = _proto("mq_unlink", _c_int, _c_char_p)


def _check(res: int, what: str) -> int:
    """`res` of a libc call, or OSError(errno) naming the call."""
    if res < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return res


# --- the states ----------------------------------------------------------------

# EventfdState ... MqueueState are image records: formats/model.py.

AnonFdState = Union[EventfdState, TimerfdState, SignalfdState, InotifyState, MemfdState,
                    MqueueState, FanotifyState]

ANON_FD_KINDS = frozenset({FdKind.EVENTFD, FdKind.TIMERFD, FdKind.SIGNALFD, FdKind.INOTIFY,
                           FdKind.MEMFD, FdKind.MQUEUE, FdKind.FANOTIFY})


# --- dump half -----------------------------------------------------------------

def dump_anon_fd(pid: int, fd: int, kind: FdKind) -> AnonFdState:
    """The state of fd `fd` of the frozen process `pid`, a `kind` of :data:`ANON_FD_KINDS`.

    Raises UnsupportedResource for a state that cannot be captured faithfully,
    PtckptError when reading it fails; both name the fd.
    """
    dumper = _DUMPERS.get(kind)
    if dumper is None:
        raise UnsupportedResource(pid, f"fd {fd} ({kind.name.lower()}) as an anonymous-fd kind")
    link = procfs.readlink_fd(pid, fd)
    info = procfs.read_fdinfo(pid, fd)
    with _reading(pid, fd, link):
        return dumper(_Target(pid, fd, link), info)


class _Target(NamedTuple):
    """The fd being dumped, for messages."""

    pid: int
    fd: int
    link: str

    def unsupported(self, what: str) -> UnsupportedResource:
        return UnsupportedResource(self.pid, f"fd {self.fd} ({self.link}): {what}")


@contextlib.contextmanager
def _reading(pid: int, fd: int, link: str) -> Iterator[None]:
    """OSError inside -> PtckptError naming the process and fd."""
    try:
        yield
    except OSError as err:
        raise PtckptError(f"process {pid} fd {fd} ({link}): cannot read its state: "
                          f"{err.strerror or err}") from None


@contextlib.contextmanager
def _copy(t: _Target) -> Iterator[int]:
    """A copy of the target's fd (same open file description), closed on exit."""
    copy = pidfd_getfd(t.pid, t.fd)
    try:
        yield copy
    finally:
        os.close(copy)


def _field(t: _Target, info: procfs.FdInfo, key: str) -> str:
    """The text of fdinfo line `key`; its absence makes the fd unsupported."""
    values = info.extra.get(key)
    if not values:
        raise t.unsupported(f"its fdinfo has no '{key}' line (kernel too old?)")
    return values[0].strip()


def _dump_eventfd(t: _Target, info: procfs.FdInfo) -> EventfdState:
    count = int(_field(t, info, "eventfd-count"), 16)
    semaphore = int(_field(t, info, "eventfd-semaphore"))
    return EventfdState(count=count,
                        flags=(EFD_SEMAPHORE if semaphore else 0) | (info.flags & EFD_NONBLOCK))


def _dump_timerfd(t: _Target, info: procfs.FdInfo) -> TimerfdState:
    clockid = int(_field(t, info, "clockid"))
    settime_flags = int(_field(t, info, "settime flags"), 8)
    with _copy(t) as copy:
        spec, ticks, now = _timer_snapshot(t, copy, clockid)
    value = _ns(spec.it_value)
    return TimerfdState(clockid=clockid, flags=info.flags & TFD_NONBLOCK,
                        settime_flags=settime_flags, value_ns=value,
                        interval_ns=_ns(spec.it_interval) if value else 0,
                        ticks=ticks, expires_ns=now + value if value else 0)


def _timer_snapshot(t: _Target, copy: int, clockid: int) -> tuple[_Itimerspec, int, int]:
    """(timerfd_gettime, ticks, clock now) read with no expiration in between.

    Every expiration adds to the ticks, so equal ticks before and after the
    gettime mean the remaining time and the ticks describe the same moment.
    """
    before = _ticks(copy)
    for _ in range(10):
        spec = _Itimerspec()
        _check(_timerfd_gettime(copy, ctypes.byref(spec)), "timerfd_gettime")
        now = time.clock_gettime_ns(clockid)
        after = _ticks(copy)
        if after == before:
            return spec, after, now
        before = after
    raise PtckptError(f"process {t.pid} fd {t.fd} ({t.link}): the timer expires too often "
                      f"to be read consistently")


def _ticks(copy: int) -> int:
    values = procfs.read_fdinfo(os.getpid(), copy).extra.get("ticks")
    if not values:
        raise OSError(_errno.ENOTSUP, "fdinfo has no 'ticks' line")
    return int(values[0])


def _ns(ts: _Timespec) -> int:
    return ts.tv_sec * 1_000_000_000 + ts.tv_nsec


def _dump_signalfd(t: _Target, info: procfs.FdInfo) -> SignalfdState:
    return SignalfdState(mask=int(_field(t, info, "sigmask"), 16),
                         flags=info.flags & SFD_NONBLOCK)


def _refuse_unread_events(t: _Target, what: str) -> None:
    """Queued events (FIONREAD) cannot be read without taking them from the process."""
    with _copy(t) as copy:
        queued = struct.unpack("i", fcntl.ioctl(copy, termios.FIONREAD, b"\0" * 4))[0]
    if queued:
        raise t.unsupported(f"{queued} bytes of unread {what} events (they cannot be "
                            f"read without taking them from the process)")


def _dump_inotify(t: _Target, info: procfs.FdInfo) -> InotifyState:
    _refuse_unread_events(t, "inotify")
    mounts = _Mounts()
    try:
        found = [_dump_watch(t, line, mounts) for line in info.extra.get("inotify", [])]
    finally:
        mounts.close()
    return InotifyState(watches=tuple(sorted(w for w, _ in found)), flags=info.flags & IN_NONBLOCK,
                        deleted=tuple(sorted((w.wd, *inode) for w, inode in found if inode)))


def deleted_watches_unheld(state: InotifyState, ghosts: set) -> list[str]:
    """'inotify watch N on deleted file P' for each watch of `state` on a deleted file whose
    inode the image does not hold as a ghost file (no fd or mapping of the tree has it)."""
    paths = {w.wd: w.path for w in state.watches}
    return [f"inotify watch {wd} on the deleted file {paths.get(wd)} (inode {ino}): no fd or mapping of "
            f"the tree holds the file, so it cannot be made again to watch it"
            for wd, dev, ino in state.deleted if ("ghost", dev, ino) not in ghosts]


def _dump_watch(t: _Target, line: str, mounts: _Mounts) -> tuple[InotifyWatch, tuple[int, int] | None]:
    """One 'inotify wd:.. ino:.. sdev:.. mask:.. ... f_handle:..' line, its path resolved:
    (the watch, None), or for a deleted file (the watch at its old path, (st_dev, st_ino))."""
    fields = dict(item.partition(":")[::2] for item in line.split())
    try:
        wd, ino, sdev, mask = (int(fields[k], 16) for k in ("wd", "ino", "sdev", "mask"))
    except (KeyError, ValueError):
        raise t.unsupported(f"an inotify fdinfo line not understood: {line!r}") from None
    dev = _kernel_dev(sdev)
    where = f"inotify watch {wd} (inode {ino} on device {os.major(dev)}:{os.minor(dev)})"
    path = _path_of_mark(t, fields, dev, ino, mounts, where, line)
    if path.endswith(_DELETED):
        return InotifyWatch(wd=wd, path=path.removesuffix(_DELETED), mask=mask), (dev, ino)
    return InotifyWatch(wd=wd, path=path, mask=mask), None


def _kernel_dev(sdev: int) -> int:
    """A dev_t from the kernel's internal form (major << 20 | minor), as fdinfo shows it."""
    return os.makedev(sdev >> 20, sdev & 0xFFFFF)


def _path_of_mark(t: _Target, fields: dict, dev: int, ino: int, mounts: _Mounts, where: str,
                  line: str) -> str:
    """The path of the inode an fdinfo mark line names by file handle (" (deleted)" at the end
    for a deleted file)."""
    if "f_handle" not in fields:
        raise t.unsupported(f"{where}: its file system gives no file handle, so its path "
                            f"cannot be found")
    try:
        handle = (struct.pack("Ii", int(fields["fhandle-bytes"], 16),
                              ctypes.c_int(int(fields["fhandle-type"], 16)).value)
                  + bytes.fromhex(fields["f_handle"]))
    except (KeyError, ValueError, struct.error):
        raise t.unsupported(f"{where}: a file handle not understood: {line!r}") from None
    path, why = mounts.resolve(dev, ino, handle)
    if path is None:
        raise t.unsupported(f"{where}: its path cannot be resolved ({why})")
    return path


def _dump_fanotify(t: _Target, info: procfs.FdInfo) -> FanotifyState:
    lines = info.extra.get("fanotify", [])
    head = dict(item.partition(":")[::2] for item in (lines[0].split() if lines else []))
    try:
        init_flags, event_flags = int(head["flags"], 16), int(head["event-flags"], 16)
    except (KeyError, ValueError):
        raise t.unsupported("its fdinfo has no 'fanotify flags:' line (kernel too old?)") from None
    if init_flags & FAN_CLASS_MASK:
        raise t.unsupported("a fanotify group of the content or pre-content class: the permission "
                            "events it has read and not yet answered cannot be seen; close it before "
                            "the checkpoint")
    _refuse_unread_events(t, "fanotify")
    mounts = _Mounts()
    try:
        marks = tuple(_dump_mark(t, line, mounts) for line in lines[1:])
    finally:
        mounts.close()
    return FanotifyState(init_flags=init_flags & ~(FAN_CLOEXEC | FAN_NONBLOCK), event_flags=event_flags,
                         marks=marks, flags=info.flags & O_NONBLOCK)


def _dump_mark(t: _Target, line: str, mounts: _Mounts) -> FanotifyMark:
    """One fanotify mark line of fdinfo: its object by path."""
    fields = dict(item.partition(":")[::2] for item in line.split())
    try:
        mflags, mask, ignored = (int(fields[k], 16) for k in ("mflags", "mask", "ignored_mask"))
        if "ino" in fields:
            kind, dev, ino = 0, _kernel_dev(int(fields["sdev"], 16)), int(fields["ino"], 16)
        elif "mnt_id" in fields:
            kind, mnt_id = 1, int(fields["mnt_id"], 16)
        elif "sdev" in fields:
            kind, dev = 2, _kernel_dev(int(fields["sdev"], 16))
        else:
            raise KeyError("kind")
    except (KeyError, ValueError):
        raise t.unsupported(f"a fanotify mark this version does not know: {line!r}") from None
    if kind == 0:
        where = f"fanotify mark on inode {ino} (device {os.major(dev)}:{os.minor(dev)})"
        path = _path_of_mark(t, fields, dev, ino, mounts, where, line)
        if path.endswith(_DELETED):
            raise t.unsupported(f"{where}: the file is deleted ({path})")
    elif kind == 1:
        path = mounts.point_of(mnt_id)
        if path is None:
            raise t.unsupported(f"fanotify mark on mount {mnt_id}: a mount ptckpt does not see")
    else:
        path = mounts.root_of(dev)
        if path is None:
            raise t.unsupported(f"fanotify mark on the file system of device {os.major(dev)}:"
                                f"{os.minor(dev)}: no mount of it is visible to ptckpt")
    return FanotifyMark(kind=kind, path=path, mflags=mflags, mask=mask, ignored_mask=ignored)


class _Mounts:
    """ptckpt's mounts by device, opened lazily, to open file handles against."""

    def __init__(self) -> None:
        found: dict[int, list[tuple[bool, str]]] = {}
        self._by_id: dict[int, str] = {}
        for line in _read_mountinfo():
            left = line.partition(b" - ")[0].split(b" ")
            major, minor = (int(x) for x in left[2].split(b":"))
            root, point = _unescape(left[3]), _unescape(left[4])
            found.setdefault(os.makedev(major, minor), []).append((root != "/", point))
            self._by_id[int(left[0])] = point
        # Mounts of the whole file system first: every inode is below their root.
        self._by_dev = {dev: [point for _, point in sorted(points, key=lambda p: p[0])]
                        for dev, points in found.items()}
        self._open: dict[str, int] = {}

    def point_of(self, mnt_id: int) -> str | None:
        """The mount point of mount `mnt_id`, None if ptckpt does not see it."""
        return self._by_id.get(mnt_id)

    def root_of(self, dev: int) -> str | None:
        """A mount point of the whole file system of `dev` (or of a part of it)."""
        points = self._by_dev.get(dev)
        return points[0] if points else None

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()

    def resolve(self, dev: int, ino: int, handle: bytes) -> tuple[str | None, str]:
        """(path of the inode, "") or (None, why not), trying each mount of `dev`."""
        points = self._by_dev.get(dev)
        if not points:
            return None, "no mount of its device is visible to ptckpt"
        why = ""
        for point in points:
            try:
                mount_fd = self._mount_fd(point)
                path = _path_of_handle(mount_fd, handle, ino)
            except OSError as err:
                why = f"open_by_handle_at through {point}: {err.strerror or err}"
                continue
            if path is not None:
                return path, ""
            why = f"no path through {point} leads to the inode (deleted or disconnected)"
        return None, why

    def _mount_fd(self, point: str) -> int:
        fd = self._open.get(point)
        if fd is None:
            # open_by_handle_at refuses an O_PATH fd (EBADF); the mount point is a
            # directory, or a bind-mounted file at most.
            fd = self._open[point] = os.open(point, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY
                                             | O_CLOEXEC)
        return fd


    def open_handle(self, dev: int, handle: bytes, flags: int) -> int:
        """An fd of the inode of `handle` on device `dev` (open_by_handle_at through one of
        its mounts), opened with `flags`; OSError if none works (ESTALE: it is gone)."""
        failed: OSError = FileNotFoundError(f"no mount of device {os.major(dev)}:{os.minor(dev)} "
                                            f"is visible to ptckpt")
        for point in self._by_dev.get(dev, []):
            try:
                return _check(_open_by_handle_at(self._mount_fd(point), handle, flags), "open_by_handle_at")
            except OSError as err:
                failed = err
        raise failed


def file_handle(fd: int) -> bytes:
    """name_to_handle_at(2) of an open file: struct file_handle (handle_bytes, handle_type,
    f_handle), the way open_by_handle_at takes it; b"" if its file system gives none."""
    buf = ctypes.create_string_buffer(struct.pack("Ii", MAX_HANDLE_SZ, 0) + bytes(MAX_HANDLE_SZ))
    mount_id = _c_int()
    if _name_to_handle_at(fd, b"", buf, ctypes.byref(mount_id), AT_EMPTY_PATH) < 0:
        return b""
    size = struct.unpack_from("I", buf.raw)[0]
    return buf.raw[:8 + size]


def open_file_handle(dev: int, handle: bytes, flags: int) -> int:
    """An fd of the file of `handle` (file_handle) on device `dev`, opened with `flags`."""
    mounts = _Mounts()
    try:
        fd = mounts.open_handle(dev, handle, flags)
    finally:
        mounts.close()
    return fd


def _path_of_handle(mount_fd: int, handle: bytes, ino: int) -> str | None:
    """The path of the inode of `handle`, checked by looking it up again; None if none leads there."""
    fd = _check(_open_by_handle_at(mount_fd, handle, O_PATH | O_CLOEXEC), "open_by_handle_at")
    try:
        st = os.fstat(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    if st.st_ino != ino or not path.startswith("/"):
        return None
    if path.endswith(_DELETED):
        return path if st.st_nlink == 0 else None     # deleted, not merely disconnected
    try:
        again = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return path if (again.st_dev, again.st_ino) == (st.st_dev, st.st_ino) else None


def _read_mountinfo() -> list[bytes]:
    with open("/proc/self/mountinfo", "rb") as f:
        return f.read().splitlines()


def _unescape(field: bytes) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as \\ooo."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))


def _dump_memfd(t: _Target, info: procfs.FdInfo) -> MemfdState:
    name = t.link.removeprefix("/memfd:").removesuffix(" (deleted)")
    with _copy(t) as copy:
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


def fs_type(fd: int) -> int:
    """The file system magic (statfs f_type) of the file `fd` is open on."""
    buf = _Statfs()
    _check(_fstatfs(fd, ctypes.byref(buf)), "fstatfs")
    return buf.f_type & 0xFFFFFFFF


def is_mqueue(pid: int, fd: int) -> bool:
    """Is fd `fd` of `pid` a POSIX message queue?  (mq_open(3) opens it on the IPC
    namespace's internal mount, which /proc/PID/mountinfo does not list.)"""
    try:
        with _copy(_Target(pid, fd, "")) as copy:
            return fs_type(copy) == MQUEUE_MAGIC
    except OSError:
        return False


def _dump_mqueue(t: _Target, info: procfs.FdInfo) -> MqueueState:
    path = t.link.removesuffix(" (deleted)")
    name = "/" + path.rsplit("/", 1)[-1]
    with _copy(t) as copy:
        if fs_type(copy) != MQUEUE_MAGIC:
            raise t.unsupported("not a POSIX message queue")
        attr = _getattr(copy)
        st = os.fstat(copy)
        # A description of our own, non-blocking and readable whatever the target's is.
        own = os.open(f"/proc/self/fd/{copy}", os.O_RDWR | O_NONBLOCK | O_CLOEXEC)
    try:
        notify_pid = _mq_status(own).get("NOTIFY_PID", "0")
        if notify_pid != "0":
            raise t.unsupported(f"an mq_notify registration (by pid {notify_pid})")
        messages = _take_and_put_back(t, own, attr.mq_msgsize)
    finally:
        os.close(own)
    if len(messages) != attr.mq_curmsgs:
        raise PtckptError(f"process {t.pid} fd {t.fd} ({t.link}): held {attr.mq_curmsgs} "
                          f"messages but {len(messages)} were read: another process uses it")
    return MqueueState(name=name, maxmsg=attr.mq_maxmsg, msgsize=attr.mq_msgsize,
                       flags=attr.mq_flags & O_NONBLOCK, messages=tuple(messages),
                       mode=_stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                       unlinked=t.link.endswith(" (deleted)"))


def _take_and_put_back(t: _Target, qd: int, msgsize: int) -> list[tuple[int, bytes]]:
    """Every message of the queue, received and sent back in the same order.

    What was received is sent back even when receiving fails halfway.
    """
    messages: list[tuple[int, bytes]] = []
    try:
        _drain(qd, msgsize, messages)
    finally:
        try:
            _refill(qd, messages)
        except OSError as err:
            raise PtckptError(f"process {t.pid} fd {t.fd} ({t.link}): could not put its "
                              f"messages back ({err.strerror}); the queue lost some") from None
    return messages


def _getattr(qd: int) -> _MqAttr:
    attr = _MqAttr()
    _check(_mq_getattr(qd, ctypes.byref(attr)), "mq_getattr")
    return attr


def _mq_status(qd: int) -> dict[str, str]:
    """The queue's status line ("QSIZE:.. NOTIFY:.. SIGNO:.. NOTIFY_PID:..") as a dict."""
    text = os.pread(qd, 256, 0).decode(errors="replace")
    return dict(re.findall(r"([A-Z_]+):(\S+)", text))


def _drain(qd: int, msgsize: int,
           out: list[tuple[int, bytes]] | None = None) -> list[tuple[int, bytes]]:
    """Receive every message of the non-blocking queue `qd` into `out`: [(priority, bytes)]."""
    buf = ctypes.create_string_buffer(max(msgsize, 1))
    prio = ctypes.c_uint()
    out = [] if out is None else out
    while True:
        n = _mq_receive(qd, buf, len(buf), ctypes.byref(prio))
        if n < 0:
            err = ctypes.get_errno()
            if err == _errno.EAGAIN:
                return out
            raise OSError(err, f"mq_receive: {os.strerror(err)}")
        out.append((prio.value, buf.raw[:n]))


def _refill(qd: int, messages: list[tuple[int, bytes]] | tuple[tuple[int, bytes], ...]) -> None:
    """Send `messages` in order: within a priority they queue in sending order."""
    for prio, data in messages:
        _check(_mq_send(qd, data, len(data), prio), "mq_send")


_DUMPERS = {
    FdKind.EVENTFD: _dump_eventfd,
    FdKind.TIMERFD: _dump_timerfd,
    FdKind.SIGNALFD: _dump_signalfd,
    FdKind.INOTIFY: _dump_inotify,
    FdKind.MEMFD: _dump_memfd,
    FdKind.MQUEUE: _dump_mqueue,
    FdKind.FANOTIFY: _dump_fanotify,
}


# --- restore half --------------------------------------------------------------

def create_anon_fd(state: AnonFdState, flags: int, ghosts: dict | None = None) -> int:
    """Make the object of `state` in ptckpt: its fd (close-on-exec; the caller owns it).

    `flags` are the open flags of the recorded description: the access mode
    (memfd, mqueue) and the status flags such as O_NONBLOCK are set from them.
    `ghosts` gives the path of each deleted file made again ({("ghost", dev, ino): path}),
    where an inotify watch on a deleted file is put (the caller unlinks it afterwards,
    and once the tree is rebuilt reads away the events the restore queued:
    :func:`drain_inotify`).
    Raises RestoreFailed naming the object.
    """
    maker = _MAKERS.get(type(state))
    if maker is None:
        raise TypeError(f"not an anonymous-fd state: {state!r}")
    try:
        if isinstance(state, InotifyState):
            return _make_inotify(state, flags, ghosts or {})
        return maker(state, flags)
    except OSError as err:
        raise RestoreFailed(f"cannot recreate {describe(state)}: {err.strerror or err}") from None


def describe(state: AnonFdState) -> str:
    """A short name of the object for messages: 'eventfd (count 5)', 'mqueue /q' ..."""
    if isinstance(state, EventfdState):
        return f"eventfd (count {state.count})"
    if isinstance(state, TimerfdState):
        return f"timerfd (clock {state.clockid})"
    if isinstance(state, SignalfdState):
        return f"signalfd (mask {state.mask:#x})"
    if isinstance(state, InotifyState):
        return f"inotify ({len(state.watches)} watches)"
    if isinstance(state, MemfdState):
        return f"memfd:{state.name}"
    if isinstance(state, FanotifyState):
        return f"fanotify group ({len(state.marks)} marks)"
    return f"mqueue {state.name}"


@contextlib.contextmanager
def _closing_on_error(fd: int) -> Iterator[int]:
    """`fd`, closed if the block raises."""
    try:
        yield fd
    except BaseException:
        os.close(fd)
        raise


def _set_status_flags(fd: int, flags: int) -> None:
    """O_NONBLOCK, O_APPEND, O_NOATIME of the description as recorded."""
    current = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, current & ~_SETFL_MASK | flags & _SETFL_MASK)


def _make_eventfd(state: EventfdState, flags: int) -> int:
    if not 0 <= state.count <= _EVENTFD_MAX:
        raise OSError(_errno.EINVAL, f"count {state.count} out of range")
    fd = os.eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK | (state.flags & EFD_SEMAPHORE))
    with _closing_on_error(fd):
        if state.count:
            os.eventfd_write(fd, state.count)     # the initial value of eventfd() is 32 bits
        _set_status_flags(fd, flags)
    return fd


def _make_timerfd(state: TimerfdState, flags: int) -> int:
    fd = _check(_timerfd_create(state.clockid, TFD_CLOEXEC | TFD_NONBLOCK), "timerfd_create")
    with _closing_on_error(fd):
        if state.armed:
            absolute = bool(state.settime_flags & TFD_TIMER_ABSTIME)
            value = state.expires_ns if absolute else state.value_ns
            spec = _Itimerspec(_timespec(state.interval_ns), _timespec(value))
            _check(_timerfd_settime(fd, state.settime_flags, ctypes.byref(spec), None),
                   "timerfd_settime")
        if state.ticks:
            # settime cleared the ticks; the ioctl sets them (and refuses 0).
            fcntl.ioctl(fd, TFD_IOC_SET_TICKS, struct.pack("Q", state.ticks))
        _set_status_flags(fd, flags)
    return fd


def _timespec(ns: int) -> _Timespec:
    return _Timespec(ns // 1_000_000_000, ns % 1_000_000_000)


def _make_signalfd(state: SignalfdState, flags: int) -> int:
    sigset = struct.pack("Q", state.mask) + bytes(120)      # glibc's sigset_t is 128 bytes
    fd = _check(_signalfd(-1, sigset, SFD_CLOEXEC | SFD_NONBLOCK), "signalfd")
    with _closing_on_error(fd):
        _set_status_flags(fd, flags)
    return fd


def _make_inotify(state: InotifyState, flags: int, ghosts: dict | None = None) -> int:
    watches = state.watches
    if state.deleted:
        where = {wd: ghosts.get(("ghost", dev, ino)) if ghosts else None for wd, dev, ino in state.deleted}
        missing = [wd for wd, path in where.items() if path is None]
        if missing:
            raise OSError(_errno.ENOENT, f"watch {missing[0]} is on a deleted file that was not made again")
        watches = tuple(w._replace(path=where[w.wd]) if w.wd in where else w for w in watches)
    fd = _check(_inotify_init1(IN_CLOEXEC | IN_NONBLOCK), "inotify_init1")
    with _closing_on_error(fd):
        placeholder = os.memfd_create("ptckpt-inotify-placeholder", MFD_CLOEXEC)
        try:
            skipped = _add_watches(fd, watches, f"/proc/self/fd/{placeholder}")
        finally:
            os.close(placeholder)
        if skipped:
            _drain_inotify(fd)
        _set_status_flags(fd, flags)
    return fd


def _add_watches(fd: int, watches: tuple[InotifyWatch, ...], placeholder: str) -> int:
    """Add `watches` to the fresh instance `fd` at their wds: how many numbers were skipped.

    wds come from a cyclic counter, so each number below the next watch's is
    used up by adding and removing a watch on `placeholder`.
    """
    next_wd, skipped = 1, 0
    for w in sorted(watches):
        if w.wd < next_wd:
            raise OSError(_errno.EINVAL, f"watch {w.wd} ({w.path}) is out of order")
        while next_wd < w.wd:
            got = _check(_inotify_add_watch(fd, os.fsencode(placeholder), IN_ATTRIB),
                         "inotify_add_watch (placeholder)")
            _check(_inotify_rm_watch(fd, got), "inotify_rm_watch (placeholder)")
            if got != next_wd:
                raise OSError(_errno.EINVAL, f"the kernel gave wd {got} instead of {next_wd}")
            next_wd, skipped = got + 1, skipped + 1
            if skipped % 4096 == 0:
                _drain_inotify(fd)        # keep the IN_IGNORED events below the queue limit
        got = _check(_inotify_add_watch(fd, os.fsencode(w.path), w.mask | IN_DONT_FOLLOW),
                     f"inotify_add_watch {w.path}")
        if got != w.wd:
            raise OSError(_errno.EINVAL, f"{w.path} got wd {got} instead of {w.wd} (is it "
                                         f"the same file as another watch now?)")
        next_wd = got + 1
    return skipped


def drain_inotify(fd: int) -> None:
    """Read away the events a restore queued on inotify instance `fd` (reopening the files it
    watches, unlinking the deleted ones again), whatever the description's O_NONBLOCK."""
    current = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, current | O_NONBLOCK)
    try:
        _drain_inotify(fd)
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, current)


def _drain_inotify(fd: int) -> None:
    """Read away every queued event of the non-blocking instance `fd`."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 65536):
            pass


def _make_fanotify(state: FanotifyState, flags: int) -> int:
    """The group, without its marks yet (:func:`mark_fanotify`: added once the restore has
    opened every file, so that its own opens queue no events)."""
    fd = _check(_fanotify_init(state.init_flags | FAN_CLOEXEC | FAN_NONBLOCK, state.event_flags),
                "fanotify_init")
    with _closing_on_error(fd):
        _set_status_flags(fd, flags)
    return fd


def mark_fanotify(fd: int, state: FanotifyState) -> None:
    """Add the marks of `state` to the group `fd` made by :func:`create_anon_fd`."""
    for m in state.marks:
        kind = _FAN_KIND_FLAG[m.kind]
        what = f"fanotify_mark ({FANOTIFY_MARK_KINDS.get(m.kind)} {m.path})"
        try:
            if m.mask:
                _check(_fanotify_mark(fd, FAN_MARK_ADD | kind | m.mflags & FAN_MARK_EVICTABLE, m.mask,
                                      -100, os.fsencode(m.path)), what)
            if m.ignored_mask:
                ignore = FAN_MARK_IGNORE if m.mflags & FAN_MARK_IGNORE else FAN_MARK_IGNORED_MASK
                _check(_fanotify_mark(fd, FAN_MARK_ADD | kind | ignore
                                      | m.mflags & (FAN_MARK_EVICTABLE | FAN_MARK_IGNORED_SURV_MODIFY),
                                      m.ignored_mask, -100, os.fsencode(m.path)), what)
        except OSError as err:
            raise RestoreFailed(f"cannot mark the fanotify group again: {err.strerror or err}") from None


def _make_memfd(state: MemfdState, flags: int) -> int:
    noexec = bool(state.seals & F_SEAL_EXEC) and not state.mode & 0o111
    fd = _memfd_create(state.name, MFD_CLOEXEC | MFD_ALLOW_SEALING
                       | (MFD_NOEXEC_SEAL if noexec else MFD_EXEC))
    with _closing_on_error(fd):
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
    with _closing_on_error(fd):
        os.lseek(fd, state.pos, os.SEEK_SET)
        _set_status_flags(fd, flags)
    return fd


def reopen_memfd(fd: int, state: MemfdState, flags: int) -> int:
    """Another open file description of the memfd `fd` (which holds state's contents
    already): its own access mode, offset and status flags, as another process's open of
    /proc/PID/fd/N made it.  The caller owns the fd."""
    try:
        again = os.open(f"/proc/self/fd/{fd}", flags & O_ACCMODE | O_CLOEXEC)
    except OSError as err:
        raise RestoreFailed(f"cannot open {describe(state)} again: {err.strerror or err}") from None
    with _closing_on_error(again):
        os.lseek(again, state.pos, os.SEEK_SET)
        _set_status_flags(again, flags)
    return again


def _memfd_create(name: str, mfd_flags: int) -> int:
    """memfd_create, without MFD_EXEC / MFD_NOEXEC_SEAL on kernels before 6.3."""
    try:
        return os.memfd_create(name, mfd_flags)
    except OSError as err:
        if err.errno != _errno.EINVAL or not mfd_flags & (MFD_EXEC | MFD_NOEXEC_SEAL):
            raise
        return os.memfd_create(name, mfd_flags & ~(MFD_EXEC | MFD_NOEXEC_SEAL))


def _make_mqueue(state: MqueueState, flags: int) -> int:
    qd = _open_queue(state)
    try:
        _drain(qd, state.msgsize)
        try:
            _refill(qd, state.messages)
        except BlockingIOError:
            raise OSError(_errno.EAGAIN, f"its {len(state.messages)} messages do not fit") from None
        fd = _reopen_queue(state, qd, flags & O_ACCMODE)
    finally:
        os.close(qd)
    with _closing_on_error(fd):
        _set_status_flags(fd, flags)
    return fd


def _reopen_queue(state: MqueueState, qd: int, access: int) -> int:
    """A description of the queue with the recorded access mode, made as mq_open(3) makes
    one: an open() through /proc/self/fd would add O_LARGEFILE, which F_GETFL then shows."""
    if access == os.O_RDWR:
        return fcntl.fcntl(qd, fcntl.F_DUPFD_CLOEXEC, 0)
    if not state.unlinked:
        return _check(_mq_open(os.fsencode(state.name), access | O_CLOEXEC | O_NONBLOCK, 0, None),
                      f"mq_open {state.name}")
    return os.open(f"/proc/self/fd/{qd}", access | O_CLOEXEC)     # no name left to open it by


def _open_queue(state: MqueueState) -> int:
    """A non-blocking O_RDWR description of the queue: the existing one of the name
    (same attributes required), or a new one (unlinked again if it was)."""
    attr = _MqAttr(0, state.maxmsg, state.msgsize, 0)
    create = os.O_RDWR | O_NONBLOCK | os.O_CREAT | os.O_EXCL
    if state.unlinked:
        name = f"/ptckpt-{os.getpid()}-{time.monotonic_ns()}"
        qd = _check(_mq_open(os.fsencode(name), create, state.mode, ctypes.byref(attr)),
                    f"mq_open {name}")
        _mq_unlink(os.fsencode(name))
        created = True
    else:
        qd = _mq_open(os.fsencode(state.name), create, state.mode, ctypes.byref(attr))
        created = qd >= 0
        if not created:
            if ctypes.get_errno() != _errno.EEXIST:
                _check(qd, f"mq_open {state.name}")
            qd = _check(_mq_open(os.fsencode(state.name), os.O_RDWR | O_NONBLOCK, 0, None),
                        f"mq_open {state.name}")
    with _closing_on_error(qd):
        if created:
            os.fchown(qd, state.uid, state.gid)
            os.fchmod(qd, state.mode)         # mq_open applied the umask
        else:
            have = _getattr(qd)
            if (have.mq_maxmsg, have.mq_msgsize) != (state.maxmsg, state.msgsize):
                raise OSError(_errno.EEXIST, f"a queue of that name exists with maxmsg "
                                             f"{have.mq_maxmsg} and msgsize {have.mq_msgsize}, "
                                             f"not {state.maxmsg} and {state.msgsize}")
    return qd


_MAKERS = {
    EventfdState: _make_eventfd,
    TimerfdState: _make_timerfd,
    SignalfdState: _make_signalfd,
    InotifyState: _make_inotify,
    MemfdState: _make_memfd,
    MqueueState: _make_mqueue,
    FanotifyState: _make_fanotify,
}
