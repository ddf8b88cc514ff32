"""Incremental dumps (--track-mem, --prev, pre-dump), chains, compaction and compressed
page data, on the scribbler fixture: it keeps writing pages while it is dumped, and
its own log of writes (the count) says what every page must hold, so a restored copy
proves the image was one consistent instant (SIGUSR1: "VERIFY n OK COUNT c")."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader
from ptckpt.resources import memtrack

from conftest import wait_pid_free, wait_until

MIB = 64          # 16384 pages; RATE 2 writes a page a half-millisecond: ~1% between dumps


def _dump(ptckpt, target, image, *extra):
    res = ptckpt("dump", target.pid, "-D", image, *extra)
    assert res.returncode == 0, res.stderr
    return res


def _restore_and_verify(ptckpt, target, image, verified: str = r"VERIFY 1 OK COUNT \d+") -> int:
    """Kill the original, restore `image`, ask the copy to verify (its line: `verified`);
    the number that line ends with."""
    if target.alive():
        os.kill(target.pid, signal.SIGKILL)
        target.wait_exit(10)
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", image, "--detach", "--file-policy", "ignore")
    assert res.returncode == 0, res.stderr
    target.adopt(int(res.stdout.split()[-1]))
    target.signal(signal.SIGUSR1)
    line = target.wait_for_line(verified).group(0)
    target.assert_ok()
    return int(line.split()[-1])


def _count_in(image, pid: int, address: int) -> int:
    """The scribbler's `count` as the image holds it (through the chain)."""
    with ImageReader(image) as reader:
        for run in reader.page_runs(pid):
            if run.vaddr <= address < run.vaddr + run.npages * 4096:
                data = reader.read_pages(pid, run)
                off = address - run.vaddr
                return int.from_bytes(data[off:off + 8], "little")
    raise AssertionError(f"no page at {address:#x} in {image}")


