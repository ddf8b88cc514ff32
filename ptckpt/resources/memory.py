"""Memory: the VMAs of a process and the page contents a restore needs.

Dump half: :func:`dump_vmas` (from smaps), :func:`plan_pages` and :func:`write_pages`
(pagemap scan, then process_vm_readv in big batches into one reused buffer,
streamed to the image's pages file: no per-page Python work).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import fcntl
import mmap
import os
import stat as _stat
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

from .. import kinds, procfs, progress
from ..errors import AccessDenied, Incompatible, PtckptError
from ..formats.model import PAGE_SIZE, PageRun, Vma, VmaKind
from ..tracee import AddressSpace, RemotePtr, find_syscall_insn, page_align, probe_task, remote_syscalls
from . import fillbeside, sysvipc
from .aio import is_aio_ring
from .files import ghost_key
from .filepolicy import build_id

_SPECIAL = {
    "[heap]": VmaKind.HEAP,
    "[stack]": VmaKind.STACK,
    "[vdso]": VmaKind.VDSO,
    "[vvar]": VmaKind.VVAR,
    "[vvar_vclock]": VmaKind.VVAR_VCLOCK,
    "[vsyscall]": VmaKind.VSYSCALL,
}

# Kinds whose contents come from the kernel or from a file that stays on disk (the vdso's
# bytes are saved all the same, for a restore on another kernel build: ranges_to_save).
_NO_PAGES = {VmaKind.FILE_SHARED, VmaKind.VDSO, VmaKind.VVAR, VmaKind.VVAR_VCLOCK,
             VmaKind.VSYSCALL, VmaKind.DEVICE}


def classify_vma(path: str, shared: bool, inode: int, st: os.stat_result | None) -> VmaKind:
    """What a mapping is, from its maps path, sharing and (for files) the mapped file's stat."""
    if path in _SPECIAL:
        return _SPECIAL[path]
    if path == "" or path.startswith("[anon:") or path.startswith("[anon_shmem:"):
        if path.startswith("[anon_shmem:"):
            return VmaKind.ANON_SHARED
        return VmaKind.ANON_SHARED if shared else VmaKind.ANON_PRIVATE
    if path.startswith("/dev/zero"):
        # MAP_SHARED|MAP_ANONYMOUS shows as "/dev/zero (deleted)", a shmem object.
        return VmaKind.ANON_SHARED if shared else VmaKind.ANON_PRIVATE
    if path.startswith(("/memfd:", "/SYSV", "/dev/shm/")):
        return VmaKind.SHMEM if shared else VmaKind.FILE_PRIVATE
    if path.startswith("["):
        return VmaKind.OTHER
    if st is not None and _stat.S_ISCHR(st.st_mode):
        return VmaKind.DEVICE
    return VmaKind.FILE_SHARED if shared else VmaKind.FILE_PRIVATE


def unsupported_vmas(vmas: Sequence[Vma]) -> list[str]:
    """'mapping A-B -> anon_inode:[io_uring] (...)' for each mapping no restore can make again:
    the kernel objects mapped through an anonymous inode (io_uring rings, perf buffers ...),
    which stay mapped after their fd is closed."""
    out = []
    for v in vmas:
        if not v.path.startswith("anon_inode:"):
            continue
        what = v.path[len("anon_inode:"):]
        why = (_IO_URING_MAPPED if what == "[io_uring]"
               else "a kernel object mapped through an anonymous inode, which ptckpt cannot make again")
        out.append(f"mapping {v.start:#x}-{v.end:#x} -> {v.path} ({why})")
    return out


_IO_URING_MAPPED = ("the rings of an io_uring instance, mapped (its fd may be closed): the kernel "
                    "lets no one read its state back or make it again; checkpoint when the program "
                    "has unmapped and closed its ring")


def dump_vmas(pid: int, build_ids: dict | None = None) -> list[Vma]:
    """Every VMA of `pid` from /proc/PID/smaps, with the mapped file's size, mtime and, for an
    ELF file, its build-id (`build_ids` caches them across the processes of a dump)."""
    build_ids = {} if build_ids is None else build_ids
    out: list[Vma] = []
    for e in procfs.read_smaps(pid):
        st = _stat_mapped(pid, e) if e.inode else None
        kind = classify_vma(e.path, e.shared, e.inode, st)
        bid = ""
        if kind in (VmaKind.FILE_PRIVATE, VmaKind.FILE_SHARED) and st is not None and not e.deleted:
            key = (st.st_dev, st.st_ino, st.st_mtime_ns)
            if key not in build_ids:
                build_ids[key] = build_id(procfs.map_file_path(pid, e.start, e.end, (e.dev_major, e.dev_minor),
                                                               e.inode, e.path)) or ""
            bid = build_ids[key]
        out.append(Vma(
            start=e.start, end=e.end, prot=e.prot, shared=e.shared, kind=kind,
            pgoff=e.offset, dev_major=e.dev_major, dev_minor=e.dev_minor,
            inode=e.inode, path=e.path, vmflags=e.vmflags,
            file_size=st.st_size if st else 0,
            file_mtime_ns=st.st_mtime_ns if st else 0,
            file_deleted=e.deleted,
            build_id=bid,
            guards=tuple(guard_regions(pid, e.start, e.end)) if "gu" in e.vmflags.split() else (),
        ))
    return out


def _stat_mapped(pid: int, e: procfs.SmapsEntry) -> os.stat_result | None:
    """The mapped file's stat.  A user without procfs.MAP_FILES_CAPABILITY cannot reach a
    memfd or shared anonymous object that no fd holds: it is then known by its mappings
    alone (its size is what they cover; the program cannot see past them either)."""
    try:
        return procfs.stat_map_file(pid, e.start, e.end, dev=(e.dev_major, e.dev_minor), inode=e.inode,
                                    path=e.path)
    except AccessDenied:
        if e.shared and e.path.startswith(("/memfd:", "/dev/zero")):
            return None
        raise


PM_GUARD_REGION = 1 << 58       # /proc/PID/pagemap: the page is in a guard region
PM_PRESENT = 1 << 63
PM_FILE = 1 << 61                # a page-cache or shared-anonymous page
PM_PFN = (1 << 55) - 1           # the page frame (shown to CAP_SYS_ADMIN only)
COW_KINDS = frozenset({VmaKind.ANON_PRIVATE, VmaKind.HEAP, VmaKind.STACK, VmaKind.FILE_PRIVATE})
_NOT_INHERITED = {"dc", "wf", "lo", "lf", "sl"}   # DONTFORK, WIPEONFORK, locks, seals: not as-is


def inheritable(child: Vma, parent: Vma) -> bool:
    """Could the child's mapping be (part of) the parent's, inherited by fork: within it, of
    the same kind, file, offset and flags, nothing that fork drops or that would pin it?  A
    part: either side may have grown or split its mapping since the fork (a heap the parent
    grew, a new mapping merged below), and the child keeps its own part of the parent's."""
    flags = set(child.vmflags.split())
    return (child.kind in COW_KINDS and not child.shared and not child.guards
            and _within(child.start, child.end, child.pgoff, parent.start, parent.end, parent.pgoff,
                        file=child.kind is VmaKind.FILE_PRIVATE)
            and (child.prot, child.kind, child.path) == (parent.prot, parent.kind, parent.path)
            and flags == set(parent.vmflags.split()) and not flags & _NOT_INHERITED
            and not parent.guards)


def _within(start: int, end: int, offset: int, p_start: int, p_end: int, p_offset: int, *, file: bool) -> bool:
    """[start, end) is a part of [p_start, p_end), and for a file mapping at the offset that makes
    it the same pages of the file (an anonymous mapping shows offset 0 in /proc/PID/maps)."""
    return p_start <= start and end <= p_end and (not file or offset == p_offset + (start - p_start))


