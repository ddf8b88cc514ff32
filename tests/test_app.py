"""Application control without preload (ptckpt.app, ptckpt.h, ptckpt run, ptckpt control):
critical sections a dump waits for, checkpoints the program asks for itself and its view of
"restored" vs "continued", a resume held until the program is ready, interval checkpoints."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ptckpt.app import LAYOUT, OFF_CRITICAL, OFF_GENERATION, OFF_STATE
from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import PAGE_SIZE

from conftest import kill_pids, reap_orphans, wait_until
from test_emulator import peek
from test_restore import _one_line

APPCTL_PY = Path(__file__).parent.parent / "fixtures" / "appctl.py"


def _syms(target) -> dict[str, int]:
    return {line.split()[1]: int(line.split()[2], 16) for line in target.preamble if line.startswith("SYM ")}


def _image_bytes(image: Path, pid: int, addr: int, size: int) -> bytes:
    with ImageReader(image) as reader:
        for run in reader.page_runs(pid):
            if run.vaddr <= addr < run.vaddr + run.npages * PAGE_SIZE:
                data = reader.read_pages(pid, run)
                return data[addr - run.vaddr: addr - run.vaddr + size]
    return bytes(size)                     # a page never written reads as zeros


def _int(raw: bytes, offset: int = 0, fmt: str = "<i") -> int:
    return struct.unpack_from(fmt, raw, offset)[0]


@pytest.mark.parametrize("build", ["x86_64", "-m32"])
def test_dump_waits_for_the_end_of_a_critical_section(spawn, ptckpt, tmp_path, request, build):
    """(Built with -m32 too: ptckpt.h's block has one layout in both ABIs.)"""
    appctl = "appctl" if build == "x86_64" else str(request.getfixturevalue("fixture_bins32")["appctl"])
    target = spawn(appctl, "critical", 300)     # inside a 300 ms section most of the time
    sym = _syms(target)
    for i in range(3):
        res = ptckpt("dump", target.pid, "-D", tmp_path / f"img{i}")
        assert res.returncode == 0, res.stderr
        block = _image_bytes(tmp_path / f"img{i}", target.pid, sym["ptckpt_app"], LAYOUT.size)
        assert _int(block, OFF_CRITICAL) == 0, "frozen inside a critical section"
        assert _int(_image_bytes(tmp_path / f"img{i}", target.pid, sym["in_section"], 4)) == 0
    live = peek(target.pid, sym["ptckpt_app"], LAYOUT.size)
    assert (_int(live, OFF_STATE), _int(live, OFF_GENERATION, "<Q")) == (1, 3), "CONTINUED after 3 dumps"
    target.assert_ok()


def test_a_critical_section_longer_than_the_timeout_is_named_and_nothing_is_dumped(spawn, ptckpt, tmp_path):
    target = spawn("appctl", "critical", 5000)
    sym = _syms(target)
    wait_until(lambda: _int(peek(target.pid, sym["in_section"], 4)) == 1, 5, message="inside the section")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--critical-timeout", "300ms")
    _one_line(res, ExitCode.CRITICAL_SECTION, f"process {target.pid}", "'flush'", "0.3 s", "runs on")
    assert not (tmp_path / "img").exists()
    with open(f"/proc/{target.pid}/status") as f:
        assert "TracerPid:\t0" in f.read()
    before = int(open(target.out_path).read() or 0)
    wait_until(lambda: int(open(target.out_path).read() or 0) > before, 10, message="it counts on")
    target.assert_ok()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_c_program_asks_for_its_own_checkpoint_and_tells_restored_from_continued(
        fixture_bins, ptckpt, tmp_path):
    out = tmp_path / "out"
    res = ptckpt("run", "-D", tmp_path / "run", "--", fixture_bins["appctl"], out, "request", 100)
    assert res.returncode == 0, res.stderr
    report = [line for line in res.stdout.splitlines() if line.split()[0] in ("CHECKPOINT", "DONE")]
    assert report == ["CHECKPOINT continued 100", "DONE 200"], res.stdout
    assert "checkpoint (program)" in res.stderr
    image = tmp_path / "run" / "ckpt-0001"
    assert oct(image.stat().st_mode & 0o777) == "0o700"
    assert not (tmp_path / "run" / "control.sock").exists()
    res = ptckpt("restore", "-D", image, "--inherit-stdio", "--file-policy", "warn")
    assert res.returncode == 0, res.stderr
    assert _lines_of(res.stdout) == ["CHECKPOINT restored 100", "DONE 200"]
    # without `ptckpt run` the call says so at once
    plain = subprocess.run([fixture_bins["appctl"], tmp_path / "out2", "request", "3"], capture_output=True,
                           text=True, timeout=30, env={k: v for k, v in os.environ.items() if k != "PTCKPT_CONTROL"})
    assert "CHECKPOINT no-supervisor 3" in plain.stdout and plain.returncode == 0


def _lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.split()[0] in ("CHECKPOINT", "DONE")]