def test_chain_of_five_incremental_dumps_restores_the_last_exactly(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", MIB, 2)
    images = [tmp_path / f"c{i}" for i in range(5)]
    full = _dump(ptckpt, target, images[0], "--track-mem", "--json")
    sizes = []
    for prev, image in zip(images, images[1:]):
        time.sleep(0.3)
        res = _dump(ptckpt, target, image, "--prev", prev)
        assert "warning" not in res.stderr, res.stderr
        with ImageReader(image) as reader:
            sizes.append(reader.pages_length(target.pid))
            assert reader.inventory.parent == os.path.relpath(prev, image)
            assert reader.parent_pages(target.pid), "unchanged pages are left to the parent"
    full_bytes = int(re.search(r'"bytes": (\d+)', full.stdout).group(1))
    assert full_bytes >= MIB << 20
    # only what changed: at most one page per write the program made between the two dumps
    # (its own log says how many), plus a little of its stack and libc data
    counts = [_count_in(image, target.pid, target.symbols["count"]) for image in images]
    for size, before, after in zip(sizes, counts, counts[1:]):
        assert size <= (after - before) * 4096 + (256 << 10), (sizes, counts, full_bytes)
    assert all(s < full_bytes // 4 for s in sizes), (sizes, full_bytes)
    # the tracking fd is the dumps', not the program's: in no image
    with ImageReader(images[-1]) as reader:
        assert all(f.fd < memtrack.TRACK_FD_FLOOR for f in reader.process(target.pid).fds)
        assert all("uw" not in v.vmflags.split() for v in reader.process(target.pid).vmas)
        assert len(reader.chain()) == 5
    at_dump = _count_in(images[-1], target.pid, target.symbols["count"])
    assert _restore_and_verify(ptckpt, target, images[-1]) >= at_dump > 0


def test_pre_dump_then_short_final_dump(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", MIB, 2)
    res = ptckpt("pre-dump", target.pid, "-D", tmp_path / "pre", "--json")
    assert res.returncode == 0, res.stderr
    time.sleep(0.2)
    res = ptckpt("pre-dump", target.pid, "-D", tmp_path / "pre2", "--prev", tmp_path / "pre")
    assert res.returncode == 0, res.stderr
    # a pre-dump holds memory only
    res = ptckpt("restore", "-D", tmp_path / "pre2", "--detach")
    assert res.returncode == ExitCode.USAGE and "pre-dump" in res.stderr and "Traceback" not in res.stderr
    _dump(ptckpt, target, tmp_path / "final", "--prev", tmp_path / "pre2", "--kill")
    target.wait_exit(10)
    with ImageReader(tmp_path / "final") as reader:
        final = reader.pages_length(target.pid)
    # only what was written since the last pre-dump: a page per write at most (the program's
    # own count says how many), plus a little of its stack and libc data
    count = target.symbols["count"]
    written = _count_in(tmp_path / "final", target.pid, count) - _count_in(tmp_path / "pre2", target.pid, count)
    assert final <= written * 4096 + (256 << 10) and final < (MIB << 20) // 4, (final, written)
    assert _restore_and_verify(ptckpt, target, tmp_path / "final") > 0


def test_a_missing_or_changed_parent_is_refused(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", 8, 2)
    _dump(ptckpt, target, tmp_path / "a", "--track-mem")
    _dump(ptckpt, target, tmp_path / "b", "--prev", tmp_path / "a")
    os.rename(tmp_path / "a", tmp_path / "a-moved")
    res = ptckpt("restore", "-D", tmp_path / "b", "--detach")
    assert res.returncode == ExitCode.CORRUPT_IMAGE, res.stderr
    assert "parent" in res.stderr and "no such directory" in res.stderr and len(res.stderr.splitlines()) == 1
    _dump(ptckpt, target, tmp_path / "a")                 # another image where the parent was
    res = ptckpt("restore", "-D", tmp_path / "b", "--detach")
    assert res.returncode == ExitCode.CORRUPT_IMAGE, res.stderr
    assert "another image than the one this image was dumped against" in res.stderr
    assert target.alive()


def test_untracked_process_is_written_in_full_with_a_warning(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", 8, 2)
    _dump(ptckpt, target, tmp_path / "plain")              # no --track-mem
    res = _dump(ptckpt, target, tmp_path / "next", "--prev", tmp_path / "plain")
    assert "warning" in res.stderr and "all its pages written" in res.stderr
    with ImageReader(tmp_path / "next") as reader:
        assert not reader.parent_pages(target.pid)
    # the image is still right, and the tracking it set up serves the next one
    res = _dump(ptckpt, target, tmp_path / "third", "--prev", tmp_path / "next")
    assert "warning" not in res.stderr
    assert _restore_and_verify(ptckpt, target, tmp_path / "third") > 0


def test_compact_folds_a_chain_in_place(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", 16, 2)
    _dump(ptckpt, target, tmp_path / "a", "--track-mem")
    time.sleep(0.1)
    _dump(ptckpt, target, tmp_path / "b", "--prev", tmp_path / "a")
    time.sleep(0.1)
    _dump(ptckpt, target, tmp_path / "c", "--prev", tmp_path / "b")
    res = ptckpt("compact", "-D", tmp_path / "b")            # b keeps its id: c still finds it
    assert res.returncode == 0, res.stderr
    shutil.rmtree(tmp_path / "a")
    with ImageReader(tmp_path / "c") as reader:
        assert reader.chain() == [str(tmp_path / "c"), str(tmp_path / "b")]
    res = ptckpt("compact", "-D", tmp_path / "c", "-o", tmp_path / "whole")
    assert res.returncode == 0, res.stderr
    with ImageReader(tmp_path / "whole") as reader:
        assert not reader.inventory.parent and reader.pages_length(target.pid) >= 16 << 20
    assert _restore_and_verify(ptckpt, target, tmp_path / "whole") > 0


def test_compressed_image_restores_and_shows_its_sizes(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", 32, 2)
    _dump(ptckpt, target, tmp_path / "z", "--compress", "zstd:1")
    res = ptckpt("show", tmp_path / "z", "--summary")
    m = re.search(r"page data of \d+: (\d+) bytes, stored in (\d+) \(zstd:1", res.stdout)
    assert m and int(m.group(2)) < int(m.group(1)) // 2, res.stdout
    assert _restore_and_verify(ptckpt, target, tmp_path / "z") > 0


def test_damaged_compressed_frame_is_refused(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", 8, 0)
    _dump(ptckpt, target, tmp_path / "z", "--compress", "zstd", "--kill")
    target.wait_exit(10)
    wait_pid_free(target.pid)
    pages = tmp_path / "z" / f"pages-{target.pid}.img"
    raw = bytearray(pages.read_bytes())
    raw[4096 + 200] ^= 0x55                                  # inside the first frame
    pages.write_bytes(bytes(raw))
    res = ptckpt("restore", "-D", tmp_path / "z", "--detach")
    assert res.returncode == ExitCode.CORRUPT_IMAGE and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    wait_until(lambda: not os.path.exists(f"/proc/{target.pid}"), 5, message="nothing left running")


def test_bad_compress_spec_is_a_usage_error(ptckpt, tmp_path):
    res = ptckpt("dump", os.getpid(), "-D", tmp_path / "x", "--compress", "lz4")
    assert res.returncode == ExitCode.USAGE and "unknown compression" in res.stderr


def test_run_keeps_a_chain_of_incremental_checkpoints(ptckpt, fixture_bins, tmp_path):
    out = tmp_path / "out"
    run_dir = tmp_path / "run"
    res = ptckpt("run", "-D", run_dir, "--interval", "0.3s", "--keep", "2", "--",
                 "timeout", "3", fixture_bins["scribbler"], out, 8, 2, timeout=60)
    assert res.returncode == 124, res.stderr                  # timeout(1) ended it
    kept = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("ckpt-"))
    assert len(kept) == 2, kept
    with ImageReader(run_dir / kept[-1]) as reader:
        assert reader.chain() == [str(run_dir / kept[-1]), str(run_dir / kept[0])]
    with ImageReader(run_dir / kept[0]) as reader:
        assert not reader.inventory.parent                    # folded: stands alone


# --- background dumps: the memory copied while the tree runs ------------------------

def _no_tracking_left(pid: int) -> None:
    fds = {int(n): os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")}
    assert "anon_inode:[userfaultfd]" not in fds.values(), fds
    with open(f"/proc/{pid}/smaps") as f:
        flags = [line for line in f if line.startswith("VmFlags:") and " uw" in line]
    assert not flags, "write-protection left registered"


def test_background_dump_is_one_instant_and_leaves_nothing(spawn, ptckpt, tmp_path):
    target = spawn("scribbler", 96, 64)                # rewrites every page about once a second
    res = _dump(ptckpt, target, tmp_path / "bg", "--background", "-v")
    assert "copy the memory of" in res.stderr
    # the first freeze makes the tracking only: the protection is set while it runs
    assert "to make the tracking" in res.stderr and "to write-protect" not in res.stderr
    # and the mappings read before the freeze were those of the freeze (copy_early's copy kept)
    assert "changed before the freeze" not in res.stderr
    _no_tracking_left(target.pid)
    with ImageReader(tmp_path / "bg") as reader:
        assert reader.pages_length(target.pid) >= 96 << 20
        assert not reader.inventory.parent
    assert _restore_and_verify(ptckpt, target, tmp_path / "bg") > 0


@pytest.mark.proc_differs("maps", reason="the program maps and unmaps all the time: the snapshot taken "
                                         "before the dump is of an earlier instant than the image")
def test_background_dump_of_a_map_that_changes_while_it_is_copied(spawn, ptckpt, tmp_path):
    """The protection is set, and the pages looked for, while the program runs: here it maps,
    unmaps and drops memory all the while (fixtures/churner.c); the image is still one
    instant, as the program checks after the restore."""
    target = spawn("churner", 64, 256, 256)              # 16 MiB that churn, 256 MiB of ballast
    target.signal(signal.SIGUSR1)
    before = int(target.wait_for_line(r"VERIFY 1 OK STEP (\d+)").group(1))
    # Its map changes between the reading before the freeze and the freeze, and the early
    # copy is made up for (increment.MemoryPlan._final_copy).  That takes the program to run
    # in that window: on a busy machine it may not, so up to five dumps (each leaves it running).
    for attempt in range(5):
        image = tmp_path / f"bg{attempt}"
        res = _dump(ptckpt, target, image, "--background", "-v")
        assert "copy the memory of" in res.stderr and "to make the tracking" in res.stderr
        _no_tracking_left(target.pid)
        if "changed before the freeze" in res.stderr:
            break
    assert "changed before the freeze" in res.stderr, res.stderr
    assert _restore_and_verify(ptckpt, target, image, r"VERIFY 2 OK STEP \d+") > before


@pytest.mark.parametrize("build", ["x86_64", pytest.param("-m32", marks=pytest.mark.proc_differs(
    "maps", reason="[vsyscall] shows in a restored 32-bit process (test_compat32)"))])
def test_background_then_incremental(spawn, ptckpt, tmp_path, request, build):
    """(A 32-bit program's too: soft-dirty and write-protect tracking know no ABI.)"""
    target = spawn("scribbler" if build == "x86_64" else str(request.getfixturevalue("fixture_bins32")["scribbler"]), 32, 2)
    _dump(ptckpt, target, tmp_path / "a", "--background", "--track-mem")
    time.sleep(0.2)
    res = _dump(ptckpt, target, tmp_path / "b", "--background", "--prev", tmp_path / "a")
    assert "warning" not in res.stderr, res.stderr
    with ImageReader(tmp_path / "b") as reader:
        assert reader.pages_length(target.pid) < (32 << 20) // 4 and reader.parent_pages(target.pid)
    assert _restore_and_verify(ptckpt, target, tmp_path / "b") > 0


def _dump_until_copying(ptckpt_cmd, target, image, log):
    proc = subprocess.Popen([*ptckpt_cmd, "-v", "dump", str(target.pid), "-D", str(image), "--background"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True)
    wait_until(lambda: "copy the memory of" in log.read_text() or proc.poll() is not None, 30,
               message="the background copy started")
    assert proc.poll() is None, log.read_text()
    return proc


def test_target_killed_during_background_dump(spawn, ptckpt_cmd, tmp_path):
    target = spawn("scribbler", 768, 1)
    log = tmp_path / "dump.log"
    proc = _dump_until_copying(ptckpt_cmd, target, tmp_path / "img", log)
    try:
        os.kill(target.pid, signal.SIGKILL)
        target.wait_exit(10)
        assert proc.wait(60) not in (0, None)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [line for line in log.read_text().splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in log.read_text(), log.read_text()
    assert not os.path.exists(tmp_path / "img")
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".img")]      # no temporary left


def test_dumper_killed_during_background_dump(spawn, ptckpt_cmd, tmp_path):
    target = spawn("scribbler", 768, 4)
    proc = _dump_until_copying(ptckpt_cmd, target, tmp_path / "img", tmp_path / "dump.log")
    proc.kill()
    proc.wait()
    # the program runs on, untraced, and the write-protection went with ptckpt's userfaultfd
    wait_until(lambda: procfs_tracer(target.pid) == 0, 5, message="untraced")
    _no_tracking_left(target.pid)
    target.signal(signal.SIGUSR1)
    target.wait_for_line(r"VERIFY 1 OK")
    target.assert_ok()


def procfs_tracer(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("TracerPid:")).split()[1])


def test_clip_runs_keeps_what_a_sweep_keeps():
    """memory.clip_runs (the background dump's index, cut in its freeze) against the
    obvious sweep, on random runs (touching or not) and spans."""
    import bisect
    import random

    from ptckpt.resources.memory import clip_runs, intersect_spans

    def sweep(runs, keep):
        starts = [s for s, _e, _o in runs]
        out = []
        for a, b in intersect_spans([(s, e) for s, e, _o in runs], keep):
            s, _e, off = runs[bisect.bisect_right(starts, a) - 1]
            out.append((a, b, off + a - s))
        return out

    rng = random.Random(34)
    for _ in range(5000):
        cuts = sorted(rng.sample(range(200), 2 * rng.randint(0, 30)))
        runs, at = [], None
        for s, e in zip(cuts[::2], cuts[1::2]):
            if at is not None and rng.random() < 0.3:
                s = at                                  # touching the run before
            runs.append((s, e, rng.randrange(1 << 20)))
            at = e
        spans = sorted(rng.sample(range(200), 2 * rng.randint(0, 20)))
        keep = list(zip(spans[::2], spans[1::2]))
        assert clip_runs(runs, keep) == sweep(runs, keep), (runs, keep)


def test_span_arithmetic_agrees_with_a_sweep():
    """memory.subtract_spans and _intersect (bisection and slices, for an increment's tens of
    thousands of written spans) against the one-by-one sweep they replace."""
    import random

    from ptckpt.resources import memory

    def sweep_minus(a, b):
        out, j = [], 0
        for s, e in a:
            while j < len(b) and b[j][1] <= s:
                j += 1
            k = j
            while k < len(b) and b[k][0] < e:
                if b[k][0] > s:
                    out.append((s, b[k][0]))
                s = max(s, b[k][1])
                k += 1
            if s < e:
                out.append((s, e))
        return out

    def sweep_within(s, e, marks):
        return [(max(s, a), min(e, b)) for a, b in marks if max(s, a) < min(e, b)]

    rng = random.Random(36)

    def spans(n):
        cuts, out = sorted(rng.sample(range(300), 2 * n)), []
        for x, y in zip(cuts[::2], cuts[1::2]):
            out.append((out[-1][1] if out and rng.random() < 0.3 else x, y))     # some touching
        return out

    for _ in range(5000):
        a, b = spans(rng.randint(0, 10)), spans(rng.randint(0, 40))
        assert memory.subtract_spans(a, b) == sweep_minus(a, b), (a, b)
        s = rng.randrange(300)
        e = rng.randrange(s, 301)
        assert memory._intersect(s, e, b) == sweep_within(s, e, b), (s, e, b)
