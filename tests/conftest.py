"""Shared test machinery: compiled fixtures, spawned targets, the CLI runner.

Fixtures (pytest) defined here:
  fixture_bins   session: fixture name -> compiled executable (skips without gcc)
  spawn          spawn(program, *args, ...) -> Target; kills and reaps at teardown
  ptckpt_cmd     session: argv prefix that runs the installed CLI
  ptckpt         ptckpt(*args, ...) -> CliResult(returncode, stdout, stderr)
  wait_until, read_counter, reap_orphans, wait_pid_free, cpu_has
                 the module-level helpers of the same names, as fixtures

A test that runs a program from a Debian package (nft, tmux, gdb ...) says so with
needs("nft") (a mark) or require("nft") (inside a test or fixture): without it the test
is skipped, the reason naming the package and tests/install-debian-packages.sh.

The pytest process makes itself a child subreaper (PR_SET_CHILD_SUBREAPER) at
start-up, so every process a test creates - restored ones included, whatever
their parent was - stays a descendant of pytest and can be reaped here
(docs: DESIGN.md, "PID 1 ... reaps orphaned processes lazily").  Nothing is
reaped behind the back of a subprocess.Popen object that is still waiting.

Fixture programs and their outputs are described in fixtures/README.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import proccheck

ROOT = Path(__file__).resolve().parent.parent
FIXTURES_DIR = ROOT / "fixtures"

# Exit codes of the fixtures (fixtures/fixture.h).
EXIT_USAGE = 2
EXIT_EINTR = 3
EXIT_BADVALUE = 4
EXIT_SYSCALL = 5
EXIT_NOCPU = 77

PR_SET_CHILD_SUBREAPER = 36


def _load_build_module():
    spec = importlib.util.spec_from_file_location("ptckpt_fixture_build",
                                                  FIXTURES_DIR / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fixture_build = _load_build_module()


# --- waiting -----------------------------------------------------------------

class WaitTimeout(AssertionError):
    """wait_until ran out of time (an AssertionError, so pytest shows a failure)."""


def wait_until(predicate: Callable[[], Any], timeout: float = 10.0,
               interval: float = 0.01, message: str | Callable[[], str] | None = None) -> Any:
    """Call predicate until it returns something truthy; return that value.

    Raises WaitTimeout after `timeout` seconds; `message` (a string, or a
    callable returning one, evaluated only on failure) says what was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = message() if callable(message) else message
            raise WaitTimeout(f"timed out after {timeout:g} s: "
                              f"{text or getattr(predicate, '__name__', repr(predicate))}")
        time.sleep(interval)
        interval = min(interval * 1.5, 0.1)


# --- the process table, zombies and orphans ---------------------------------

class ProcStat(NamedTuple):
    """The /proc/PID/stat fields this file needs (man 5 proc: fields 3-6)."""
    state: str
    ppid: int
    pgid: int
    sid: int


def proc_stat(pid: int) -> ProcStat | None:
    """Fields of /proc/PID/stat, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rindex(")") + 2:].split()
    return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[3]))


def process_table() -> dict[int, ProcStat]:
    """pid -> ProcStat for every process (thread group) on the machine."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_stat(int(entry))
            if st is not None:
                table[int(entry)] = st
    return table