def test_python_program_holds_its_other_threads_until_ready_after_a_restore(ptckpt, tmp_path):
    outdir = tmp_path / "out"
    outdir.mkdir()
    res = ptckpt("run", "-D", tmp_path / "run", "--", sys.executable, APPCTL_PY, outdir)
    assert res.returncode == 0, res.stderr
    assert "CHECKPOINT continued" in res.stdout and "DONE" in res.stdout, res.stdout
    res = ptckpt("restore", "-D", tmp_path / "run" / "ckpt-0001", "--inherit-stdio", "--file-policy", "warn")
    assert res.returncode == 0, res.stderr
    got = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()}
    assert got["CHECKPOINT"][0] == "restored", res.stdout
    restored_at, ready_at = float(got["CHECKPOINT"][1]), float(got["READY_AT"][0])
    assert ready_at - restored_at >= 0.5
    ticks = [float(x) for x in (outdir / "worker").read_text().split()]
    assert not [t for t in ticks if restored_at < t < ready_at], "the worker ran before ready()"
    assert [t for t in ticks if t > ready_at], "the worker runs after ready()"
    assert "DONE" in got


def test_interval_checkpoints_and_control(fixture_bins, ptckpt, ptckpt_cmd, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "count"
    with open(tmp_path / "run.out", "wb") as so, open(tmp_path / "run.err", "wb") as se:
        sup = subprocess.Popen(ptckpt_cmd + ["run", "-D", str(run_dir), "--interval", "400ms", "--",
                                             str(fixture_bins["counter"]), str(out), "10", "1000"],
                               stdout=so, stderr=se, stdin=subprocess.DEVNULL, start_new_session=True)
    counter = 0
    try:
        wait_until(lambda: (run_dir / "ckpt-0002").exists(), 20, message="two interval checkpoints")
        status = ptckpt("control", run_dir, "status")
        assert status.returncode == 0, status.stderr
        state = json.loads(status.stdout)
        counter = state["pid"]
        assert state["running"] and state["command"][0] == str(fixture_bins["counter"])
        assert [c["reason"] for c in state["checkpoints"]][:2] == ["interval", "interval"]
        taken = ptckpt("control", counter, "checkpoint")          # by the command's pid
        assert taken.returncode == 0, taken.stderr
        assert Path(taken.stdout.strip()).is_dir()
        first_value = _counter_in_image(run_dir / "ckpt-0001", counter, fixture_bins)
        stopped = ptckpt("control", sup.pid, "stop")              # by the run's pid
        # issue 37: a summary line, on stderr like every command's (it printed on stdout)
        assert stopped.returncode == 0 and stopped.stdout == "", stopped
        assert stopped.stderr.startswith(f"stopped {counter}: killed with its children"), stopped.stderr
        assert sup.wait(20) == 128 + 9
        assert not os.path.exists(f"/proc/{counter}") or open(f"/proc/{counter}/stat").read().split()[2] == "Z"
        last = int(out.read_text())
        assert last > first_value
        res = ptckpt("restore", "-D", run_dir / "ckpt-0001", "--detach", "--file-policy", "warn")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: first_value < int(out.read_text() or 0) < last, 10,
                   message="the counter goes on from the first checkpoint's value")
        gone = ptckpt("control", run_dir, "status")
        _one_line(gone, ExitCode.CONTROL, "no run at")
    finally:
        kill_pids([sup.pid, counter] if counter else [sup.pid])
        sup.wait(10)
        reap_orphans()


def _counter_in_image(image: Path, pid: int, fixture_bins) -> int:
    """The `counter` global in the image (its address from the binary's symbol table)."""
    with ImageReader(image) as reader:
        vmas = reader.process(pid).vmas
    exe = str(fixture_bins["counter"])
    base = min(v.start for v in vmas if v.path == exe)
    from elftools.elf.elffile import ELFFile
    with open(exe, "rb") as f:
        sym = ELFFile(f).get_section_by_name(".symtab").get_symbol_by_name("counter")[0]
    return _int(_image_bytes(image, pid, base + sym["st_value"], 8), 0, "<Q")
