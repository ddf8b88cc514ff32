"""A simulator nobody here wrote: Icarus Verilog (Debian's iverilog) running a testbench
(fixtures/verilog/lfsr_tb.v), checkpointed in the middle of its run and restored, ends with
the line an uninterrupted run prints; restored a second time from the same image, the
same again (the campaign's use: one image, many restarts)."""

from __future__ import annotations

import subprocess

from conftest import FIXTURES_DIR, needs, tool, kill_pids, reap_orphans, wait_pid_free, wait_until

IVERILOG, VVP = tool("iverilog"), tool("vvp")
pytestmark = needs("iverilog", "vvp")
CYCLES = "+cycles=3000000"


def _done(path) -> str | None:
    return next((line for line in path.read_text().splitlines() if line.startswith("DONE")), None)


def test_verilog_testbench_restored_mid_run_ends_as_a_run_left_alone(ptckpt, tmp_path):
    sim = tmp_path / "lfsr"
    subprocess.run([IVERILOG, "-o", str(sim), str(FIXTURES_DIR / "verilog" / "lfsr_tb.v")], check=True,
                   capture_output=True)
    alone = subprocess.run([VVP, "-n", str(sim), CYCLES], check=True, capture_output=True, text=True,
                           timeout=120).stdout
    want = next(line for line in alone.splitlines() if line.startswith("DONE"))
    out = tmp_path / "run.out"
    with open(out, "wb") as so:
        run = subprocess.Popen([VVP, "-n", str(sim), CYCLES], stdin=subprocess.DEVNULL, stdout=so,
                               stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    pids = {run.pid}
    try:
        wait_until(lambda: int(open(f"/proc/{run.pid}/stat").read().split(") ")[1].split()[11]) > 30, 30,
                   message="the simulation under way (0.3 s of CPU)")
        res = ptckpt("dump", run.pid, "-D", tmp_path / "img", "--kill")
        assert res.returncode == 0, res.stderr
        run.wait(10)
        assert _done(out) is None, "checkpointed before its end"
        at_dump = out.read_bytes()
        for attempt in range(2):
            wait_pid_free(run.pid)
            res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--file-policy", "warn")
            assert res.returncode == 0, res.stderr
            assert wait_until(lambda: _done(out), 120, message=lambda: out.read_text()[-300:]) == want, attempt
            wait_until(lambda: not _alive(run.pid), 10, message="the restored simulation ends")
            reap_orphans()
            assert out.read_text() == alone, "every line once, the same as the run left alone"
            out.write_bytes(at_dump)             # as it was at the dump, for the next restart
    finally:
        kill_pids(pids)
        reap_orphans()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] not in "ZX"
    except FileNotFoundError:
        return False