def descendants(root: int | None = None,
                table: dict[int, ProcStat] | None = None) -> set[int]:
    """Pids of all descendants of root (default: this pytest process)."""
    root = os.getpid() if root is None else root
    table = process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, st in table.items():
        children.setdefault(st.ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    """True if pid is a process that is not (yet) a zombie."""
    st = proc_stat(pid)
    return st is not None and st.state not in ("Z", "X")


# Exit statuses (os.waitpid form) of children reaped by reap_orphans, so that
# Target.wait_exit can still report how a restored process ended.
_reaped_status: dict[int, int] = {}


def _waiting_popen_pids() -> set[int]:
    """Pids of live subprocess.Popen objects that have not collected their child.

    Reaping one of those would make its wait() see ECHILD and report exit
    status 0, hiding a failure; they are left to their Popen.
    """
    pids = set()
    for obj in gc.get_objects():
        if isinstance(obj, subprocess.Popen) and obj.returncode is None:
            pids.add(obj.pid)
    return pids


def reap_orphans(pids: Iterable[int] | None = None) -> dict[int, int]:
    """Reap zombie children of this process that no Popen object waits for.

    With `pids`, only those.  Orphans reparented to pytest (it is a child
    subreaper) land here: a restored process whose restorer exited, the
    children of a killed fixture.  Returns {pid: wait status} reaped now; the
    statuses are also kept for Target.wait_exit.
    """
    me = os.getpid()
    if pids is None:
        candidates = [pid for pid, st in process_table().items()
                      if st.ppid == me and st.state in ("Z", "X")]
    else:
        candidates = list(pids)
    if not candidates:
        return {}
    skip = _waiting_popen_pids()
    reaped = {}
    for pid in candidates:
        if pid in skip:
            continue
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got:
            reaped[got] = status
            _reaped_status[got] = status
    return reaped


def wait_pid_free(pid: int, timeout: float = 10.0) -> None:
    """Wait until no process (not even a zombie) holds pid, reaping it if ours.

    Use before restoring a process at its old pid.  A zombie that belongs to
    another parent is waited for, not reaped.
    """
    def free() -> bool:
        st = proc_stat(pid)
        if st is None:
            return True
        if st.state in ("Z", "X") and st.ppid == os.getpid():
            reap_orphans([pid])
        return proc_stat(pid) is None

    wait_until(free, timeout, message=lambda: f"pid {pid} still taken: {proc_stat(pid)}")


def kill_process_groups(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILL each Popen's process group (it was started with start_new_session) and wait for it."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def kill_pids(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send sig to each pid, ignoring the ones already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        warnings.warn(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")


def _compile_sources() -> None:
    """Byte-compile the project's sources once, so that each `ptckpt` command a test runs
    loads them instead of compiling them again: an editable install (README's) leaves them
    uncompiled, and with PYTHONDONTWRITEBYTECODE set no command would write them (about
    0.2 s a command here); the same for the methods of its dataclasses (~40 ms)."""
    import compileall
    for name in ("ptckpt", "formats", "restorer", "examples"):
        if (ROOT / name).is_dir():
            compileall.compile_dir(ROOT / name, quiet=1)
    # and the dataclasses' methods the commands would compile at each start (ptckpt.codecache)
    subprocess.run([sys.executable, "-m", "ptckpt.codecache"], check=False)


def pytest_configure(config: pytest.Config) -> None:
    _compile_sources()
    config.addinivalue_line("markers", "proc_differs(*views, reason): the restored process may differ from "
                                       "the dumped one in these /proc views (tests/proccheck.py)")
    _become_subreaper()


def pytest_assertrepr_compare(config: pytest.Config, op: str, left: object, right: object) -> list[str] | None:
    """Long byte strings that differ, told in a few lines: their lengths, where they first
    differ and the bytes around it, instead of pytest's full diff (which on CI, where it is
    not truncated, runs to thousands of lines and pushes the test's name out of the log)."""
    kinds = (bytes, bytearray, memoryview)
    if op != "==" or not isinstance(left, kinds) or not isinstance(right, kinds):
        return None
    a, b = bytes(left), bytes(right)
    if max(len(a), len(b)) <= 64:
        return None
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    at = max(0, first - 8)
    ndiff = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    return [f"{len(a)} bytes == {len(b)} bytes: {ndiff} differ, the first at offset {first:#x}",
            f"left  [{at:#x}:] {a[at:at + 32].hex(' ')}",
            f"right [{at:#x}:] {b[at:at + 32].hex(' ')}",
            f"left has {len(a) - a.count(0)} non-zero bytes, right {len(b) - b.count(0)}"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Kill and reap whatever a test left behind (spawn cleans up its own)."""
    def leftovers() -> list[int]:
        reap_orphans()
        return [pid for pid in descendants() - _waiting_popen_pids() if pid_alive(pid)]

    alive = leftovers()
    if alive:
        # Too late for the warnings summary: say it on stderr.
        print(f"\nconftest: killing processes the tests left behind: {sorted(alive)}",
              file=sys.stderr)
        kill_pids(alive)
        try:
            wait_until(lambda: not leftovers(), timeout=5.0)
        except WaitTimeout:
            pass
    reap_orphans()


@contextlib.contextmanager
def limited_cgroup(controller: str, setting: str, value: str):
    """A cgroup of the tests' own with one limit (cgroup v1's `controller` hierarchy, or a
    v2 hierarchy at /sys/fs/cgroup that has the controller); yields a command prefix that
    runs a command inside it.  Removed at the end, its processes killed first."""
    v1 = Path("/sys/fs/cgroup") / controller
    v2 = Path("/sys/fs/cgroup")
    if (v1 / "cgroup.procs").exists():
        base, name = v1, {"pids.max": "pids.max", "memory.max": "memory.limit_in_bytes"}[setting]
    elif controller in (v2 / "cgroup.subtree_control").read_text().split() if (v2 / "cgroup.subtree_control").exists() else ():
        base, name = v2, setting
    else:
        pytest.skip(f"no {controller} cgroup controller to limit a restore with")
    group = Path(tempfile.mkdtemp(prefix="ptckpt-test-", dir=base))
    try:
        (group / name).write_text(value)
        yield ["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh"]
    finally:
        for _ in range(100):
            pids = (group / "cgroup.procs").read_text().split()
            if not pids:
                break
            kill_pids(int(p) for p in pids)
            time.sleep(0.05)
        group.rmdir()


# --- sizes of the randomised robustness tests ------------------------------------

def trials(default: int) -> int:
    """How many times a randomised robustness test tries (dumps or restores interrupted at
    random moments): `default`, the size that fits CI, or $PTCKPT_TRIALS (bench/interrupts
    runs them at full size)."""
    return int(os.environ.get("PTCKPT_TRIALS") or default)


# --- CPU features --------------------------------------------------------------

def cpu_has(flag: str) -> bool:
    """True if /proc/cpuinfo lists flag (e.g. "avx2", "avx512f")."""
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith("flags"):
                return flag in line.split(":", 1)[1].split()
    return False


# --- programs from Debian packages ------------------------------------------------

INSTALL_SCRIPT = "tests/install-debian-packages.sh"

# The programs tests run, and the Debian package of each (the script above installs them
# all; README, "Test").
TOOL_PACKAGES = {
    "gcc": "gcc", "readelf": "binutils",
    "nft": "nftables",
    "tmux": "tmux", "vim": "vim", "less": "less", "top": "procps", "ps": "procps",
    "redis-server": "redis-server",
    "gdb": "gdb",
    "setpriv": "util-linux", "ipcrm": "util-linux", "nsenter": "util-linux",
    "unshare": "util-linux", "prlimit": "util-linux",
    "ip": "iproute2", "ss": "iproute2",
    "mpicc": "libmpich-dev", "mpiexec": "mpich",
    "iverilog": "iverilog", "vvp": "iverilog",
}


def tool(name: str) -> str | None:
    """The path of program `name` on PATH (or in /usr/sbin, /sbin, where Debian puts nft and
    ip and a non-root PATH may not look), or None."""
    path = os.environ.get("PATH") or os.defpath
    return shutil.which(name, path=path + os.pathsep + "/usr/sbin:/sbin")


def missing(*tools: str) -> str | None:
    """None when every program in `tools` is here, else the reason to skip: which are
    missing, their Debian packages and the script that installs them."""
    absent = [t for t in tools if tool(t) is None]
    if not absent:
        return None
    packages = sorted({TOOL_PACKAGES.get(t, t) for t in absent})
    return (f"needs {', '.join(absent)} (Debian's {', '.join(packages)}): "
            f"{INSTALL_SCRIPT} installs {'it' if len(packages) == 1 else 'them'}")


def needs(*tools: str) -> pytest.MarkDecorator:
    """A mark skipping a test (or, as `pytestmark`, a module) when a program is missing:
    ``@needs("tmux", "vim")``."""
    reason = missing(*tools)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def needs_network_lock() -> pytest.MarkDecorator:
    """needs("nft"), and a kernel that takes ptckpt's network lock (ptckpt.netlock.available()):
    the mark of a test that dumps with --tcp-established."""
    reason = missing("nft")
    if reason is None:
        from ptckpt import netlock
        why = netlock.available()
        reason = f"no network lock here: {why}" if why else None
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def require(*tools: str) -> None:
    """Skip the running test (or fixture) when a program is missing."""
    reason = missing(*tools)
    if reason is not None:
        pytest.skip(reason)


# --- compiled fixtures -------------------------------------------------------------

@pytest.fixture(scope="session")
def fixture_bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Compile every fixtures/*.c once per session: name -> executable path."""
    if fixture_build.find_cc() is None:
        pytest.skip("needs gcc (Debian's gcc, libc6-dev) to compile the C fixtures in "
                    f"fixtures/*.c: {INSTALL_SCRIPT} installs them")
    outdir = tmp_path_factory.mktemp("fixture-bins")
    try:
        return fixture_build.compile_all(outdir)
    except fixture_build.CompileError as err:
        pytest.fail(str(err), pytrace=False)


X86_64_ONLY = ("avx",)            # fixtures that are x86_64 programs by nature


@pytest.fixture(scope="session")
def fixture_bins32(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The C fixtures built with ``gcc -m32`` (32-bit, ia32 programs) once per session, but
    those of X86_64_ONLY: name -> executable path.  Skips where gcc cannot build 32-bit
    programs (Debian's gcc-multilib: the install script installs it)."""
    if fixture_build.find_cc() is None:
        pytest.skip("needs gcc to compile the C fixtures")
    outdir = tmp_path_factory.mktemp("fixture-bins32")
    names = [n for n in fixture_build.sources() if n not in X86_64_ONLY]
    try:
        return fixture_build.compile_all(outdir, names, extra=("-m32",))
    except fixture_build.CompileError as err:
        if "-m32" in err.output or "gnu/stubs-32.h" in err.output or "cannot find" in err.output:
            pytest.skip(f"needs gcc -m32 (Debian's gcc-multilib): {INSTALL_SCRIPT} installs it")
        pytest.fail(str(err), pytrace=False)


# --- spawned targets -------------------------------------------------------------

class TargetError(AssertionError):
    """A spawned fixture failed to start, reported a failure or misbehaved."""


_LINE_READY = re.compile(r"^READY (\d+)$")
_LINE_SYM = re.compile(r"^SYM (\S+) 0x([0-9a-fA-F]+)$")
_LINE_TID = re.compile(r"^TID (\d+) (\d+)$")


def _complete_lines(path: Path) -> list[str]:
    """The lines of a file that end in a newline (a line being written is left out)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    return data.decode(errors="replace").split("\n")[:-1]


def _tail(path: Path | None, limit: int = 2000) -> str:
    if path is None:
        return "(none)"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return "(missing)"
    text = data[-limit:].decode(errors="replace")
    return text if text else "(empty)"


def read_counter(path: Path | str, timeout: float = 2.0) -> int:
    """The fixed-width integer a counter fixture keeps at the start of its file.

    Reads until two reads agree (a read can race the fixture's pwrite).
    Raises TargetError if the fixture replaced it with a "FAIL ..." line.
    """
    return read_numbers(path, timeout)[0]


def read_numbers(path: Path | str, timeout: float = 2.0) -> tuple[int, ...]:
    """All integers on the first line of a state file (counter: 1, threads: 4,
    avx: 1), read consistently.  Raises TargetError on "FAIL ..." content."""
    path = Path(path)

    def once() -> tuple[int, ...] | None:
        try:
            text = path.read_text(errors="replace")
        except FileNotFoundError:
            return None
        if text.startswith("FAIL"):
            raise TargetError(f"{path.name}: {text.strip()}")
        line, newline, _ = text.partition("\n")
        if not newline:
            return None
        numbers = tuple(int(n) for n in re.findall(r"\b\d+\b", line))
        return numbers or None

    def agreed():
        first = once()
        return first if first is not None and once() == first else None

    return wait_until(agreed, timeout, interval=0.002,
                      message=f"no complete state line in {path}")


class Target:
    """One fixture process started by `spawn` (see the attributes below).

    The handle outlives the process.  The typical restore test:

        t = spawn("counter"); ptckpt("dump", t.pid, "-D", img)
        t.kill()                      # SIGKILL, reap, wait until the pid is free
        ptckpt("restore", "-D", img, "--detach")
        t.wait_progress(); t.assert_ok()

    A process found at t.pid after the previous one ended is a new
    "incarnation": poll() / wait_exit() / failure() then speak of it (it is
    pytest's child through the subreaper, so its status is still seen).  A
    restored copy at another pid is attached with adopt(pid).  `spawn`'s
    teardown SIGKILLs every pid the handle knew, and everything in their
    process groups / sessions that descends from pytest, then reaps.
    """

    def __init__(self, name: str, argv: list[str], popen: subprocess.Popen,
                 workdir: Path, out_path: Path | None, stdout_path: Path,
                 stderr_path: Path, stdin_file: Any | None, fifo_path: Path | None):
        self.name = name
        self.argv = argv
        self.popen = popen
        self.pid: int = popen.pid
        self.workdir = workdir
        self.out_path = out_path          # argv[1] of the fixture, or None
        self.stdout_path = stdout_path
        self.stderr_path = stderr_path
        self.fifo_path = fifo_path        # stdin FIFO (stdin="fifo")
        self.stdin = stdin_file           # our writing end (stdin="pipe"/"fifo")
        self.preamble: list[str] = []     # stdout lines before READY
        self.symbols: dict[str, int] = {} # "SYM name 0x..." lines
        self.tids: list[int] = []         # "TID i tid" lines, by i
        self._pids = {self.pid}           # cleaned up at teardown
        # The process at self.pid is an "incarnation": first the one Popen
        # started, later maybe a restored one (same pid, or adopted).  Only
        # the first is waited for through Popen; the others by pid.
        self._by_popen = True             # how to wait for the current one
        self._ended = False               # the current one has ended ...
        self._returncode: int | None = None   # ... with this status

    def __repr__(self) -> str:
        return f"<Target {self.name} pid={self.pid}>"

    # -- output -----------------------------------------------------------
    def stdout_lines(self) -> list[str]:
        return _complete_lines(self.stdout_path)

    def stdout_text(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def out_lines(self) -> list[str]:
        """Complete lines of the output file (argv[1])."""
        return _complete_lines(self._need_out())

    def out_text(self) -> str:
        return self._need_out().read_text(errors="replace")

    def read_counter(self, timeout: float = 2.0) -> int:
        """The integer of a counter-style state file (counter, counter.py, avx)."""
        return read_counter(self._need_out(), timeout)

    def read_counters(self, timeout: float = 2.0) -> tuple[int, ...]:
        """All integers of the state file's line (threads: counters[0..3])."""
        return read_numbers(self._need_out(), timeout)

    def wait_for_line(self, pattern: str, *, where: str = "stdout", count: int = 1,
                      timeout: float = 10.0) -> re.Match:
        """Wait for the count-th complete line matching regex pattern (re.search)
        in "stdout" or "out" (the output file); return its match.

        Fails early, with the fixture's output, if the process dies first.
        """
        rx = re.compile(pattern)
        lines = self.stdout_lines if where == "stdout" else self.out_lines

        def found():
            matches = [m for m in map(rx.search, lines()) if m]
            if len(matches) >= count:
                return matches[count - 1]
            if not self.alive():
                # One last look: the line may have been written just before exit.
                matches = [m for m in map(rx.search, lines()) if m]
                if len(matches) >= count:
                    return matches[count - 1]
                raise TargetError(f"{self.name} ended before line {pattern!r} "
                                  f"#{count} appeared\n{self.describe()}")
            return None

        return wait_until(found, timeout,
                          message=lambda: f"line {pattern!r} #{count} in {where} "
                                          f"of {self.name}\n{self.describe()}")

    def wait_progress(self, timeout: float = 10.0) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Wait until every number in the state file grew; return (before, after).

        The "it keeps running" check for counter, counter.py, threads and avx.
        """
        before = self.read_counters()

        def grown():
            self.assert_ok()
            now = self.read_counters()
            return now if all(b > a for a, b in zip(before, now)) else None

        after = wait_until(grown, timeout,
                           message=lambda: f"{self.name} made no progress from "
                                           f"{before}\n{self.describe()}")
        return before, after

    def failure(self) -> str | None:
        """What the fixture reported as failing ("FAIL ..." in the output file,
        text on stderr, an exit status), or None."""
        problems = []
        if self.out_path is not None:
            for line in _complete_lines(self.out_path):
                if line.startswith("FAIL "):
                    problems.append(line)
        err = self.stderr_text().strip() if self.stderr_path.exists() else ""
        if err:
            problems.append(f"stderr: {err}")
        if self.poll() and self._returncode not in (None, 0):
            problems.append(f"exit status {self._returncode}")
        return "; ".join(problems) if problems else None

    def assert_ok(self) -> None:
        """Raise TargetError if the fixture reported a failure."""
        problem = self.failure()
        if problem:
            raise TargetError(f"{self.name} (pid {self.pid}) failed: {problem}\n"
                              f"{self.describe()}")

    def describe(self) -> str:
        """A diagnostic block: argv, state, and the tails of every output."""
        st = proc_stat(self.pid)
        return (f"--- target {self.name} pid {self.pid}: {' '.join(self.argv)}\n"
                f"state: {st.state if st else 'gone'}, returncode: {self._returncode}\n"
                f"--- stdout:\n{_tail(self.stdout_path)}\n"
                f"--- stderr:\n{_tail(self.stderr_path)}\n"
                f"--- output file:\n{_tail(self.out_path)}")

    def _need_out(self) -> Path:
        if self.out_path is None:
            raise TypeError(f"{self.name} was spawned without an output file")
        return self.out_path

    # -- input and signals ------------------------------------------------------
    def send(self, data: str | bytes) -> None:
        """Write to the fixture's stdin (spawned with stdin="pipe" or "fifo")."""
        if self.stdin is None:
            raise TypeError(f"{self.name} was spawned without a stdin pipe")
        self.stdin.write(data.encode() if isinstance(data, str) else data)
        self.stdin.flush()

    def send_line(self, line: str) -> None:
        self.send(line + "\n")

    def close_stdin(self) -> None:
        if self.stdin is not None:
            self.stdin.close()
            self.stdin = None

    def signal(self, sig: int = signal.SIGUSR1) -> None:
        os.kill(self.pid, sig)

    # -- life and death -------------------------------------------------------------
    def alive(self) -> bool:
        """True while the process with our pid runs (not a zombie)."""
        return pid_alive(self.pid)

    def adopt(self, pid: int) -> None:
        """Make pid (e.g. a restored copy with another pid) this target's process:
        it is cleaned up at teardown and pid / alive() / wait_exit() refer to it."""
        self._pids.add(pid)
        self.pid = pid
        self._new_incarnation()

    def _new_incarnation(self, forget_status: bool = True) -> None:
        self._by_popen = False
        self._ended = False
        self._returncode = None
        if forget_status:
            _reaped_status.pop(self.pid, None)

    def _end(self, returncode: int | None) -> None:
        self._ended = True
        self._returncode = returncode

    def poll(self) -> bool:
        """True if the current incarnation has ended (status: .returncode).

        A process running at our pid after the last one ended (a restore at
        the same pid) is taken as a new incarnation.  Never blocks; reaps the
        process if it is pytest's zombie child."""
        if self._ended:
            # The ended one no longer holds the pid (it was reaped): whatever
            # is there now, running or a zombie, or was reaped since, is new.
            if proc_stat(self.pid) is None and self.pid not in _reaped_status:
                return True
            self._new_incarnation(forget_status=False)
        if self._by_popen:
            if self.popen.poll() is None:
                return False
            self._end(self.popen.returncode)
            return True
        st = proc_stat(self.pid)
        if st is not None and st.state in ("Z", "X") and st.ppid == os.getpid():
            reap_orphans([self.pid])
            st = proc_stat(self.pid)
        if self.pid in _reaped_status:
            self._end(os.waitstatus_to_exitcode(_reaped_status.pop(self.pid)))
            return True
        if st is None:                 # gone, reaped by someone else: no status
            self._end(None)
            return True
        return False

    @property
    def returncode(self) -> int | None:
        """Popen-style status of the current incarnation, once poll() saw it end."""
        return self._returncode if self._ended else None

    def wait_exit(self, timeout: float = 10.0) -> int | None:
        """Wait for the current incarnation to end; return its status like
        Popen.returncode (negative: killed by that signal), or None when
        another process reaped it."""
        if not self.poll() and self._by_popen:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TargetError(f"{self.name} still running after {timeout:g} s\n"
                                  f"{self.describe()}") from None
        wait_until(self.poll, timeout,
                   message=lambda: f"{self.name} to exit\n{self.describe()}")
        return self._returncode

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL the process (group) now, reap it, and wait until its pid is
        free (e.g. to restore it there).  wait_exit() then gives its status."""
        self._kill_and_reap(timeout)
        wait_pid_free(self.pid, timeout)
        self.poll()

    def _victims(self) -> set[int]:
        """Our descendants that are this target's processes or share its
        process group / session (pgid = sid = pid: start_new_session)."""
        table = process_table()
        mine = descendants(table=table)
        return {pid for pid in mine
                if pid in self._pids or table[pid].pgid in self._pids
                or table[pid].sid in self._pids}

    def _kill_and_reap(self, timeout: float) -> None:
        victims = self._victims()
        kill_pids(victims)

        def done() -> bool:
            self.poll()                   # the current incarnation, first
            if self.popen.returncode is None:
                self.popen.poll()
            reap_orphans(victims)
            return not any(pid_alive(p) for p in victims) and \
                self.popen.returncode is not None

        try:
            wait_until(done, timeout, message=lambda: f"{self.name} to die\n{self.describe()}")
        except WaitTimeout as err:
            warnings.warn(str(err))

    def cleanup(self) -> None:
        """The teardown: never raises, always kills and reaps, and removes the POSIX message
        queue a fixture announced ("MQ /name": fdkinds), which outlives it otherwise and
        would be opened again, messages and all, by a later fixture given the same pid."""
        try:
            self.close_stdin()
        except OSError:
            pass
        self._kill_and_reap(10.0)
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if f is not None:
                f.close()
        for line in self.preamble:
            if line.startswith("MQ /"):
                ctypes.CDLL(None).mq_unlink(line.split()[1].encode())


def _resolve_program(program: str, request: pytest.FixtureRequest) -> tuple[str, list[str]]:
    """Fixture name or path -> (name, argv prefix)."""
    if program.endswith(".py"):
        path = Path(program) if os.sep in program else FIXTURES_DIR / program
        if not path.exists():
            raise FileNotFoundError(f"no such Python fixture: {path}")
        return path.name, [sys.executable, str(path)]
    if os.sep in program:
        return Path(program).name, [program]
    bins = request.getfixturevalue("fixture_bins")
    if program not in bins:
        raise KeyError(f"no such fixture: {program!r} (have: {', '.join(sorted(bins))})")
    return program, [str(bins[program])]


@pytest.fixture
def spawn(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Target]:
    """Start fixture programs; every one is killed and reaped at teardown.

    spawn(program, *args, out=True, stdin=None, env=None, ready=True,
          timeout=30.0) -> Target

    program  a fixtures/*.c name ("counter"), a fixtures/*.py name
             ("counter.py", run with this Python), or a path
    args     the fixture's arguments after argv[1] (str() is applied)
    out      pass tmp_path/<name>.<n>.out as argv[1] (Target.out_path)
    stdin    None (/dev/null), "pipe" or "fifo" (a named FIFO in tmp_path,
             which a restore can reopen by path); write with Target.send()
    ready    wait for "READY <pid>" (a fixture exiting 77 skips the test)
    stdout and stderr go to files (Target.stdout_path, .stderr_path) opened
    O_APPEND, so a restored process can reopen them and nothing blocks.
    """
    targets: list[Target] = []
    counter = iter(range(1, 1 << 30))

    def _spawn(program: str, *args: Any, out: bool = True, stdin: str | None = None,
               env: dict[str, str] | None = None, ready: bool = True,
               timeout: float = 30.0) -> Target:
        name, argv = _resolve_program(program, request)
        n = next(counter)
        base = tmp_path / f"{name}.{n}"
        out_path = Path(f"{base}.out") if out else None
        argv = argv + ([str(out_path)] if out_path else []) + [str(a) for a in args]
        stdout_path, stderr_path = Path(f"{base}.stdout"), Path(f"{base}.stderr")
        fifo_path = None
        child_stdin: Any = subprocess.DEVNULL
        our_end = None
        if stdin == "pipe":
            r, w = os.pipe()
            child_stdin, our_end = r, os.fdopen(w, "wb")
        elif stdin == "fifo":
            fifo_path = Path(f"{base}.fifo")
            os.mkfifo(fifo_path)
            # O_RDWR first so neither of the two real opens blocks.
            keep = os.open(fifo_path, os.O_RDWR)
            child_stdin = os.open(fifo_path, os.O_RDONLY)
            our_end = os.fdopen(os.open(fifo_path, os.O_WRONLY), "wb")
            os.close(keep)
        elif stdin is not None:
            raise ValueError(f"stdin must be None, 'pipe' or 'fifo', not {stdin!r}")
        with open(stdout_path, "ab") as so, open(stderr_path, "ab") as se:
            try:
                popen = subprocess.Popen(argv, stdin=child_stdin, stdout=so, stderr=se,
                                         start_new_session=True, close_fds=True,
                                         env=env, cwd=tmp_path, preexec_fn=_default_dispositions)
            finally:
                if isinstance(child_stdin, int) and child_stdin >= 0:
                    os.close(child_stdin)
        target = Target(name, argv, popen, tmp_path, out_path, stdout_path,
                        stderr_path, our_end, fifo_path)
        targets.append(target)
        if ready:
            _wait_ready(target, timeout)
        return target

    yield _spawn
    for target in reversed(targets):
        target.cleanup()


def _default_dispositions() -> None:
    """preexec_fn of a fixture: SIGINT and SIGQUIT back to their default.  A non-interactive
    shell starts a background job (`pytest ... &`, as CI runners do) with both ignored, and
    an ignored signal stays ignored across fork and exec: the fixtures, their images and the
    processes restored from them would ignore ^C, which the tests send them."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _wait_ready(target: Target, timeout: float) -> None:
    def ready():
        lines = target.stdout_lines()
        for i, line in enumerate(lines):
            m = _LINE_READY.match(line)
            if m:
                return i, int(m.group(1))
        if target.poll():
            if target.popen.returncode == EXIT_NOCPU:
                pytest.skip(f"{target.name}: {target.stderr_text().strip()}")
            raise TargetError(f"{target.name} exited with {target.popen.returncode} "
                              f"before READY\n{target.describe()}")
        return None

    index, pid = wait_until(ready, timeout,
                            message=lambda: f"READY from {target.name}\n{target.describe()}")
    if pid != target.pid:
        raise TargetError(f"{target.name} says READY {pid} but its pid is {target.pid}")
    target.preamble = target.stdout_lines()[:index]
    for line in target.preamble:
        if m := _LINE_SYM.match(line):
            target.symbols[m.group(1)] = int(m.group(2), 16)
        elif m := _LINE_TID.match(line):
            i, tid = int(m.group(1)), int(m.group(2))
            target.tids.extend([0] * (i + 1 - len(target.tids)))
            target.tids[i] = tid


# --- the CLI ----------------------------------------------------------------------

class CliResult(NamedTuple):
    """What one `ptckpt` run gave; unpacks as (returncode, stdout, stderr)."""
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture(scope="session")
def ptckpt_cmd() -> list[str]:
    """The argv prefix running the installed CLI: the console script next to
    this Python, else `python -m ptckpt`."""
    script = Path(sys.executable).parent / "ptckpt"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "ptckpt"]


def plan_accepts(directory: str) -> None:
    """What a dump said yes to, restore's plan here says yes to as well (pids and changed
    files aside, which depend on when the restore runs): every image a test makes."""
    from ptckpt.formats.image import ImageReader
    from ptckpt.restore import preflight
    if not os.path.isdir(directory):
        return                                       # --page-server and the like: no image here
    with ImageReader(directory, verify_pages=False) as image:
        if image.inventory.memory_only:
            return                                   # a pre-dump: restored through its child
    refused = [f for f in preflight(directory) if not f.ok and f.what in ("image", "this host")]
    if refused:
        pytest.fail(f"the dump accepted {directory}, restore's plan refuses it: "
                    + "; ".join(f.detail for f in refused))


def _option(args: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a == name:
            return args[i + 1]
    return None


@pytest.fixture
def ptckpt(ptckpt_cmd: list[str], tmp_path: Path, request: pytest.FixtureRequest) -> Callable[..., CliResult]:
    """Run the CLI as a subprocess: ptckpt(*args, timeout=120.0, input=None,
    env=None, cwd=None, check=False, prefix=()) -> CliResult(returncode, stdout, stderr);
    `prefix` goes before the command (a wrapper such as prlimit).

    stdout/stderr go through files, not pipes, so a process the CLI leaves
    running (a restored target) cannot hold them open and hang the test.  The
    CLI runs in its own session; on timeout its whole process group is killed
    and the test fails.  check=True fails the test on a non-zero exit.

    Every `dump PID` is preceded by a snapshot of what /proc shows of PID, and every
    successful `restore --detach` of that image (asking for no change) is followed by the
    comparison with the restored process (tests/proccheck.py); a difference fails the test
    unless it is marked ``@pytest.mark.proc_differs(VIEW, ..., reason=...)``.
    """
    runs = iter(range(1, 1 << 30))
    snapshots: dict[str, dict] = {}
    marker = request.node.get_closest_marker("proc_differs")
    ignore = frozenset(marker.args) if marker else frozenset()

    def image_of(args: list[str], cwd: Path | str | None) -> str | None:
        directory = _option(args, "-D") or _option(args, "--directory")
        return os.path.abspath(os.path.join(cwd or os.getcwd(), directory)) if directory else None

    def before(args: list[str], cwd: Path | str | None) -> None:
        if len(args) > 1 and args[0] == "dump" and args[1].isdigit() and image_of(args, cwd):
            try:
                snapshots[image_of(args, cwd)] = proccheck.snapshot(int(args[1]))
            except OSError:
                pass

    def after(args: list[str], cwd: Path | str | None, result: CliResult) -> None:
        if args and args[0] == "dump" and result.returncode == 0:
            plan_accepts(image_of(args, cwd) or os.path.join(cwd or os.getcwd(), f"ckpt-{args[1]}"))
        if not args or args[0] != "restore" or result.returncode != 0 or "--detach" not in args:
            return
        if proccheck.CHANGING_FLAGS & set(args) or image_of(args, cwd) not in snapshots:
            return
        pid = proccheck.restored_pid(result.stderr)
        try:
            now = proccheck.snapshot(pid) if pid else None
        except OSError:
            return                                   # it ended already: nothing to compare
        found = proccheck.differences(snapshots[image_of(args, cwd)], now, ignore) if now else []
        if found:
            pytest.fail(f"restored process {pid} differs from what it was at the dump "
                        f"(tests/proccheck.py):\n" + "\n".join(found))

    def run(*args: Any, timeout: float = 120.0, input: str | bytes | None = None,
            env: dict[str, str] | None = None, cwd: Path | str | None = None,
            check: bool = False, prefix: Sequence[str] = ()) -> CliResult:
        args = [str(a) for a in args]
        argv = [*prefix] + ptckpt_cmd + args
        before(args, cwd)
        n = next(runs)
        out_path, err_path = tmp_path / f"ptckpt.{n}.stdout", tmp_path / f"ptckpt.{n}.stderr"
        stdin_data = input.encode() if isinstance(input, str) else input
        with open(out_path, "wb") as so, open(err_path, "wb") as se:
            proc = subprocess.Popen(argv, stdout=so, stderr=se,
                                    stdin=subprocess.PIPE if stdin_data is not None
                                    else subprocess.DEVNULL,
                                    env=env, cwd=cwd, start_new_session=True)
            try:
                proc.communicate(stdin_data, timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_process_groups([proc])
                reap_orphans()
                pytest.fail(f"{' '.join(argv)} did not finish within {timeout:g} s\n"
                            f"stdout:\n{_tail(out_path)}\nstderr:\n{_tail(err_path)}")
        reap_orphans()
        result = CliResult(proc.returncode, out_path.read_text(errors="replace"),
                           err_path.read_text(errors="replace"))
        if check and result.returncode != 0:
            pytest.fail(f"{' '.join(argv)} exited with {result.returncode}\n"
                        f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        after(args, cwd, result)
        return result

    return run


# --- the helpers as fixtures ---------------------------------------------------------

@pytest.fixture(name="wait_until")
def _wait_until_fixture() -> Callable[..., Any]:
    """wait_until(predicate, timeout=10.0, interval=0.01, message=None) -> value"""
    return wait_until


@pytest.fixture(name="read_counter")
def _read_counter_fixture() -> Callable[..., int]:
    """read_counter(path, timeout=2.0) -> int"""
    return read_counter


@pytest.fixture(name="reap_orphans")
def _reap_orphans_fixture() -> Callable[..., dict[int, int]]:
    """reap_orphans(pids=None) -> {pid: wait status}"""
    return reap_orphans


@pytest.fixture(name="wait_pid_free")
def _wait_pid_free_fixture() -> Callable[..., None]:
    """wait_pid_free(pid, timeout=10.0)"""
    return wait_pid_free


@pytest.fixture(name="cpu_has")
def _cpu_has_fixture() -> Callable[[str], bool]:
    """cpu_has(flag) -> bool, from /proc/cpuinfo"""
    return cpu_has


IDLE_TAIL = "print('READY', os.getpid(), flush=True)\nwhile True:\n    time.sleep(0.05)\n"


def idle_script(directory: Path, name: str, setup: str) -> Path:
    """A python3 target: `setup` (which imports os and time), then READY, then idle forever."""
    path = directory / name
    path.write_text(setup + IDLE_TAIL)
    return path


@pytest.fixture
def killed_counter(spawn: Callable[..., "Target"], ptckpt: Callable[..., CliResult],
                   tmp_path: Path) -> tuple["Target", Path]:
    """A counter fixture dumped with --kill to tmp_path/img, its pid free again:
    (the target, to adopt a restored copy; the image)."""
    target = spawn("counter")
    image = tmp_path / "img"
    res = ptckpt("dump", target.pid, "-D", image, "--kill")
    assert res.returncode == 0, res.stderr
    target.wait_exit(10)
    wait_pid_free(target.pid)
    return target, image
