"""How a dump writes memory: in full, as an increment on a parent image, as a pre-dump,
or copied while the tree runs (background).

* ``--track-mem``: after the pages are read, every private mapping is write-protected
  (resources.memtrack) so that the next dump can tell which pages changed.
* ``--prev DIR``: the image is an increment on DIR: only the pages written since DIR
  was dumped are read, the others are recorded as DIR's (PAGE_PARENT).  A process
  whose memory was not tracked since DIR is written in full, and a line says why.
  It tracks on from this image, unless the process is killed.
* pre-dump: the memory is written while the tree runs; the image holds memory
  only, to be the parent of the real dump.
* background (``--background``; by default for a leave-running dump of more than
  BACKGROUND_MIN bytes of memory): a pre-copy.  The tree is frozen a first time only
  to write-protect its private memory (asynchronously: the program never waits on a
  fault), which is then copied while it runs; the real freeze copies only the pages
  written meanwhile, and those copied before but written since are dropped from the
  index.  The image is the same as a frozen dump's: one instant, the second freeze.
  Without --track-mem the write-protection is ptckpt's alone (the userfaultfd is
  closed in the process at once, ptckpt holds the only copy): it ends with the dump,
  or with ptckpt if ptckpt is killed, and the process is left as it was.

:class:`MemoryPlan` carries these choices through one dump; dump.py calls it.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import procfs
from .errors import PtckptError, UsageError
from .formats.image import ImageReader, ImageWriter
from .formats.model import PAGE_SIZE, Fd, FdKind, Vma, VmaKind
from .resources import memory, memtrack
from .tracee import AddressSpace, Session, find_syscall_insn, remote_syscalls

log = logging.getLogger("ptckpt.dump")

BACKGROUND_MIN = 64 << 20      # private memory (Rss) from which a leave-running dump pre-copies
PASSES = 4                     # copies while the tree runs: all, then what was written meanwhile ...
PASS_ENOUGH = 4 << 20          # ... until a pass copies no more than this


@dataclass
class _Early:
    """The freeze's copy of what was written since the last pass, made from the mappings as
    they were just before the freeze while the frozen smaps is still being read."""

    vmas: list[Vma]
    read: list[tuple[int, int, bool]]
    runs: list                                 # PageRun
    index: tuple                               # MemoryPlan._index of it


@dataclass
class _Precopy:
    """What the background passes wrote of one process while it ran."""

    pages: object                              # its PagesWriter, still open
    passes: list[list[tuple[int, int, int]]] = field(default_factory=list)   # (start, end, data offset)
    parent: list[tuple[int, int]] = field(default_factory=list)      # unchanged since the parent
    spans: list[tuple[int, int]] = field(default_factory=list)       # its tracked mappings
    made: list[tuple[int, int, int]] | None = None    # index() of the passes, made before the freeze
    guess: list[Vma] | None = None            # its mappings read after the passes, before the freeze
    early: _Early | None = None               # the final copy made from the guess (copy_early)

    def index(self) -> list[tuple[int, int, int]]:
        """Every page's newest copy: a later pass's run hides an earlier one's."""
        out: list[tuple[int, int, int]] = []
        covered: list[tuple[int, int]] = []
        for runs in reversed(self.passes):
            runs = sorted(runs)
            starts = [s for s, _e, _o in runs]
            for a, b in memory.subtract_spans([(s, e) for s, e, _o in runs], covered):
                s, _e, off = runs[bisect.bisect_right(starts, a) - 1]
                out.append((a, b, off + a - s))
            covered = memory.merge_spans(covered + [(s, e) for s, e, _o in runs])
        return sorted(out)


def _spans(vmas: Sequence[Vma]) -> list[tuple[int, int]]:
    return [(v.start, v.end) for v in vmas if v.kind is not VmaKind.VSYSCALL]


def _triples(runs) -> list[tuple[int, int, int]]:
    """(vaddr, npages, offset) of each PageRun: what an index holds."""
    return [(r.vaddr, r.npages, r.offset) for r in runs]


def _tracked_spans(vmas: Sequence[Vma]) -> list[tuple[int, int]]:
    return memory.merge_spans((v.start, v.end) for v in vmas if v.kind in memtrack.TRACKED_KINDS)


