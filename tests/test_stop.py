"""`ptckpt stop PID|PIDFILE` ends a detached restored tree: SIGTERM first, SIGKILL after
--timeout, and the init of a --pidns tree's namespace too (it ignores SIGTERM).  Only a
tree ptckpt restored (the restore's record, ptckpt.restored): anything else is refused
unless --force."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat

import pytest

from ptckpt import api, procfs, restored
from ptckpt.errors import ExitCode, NotRestored

from conftest import idle_script, kill_pids, proc_stat, reap_orphans, wait_until
from test_restore import _one_line


def _gone(pid: int) -> bool:
    st = proc_stat(pid)
    return st is None or st.state in ("Z", "X")


def test_stop_ends_a_detached_pidns_tree_by_its_pidfile(killed_counter, ptckpt, tmp_path):
    target, image = killed_counter
    pidfile = tmp_path / "pid"
    res = ptckpt("restore", "-D", image, "--pidns", "--detach", "--pidfile", pidfile, "--file-policy", "warn")
    assert res.returncode == 0, res.stderr
    outer = int(pidfile.read_text())
    init = proc_stat(outer).ppid
    try:
        res = ptckpt("stop", pidfile)
        assert res.returncode == 0, res.stderr
        assert res.stdout == ""                                 # said on stderr, as restore's line
        assert res.stderr.strip() == (f"stopped {outer}: ended on SIGTERM; its pid namespace ended with its "
                                      f"init {init}")
        reap_orphans()
        wait_until(lambda: _gone(outer) and _gone(init), 5, message="the tree and its init gone")
    finally:
        kill_pids([init, outer])
        reap_orphans()


def test_stop_kills_what_does_not_end_on_sigterm(spawn, ptckpt, tmp_path):
    target = spawn(str(idle_script(tmp_path, "stubborn.py", "import os, signal, time\n"
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n")), out=False)
    res = ptckpt("stop", target.pid, "--timeout", "300ms", "--force")    # not restored: --force
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr.strip() == f"stopped {target.pid}: killed (SIGTERM was not enough)"
    target.wait_exit(5)


def test_stop_of_nothing_is_one_line(ptckpt, tmp_path):
    _one_line(ptckpt("stop", "4194305"), ExitCode.NO_SUCH_PROCESS, "4194305")
    (tmp_path / "junk").write_text("not a pid\n")
    _one_line(ptckpt("stop", tmp_path / "junk"), ExitCode.USAGE, "not a pid")


@pytest.fixture
def sleeper(spawn):
    """A process ptckpt did not restore (the user's own); killed at teardown (spawn), its
    record too if a test made one."""
    target = spawn(shutil.which("sleep"), 300, out=False, ready=False)
    yield target
    restored.forget(target.pid)


def test_stop_refuses_a_process_ptckpt_did_not_restore(sleeper, ptckpt):
    res = ptckpt("stop", sleeper.pid)
    _one_line(res, ExitCode.NOT_RESTORED, str(sleeper.pid), "not a tree ptckpt restored", "--force", "kill")
    assert res.stdout == ""
    assert sleeper.alive()
    with pytest.raises(NotRestored) as err:                     # the API says the same
        api.stop(sleeper.pid, timeout=0.1)
    assert err.value.exit_code == ExitCode.NOT_RESTORED
    assert sleeper.alive()


def test_stop_refuses_a_stale_record_and_removes_it(sleeper, ptckpt, tmp_path):
    """A record whose start time is not the live process's (the pid was reused since the
    restore) is no reason to end it: refused, and the stale record goes."""
    assert restored.record(sleeper.pid, str(tmp_path)) is None
    path = os.path.join(restored.record_dir(), str(sleeper.pid))
    with open(path) as f:
        rec = json.load(f)
    rec["start_time"] -= 1                                      # an earlier process with that pid
    with open(path, "w") as f:
        json.dump(rec, f)
    _one_line(ptckpt("stop", sleeper.pid), ExitCode.NOT_RESTORED, str(sleeper.pid), "--force")
    assert sleeper.alive()
    assert not os.path.exists(path)


def test_stop_force_ends_a_process_ptckpt_did_not_restore(sleeper, ptckpt):
    res = ptckpt("stop", sleeper.pid, "--force")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr.strip() == f"stopped {sleeper.pid}: ended on SIGTERM"
    sleeper.wait_exit(5)


def test_stop_ends_a_tree_restored_through_the_api(killed_counter, ptckpt):
    _target, image = killed_counter
    proc = api.restore(image, file_policy=["warn"])
    try:
        path = os.path.join(restored.record_dir(), str(proc.pid))
        mode = os.stat(path).st_mode
        assert stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(os.stat(restored.record_dir()).st_mode) == 0o700
        with open(path) as f:
            assert json.load(f) == {"pid": proc.pid, "start_time": procfs.read_stat(proc.pid).start_time,
                                    "image": str(image)}
        res = ptckpt("stop", proc.pid)
        assert res.returncode == 0, res.stderr
        assert res.stdout == "" and res.stderr.strip() == f"stopped {proc.pid}: ended on SIGTERM"
        assert proc.wait(timeout=5) is not None
        assert not os.path.exists(path)                          # the tree ended: its record went
    finally:
        proc.kill()


def test_stop_ends_a_lazily_restored_tree(killed_counter, ptckpt):
    _target, image = killed_counter
    res = ptckpt("restore", "-D", image, "--detach", "--lazy", "--json", "--file-policy", "warn")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    started = [out["pid"]] + ([out["lazy"]["server"], out["lazy"]["watchdog"]] if out["lazy"] else [])
    try:
        res = ptckpt("stop", out["pid"])
        assert res.returncode == 0, res.stderr
        reap_orphans()
        wait_until(lambda: _gone(out["pid"]), 5, message="the restored tree gone")
    finally:
        kill_pids(started)
        reap_orphans()
        if out["lazy"]:
            with contextlib.suppress(OSError):
                os.unlink(out["lazy"]["log"])
