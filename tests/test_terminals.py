"""Terminals: dump a tty through a frozen target's fd, a new pty with the same state,
the relay, and the controlling-tty / foreground-group injections, on real processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from ptckpt import procfs
from ptckpt.errors import PtckptError, RemoteSyscallError
from ptckpt.resources import terminals as T
from ptckpt.tracee import AddressSpace, Session, find_syscall_insn, remote_syscalls

from conftest import kill_pids, require, reap_orphans, wait_until

PY = sys.executable
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _kill_and_reap(pid: int) -> None:
    kill_pids([pid])
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


@contextlib.contextmanager
def _frozen(pid: int):
    session = Session()
    try:
        session.freeze_process(pid)
        yield session
    finally:
        session.resume_all()


@contextlib.contextmanager
def _injecting(pid: int):
    """A remote-syscall scope on the frozen leader of `pid`; it runs on afterwards."""
    with _frozen(pid) as session:
        leader = next(t for t in session.threads_of(pid) if t.tid == pid)
        with AddressSpace(pid) as mem:
            gadget = find_syscall_insn(mem, procfs.read_maps(pid))
            with remote_syscalls(leader, mem, gadget) as remote:
                yield remote


def _odd_termios(base: T.Termios) -> T.Termios:
    """A termios no program would leave by itself: echo off, ^C moved, VMIN/VTIME set."""
    cc = bytearray(base.cc)
    cc[termios.VINTR] = 0x07
    cc[termios.VMIN] = 3
    cc[termios.VTIME] = 5
    return T.Termios(iflag=base.iflag | termios.IXOFF, oflag=base.oflag,
                     cflag=base.cflag, lflag=base.lflag & ~(termios.ECHO | termios.ICANON),
                     line=base.line, cc=bytes(cc), ispeed=base.ispeed, ospeed=base.ospeed)


# --- (a) dump a tmux pane's terminal --------------------------------------------------

@pytest.fixture
def tmux_pane(tmp_path):
    """A python3 sleeping in a detached 120x40 tmux session of a private server: its pid."""
    require("tmux")
    sock = str(tmp_path / "tmux.sock")
    base = ["tmux", "-S", sock, "-f", "/dev/null"]
    env = dict(os.environ, TERM=os.environ.get("TERM") or "xterm")
    subprocess.run(base + ["new-session", "-d", "-s", "ptckpt", "-x", "120", "-y", "40",
                           f"exec {PY} -c 'import time; time.sleep(60)'"],
                   check=True, env=env, stdin=subprocess.DEVNULL)
    pane = None
    try:
        pane = int(subprocess.run(base + ["list-panes", "-F", "#{pane_pid}"], check=True,
                                  capture_output=True, text=True).stdout.split()[0])
        wait_until(lambda: os.readlink(f"/proc/{pane}/exe") == os.path.realpath(PY), 5,
                   message="the pane never ran python3")
        yield pane
    finally:
        subprocess.run(base + ["kill-server"], capture_output=True)
        if pane is not None:
            kill_pids([pane])


def test_dump_terminal_of_tmux_pane(tmux_pane):
    pid = tmux_pane
    pts = os.readlink(f"/proc/{pid}/fd/0")
    assert pts.startswith("/dev/pts/")
    fd = os.open(pts, os.O_RDWR | os.O_NOCTTY)
    try:
        odd = _odd_termios(T._get_termios(fd))
        T._set_termios(fd, odd)
    finally:
        os.close(fd)

    with _frozen(pid):
        state = T.dump_terminal(pid, 0)

    st = procfs.read_stat(pid)
    assert state.termios == odd
    assert not state.termios.lflag & termios.ECHO
    assert state.termios.cc[termios.VINTR] == 0x07
    assert (state.winsize.cols, state.winsize.rows) == (120, 40)
    assert state.fg_pgrp == st.pgrp == pid          # tmux makes the pane a session leader
    assert state.sid == st.session == pid
    assert state.controlling
    assert state.pty_slave and not state.pty_master
    assert state.path == pts and state.pty_index == int(pts.rsplit("/", 1)[1])
    assert state.rdev == os.stat(pts).st_rdev


def test_dump_terminal_of_a_master_and_a_non_terminal():
    master, slave, path = T.open_new_pty()
    try:
        m = T.dump_terminal(os.getpid(), master)
        assert m.pty_master and not m.pty_slave and not m.controlling
        assert m.pty_index == int(path.rsplit("/", 1)[1])
        assert m.sid is None and m.fg_pgrp is None       # nobody's controlling tty
        s = T.dump_terminal(os.getpid(), slave)
        assert s.pty_slave and s.path == path and s.pty_index == m.pty_index
    finally:
        _close(master, slave)
    r, w = os.pipe()
    try:
        with pytest.raises(PtckptError, match="not a terminal"):
            T.dump_terminal(os.getpid(), r)
    finally:
        _close(r, w)


# --- (b) a new pty with the recorded state ----------------------------------------

REPORT = ("import json, os, termios; t = termios.tcgetattr(0); s = os.get_terminal_size(0); "
          "print(json.dumps({'flags': t[:4], 'cc': [c if isinstance(c, int) else ord(c) "
          "for c in t[6][:19]], 'size': [s.columns, s.lines], 'tty': os.ttyname(0)}))")


def _state_with(termios_: T.Termios, winsize: T.WinSize) -> T.TerminalState:
    return T.TerminalState(termios=termios_, winsize=winsize, fg_pgrp=None, sid=None,
                           controlling=False, pty_slave=True, pty_master=False, pty_index=0,
                           rdev=0, path="/dev/pts/0")


def test_open_new_pty_has_recorded_termios_and_size():
    master, slave, path = T.open_new_pty()
    try:
        recorded = _state_with(_odd_termios(T._get_termios(slave)), T.WinSize(33, 101, 7, 9))
    finally:
        _close(master, slave)

    master, slave, path = T.open_new_pty(recorded)
    try:
        assert T._get_termios(slave) == recorded.termios
        assert T._get_winsize(master) == recorded.winsize      # one winsize for the pair
        out = subprocess.run([PY, "-c", REPORT], stdin=slave, stdout=subprocess.PIPE,
                             check=True, timeout=10).stdout
    finally:
        _close(master, slave)
    got = json.loads(out)
    t = recorded.termios
    assert got["flags"] == [t.iflag, t.oflag, t.cflag, t.lflag]
    assert bytes(got["cc"]) == t.cc
    assert got["size"] == [101, 33]
    assert got["tty"] == path


def test_apply_terminal_state_and_foreground_as_controlling_process():
    """In a session leader whose controlling tty is the pty: termios set, then the
    foreground handed to another group and back (the second call comes from the
    background, where SIGTTOU would stop it without the blocking)."""
    master, slave, path = T.open_new_pty()
    _close(slave)
    recorded = _state_with(_odd_termios(T._get_termios(master)), T.WinSize(21, 77))
    code = f"""