class MemoryPlan:
    def __init__(self, directory: str, *, prev: str | None = None, track_mem: bool = False,
                 pre_dump: bool = False, killing: bool = False, background: bool | None = False):
        if killing and (track_mem or pre_dump):
            raise UsageError("--track-mem and pre-dump need the process to go on running (not --kill)")
        if killing and background:
            raise UsageError("--background copies memory while the tree runs: not with --kill")
        self.pre_dump = pre_dump
        self.parent_id = self.parent = ""
        self.prev = prev
        if prev is not None:
            inv = ImageReader.read_inventory(prev)
            if not inv.image_id:
                raise UsageError(f"{prev} was written by an older ptckpt (no image id): it cannot be a parent")
            self.parent_id = inv.image_id
            self.parent = os.path.relpath(os.path.abspath(prev), os.path.abspath(directory))
        self.track = (track_mem or pre_dump or prev is not None) and not killing
        self.background = background if not (killing or pre_dump) else False    # None: decide by size
        self.trackers: dict[int, tuple[memtrack.Tracker, int]] = {}   # pid -> (tracker, vpid)
        self._precopied: dict[int, _Precopy] = {}
        self._registered: dict[int, list[tuple[int, int]]] = {}   # pid -> mappings tracked ("uw")
        self._deferred: list = []
        self.untracked: list[str] = []     # why processes were written in full

    def inventory_fields(self) -> dict:
        return {"parent": self.parent, "parent_id": self.parent_id, "memory_only": self.pre_dump}

    # --- the background pass, before the freeze ------------------------------------------

    def wants_background(self, pids: Sequence[int]) -> bool:
        """Whether to pre-copy: as asked, or (None) when the tree's private memory is big
        enough that copying it frozen would cost more than the second freeze."""
        if self.background is None:
            total = 0
            for p in pids:
                try:
                    total += int(procfs.read_status(p).raw.get("RssAnon", "0 kB").split()[0]) * 1024
                except (PtckptError, ValueError, IndexError):
                    pass
            self.background = total >= BACKGROUND_MIN
        return self.background

    def precopy(self, pids: Sequence[int], vpid_of, writer: ImageWriter) -> None:
        """Freeze the tree briefly to write-protect its memory, then copy it while it runs."""
        session = Session()
        plans: dict[int, tuple[list, list, list]] = {}
        started = time.monotonic()
        try:
            for pid in pids:
                try:
                    plans[pid] = self._protect_for_precopy(session, pid, vpid_of(pid))
                except PtckptError as err:     # gone, a zombie ...: the real freeze copies it
                    log.info("no pre-copy of %d: %s", pid, err)
                    self._drop_tracker(pid)
        finally:
            session.resume_all()
            log.info("pre-copy: frozen %.3f s to %s", time.monotonic() - started,
                     "write-protect" if self.prev is not None else "make the tracking")
        for pid in [p for p, plan in plans.items() if plan is None]:
            try:
                plans[pid] = self._protect_running(pid)
            except PtckptError as err:         # it ended meanwhile: the real freeze copies what is left
                log.info("no pre-copy of %d: %s", pid, err)
                del plans[pid]
                self._drop_tracker(pid)
        unpinned = [(0, 2**63)] if len(pids) > 1 else []   # a tree: keep pages shared copy-on-write
        for pid, (ranges, unchanged, spans) in plans.items():
            pre = self._precopied[pid] = _Precopy(writer.pages_writer(vpid_of(pid)), parent=unchanged,
                                                  spans=spans)
            try:
                runs, _stats = self._copy_running(pid, ranges, pre.pages, unpinned)
            except PtckptError as err:          # it ended meanwhile: nothing to keep of it
                self._give_up(pid, err)
                continue
            pre.passes.append([(r.vaddr, r.vaddr + r.npages * PAGE_SIZE, r.offset) for r in runs])
        for _ in range(PASSES - 1):
            if self._copy_rewritten(unpinned) <= PASS_ENOUGH:
                break
        for pid, pre in self._precopied.items():  # the real freeze does not wait for the disk
            pre.made = pre.index()                # nor for this
            try:                                  # nor, unless they change, for its smaps
                pre.guess = self.clean_vmas(pid, memory.dump_vmas(pid))
            except PtckptError:
                pre.guess = None
            pre.pages.drain()

    def _copy_rewritten(self, unpinned) -> int:
        """Another pass, the tree running: the pages written since the last one, taken and
        protected again in one atomic scan (PM_SCAN_WP_MATCHING), then copied.  Zero pages
        are copied too: a newer copy must hide the older one.  Returns the bytes copied."""
        total = 0
        for pid, pre in list(self._precopied.items()):
            try:
                again = memory.merge_spans(self.trackers[pid][0].rewritten(pre.spans))
                runs, stats = self._copy_running(pid, [(s, e, False) for s, e in again], pre.pages, unpinned)
            except PtckptError as err:
                self._give_up(pid, err)
                continue
            pre.passes.append([(r.vaddr, r.vaddr + r.npages * PAGE_SIZE, r.offset) for r in runs])
            total += stats.bytes
        log.info("pre-copy pass: %d bytes written again", total)
        return total

    def _copy_running(self, pid: int, ranges, pages, shared=()):
        """write_pages() from a process that runs: a range it unmapped meanwhile is left out
        and unprotected, so that it counts as written next time."""
        lost: list[tuple[int, int]] = []
        with AddressSpace(pid) as mem:
            runs, stats = memory.write_pages(mem, ranges, pages, shared, lost=lost)
        tracker = self.trackers.get(pid, (None, 0))[0]
        if tracker is not None:
            for s, e in lost:
                tracker.unprotect(s, e)
        return runs, stats

    def _protect_for_precopy(self, session: Session, pid: int, vpid: int):
        """Frozen: the tracking userfaultfd made (injected).  Without a parent image that is
        all (None: _protect_running does the rest once the tree runs).  With one, the pages
        written since it are read and protected again while frozen: none can slip between."""
        tasks = session.freeze_process(pid)
        leader = next(t for t in tasks if t.tid == pid)
        with AddressSpace(pid) as mem:
            with remote_syscalls(leader, mem, find_syscall_insn(mem, procfs.read_maps(pid))) as remote:
                self.prepare(pid, vpid, remote)
        if self.prev is None:
            return None
        vmas = self.clean_vmas(pid, memory.dump_vmas(pid))
        tracker = self.trackers[pid][0]
        written = self._written_since_parent(pid, vpid, tracker, vmas)
        ranges, unchanged = memory.plan_pages(pid, vmas, written)
        tracker.protect(vmas)
        return ranges, unchanged, _tracked_spans(vmas)

    def _protect_running(self, pid: int):
        """The pre-copy's protection set while the process runs: every page is protected
        before the first pass copies it, so a write after its copy marks it for the next
        pass; the pages to copy are looked for only once all are protected (one made
        present meanwhile is copied, and marked too).  A mapping made, or one changed under
        the registration, has no protection: its pages count as written."""
        vmas = self.clean_vmas(pid, memory.dump_vmas(pid))
        self.trackers[pid][0].protect(vmas)
        ranges, unchanged = memory.plan_pages(pid, vmas, None)
        return ranges, unchanged, _tracked_spans(vmas)

    def _give_up(self, pid: int, err: PtckptError) -> None:
        """No pre-copy of `pid` after all (it ended ...): what it had goes; the real
        freeze copies it, if it is still there."""
        log.info("no pre-copy of %d: %s", pid, err)
        self._precopied.pop(pid).pages.discard()
        self._drop_tracker(pid)

    def _drop_tracker(self, pid: int) -> None:
        entry = self.trackers.pop(pid, None)
        if entry is not None:
            if entry[0].protected and self.track:
                entry[0].forget()
            entry[0].close()

    def _written_since_parent(self, pid: int, vpid: int, tracker, vmas):
        """The pages written since the parent image (None: all of them, and why is noted)."""
        if self.prev is None:
            return None
        if tracker is not None and tracker.since(self.parent_id, vpid):
            return tracker.written(_spans(vmas))
        why = ("no tracking since" if tracker is None or tracker.previous is None
               else "its tracking was reset after")
        self.untracked.append(f"process {pid}: {why} {self.prev}, all its pages written")
        return None

    # --- frozen, per process -----------------------------------------------------------

    def clean_vmas(self, pid: int, vmas: list[Vma]) -> list[Vma]:
        """The tracking's own registration ("uw") is not the program's: left out."""
        if pid not in self.trackers and memtrack.find_fd(pid) is None:
            return vmas
        self._registered[pid] = [(v.start, v.end) for v in vmas if "uw" in v.vmflags.split()]
        return [dataclasses.replace(v, vmflags=" ".join(f for f in v.vmflags.split() if f != "uw"))
                if "uw" in v.vmflags.split() else v for v in vmas]

    def prepare(self, pid: int, vpid: int, remote) -> None:
        """In a syscall scope of the frozen process: its tracking fd, found or made (only
        ptckpt's, for a background pass without tracking)."""
        if pid in self.trackers:
            return
        if self.track or self.background:
            self.trackers[pid] = (memtrack.prepare_frozen(pid, remote, keep=self.track), vpid)
        elif self.prev is not None:
            found = memtrack.existing(pid)
            if found is not None:
                self.trackers[pid] = (found, vpid)

    def visible_fds(self, pid: int, fds: Sequence[Fd]) -> list[Fd]:
        """The process's fds without the tracking userfaultfd (ours, not the program's)."""
        return [f for f in fds if not (f.kind is FdKind.USERFAULTFD and memtrack.is_ours(pid, f.fd))]

    def save_pages(self, pid: int, vpid: int, vmas: Sequence[Vma], writer: ImageWriter, mem: AddressSpace,
                   lent: Sequence[tuple[int, int]]):
        """Plan and (unless a pre-dump: later, run_deferred) write the process's pages;
        returns (runs, stats) or None when deferred.  Leaves the memory protected."""
        if pid in self._precopied:
            return self._finish_precopy(pid, vmas, mem, lent)
        pages = writer.pages_writer(vpid)
        tracker, _ = self.trackers.get(pid, (None, 0))
        registered = self._registered.get(pid, [])
        if self.track and registered and tracker is not None and tracker.since(self.parent_id, vpid):
            written, new = self._written_protected_again(tracker, vmas, registered)
        else:
            written, new = self._written_since_parent(pid, vpid, tracker, vmas), vmas
        ranges, unchanged = memory.plan_pages(pid, vmas, written)
        pages.add_parents(unchanged)
        if tracker is not None and self.track:
            tracker.protect(new)
        if self.pre_dump:
            self._deferred.append((pid, ranges, pages, lent))
            return None
        runs, stats = memory.write_pages(mem, ranges, pages, lent)
        for run in runs:
            pages.add_run(run.vaddr, run.npages, run.offset)
        pages.close()
        return runs, stats

    def _written_protected_again(self, tracker, vmas: Sequence[Vma], registered: list[tuple[int, int]]):
        """An increment that tracks on (frozen): the pages written since the parent image,
        those of the mappings already tracked protected again as they are found (the
        kernel looks at the written ones only, not every page as a new protection does);
        returns them and the mappings still to protect (new, or never tracked)."""
        spans = memory.merge_spans(_spans(vmas))
        tracked = memory.intersect_spans(spans, memory.merge_spans(registered))
        written = tracker.rewritten(tracked) + tracker.written(memory.subtract_spans(spans, tracked))
        return sorted(written), [v for v in vmas if not memory.intersect_spans([(v.start, v.end)], tracked)]

    def copy_early(self, pid: int, mem: AddressSpace, lent) -> None:
        """Frozen, before its smaps is read (procfs.read_ahead): the pages of a pre-copied
        process written since the last pass, copied after the mappings it had just before
        the freeze, and its index made.  _finish_precopy keeps them when the frozen smaps
        shows the same mappings, and makes up for any difference otherwise."""
        pre = self._precopied.get(pid)
        if pre is None or pre.guess is None:
            return
        since = self.trackers[pid][0].written(_spans(pre.guess))
        read, unchanged = memory.plan_pages(pid, pre.guess, since)
        runs, _stats = memory.write_pages(mem, read, pre.pages, lent)
        pre.early = _Early(pre.guess, read, runs,
                           self._index(pre, unchanged, _triples(runs)))
        pre.pages.drain()                         # written while the smaps is read, not after

    def _final_copy(self, pid: int, pre: _Precopy, vmas: Sequence[Vma], mem: AddressSpace, lent):
        """The index of the freeze's copy (_index): copy_early's if the mappings are those it
        guessed; else from the frozen mappings' plan, its copy kept where it is part of it and
        what it lacks read now."""
        early = pre.early
        if early is not None and early.vmas == list(vmas):
            return early.index
        since = self.trackers[pid][0].written(_spans(vmas))
        read, unchanged = memory.plan_pages(pid, vmas, since)      # unchanged: sorted, merged
        if early is None:
            runs, _stats = memory.write_pages(mem, read, pre.pages, lent)
            return self._index(pre, unchanged, _triples(runs))
        log.info("pre-copy: the mappings of %d changed before the freeze: the copy made up for it", pid)
        # the early copy left out zero pages where it could: it stands in for a range here
        # only as one that may leave them out too
        done = {True: memory.merge_spans((s, e) for s, e, _d in early.read),
                False: memory.merge_spans((s, e) for s, e, d in early.read if not d)}
        missing = [(a, b, d) for s, e, d in read for a, b in memory.subtract_spans([(s, e)], done[d])]
        more, _stats = memory.write_pages(mem, missing, pre.pages, lent)
        wanted = memory.subtract_spans(memory.merge_spans((s, e) for s, e, _d in read),
                                       memory.merge_spans((s, e) for s, e, _d in missing))
        kept = memory.clip_runs(sorted((r.vaddr, r.vaddr + r.npages * PAGE_SIZE, r.offset) for r in early.runs),
                                wanted)
        return self._index(pre, unchanged, sorted([(a, (b - a) // PAGE_SIZE, off) for a, b, off in kept]
                                                  + _triples(more)))

    @staticmethod
    def _index(pre: _Precopy, unchanged, copied_now: list[tuple[int, int, int]]):
        """(page runs, parent spans, stats) of the image: the freeze's copy, then what the
        passes copied and was not written since (cut from the passes' index)."""
        before = pre.made if pre.made is not None else pre.index()
        kept = [(a, (b - a) // PAGE_SIZE, off) for a, b, off in memory.clip_runs(before, unchanged)]
        stats = memory.PageStats(pages=sum(n for _v, n, _o in copied_now) + sum(n for _a, n, _o in kept))
        stats.bytes = stats.pages * PAGE_SIZE
        parents = []
        if pre.parent:
            copied = memory.merge_spans((s, e) for s, e, _o in before)
            parents = memory.subtract_spans(memory.intersect_spans(memory.merge_spans(pre.parent), unchanged),
                                            copied)
        return copied_now + kept, parents, stats

    def _finish_precopy(self, pid: int, vmas: Sequence[Vma], mem: AddressSpace, lent):
        """The real freeze of a pre-copied process: what it wrote since the background pass
        is read now; what was copied then and not written since stays in the index."""
        pre = self._precopied.pop(pid)
        runs, parents, stats = self._final_copy(pid, pre, vmas, mem, lent)
        pre.pages.add_runs(runs)
        pre.pages.add_parents(parents)
        if self.track:
            self.trackers[pid][0].protect(vmas)
        pre.pages.close()
        return runs, stats

    # --- after the freeze ------------------------------------------------------------

    def run_deferred(self, result) -> None:
        """Pre-dump: write the pages of the running processes (_copy_running)."""
        for pid, ranges, pages, lent in self._deferred:
            runs, stats = self._copy_running(pid, ranges, pages, lent)
            for run in runs:
                pages.add_run(run.vaddr, run.npages, run.offset)
            pages.close()
            result.pages += stats.pages
            result.bytes += stats.bytes
        self._deferred.clear()

    def drop_precopies(self) -> None:
        """Processes pre-copied that the dump does not hold (they ended meanwhile)."""
        for pre in self._precopied.values():
            pre.pages.discard()
        self._precopied.clear()

    def committed(self, image_id: str) -> None:
        if self.track:
            for tracker, vpid in self.trackers.values():
                tracker.commit(image_id, vpid)

    def failed(self) -> None:
        """The dump failed after protecting: what the bits say belongs to no image."""
        if self.track:
            for tracker, _vpid in self.trackers.values():
                if tracker.protected:
                    tracker.forget()

    def close(self) -> None:
        for tracker, _vpid in self.trackers.values():
            tracker.close()
        self.trackers.clear()
        memtrack.prune_states()
