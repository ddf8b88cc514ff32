"""Campaigns on Dask (ptckpt campaign --backend dask://HOST:PORT): a real `dask scheduler`
and two `dask worker` processes on loopback, each worker with an image cache of its own,
started here and killed by pid.  The same seeds give the same outcome table as the local
backend, even when a worker is killed mid-campaign; each worker fetched the image once."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import kill_pids, kill_process_groups, reap_orphans, wait_until
from test_campaign import VENDOR, _leftovers, checkpoint_testbench
from test_clones import _running, campaigner_image  # noqa: F401
from test_emulator import start_emulator, testbench_bin  # noqa: F401

# 2000 vectors of 1.5 ms after the region of interest, checkpointed at vector 1300: each run
# has about 1 s of test vectors left (a dump must freeze it before it ends, on a slow CI too).
CONFIG = "width 32\ninit_steps 10\ninit_sleep_us 1000\nvectors 2000\nvector_sleep_us 1500\n"
DASK = str(Path(sys.executable).parent / "dask")
RUNS = 24                  # per campaign; a worker is killed once half of them are done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _table(out: Path) -> list[tuple]:
    """results.csv without what may differ between backends (timings, hosts)."""
    with open(out / "results.csv", newline="") as f:
        return [tuple(v for k, v in row.items() if k not in ("seconds", "host")) for row in csv.DictReader(f)]


@pytest.fixture
def short_testbench(spawn, ptckpt, testbench_bin, tmp_path):
    emulator = start_emulator(spawn, options=("--per-connection",))
    image = checkpoint_testbench(spawn, ptckpt, testbench_bin, tmp_path, emulator.address, CONFIG, at_vector=1300)
    yield image, dict(os.environ, EMULATOR_ADDRESS=emulator.address)
    kill_pids(_leftovers(str(testbench_bin)))
    reap_orphans()


@pytest.fixture
def dask_cluster(short_testbench, tmp_path):
    """(address, [worker Popen], [cache dir]): a scheduler and two single-thread workers."""
    _image, env = short_testbench
    yield from _cluster(tmp_path, env)


def _cluster(tmp_path: Path, env: dict):
    port = _free_port()
    procs: list[subprocess.Popen] = []
    logs = tmp_path / "dask-logs"
    logs.mkdir()

    def start(name: str, argv: list[str], extra_env: dict | None = None) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as log:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 env={**env, **(extra_env or {})}, start_new_session=True)
        procs.append(p)
        return p

    try:
        start("scheduler", [DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"])
        address = f"127.0.0.1:{port}"
        caches, workers = [], []
        for i in (1, 2):
            cache = tmp_path / f"cache{i}"
            caches.append(cache)
            workers.append(start(f"worker{i}", [DASK, "worker", f"tcp://{address}", "--nthreads", "1",
                                                "--no-nanny", "--host", "127.0.0.1", "--no-dashboard",
                                                "--name", f"w{i}"],
                                 {"PTCKPT_IMAGE_CACHE": str(cache)}))
        from distributed import Client
        with Client(f"tcp://{address}", timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
        yield address, workers, caches
    finally:
        kill_process_groups(procs)
        reap_orphans()


def _args(image, out, backend: str = "local") -> list[str]:
    return ["campaign", "-D", str(image), "--plugin", VENDOR, "--file-policy", "warn", "-o", str(out),
            "--inject", "flip:symbol=design_state,bits=1", "--timeout", "30s", "--runs", str(RUNS),
            "--seed", "300", "--jobs", "2", "--backend", backend]


def test_dask_campaign_matches_local_and_survives_a_lost_worker(ptckpt, ptckpt_cmd, short_testbench,
                                                                 dask_cluster, testbench_bin, tmp_path):
    image, env = short_testbench
    address, workers, caches = dask_cluster
    out = tmp_path / "dask"
    # the local campaign runs at the same time as the Dask one (the runs mostly wait on the
    # emulator), so that the comparison costs one campaign's time
    with open(tmp_path / "dask.stdout", "wb") as so, open(tmp_path / "dask.stderr", "wb") as se, \
            open(tmp_path / "local.stdout", "wb") as lo, open(tmp_path / "local.stderr", "wb") as le:
        campaign = subprocess.Popen(ptckpt_cmd + _args(image, out, f"dask://{address}"), stdout=so, stderr=se,
                                    env=env, start_new_session=True)
        local = subprocess.Popen(ptckpt_cmd + _args(image, tmp_path / "local"), stdout=lo, stderr=le,
                                 env=env, start_new_session=True)
    try:
        # a worker lost mid-campaign: its run goes to the other, and counts once
        wait_until(lambda: len(list((out / "runs").glob("0*"))) >= RUNS // 2 if (out / "runs").exists() else False,
                   120, message="half the runs done on Dask")
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait()
        assert campaign.wait(300) == 0, (tmp_path / "dask.stderr").read_text()
        assert local.wait(300) == 0, (tmp_path / "local.stderr").read_text()
    finally:
        for p in (campaign, local):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    local_stdout = (tmp_path / "local.stdout").read_text()
    assert _table(out) == _table(tmp_path / "local")
    assert len(_table(out)) == RUNS + 1                            # the reference and the runs, once each
    local_summary = local_stdout.strip().splitlines()[-1].split(";")[0]
    assert local_summary in (tmp_path / "dask.stdout").read_text()
    data = json.loads((out / "results.json").read_text())
    assert {r["host"] for r in data["runs"]} == {socket.gethostname()}
    # each worker that ran something fetched the image once, into its own cache, checked
    for cache in caches:
        held = [p for p in cache.iterdir() if p.is_dir()] if cache.exists() else []
        assert len(held) <= 1, held
        for d in held:
            assert (d / ".complete").exists() and (d / "inventory.img").exists()
            assert (d / "inventory.img").read_bytes() == (image / "inventory.img").read_bytes()
    assert any(c.exists() and any(c.iterdir()) for c in caches)
    time.sleep(0.5)
    assert _leftovers(str(testbench_bin)) == [], "nothing is left running on any worker"
    # ^C in the middle of a campaign: the runs going on are killed on their worker
    with open(tmp_path / "int.stderr", "wb") as se:
        campaign = subprocess.Popen(ptckpt_cmd + _args(image, tmp_path / "int", f"dask://{address}"),
                                    stdout=subprocess.DEVNULL, stderr=se, env=env, start_new_session=True)
    try:
        wait_until(lambda: _leftovers(str(testbench_bin)), 60, message="a run going on")
        campaign.send_signal(signal.SIGINT)
        assert campaign.wait(60) != 0
    finally:
        if campaign.poll() is None:
            os.killpg(campaign.pid, signal.SIGKILL)
            campaign.wait()
    assert "Traceback" not in (tmp_path / "int.stderr").read_text()
    wait_until(lambda: not _leftovers(str(testbench_bin)), 10, message="no run left after ^C")


def test_dask_backend_refusals(ptckpt, tmp_path, killed_counter):
    """A scheduler that is not there, and an incremental image, are one line each."""
    _target, image = killed_counter
    res = ptckpt("campaign", "-D", image, "-o", tmp_path / "out", "--inject", "flip:symbol=counter,bits=1",
                 "--runs", "1", "--backend", f"dask://127.0.0.1:{_free_port()}", timeout=120)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "no Dask scheduler at" in res.stderr, res.stderr
    res = ptckpt("campaign", "-D", image, "-o", tmp_path / "out", "--inject", "flip:symbol=counter,bits=1",
                 "--runs", "1", "--backend", "carrier-pigeon")
    assert res.returncode != 0 and "local or dask://HOST:PORT" in res.stderr, res.stderr


def test_dask_campaign_runs_copies_of_a_template_on_each_worker(ptckpt, campaigner_image, fixture_bins, tmp_path):
    """With the Dask backend each worker holds one template of the campaign's image (started
    by its first run, ended with the campaign) and its runs are copies of it: the same table
    as the local copies, nothing left running afterwards."""
    image, _pid = campaigner_image()
    cluster = _cluster(tmp_path, dict(os.environ))
    address, _workers, _caches = next(cluster)
    try:
        args = ["campaign", "-D", image, "--runs", "10", "--jobs", "2", "--seed", "70", "--timeout", "30s", "--json",
                "--inject", "set:symbol=stop,value=1", "--inject", "flip:symbol=table,bits=1"]
        dask = ptckpt(*args, "-o", tmp_path / "dask", "--backend", f"dask://{address}")
        assert dask.returncode == 0, dask.stderr
        local = ptckpt(*args, "-o", tmp_path / "local")
        assert local.returncode == 0, local.stderr
        assert json.loads(dask.stdout)["runs_as"] == "copies of a template"
        assert _table(tmp_path / "dask") == _table(tmp_path / "local")
        exe = str(fixture_bins["campaigner"])
        wait_until(lambda: not _running(exe), 10, message=lambda: f"left on the workers: {_running(exe)}")
    finally:
        cluster.close()
