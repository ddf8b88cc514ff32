"""Which pages go into an image: all-zero pages of anonymous memory are left out, correctly."""

from __future__ import annotations

import mmap
import os
import random
import signal

from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import PAGE_SIZE
from ptckpt.resources.memory import drop_zero_pages, zero_pages

from test_restore import _dump_kill, _restore


def test_drop_zero_pages_compacts_and_splits_runs():
    rng = random.Random(7)
    n = 64
    buf = mmap.mmap(-1, n * PAGE_SIZE)
    view = memoryview(buf)
    pages = []
    for i in range(n):
        kind = rng.random()
        data = bytes(PAGE_SIZE) if kind < 0.4 else (
            bytes(PAGE_SIZE - 1) + b"\1" if kind < 0.55 else os.urandom(PAGE_SIZE))
        view[i * PAGE_SIZE:(i + 1) * PAGE_SIZE] = data
        pages.append(data)
    batch = [(0x10000, 0x10000 + 20 * PAGE_SIZE, True),
             (0x100000, 0x100000 + 30 * PAGE_SIZE, False),     # a file mapping: zeros stay
             (0x900000, 0x900000 + 14 * PAGE_SIZE, True)]
    addrs, keep_zero = [], set()
    for s, e, droppable in batch:
        addrs += range(s, e, PAGE_SIZE)
        if not droppable:
            keep_zero.update(range(s, e, PAGE_SIZE))
    assert sorted(zero_pages(view, n * PAGE_SIZE)) == [i * PAGE_SIZE for i, p in enumerate(pages)
                                                       if p == bytes(PAGE_SIZE)]
    nbytes, kept = drop_zero_pages(view, n * PAGE_SIZE, batch)
    got, off = {}, 0
    for s, e in kept:
        for a in range(s, e, PAGE_SIZE):
            got[a] = bytes(view[off:off + PAGE_SIZE])
            off += PAGE_SIZE
    assert off == nbytes
    assert got == {a: p for a, p in zip(addrs, pages) if p != bytes(PAGE_SIZE) or a in keep_zero}


def test_written_zero_pages_are_not_stored_and_read_back_zero(spawn, ptckpt, tmp_path):
    script = tmp_path / "zeros.py"
    script.write_text(
        "import hashlib, mmap, os, signal, sys, time\n"
        "m = mmap.mmap(-1, 2048 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "for i in range(2048):\n"
        "    page = bytes(4096) if i % 4 else (b'%08d' % i) * 512\n"
        "    m[i * 4096:(i + 1) * 4096] = page          # every page written, 3 of 4 with zeros\n"
        "want = hashlib.sha256(m).hexdigest()\n"
        "def check(sig, frame):\n"
        "    ok = hashlib.sha256(m).hexdigest() == want\n"
        "    open(sys.argv[1], 'a').write('OK\\n' if ok else 'FAIL zeros\\n')\n"
        "signal.signal(signal.SIGUSR1, check)\n"
        "print('SYM region 0x%x' % __import__('ctypes').addressof(__import__('ctypes').c_char.from_buffer(m)), flush=True)\n"
        "print('READY', os.getpid(), flush=True)\n"
        "while True: time.sleep(0.05)\n")
    target = spawn(str(script))
    region = target.symbols["region"]
    _dump_kill(ptckpt, target, tmp_path / "img")
    with ImageReader(tmp_path / "img") as image:
        saved = set()
        for r in image.page_runs(target.pid):
            saved.update(range(r.vaddr, r.vaddr + r.npages * PAGE_SIZE, PAGE_SIZE))
    in_region = sorted((a - region) // PAGE_SIZE for a in saved if region <= a < region + 2048 * PAGE_SIZE)
    assert in_region == list(range(0, 2048, 4)), "only the non-zero pages of the region"
    _restore(ptckpt, tmp_path / "img")
    target.signal(signal.SIGUSR1)
    target.wait_for_line("^OK$", where="out")
    target.assert_ok()
