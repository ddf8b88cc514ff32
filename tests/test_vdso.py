"""The vdso proxy: a restore on a kernel whose vdso is another build's (resources/vdso.py).

The image of a real process is made to look as if another kernel had made it: its saved
vdso pages become the vdso of Debian's 6.1.0-50-cloud-amd64 kernel (fixtures/vdso/, see
fixtures/README.md), and the program's pointers into its vdso (glibc's cached
clock_gettime, the GOT slots its gettimeofday and time IFUNCs filled) are moved to the
same functions in that build, as that kernel's vdso would have had them.  Found here by
value: every 8-byte word of the saved memory equal to the address of a vdso function.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import struct
import time
from array import array
from pathlib import Path

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import PAGE_SIZE, VmaKind

from conftest import kill_pids, pid_alive, reap_orphans, wait_until
from test_lazy import lazy  # noqa: F401 (a fixture)
from test_restore import _dump_kill, _one_line, _restore, _rewrite_image

FOREIGN = Path(__file__).resolve().parent.parent / "fixtures" / "vdso" / "vdso64-6.1.0-50-cloud-amd64.so"
AT_SYSINFO_EHDR = 33


def _functions(text: bytes) -> dict[str, int]:
    """name -> offset of each function a vdso exports, from its .dynsym section (pyelftools
    read here on its own, not through ptckpt's parser); the vdso is linked at 0."""
    from elftools.elf.elffile import ELFFile
    elf = ELFFile(io.BytesIO(text))
    assert next(elf.iter_segments())["p_vaddr"] == 0
    return {s.name: s["st_value"] for s in elf.get_section_by_name(".dynsym").iter_symbols()
            if s["st_info"]["type"] == "STT_FUNC"}


def _vdso_of(image_dir: Path):
    """(the image's [vdso] mapping, its saved bytes)."""
    with ImageReader(image_dir) as image:
        pid = image.inventory.root_pid
        vma = next(v for v in image.process(pid).vmas if v.kind is VmaKind.VDSO)
        text = bytearray(vma.end - vma.start)
        for run in image.page_runs(pid):
            data = image.read_pages(pid, run)
            for i in range(run.npages):
                at = run.vaddr + i * PAGE_SIZE
                if vma.start <= at < vma.end:
                    text[at - vma.start:at - vma.start + PAGE_SIZE] = data[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]
    assert text.startswith(b"\x7fELF"), "the dump saves the vdso's bytes"
    return vma, bytes(text)


def _as_made_elsewhere(src: Path, dst: Path, foreign: bytes) -> int:
    """Image `src` as another kernel (whose vdso is `foreign`) would have made it: the vdso
    pages hold `foreign`, and each saved word pointing at a function of the real vdso now
    points at the same function of `foreign`.  Returns how many words were moved."""
    vma, real = _vdso_of(src)
    assert len(foreign) <= vma.end - vma.start
    foreign = foreign.ljust(vma.end - vma.start, b"\0")
    old, new = _functions(real), _functions(foreign)
    moved = {vma.start + old[n]: vma.start + new[n] for n in old if n in new and old[n] != new[n]}
    count = 0

    def change(vaddr: int, data: bytes) -> bytes:
        nonlocal count
        out = bytearray(data)
        for i in range(0, len(data), PAGE_SIZE):
            at = vaddr + i
            if vma.start <= at < vma.end:
                out[i:i + PAGE_SIZE] = foreign[at - vma.start:at - vma.start + PAGE_SIZE]
                continue
            words = array("Q", data[i:i + PAGE_SIZE])
            for j, w in enumerate(words):
                if w in moved:
                    words[j] = moved[w]
                    count += 1
            out[i:i + PAGE_SIZE] = words.tobytes()
        return bytes(out)

    _rewrite_image(src, dst, lambda p: p, change)
    return count


def _clocks(target) -> tuple[int, ...]:
    """rounds, CLOCK_MONOTONIC ns, CLOCK_REALTIME ns, gettimeofday us (fixtures/clocks.c)."""
    fields = target.out_path.read_text().split()
    return tuple(int(f) for f in fields) if len(fields) == 4 else (0, 0, 0, 0)


def _auxv(pid: int, key: int) -> int:
    data = Path(f"/proc/{pid}/auxv").read_bytes()
    pairs = dict(struct.iter_unpack("<QQ", data))
    return pairs[key]


@pytest.fixture
def clocks_image(spawn, ptckpt, tmp_path):
    target = spawn("clocks")
    wait_until(lambda: _clocks(target)[0] > 50, 10, message="clocks runs")
    _dump_kill(ptckpt, target, tmp_path / "img")
    return target, tmp_path / "img"


def test_clocks_go_on_through_the_proxy_of_another_kernels_vdso(clocks_image, ptckpt, tmp_path):
    """clock_gettime, gettimeofday and time, which glibc calls in the vdso, keep working
    after a restore whose image's vdso is another kernel build's: the program's pointers
    lead into the image's vdso bytes, whose entries the proxy turns into jumps into this
    kernel's vdso.  Without the proxy they would run this kernel's vdso at the other
    build's offsets (the middle of other functions)."""
    target, image = clocks_image
    res = ptckpt("check", "--image", image, "--json")
    found = {f["what"]: f for f in json.loads(res.stdout)}
    assert res.returncode == 0 and found["vdso"]["ok"], res.stdout + res.stderr
    assert "the same build as this kernel's" in found["vdso"]["detail"], found["vdso"]

    moved = _as_made_elsewhere(image, tmp_path / "elsewhere", FOREIGN.read_bytes())
    assert moved >= 2, "glibc's pointers to clock_gettime and gettimeofday were found and moved"
    res = ptckpt("check", "--image", tmp_path / "elsewhere", "--json")
    found = {f["what"]: f for f in json.loads(res.stdout)}
    assert res.returncode == 0, res.stdout + res.stderr
    detail = found["vdso"]["detail"]
    assert found["vdso"]["ok"] and "vdso proxy" in detail and "704e99b53cb5" in detail, detail
    assert "__vdso_clock_gettime" in detail and "__vdso_gettimeofday" in detail, detail

    at_dump = _clocks(target)
    vma, _text = _vdso_of(tmp_path / "elsewhere")
    pid = _restore(ptckpt, tmp_path / "elsewhere")
    assert pid == target.pid
    first = _clocks(target)
    wait_until(lambda: _clocks(target)[0] > first[0] + 100, 10, message="the clocks loop goes on")
    time.sleep(0.2)
    later = _clocks(target)
    assert all(b > a for a, b in zip(at_dump, later)), (at_dump, later)
    assert later[2] // 1000 - later[3] < 2_000_000 and abs(later[2] / 1e9 - time.time()) < 5, later
    target.assert_ok()                      # the fixture checks what each call returned

    # The program still sees its vdso where it was (auxv, and the proxy's ELF there);
    # this kernel's vdso lies elsewhere, and the proxy's entries lead into it.
    assert _auxv(pid, AT_SYSINFO_EHDR) == vma.start
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    kernel = [line for line in maps if line.endswith("[vdso]")]
    assert len(kernel) == 1 and not kernel[0].startswith(f"{vma.start:x}-"), maps
    host_base = int(kernel[0].split("-")[0], 16)
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(vma.start)
        proxy = mem.read(vma.end - vma.start)
        mem.seek(host_base)
        host = _functions(mem.read(2 * PAGE_SIZE))
    entry = _functions(proxy)["__vdso_clock_gettime"]
    assert proxy[entry:entry + 12] == b"\x48\xb8" + struct.pack("<Q", host_base + host["__vdso_clock_gettime"]) \
        + b"\xff\xe0"

    # Dumped again and restored here, the proxy is plain memory and this kernel's vdso its own.
    _dump_kill(ptckpt, target, tmp_path / "again")
    at_dump = _clocks(target)
    assert _restore(ptckpt, tmp_path / "again") == target.pid
    wait_until(lambda: _clocks(target)[0] > at_dump[0] + 100, 10, message="the clocks loop goes on again")
    target.assert_ok()


def test_a_forked_child_goes_on_through_the_proxy_too(spawn, ptckpt, tmp_path):
    """In a tree each process gets its own proxy: a child is cloned from its parent's rebuilt
    address space (proxy and parked vdso included) and rebuilds its own the same way."""
    target = spawn("clocks", 1000, "fork")
    child = int(re.search(r"^CHILD (\d+)$", target.stdout_text(), re.M).group(1))
    child_out = Path(f"{target.out_path}.child")

    def child_clocks() -> tuple[int, ...]:
        fields = child_out.read_text().split() if child_out.exists() else []
        return tuple(int(f) for f in fields) if len(fields) == 4 else (0, 0, 0, 0)

    try:
        wait_until(lambda: _clocks(target)[0] > 50 and child_clocks()[0] > 50, 10, message="both run")
        _dump_kill(ptckpt, target, tmp_path / "img", members=[child])
        assert _as_made_elsewhere(tmp_path / "img", tmp_path / "elsewhere", FOREIGN.read_bytes()) >= 4
        res = ptckpt("check", "--image", tmp_path / "elsewhere", "--json")
        lines = [f for f in json.loads(res.stdout) if f["what"] == "vdso"]
        assert res.returncode == 0 and len(lines) == 2, res.stdout + res.stderr
        assert all(f["ok"] and "vdso proxy" in f["detail"] for f in lines), lines
        at_dump = _clocks(target), child_clocks()
        assert _restore(ptckpt, tmp_path / "elsewhere") == target.pid
        wait_until(lambda: _clocks(target)[0] > at_dump[0][0] + 100 and child_clocks()[0] > at_dump[1][0] + 100,
                   10, message="both clocks loops go on")
        assert os.path.exists(f"/proc/{child}") and target.stdout_text().count("READY") == 1
        target.assert_ok()
    finally:
        kill_pids([child])
        reap_orphans()


def test_a_lazy_restore_of_a_compressed_image_makes_the_proxy_too(clocks_image, ptckpt, tmp_path, lazy):
    """With --lazy, compressed frames are decompressed as they are needed: the vdso's are
    decompressed before the restore looks at its bytes."""
    target, image = clocks_image
    _as_made_elsewhere(image, tmp_path / "elsewhere", FOREIGN.read_bytes())
    res = ptckpt("compact", "-D", tmp_path / "elsewhere", "-o", tmp_path / "zstd", "--compress", "zstd:1")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "zstd") as compressed:
        assert compressed.compression(target.pid).startswith("zstd")
    res = ptckpt("check", "--image", tmp_path / "zstd", "--json")      # its frames read one by one
    found = {f["what"]: f for f in json.loads(res.stdout)}
    assert res.returncode == 0 and "704e99b53cb5" in found["vdso"]["detail"], res.stdout + res.stderr
    at_dump = _clocks(target)
    pid, _info = lazy(tmp_path / "zstd")
    assert pid == target.pid
    wait_until(lambda: _clocks(target)[0] > at_dump[0] + 100, 10, message="the clocks loop goes on")
    target.assert_ok()


