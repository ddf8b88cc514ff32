"""Memory tracking between dumps: which pages a process wrote since its last dump.

This kernel has no soft-dirty bit (CONFIG_MEM_SOFT_DIRTY is off), so tracking is
userfaultfd write-protection in asynchronous mode (UFFD_FEATURE_WP_ASYNC, Linux
6.7): a write to a protected page is let through by the kernel at once and only
clears the page's uffd-wp bit, which PAGEMAP_SCAN reports as PAGE_IS_WRITTEN.
Nobody has to answer a fault, so the process runs at full speed between dumps.

Dump side, all while the process is frozen:

* :func:`prepare_frozen` finds the process's tracking userfaultfd (one a
  previous dump left, recorded in a state file), or makes one by injecting
  userfaultfd() into the process and moving it to a high fd with close-on-exec.
  ptckpt works on a pidfd_getfd copy: a userfaultfd's ioctls act on the memory
  of the process that created it, whoever calls them.
* :meth:`Tracker.written` lists the pages written since the protection was set
  (the incremental dump reads only these); pages of mappings made since then,
  or that the registration could not take, have no uffd-wp bit and so count as
  written: an unknown page is always saved, never assumed unchanged.
* :meth:`Tracker.protect` registers every private mapping (new ones too) and
  write-protects every page there: the point the next increment starts from.
* :meth:`Tracker.commit` records, once the image is committed, which image the
  protection belongs to; :meth:`Tracker.forget` removes the record after a dump
  that failed (the bits were reset for an image that does not exist, so the
  next incremental dump must write everything).

The record is a state file per process in /run/ptckpt/memtrack (or
$XDG_RUNTIME_DIR/ptckpt/memtrack), keyed by pid and start time: image id, the
pid the image gives the process, the fd and the userfaultfd's inode.  A dump
with --prev DIR uses the tracking only when the record names DIR's image and
the fd is still that userfaultfd; otherwise the process's pages are written in
full (and a line says why).  Only the tracking fd is left in the process; the
dumps leave it out of the image (:func:`tracked_inos`).

Only private memory is tracked: a MAP_SHARED page written through another
process's mapping would not clear this process's bit.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from .. import procfs
from ..errors import PtckptError
from ..formats.model import Vma, VmaKind
from ..tracee import pidfd_getfd
from .memory import merge_spans

UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F                 # _IOWR(0xAA, 0x3F, struct uffdio_api)
UFFDIO_REGISTER = 0xC020AA00            # _IOWR(0xAA, 0x00, struct uffdio_register)
UFFDIO_REGISTER_MODE_WP = 1 << 1
UFFDIO_WRITEPROTECT = 0xC018AA06        # _IOWR(0xAA, 0x06, struct uffdio_writeprotect)
UFFD_FEATURE_WP_UNPOPULATED = 1 << 13   # anonymous memory needs it for PAGEMAP_SCAN's protection
UFFD_FEATURE_WP_ASYNC = 1 << 15
UFFD_USER_MODE_ONLY = 1
PM_SCAN_WP_MATCHING = 1 << 0
TRACK_FD_FLOOR = 900                    # where the tracking fd goes in the process (F_DUPFD)
TRACKED_KINDS = frozenset({VmaKind.ANON_PRIVATE, VmaKind.HEAP, VmaKind.STACK, VmaKind.FILE_PRIVATE})
O_CLOEXEC, O_NONBLOCK, F_DUPFD_CLOEXEC = 0o2000000, 0o4000, 1030

log = logging.getLogger("ptckpt.memtrack")


def state_dir() -> str:
    if os.geteuid() == 0:
        return "/run/ptckpt/memtrack"
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/ptckpt-{os.geteuid()}", "ptckpt", "memtrack")


def _key(pid: int) -> str:
    return f"{pid}-{procfs.read_stat(pid).start_time}"


@dataclass
class State:
    image_id: str        # the image whose pages the protection is relative to
    vpid: int            # the process's pid in that image
    fd: int              # the tracking userfaultfd, in the process
    ino: int             # its inode (anon_inode:[userfaultfd])


def load_state(pid: int) -> State | None:
    """The process's tracking record, if its fd is still that userfaultfd."""
    try:
        with open(os.path.join(state_dir(), _key(pid))) as f:
            state = State(**json.load(f))
    except (OSError, ValueError, TypeError, PtckptError):
        return None
    return state if _fd_is(pid, state.fd, state.ino) else None