def page_frames_visible() -> bool:
    """Whether /proc/PID/pagemap shows page frame numbers to ptckpt (CAP_SYS_ADMIN, since 4.0):
    :func:`shared_with_parent` sees no sharing without them."""
    return bool(procfs.read_status(os.getpid()).cap_eff >> 21 & 1)


def shared_with_parent(pid: int, ppid: int) -> dict[int, tuple[tuple[int, int], ...]]:
    """{mapping start: runs of anonymous pages `pid` shares copy-on-write with `ppid`} (both
    frozen): present in both at one page frame, at one address of a private mapping of the
    child that lies within one of the parent's, alike (see :func:`inheritable`).  Read before
    any of their memory is: reading a process's memory through process_vm_readv pins its
    pages, and a pin unshares a page shared copy-on-write."""
    theirs = sorted((m.start, m.end, m.perms, m.offset, m.path) for m in procfs.read_maps(ppid) if not m.shared)
    starts = [t[0] for t in theirs]
    out: dict[int, tuple[tuple[int, int], ...]] = {}
    for m in procfs.read_maps(pid):
        if m.shared:
            continue
        i = bisect.bisect_right(starts, m.start) - 1
        if i < 0:
            continue
        p_start, p_end, perms, offset, path = theirs[i]
        file = m.inode != 0
        if (perms, path) != (m.perms, m.path) or not _within(m.start, m.end, m.offset, p_start, p_end, offset,
                                                              file=file):
            continue
        a_map, b_map = _pagemap(pid, m.start, m.end), _pagemap(ppid, m.start, m.end)
        runs: list[tuple[int, int]] = []
        for i, ((a,), (b,)) in enumerate(zip(_PM_ENTRY.iter_unpack(a_map), _PM_ENTRY.iter_unpack(b_map))):
            if (a & PM_PRESENT and not a & PM_FILE and a & PM_PFN
                    and (a & PM_PFN, b & (PM_PRESENT | PM_FILE)) == (b & PM_PFN, PM_PRESENT)):
                addr = m.start + i * PAGE_SIZE
                if runs and runs[-1][1] == addr:
                    runs[-1] = (runs[-1][0], addr + PAGE_SIZE)
                else:
                    runs.append((addr, addr + PAGE_SIZE))
        if runs:
            out[m.start] = tuple(runs)
    return out


def with_cow(vmas: Sequence[Vma], parent_vmas: Sequence[Vma],
             shared: dict[int, tuple[tuple[int, int], ...]]) -> list[Vma]:
    """`vmas` with their copy-on-write runs (from :func:`shared_with_parent`) where the
    mapping can be (part of) the parent's, inherited by fork."""
    ordered = sorted(parent_vmas, key=lambda v: v.start)
    starts = [v.start for v in ordered]

    def containing(v: Vma) -> Vma | None:
        i = bisect.bisect_right(starts, v.start) - 1
        return ordered[i] if i >= 0 and v.end <= ordered[i].end else None

    out = []
    for v in vmas:
        parent = containing(v) if v.start in shared else None
        out.append(dataclasses.replace(v, cow=shared[v.start]) if parent is not None and inheritable(v, parent)
                   else v)
    return out