def test_a_vdso_exporting_what_this_kernels_lacks_is_refused_by_name(clocks_image, ptckpt, tmp_path):
    """A function the image's vdso exports and this kernel's does not has nowhere to lead:
    `check --image` and restore name it, exit 15, before anything runs."""
    target, image = clocks_image
    foreign = FOREIGN.read_bytes()
    assert foreign.count(b"__vdso_getcpu\0") == 1
    _as_made_elsewhere(image, tmp_path / "odd", foreign.replace(b"__vdso_getcpu\0", b"__vdso_getcpX\0"))
    res = ptckpt("check", "--image", tmp_path / "odd")
    assert res.returncode == ExitCode.INCOMPATIBLE, res.stdout + res.stderr
    assert any(line.startswith("vdso") and "NO" in line and "__vdso_getcpX" in line
               for line in res.stdout.splitlines()), res.stdout
    _one_line(ptckpt("restore", "-D", tmp_path / "odd"), ExitCode.INCOMPATIBLE, "__vdso_getcpX", "vdso")
    assert not pid_alive(target.pid)


def test_a_thread_stopped_inside_a_vdso_that_needs_the_proxy_is_refused(clocks_image, ptckpt, tmp_path):
    """The rest of a vdso function would read the other kernel's data pages, which the proxy
    does not bring: a thread stopped there is named, exit 15, before anything runs."""
    from ptckpt.formats.model import GP_REG_NAMES
    target, image = clocks_image
    _as_made_elsewhere(image, tmp_path / "elsewhere", FOREIGN.read_bytes())
    vma, _text = _vdso_of(tmp_path / "elsewhere")
    inside = vma.start + _functions(FOREIGN.read_bytes())["__vdso_clock_gettime"] + 4
    rip = GP_REG_NAMES.index("rip")

    def stopped_inside(p):
        t = p.threads[0]
        regs = t.regs[:rip] + (inside,) + t.regs[rip + 1:]
        return dataclasses.replace(p, threads=(dataclasses.replace(t, regs=regs),) + p.threads[1:])

    _rewrite_image(tmp_path / "elsewhere", tmp_path / "inside", stopped_inside)
    res = ptckpt("check", "--image", tmp_path / "inside")
    assert res.returncode == ExitCode.INCOMPATIBLE, res.stdout + res.stderr
    assert any(line.startswith("vdso") and "NO" in line and f"thread {target.pid}" in line and f"{inside:#x}" in line
               for line in res.stdout.splitlines()), res.stdout
    _one_line(ptckpt("restore", "-D", tmp_path / "inside"), ExitCode.INCOMPATIBLE, "inside the image's vdso")
    assert not pid_alive(target.pid)


def test_an_image_without_its_vdso_bytes_restores_where_the_layout_is_the_same(clocks_image, ptckpt, tmp_path):
    """An image saved before the vdso's bytes were (an older ptckpt) is compared by layout,
    as then: this kernel's vdso takes its place."""
    target, image = clocks_image
    vma, _text = _vdso_of(image)

    def without_vdso(vaddr: int, data: bytes):
        end = vaddr + len(data)
        if vaddr < vma.end and end > vma.start:
            assert (vaddr, end) == (vma.start, vma.end), "the vdso's pages are a run of their own"
            return None
        return data

    _rewrite_image(image, tmp_path / "older", lambda p: p, without_vdso)
    res = ptckpt("check", "--image", tmp_path / "older", "--json")
    found = {f["what"]: f for f in json.loads(res.stdout)}
    assert res.returncode == 0 and "no copy of its vdso" in found["vdso"]["detail"], res.stdout
    at_dump = _clocks(target)
    assert _restore(ptckpt, tmp_path / "older") == target.pid
    wait_until(lambda: _clocks(target)[0] > at_dump[0] + 100, 10, message="the clocks loop goes on")
    target.assert_ok()
    assert os.path.exists(f"/proc/{target.pid}")
