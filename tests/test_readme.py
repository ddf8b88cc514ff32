"""README's examples, run as they are written, in the order written, twice (each must work
when run again): the quick start's shell block (bash -e, from the repository's top
directory, on a terminal as a reader runs it), the Python API's block (this venv's python)
and the pytest plugin's two files (conftest.py and test_counter.py, named by their first
line, run with pytest in a directory of their own).  The blocks are found by their place
under README's headings, so what is tested is what README shows."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import ROOT, descendants, kill_pids, pid_alive, reap_orphans, require, wait_until

README = ROOT / "README.md"
BIN = Path(sys.executable).parent            # the venv's bin: python, ptckpt, pytest


def blocks_under(heading: str, text: str | None = None) -> list[tuple[str, str]]:
    """The fenced code blocks between `heading` (a whole line, "## Quick start") and the
    next heading of any level: [(info string, code)]."""
    text = README.read_text() if text is None else text
    lines = text.splitlines(keepends=True)
    start = lines.index(heading + "\n") + 1
    blocks, fence, info, code = [], None, "", []
    for line in lines[start:]:
        if fence is None:
            if line.startswith("#"):
                break
            m = re.match(r"^(```+)\s*(\S*)", line)
            if m:
                fence, info, code = m.group(1), m.group(2), []
        elif line.rstrip() == fence:
            blocks.append((info, "".join(code)))
            fence = None
        else:
            code.append(line)
    return blocks


def test_blocks_are_found_under_their_headings():
    text = "# t\n## A\nx\n```\necho a\n```\n```python\n# f.py\np\n```\n### B\n```\nno\n```\n"
    assert blocks_under("## A", text) == [("", "echo a\n"), ("python", "# f.py\np\n")]
    quick = blocks_under("## Quick start")
    api = blocks_under("## Python API")
    plugin = blocks_under("### pytest plugin")
    assert len(quick) == 1 and "ptckpt restore" in quick[0][1]
    assert [i for i, _ in api] == ["python"] and "ptckpt.restore(" in api[0][1]
    assert [code.splitlines()[0] for _, code in plugin] == ["# conftest.py", "# test_counter.py"]


def test_ci_runs_the_install_and_test_commands_verbatim():
    """.ci/run runs README's Install and Test commands, each a line of its own, in README's order."""
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    commands = [line.strip() for heading in ("## Install", "## Test") for _, code in blocks_under(heading)
                for line in code.splitlines() if line.strip()]
    assert commands[:3] == ["python3 -m venv .venv", ". .venv/bin/activate",
                            "pip install -e '.[test,cluster]' -e ./examples/emulator-link"]
    at = [next((i for i, line in enumerate(ci) if line == c or line.startswith(f"if ! {c};")
                or line.startswith(f"{c} ||")), None) for c in commands]
    assert None not in at, [c for c, i in zip(commands, at) if i is None]
    assert at == sorted(at), list(zip(commands, at))


def _env() -> dict[str, str]:
    """README's shell: the venv active (its bin first on PATH)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
               VIRTUAL_ENV=str(BIN.parent))
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _on_a_terminal(argv: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """Run argv with a new pty as its stdin, stdout and stderr (a reader's terminal):
    (exit status, what it printed)."""
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=_env(),
                                start_new_session=True)
    finally:
        os.close(slave)
    out = bytearray()

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:                  # EIO: every slave end is closed
                return
            if not data:
                return
            out.extend(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{argv} did not finish in {timeout:g} s:\n{out.decode(errors='replace')[-4000:]}")
    reader.join(2)        # a restored process may keep the terminal open: read what is there
    os.close(master)
    return status, out.decode(errors="replace").replace("\r\n", "\n")


def _run(argv: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace", timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{argv} did not finish in {timeout:g} s:\n{err.stdout}")
    return proc.returncode, proc.stdout


def _top_level() -> set[str]:
    return {str(p.relative_to(ROOT)) for d in (ROOT, ROOT / "fixtures") for p in d.iterdir()}


@pytest.fixture
def started():
    """Kill, at the end, what the examples started and left: the processes that became
    pytest's descendants meanwhile (pytest is a child subreaper: restored trees land here),
    and the quick start's restored counter, by its pidfile."""
    before = descendants()
    yield
    pids = set()
    try:
        pid = int(Path("/tmp/counter.pid").read_text().split()[0])
        if os.readlink(f"/proc/{pid}/exe") == "/tmp/counter":
            pids.add(pid)
    except (OSError, ValueError, IndexError):
        pass
    pids |= {p for p in descendants() - before if pid_alive(p)}
    kill_pids(pids)
    wait_until(lambda: not any(pid_alive(p) for p in pids) and (reap_orphans() or True), 10,
               message=lambda: f"the examples' processes to end: {sorted(p for p in pids if pid_alive(p))}")
    reap_orphans()


def test_readme_examples_run_as_written_and_again(tmp_path, started):
    require("gcc")
    quick, = blocks_under("## Quick start")
    api, = blocks_under("## Python API")
    plugin = blocks_under("### pytest plugin")
    script = tmp_path / "quick-start.sh"
    script.write_text("set -e\n" + quick[1])
    suite = tmp_path / "suite"
    suite.mkdir()
    for _, code in plugin:
        name = code.splitlines()[0].removeprefix("# ").strip()
        (suite / name).write_text(code)
    pytest_cmd = [str(BIN / "pytest")] if (BIN / "pytest").exists() else [sys.executable, "-m", "pytest"]
    listing = _top_level()

    for run in ("first", "again"):
        status, out = _on_a_terminal(["bash", str(script)], ROOT, 120)
        assert status == 0 and "Traceback" not in out, f"quick start ({run} run) exited {status}:\n{out}"
        assert re.search(r"^stopped \d+", out, re.M), out
        assert _top_level() == listing, "the quick start wrote into the repository, not under /tmp"

        status, out = _run([sys.executable, "-c", api[1]], tmp_path, 120)
        assert status == 0, f"Python API ({run} run) exited {status}:\n{out}"
        assert out.splitlines()[-1] == "143", out

        status, out = _run(pytest_cmd, suite, 300)
        assert status == 0 and re.search(r"\b1 passed\b", out), f"pytest plugin ({run} run) exited {status}:\n{out}"


def run_block(block: str, log: Path, timeout: float) -> tuple[int, str]:
    """A shell block of README run as written (bash -e, from the repository's top
    directory, the venv's bin first on PATH), its output into `log` (a file: what it leaves
    running may hold its stdout); what it leaves running is ended: (exit status, output)."""
    before = descendants()
    try:
        with open(log, "wb") as f:
            proc = subprocess.Popen(["bash", "-e", "-c", block], cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL,
                                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = proc.wait()
        return status, log.read_text(errors="replace")
    finally:
        left = {p for p in descendants() - before if pid_alive(p)}
        kill_pids(left)
        wait_until(lambda: not any(pid_alive(p) for p in left) and (reap_orphans() or True), 10)


def test_readme_campaign_example_runs_as_written_and_again(started, tmp_path):
    """The campaign example (Application control, fault injection, campaigns), as written,
    from the repository's top directory, twice: it ends with its summary line each time.
    What it leaves running (the emulator) is ended between the two runs."""
    require("gcc")
    block = next(code for _, code in blocks_under("## Application control, fault injection, campaigns")
                 if "ptckpt campaign" in code)
    for run in ("first", "again"):
        status, out = run_block(block, tmp_path / f"{run}.out", 240)
        assert status == 0 and "Traceback" not in out, f"campaign example ({run} run) exited {status}:\n{out}"
        assert re.search(r"^10 runs: \d+ masked, \d+ detected, 0 crashed, 0 hung; results in /tmp/results$",
                         out, re.M), out
