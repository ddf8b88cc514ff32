"""The Python API (ptckpt.api; ptckpt.dump and ptckpt.restore are callable): a program of
the user's own dumps a process it started and restores it, then waits for it, the way
README's example does.  The program runs in its own interpreter, as a user's would."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import kill_pids, reap_orphans
from ptckpt.errors import ExitCode, NoSuchProcess, PtckptError

PROGRAM = textwrap.dedent(r"""
    import os, signal, subprocess, sys, time
    import ptckpt

    counter, out, image = sys.argv[1:4]

    def value():
        try:
            with open(out) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def wait_for(cond, what):
        deadline = time.monotonic() + 10
        while not cond():
            if time.monotonic() > deadline:
                sys.exit(f"timed out: {what}")
            time.sleep(0.01)

    target = subprocess.Popen([counter, out], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    print("PID", target.pid, flush=True)
    wait_for(lambda: value() > 0, "the counter counts")
    bystander = os.fork()                    # a child of ours the library must leave alone
    if bystander == 0:
        time.sleep(0.3)
        os._exit(7)
    result = ptckpt.dump(target.pid, image, leave_running=False)
    print("DUMPED", result.pids == [target.pid], result.pages > 0, result.directory == image, flush=True)
    print("TARGET", target.wait(timeout=5), flush=True)   # its end is ours to collect, not the library's
    _, status = os.waitpid(bystander, 0)
    print("BYSTANDER", os.waitstatus_to_exitcode(status), flush=True)
    at_dump = value()
    proc = ptckpt.restore(image, pidns=True)
    print("RESTORED", proc.pid, proc.init_pid, proc.vpid == target.pid, proc.alive(), flush=True)
    wait_for(lambda: value() > at_dump + 10, "the restored counter goes on")
    print("WAIT", proc.wait(timeout=0.1), flush=True)
    proc.signal(signal.SIGTERM)
    print("STATUS", proc.wait(timeout=10), proc.alive(), flush=True)
    again = ptckpt.api.restore(image, pidns=True, file_policy=["warn"])   # the counter wrote since
    again.kill()
    print("KILLED", again.alive(), again.wait(), any("count" in w for w in again.warnings), flush=True)
""")


@pytest.fixture
def started():
    """Pids the program prints (PID, RESTORED): killed at the end whatever happened."""
    pids: list[int] = []
    yield pids
    kill_pids(pids)
    reap_orphans()


def test_a_program_dumps_and_restores_through_the_python_api(fixture_bins, tmp_path, started):
    script = tmp_path / "user.py"
    script.write_text(PROGRAM)
    res = subprocess.run([sys.executable, script, fixture_bins["counter"], tmp_path / "count",
                          str(tmp_path / "img")], capture_output=True, text=True, timeout=120)
    lines = res.stdout.splitlines()
    for line in lines:
        words = line.split()
        if words[0] in ("PID", "RESTORED"):
            started += [int(w) for w in words[1:3] if w.isdigit() and int(w) > 0]
    assert res.returncode == 0, res.stdout + res.stderr
    assert [l for l in lines if not l.startswith(("PID", "RESTORED"))] == [
        "DUMPED True True True", "TARGET -9", "BYSTANDER 7", "WAIT None", "STATUS 143 False", "KILLED False 137 True"]
    restored = next(l for l in lines if l.startswith("RESTORED")).split()
    assert restored[3:] == ["True", "True"] and int(restored[2]) > 0      # its own pid namespace


def test_api_errors_are_the_commands_errors(tmp_path):
    import ptckpt
    with pytest.raises(NoSuchProcess) as caught:
        ptckpt.dump(4194304 + 1, tmp_path / "img")
    assert caught.value.exit_code == ExitCode.NO_SUCH_PROCESS
    with pytest.raises(PtckptError) as caught:
        ptckpt.restore(tmp_path / "nothing")
    assert caught.value.exit_code == ExitCode.NOT_AN_IMAGE
    assert callable(ptckpt.dump) and callable(ptckpt.restore)
    from ptckpt.dump import DumpMode                    # the modules stay modules too
    assert DumpMode.KILL