def _fd_is(pid: int, fd: int, ino: int) -> bool:
    try:
        return (procfs.readlink_fd(pid, fd) == "anon_inode:[userfaultfd]"
                and procfs.stat_fd(pid, fd).st_ino == ino)
    except (OSError, PtckptError):
        return False


FEATURES = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED


def is_ours(pid: int, fd: int) -> bool:
    """Whether fd `fd` of `pid` is a tracking userfaultfd ptckpt made: a userfaultfd at or
    above TRACK_FD_FLOOR with exactly the tracking's features (a fork child holds its
    parent's; a record lost with /run still leaves it recognisable)."""
    if fd < TRACK_FD_FLOOR:
        return False
    try:
        if procfs.readlink_fd(pid, fd) != "anon_inode:[userfaultfd]":
            return False
        api = procfs.read_fdinfo(pid, fd).extra["API"][0].split()[0]
        return int(api.split(":")[1], 16) & 0xFFFFFFF == FEATURES
    except (OSError, PtckptError, KeyError, IndexError, ValueError):
        return False


def find_fd(pid: int) -> int | None:
    """The process's tracking fd, if it has one."""
    try:
        fds = [fd for fd in procfs.list_fds(pid) if fd >= TRACK_FD_FLOOR]
    except (OSError, PtckptError):
        return None
    return next((fd for fd in fds if is_ours(pid, fd)), None)


def prune_states() -> None:
    """Remove the records of processes that are gone."""
    with contextlib.suppress(OSError):
        for name in os.listdir(state_dir()):
            pid, _, start = name.partition("-")
            try:
                alive = str(procfs.read_stat(int(pid)).start_time) == start
            except (ValueError, PtckptError):
                alive = False
            if not alive:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(state_dir(), name))


