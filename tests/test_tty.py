"""Terminals: a real interactive python3 in a pty, driven with tmux send-keys and read with
capture-pane, restored onto the invoking terminal (a shell job) or onto a new pty."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

from conftest import WaitTimeout, needs, kill_pids, reap_orphans, wait_pid_free, wait_until

pytestmark = needs("tmux")


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
    _remove_socket(sock)


def _remove_socket(name: str) -> None:
    """tmux leaves its socket file behind when its server is killed."""
    where = os.environ.get("TMUX_TMPDIR", "/tmp")
    with contextlib.suppress(OSError):
        os.unlink(f"{where}/tmux-{os.getuid()}/{name}")


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
    """Until `pid` runs python3 again (not the restorer stub it starts as), let go by ptckpt (its
    state alone does not say it: between two injected syscalls a traced process runs too)."""
    def back() -> bool:
        try:
            with open(f"/proc/{pid}/status") as f:
                released = "\nTracerPid:\t0\n" in f.read()
            return "python" in os.readlink(f"/proc/{pid}/exe") and released and _stat(pid)[0] != "t"
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
        # (the stub can look restored while ptckpt still injects into it: wait for the end state)
        wait_until(lambda: int(_stat(repl)[3]) == repl and int(_stat(repl)[4]) != 0, 5,
                   message=lambda: f"its own session, with a controlling tty: {_stat(repl)}")
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


# --- real full-screen programs restored into a plain terminal (no --new-pty) -----------

def _tty_of_pane(tmux, session: str) -> str:
    return tmux("list-panes", "-t", session, "-F", "#{pane_tty}").strip()


def _job_in_pane(tmux, session: str, command: str, ready) -> int:
    """`command` typed into a shell in tmux session `session`; its pid once `ready(screen)`."""
    tmux("new-session", "-d", "-s", session, "-x", "100", "-y", "30", "bash --norc --noprofile")
    wait_until(lambda: _screen(tmux, session).rstrip().endswith(("$", "#")), 10)
    tmux("send-keys", "-t", session, command, "Enter")
    wait_until(lambda: ready(_screen(tmux, session)), 15, message=lambda: _screen(tmux, session))
    return _children(_pane_pid(tmux, session))[0]


def _dump_and_restore_in_pane(tmux, ptckpt, ptckpt_cmd, tmp_path, session: str, pid: int,
                              exe: str, *restore_args: str) -> None:
    """Dump `pid` (killing it), then `ptckpt restore` typed into the shell of `session`; waits
    until the restored process runs `exe` again (the start of its name: vim may be vim.basic)."""
    res = ptckpt("dump", pid, "-D", tmp_path / "img", "--kill")
    assert res.returncode == 0, res.stderr
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 5)
    tmux("send-keys", "-t", session, "clear", "Enter")
    cmd = shlex.join(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"), *restore_args])
    tmux("send-keys", "-t", session, f"{cmd}; echo RC=$?", "Enter")

    def back() -> bool:
        try:
            return (os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith(exe)
                    and _stat(pid)[0] != "t")
        except OSError:
            return False
    wait_until(back, 15, message=lambda: _screen(tmux, session))


def _links(pid: int) -> dict[int, str]:
    """What each fd of `pid` is; an fd closed between the listing and its readlink (top opens
    and closes files of /proc all the time) is left out."""
    out = {}
    for n in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            out[int(n)] = os.readlink(f"/proc/{pid}/fd/{n}")
    return out


def _ends_with_status(tmux, session: str, pid: int, status: int = 0) -> None:
    wait_until(lambda: not os.path.exists(f"/proc/{pid}") and f"RC={status}" in _screen(tmux, session),
               10, message=lambda: _screen(tmux, session))


@needs("top")
def test_top_restored_into_a_plain_terminal_has_its_terminal_at_every_fd(tmux, ptckpt, ptckpt_cmd, tmp_path):
    """top's fd 3 is a dup of its fd 0: the handoff of the terminal once gave fds 0, 1 and 3
    ptckpt's own fd 3 (the image's page file)."""
    top = _job_in_pane(tmux, "top", "top -d 0.5", lambda s: "load average" in s)
    tty = _tty_of_pane(tmux, "top")
    before = _links(top)
    assert [before[n] for n in (0, 1, 3)] == [tty] * 3, before
    try:
        _dump_and_restore_in_pane(tmux, ptckpt, ptckpt_cmd, tmp_path, "top", top, "top")
        after = _links(top)
        assert [after[n] for n in (0, 1, 3)] == [tty] * 3, after
        assert after[2] == before[2]
        # ptckpt restore hands the terminal over as the restored tree starts: a moment later
        wait_until(lambda: int(_stat(top)[2]) == top and int(_stat(top)[5]) == top, 5,
                   message=lambda: f"its own group, in front of the terminal: {_stat(top)}")
        # it redraws (the screen was cleared before the restore) and takes keystrokes
        wait_until(lambda: "load average" in _screen(tmux, "top"), 10, message=lambda: _screen(tmux, "top"))
        tmux("send-keys", "-t", "top", "q")
        _ends_with_status(tmux, "top", top)
    finally:
        kill_pids([top])


def test_bash_restored_into_a_plain_terminal(tmux, ptckpt, ptckpt_cmd, tmp_path):
    """bash keeps its terminal at fd 255 too (it refused: 'has no fd 255 of its own')."""
    inner = _job_in_pane(tmux, "sh", "bash --norc --noprofile", lambda s: s.rstrip().count("#") +
                         s.rstrip().count("$") >= 2)
    tmux("send-keys", "-t", "sh", "X=41; PS1='inner> '", "Enter")
    wait_until(lambda: "inner>" in _screen(tmux, "sh"), 10)
    tty = _tty_of_pane(tmux, "sh")
    assert _links(inner)[255] == tty
    try:
        _dump_and_restore_in_pane(tmux, ptckpt, ptckpt_cmd, tmp_path, "sh", inner, "bash")
        links = _links(inner)
        assert [links[n] for n in (0, 1, 2, 255)] == [tty] * 4, links
        tmux("send-keys", "-t", "sh", "echo $((X + 1))", "Enter")
        wait_until(lambda: "42" in _screen(tmux, "sh").split("echo $((X + 1))")[-1], 10,
                   message=lambda: _screen(tmux, "sh"))
        tmux("send-keys", "-t", "sh", "exit", "Enter")
        _ends_with_status(tmux, "sh", inner)
    finally:
        kill_pids([inner])


@needs("less")
def test_less_with_its_own_open_of_the_terminal_restored(tmux, ptckpt, ptckpt_cmd, tmp_path):
    """less opens the terminal a second time (/dev/tty, a description of its own): it was
    accepted at dump and refused at restore; now it is opened again as /dev/tty."""
    less = _less_in_pane(tmux, tmp_path)
    tty = _tty_of_pane(tmux, "less")
    before = _links(less)
    own = [n for n in before if n > 2 and before[n] in (tty, "/dev/tty")]
    assert own, before
    try:
        _dump_and_restore_in_pane(tmux, ptckpt, ptckpt_cmd, tmp_path, "less", less, "less")
        after = _links(less)
        assert [after[n] for n in (0, 1, 2)] == [before[n] for n in (0, 1, 2)]
        assert all(after[n] == "/dev/tty" for n in own), after
        # its controlling terminal is the pane's: reading /dev/tty reads the pane's keys
        _less_redraws_and_takes_keys(tmux, less)
    finally:
        kill_pids([less])


def _less_in_pane(tmux, tmp_path) -> int:
    text = tmp_path / "lines.txt"
    text.write_text("".join(f"line number {n}\n" for n in range(1, 501)))
    return _job_in_pane(tmux, "less", f"less {text}", lambda s: "line number 1" in s)


def _less_redraws_and_takes_keys(tmux, less: int) -> None:
    wait_until(lambda: "line number 1" in _screen(tmux, "less"), 10, message=lambda: _screen(tmux, "less"))
    tmux("send-keys", "-t", "less", "G")
    wait_until(lambda: "line number 500" in _screen(tmux, "less"), 10, message=lambda: _screen(tmux, "less"))
    tmux("send-keys", "-t", "less", "q")
    _ends_with_status(tmux, "less", less)


@needs("less")
def test_less_restored_onto_a_new_pty_leads_a_session_with_it(tmux, ptckpt, ptckpt_cmd, tmp_path):
    """less was in its shell's session: with --new-pty it leads a session whose controlling
    terminal is the new pty, so its own open of /dev/tty is that pty (not ptckpt's terminal)."""
    less = _less_in_pane(tmux, tmp_path)
    try:
        _dump_and_restore_in_pane(tmux, ptckpt, ptckpt_cmd, tmp_path, "less", less, "less", "--new-pty")
        fields = _stat(less)
        assert int(fields[3]) == less and int(fields[5]) == less, "its own session, in front of it"
        pts = os.readlink(f"/proc/{less}/fd/0")
        assert pts.startswith("/dev/pts/") and pts != _tty_of_pane(tmux, "less")
        assert os.stat(f"/proc/{less}/fd/0").st_rdev == _tty_nr_rdev(int(fields[4]))
        _less_redraws_and_takes_keys(tmux, less)
    finally:
        kill_pids([less])


def _tty_nr_rdev(tty_nr: int) -> int:
    return os.makedev((tty_nr >> 8) & 0xFFF, (tty_nr & 0xFF) | ((tty_nr >> 12) & 0xFFF00))


def _vim_n(tmux, session: str) -> int:
    """g:n of the vim in `session`, through the screen.  Asked again (up to three times) when
    no answer shows: keys typed while a restore sets the terminal up may be flushed with
    the input queue (TCSAFLUSH), and a timer's redraw may wipe the message line."""
    for attempt in range(3):
        marker = f"n={{}}{os.urandom(3).hex()}"
        tmux("send-keys", "-t", session, "Escape")
        tmux("send-keys", "-t", session, f":echo '{marker.format('')}' . g:n", "Enter")
        head = marker.format("")
        try:
            found = wait_until(lambda: [ln for ln in _screen(tmux, session).splitlines() if ln.startswith(head)],
                               5, message=lambda: _screen(tmux, session))
        except WaitTimeout:
            if attempt == 2:
                raise
            continue
        return int(found[-1][len(head):].split()[0])
    raise AssertionError("unreachable")


@needs("vim")
def test_vim_with_a_repeating_timer_keeps_firing_after_restore(tmux, ptckpt, ptckpt_cmd, tmp_path):
    vim = _job_in_pane(tmux, "vim", "vim -u NONE -N -i NONE", lambda s: s.count("~") > 5)
    tmux("send-keys", "-t", "vim", ":let g:n = 0", "Enter")
    tmux("send-keys", "-t", "vim",
         ":call timer_start(200, {-> execute('let g:n += 1')}, {'repeat': -1})", "Enter")
    wait_until(lambda: _vim_n(tmux, "vim") >= 3, 10)
    try:
        _dump_and_restore_in_pane(tmux, ptckpt, ptckpt_cmd, tmp_path, "vim", vim, "vim")
        first = _vim_n(tmux, "vim")
        wait_until(lambda: _vim_n(tmux, "vim") >= first + 5, 10)
        links = _links(vim)
        tty = _tty_of_pane(tmux, "vim")
        assert [links[n] for n in (0, 1, 2)] == [tty] * 3, links
        tmux("send-keys", "-t", "vim", ":qa!", "Enter")
        _ends_with_status(tmux, "vim", vim)
    finally:
        kill_pids([vim])


@needs("top")
def test_session_leader_restored_in_front_of_a_plain_terminal(tmux, ptckpt, ptckpt_cmd, tmp_path):
    """top ran as a pane's own program (a session leader, the terminal its controlling one):
    restored into another pane's shell it joins that session and comes to the front, where
    making it a session of its own failed (EPERM: the terminal is the shell's session's)."""
    tmux("new-session", "-d", "-s", "lead", "-x", "100", "-y", "30", "top -d 0.5")
    wait_until(lambda: "load average" in _screen(tmux, "lead"), 10)
    top = _pane_pid(tmux, "lead")
    assert int(_stat(top)[3]) == top
    tmux("new-session", "-d", "-s", "sh", "-x", "100", "-y", "30", "bash --norc --noprofile")
    wait_until(lambda: _screen(tmux, "sh").rstrip().endswith(("$", "#")), 10)
    shell = _pane_pid(tmux, "sh")
    try:
        res = ptckpt("dump", top, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        # In a pid namespace of its own: tmux, its parent, was seen to leave the pid a zombie
        # for more than 10 s (killed by a dump or by a plain SIGKILL alike).
        cmd = shlex.join(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"), "--pidns"])
        tmux("send-keys", "-t", "sh", f"{cmd} 2>{tmp_path / 'err'}; echo RC=$?", "Enter")
        outer = wait_until(lambda: re.search(r" as (\d+)", (tmp_path / "err").read_text()
                                             if (tmp_path / "err").exists() else ""), 15,
                           message=lambda: _screen(tmux, "sh"))
        top = int(outer.group(1))
        wait_until(lambda: os.readlink(f"/proc/{top}/exe").endswith("/top") and _stat(top)[0] != "t", 15,
                   message=lambda: _screen(tmux, "sh"))
        fields = _stat(top)
        assert int(fields[3]) == int(_stat(shell)[3]), "in the shell's session"
        assert int(fields[2]) == top and int(fields[5]) == top, "its own group, in front of the terminal"
        wait_until(lambda: "load average" in _screen(tmux, "sh"), 10, message=lambda: _screen(tmux, "sh"))
        tmux("send-keys", "-t", "sh", "q")
        _ends_with_status(tmux, "sh", top)
        assert "session leader" in (tmp_path / "err").read_text()
        assert int(_stat(shell)[5]) == int(_stat(shell)[2]), "the shell has its terminal back"
    finally:
        kill_pids([top])


FAILING_PLUGIN = '''
from ptckpt.plugins import Plugin
class Failing(Plugin):
    name = "failing"
    def restored(self, proc, ctx):
        raise RuntimeError("this restore fails on purpose")
'''


@needs("vim")
def test_a_failed_restore_leaves_the_terminal_as_it_was(tmux, ptckpt, ptckpt_cmd, tmp_path):
    """The restore puts the image's termios (vim's raw mode) and the job's group on the
    terminal before the processes are rebuilt; when it fails after that, both go back."""
    vim = _job_in_pane(tmux, "vim", "vim -u NONE -N -i NONE", lambda s: s.count("~") > 5)
    (tmp_path / "failing.py").write_text(FAILING_PLUGIN)
    shell = _pane_pid(tmux, "vim")
    try:
        res = ptckpt("dump", vim, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: not os.path.exists(f"/proc/{vim}"), 5)
        tmux("send-keys", "-t", "vim", "clear", "Enter")
        tmux("send-keys", "-t", "vim", f"stty -g > {tmp_path / 'before'}", "Enter")
        cmd = shlex.join(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"),
                                       "--plugin", str(tmp_path / "failing.py")])
        tmux("send-keys", "-t", "vim", f"{cmd}; echo RC=$?; stty -g > {tmp_path / 'after'}", "Enter")
        wait_until(lambda: (tmp_path / "after").exists() and (tmp_path / "after").read_text(), 20,
                   message=lambda: _screen(tmux, "vim"))
        assert re.search(r"RC=1\d", _screen(tmux, "vim")), _screen(tmux, "vim")
        assert (tmp_path / "after").read_text() == (tmp_path / "before").read_text()
        assert int(_stat(shell)[5]) == int(_stat(shell)[2]), "the shell has its terminal back"
    finally:
        kill_pids([vim])


@pytest.fixture
def inner_tmux(tmp_path):
    """A second tmux server (the one dumped and restored): inner(*args); killed at the end,
    with its panes and the processes a restore made of them."""
    sock = f"ptckpt-inner-{os.getpid()}-{tmp_path.name}"[:100]
    pids: list[int] = []

    def run(*args: str) -> str:
        return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True,
                              check=True).stdout

    run.sock = sock
    run.pids = pids
    yield run
    with contextlib.suppress(subprocess.CalledProcessError):
        pids += [int(p) for p in run("list-panes", "-a", "-F", "#{pane_pid}").split()]
        pids += [int(run("display-message", "-p", "#{pid}"))]
    pids += [d for p in list(pids) for d in _descendants(p)]
    subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    kill_pids(pids)
    reap_orphans()
    _remove_socket(sock)


def test_a_tmux_server_restored_and_attached_by_a_new_client(tmux, inner_tmux, ptckpt, tmp_path):
    """A tmux server holds the pty master of its pane, whose shell has the slave as its
    controlling terminal: both come back, with the pty's size, and a new client sees the
    screen of before the dump and types into the restored shell."""
    inner = inner_tmux
    inner("new-session", "-d", "-s", "work", "-x", "90", "-y", "25", "bash --norc --noprofile")
    wait_until(lambda: inner("capture-pane", "-p", "-t", "work").rstrip().endswith(("$", "#")), 10)
    inner("send-keys", "-t", "work", "echo hello-$((6 * 7))-before", "Enter")
    wait_until(lambda: "hello-42-before" in inner("capture-pane", "-p", "-t", "work"), 10)
    server = int(inner("display-message", "-p", "#{pid}"))
    shell = int(inner("list-panes", "-t", "work", "-F", "#{pane_pid}"))
    inner.pids += [server, shell]
    pts = inner("list-panes", "-t", "work", "-F", "#{pane_tty}").strip()
    assert os.readlink(f"/proc/{shell}/fd/0") == pts
    # the clients of the commands above gone: the server holds its listening socket only
    wait_until(lambda: sum(os.readlink(f"/proc/{server}/fd/{n}").startswith("socket:")
                           for n in os.listdir(f"/proc/{server}/fd")) == 1, 10,
               message="the tmux commands' client connections closed")
    res = ptckpt("dump", server, "-D", tmp_path / "img", "--kill")
    assert res.returncode == 0, res.stderr
    for pid in (shell, server):
        wait_pid_free(pid)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    fields = _stat(shell)
    assert int(fields[3]) == shell and int(fields[4]) != 0, "its own session, with a controlling tty"
    assert int(fields[5]) == shell, "in front of its pty"
    assert os.readlink(f"/proc/{shell}/fd/0").startswith("/dev/pts/")
    # a new client, in a pane of the test's own tmux, sees the old screen and types on
    tmux("new-session", "-d", "-s", "viewer", "-x", "100", "-y", "30",
         f"tmux -L {inner.sock} attach -t work")
    wait_until(lambda: "hello-42-before" in _screen(tmux, "viewer"), 10, message=lambda: _screen(tmux, "viewer"))
    tmux("send-keys", "-t", "viewer", "stty size; echo after-$((40 + 2))", "Enter")
    wait_until(lambda: "after-42" in _screen(tmux, "viewer").split("after-$")[-1], 10,
               message=lambda: _screen(tmux, "viewer"))


def test_a_pty_whose_slave_is_held_outside_is_refused_at_dump(tmux, inner_tmux, ptckpt, tmp_path):
    """The master in the tree, its slave in a process outside: refused by name, left running."""
    inner = inner_tmux
    inner("new-session", "-d", "-s", "srv", "sleep 600")
    server = int(inner("display-message", "-p", "#{pid}"))
    pane = int(inner("list-panes", "-t", "srv", "-F", "#{pane_pid}"))
    inner.pids += [server, pane]
    res = ptckpt("dump", server, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr                    # the whole tree: fine
    pts = inner("list-panes", "-t", "srv", "-F", "#{pane_tty}").strip()
    holder = subprocess.Popen(["sleep", "600"], stdin=open(pts), start_new_session=True)
    try:
        res = ptckpt("dump", server, "-D", tmp_path / "img2")
        assert res.returncode == 13, res.stderr
        line, = res.stderr.strip().splitlines()
        assert "/dev/ptmx" in line and f"pid {holder.pid}" in line and "slave" in line, line
        assert _stat(server)[0] in "SR" and not (tmp_path / "img2").exists(), "left running, nothing written"
    finally:
        holder.kill()
        holder.wait()


def test_a_pty_master_with_output_pending_and_its_slave_in_the_tree(spawn, ptckpt, tmp_path):
    """script(1)'s shape: the master in the parent, the slave the child's controlling terminal.
    The bytes the child wrote that the parent has not read, and the window size, survive a
    leave-running dump (for the process left running) and a restore."""
    holder = spawn("ptyholder.py")
    kid = int(holder.stdout_lines()[0].split()[1])
    try:
        res = ptckpt("dump", holder.pid, "-D", tmp_path / "img")
        assert res.returncode == 0, res.stderr
        holder.signal(signal.SIGUSR1)                  # the one left running reads its pty
        assert holder.wait_exit(20) == 0, holder.describe()
        assert "VERIFY OK" in holder.out_text()
        kill_pids([kid])
        for pid in (kid, holder.pid):
            wait_pid_free(pid)
        holder.out_path.write_text("")
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--file-policy", "ignore")
        assert res.returncode == 0, res.stderr
        holder.adopt(holder.pid)
        fields = _stat(kid)
        assert int(fields[3]) == kid and int(fields[4]) != 0 and int(fields[5]) == kid
        os.kill(holder.pid, signal.SIGUSR1)
        wait_until(lambda: "VERIFY" in holder.out_text() or "BAD" in holder.out_text(), 20,
                   message=holder.describe)
        assert "VERIFY OK" in holder.out_text(), holder.out_text()
        assert "pending-output-42" in holder.out_text()
    finally:
        kill_pids([holder.pid, kid])



PTY_OWNER = r'''
import os, time
master, slave = os.openpty()
print("PTS", os.ttyname(slave), flush=True)
os.close(slave)
print("READY", os.getpid(), flush=True)
time.sleep(600)
'''

CTTY_ONLY = ("import fcntl, os, sys, termios, time\n"
             "fd = os.open(sys.argv[1], os.O_RDWR)\n"
             "fcntl.ioctl(fd, termios.TIOCSCTTY, 0)\n"
             "os.close(fd)\n"
             "print('CTTY', flush=True)\n"
             "time.sleep(600)\n")


def test_a_pty_controlling_a_session_outside_the_tree_is_refused_at_dump(spawn, ptckpt, tmp_path):
    """The tree holds the master; a process outside made the slave its controlling terminal
    and closed its fds (so no fd of it shows outside): refused, naming the session."""
    (tmp_path / "owner.py").write_text(PTY_OWNER)
    holder = spawn(str(tmp_path / "owner.py"), out=False)
    pts = holder.stdout_lines()[0].split()[1]
    outside = subprocess.Popen([sys.executable, "-c", CTTY_ONLY, pts], stdout=subprocess.PIPE,
                               stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        assert outside.stdout.readline().strip() == b"CTTY"
        res = ptckpt("dump", holder.pid, "-D", tmp_path / "img")
        assert res.returncode == 13, res.stderr
        line, = res.stderr.strip().splitlines()
        assert f"controlling terminal of session {outside.pid}" in line and "leader" in line, line
        assert holder.alive() and not (tmp_path / "img").exists()
    finally:
        outside.kill()
        outside.wait()


SLOW_PLUGIN = '''
import time
from ptckpt.plugins import Plugin
class Slow(Plugin):
    name = "slow"
    def restored(self, proc, ctx):
        open(__file__ + ".started", "w").close()
        time.sleep(30)
'''


@needs("top")
def test_ctrl_c_during_a_restore_ends_it_and_leaves_the_terminal_as_it_was(tmux, ptckpt, ptckpt_cmd, tmp_path):
    """^C typed while the processes are being rebuilt reaches ptckpt restore (the job is not
    in front yet): the restore ends, nothing of it is left, the shell has its terminal."""
    top = _job_in_pane(tmux, "top", "top -d 0.5", lambda s: "load average" in s)
    shell = _pane_pid(tmux, "top")
    (tmp_path / "slow.py").write_text(SLOW_PLUGIN)
    try:
        res = ptckpt("dump", top, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        wait_until(lambda: not os.path.exists(f"/proc/{top}"), 5)
        tmux("send-keys", "-t", "top", "clear", "Enter")
        tmux("send-keys", "-t", "top", f"stty -g > {tmp_path / 'before'}", "Enter")
        cmd = shlex.join(ptckpt_cmd + ["restore", "-D", str(tmp_path / "img"), "--plugin", str(tmp_path / "slow.py")])
        tmux("send-keys", "-t", "top", f"{cmd}; echo RC=$?; stty -g > {tmp_path / 'after'}", "Enter")
        wait_until(lambda: (tmp_path / "slow.py.started").exists(), 20, message=lambda: _screen(tmux, "top"))
        tmux("send-keys", "-t", "top", "C-c")
        wait_until(lambda: (tmp_path / "after").exists() and (tmp_path / "after").read_text(), 20,
                   message=lambda: _screen(tmux, "top"))
        assert "RC=130" in _screen(tmux, "top"), _screen(tmux, "top")
        assert (tmp_path / "after").read_text() == (tmp_path / "before").read_text()
        assert int(_stat(shell)[5]) == int(_stat(shell)[2]), "the shell has its terminal back"
        wait_until(lambda: not os.path.exists(f"/proc/{top}") or _stat(top)[0] == "Z", 10)
    finally:
        kill_pids([top])
