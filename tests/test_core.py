"""ELF core files from an image (`ptckpt core`, ptckpt/core.py): gdb reads them and shows
every thread's stack with the fixture's own function names; pyelftools finds a note per
thread, the mapped files, and memory the same as the image's.  Bad input: one line."""

from __future__ import annotations

import os
import re
import stat
import struct
import subprocess

import pytest
from elftools.elf.elffile import ELFFile

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import needs, tool
from test_restore import _one_line

GDB = tool("gdb")


def _dump(ptckpt, pid, image):
    res = ptckpt("dump", pid, "-D", image)            # leave-running: the fixture goes on
    assert res.returncode == 0, res.stderr


def _cores(ptckpt, image, out):
    res = ptckpt("core", "-D", image, "-o", out)
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


def _notes(path):
    with open(path, "rb") as f:
        elf = ELFFile(f)
        assert elf["e_type"] == "ET_CORE" and elf["e_machine"] == "EM_X86_64"
        notes = [n for seg in elf.iter_segments() if seg["p_type"] == "PT_NOTE" for n in seg.iter_notes()]
        loads = [(s["p_vaddr"], s["p_memsz"], s["p_filesz"], s["p_offset"])
                 for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
    return notes, loads


def _core_bytes(path, loads, addr: int, size: int) -> bytes:
    for vaddr, memsz, filesz, offset in loads:
        if vaddr <= addr < vaddr + filesz:
            with open(path, "rb") as f:
                f.seek(offset + addr - vaddr)
                return f.read(size)
    raise AssertionError(f"{addr:#x} is in no PT_LOAD with bytes")


@needs("gdb")
@pytest.mark.parametrize("build", ["x86_64", "-m32"])
def test_gdb_reads_the_core_of_every_thread(spawn, ptckpt, tmp_path, request, build):
    """(A 32-bit process's core is an ELF32 one for EM_386, as the kernel would dump it.)"""
    threads = "threads" if build == "x86_64" else str(request.getfixturevalue("fixture_bins32")["threads"])
    target = spawn(threads)
    _dump(ptckpt, target.pid, tmp_path / "img")
    lines = _cores(ptckpt, tmp_path / "img", tmp_path / "cores")
    core = tmp_path / "cores" / f"core.{target.pid}"
    with open(core, "rb") as f:
        elf = ELFFile(f)
        assert (elf.elfclass, elf["e_machine"]) == ((64, "EM_X86_64") if build == "x86_64" else (32, "EM_386"))
    assert lines == [f"{core}: process {target.pid}, 5 threads, " + lines[0].rsplit(", ", 1)[1]]
    assert stat.S_IMODE(core.stat().st_mode) == 0o600            # memory secrets
    assert stat.S_IMODE((tmp_path / "cores").stat().st_mode) == 0o700
    out = subprocess.run([GDB, "-batch", "-nx", "-ex", "thread apply all bt", target.argv[0], str(core)],
                         capture_output=True, text=True, timeout=120).stdout
    assert out.count("\nThread ") == 5, out
    # "#3  0x... in main (" or, at the start of a line's code, "#3  main (" (no address)
    assert re.search(r"#\d+\s+(0x[0-9a-f]+ in )?main \(", out), out
    assert len(re.findall(r"#\d+\s+(?:0x[0-9a-f]+ in )?count \(", out)) == 4, out
    assert "nanosleep" in out, out


def test_the_core_holds_the_images_memory_threads_and_files(spawn, ptckpt, tmp_path):
    target = spawn("threads")
    _dump(ptckpt, target.pid, tmp_path / "img")
    _cores(ptckpt, tmp_path / "img", tmp_path / "cores")
    core = tmp_path / "cores" / f"core.{target.pid}"
    notes, loads = _notes(core)
    kinds = [n["n_type"] for n in notes]
    assert kinds.count("NT_PRSTATUS") == 5 and kinds.count(0x202) == 5      # NT_X86_XSTATE ("LINUX")
    assert kinds.count("NT_PRPSINFO") == kinds.count("NT_AUXV") == kinds.count("NT_FILE") == 1
    files = next(n for n in notes if n["n_type"] == "NT_FILE")["n_desc"]["filename"]
    assert any(os.fsdecode(f) == target.argv[0] for f in files), files
    # struct elf_prstatus: siginfo (12), cursig (2+2), sigpend, sighold (8+8), then pr_pid
    pids = {struct.unpack_from("<i", n["n_desc"], 32)[0] for n in notes if n["n_type"] == "NT_PRSTATUS"}
    with ImageReader(tmp_path / "img") as image:
        proc = image.process(target.pid)
        assert pids == {t.tid for t in proc.threads}
        addr = target.symbols["counters"]
        run = next(r for r in image.page_runs(target.pid) if r.vaddr <= addr < r.vaddr + r.npages * 4096)
        data = image.read_pages(target.pid, run)
    at = addr - run.vaddr
    assert _core_bytes(core, loads, addr, 32) == data[at:at + 32]     # the counters at the dump
    assert core.stat().st_blocks * 512 < core.stat().st_size, "untouched memory stays holes"


def test_a_forked_child_gets_its_own_core(spawn, ptckpt, tmp_path):
    """Pages a child still shares copy-on-write with its parent are kept once, in the
    parent's pages: the child's core has them all the same."""
    target = spawn("forkserver")
    _dump(ptckpt, target.pid, tmp_path / "img")
    lines = _cores(ptckpt, tmp_path / "img", tmp_path / "cores")
    with ImageReader(tmp_path / "img") as image:
        pids = list(image.pids)
        child = pids[1]
        cow = [c for v in image.process(child).vmas for c in v.cow]
    assert len(lines) == len(pids) > 1
    if cow:
        start = cow[0][0]
        parent_core = tmp_path / "cores" / f"core.{pids[0]}"
        child_core = tmp_path / "cores" / f"core.{child}"
        assert _core_bytes(child_core, _notes(child_core)[1], start, 4096) == \
            _core_bytes(parent_core, _notes(parent_core)[1], start, 4096)


def test_bad_input_is_one_line(ptckpt, tmp_path, killed_counter):
    _one_line(ptckpt("core", "-D", tmp_path / "nothing", "-o", tmp_path / "c"), ExitCode.NOT_AN_IMAGE)
    _target, image = killed_counter
    (tmp_path / "afile").write_text("")
    _one_line(ptckpt("core", "-D", image, "-o", tmp_path / "afile"), ExitCode.IO_ERROR, "afile")


def test_the_xstate_notes_are_the_kernels_for_this_cpu(spawn, ptckpt, tmp_path):
    """NT_X86_XSTATE is the regset PTRACE_GETREGSET gives (CPUID's XSAVE size for the XCR0 in
    force: 0x980 on an AMD EPYC with AVX-512, not the 0xa80 of Intel's layout that gdb's
    gcore writes), and NT_X86_XSAVE_LAYOUT, once after the threads' notes, gives each
    feature's size and offset from CPUID leaf 0xD, as the kernel's own core does (Linux 6.11+)."""
    from ptckpt.cpuid import cpuid
    target = spawn("avx")
    _dump(ptckpt, target.pid, tmp_path / "img")
    _cores(ptckpt, tmp_path / "img", tmp_path / "cores")
    notes, _loads = _notes(tmp_path / "cores" / f"core.{target.pid}")
    with ImageReader(tmp_path / "img") as image:
        xcr0, size = image.inventory.xfeatures, image.inventory.xstate_size
        xstate = image.process(target.pid).threads[0].xstate
    assert size == len(xstate) == cpuid(0xD, 0)[1]
    xstates = [n for n in notes if n["n_type"] == 0x202]
    assert [n["n_descsz"] for n in xstates] == [size]
    assert [n["n_type"] for n in notes][-1] == 0x205 and [n["n_name"] for n in notes][-1] == "LINUX"
    layout = notes[-1]["n_desc"]
    layout = layout.encode("latin-1") if isinstance(layout, str) else bytes(layout)
    want = [(bit, *cpuid(0xD, bit)[:2], 0) for bit in range(2, 64) if xcr0 >> bit & 1 and cpuid(0xD, bit)[0]]
    assert list(struct.iter_unpack("<IIII", layout)) == want
    assert max(offset + size_ for _bit, size_, offset, _f in want) <= size
