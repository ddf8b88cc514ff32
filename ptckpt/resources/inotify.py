"""inotify fds: the watches by path at their watch descriptors, and the instance again.

Dump half (:func:`dump`, through resources.anonfds.dump_anon_fd), from its fdinfo and a
copy of the fd (pidfd_getfd), which shares the target's open file description:

inotify: one fdinfo line per watch (``wd``, ``ino``, ``sdev``, ``mask`` and
``ignored_mask`` in hex, then ``fhandle-bytes``, ``fhandle-type``, ``f_handle``). A watch
holds an inode, not a path: the path is found by opening the file handle with
open_by_handle_at(2) (needs CAP_DAC_READ_SEARCH) relative to a mount of the device
``sdev`` (the kernel's dev_t, major << 20 | minor) found in ptckpt's /proc/self/mountinfo,
and reading the link of the fd obtained; it is accepted only when that path, looked up
again, is the very inode. A watch on a deleted file (the handle opens an inode with no
links left) is recorded at the path it had, with its (st_dev, st_ino): the dump keeps it
only when the tree holds that file open or mapped, so the file is a ghost file of the
image. Unread events cannot be read without consuming them, so an inotify fd with queued
events (FIONREAD) is refused.

Restore half (:func:`make`, through resources.anonfds.create_anon_fd), with the
status flags (O_NONBLOCK ...) of the recorded description:

inotify with the same watches and the same watch descriptors. The kernel hands out wds
cyclically (idr_alloc_cyclic from 1: a removed wd is not reused, a fresh instance starts
at 1), so a gap is skipped by adding and removing a placeholder watch (on a memfd of
ptckpt's, an inode nobody else watches) once per missing number; the IN_IGNORED events
this queues are read away before the fd is handed over; a watch on a deleted file is put
on the ghost file made again (the very inode the restored fds open); the events the rest
of the restore queues (its opens of the tree's files, the ghosts' unlinks) are read away
once the tree is rebuilt (:func:`drain_inotify`);

Limits: queued events are refused (not lost); the next wd the group would have handed out is
max(wd) + 1 after restore, while the original may have been further on (its removed top
wds leave no trace); add-time flags (IN_MASK_ADD, IN_ONLYDIR, IN_MASK_CREATE) are not kept
(IN_ONESHOT and IN_EXCL_UNLINK are); a watch on a file system without file handles
(procfs, sysfs ...), on a deleted file no fd or mapping of the tree holds (another process
does), on a mount ptckpt does not see, or whose dentry the kernel can only give
disconnected, is refused; events that happen to the watched files during the restore,
until the tree is rebuilt, are read away with the restore's own; paths are ptckpt's view
of the mounts (the target must share ptckpt's mount namespace).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import fcntl
import os
import struct

from .. import procfs
from ..errors import UnsupportedResource
from ..formats.model import Fd, FdKind, InotifyState, InotifyWatch
from .fdstate import (DELETED, O_CLOEXEC, O_NONBLOCK, FdKindOps, Target, check, closing_on_error, proto,
                      refuse_unread_events, set_status_flags)
from .fhandles import Mounts, kernel_dev, path_of_mark

IN_NONBLOCK = O_NONBLOCK
IN_CLOEXEC = O_CLOEXEC
IN_ATTRIB = 0x00000004
IN_IGNORED = 0x00008000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ONESHOT = 0x80000000
_INOTIFY_EVENT = struct.Struct("iIII")     # wd, mask, cookie, len (then the name)
MFD_CLOEXEC = 0x1

_c_int = ctypes.c_int
_inotify_init1 = proto("inotify_init1", _c_int, _c_int)
_inotify_add_watch = proto("inotify_add_watch", _c_int, _c_int, ctypes.c_char_p, ctypes.c_uint32)
_inotify_rm_watch = proto("inotify_rm_watch", _c_int, _c_int, _c_int)


# --- dump half -----------------------------------------------------------------

def dump(t: Target, info: procfs.FdInfo) -> InotifyState:
    refuse_unread_events(t, "inotify")
    mounts = Mounts()
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


def check_deleted_watches(fds: dict[int, list[Fd]], states: list, ghosts: set) -> None:
    """An inotify watch on a deleted file needs the file in the image (a ghost file: its
    key in `ghosts`); `states`: the tree's fd states, `fds`: its members' fds."""
    for state in states:
        if isinstance(state, InotifyState):
            bad = deleted_watches_unheld(state, ghosts)
            if bad:
                p, f = next((p, f) for p, flist in fds.items() for f in flist if f.desc == state.desc)
                raise UnsupportedResource(p, f"fd {f.fd} ({f.path}): {bad[0]}")


def _dump_watch(t: Target, line: str, mounts: Mounts) -> tuple[InotifyWatch, tuple[int, int] | None]:
    """One 'inotify wd:.. ino:.. sdev:.. mask:.. ... f_handle:..' line, its path resolved:
    (the watch, None), or for a deleted file (the watch at its old path, (st_dev, st_ino))."""
    fields = dict(item.partition(":")[::2] for item in line.split())
    try:
        wd, ino, sdev, mask = (int(fields[k], 16) for k in ("wd", "ino", "sdev", "mask"))
    except (KeyError, ValueError):
        raise t.unsupported(f"an inotify fdinfo line not understood: {line!r}") from None
    dev = kernel_dev(sdev)
    where = f"inotify watch {wd} (inode {ino} on device {os.major(dev)}:{os.minor(dev)})"
    path = path_of_mark(t, fields, dev, ino, mounts, where, line)
    if path.endswith(DELETED):
        return InotifyWatch(wd=wd, path=path.removesuffix(DELETED), mask=mask), (dev, ino)
    return InotifyWatch(wd=wd, path=path, mask=mask), None


# --- restore half --------------------------------------------------------------

def make(state: InotifyState, flags: int, ghosts: dict | None = None) -> int:
    watches = state.watches
    if state.deleted:
        where = {wd: ghosts.get(("ghost", dev, ino)) if ghosts else None for wd, dev, ino in state.deleted}
        missing = [wd for wd, path in where.items() if path is None]
        if missing:
            raise OSError(_errno.ENOENT, f"watch {missing[0]} is on a deleted file that was not made again")
        watches = tuple(w._replace(path=where[w.wd]) if w.wd in where else w for w in watches)
    fd = check(_inotify_init1(IN_CLOEXEC | IN_NONBLOCK), "inotify_init1")
    with closing_on_error(fd):
        placeholder = os.memfd_create("ptckpt-inotify-placeholder", MFD_CLOEXEC)
        try:
            skipped = _add_watches(fd, watches, f"/proc/self/fd/{placeholder}")
        finally:
            os.close(placeholder)
        if skipped:
            _drain_inotify(fd)
        set_status_flags(fd, flags)
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
            got = check(_inotify_add_watch(fd, os.fsencode(placeholder), IN_ATTRIB),
                         "inotify_add_watch (placeholder)")
            check(_inotify_rm_watch(fd, got), "inotify_rm_watch (placeholder)")
            if got != next_wd:
                raise OSError(_errno.EINVAL, f"the kernel gave wd {got} instead of {next_wd}")
            next_wd, skipped = got + 1, skipped + 1
            if skipped % 4096 == 0:
                _drain_inotify(fd)        # keep the IN_IGNORED events below the queue limit
        got = check(_inotify_add_watch(fd, os.fsencode(w.path), w.mask | IN_DONT_FOLLOW),
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


def describe(state: InotifyState) -> str:
    return f"inotify ({len(state.watches)} watches)"


KIND = FdKindOps(FdKind.INOTIFY, InotifyState, dump, make, describe, takes_ghosts=True)
