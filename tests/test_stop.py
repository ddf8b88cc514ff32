"""`ptckpt stop PID|PIDFILE` ends a detached restored tree: SIGTERM first, SIGKILL after
--timeout, and the init of a --pidns tree's namespace too (it ignores SIGTERM)."""

from __future__ import annotations

from ptckpt.errors import ExitCode

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
        assert res.stdout.strip() == (f"stopped {outer}: ended on SIGTERM; its pid namespace ended with its "
                                      f"init {init}")
        reap_orphans()
        wait_until(lambda: _gone(outer) and _gone(init), 5, message="the tree and its init gone")
    finally:
        kill_pids([init, outer])
        reap_orphans()


def test_stop_kills_what_does_not_end_on_sigterm(spawn, ptckpt, tmp_path):
    target = spawn(str(idle_script(tmp_path, "stubborn.py", "import os, signal, time\n"
                                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n")), out=False)
    res = ptckpt("stop", target.pid, "--timeout", "300ms")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"stopped {target.pid}: killed (SIGTERM was not enough)"
    target.wait_exit(5)


def test_stop_of_nothing_is_one_line(ptckpt, tmp_path):
    _one_line(ptckpt("stop", "4194305"), ExitCode.NO_SUCH_PROCESS, "4194305")
    (tmp_path / "junk").write_text("not a pid\n")
    _one_line(ptckpt("stop", tmp_path / "junk"), ExitCode.USAGE, "not a pid")
