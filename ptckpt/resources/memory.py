"""Memory: the VMAs of a process and the page contents a restore needs.

Dump half: :func:`dump_vmas` (from smaps) and :func:`dump_pages_frozen`
(pagemap scan, then process_vm_readv in big batches into one reused buffer,
streamed to the image's pages file: no per-page Python work).
"""

from __future__ import annotations

import os
import stat as _stat
from dataclasses import dataclass
from typing import Iterable, Sequence

from .. import procfs
from ..formats.model import PAGE_SIZE, PageRun, Vma, VmaKind
from ..tracee import AddressSpace

BATCH_BYTES = 64 * 1024 * 1024     # one process_vm_readv batch / one write to the image

_SPECIAL = {
    "[heap]": VmaKind.HEAP,
    "[stack]": VmaKind.STACK,
    "[vdso]": VmaKind.VDSO,
    "[vvar]": VmaKind.VVAR,
    "[vvar_vclock]": VmaKind.VVAR_VCLOCK,
    "[vsyscall]": VmaKind.VSYSCALL,
}

# Kinds whose contents come from the kernel or from a file that stays on disk.
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


def dump_vmas(pid: int) -> list[Vma]:
    """Every VMA of `pid` from /proc/PID/smaps, with the mapped file's size and mtime."""
    out: list[Vma] = []
    for e in procfs.read_smaps(pid):
        st = procfs.stat_map_file(pid, e.start, e.end) if e.inode else None
        kind = classify_vma(e.path, e.shared, e.inode, st)
        out.append(Vma(
            start=e.start, end=e.end, prot=e.prot, shared=e.shared, kind=kind,
            pgoff=e.offset, dev_major=e.dev_major, dev_minor=e.dev_minor,
            inode=e.inode, path=e.path, vmflags=e.vmflags,
            file_size=st.st_size if st else 0,
            file_mtime_ns=st.st_mtime_ns if st else 0,
            file_deleted=e.deleted,
        ))
    return out


def ranges_to_save(pid: int, vma: Vma) -> list[tuple[int, int]]:
    """(start, end) runs of pages of `vma` whose contents go into the image.

    Anonymous memory: pages present or swapped, except those still mapping
    the shared zero page (never written).  Private file mappings: only the
    pages that became anonymous copies (written, or never backed by the
    file); the rest is read again from the file.  Shared anonymous and shmem
    mappings: every present page.  Never-touched pages are absent from the
    page tables and so are never saved.
    """
    if vma.kind in _NO_PAGES or not vma.prot & 1 and vma.kind is VmaKind.OTHER:
        return []
    want_file_pages = vma.kind in (VmaKind.ANON_SHARED, VmaKind.SHMEM)
    runs = procfs.scan_pages(pid, vma.start, vma.end)
    out: list[tuple[int, int]] = []
    for run in runs:
        if run.pfn_zero:
            continue
        if run.file and not want_file_pages:
            continue
        if out and out[-1][1] == run.start:
            out[-1] = (out[-1][0], run.end)
        else:
            out.append((run.start, run.end))
    return out


@dataclass
class PageStats:
    pages: int = 0
    bytes: int = 0


def _batches(ranges: Iterable[tuple[int, int]], limit: int) -> Iterable[list[tuple[int, int]]]:
    """Group (start, end) ranges into batches of at most `limit` bytes, splitting big ones."""
    batch: list[tuple[int, int]] = []
    size = 0
    for start, end in ranges:
        while start < end:
            take = min(end - start, limit - size)
            batch.append((start, start + take))
            size += take
            start += take
            if size == limit:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def dump_pages_frozen(mem: AddressSpace, vmas: Sequence[Vma], pages) -> tuple[list[PageRun], PageStats]:
    """Copy the pages a restore needs into the image's pages file.

    `pages` is the image's PagesWriter (double-buffered: we fill one buffer
    with process_vm_readv while the writer thread checksums and writes the
    other).  Returns the page index and the totals.
    """
    ranges: list[tuple[int, int]] = []
    for vma in vmas:
        ranges.extend(ranges_to_save(mem.pid, vma))
    stats = PageStats()
    index: list[PageRun] = []
    for batch in _batches(ranges, BATCH_BYTES):
        nbytes = sum(e - s for s, e in batch)
        buf = pages.get_buffer(nbytes)
        mem.read_into(buf, [(s, e - s) for s, e in batch])
        offset = pages.submit(buf, nbytes)
        for s, e in batch:
            index.append(PageRun(vaddr=s, npages=(e - s) // PAGE_SIZE, offset=offset))
            offset += e - s
        stats.pages += nbytes // PAGE_SIZE
        stats.bytes += nbytes
    return _merge_runs(index), stats


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