import os, sys, time, json
sys.path.insert(0, {ROOT!r})
from ptckpt.resources import terminals as T
from ptckpt.tracee import pidfd_getfd
state = eval(sys.argv[1], dict(vars(T)))
fd = os.open({path!r}, os.O_RDWR)          # a session leader: this makes it the ctty
kid = os.fork()
if kid == 0:
    os.setpgid(0, 0)
    time.sleep(10)
    os._exit(0)
os.setpgid(kid, kid)
T.apply_terminal_state(fd, state, foreground_pgrp=kid)
first = os.tcgetpgrp(fd)
T.apply_terminal_state(fd, state, foreground_pgrp=os.getpgrp(), winsize=False)
print(json.dumps([first, kid, os.tcgetpgrp(fd), os.getpgrp()]), flush=True)
os.kill(kid, 9)
os.waitpid(kid, 0)
"""
    try:
        proc = subprocess.run([PY, "-c", code, repr(recorded)], stdout=subprocess.PIPE,
                              start_new_session=True, timeout=10, check=True)
        first, kid, second, own = json.loads(proc.stdout)
        assert first == kid and second == own
        assert T._get_termios(master) == recorded.termios
        assert T._get_winsize(master) == recorded.winsize
    finally:
        _close(master)


# --- (c) the relay --------------------------------------------------------------------

def _spawn_on_slave(path: str, argv: list[str]) -> int:
    """argv as the session leader of the pty at `path` (its stdio and controlling tty)."""
    return os.posix_spawn(argv[0], argv, os.environ, setsid=True, file_actions=[
        (os.POSIX_SPAWN_OPEN, 0, path, os.O_RDWR, 0),
        (os.POSIX_SPAWN_DUP2, 0, 1),
        (os.POSIX_SPAWN_DUP2, 0, 2),
    ])


def test_relay_pipes_until_the_process_exits():
    master, slave, path = T.open_new_pty()
    child = None
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        child = _spawn_on_slave(path, [PY, "-c", "print(input().upper()); raise SystemExit(7)"])
        _close(slave)        # only the child holds the slave now
        os.write(in_w, b"hello\n")
        status = T.relay(master, stdin_fd=in_r, stdout_fd=out_w, until_pid=child)
        child = None          # reaped by relay
        os.close(out_w)
        out = b""
        while chunk := os.read(out_r, 65536):
            out += chunk
        assert status == 7
        assert b"HELLO" in out
        assert b"hello" in out              # the pty's echo
        assert os.get_blocking(in_r)        # stdin's flags untouched
    finally:
        if child is not None:
            _kill_and_reap(child)
        _close(master, slave, in_r, in_w, out_r, out_w)


def test_relay_ends_at_hangup_and_sends_eof_on_stdin_end():
    """Without until_pid: stdin's end becomes VEOF (cat exits), the master hangs up."""
    master, slave, path = T.open_new_pty()
    child = None
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        child = _spawn_on_slave(path, ["/bin/cat"])
        _close(slave)
        os.write(in_w, b"abc\n")
        os.close(in_w)
        assert T.relay(master, stdin_fd=in_r, stdout_fd=out_w) == 0
        os.close(out_w)
        out = os.read(out_r, 65536)
        assert out.count(b"abc") == 2       # echo, then cat's copy
        _, status = os.waitpid(child, 0)
        child = None
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        if child is not None:
            _kill_and_reap(child)
        _close(master, slave, in_r, in_w, out_r, out_w)


