"""Sanity tests of the fixture programs and of conftest's machinery.

No ptrace here: the fixtures must do what fixtures/README.md says on their
own, and their failure detection must fire, before any checkpoint test can
trust them.  Memory is poked through /proc/PID/mem, threads are stopped
with SIGSTOP, and /proc/PID/syscall tells where a stopped thread is.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import (EXIT_BADVALUE, TargetError, WaitTimeout, pid_alive, proc_stat,
                      reap_orphans, wait_pid_free, wait_until)

SYS_READ = 0
SYS_CLOCK_NANOSLEEP = 230     # glibc 2.36's nanosleep() uses clock_nanosleep


def poke_mem(pid: int, addr: int, data: bytes) -> None:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        mem.seek(addr)
        mem.write(data)


def peek_mem(pid: int, addr: int, size: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(addr)
        return mem.read(size)


def current_syscall(pid: int, tid: int | None = None) -> list[str]:
    """/proc/PID/syscall split: [nr, args...] in a syscall, ["-1", sp, pc]
    for a thread stopped in user mode, ["running"] otherwise."""
    path = f"/proc/{pid}/task/{tid}/syscall" if tid else f"/proc/{pid}/syscall"
    with open(path) as f:
        return f.read().split()


def in_syscall(pid: int, nr: int) -> bool:
    return current_syscall(pid)[0] == str(nr)


def stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while proc_stat(pid).state != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.005)


# --- the machinery ------------------------------------------------------------------

EXPECTED = {"appctl", "fdkinds", "files", "forkserver", "avx", "bigheap", "blocked_read", "counter", "filemap", "sleeper", "threads",
            "tcppair", "udpserver", "tcplisten", "netcount", "manyconn", "timers",
            "privs", "vmflags", "sharedfd", "deleted", "notify", "scribbler", "membarrier", "shmobjects",
            "stopsig", "pidfds", "ptypair", "campaigner", "pauser", "clocks", "churner", "ghostnodes"}


def test_every_fixture_compiles(fixture_bins):
    assert set(fixture_bins) == EXPECTED
    for path in fixture_bins.values():
        assert os.access(path, os.X_OK)


def test_ready_reports_own_pid_and_new_session(spawn):
    t = spawn("counter")
    assert proc_stat(t.pid).sid == t.pid       # start_new_session: pgid = sid = pid
    assert proc_stat(t.pid).pgid == t.pid
    assert set(t.symbols) == {"counter", "poke"}


def test_kill_frees_the_pid(spawn):
    t = spawn("counter")
    pid = t.pid
    t.kill()
    assert proc_stat(pid) is None
    assert not t.alive()
    assert t.wait_exit() == -signal.SIGKILL


def test_orphans_are_reparented_to_pytest_and_reaped():
    # sh starts a background sleep and exits: the sleep is orphaned, and
    # since pytest is a child subreaper it becomes pytest's child.
    out = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    orphan = int(out.stdout)
    try:
        assert proc_stat(orphan).ppid == os.getpid()
    finally:
        os.kill(orphan, signal.SIGKILL)
    wait_pid_free(orphan, timeout=5)
    assert proc_stat(orphan) is None


def test_reap_orphans_leaves_waiting_popen_alone():
    proc = subprocess.Popen(["sh", "-c", "exit 7"])
    deadline = time.monotonic() + 5
    while proc_stat(proc.pid).state != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert proc.pid not in reap_orphans()
    assert proc.wait() == 7


def test_wait_until_times_out():
    with pytest.raises(WaitTimeout, match="nothing"):
        wait_until(lambda: False, timeout=0.05, message="nothing")


def test_missing_ready_is_reported(spawn):
    with pytest.raises(TargetError, match="exited with 2 before READY"):
        spawn("counter", "not-a-number")


# --- counter, counter.py -----------------------------------------------------------

@pytest.mark.parametrize("program", ["counter", "counter.py"])
def test_counter_keeps_counting(spawn, program):
    t = spawn(program)
    before, after = t.wait_progress(timeout=5)
    assert after[0] >= before[0] + 10
    t.assert_ok()


def test_counter_symbol_is_the_counter(spawn):
    t = spawn("counter")
    addr = t.symbols["counter"]
    first = int.from_bytes(peek_mem(t.pid, addr, 8), "little")
    time.sleep(0.1)
    second = int.from_bytes(peek_mem(t.pid, addr, 8), "little")
    assert second > first
    # poke: the counter continues from the value written there
    poke_mem(t.pid, t.symbols["poke"], (10**6).to_bytes(8, "little"))
    t.wait_for_line(r"^\d{20}$", where="out")
    assert wait_until(lambda: t.read_counter() >= 10**6, timeout=5)
    t.assert_ok()


def test_counter_detects_changed_memory(spawn):
    t = spawn("counter", 10, 200000)       # 200 ms steps: the write lands in a sleep
    poke_mem(t.pid, t.symbols["counter"], (12345).to_bytes(8, "little"))
    assert t.wait_exit(timeout=5) == EXIT_BADVALUE
    assert "BAD counter" in t.stderr_text()
    assert t.out_text().startswith("FAIL BAD counter")
    with pytest.raises(TargetError, match="FAIL BAD counter"):
        t.read_counter()


# --- threads -----------------------------------------------------------------------

def test_threads_count_each(spawn):
    t = spawn("threads")
    assert len(t.tids) == 4 and len(set(t.tids)) == 4
    tasks = {int(x) for x in os.listdir(f"/proc/{t.pid}/task")}
    assert tasks == {t.pid, *t.tids}
    before, after = t.wait_progress(timeout=5)
    assert len(after) == 4
    counters = peek_mem(t.pid, t.symbols["counters"], 32)
    values = [int.from_bytes(counters[i:i + 8], "little") for i in range(0, 32, 8)]
    assert all(v >= a for v, a in zip(values, after))


# --- blocked_read ----------------------------------------------------------------

@pytest.mark.parametrize("stdin", ["pipe", "fifo"])
def test_blocked_read_echoes_lines(spawn, stdin):
    t = spawn("blocked_read", stdin=stdin)
    wait_until(lambda: in_syscall(t.pid, SYS_READ), timeout=5)
    t.send_line("hello")
    t.wait_for_line("^GOT hello$")
    t.send("wor")
    time.sleep(0.05)
    t.send("ld\n")
    t.wait_for_line("^GOT world$")
    assert t.out_lines() == ["GOT hello", "GOT world"]
    assert int.from_bytes(peek_mem(t.pid, t.symbols["lines"], 8), "little") == 2
    t.close_stdin()
    t.wait_for_line("^EOF$")
    assert t.wait_exit() == 0
    assert t.failure() is None


def test_blocked_read_detects_garbage(spawn):
    t = spawn("blocked_read", stdin="pipe")
    t.send(b"ok\nb\x00d\n")
    assert t.wait_exit(timeout=5) == EXIT_BADVALUE
    assert t.stdout_lines()[-1] == "GOT ok"
    assert "BAD byte 0x00 at line 2" in t.stderr_text()


# --- sleeper -----------------------------------------------------------------------

def test_sleeper_wakes_after_its_time(spawn):
    t = spawn("sleeper", 1.0)
    started = time.monotonic()
    wait_until(lambda: in_syscall(t.pid, SYS_CLOCK_NANOSLEEP), timeout=5)
    m = t.wait_for_line(r"^ELAPSED 1 (\S+)$", timeout=10)
    assert 1.0 <= float(m.group(1)) < 2.0
    assert time.monotonic() - started >= 0.9
    t.wait_for_line("^WOKE 1$")
    assert t.wait_exit() == 0
    assert t.out_lines()[-1] == "WOKE 1"


# --- bigheap --------------------------------------------------------------------------

def test_bigheap_checksum_stable(spawn):
    t = spawn("bigheap", 64)
    first = t.preamble[-1]
    assert re.fullmatch(r"CHECKSUM 0 0x[0-9a-f]{16} MIB 64", first)
    for n in (1, 2):
        t.signal(signal.SIGUSR1)
        m = t.wait_for_line(rf"^CHECKSUM {n} (\S+) MIB 64$")
        assert m.group(1) == first.split()[2]
        t.wait_for_line(rf"^VERIFY {n} OK$")
    assert t.out_lines()[0] == first
    t.assert_ok()


def test_bigheap_detects_a_changed_word(spawn):
    t = spawn("bigheap", 16)
    addr = t.symbols["heap"] + 5 * 4096 + 8
    word = peek_mem(t.pid, addr, 8)
    poke_mem(t.pid, addr, bytes(b ^ 0xFF for b in word))
    t.signal(signal.SIGUSR1)
    assert t.wait_exit(timeout=10) == EXIT_BADVALUE
    assert "BAD heap word at offset 0x5008 (page 5)" in t.stderr_text()


# --- filemap ---------------------------------------------------------------------------

def test_filemap_mappings_verify(spawn, tmp_path):
    priv, shared = tmp_path / "priv.dat", tmp_path / "shared.dat"
    t = spawn("filemap", priv, shared, 8)
    maps = open(f"/proc/{t.pid}/maps").read()
    assert re.search(rf"rw-p 00000000 \S+ \d+ +{re.escape(str(priv))}$", maps, re.M)
    assert re.search(rf"rw-s 00000000 \S+ \d+ +{re.escape(str(shared))}$", maps, re.M)
    # the fixture closed its fds: only the mappings refer to the files
    fds = {os.readlink(f"/proc/{t.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{t.pid}/fd")}
    assert str(priv) not in fds and str(shared) not in fds
    first = t.preamble[-1].split()
    for n in (1, 2):
        t.signal(signal.SIGUSR1)
        m = t.wait_for_line(rf"^CHECKSUM {n} private (\S+) shared (\S+)$")
        assert (m.group(1), m.group(2)) == (first[3], first[5])
        t.wait_for_line(rf"^VERIFY {n} OK$")
        # the report counter went through the shared mapping into the file
        data = shared.read_bytes()
        assert int.from_bytes(data[7 * 4096:7 * 4096 + 8], "little") == n
    t.assert_ok()


def test_filemap_detects_a_changed_private_page(spawn, tmp_path):
    t = spawn("filemap", tmp_path / "p.dat", tmp_path / "s.dat")
    poke_mem(t.pid, t.symbols["private"] + 3 * 4096, b"\0" * 8)
    t.signal(signal.SIGUSR1)
    assert t.wait_exit(timeout=10) == EXIT_BADVALUE
    assert "BAD private page 3 (clean file page)" in t.stderr_text()


# --- avx ---------------------------------------------------------------------------------

def _avx_mode_or_skip(mode: str, cpu_has) -> None:
    if not cpu_has("avx"):
        pytest.skip("the CPU has no AVX")
    if mode == "zmm" and not (cpu_has("avx512f") and cpu_has("avx512bw")):
        pytest.skip("the CPU has no AVX-512F/BW")


@pytest.mark.parametrize("mode", ["ymm", "zmm"])
def test_avx_reports_ok(spawn, cpu_has, mode):
    _avx_mode_or_skip(mode, cpu_has)
    t = spawn("avx", mode)
    assert t.out_text().startswith("AVX OK ")
    t.wait_progress(timeout=10)
    assert {"want", "got", "spin_begin", "spin_end", "checks"} <= set(t.symbols)
    t.assert_ok()


@pytest.mark.parametrize("mode", ["ymm", "zmm"])
def test_avx_detects_a_changed_register(spawn, cpu_has, mode):
    """Stop the thread inside the spin, change the expected pattern of one
    register lane behind its back: the next compare must report it."""
    _avx_mode_or_skip(mode, cpu_has)
    t = spawn("avx", mode)
    lane = t.symbols["want"] + (5 * 8 + 3) * 8        # vec[5][3]
    for _ in range(50):
        stop(t.pid)
        where = current_syscall(t.pid)
        if where[0] == "-1" and t.symbols["spin_begin"] <= int(where[2], 16) < t.symbols["spin_end"]:
            poke_mem(t.pid, lane, (0x1234).to_bytes(8, "little"))
            os.kill(t.pid, signal.SIGCONT)
            break
        os.kill(t.pid, signal.SIGCONT)
        time.sleep(0.01)
    else:
        pytest.fail("the avx thread was never stopped inside its spin")
    assert t.wait_exit(timeout=10) == EXIT_BADVALUE
    assert f"AVX BAD {mode}5 lane 3: 0xa5a5000600045a5a expected 0x0000000000001234" \
        in t.stderr_text()
    assert t.out_text().startswith("FAIL AVX BAD")


# --- robustness: a stop and continue is not a failure ---------------------------------------

@pytest.mark.parametrize("program,args,kw", [
    ("counter", (), {}),
    ("counter.py", (), {}),
    ("threads", (), {}),
    ("blocked_read", (), {"stdin": "pipe"}),
    ("sleeper", (1.0,), {}),
    ("bigheap", (8,), {}),
    ("filemap", ("p.dat", "s.dat"), {}),
    ("avx", (), {}),
])
def test_fixtures_survive_sigstop(spawn, cpu_has, program, args, kw):
    """Job-control stops interrupt nanosleep and read the way a ptrace stop does
    (the kernel restarts them): no fixture may take that for a failure."""
    if program == "avx":
        _avx_mode_or_skip("ymm", cpu_has)
    t = spawn(program, *args, **kw)
    for _ in range(5):
        stop(t.pid)
        time.sleep(0.02)
        os.kill(t.pid, signal.SIGCONT)
        time.sleep(0.02)
    if program in ("counter", "counter.py", "threads", "avx"):
        t.wait_progress(timeout=5)
    elif program == "blocked_read":
        t.send_line("still here")
        t.wait_for_line("^GOT still here$")
    elif program == "sleeper":
        t.wait_for_line("^WOKE 1$", timeout=10)
    else:
        t.signal(signal.SIGUSR1)
        t.wait_for_line("^VERIFY 1 OK$")
    t.assert_ok()
    assert t.alive() or t.wait_exit() == 0


def test_python_counter_runs_this_interpreter(spawn):
    t = spawn("counter.py")
    assert os.readlink(f"/proc/{t.pid}/exe") == os.path.realpath(sys.executable)
    assert pid_alive(t.pid)


# --- the CLI runner -------------------------------------------------------------------------

def test_ptckpt_runner_runs_the_installed_cli(ptckpt):
    returncode, stdout, stderr = ptckpt("--help")
    assert returncode == 0, stderr
    assert "dump" in stdout


def test_ptckpt_runner_reports_failure_exit(ptckpt):
    result = ptckpt("no-such-command")
    assert result.returncode != 0
    assert result.stderr
