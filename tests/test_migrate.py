"""ptckpt page-server, push and migrate: a page server in a network namespace of its own
(unshare -n), reached through a unix socket, with a token; processes moved there go on
where they were, and every failure before the other side runs leaves them running here."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from conftest import require, kill_pids, kill_process_groups, pid_alive, reap_orphans, wait_until
from ptckpt.errors import ExitCode
from test_campaign import VENDOR
from test_emulator import start_emulator, start_testbench, testbench_bin  # noqa: F401


@pytest.fixture
def page_server(ptckpt_cmd, tmp_path):
    """start(env=None) -> (address, token file, directory): `ptckpt page-server` in a new
    network namespace, listening on a unix socket; killed (with what it restored) at the end."""
    require("unshare")
    started: list[subprocess.Popen] = []
    token = tmp_path / "token"
    token.write_text(os.urandom(24).hex() + "\n")
    token.chmod(0o600)

    def start(env: dict | None = None, extra_env: dict | None = None) -> tuple[str, Path, Path]:
        n = len(started)
        sock, directory = tmp_path / f"ps{n}.sock", tmp_path / f"received{n}"
        with open(tmp_path / f"page-server{n}.log", "wb") as log:
            p = subprocess.Popen(["unshare", "-n", *ptckpt_cmd, "page-server", "--listen", f"unix:{sock}",
                                  "-D", directory, "--token-file", token], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=log, start_new_session=True,
                                 env={**(env or os.environ), **(extra_env or {})})
        started.append(p)
        wait_until(sock.exists, 20, message="the page server listens")
        return f"unix:{sock}", token, directory

    yield start
    kill_process_groups(started)
    reap_orphans()


def _netns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def test_counter_migrates_into_another_network_namespace_and_counts_on(spawn, ptckpt, page_server):
    """Pre-dump rounds while it runs, a short final dump, the restore there (--pidns: its
    pid is still taken here until the end); it is killed here only once it runs there,
    and goes on counting from its value, in the page server's network namespace."""
    address, token, received = page_server()
    target = spawn("counter")
    target.wait_progress()
    res = ptckpt("migrate", target.pid, "--to", address, "--token-file", token, "--restore-opt=--pidns", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    moved = out["remote_pid"]
    try:
        assert out["rounds"] == 2 and out["round_bytes"][0] > 0
        assert 0 < out["downtime"] < out["seconds"]
        assert out["remote"]["vpid"] == target.pid              # its own pid, in a pid namespace there
        target.wait_exit(10)                                      # killed here
        assert pid_alive(moved)
        assert _netns(moved) != _netns(os.getpid())
        at = target.read_counter()
        wait_until(lambda: target.read_counter() > at + 20, 10, message="the counter goes on there")
        target.adopt(moved)
        target.assert_ok()
        assert any(received.iterdir()), "the image is in the page server's directory"
        for path in received.rglob("*"):
            assert path.stat().st_mode & 0o077 == 0, path      # 0700 / 0600
    finally:
        kill_pids([moved, out["remote"].get("init_pid", 0)])
        reap_orphans()


def test_migration_that_fails_there_leaves_the_process_running_here(spawn, ptckpt, page_server):
    """The restore there fails (no --pidns on this host: the pid is still taken) and then the
    connection breaks mid-transfer (the server dies receiving a file): each time the
    process resumes here, where it was, and one line says why (exit 24)."""
    address, token, _ = page_server()
    target = spawn("counter")
    target.wait_progress()
    res = ptckpt("migrate", target.pid, "--to", address, "--token-file", token, "--rounds", "1")
    assert res.returncode == ExitCode.TRANSFER, res.stderr
    assert "the restore there failed" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    at = target.read_counter()
    wait_until(lambda: target.read_counter() > at + 20, 10, message="it runs on here")
    address2, token2, _ = page_server(extra_env={"PTCKPT_TEST_DIE_AT": "page-server-file:3"})
    res = ptckpt("migrate", target.pid, "--to", address2, "--token-file", token2, "--rounds", "1")
    assert res.returncode == ExitCode.TRANSFER, res.stderr
    assert "connection" in res.stderr and "Traceback" not in res.stderr, res.stderr
    at = target.read_counter()
    wait_until(lambda: target.read_counter() > at + 20, 10, message="it runs on here again")
    target.assert_ok()


def test_wrong_token_and_no_server_are_refused_before_anything_is_touched(spawn, ptckpt, page_server, tmp_path,
                                                                          killed_counter):
    address, _token, _ = page_server()
    wrong = tmp_path / "wrong"
    wrong.write_text("x" * 32)
    target = spawn("counter")
    target.wait_progress()
    for to, words in ((address, "refused the token"), (f"unix:{tmp_path / 'nobody.sock'}", "no page server at")):
        res = ptckpt("migrate", target.pid, "--to", to, "--token-file", wrong)
        assert res.returncode == ExitCode.TRANSFER and words in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert target.alive()
    fds = os.listdir(f"/proc/{target.pid}/fd")
    assert all(int(fd) < 900 for fd in fds), "not even tracked: nothing was done to it"
    _t, image = killed_counter
    res = ptckpt("push", "-D", image, "--to", address, "--token-file", wrong)
    assert res.returncode == ExitCode.TRANSFER and "refused the token" in res.stderr, res.stderr
    short = tmp_path / "short"
    short.write_text("short")
    res = ptckpt("push", "-D", image, "--to", address, "--token-file", short)
    assert res.returncode == ExitCode.USAGE and "16 bytes" in res.stderr, res.stderr


def test_push_sends_an_image_with_its_parents(spawn, ptckpt, page_server, tmp_path):
    address, token, received = page_server()
    target = spawn("scribbler", 8, 1)
    try:
        assert ptckpt("dump", target.pid, "-D", tmp_path / "a", "--track-mem").returncode == 0
        assert ptckpt("dump", target.pid, "-D", tmp_path / "b", "--prev", tmp_path / "a").returncode == 0
    finally:
        kill_pids([target.pid])
    res = ptckpt("push", "-D", tmp_path / "b", "--to", address, "--token-file", token)
    assert res.returncode == 0, res.stderr
    where = received / res.stdout.strip()
    assert where.name == "b" and (where.parent / "a" / "inventory.img").exists()
    for name in os.listdir(tmp_path / "b"):
        assert (where / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    res = ptckpt("show", where, "--summary")
    assert res.returncode == 0 and "parent" in res.stdout, res.stdout + res.stderr


def test_emulator_testbench_migrates_and_ends_with_the_reference_signature(spawn, ptckpt, page_server,
                                                                           testbench_bin, tmp_path):
    """The testbench and a reference run of the same configuration on one emulator (a unix
    socket both namespaces reach); the testbench is moved mid-run (the vendor plugin drops
    and re-makes its emulator link) and ends with the reference's signature, no cycle lost."""
    config = "width 32\ninit_steps 10\ninit_sleep_us 1000\nvectors 1500\nvector_sleep_us 1500\n"
    emulator = start_emulator(spawn, "unix", tmp_path / "emu.sock", options=("--per-connection",))
    env = dict(os.environ, EMULATOR_ADDRESS=emulator.address)
    address, token, _ = page_server(env=env)
    ref = start_testbench(spawn, testbench_bin, tmp_path, emulator.address, config, name="ref")
    bench = start_testbench(spawn, testbench_bin, tmp_path, emulator.address, config, name="moved")
    bench.wait_for_line("REGION 1", timeout=10)
    moved = 0
    try:
        for _ in range(20):               # the vendor plugin refuses a freeze mid-transaction
            res = ptckpt("migrate", bench.pid, "--to", address, "--token-file", token, "--rounds", "1",
                         "--plugin", VENDOR, "--restore-opt=--pidns", f"--restore-opt=--plugin={VENDOR}",
                         "--restore-opt=--file-policy=warn", "--json", env=env)
            if res.returncode == 0 or "dump again" not in res.stderr:
                break
        assert res.returncode == 0, res.stderr
        moved = json.loads(res.stdout)["remote_pid"]
        bench.wait_exit(10)
        wait_until(lambda: not pid_alive(moved), 30, message="the moved testbench ends")
        ref.wait_exit(30)
        sig = {}
        for tb in (ref, bench):
            lines = tb.stdout_lines()
            sig[tb] = next(line.split()[1] for line in lines if line.startswith("SIGNATURE "))
            log = (tb.slot / "run.log").read_text()
            assert "jump" not in log and "done eintr_retries" in log, log[-300:]
        assert sig[bench] == sig[ref]
        assert re.fullmatch(r"[0-9a-f]{16}", sig[ref])
    finally:
        kill_pids([moved] if moved else [])
        reap_orphans()