SPAWNED = """
import os
os.write(1, b"typed\\n")
got = b""
while b"answer" not in got:
    got += os.read(0, 100)
open(os.environ["OUT"], "wb").write(got)
"""


def test_spawn_on_master_runs_a_program_on_the_master(tmp_path):
    master, slave, path = T.open_new_pty()
    prog = None
    try:
        # The program reads the slave's output from stdin and types into stdout.
        prog = T.spawn_on_master(master, [PY, "-c", SPAWNED], env={"OUT": str(tmp_path / "out")})
        os.close(master)
        master = -1
        assert os.read(slave, 100) == b"typed\n"
        os.write(slave, b"answer")
        _, status = os.waitpid(prog, 0)
        prog = None
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert (tmp_path / "out").read_bytes().endswith(b"answer")   # after the echo
    finally:
        if prog is not None:
            _kill_and_reap(prog)
        _close(slave)
        if master >= 0:
            _close(master)
    with pytest.raises(PtckptError, match="cannot run"):
        m, s, _ = T.open_new_pty()
        try:
            T.spawn_on_master(m, ["/nonexistent/program"])
        finally:
            _close(m, s)


INNER = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})
first = os.get_terminal_size(0)
print("ready", first.columns, first.lines, flush=True)
while os.get_terminal_size(0) == first:
    signal.sigwait({signal.SIGWINCH})
now = os.get_terminal_size(0)
print("resized", now.columns, now.lines, flush=True)
sys.stdin.read()
"""

DRIVER = """
import os, sys
sys.path.insert(0, sys.argv[1])
from ptckpt.resources import terminals as T
master, slave, path = T.open_new_pty()
inner = os.posix_spawn(sys.executable, [sys.executable, "-c", sys.argv[2]], os.environ,
                       setsid=True, file_actions=[(os.POSIX_SPAWN_OPEN, 0, path, os.O_RDWR, 0),
                                                  (os.POSIX_SPAWN_DUP2, 0, 1)])
os.close(slave)
sys.exit(T.relay(master, until_pid=inner))
"""


def _read_until(fd: int, needle: bytes, timeout: float = 5.0) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while needle not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {got!r}"
        r, _, _ = select.select([fd], [], [], left)
        if r:
            got += os.read(fd, 4096)
    return got


def test_relay_on_a_terminal_raw_mode_winch_and_keys():
    """ptckpt's terminal is a pty here too: raw while relaying and back after, its
    size copied in at the start and on SIGWINCH, ^C passed through as a byte."""
    outer, outer_slave, outer_path = T.open_new_pty()
    _close(outer_slave)
    T._set_winsize(outer, T.WinSize(30, 90))
    cooked = T._get_termios(outer)
    driver = None
    try:
        driver = _spawn_on_slave(outer_path, [PY, "-c", DRIVER, ROOT, INNER])
        _read_until(outer, b"ready 90 30")
        relaying = T._get_termios(outer)
        assert not relaying.lflag & (termios.ICANON | termios.ECHO | termios.ISIG)
        assert not relaying.oflag & termios.OPOST
        T._set_winsize(outer, T.WinSize(25, 70))    # the kernel signals the driver
        _read_until(outer, b"resized 70 25")
        os.write(outer, b"\x03")                    # ^C: the inner pty's ISIG kills it
        _, status = os.waitpid(driver, 0)
        driver = None
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGINT
        assert T._get_termios(outer) == cooked
    finally:
        if driver is not None:
            _kill_and_reap(driver)
        _close(outer)


# --- (d) controlling tty and foreground group by injection ----------------------------

# A session member gets the controlling tty only by fork from a process that has
# it: the kid is forked after the injection (a line on stdin says when).
LEADER = """
import os, sys, time
os.setsid()
print(os.getpid(), flush=True)
sys.stdin.readline()
kid = os.fork()
if kid == 0:
    os.setpgid(0, 0)
    time.sleep(30)
    os._exit(0)
