"""A restore interrupted at a random moment leaves nothing behind, and the next one works.

SIGINT and SIGTERM unwind the restore (what it built is killed and reaped by ptckpt
itself); SIGKILL gives ptckpt no chance, so the processes it half-built die with it
(PR_SET_PDEATHSIG before they are seized, PTRACE_O_EXITKILL after).  Each phase is hit
by the test hook PTCKPT_TEST_DIE_AT (ptckpt.testhooks), and random moments too.  Such a stub stays a zombie until whoever inherits it
(pid 1, here pytest) reaps it, which may take a moment: the next restore waits for a
zombie holding its pid (pids.ZOMBIE_WAIT) instead of refusing "pid taken".
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time

import pytest

from conftest import descendants, pid_alive, proc_stat, reap_orphans, trials, wait_until


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _status(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return " ".join(line.strip() for line in f if line.split(":")[0] in ("Name", "State", "PPid",
                                                                                  "TracerPid", "SigPnd"))
    except OSError:
        return "gone"


def _restore_again(target, ptckpt, image, reap_late: bool) -> None:
    """The next restore works, even while a zombie of the last one still holds the pid (it is
    reaped half a second later, as pid 1 would)."""
    reaper = threading.Timer(0.5, reap_orphans) if reap_late else None
    if reaper:
        reaper.start()
    res = ptckpt("restore", "-D", image, "--detach", "--file-policy", "warn")
    if reaper:
        reaper.join()
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    target.wait_progress()
    target.assert_ok()
    os.kill(target.pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(target.pid), 5)
    reap_orphans()
    wait_until(lambda: proc_stat(target.pid) is None, 5)


def _assert_stopped_by(res, sig) -> None:
    """SIGKILL ended the command; SIGINT/SIGTERM unwound it, said in one line, exit 128+N."""
    if sig == signal.SIGKILL:
        assert res.returncode == -sig, (res.returncode, res.stderr)
    else:
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 128 + sig and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
        assert f"interrupted by {sig.name}" in lines[0]


@pytest.mark.parametrize("point", ["restore-stub", "restore-fixup", "restore-resume"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_restore_stopped_at_each_phase_leaves_nothing(sig, point, killed_counter, ptckpt, tmp_path):
    target, image = killed_counter
    res = ptckpt("restore", "-D", image, "--detach", "--file-policy", "warn",
                 env=dict(os.environ, PTCKPT_TEST_DIE_AT=f"{point}:1:{sig.name}"))
    _assert_stopped_by(res, sig)
    # nothing half-built runs with the pid: SIGINT/SIGTERM unwound it (killed and reaped by
    # ptckpt), after SIGKILL the stub died with ptckpt (a zombie until its new parent reaps)
    wait_until(lambda: not pid_alive(target.pid), 5,
               message=lambda: f"pid {target.pid} free: {_status(target.pid)}")
    _restore_again(target, ptckpt, image, reap_late=sig == signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=lambda s: s.name)
def test_restores_interrupted_at_random_moments(sig, killed_counter, ptckpt, ptckpt_cmd):
    """At a random moment after the stub exists: either nothing is left, or the process was
    let go before the signal came and runs whole.  SIGINT is handled: then the command said
    so.  SIGKILL can land between the tree being let go and the line being printed (a
    window no program can close): then the process runs whole, said or not."""
    target, image = killed_counter
    rng = random.Random(sig)
    for trial in range(trials(6)):
        proc = subprocess.Popen(ptckpt_cmd + ["restore", "-D", str(image), "--detach", "--file-policy", "warn"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                text=True)
        wait_until(lambda: _children(proc.pid) or proc.poll() is not None, 30, interval=0.001)
        time.sleep(rng.uniform(0, 0.004))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        time.sleep(0.2)
        assert "Traceback" not in err, err
        if pid_alive(target.pid):
            assert "restored pid" in err or sig == signal.SIGKILL, (trial, proc.returncode, err)
            target.adopt(target.pid)
            target.wait_progress()
            target.assert_ok()
            os.kill(target.pid, signal.SIGKILL)
        else:
            assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), (trial, proc.returncode, err)
        wait_until(lambda: not pid_alive(target.pid), 5,
                   message=lambda: f"trial {trial}: pid {target.pid} free: {_status(target.pid)}")
        reap_orphans()
        wait_until(lambda: proc_stat(target.pid) is None, 5)
    _restore_again(target, ptckpt, image, reap_late=False)


@pytest.mark.parametrize("point", ["restore-pidns", "restore-stub", "restore-fixup", "restore-resume"])
def test_a_pidns_restore_killed_at_each_phase_leaves_no_namespace_behind(point, killed_counter, ptckpt):
    """ptckpt killed outright while it builds a tree in a pid namespace of its own: the
    namespace's init sees ptckpt's end of its guard pipe close before the tree was let go
    and kills everything in the namespace, the stub it made before ptckpt seized it too."""
    target, image = killed_counter
    alive_before = descendants()
    res = ptckpt("restore", "-D", image, "--pidns", "--detach", "--file-policy", "warn",
                 env=dict(os.environ, PTCKPT_TEST_DIE_AT=f"{point}:1:SIGKILL"))
    assert res.returncode == -signal.SIGKILL, (res.returncode, res.stderr)

    def left() -> set[int]:
        reap_orphans()
        return {p for p in descendants() - alive_before if proc_stat(p) is not None}

    wait_until(lambda: not left(), 5, message=lambda: f"left: {[_status(p) for p in left()]}")
    res = ptckpt("restore", "-D", image, "--pidns", "--detach", "--file-policy", "warn")
    assert res.returncode == 0, res.stderr
    m = re.search(r"\(init (\d+)\) as (\d+)", res.stderr)
    init, outer = int(m.group(1)), int(m.group(2))
    try:
        target.adopt(outer)
        target.wait_progress()
        target.assert_ok()
    finally:
        os.kill(init, signal.SIGKILL)
        reap_orphans()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_waiting_restore_passes_the_signal_to_its_process(sig, killed_counter, ptckpt_cmd):
    """`ptckpt restore` without --detach waits for what it restored, as a shell waits for
    its job: ^C (or SIGTERM) to ptckpt goes to the restored process, and ptckpt exits
    with its status, leaving nothing running."""
    target, image = killed_counter
    proc = subprocess.Popen(ptckpt_cmd + ["restore", "-D", str(image), "--file-policy", "warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True)
    try:
        wait_until(lambda: pid_alive(target.pid) or proc.poll() is not None, 30)
        target.adopt(target.pid)
        target.wait_progress()
        # the restored process must die of `sig` (an ignored one -- inherited from a shell's
        # background job -- would leave ptckpt waiting on: conftest's spawn resets it)
        assert not _ignores(target.pid, sig), f"the restored process ignores {sig.name}"
        proc.send_signal(sig)
        # the state needed: the restored process gone, then ptckpt with its status
        wait_until(lambda: not pid_alive(target.pid) or proc.poll() is not None, 60,
                   message=lambda: f"the restored process to end of {sig.name}: {_status(target.pid)}")
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, (proc.returncode, err)
        assert "interrupted" not in err, err
        wait_until(lambda: not pid_alive(target.pid), 5, message=lambda: _status(target.pid))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reap_orphans()


def _ignores(pid: int, sig: int) -> bool:
    """Whether process `pid` ignores signal `sig` (SigIgn of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return bool(mask >> (sig - 1) & 1)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_restore_stopped_while_ptckpt_fills_pages_beside_the_tracee(sig, spawn, ptckpt, tmp_path):
    """ptckpt's own thread is copying half of a big fill (resources/fillbeside) when the signal
    comes: SIGINT/SIGTERM stop it and unwind the restore, SIGKILL takes the stub with
    ptckpt; nothing is left, and the next restore brings the heap back whole."""
    target = spawn("bigheap", 160)
    image = tmp_path / "img"
    assert ptckpt("dump", target.pid, "-D", image, "--kill").returncode == 0
    target.wait_exit(10)
    wait_until(lambda: proc_stat(target.pid) is None, 5)
    res = ptckpt("restore", "-D", image, "--detach", env=dict(os.environ, PTCKPT_TEST_DIE_AT=f"restore-fill-beside:2:{sig.name}"))
    _assert_stopped_by(res, sig)
    wait_until(lambda: not pid_alive(target.pid), 5, message=lambda: f"pid {target.pid} free: {_status(target.pid)}")
    reap_orphans()
    wait_until(lambda: proc_stat(target.pid) is None, 5)
    res = ptckpt("-v", "restore", "-D", image, "--detach")
    assert res.returncode == 0 and "copied by ptckpt beside" in res.stderr, res.stderr
    target.adopt(target.pid)
    target.signal(signal.SIGUSR1)
    target.wait_for_line("VERIFY 1 OK")
    target.assert_ok()
