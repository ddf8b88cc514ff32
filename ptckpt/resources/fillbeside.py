"""Half of a big restore's page filling done by ptckpt beside the tracee's own reads.

An eager restore fills the saved pages by injected preadv()s, which the tracee runs on one
core (resources/memory.fill_pages_in_target).  Page allocation, zeroing and the copy out of
the page cache are kernel work that a second core can share: while the tracee reads its
groups of pages, a thread of ptckpt copies the others with process_vm_writev() straight
from a private read-only view of the same page file (one copy, page cache to memory, as the
tracee's own).  Its page faults land in the tracee's memory and are charged to it as the
tracee's own are; the view's pages are dropped from ptckpt's memory chunk by chunk, so that
ptckpt stays small (a memory limit's OOM killer picks the tracee, as without the thread).

Only taken for a page file ptckpt can map whose data lies whole within it (checked from its
size first: a view of a file that ends early would fault).  The thread stops between
chunks when told (a failed or interrupted restore), and its error, if any, is the restore's.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from typing import Sequence

from .. import progress, testhooks
from ..errors import PtckptError
from ..formats.model import PAGE_SIZE
from ..tracee import AddressSpace
from . import process

log = logging.getLogger("ptckpt.restore")

SPLIT_MIN = 64 << 20          # below this, one reader is as fast: no thread
_CHUNK = 8 << 20              # what the thread moves between looks at its stop flag

Group = list[tuple[int, int, int]]          # (file offset, vaddr, length), consecutive in the file


def share(mem: AddressSpace, groups: Sequence[Group], pages_fd: int,
          data_offset: int) -> tuple[list[Group], "Beside | None"]:
    """(the groups the tracee reads, the thread copying the rest or None): split() and the
    thread started; all the tracee's again where the page file cannot be mapped."""
    tracee_part, ptckpt_part = split(mem.pid, groups, pages_fd, data_offset)
    if not ptckpt_part:
        return tracee_part, None
    try:
        return tracee_part, Beside(mem, pages_fd, data_offset, ptckpt_part)
    except (OSError, ValueError) as e:         # mmap refused: the tracee reads it all
        log.debug("fill: no view of the page file (%s): the tracee reads all", e)
        return list(groups), None


def split(pid: int, groups: Sequence[Group], pages_fd: int, data_offset: int) -> tuple[list[Group], list[Group]]:
    """(the tracee's groups, ptckpt's): half the bytes each (to a page), ptckpt's from the
    end, the group in the middle cut in two; all the tracee's when the total is small, the
    file cannot be viewed whole, or the memory cgroup of the tracee `pid` may run out."""
    total = sum(n for g in groups for _o, _v, n in g)
    if total < SPLIT_MIN or not _viewable(pages_fd, data_offset, groups) or not memory_room(pid, total):
        return list(groups), []
    left = total // 2 // PAGE_SIZE * PAGE_SIZE          # what the tracee keeps
    tracee_part: list[Group] = []
    ptckpt_part: list[Group] = []
    for g in groups:
        if not left:
            ptckpt_part.append(g)
            continue
        kept: Group = []
        for i, (o, v, n) in enumerate(g):
            if n <= left:
                kept.append((o, v, n))
                left -= n
                continue
            if left:
                kept.append((o, v, left))
            ptckpt_part.append([(o + left, v + left, n - left), *g[i + 1:]])
            left = 0
            break
        tracee_part.append(kept)
    return tracee_part, ptckpt_part


def _viewable(pages_fd: int, data_offset: int, groups: Sequence[Group]) -> bool:
    try:
        size = os.fstat(pages_fd).st_size
    except OSError:
        return False
    end = max((o + n for g in groups for o, _v, n in g), default=0)
    return data_offset + end <= size


def memory_room(pid: int, need: int) -> bool:
    """Whether the memory cgroup of `pid`, and each one above it, has room for `need` bytes
    more and a margin.  Where it might not, the tracee fills alone: a fault ptckpt makes in
    its memory past the limit runs the OOM killer in ptckpt's stead, and once the tracee is
    killed and its memory reaped, ptckpt's next fault there would have ptckpt killed too.
    cgroup v1's memory hierarchy where it is mounted, else v2's; False where neither can
    be read."""
    try:
        mounts = process.cgroup_mounts()
    except (OSError, PtckptError):
        return False
    lines = [line.split(":", 2) for line in process.read_cgroups(pid).splitlines()]
    v1 = next(((frozenset(c.split(",")), path) for _id, c, path in lines if "memory" in c.split(",")), None)
    if v1 is not None:                 # v1's memory hierarchy (mounts are keyed by controllers)
        root, group = mounts.get(v1[0]), v1[1]
        limit_name, used_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
    else:                              # else v2's
        root, group = mounts.get(frozenset()), next((path for _id, c, path in lines if not c), None)
        limit_name, used_name = "memory.max", "memory.current"
    if root is None or group is None:
        return False
    parts = [p for p in group.split("/") if p]
    for depth in range(len(parts), 0, -1):
        where = os.path.join(root, *parts[:depth])
        try:
            with open(f"{where}/{limit_name}") as f:
                limit = f.read().strip()
            if limit == "max":
                continue
            with open(f"{where}/{used_name}") as f:
                used = int(f.read())
        except FileNotFoundError:
            continue                              # no memory controller at this level
        except (OSError, ValueError):
            return False
        if int(limit) - used < need + need // 4 + (64 << 20):
            return False
    return True


class Beside:
    """The thread copying `groups` from the page file into `mem` (started at once)."""

    def __init__(self, mem: AddressSpace, pages_fd: int, data_offset: int, groups: Sequence[Group]):
        self.mem, self.groups, self.data_offset = mem, groups, data_offset
        # a private view is writable for ctypes (write_from) and never written: no copy made
        self.view = mmap.mmap(pages_fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.view.madvise(mmap.MADV_SEQUENTIAL)
        self.moved = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="ptckpt-fill", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            whole = memoryview(self.view)
            try:
                for g in self.groups:
                    self._group(whole, g)
            finally:
                whole.release()
        except BaseException as e:               # reported by join(), in the restoring thread
            self.error = e

    def _group(self, whole: memoryview, group: Group) -> None:
        for offset, vaddr, length in group:
            at = self.data_offset + offset
            for done in range(0, length, _CHUNK):
                if self.stop.is_set():
                    return
                n = min(_CHUNK, length - done)
                self.mem.write_from(whole[at + done:at + done + n], [(vaddr + done, n)])
                # the view's pages leave ptckpt's own memory again: else they count as
                # ptckpt's size, and under a memory limit the OOM killer picks ptckpt
                lo = (at + done) // PAGE_SIZE * PAGE_SIZE
                self.view.madvise(mmap.MADV_DONTNEED, lo, at + done + n - lo)
                progress.moved(n)
                self.moved += n
                testhooks.reached("restore-fill-beside")

    def join(self, *, abandon: bool = False) -> None:
        """Wait for the thread (told to stop first when `abandon`), then raise its error."""
        if abandon:
            self.stop.set()
        self.thread.join()
        try:
            self.view.close()
        except BufferError:                      # a slice still held by the error's traceback
            pass
        if self.error is not None and not abandon:
            raise self.error
        log.info("fill: %.1f MiB of %d's pages copied by ptckpt beside its own reads",
                 self.moved / (1 << 20), self.mem.pid)