os.setpgid(kid, kid)
print(kid, flush=True)
time.sleep(30)
"""


def test_make_controlling_tty_and_foreground_by_injection():
    master, slave, path = T.open_new_pty()
    leader = subprocess.Popen([PY, "-c", LEADER], pass_fds=[slave], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    kid = None
    try:
        assert int(leader.stdout.readline()) == leader.pid
        assert procfs.read_stat(leader.pid).tty_nr == 0
        rdev = os.fstat(slave).st_rdev
        tty_nr = lambda pid: T.decode_tty_nr(procfs.read_stat(pid).tty_nr)  # noqa: E731

        with _injecting(leader.pid) as remote:
            T.make_controlling_tty_frozen(remote, slave)
            T.make_controlling_tty_frozen(remote, slave)       # again: a no-op
            T.set_foreground_frozen(remote, slave, leader.pid)
        st = procfs.read_stat(leader.pid)
        assert tty_nr(leader.pid) == (os.major(rdev), os.minor(rdev))
        assert st.tpgid == st.pgrp == leader.pid
        assert os.tcgetpgrp(master) == leader.pid
        leader.stdin.write(b"fork\n")
        leader.stdin.flush()
        kid = int(leader.stdout.readline())
        assert tty_nr(kid) == tty_nr(leader.pid)

        # From the background group (the kid's): SIGTTOU would stop it unblocked.
        with _injecting(kid) as remote:
            T.set_foreground_frozen(remote, slave, kid)
        assert procfs.read_stat(leader.pid).tpgid == kid
        assert procfs.read_stat(kid).state in ("S", "R")      # not stopped
        assert procfs.read_status(kid).sig_blk == 0          # its mask is put back
        assert procfs.read_status(kid).shd_pnd == 0          # and no SIGTTOU was sent

        # The terminal of another session: EPERM without stealing.
        other = subprocess.Popen([PY, "-c", "import os, time; os.setsid(); print(1, flush=True); "
                                  "time.sleep(30)"], pass_fds=[slave],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        try:
            other.stdout.readline()
            with _injecting(other.pid) as remote, pytest.raises(RemoteSyscallError) as err:
                T.make_controlling_tty_frozen(remote, slave)
            assert err.value.errno == 1        # EPERM
        finally:
            other.kill()
            other.wait()
    finally:
        if kid is not None:
            kill_pids([kid])
        leader.kill()
        leader.wait()
        leader.stdin.close()
        leader.stdout.close()
        _close(master, slave)
        if kid is not None:        # reparented to pytest (a subreaper) when the leader died
            wait_until(lambda: reap_orphans([kid]) or not os.path.exists(f"/proc/{kid}"), 5)


def _vt_after(t) -> list[str]:
    t.signal(signal.SIGUSR1)
    assert t.wait_exit(10) == 0, t.describe()
    return t.out_lines()[-1:]


def test_a_virtual_console_as_controlling_terminal_is_refused_at_dump(spawn, ptckpt, tmp_path):
    """A session leader whose controlling terminal is a virtual console it opened (through a
    node of its own), not a shell job's terminal: the restore could not make it a
    controlling terminal again (it reopened /dev/tty and failed), so the dump refuses it by
    name, and the program runs on with its console."""
    from ptckpt.errors import ExitCode
    from test_restore import _one_line
    t = spawn("vtholder.py", "ctty")
    assert "CTTY yes" in t.preamble
    res = ptckpt("dump", t.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {t.pid}", "fd 4", ".vt", "4:5",
              "controlling terminal", "O_NOCTTY")
    assert not (tmp_path / "img").exists()
    assert _vt_after(t) == ["RDEV 4:5"]


def test_a_virtual_console_opened_noctty_comes_back_by_its_node(spawn, ptckpt, tmp_path):
    """The same console opened O_NOCTTY is reopened through its node: the same device."""
    from conftest import wait_pid_free
    from test_restore import _restore
    t = spawn("vtholder.py", "noctty")
    assert "CTTY no" in t.preamble
    res = ptckpt("dump", t.pid, "-D", tmp_path / "img", "--kill")
    assert res.returncode == 0, res.stderr
    t.wait_exit(10)
    wait_pid_free(t.pid)
    _restore(ptckpt, tmp_path / "img")
    assert _vt_after(t) == ["RDEV 4:5"]