def _pagemap(pid: int, start: int, end: int) -> bytes:
    with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
        f.seek(start // PAGE_SIZE * 8)
        return f.read((end - start) // PAGE_SIZE * 8)


def guard_regions(pid: int, start: int, end: int) -> list[tuple[int, int]]:
    """(start, end) runs of guard pages (madvise MADV_GUARD_INSTALL) in [start, end)."""
    out: list[tuple[int, int]] = []
    for i, (entry,) in enumerate(_PM_ENTRY.iter_unpack(_pagemap(pid, start, end))):
        if entry & PM_GUARD_REGION:
            addr = start + i * PAGE_SIZE
            if out and out[-1][1] == addr:
                out[-1] = (out[-1][0], addr + PAGE_SIZE)
            else:
                out.append((addr, addr + PAGE_SIZE))
    return out


_PM_ENTRY = struct.Struct("<Q")

# Every flag smaps shows in VmFlags (fs/proc/task_mmu.c), and who answers for it: the
# restore makes it again (how), it follows from what the restore maps (the kind, the
# protections), or it is refused at dump (why).  A flag not in the table is refused too:
# nothing a newer kernel shows is dropped without a word.
VMFLAGS_MADE = {
    "rd": "protections", "wr": "protections", "ex": "protections", "sh": "MAP_SHARED",
    "mr": "protections", "mw": "protections", "me": "protections", "ms": "MAP_SHARED",
    "gd": "MAP_GROWSDOWN", "nr": "MAP_NORESERVE", "dp": "MAP_DROPPABLE (its pages zeroed)",
    "lo": "mlock", "lf": "mlock2(MLOCK_ONFAULT)",
    "sr": "madvise(MADV_SEQUENTIAL)", "rr": "madvise(MADV_RANDOM)",
    "dc": "madvise(MADV_DONTFORK)", "wf": "madvise(MADV_WIPEONFORK)",
    "dd": "madvise(MADV_DONTDUMP)", "hg": "madvise(MADV_HUGEPAGE)",
    "nh": "madvise(MADV_NOHUGEPAGE)", "mg": "madvise(MADV_MERGEABLE)",
    "gu": "madvise(MADV_GUARD_INSTALL) on the guard regions", "sl": "mseal",
}
VMFLAGS_DERIVED = {
    "ac": "accounted private writable memory",
    "sd": "soft-dirty bookkeeping",
    "pf": "a kernel or device mapping (vdso, vvar, vsyscall, devices)",
    "io": "a kernel or device mapping (vdso, vvar, vsyscall, devices)",
    "de": "a kernel or device mapping (vdso, vvar, vsyscall, devices, AIO rings)",
    "mm": "a kernel or device mapping (vdso, vvar, vsyscall, devices)",
}
VMFLAGS_REFUSED = {
    "ht": "hugetlb memory, which ptckpt does not save",
    "um": ("a userfaultfd registration for missing pages: another program serves its page faults, "
           "such as the page server of a lazy restore still putting its memory in (dump once it has exited)"),
    "uw": "a userfaultfd registration (write-protect)",
    "ui": "a userfaultfd registration (minor faults)",
    "ss": "a shadow stack",
    "sf": "synchronous page faults of a DAX file",
    "ar": "an architecture-specific mapping",
}
_MADVISE = {"sr": 2, "rr": 1, "dc": 10, "wf": 18, "dd": 16, "hg": 14, "nh": 15, "mg": 12}
_KERNEL_KINDS = {VmaKind.VDSO, VmaKind.VVAR, VmaKind.VVAR_VCLOCK, VmaKind.VSYSCALL, VmaKind.DEVICE}


def check_vmas(pid: int, vmas: Sequence[Vma]) -> None:
    """Refuse, by name, a mapping the restore cannot make as it was (see the tables above)."""
    from ..errors import UnsupportedResource
    for v in vmas:
        if unsupported_vmas([v]):
            continue                    # refused with its fds, by name (capture_sharing_frozen)
        where = f"mapping {v.start:#x}-{v.end:#x} {v.path or '[anon]'}"
        row = kinds.MAPPINGS.get(v.kind)                 # the table of kinds (ptckpt.kinds)
        if row is None or not row.restored:
            raise UnsupportedResource(pid, f"{where} ({row.refusal if row else 'a kind of mapping this ptckpt does not know'})")
        for flag in v.vmflags.split():
            if flag in VMFLAGS_MADE or flag in VMFLAGS_DERIVED and (
                    flag in ("ac", "sd") or v.kind in _KERNEL_KINDS or "[aio]" in v.path):
                continue
            why = VMFLAGS_REFUSED.get(flag, "a VMA flag ptckpt does not know")
            raise UnsupportedResource(pid, f"{where} with VmFlags '{flag}' ({why})")


MLOCK_ONFAULT = 1
PR_SET_VMA, PR_SET_VMA_ANON_NAME = 0x53564D41, 0
MADV_GUARD_INSTALL = 102


def restore_advice_frozen(remote, vmas: Sequence[Vma]) -> None:
    """After the pages are in: madvise hints, locks, names, guard regions and seals of every
    mapping that had them (the flags of VMFLAGS_MADE)."""
    for v in vmas:
        flags = v.vmflags.split()
        length = v.end - v.start
        where = f"{v.start:#x}-{v.end:#x}"
        for flag in flags:
            if flag in _MADVISE:
                remote.checked("madvise", v.start, length, _MADVISE[flag], step=f"madvise {flag} {where}")
        if "lo" in flags or "lf" in flags:
            remote.checked("mlock2", v.start, length, MLOCK_ONFAULT if "lf" in flags else 0,
                           step=f"mlock {where}")
        if v.path.startswith(("[anon:", "[anon_shmem:")):
            name = v.path.split(":", 1)[1][:-1]
            with remote.scratch(os.fsencode(name) + b"\0") as p:
                remote.checked("prctl", PR_SET_VMA, PR_SET_VMA_ANON_NAME, v.start, length, int(p),
                               step=f"name {where} {name!r}")
        for gs, ge in v.guards:
            remote.checked("madvise", gs, ge - gs, MADV_GUARD_INSTALL, step=f"guard {gs:#x}-{ge:#x}")
    for v in vmas:                 # last: a sealed mapping refuses any change
        if "sl" in v.vmflags.split():
            remote.checked("mseal", v.start, v.end - v.start, 0, step=f"seal {v.start:#x}-{v.end:#x}")


_PRIVATE_ANON = frozenset({VmaKind.ANON_PRIVATE, VmaKind.HEAP, VmaKind.STACK})


def ranges_to_save(pid: int, vma: Vma) -> list[tuple[int, int]]:
    """(start, end) runs of pages of `vma` whose contents go into the image.

    Anonymous memory: pages present or swapped, except those still mapping
    the shared zero page (never written).  Private file mappings: only the
    pages that became anonymous copies (written, or never backed by the
    file); the rest is read again from the file.  Shared anonymous memory and
    memfd mappings: every page of the object that holds data, mapped here or
    not (another process may have written it).  Never-touched pages are
    absent from the page tables and so are never saved.
    """
    if vma.kind is VmaKind.VDSO:
        return [(vma.start, vma.end)]  # whole: a restore on another kernel build needs it (resources.vdso)
    if vma.kind in _NO_PAGES or not vma.prot & 1 and vma.kind is VmaKind.OTHER:
        return []
    if "dp" in vma.vmflags.split():
        # MAP_DROPPABLE: the kernel frees its pages whenever it likes and the program must
        # cope; a restore gives them zeroed, as CRIU does (and glibc's vgetrandom state,
        # kept there, is reseeded rather than repeated by every restore of one image).
        return []
    if is_sysv(vma):
        return []                      # the segment's bytes are in its SYSV_SHM record
    if vma.kind in SHARED_OBJECT_KINDS and vma.inode and vma.prot & 1:
        ranges = shared_object_ranges(pid, vma)
        if ranges is not None:
            return ranges
    if vma.kind in _PRIVATE_ANON:
        # no page here is the page cache's (a file mapping moved by mremap is FILE_PRIVATE),
        # so the kernel is not asked: not looking up each page's struct page makes the walk
        # three times as fast (12 against 40 ms for 4 GiB)
        runs = procfs.scan_pages(pid, vma.start, vma.end, skip_zero=True, skip_file=False,
                                 return_mask=procfs.PAGE_IS_PRESENT | procfs.PAGE_IS_SWAPPED)
    else:
        want_file_pages = vma.kind in (VmaKind.ANON_SHARED, VmaKind.SHMEM)
        runs = procfs.scan_pages(pid, vma.start, vma.end, skip_zero=True, skip_file=not want_file_pages)
    out: list[tuple[int, int]] = []
    for run in runs:
        if out and out[-1][1] == run.start:
            out[-1] = (out[-1][0], run.end)
        else:
            out.append((run.start, run.end))
    holes = vma.guards + vma.cow
    return _without(out, holes) if holes else out


def _without(ranges: list[tuple[int, int]], holes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` minus `holes` (guard pages, which the scan reports as swapped-out pages)."""
    for hs, he in holes:
        cut = []
        for s, e in ranges:
            if e <= hs or s >= he:
                cut.append((s, e))
                continue
            if s < hs:
                cut.append((s, hs))
            if e > he:
                cut.append((he, e))
        ranges = cut
    return ranges


SHARED_OBJECT_KINDS = frozenset({VmaKind.ANON_SHARED, VmaKind.SHMEM})


def _made_object(vma: Vma, shared: dict) -> int | None:
    """The fd (in the stub) of the object ptckpt made for `vma`: a MAP_SHARED anonymous or
    memfd object, or a deleted file made again; None for any other mapping."""
    for key in (ghost_key(vma), object_key(vma)):
        if key is not None and key in shared:
            return shared[key]
    return None


def is_sysv(vma: Vma) -> bool:
    """A SysV shared memory attach ("/SYSV<key> (deleted)"; the inode column is the shmid)."""
    return vma.kind is VmaKind.SHMEM and vma.path.startswith("/SYSV")


def shared_object_key(vma: Vma) -> tuple[int, int, int] | None:
    """Which memory object a MAP_SHARED anonymous or memfd mapping shows (the same in every
    process that shares it), or None for any other mapping."""
    if vma.kind is VmaKind.ANON_SHARED and vma.inode and vma.path.startswith("/dev/zero"):
        return (vma.dev_major, vma.dev_minor, vma.inode)
    if vma.kind is VmaKind.SHMEM and vma.shared and vma.path.startswith("/memfd:"):
        return (vma.dev_major, vma.dev_minor, vma.inode)
    return None


def object_key(vma: Vma) -> tuple[int, int, int] | None:
    """The memory object a mapping maps when it is one a restore makes itself: the
    shared_object_key of a MAP_SHARED one, and of a MAP_PRIVATE mapping of a memfd (whose
    object is made for the memfd's fd or for its shared mappings, and mapped privately)."""
    key = shared_object_key(vma)
    if key is None and vma.kind is VmaKind.FILE_PRIVATE and vma.path.startswith("/memfd:"):
        key = (vma.dev_major, vma.dev_minor, vma.inode)
    return key


def shared_object_ranges(pid: int, vma: Vma) -> list[tuple[int, int]] | None:
    """The parts of `vma` whose object holds data (lseek SEEK_DATA/SEEK_HOLE on the object,
    opened through /proc/PID/map_files), as address ranges; None if it cannot be opened."""
    if shared_object_key(vma) is None:
        return None
    try:
        fd = os.open(procfs.map_file_path(pid, vma.start, vma.end, (vma.dev_major, vma.dev_minor),
                                          vma.inode, vma.path), os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, PtckptError):
        return None
    out: list[tuple[int, int]] = []
    try:
        pos, end = vma.pgoff, vma.pgoff + (vma.end - vma.start)
        while pos < end:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:            # ENXIO: no data after pos
                break
            if data >= end:
                break
            hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
            lo = vma.start + (data - vma.pgoff) // PAGE_SIZE * PAGE_SIZE
            hi = vma.start + page_align(hole - vma.pgoff)
            out.append((lo, min(hi, vma.end)))
            pos = hole
    finally:
        os.close(fd)
    return out


@dataclass
class PageStats:
    pages: int = 0
    bytes: int = 0


def _batches(ranges: Iterable[tuple[int, int, bool]], limit: int) -> Iterable[list[tuple[int, int, bool]]]:
    """Group (start, end, flag) ranges into batches of at most `limit` bytes, splitting big ones."""
    batch: list[tuple[int, int, bool]] = []
    size = 0
    for start, end, flag in ranges:
        while start < end:
            take = min(end - start, limit - size)
            batch.append((start, start + take, flag))
            size += take
            start += take
            if size == limit:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def plan_pages(pid: int, vmas: Sequence[Vma], written: Sequence[tuple[int, int]] | None = None):
    """What a dump saves: ([(start, end, zero-droppable)] ranges to read, [(start, end)]
    ranges left to the parent image).  With `written` (an incremental dump: the pages
    written since the parent image, memtrack), only those are read, and the other pages
    that hold data are the parent's."""
    ranges: list[tuple[int, int, bool]] = []
    for vma in vmas:
        # Zero pages can be left out where the restore maps fresh anonymous memory;
        # in a file mapping the file's own bytes would show through instead.
        droppable = vma.kind in ZERO_DROPPABLE
        ranges.extend((s, e, droppable) for s, e in ranges_to_save(pid, vma))
    if written is None:
        return ranges, []
    marks = merge_spans(written)
    read = [(a, b, d) for s, e, d in ranges for a, b in _intersect(s, e, marks)]
    unchanged = subtract_spans(merge_spans((s, e) for s, e, _d in ranges), marks)
    return read, unchanged


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint (start, end) spans covering the same addresses: overlaps and
    neighbours merged."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and out[-1][1] >= s:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def intersect_spans(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """a ∩ b, both sorted and disjoint: one sweep."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract_spans(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """a minus b, both sorted and disjoint: for each span of a, the spans of b within it
    found by bisection, and the gaps between them kept (no loop over b in Python: an
    increment's written pages are tens of thousands of spans)."""
    out: list[tuple[int, int]] = []
    for s, e in a:
        cut = _intersect(s, e, b)
        if not cut:
            out.append((s, e))
            continue
        bounds = [s, *(v for span in cut for v in span), e]
        out.extend(pair for pair in zip(bounds[0::2], bounds[1::2]) if pair[0] < pair[1])
    return out


def clip_runs(runs: Sequence[tuple[int, int, int]], keep: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The parts of (start, end, data offset) runs (sorted, disjoint) within `keep` (sorted,
    disjoint spans), each with its offset.  The gaps of `keep` are what is cut: few, for
    runs that are many (the index of a background dump, cut where the pages were written
    during its freeze), so the runs between two gaps are copied whole, not one by one."""
    if not runs:
        return []
    lo, hi = runs[0][0], runs[-1][1]
    gaps, at = [], lo
    for s, e in keep:
        if e <= at:
            continue
        if s >= hi:
            break
        if s > at:
            gaps.append((at, s))
        at = max(at, e)
    if at < hi:
        gaps.append((at, hi))
    ends = [e for _s, e, _o in runs]
    out: list[tuple[int, int, int]] = []
    i, n, cur = 0, len(runs), None       # cur: what is left of runs[i] past the last gap
    for a, b in gaps:
        j = max(i, bisect.bisect_right(ends, a))     # runs[i:j] end before the gap: whole
        if j > i:
            out.extend(runs[i:j] if cur is None else [cur, *runs[i + 1:j]])
            i, cur = j, None
        if i == n:
            break
        s, _e, off = cur if cur is not None else runs[i]
        if s < a:                                    # the gap starts in it: its head stays
            out.append((s, a, off))
        i, cur = max(i, bisect.bisect_right(ends, b)), None    # those within the gap go
        if i < n and runs[i][0] < b:                 # the gap ends in it: its tail stays
            s, e, off = runs[i]
            cur = (b, e, off + b - s)
    if i < n:
        out.extend(runs[i:] if cur is None else [cur, *runs[i + 1:]])
    return out


def _intersect(s: int, e: int, marks: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `marks` (sorted, disjoint) within [s, e): a slice, its ends clipped."""
    if s >= e:
        return []
    i = max(0, bisect.bisect_right(marks, (s, 2**64)) - 1)
    j = bisect.bisect_left(marks, (e, -1), lo=i)          # the first mark that starts at e or later
    out = list(marks[i:j])
    if out and out[0][1] <= s:
        del out[0]
    if not out:
        return []
    if out[0][0] < s:
        out[0] = (s, out[0][1])
    if out[-1][1] > e:
        out[-1] = (out[-1][0], e)
    return out


def write_pages(mem: AddressSpace, ranges, pages, shared: Sequence[tuple[int, int]] = (),
                lost: list | None = None) -> tuple[list[PageRun], PageStats]:
    """Read (start, end, droppable) ranges into the image's pages file.

    `pages` is the image's PagesWriter (double-buffered: we fill one buffer
    with process_vm_readv while the writer thread checksums and writes the
    other).  Returns the page index and the totals.  The `shared` ranges (pages a
    child shares with this process copy-on-write) are read without pinning them,
    so they stay shared in a tree that goes on running.  `lost`: the process runs
    (a pre-dump): ranges it unmapped meanwhile are left out and listed there.
    """
    ranges = list(_pieces(ranges, sorted(shared))) if shared else list(ranges)
    progress.expect(sum(e - s for s, e, _ in ranges))
    stats = PageStats()
    index: list[PageRun] = []
    for batch in _batches(ranges, pages.buffer_size):
        nbytes = sum(e - s for s, e, _ in batch)
        read = nbytes
        buf = pages.get_buffer()
        if lost is None:
            _read_batch(mem, buf, batch, sorted(shared))
        else:
            batch = _read_running(mem, buf, batch, lost, sorted(shared))
            nbytes = sum(e - s for s, e, _ in batch)
        nbytes, kept = drop_zero_pages(buf, nbytes, batch)
        offset = pages.submit(buf, nbytes, done=lambda read=read: progress.moved(read))
        for s, e in kept:
            index.append(PageRun(vaddr=s, npages=(e - s) // PAGE_SIZE, offset=offset))
            offset += e - s
        stats.pages += nbytes // PAGE_SIZE
        stats.bytes += nbytes
    return _merge_runs(index), stats


def _read_running(mem: AddressSpace, buf, batch, lost: list, shared=()):
    """_read_batch for a process that runs: what it unmapped meanwhile is dropped from the
    batch (the rest moves up in `buf`) and added to `lost`.  A range is cut where the
    mappings now end, so that the part of it still mapped is kept: a range can span two
    mappings the kernel had merged, and one of them be gone now."""
    try:
        _read_batch(mem, buf, batch, shared)
        return batch
    except PtckptError:
        pass
    try:
        mapped = merge_spans((m.start, m.end) for m in procfs.read_maps(mem.pid))
    except (OSError, PtckptError):
        mapped = []
    kept, done = [], 0
    for s, e, d in batch:
        pieces = _intersect(s, e, mapped)
        lost.extend(subtract_spans([(s, e)], pieces))
        for a, b in pieces:
            try:
                mem.read_unpinned(buf[done:done + b - a], a)
            except PtckptError:
                lost.append((a, b))
                continue
            kept.append((a, b, d))
            done += b - a
    return kept


def _pieces(ranges, holes):
    """`ranges` cut at the edges of `holes`, so that each piece is all in one or all out."""
    edges = sorted({x for h in holes for x in h})
    for s, e, d in ranges:
        cuts = [x for x in edges[bisect.bisect_right(edges, s):bisect.bisect_left(edges, e)]]
        for a, b in zip([s] + cuts, cuts + [e]):
            yield a, b, d


def _inside(s: int, holes) -> bool:
    i = bisect.bisect_right(holes, (s, 2**64)) - 1
    return i >= 0 and holes[i][0] <= s < holes[i][1]


def _read_batch(mem: AddressSpace, buf, batch, shared) -> None:
    """Read a batch of ranges into consecutive bytes of `buf`: process_vm_readv, but the
    pieces in `shared` through /proc/PID/mem (see write_pages)."""
    if not shared:
        mem.read_into(buf[:sum(e - s for s, e, _ in batch)], [(s, e - s) for s, e, _ in batch])
        return
    done = start = 0
    fast: list[tuple[int, int]] = []
    for s, e, _ in batch:
        if _inside(s, shared):
            if fast:
                mem.read_into(buf[start:done], fast)
                fast = []
            mem.read_unpinned(buf[done:done + e - s], s)
            start = done + e - s
        else:
            fast.append((s, e - s))
        done += e - s
    if fast:
        mem.read_into(buf[start:done], fast)


_libc = ctypes.CDLL(None)
_libc.memmem.restype = ctypes.c_void_p
_libc.memmem.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
_ZERO_PAGE = ctypes.create_string_buffer(PAGE_SIZE)


def zero_pages(buf: memoryview, nbytes: int) -> list[int]:
    """Offsets of the page-aligned all-zero pages in buf[:nbytes].

    glibc's memmem (two-way search) skips through non-zero data a needle's
    length at a time, so Python only runs once per zero run found.
    """
    base = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(buf))
    out: list[int] = []
    pos = 0
    while pos < nbytes:
        hit = _libc.memmem(base + pos, nbytes - pos, _ZERO_PAGE, PAGE_SIZE)
        if not hit:
            break
        at = hit - base
        page = (at + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)     # first whole page of the zero run
        # Every aligned page from here on that is zero belongs to this run or a later one.
        while page + PAGE_SIZE <= nbytes and buf[page:page + PAGE_SIZE] == _ZERO_VIEW:
            out.append(page)
            page += PAGE_SIZE
        pos = max(page, at + 1)
    return out


_ZERO_VIEW = memoryview(bytes(PAGE_SIZE))


ZERO_DROPPABLE = frozenset({VmaKind.ANON_PRIVATE, VmaKind.HEAP, VmaKind.STACK, VmaKind.ANON_SHARED})


def drop_zero_pages(buf: memoryview, nbytes: int, batch: list[tuple[int, int, bool]]):
    """Remove all-zero pages of droppable ranges from a filled batch: compact buf, split
    the (start, end, droppable) ranges into the (start, end) runs that remain.

    A page that reads as zero needs no saving: the restore maps fresh
    anonymous memory, which reads as zero too.  Returns (nbytes, ranges).
    Work is proportional to ranges plus zero pages, never to all pages.
    """
    zeros = zero_pages(buf, nbytes) if any(d for _, _, d in batch) else []
    if not zeros:
        return nbytes, [(s, e) for s, e, _ in batch]
    segments: list[tuple[int, int, int]] = []     # (buffer offset, length, vaddr)
    zi = 0
    src = 0
    for start, end, droppable in batch:
        seg_end = src + end - start
        cur = src
        while zi < len(zeros) and zeros[zi] < seg_end:
            z = zeros[zi]
            zi += 1
            if not droppable:
                continue
            if z > cur:
                segments.append((cur, z - cur, start + cur - src))
            cur = z + PAGE_SIZE
        if cur < seg_end:
            segments.append((cur, seg_end - cur, start + cur - src))
        src = seg_end
    kept: list[tuple[int, int]] = []
    dst = 0
    for off, n, vaddr in segments:
        if off != dst:
            buf[dst:dst + n] = buf[off:off + n]        # memmove: dst < off
        kept.append((vaddr, vaddr + n))
        dst += n
    return dst, kept


def _merge_runs(index: list[PageRun]) -> list[PageRun]:
    """Join runs that are adjacent both in memory and in the file."""
    out: list[PageRun] = []
    for r in index:
        if out and out[-1].vaddr + out[-1].npages * PAGE_SIZE == r.vaddr and \
                out[-1].offset + out[-1].npages * PAGE_SIZE == r.offset:
            last = out.pop()
            r = PageRun(last.vaddr, last.npages + r.npages, last.offset)
        out.append(r)
    return out


# --- restore half ------------------------------------------------------------

PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
MAP_GROWSDOWN, MAP_NORESERVE = 0x0100, 0x4000
MAP_DROPPABLE = 0x08
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
O_RDONLY, O_RDWR, O_CLOEXEC = 0, 2, 0o2000000
AT_FDCWD = -100 & (2**64 - 1)
TASK_SIZE = 0x7FFFFFFFF000
KERNEL_MAPPED = (VmaKind.VDSO, VmaKind.VVAR, VmaKind.VVAR_VCLOCK)
GADGET_PAGES = 2      # one page of code (syscall; int3), one of scratch memory
GADGET_CODE = b"\x0f\x05\xcc\xcd\x80\xcc"    # syscall; int3; int $0x80 (i386 calls); int3
COMPAT_GADGET = 0x10000000          # where a 32-bit process's gadget is looked for (below 4 GiB)
COMPAT_LIMIT = 0x100000000


def special_layout(vmas: Sequence) -> dict[str, tuple[int, int]]:
    """{'[vdso]': (start, end), ...} of the kernel-provided mappings in `vmas`."""
    return {v.path: (v.start, v.end) for v in vmas
            if v.path in ("[vdso]", "[vvar]", "[vvar_vclock]")}


def vdso_mismatch(image_vmas: Sequence[Vma], own_maps: Sequence) -> str | None:
    """Why this kernel's vdso cannot stand in for the image's, or None when it can."""
    want = special_layout(image_vmas)
    have = special_layout(own_maps)
    for name, (start, end) in want.items():
        if name not in have:
            return f"this kernel maps no {name}, the image has one of {end - start} bytes"
        hs, he = have[name]
        if he - hs != end - start:
            return (f"{name} is {he - hs} bytes on this kernel but {end - start} bytes in the image "
                    "(a different kernel made it)")
    if want and "[vdso]" in want and "[vvar]" in want and "[vdso]" in have and "[vvar]" in have:
        if want["[vdso]"][0] - want["[vvar]"][0] != have["[vdso]"][0] - have["[vvar]"][0]:
            return "[vdso] and [vvar] are laid out differently on this kernel"
    return None


def find_hole(taken: Iterable[tuple[int, int]], size: int, start: int = 0x100000000,
              limit: int = 0) -> int:
    """A page-aligned address where `size` bytes overlap none of the `taken` ranges
    (and end below `limit`, TASK_SIZE by default)."""
    ranges = sorted(taken)
    addr = start
    for s, e in ranges:
        if e <= addr:
            continue
        if s >= addr + size:
            break
        addr = (e + 0xFFFFF) & ~0xFFFFF
    if addr + size > (limit or TASK_SIZE):
        raise ValueError("no hole in the address space")
    return addr


class _FileCache:
    """Files opened inside the tracee for mapping, by (path, flags); closed at the end."""

    def __init__(self, remote):
        self.remote = remote
        self.fds: dict[tuple[str, int], int] = {}

    def open(self, path: str, flags: int, step: str) -> int:
        key = (path, flags)
        if key not in self.fds:
            with self.remote.scratch(os.fsencode(path) + b"\0") as p:
                try:
                    self.fds[key] = self.remote.checked("openat", AT_FDCWD, int(p), flags | O_CLOEXEC, 0,
                                                        step=step)
                except Exception as err:
                    if hasattr(err, "message"):
                        err.message += f" [path {path}]"
                        err.args = (err.message,)
                    raise
        return self.fds[key]

    def close_all(self) -> None:
        for fd in self.fds.values():
            self.remote.checked("close", fd, step="close mapped files")
        self.fds.clear()


def gadget_scratch_top(gadget: int) -> int:
    """The top of the scratch memory in the gadget's pages (below it: injected arguments)."""
    return gadget + GADGET_PAGES * PAGE_SIZE - 16


def inherited_vmas(image_vmas: Sequence[Vma]) -> list[Vma]:
    """The mappings a process takes over from its parent (pages shared copy-on-write)."""
    return [v for v in image_vmas if v.cow]


def prepare_address_space_frozen(remote, mem: AddressSpace, image_vmas: Sequence[Vma], compat: bool = False,
                                 proxy: bool = False) -> None:
    """Turn the freshly exec'd stub into an empty address space holding only the kernel's pages
    (and the mappings it inherited from its rebuilt parent, which it keeps).

    1. map the gadget (code + scratch) in a hole of both layouts, move execution there;
    2. unmap everything of the stub but the gadget, [vdso]/[vvar]/[vvar_vclock] and the
       inherited mappings;
    3. move those to the image's addresses (via a free spot, so none lands on another).

    `compat`: a 32-bit (ia32) process's: the gadget lies below 4 GiB (the compat calls'
    pointers are 32 bits), and the stub's 64-bit vdso gives way to this kernel's 32-bit
    one, mapped at the image's address (arch_prctl ARCH_MAP_VDSO_32).

    `proxy` (resources.vdso): the image's vdso is another kernel build's; this kernel's
    vdso pages are parked together at a free address instead, for its proxy to lead to.
    """
    own = procfs.read_maps(mem.pid)
    taken = [(v.start, v.end) for v in image_vmas] + [(m.start, m.end) for m in own]
    size = GADGET_PAGES * PAGE_SIZE
    gadget = find_hole(taken, size, start=COMPAT_GADGET if compat else 0x100000000,
                       limit=COMPAT_LIMIT if compat else TASK_SIZE)
    remote.checked("mmap", gadget, size, PROT_READ | PROT_WRITE | PROT_EXEC,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, 2**64 - 1, 0, step="map the gadget")
    mem.write(gadget, GADGET_CODE)
    remote.move_gadget(RemotePtr(gadget), gadget_scratch_top(gadget))
    keep = [(gadget, gadget + size)] + [(m.start, m.end) for m in own
                                        if m.path in ("[vdso]", "[vvar]", "[vvar_vclock]") and not compat]
    keep += [(v.start, v.end) for v in inherited_vmas(image_vmas)]
    cursor = PAGE_SIZE * 16
    for s, e in sorted(keep) + [(TASK_SIZE, TASK_SIZE)]:
        if s > cursor:
            remote.checked("munmap", cursor, s - cursor, step="unmap the stub")
        cursor = max(cursor, e)
    if compat:
        _map_vdso32_frozen(remote, mem, image_vmas)
    elif proxy:
        _park_kernel_pages_frozen(remote, own, taken + [(gadget, gadget + size)])
    else:
        _move_kernel_pages_frozen(remote, image_vmas, own, taken + [(gadget, gadget + size)])


def _move_kernel_pages_frozen(remote, image_vmas: Sequence[Vma], own: Sequence, taken: list) -> None:
    """The stub's vdso pages moved: first out of the way, then to the image's addresses."""
    want = special_layout(image_vmas)
    have = special_layout(own)
    parked: dict[str, tuple[int, int]] = {}
    for name, (s, e) in have.items():
        if name not in want:
            remote.checked("munmap", s, e - s, step=f"unmap {name}")
            continue
        spot = find_hole(taken, e - s, start=0x200000000)
        taken.append((spot, spot + e - s))
        remote.checked("mremap", s, e - s, e - s, MREMAP_MAYMOVE | MREMAP_FIXED, spot,
                       step=f"move {name}")
        parked[name] = (spot, spot + e - s)
    for name, (s, e) in parked.items():
        ws, we = want[name]
        remote.checked("mremap", s, e - s, e - s, MREMAP_MAYMOVE | MREMAP_FIXED, ws,
                       step=f"move {name}")


def _park_kernel_pages_frozen(remote, own: Sequence, taken: list) -> None:
    """This kernel's vdso pages moved together (as laid out) to a spot free in the image's
    layout and in the stub's own."""
    have = special_layout(own)
    if not have:
        return
    low, high = min(s for s, _e in have.values()), max(e for _s, e in have.values())
    spot = find_hole(taken, high - low, start=0x200000000)
    for name, (s, e) in have.items():
        remote.checked("mremap", s, e - s, e - s, MREMAP_MAYMOVE | MREMAP_FIXED, spot + s - low,
                       step=f"park {name}")


ARCH_MAP_VDSO_32 = 0x2002


def _map_vdso32_frozen(remote, mem: AddressSpace, image_vmas: Sequence[Vma]) -> None:
    """This kernel's 32-bit vdso (and its data pages) where the image had them; refused when
    this kernel lays them out otherwise than the one that made the image."""
    want = special_layout(image_vmas)
    if not want:
        return
    remote.checked("arch_prctl", ARCH_MAP_VDSO_32, min(s for s, _e in want.values()),
                   step="map the 32-bit vdso")
    have = special_layout(procfs.read_maps(mem.pid))
    if have != want:
        raise Incompatible(f"this kernel's 32-bit vdso is laid out as {_layout_text(have)}, "
                           f"the image's as {_layout_text(want)}: a different kernel made it")


def probe_vdso32() -> tuple[list, bytes]:
    """This kernel's 32-bit vdso, as a throwaway child of ptckpt shows it once it has traded
    its own vdso for one (ARCH_MAP_VDSO_32 where the kernel likes): its [vvar], [vvar_vclock]
    and [vdso] mappings (for vdso_mismatch) and the [vdso]'s bytes (for a core file).  None
    and no bytes where the kernel maps none (no ia32 emulation)."""
    with probe_task(changed=True) as task, AddressSpace(task.tgid) as mem:
        own = procfs.read_maps(task.tgid)
        taken = [(m.start, m.end) for m in own]
        with remote_syscalls(task, mem, find_syscall_insn(mem, own), keep_regs=False) as remote:
            gadget = find_hole(taken, GADGET_PAGES * PAGE_SIZE)
            remote.checked("mmap", gadget, GADGET_PAGES * PAGE_SIZE, PROT_READ | PROT_WRITE | PROT_EXEC,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, 2**64 - 1, 0, step="probe the 32-bit vdso")
            mem.write(gadget, GADGET_CODE)
            remote.move_gadget(RemotePtr(gadget), gadget_scratch_top(gadget))
            for m in own:
                if m.path in ("[vdso]", "[vvar]", "[vvar_vclock]"):
                    remote.checked("munmap", m.start, m.end - m.start, step="probe the 32-bit vdso")
            if remote.syscall("arch_prctl", ARCH_MAP_VDSO_32, 0) < 0:
                return [], b""
            maps = [m for m in procfs.read_maps(task.tgid) if m.path in ("[vdso]", "[vvar]", "[vvar_vclock]")]
            text = next((mem.read(m.start, m.end - m.start) for m in maps if m.path == "[vdso]"), b"")
            return maps, text


def _layout_text(layout: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{name} {s:#x}-{e:#x}" for name, (s, e) in sorted(layout.items(), key=lambda kv: kv[1]))


_libc_mm = ctypes.CDLL(None, use_errno=True)
_libc_mm.mmap.restype = ctypes.c_void_p
_libc_mm.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_long]
_libc_mm.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def create_shared_objects(vmas: Iterable[Vma], made: dict | None = None) -> dict[tuple[int, int, int], int]:
    """In ptckpt: one memory object per shared anonymous or memfd object of the image, sized to
    cover every mapping of it; {shared_object_key: fd}.  The caller owns the fds.

    `made` holds objects already made for fds ({key: fd}, memfds): those are used.
    A MAP_SHARED|MAP_ANONYMOUS object is made the way the kernel makes one (an anonymous
    shared mapping, opened through /proc/self/map_files, then unmapped), so the restored
    mappings show "/dev/zero (deleted)" again; a memfd is made with its name.
    """
    vmas = list(vmas)
    sizes: dict[tuple[int, int, int], int] = {}
    names: dict[tuple[int, int, int], str] = {}
    for v in vmas:
        key = shared_object_key(v)
        if key is not None:
            sizes[key] = max(sizes.get(key, 0), v.pgoff + (v.end - v.start), v.file_size)
            names[key] = v.path
    out: dict[tuple[int, int, int], int] = {}
    made = made or {}
    try:
        for key, size in sizes.items():
            # an object an fd of the image also holds (a memfd) is made once, with that fd
            out[key] = os.dup(made[key]) if key in made else _new_object(names[key], page_align(size))
        for key in {object_key(v) for v in vmas} - set(out) - {None}:
            if key in made:                       # mapped privately only: its fd's object
                out[key] = os.dup(made[key])
    except BaseException:
        for fd in out.values():
            os.close(fd)
        raise
    return out


def _new_object(path: str, size: int) -> int:
    if path.startswith("/memfd:"):
        name = path[len("/memfd:"):].removesuffix(" (deleted)")
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return fd
    addr = _libc_mm.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_ANONYMOUS, -1, 0)
    if addr in (None, 2**64 - 1):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a {size}-byte shared object: {os.strerror(err)}")
    try:
        return os.open(f"/proc/self/map_files/{addr:x}-{addr + size:x}", os.O_RDWR | os.O_CLOEXEC)
    except PermissionError:
        # map_files needs procfs.MAP_FILES_CAPABILITY: a user's restore makes a memfd, the
        # same shared memory, which the restored process sees as "/memfd:dev/zero (deleted)"
        fd = os.memfd_create("dev/zero", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return fd
    finally:
        _libc_mm.munmap(addr, size)


def restore_vmas_frozen(remote, mem: AddressSpace, vmas: Sequence[Vma], runs: Sequence[PageRun],
                        sources, shared: dict | None = None, lazy=None, proxy=None) -> None:
    """Map every VMA at its address, fill the saved pages in bulk, then set the protections.

    `runs` are all the saved pages; `sources` says where they are: (fd, base, runs) per
    file (ImageReader.page_sources: an incremental image's pages are in several).
    `shared` maps shared_object_key()s to the fd (in the tracee) of the object to map.
    `lazy` (a lazypages.Server): the pages it registers are left to it, not filled.
    `proxy` (a resources.vdso.Verdict): the image's vdso is made of its saved bytes, its
    entries patched to lead into this kernel's (parked by prepare_address_space_frozen);
    without it the saved vdso bytes are not used (this kernel's vdso is in place).
    """
    shared = shared or {}
    made_here = [(v.start, v.end) for v in vmas if proxy is not None and v.kind is VmaKind.VDSO]
    kernel = [(v.start, v.end) for v in vmas if v.kind in KERNEL_MAPPED and (v.start, v.end) not in made_here]
    if kernel:
        sources = [(fd, base, _runs_outside(part, kernel)) for fd, base, part in sources]
        runs = _runs_outside(runs, kernel)
    attached: set[tuple[int, int]] = set()
    with_pages = _vmas_with_pages(vmas, runs)
    files = _FileCache(remote)
    for vma in vmas:
        if (vma.kind in KERNEL_MAPPED and (vma.start, vma.end) not in made_here
                or vma.kind is VmaKind.VSYSCALL or is_aio_ring(vma)):
            continue                              # an AIO ring: made by resources/aio.py
        if vma.cow:                               # inherited from the parent: in place already
            if id(vma) in with_pages and not vma.prot & PROT_WRITE:
                remote.checked("mprotect", vma.start, vma.end - vma.start, vma.prot | PROT_WRITE,
                               step=f"open {vma.start:#x}-{vma.end:#x} for its own pages")
            _forget_parent_pages(remote, vma, runs)
            continue
        length = vma.end - vma.start
        prot = vma.prot | (PROT_WRITE if id(vma) in with_pages else 0)
        step = f"map {vma.start:#x}-{vma.end:#x} {vma.path or '[anon]'}"
        flags = MAP_FIXED | (MAP_SHARED if vma.shared else MAP_PRIVATE)
        if "dp" in vma.vmflags.split():
            flags = MAP_FIXED | MAP_DROPPABLE
        if "gd" in vma.vmflags.split():
            flags |= MAP_GROWSDOWN
        if "nr" in vma.vmflags.split():
            flags |= MAP_NORESERVE
        if is_sysv(vma):
            base = vma.start - vma.pgoff          # shmat maps the whole segment from there
            given = PROT_READ | (vma.prot & (PROT_WRITE | PROT_EXEC))
            if (vma.inode, base) not in attached:
                sysvipc.attach_shm_frozen(remote, vma.inode, base, readonly=not vma.prot & PROT_WRITE,
                                          executable=bool(vma.prot & PROT_EXEC))
                attached.add((vma.inode, base))
            if vma.prot != given:
                remote.checked("mprotect", vma.start, length, vma.prot, step=step)
        elif _made_object(vma, shared) is not None:  # a shared object or deleted file ptckpt made
            remote.checked("mmap", vma.start, length, prot, flags, _made_object(vma, shared), vma.pgoff,
                           step=step)
        elif vma.kind in (VmaKind.ANON_PRIVATE, VmaKind.HEAP, VmaKind.STACK, VmaKind.ANON_SHARED, VmaKind.VDSO):
            remote.checked("mmap", vma.start, length, prot, flags | MAP_ANONYMOUS, 2**64 - 1, 0,
                           step=step)
        elif vma.kind in (VmaKind.FILE_PRIVATE, VmaKind.FILE_SHARED, VmaKind.SHMEM, VmaKind.DEVICE):
            fd = files.open(vma.path, O_RDWR if may_write_file(vma) else O_RDONLY, step)
            remote.checked("mmap", vma.start, length, prot, flags, fd, vma.pgoff, step=step)
        else:
            raise ValueError(f"cannot restore mapping {vma.path!r} ({vma.kind.name})")
    files.close_all()
    if lazy is not None:
        sources = lazy.register_frozen(remote, mem.pid, vmas, sources)
    sizes = [sum(r.npages for r in part) * PAGE_SIZE for _fd, _offset, part in sources]
    progress.expect(sum(sizes))
    for pages_fd, data_offset, part in sources:      # each says what it moved as it goes
        if not fill_pages_in_target(remote, part, pages_fd, data_offset, mem):
            fill_pages(mem, part, pages_fd, data_offset)
    if made_here:
        _write_proxy(mem, proxy, made_here[0][0])
    for vma in vmas:
        if id(vma) in with_pages and not vma.prot & PROT_WRITE:
            remote.checked("mprotect", vma.start, vma.end - vma.start, vma.prot,
                           step=f"protect {vma.start:#x}-{vma.end:#x}")
    # with the proxy, the image's [vvar] areas stay empty: no advice for them
    restore_advice_frozen(remote, [v for v in vmas if not made_here or v.kind not in KERNEL_MAPPED
                                   or v.kind is VmaKind.VDSO])


def _runs_outside(runs: Sequence[PageRun], spans: Sequence[tuple[int, int]]) -> list[PageRun]:
    """`runs` without their pages inside `spans` (offsets moved with what is cut off)."""
    out = []
    for r in runs:
        for s, e in _without([(r.vaddr, r.vaddr + r.npages * PAGE_SIZE)], spans):
            out.append(PageRun(s, (e - s) // PAGE_SIZE, r.offset + s - r.vaddr))
    return out


def _write_proxy(mem: AddressSpace, proxy, image_base: int) -> None:
    """The jumps of the vdso proxy over the image's vdso bytes, into this kernel's vdso."""
    host_base = next(m.start for m in procfs.read_maps(mem.pid) if m.path == "[vdso]")
    for address, code in proxy.patches(image_base, host_base):
        mem.write(address, code)


MADV_DONTNEED = 4


def _forget_parent_pages(remote, vma: Vma, runs: Sequence[PageRun]) -> None:
    """In an inherited mapping, the pages that are neither shared with the parent nor saved
    for this process were not there (or were the file's) at the dump: drop the parent's."""
    mine = [(r.vaddr, r.vaddr + r.npages * PAGE_SIZE) for r in runs
            if r.vaddr < vma.end and r.vaddr + r.npages * PAGE_SIZE > vma.start]
    for s, e in _without([(vma.start, vma.end)], list(vma.cow) + mine):
        remote.checked("madvise", s, e - s, MADV_DONTNEED, step=f"drop the parent's pages {s:#x}-{e:#x}")


def may_write_file(vma: Vma) -> bool:
    """A shared file mapping that may be made writable (VmFlags "mw", VM_MAYWRITE: its file
    was open for writing when mapped), so mprotect(PROT_WRITE) works after restore too."""
    return bool(vma.shared and (vma.prot & PROT_WRITE or "mw" in vma.vmflags.split()))


def _vmas_with_pages(vmas: Sequence[Vma], runs: Sequence[PageRun]) -> set[int]:
    """id() of each VMA that has saved pages (they need PROT_WRITE while being filled)."""
    ordered = sorted(vmas, key=lambda v: v.start)
    starts = [v.start for v in ordered]
    out: set[int] = set()
    for r in runs:
        lo = r.vaddr
        hi = r.vaddr + r.npages * PAGE_SIZE
        i = bisect.bisect_right(starts, lo) - 1
        while 0 <= i < len(ordered) and ordered[i].start < hi:
            if ordered[i].end > lo:
                out.add(id(ordered[i]))
            i += 1
    return out


FILL_BUFFER = 32 * 1024 * 1024
_IOV_BATCH = 256                      # iovecs per injected preadv (the tracee's scratch holds 4 KiB)
_GROUP_MAX = 64 << 20                 # what one injected preadv moves: a progress step (~0.2 ms each)


def fill_pages_in_target(remote, runs: Sequence[PageRun], pages_fd: int, data_offset: int,
                         mem: AddressSpace | None = None) -> bool:
    """The tracee reads its saved pages itself: the image's page file opened in it, then
    injected preadv()s straight into its memory, one per run of pages consecutive in the
    file (up to _IOV_BATCH mappings each).  One copy, page cache to memory, and the page
    faults are the tracee's own: a memory limit ends it, not ptckpt.  Given `mem`, a big
    fill is shared: a thread of ptckpt copies half of it meanwhile (resources/fillbeside).
    False when the tracee cannot open the file, or the pages lie in more pieces of the
    file than injected calls pay for (an incremental chain's): then ptckpt copies
    (fill_pages)."""
    if not runs:
        return True
    groups = _file_groups(runs)
    if len(groups) > _INJECT_MAX_CALLS + sum(r.npages for r in runs) * PAGE_SIZE // _GROUP_MAX:
        return False                          # (the groups a size cut adds are not pieces)
    path = os.readlink(f"/proc/self/fd/{pages_fd}")
    if not path.startswith("/") or path.endswith(" (deleted)"):
        path = f"/proc/{os.getpid()}/fd/{pages_fd}"     # a memfd (decompressed page data)
    with remote.scratch(os.fsencode(path) + b"\0") as p:
        fd = remote.syscall("openat", -100, int(p), os.O_RDONLY | os.O_CLOEXEC, 0)
    if fd < 0:
        return False
    beside = None
    failed = True
    try:
        if mem is not None:
            groups, beside = fillbeside.share(mem, groups, pages_fd, data_offset)
        for g in groups:
            iov = b"".join(struct.pack("<QQ", vaddr, n) for _o, vaddr, n in g)
            want, offset = sum(n for _o, _v, n in g), data_offset + g[0][0]
            with remote.scratch(iov) as iovp:
                got = remote.checked("preadv", fd, int(iovp), len(g), offset, 0,
                                     step=f"read {want} bytes of pages at {g[0][1]:#x} from {path}")
            if got != want:                # short: the page file ends early (or a fault)
                from ..errors import CorruptImage
                raise CorruptImage(path, f"page data ends early at offset {offset + got}")
            progress.moved(got)
        failed = False
    finally:
        try:
            if beside is not None:
                beside.join(abandon=failed)
        finally:
            remote.syscall("close", fd)
    return True


_INJECT_MAX_CALLS = 256       # ~0.2 ms each; ptckpt's own preadv + process_vm_writev are µs


def _file_groups(runs: Sequence[PageRun]) -> list[list[tuple[int, int, int]]]:
    """[(file offset, vaddr, length)] groups, each consecutive in the file: one preadv each."""
    groups: list[list[tuple[int, int, int]]] = []
    size = 0                                  # bytes of the last group
    for r in sorted(runs, key=lambda r: r.offset):
        pos, left, vaddr = r.offset, r.npages * PAGE_SIZE, r.vaddr
        while left:
            take = min(left, _GROUP_MAX)
            g = groups[-1] if groups else None
            if (g is None or len(g) == _IOV_BATCH or g[-1][0] + g[-1][2] != pos
                    or size + take > _GROUP_MAX):
                g = []
                groups.append(g)
                size = 0
            g.append((pos, vaddr, take))
            size += take
            pos, vaddr, left = pos + take, vaddr + take, left - take
    return groups


def fill_pages(mem: AddressSpace, runs: Sequence[PageRun], pages_fd: int, data_offset: int) -> None:
    """Copy the saved pages into the tracee: big preadv()s from the image into one reused
    buffer, each followed by one process_vm_writev chain over the runs it holds."""
    buf = mmap.mmap(-1, FILL_BUFFER)
    view = memoryview(buf)
    own = -1
    if fcntl.fcntl(pages_fd, fcntl.F_GETFL) & os.O_DIRECT and len(runs) > _INJECT_MAX_CALLS:
        # pieces scattered over the file (an incremental chain's): through the page cache
        pages_fd = own = os.open(f"/proc/self/fd/{pages_fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        batch: list[tuple[int, int]] = []     # (vaddr, length), consecutive in the file
        start = size = 0
        for r in sorted(runs, key=lambda r: r.offset):
            pos, left, vaddr = r.offset, r.npages * PAGE_SIZE, r.vaddr
            while left:
                if batch and (pos != start + size or size == FILL_BUFFER):
                    _fill_batch(mem, pages_fd, data_offset + start, view, size, batch)
                    batch, size = [], 0
                if not batch:
                    start = pos
                take = min(left, FILL_BUFFER - size)
                batch.append((vaddr, take))
                size += take
                pos += take
                vaddr += take
                left -= take
        if batch:
            _fill_batch(mem, pages_fd, data_offset + start, view, size, batch)
    finally:
        # After an error, slices of the view may live on in its traceback: the buffer then
        # goes with them, and the error itself is what is reported.
        if own >= 0:
            os.close(own)
        with contextlib.suppress(BufferError):
            view.release()
            buf.close()


def _fill_batch(mem: AddressSpace, fd: int, offset: int, view: memoryview, size: int,
                batch: list[tuple[int, int]]) -> None:
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:size]], offset + got)
        if n <= 0:
            from ..errors import CorruptImage
            raise CorruptImage(f"fd {fd}", f"page data ends early at offset {offset + got}")
        got += n
    mem.write_from(view[:size], batch)
    progress.moved(size)
