"""Resources running out (issue 19): a dump or restore that runs out of open files or
processes or memory stops with one line naming what ran out and the way out (exit 23);
the target runs on, nothing half-made is left, and the next try with room works."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import descendants, limited_cgroup, wait_pid_free


def _limited(ptckpt, nofile: int, *args):
    """ptckpt with RLIMIT_NOFILE nofile/nofile (util-linux prlimit), or None when the
    interpreter itself cannot start under it (not ptckpt's to report)."""
    res = ptckpt(*args, prefix=["prlimit", f"--nofile={nofile}:{nofile}", "--"], timeout=60)
    if "Fatal Python error" in res.stderr:
        return None
    return res


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def test_a_dump_out_of_open_files_says_so_and_the_target_runs_on(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    outcomes = {}
    for n in range(5, 17):
        image = tmp_path / f"img{n}"
        res = _limited(ptckpt, n, "dump", target.pid, "-D", image, "--leave-running")
        if res is None:
            continue
        outcomes[n] = res.returncode
        assert res.returncode in (0, 23), (n, res)
        if res.returncode == 23:
            assert res.stderr.count("\n") == 1 and "ulimit -n" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr
            assert not image.exists()
        before = target.read_counter()
        target.wait_progress()                     # not stopped, not traced, counting on
        assert target.read_counter() > before
        with open(f"/proc/{target.pid}/status") as f:
            assert "\nTracerPid:\t0\n" in f.read()
    assert _leftovers(tmp_path) == []
    assert 23 in outcomes.values() and 0 in outcomes.values(), outcomes
    target.assert_ok()


@pytest.mark.proc_differs("limits", reason="the restored process keeps the small RLIMIT_NOFILE it was made "
                                           "under when raising a hard limit needs CAP_SYS_RESOURCE (warned)")
def test_a_restore_out_of_open_files_says_so_and_leaves_nothing(killed_counter, ptckpt, tmp_path):
    target, image = killed_counter
    alive_before = descendants()
    outcomes = {}
    for n in range(5, 17):
        res = _limited(ptckpt, n, "restore", "-D", image, "--detach")
        if res is None:
            continue
        outcomes[n] = res.returncode
        assert res.returncode in (0, 23), (n, res)
        if res.returncode == 23:
            assert res.stderr.count("\n") == 1 and "ulimit -n" in res.stderr, res.stderr
            assert not os.path.exists(f"/proc/{target.pid}")
            assert descendants() <= alive_before
        else:                                      # with room, the restore works
            target.adopt(target.pid)
            target.wait_progress()
            target.assert_ok()
            break
    assert 23 in outcomes.values() and 0 in outcomes.values(), outcomes


@pytest.mark.parametrize("program, args, controller, setting, value, words", [
    ("forkserver", (), "pids", "pids.max", "2", "no more processes may be made"),
    ("bigheap", (256,), "memory", "memory.max", str(160 << 20), "out of memory"),
])
def test_a_restore_out_of_processes_or_memory_says_so_and_leaves_nothing(spawn, ptckpt, tmp_path, program, args,
                                                                        controller, setting, value, words):
    """A tree of four in a pids cgroup that allows two; 256 MiB of heap in a memory cgroup of
    160 MiB (the OOM killer ends the half-built process, made the one it picks, not ptckpt:
    the process reads its pages itself, so the faults that hit the limit are its own)."""
    target = spawn(program, *args, timeout=60)
    members = [target.pid] + [int(line.split()[2]) for line in target.preamble if line.startswith("WORKER ")]
    image = tmp_path / "img"
    ptckpt("dump", target.pid, "-D", image, "--kill", check=True)
    target.wait_exit(10)
    for pid in members:
        wait_pid_free(pid)
    alive_before = descendants()
    with limited_cgroup(controller, setting, value) as inside:
        res = ptckpt("restore", "-D", image, "--detach", prefix=inside)
    assert descendants() <= alive_before
    assert not any(os.path.exists(f"/proc/{pid}") for pid in members)
    assert res.returncode == 23 and res.stderr.count("\n") == 1, res
    assert words in res.stderr and "try again" in res.stderr, res.stderr
    res = ptckpt("restore", "-D", image, "--detach")          # with room, it works
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    target.wait_progress() if program == "forkserver" else target.signal()
    target.assert_ok()
