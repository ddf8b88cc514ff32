"""How a dump writes memory: in full, as an increment on a parent image, or as a pre-dump.

* ``--track-mem``: after the pages are read, every private mapping is write-protected
  (resources.memtrack) so that the next dump can tell which pages changed.
* ``--prev DIR``: the image is an increment on DIR: only the pages written since DIR
  was dumped are read, the others are recorded as DIR's (PAGE_PARENT).  A process
  whose memory was not tracked since DIR is written in full, and a line says why.
  It tracks on from this image, unless the process is killed.
* pre-dump: the process is frozen only to scan and protect; its memory is written
  while it runs.  The image holds memory only, to be the parent of the real dump.

:class:`MemoryPlan` carries these choices through one dump; dump.py calls it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

from .errors import UsageError
from .formats.image import ImageReader
from .formats.model import Fd, FdKind, Vma, VmaKind
from .resources import memory, memtrack
from .tracee import AddressSpace

log = logging.getLogger("ptckpt.dump")


class MemoryPlan:
    def __init__(self, directory: str, *, prev: str | None = None, track_mem: bool = False,
                 pre_dump: bool = False, killing: bool = False):
        if killing and (track_mem or pre_dump):
            raise UsageError("--track-mem and pre-dump need the process to go on running (not --kill)")
        self.pre_dump = pre_dump
        self.parent_id = self.parent = ""
        self.prev = prev
        if prev is not None:
            inv = ImageReader.read_inventory(prev)
            if not inv.image_id:
                raise UsageError(f"{prev} was written by an older ptckpt (no image id): it cannot be a parent")
            self.parent_id = inv.image_id
            self.parent = os.path.relpath(os.path.abspath(prev), os.path.abspath(directory))
        self.protect = (track_mem or pre_dump or prev is not None) and not killing
        self.trackers: dict[int, tuple[memtrack.Tracker, int]] = {}   # pid -> (tracker, vpid)
        self._deferred: list = []
        self.untracked: list[str] = []     # why processes were written in full

    def inventory_fields(self) -> dict:
        return {"parent": self.parent, "parent_id": self.parent_id, "memory_only": self.pre_dump}

    # --- frozen, per process -----------------------------------------------------------

    def clean_vmas(self, pid: int, vmas: list[Vma]) -> list[Vma]:
        """The tracking's own registration ("uw") is not the program's: left out."""
        if memtrack.find_fd(pid) is None:
            return vmas
        return [dataclasses.replace(v, vmflags=" ".join(f for f in v.vmflags.split() if f != "uw"))
                if "uw" in v.vmflags.split() else v for v in vmas]

    def prepare(self, pid: int, vpid: int, remote) -> None:
        """In a syscall scope of the frozen process: its tracking fd, found or made."""
        if self.protect:
            self.trackers[pid] = (memtrack.prepare_frozen(pid, remote), vpid)
        elif self.prev is not None:
            found = memtrack.existing(pid)
            if found is not None:
                self.trackers[pid] = (found, vpid)

    def visible_fds(self, pid: int, fds: Sequence[Fd]) -> list[Fd]:
        """The process's fds without the tracking userfaultfd (ours, not the program's)."""
        return [f for f in fds if not (f.kind is FdKind.USERFAULTFD and memtrack.is_ours(pid, f.fd))]

    def save_pages(self, pid: int, vpid: int, vmas: Sequence[Vma], pages, mem: AddressSpace,
                   lent: Sequence[tuple[int, int]]):
        """Plan and (unless a pre-dump: later, run_deferred) write the process's pages;
        returns (runs, stats) or None when deferred.  Leaves the memory protected."""
        tracker, _ = self.trackers.get(pid, (None, 0))
        written = None
        if self.prev is not None:
            if tracker is not None and tracker.since(self.parent_id, vpid):
                written = tracker.written([(v.start, v.end) for v in vmas if v.kind is not VmaKind.VSYSCALL])
            else:
                why = ("no tracking since" if tracker is None or tracker.previous is None
                       else "its tracking was reset after")
                self.untracked.append(f"process {pid}: {why} {self.prev}, all its pages written")
        ranges, unchanged = memory.plan_pages(pid, vmas, written)
        for s, e in unchanged:
            pages.add_parent(s, (e - s) // memory.PAGE_SIZE)
        if tracker is not None and self.protect:
            tracker.protect(vmas)
        if self.pre_dump:
            self._deferred.append((pid, ranges, pages, lent))
            return None
        runs, stats = memory.write_pages(mem, ranges, pages, lent)
        for run in runs:
            pages.add_run(run.vaddr, run.npages, run.offset)
        pages.close()
        return runs, stats

    # --- after the freeze ------------------------------------------------------------

    def run_deferred(self, result) -> None:
        """Pre-dump: write the pages of the running processes.  A range a process unmapped
        meanwhile is left out and unprotected (it counts as written next time)."""
        for pid, ranges, pages, lent in self._deferred:
            lost: list[tuple[int, int]] = []
            with AddressSpace(pid) as mem:
                runs, stats = memory.write_pages(mem, ranges, pages, lent, lost=lost)
            for run in runs:
                pages.add_run(run.vaddr, run.npages, run.offset)
            pages.close()
            tracker = self.trackers.get(pid, (None, 0))[0]
            if tracker is not None:
                for s, e in lost:
                    tracker.unprotect(s, e)
            result.pages += stats.pages
            result.bytes += stats.bytes
        self._deferred.clear()

    def committed(self, image_id: str) -> None:
        if self.protect:
            for tracker, vpid in self.trackers.values():
                tracker.commit(image_id, vpid)

    def failed(self) -> None:
        """The dump failed after protecting: what the bits say belongs to no image."""
        if self.protect:
            for tracker, _vpid in self.trackers.values():
                if tracker.protected:
                    tracker.forget()

    def close(self) -> None:
        for tracker, _vpid in self.trackers.values():
            tracker.close()
        self.trackers.clear()
        memtrack.prune_states()
