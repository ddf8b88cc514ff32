"""Concurrency (issue 19): many dumps of different processes at once, and many --pidns
restores of one image at once, each copy with the image's pids in a namespace of its own."""

from __future__ import annotations

import concurrent.futures
import re
import struct

from conftest import kill_pids, reap_orphans, wait_until

COPIES = 6


def _counter_of(pid: int, address: int) -> int:
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(address)
        return struct.unpack("<Q", f.read(8))[0]


def test_many_pidns_restores_of_one_image_at_once(killed_counter, ptckpt, tmp_path):
    target, image = killed_counter
    address = target.symbols["counter"]
    with concurrent.futures.ThreadPoolExecutor(COPIES) as pool:
        results = list(pool.map(lambda _: ptckpt("restore", "-D", image, "--pidns", "--detach",
                                                 "--file-policy", "ignore"), range(COPIES)))
    copies = []
    try:
        for res in results:
            m = re.search(r"\(init (\d+)\) as (\d+)", res.stderr)
            assert res.returncode == 0 and m, res
            copies.append((int(m.group(1)), int(m.group(2))))
        assert len({outer for _init, outer in copies}) == COPIES
        for _init, outer in copies:
            with open(f"/proc/{outer}/status") as f:
                assert re.search(rf"\nNSpid:\t{outer}\t{target.pid}\n", f.read())
            first = _counter_of(outer, address)
            wait_until(lambda: _counter_of(outer, address) > first)    # each copy counts on
    finally:
        kill_pids([init for init, _outer in copies])
        reap_orphans()


def test_many_processes_dumped_at_once(spawn, ptckpt, tmp_path):
    targets = [spawn("counter") for _ in range(COPIES)]
    with concurrent.futures.ThreadPoolExecutor(COPIES) as pool:
        results = list(pool.map(lambda t: ptckpt("dump", t.pid, "-D", tmp_path / f"img-{t.pid}", "--leave-running"),
                                targets))
    for target, res in zip(targets, results):
        assert res.returncode == 0, res
        target.wait_progress()
        res = ptckpt("show", tmp_path / f"img-{target.pid}")
        assert res.returncode == 0, res
    for target in targets:
        target.assert_ok()


def test_two_dumps_of_one_pid_at_once_one_is_refused_and_the_target_runs_on(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda n: ptckpt("dump", target.pid, "-D", tmp_path / f"img{n}", "--leave-running"),
                                range(2)))
    codes = sorted(r.returncode for r in results)
    assert codes[0] == 0, results
    if codes[1] != 0:                              # they met: the second sees the first's trace
        refused = next(r for r in results if r.returncode)
        assert refused.returncode == 5 and refused.stderr.count("\n") == 1, refused
        assert "already traced" in refused.stderr
    target.wait_progress()
    target.assert_ok()
