"""The seed scenario end to end: a testbench driving an emulator that runs outside the
checkpoint is dumped at its region of interest, and restarted in another run slot, against a
fresh emulator at another address, with another DISPLAY; it finishes with the signature of an
uninterrupted run."""

from __future__ import annotations

import os
import shutil

import pytest

from conftest import kill_pids, reap_orphans
from test_emulator import finish, start_emulator, start_testbench, testbench_bin  # noqa: F401

VENDOR = "emulator-link"        # examples/emulator-link, installed: found by its entry point
# 600 vectors of 5 ms: the bench still runs while the dump is retried (the vendor plugin
# refuses a freeze mid-transaction), on a loaded machine too (200 were not always enough)
CONFIG = "init_steps 40\ninit_sleep_us 2000\nvectors 600\nvector_sleep_us 5000\n"


@pytest.mark.parametrize("net", [(), ("--tcp-established",)], ids=["plain", "tcp-established"])
def test_testbench_restarts_in_another_slot_against_a_fresh_emulator(spawn, ptckpt, testbench_bin,
                                                                      tmp_path, net):
    """(With --tcp-established the dump locks the tree's TCP connections as it freezes: the
    vendor plugin claims its link in pre_dump, and talks over it in frozen.)"""
    (tmp_path / "ref").mkdir()
    reference = finish(start_testbench(spawn, testbench_bin, tmp_path / "ref", start_emulator(spawn).address,
                                       CONFIG, name="slot3", display=":3"))
    runs = tmp_path / "runs"
    runs.mkdir()
    first = start_emulator(spawn)
    bench = start_testbench(spawn, testbench_bin, runs, first.address, CONFIG, name="slot3", display=":3")
    try:
        bench.wait_for_line("REGION 1", timeout=10)
        for attempt in range(3):           # the vendor plugin refuses a freeze mid-transaction
            res = ptckpt("dump", bench.pid, "-D", tmp_path / f"img{attempt}", "--kill",
                         "--plugin", VENDOR, *net)
            if res.returncode == 0:
                break
            assert "dump again" in res.stderr, res.stderr
        assert res.returncode == 0, res.stderr
        image = tmp_path / f"img{attempt}"
        bench.wait_exit(10)
        first.target.kill()
        second = start_emulator(spawn, "unix", tmp_path / "emulator7.sock")
        shutil.copytree(runs / "slot3", runs / "slot7")         # the new run slot
        env = dict(os.environ, EMULATOR_ADDRESS=second.address)
        res = ptckpt("restore", "-D", image, "--detach", "--plugin", VENDOR,
                     "--remap-path", f"{runs}/slot3={runs}/slot7", "--set-env", "DISPLAY=:7", env=env)
        assert res.returncode == 0, res.stderr
        report = finish(bench, timeout=20)
        assert report["SIGNATURE"] == reference["SIGNATURE"], "the signature of an uninterrupted run"
        assert report["DISPLAY"] == ":7"
        assert report["SLOT"] == str(runs / "slot7" / "run.log")
        assert "cycle jump" not in (runs / "slot7" / "run.log").read_text()
    finally:
        kill_pids([bench.pid])
        reap_orphans()