class Tracker:
    """One process's tracking userfaultfd, held by ptckpt for the length of a dump."""

    def __init__(self, pid: int, fd_in_process: int, ours: int, previous: State | None):
        self.pid = pid
        self.fd = fd_in_process
        self.ours = ours                      # our pidfd_getfd copy
        self.ino = os.fstat(ours).st_ino
        self.previous = previous              # the record a previous dump left (None: new)
        self.protected = False
        self._key = _key(pid)

    def since(self, image_id: str, vpid: int) -> bool:
        """Whether the pages not written since the protection are those of image `image_id`."""
        return self.previous is not None and self.previous.image_id == image_id and self.previous.vpid == vpid

    def written(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The parts of `ranges` written since the protection (or never protected)."""
        out: list[tuple[int, int]] = []
        for start, end in merge_spans(ranges):
            for run in procfs.scan_written(self.pid, start, end):
                out.append((run.start, run.end))
        return out

    def rewritten(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """The pages of `spans` written since the protection, protected again in the same
        atomic scan (the process may run): a write after it shows in the next scan."""
        out: list[tuple[int, int]] = []
        for start, end in spans:
            out.extend((r.start, r.end) for r in procfs.scan_written(self.pid, start, end, protect=True,
                                                                      only_written=True))
        return out

    def protect(self, vmas: Sequence[Vma]) -> int:
        """Register the private mappings and write-protect every page in them; returns the
        bytes of the mappings that could not be registered (their pages count as written)."""
        untracked = 0
        for vma in vmas:
            if vma.kind not in TRACKED_KINDS or "dp" in vma.vmflags.split():
                continue
            arg = bytearray(struct.pack("<QQQQ", vma.start, vma.end - vma.start, UFFDIO_REGISTER_MODE_WP, 0))
            try:
                fcntl.ioctl(self.ours, UFFDIO_REGISTER, arg)
            except OSError as err:
                log.debug("memtrack: %d %#x-%#x not registered: %s", self.pid, vma.start, vma.end, err.strerror)
                untracked += vma.end - vma.start
                continue
            procfs.scan_written(self.pid, vma.start, vma.end, protect=True)
            self.protected = True
        return untracked

    def unprotect(self, start: int, end: int) -> None:
        """Clear the protection of [start, end): its pages count as written next time.  The
        kernel refuses a range with a hole in it: then each part still mapped is cleared on
        its own (a part left protected would count as not written, and be lost)."""
        if self._unprotect(start, end):
            return
        try:
            maps = procfs.read_maps(self.pid)
        except (OSError, PtckptError):
            return                                # it ended: nothing left to mark
        for m in maps:
            if m.start < end and start < m.end:
                self._unprotect(max(m.start, start), min(m.end, end))   # not ours (unregistered): written anyway

    def _unprotect(self, start: int, end: int) -> bool:
        arg = bytearray(struct.pack("<QQQ", start, end - start, 0))
        try:
            fcntl.ioctl(self.ours, UFFDIO_WRITEPROTECT, arg)
        except OSError:
            return False
        return True

    def commit(self, image_id: str, vpid: int) -> None:
        """Record that the protection is relative to image `image_id` (committed)."""
        os.makedirs(state_dir(), mode=0o700, exist_ok=True)
        path = os.path.join(state_dir(), self._key)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"image_id": image_id, "vpid": vpid, "fd": self.fd, "ino": self.ino}, f)
        os.replace(tmp, path)

    def forget(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(state_dir(), self._key))

    def close(self) -> None:
        if self.ours >= 0:
            os.close(self.ours)
            self.ours = -1


def existing(pid: int) -> Tracker | None:
    """The tracking a previous dump left in the process, if any (nothing is made); without
    its record (lost, or the dump that set it failed) it tracks since no image."""
    previous = load_state(pid)
    fd = previous.fd if previous is not None else find_fd(pid)
    if fd is None:
        return None
    return Tracker(pid, fd, pidfd_getfd(pid, fd), previous)


def prepare_frozen(pid: int, remote, *, keep: bool = True) -> Tracker:
    """The process's tracking userfaultfd: the one a previous dump left, or a new one made
    by injection (`remote`: a syscall scope in one of its threads).  `keep=False`: a new
    one is closed in the process at once; ptckpt's copy is then the only one, and the
    protection ends with it (when the dump ends, or ptckpt does)."""
    found = existing(pid)
    if found is not None:
        return found
    made = remote.checked("userfaultfd", O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY,
                          step="make a userfaultfd to track written pages")
    try:
        fd = remote.checked("fcntl", made, F_DUPFD_CLOEXEC, TRACK_FD_FLOOR,
                            step="move the tracking userfaultfd to a high fd")
    finally:
        remote.syscall("close", made)
    ours = pidfd_getfd(pid, fd)
    if not keep:
        remote.syscall("close", fd)
        fd = -1
    try:
        arg = bytearray(struct.pack("<QQQ", UFFD_API, FEATURES, 0))
        fcntl.ioctl(ours, UFFDIO_API, arg)
    except OSError as err:
        os.close(ours)
        if fd >= 0:
            remote.syscall("close", fd)
        from ..errors import UnsupportedResource
        raise UnsupportedResource(pid, "memory tracking", why=f"this kernel refuses asynchronous userfaultfd "
                                  f"write-protection ({err.strerror})", way_out="dump without --track-mem/--prev"
                                  ) from None
    return Tracker(pid, fd, ours, None)
