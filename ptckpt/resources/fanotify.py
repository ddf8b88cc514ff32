"""fanotify fds: the group's flags and marks, and the group again.

Dump half (:func:`dump`, through resources.anonfds.dump_anon_fd), from its fdinfo and a
copy of the fd (pidfd_getfd), which shares the target's open file description:

fanotify: ``fanotify flags:.. event-flags:..`` (fanotify_init's flags and event_f_flags),
then one line per mark: on an inode (``ino``, ``sdev`` and a file handle, resolved to a
path as for inotify), a mount (``mnt_id``, its mount point in ptckpt's mountinfo) or a
file system (``sdev``, a mount of it), with ``mflags`` (the FAN_MARK_* flags it was added
with that the kernel keeps), ``mask`` and ``ignored_mask``. A group of the content or
pre-content class (permission events: those read and not yet answered cannot be seen) and
a group with unread events are refused.

Restore half (:func:`make`, through resources.anonfds.create_anon_fd), with the
status flags (O_NONBLOCK ...) of the recorded description:

fanotify with its init flags and event flags; its marks are added by :func:`mark_fanotify`
once the restore has opened every file of the tree (else its own opens would be queued as
events);

Limits: marks by path (ptckpt's view of the mounts), so a mark on a deleted file or a mount ptckpt
does not see is refused; a mark of a kind this version does not know (mount namespace
marks) is refused; events that happen between the marks and the resume are the restored
program's to read.
"""

from __future__ import annotations

import ctypes
import os

from .. import procfs
from ..errors import RestoreFailed
from ..formats.model import FANOTIFY_MARK_KINDS, FanotifyMark, FanotifyState, FdKind
from .fdstate import (DELETED, O_NONBLOCK, FdKindOps, Target, check, closing_on_error, proto, refuse_unread_events,
                      set_status_flags)
from .fhandles import Mounts, kernel_dev, path_of_mark

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

_c_int, _c_uint = ctypes.c_int, ctypes.c_uint
_fanotify_init = proto("fanotify_init", _c_int, _c_uint, _c_uint)
_fanotify_mark = proto("fanotify_mark", _c_int, _c_int, _c_uint, ctypes.c_uint64, _c_int, ctypes.c_char_p)


# --- dump half -----------------------------------------------------------------

def dump(t: Target, info: procfs.FdInfo) -> FanotifyState:
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
    refuse_unread_events(t, "fanotify")
    mounts = Mounts()
    try:
        marks = tuple(_dump_mark(t, line, mounts) for line in lines[1:])
    finally:
        mounts.close()
    return FanotifyState(init_flags=init_flags & ~(FAN_CLOEXEC | FAN_NONBLOCK), event_flags=event_flags,
                         marks=marks, flags=info.flags & O_NONBLOCK)


def _dump_mark(t: Target, line: str, mounts: Mounts) -> FanotifyMark:
    """One fanotify mark line of fdinfo: its object by path."""
    fields = dict(item.partition(":")[::2] for item in line.split())
    try:
        mflags, mask, ignored = (int(fields[k], 16) for k in ("mflags", "mask", "ignored_mask"))
        if "ino" in fields:
            kind, dev, ino = 0, kernel_dev(int(fields["sdev"], 16)), int(fields["ino"], 16)
        elif "mnt_id" in fields:
            kind, mnt_id = 1, int(fields["mnt_id"], 16)
        elif "sdev" in fields:
            kind, dev = 2, kernel_dev(int(fields["sdev"], 16))
        else:
            raise KeyError("kind")
    except (KeyError, ValueError):
        raise t.unsupported(f"a fanotify mark this version does not know: {line!r}") from None
    if kind == 0:
        where = f"fanotify mark on inode {ino} (device {os.major(dev)}:{os.minor(dev)})"
        path = path_of_mark(t, fields, dev, ino, mounts, where, line)
        if path.endswith(DELETED):
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


# --- restore half --------------------------------------------------------------

def make(state: FanotifyState, flags: int) -> int:
    """The group, without its marks yet (:func:`mark_fanotify`: added once the restore has
    opened every file, so that its own opens queue no events)."""
    fd = check(_fanotify_init(state.init_flags | FAN_CLOEXEC | FAN_NONBLOCK, state.event_flags),
                "fanotify_init")
    with closing_on_error(fd):
        set_status_flags(fd, flags)
    return fd


def mark_fanotify(fd: int, state: FanotifyState) -> None:
    """Add the marks of `state` to the group `fd` made by :func:`create_anon_fd`."""
    for m in state.marks:
        kind = _FAN_KIND_FLAG[m.kind]
        what = f"fanotify_mark ({FANOTIFY_MARK_KINDS.get(m.kind)} {m.path})"
        try:
            if m.mask:
                check(_fanotify_mark(fd, FAN_MARK_ADD | kind | m.mflags & FAN_MARK_EVICTABLE, m.mask,
                                      -100, os.fsencode(m.path)), what)
            if m.ignored_mask:
                ignore = FAN_MARK_IGNORE if m.mflags & FAN_MARK_IGNORE else FAN_MARK_IGNORED_MASK
                check(_fanotify_mark(fd, FAN_MARK_ADD | kind | ignore
                                      | m.mflags & (FAN_MARK_EVICTABLE | FAN_MARK_IGNORED_SURV_MODIFY),
                                      m.ignored_mask, -100, os.fsencode(m.path)), what)
        except OSError as err:
            raise RestoreFailed(f"cannot mark the fanotify group again: {err.strerror or err}") from None


def describe(state: FanotifyState) -> str:
    return f"fanotify group ({len(state.marks)} marks)"


KIND = FdKindOps(FdKind.FANOTIFY, FanotifyState, dump, make, describe)
