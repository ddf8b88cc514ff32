"""An MPI job (Debian's MPICH: mpiexec, its hydra proxy, the ranks; UCX's shared memory
between the ranks: POSIX shm objects unlinked and mapped by both) checkpointed in the
middle of its run and restored finishes with the result of an uninterrupted run.  The
program (fixtures/mpi/mpisum.c) checks every message it gets as well."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import FIXTURES_DIR, needs, tool, descendants, kill_pids, reap_orphans, wait_pid_free, wait_until

MPICC, MPIEXEC = tool("mpicc"), tool("mpiexec")
pytestmark = needs("mpicc", "mpiexec")
STEPS = 300


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> str:
    """A launcher: mpiexec of 2 ranks of mpisum (built here with mpicc), OUTFILE STEPS."""
    where = tmp_path_factory.mktemp("mpi")
    binary = where / "mpisum"
    subprocess.run([MPICC, "-O1", "-Wall", "-o", str(binary), str(FIXTURES_DIR / "mpi" / "mpisum.c")],
                   check=True, capture_output=True)
    launcher = where / "mpijob"
    launcher.write_text(f"#!/bin/sh\nexec {MPIEXEC} -n 2 {binary} \"$@\"\n")
    launcher.chmod(0o755)
    return str(launcher)


def _line(path, word: str) -> str | None:
    try:
        text = open(path).read()
    except FileNotFoundError:
        return None
    assert "BAD" not in text, text
    return next((line for line in text.splitlines() if line.startswith(word)), None)


def test_mpi_job_restored_mid_run_ends_with_the_uninterrupted_result(job, ptckpt, tmp_path):
    reference = tmp_path / "reference.out"
    subprocess.run([job, str(reference), str(STEPS)], check=True, timeout=60,
                   stdin=subprocess.DEVNULL, capture_output=True)
    want = _line(reference, "RESULT")
    assert want, reference.read_text()

    out = tmp_path / "job.out"
    with open(tmp_path / "job.stdout", "wb") as so:
        launcher = subprocess.Popen([job, str(out), str(STEPS)], stdin=subprocess.DEVNULL, stdout=so,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    tree: set[int] = {launcher.pid}
    try:
        wait_until(lambda: _line(out, "STEP 60"), 30, message="the job at step 60")
        tree |= descendants(launcher.pid)
        assert len(tree) >= 4, "mpiexec, its proxy and two ranks"
        res = ptckpt("dump", launcher.pid, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        assert "4 processes" in res.stderr, res.stderr
        launcher.wait(10)
        assert _line(out, "RESULT") is None, "it was checkpointed before its end"
        for pid in tree:
            wait_pid_free(pid)
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
        assert res.returncode == 0, res.stderr
        got = wait_until(lambda: _line(out, "RESULT"), 60, message=lambda: f"the job's result\n{out.read_text()}")
        assert got == want
        assert _line(out, "RANKS") == "RANKS 2"
        steps = [line for line in out.read_text().splitlines() if line.startswith("STEP")]
        assert steps == [f"STEP {i}" for i in range(0, STEPS, 20)], "no step lost or repeated"
    finally:
        kill_pids(tree | {p for pid in tree for p in descendants(pid)})
        reap_orphans()
        print(open(tmp_path / "job.stdout").read(), file=sys.stderr)
