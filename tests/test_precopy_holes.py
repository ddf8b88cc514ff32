"""A background dump copies memory while the program runs: a range it reads may span two
mappings the kernel had merged, and one of them be unmapped meanwhile.  What is still
mapped of that range must be kept (read now, or counted as written so that the next
pass or the freeze copies it); before, the whole range was dropped and its protection
kept where a new mapping had come in the hole (the kernel refuses to unprotect a range
with a mapping it does not protect), so the part still mapped counted as not written and
was in no pass: the page next to the hole came back as zeros (the churner test's "BAD
ballast word 0").

These run on ptckpt's own memory: a real mapping, a real hole, the real kernel's
userfaultfd write-protection."""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct

import pytest

from ptckpt.resources import memory, memtrack
from ptckpt.tracee import AddressSpace

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
SYS_userfaultfd = 323


@pytest.fixture
def three_pages_with_a_hole():
    """Three anonymous pages, the first and last filled (b"A", b"C"), then the middle one
    unmapped: (start, the hole's start)."""
    base = _libc.mmap(None, 3 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                      mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    ctypes.memset(base, ord("A"), PAGE)
    ctypes.memset(base + 2 * PAGE, ord("C"), PAGE)
    yield base
    _libc.munmap(base, 3 * PAGE)


def test_a_range_read_while_running_keeps_what_is_still_mapped(three_pages_with_a_hole):
    base = three_pages_with_a_hole
    assert _libc.munmap(base + PAGE, PAGE) == 0
    buf = memoryview(bytearray(3 * PAGE))
    lost: list = []
    with AddressSpace(os.getpid()) as mem:
        kept = memory._read_running(mem, buf, [(base, base + 3 * PAGE, True)], lost)
    assert kept == [(base, base + PAGE, True), (base + 2 * PAGE, base + 3 * PAGE, True)]
    assert lost == [(base + PAGE, base + 2 * PAGE)]
    assert bytes(buf[:PAGE]) == b"A" * PAGE and bytes(buf[PAGE:2 * PAGE]) == b"C" * PAGE


def test_unprotecting_a_range_remapped_in_part_marks_the_rest(three_pages_with_a_hole):
    base = three_pages_with_a_hole
    ufd = _libc.syscall(SYS_userfaultfd, os.O_CLOEXEC | os.O_NONBLOCK | memtrack.UFFD_USER_MODE_ONLY)
    if ufd < 0:
        pytest.skip(f"no userfaultfd here: {os.strerror(ctypes.get_errno())}")
    tracker = memtrack.Tracker(os.getpid(), -1, ufd, None)
    try:
        fcntl.ioctl(ufd, memtrack.UFFDIO_API, bytearray(struct.pack("<QQQ", memtrack.UFFD_API, memtrack.FEATURES, 0)))
        fcntl.ioctl(ufd, memtrack.UFFDIO_REGISTER, bytearray(struct.pack(
            "<QQQQ", base, 3 * PAGE, memtrack.UFFDIO_REGISTER_MODE_WP, 0)))
        tracker.rewritten([(base, base + 3 * PAGE)])           # protects every page
        kept = [(base, base + PAGE), (base + 2 * PAGE, base + 3 * PAGE)]
        assert tracker.written(kept) == [], "protected: nothing written yet"
        assert _libc.munmap(base + PAGE, PAGE) == 0
        # and a new mapping there, which no userfaultfd protects: the kernel then refuses the range
        assert _libc.mmap(base + PAGE, PAGE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                          | 0x10, -1, 0) == base + PAGE                          # MAP_FIXED
        tracker.unprotect(base, base + 3 * PAGE)
        assert tracker.written(kept) == kept, "both pages of the old mapping count as written"
    finally:
        tracker.close()
