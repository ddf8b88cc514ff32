"""Terminals: a real interactive python3 in a pty, driven with tmux send-keys and read with
capture-pane, restored onto the invoking terminal (a shell job) or onto a new pty."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from conftest import kill_pids, reap_orphans, wait_until

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@pytest.fixture
def tmux(tmp_path):
    """tmux(*args) on a private server; the server and what runs in it are killed at the end."""
    sock = f"ptckpt-test-{os.getpid()}-{tmp_path.name}"[:100]

    def run(*args: str) -> str:
        return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True,
                              check=True).stdout

    yield run
    pids = []
    try:
        pids = [int(p) for p in run("list-panes", "-a", "-F", "#{pane_pid}").split()]
        pids += [int(p) for p in run("display-message", "-p", "#{pid}").split()]    # the server
    except subprocess.CalledProcessError:
        pass
    pids += [d for p in list(pids) for d in _descendants(p)]
    subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    kill_pids(pids)
    reap_orphans()


def _descendants(pid: int) -> list[int]:
    try:
        kids = _children(pid)
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def _running(word: str) -> list[int]:
    """Pids whose command line mentions `word` (the program ptckpt handed the master to)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if word.encode() in f.read():
                        out.append(int(name))
            except OSError:
                pass
    return out


def _screen(tmux, session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def _pane_pid(tmux, session: str) -> int:
    return int(tmux("list-panes", "-t", session, "-F", "#{pane_pid}").split()[0])


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()       # state ppid pgrp session tty_nr tpgid ...


def _repl_in(tmux, session: str, command: str | None = None) -> int:
    """python3 -q running in tmux session `session` (its pane's program, or `command` typed into
    the pane's shell), with x = 41 entered; returns its pid."""
    if command is None:
        tmux("new-session", "-d", "-s", session, "-x", "100", "-y", "30", "python3 -q")
    else:
        tmux("new-session", "-d", "-s", session, "-x", "100", "-y", "30", command)
        tmux("send-keys", "-t", session, "python3 -q", "Enter")
    wait_until(lambda: ">>>" in _screen(tmux, session), 10)
    pane = _pane_pid(tmux, session)
    repl = pane if command is None else _children(pane)[0]
    tmux("send-keys", "-t", session, "x = 41", "Enter")
    wait_until(lambda: _screen(tmux, session).count(">>>") >= 2, 10)
    return repl


def _wait_restored(tmux, session: str, pid: int) -> None:
    """Until `pid` runs python3 again (not the restorer stub it starts as)."""
    def back() -> bool:
        try:
            return "python" in os.readlink(f"/proc/{pid}/exe") and _stat(pid)[0] != "t"
        except OSError:
            return False
    wait_until(back, 10, message=lambda: _screen(tmux, session))


def _repl_remembers(tmux, session: str) -> None:
    tmux("send-keys", "-t", session, "print(x + 1)", "Enter")
    wait_until(lambda: "42" in _screen(tmux, session).split("print(x + 1)")[-1], 10,
               message=lambda: _screen(tmux, session))


def test_python_repl_restored_onto_a_new_pty(tmux, ptckpt, ptckpt_cmd, tmp_path):
    repl = _repl_in(tmux, "one")
    try:
        res = ptckpt("dump", repl, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: not os.path.exists(f"/proc/{repl}"), 5)
        cmd = shlex.join(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"), "--new-pty"])
        tmux("new-session", "-d", "-s", "two", "-x", "100", "-y", "30", f"{cmd}; sleep 60")
        _wait_restored(tmux, "two", repl)
        fields = _stat(repl)
        assert int(fields[3]) == repl and int(fields[4]) != 0, "its own session, with a controlling tty"
        assert os.readlink(f"/proc/{repl}/fd/0").startswith("/dev/pts/")
        _repl_remembers(tmux, "two")
    finally:
        kill_pids([repl])


def test_python_repl_restored_as_a_shell_job_onto_the_invoking_terminal(tmux, ptckpt, ptckpt_cmd, tmp_path):
    repl = _repl_in(tmux, "job", "bash --norc --noprofile")
    shell = _pane_pid(tmux, "job")
    try:
        res = ptckpt("dump", repl, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: not os.path.exists(f"/proc/{repl}"), 5)
        tmux("send-keys", "-t", "job", "clear", "Enter")
        cmd = shlex.join(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img")])
        tmux("send-keys", "-t", "job", cmd, "Enter")
        _wait_restored(tmux, "job", repl)
        fields = _stat(repl)
        pgrp, tpgid = int(fields[2]), int(fields[5])
        assert pgrp == repl and tpgid == repl, "its own group, in front of the terminal"
        _repl_remembers(tmux, "job")
        tmux("send-keys", "-t", "job", "exit()", "Enter")
        wait_until(lambda: not os.path.exists(f"/proc/{repl}") and
                   _screen(tmux, "job").rstrip().endswith(("$", "#")), 10,
                   message=lambda: _screen(tmux, "job"))
        fields = _stat(shell)
        assert int(fields[5]) == int(fields[2]), "the shell has its terminal back"
    finally:
        kill_pids([repl])


DRIVER = r'''
import os, sys, time
out = sys.argv[1]
os.write(1, b"print(x + 1)\r")                      # typed into the restored REPL
seen = b""
deadline = time.time() + 10
while b"42" not in seen.split(b"print(x + 1)")[-1] and time.time() < deadline:
    seen += os.read(0, 4096)
open(out, "wb").write(seen)
os.write(1, b"exit()\r")
time.sleep(1)
'''


def test_new_pty_master_handed_to_a_named_program(tmux, ptckpt, tmp_path):
    repl = _repl_in(tmux, "one")
    (tmp_path / "driver.py").write_text(DRIVER)
    out = tmp_path / "seen"
    try:
        assert ptckpt("dump", repl, "-D", tmp_path / "img", "--kill").returncode == 0
        wait_until(lambda: not os.path.exists(f"/proc/{repl}"), 5)
        res = ptckpt("restore", "-D", tmp_path / "img", "--new-pty", "--detach",
                     "--new-pty-program", f"python3 {tmp_path / 'driver.py'} {out}")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: out.exists(), 15)
        assert b"42" in out.read_bytes().split(b"print(x + 1)")[-1], out.read_bytes()
        wait_until(lambda: not os.path.exists(f"/proc/{repl}") or
                   _stat(repl)[0] == "Z", 10,
                   message="the REPL ends when the program types exit()")
    finally:
        kill_pids([repl] + _running(str(tmp_path / "driver.py")))
        reap_orphans()
    res = ptckpt("restore", "-D", tmp_path / "img", "--new-pty", "--detach")
    assert res.returncode == 2 and "--new-pty-program" in res.stderr
