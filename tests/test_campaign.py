"""Restart campaigns (ptckpt campaign): one checkpoint of the emulator testbench restored many
times, two at a time, each run in its own pid namespace with its own seed and faults."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ptckpt.units import parse_duration
from ptckpt.errors import ExitCode, UsageError

from conftest import kill_pids, reap_orphans, wait_until
from test_emulator import start_emulator, start_testbench, testbench_bin  # noqa: F401
from test_restore import _dump_kill

VENDOR = "emulator-link"        # examples/emulator-link, installed: found by its entry point
# A 32-bit design: a flipped bit in the upper half of a design_state word is masked.
CONFIG = "width 32\ninit_steps 10\ninit_sleep_us 1000\nvectors 1200\nvector_sleep_us 1500\n"


def _rows(out: Path) -> list[dict]:
    with open(out / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def _leftovers(exe: str) -> list[int]:
    """Processes still running `exe` (restored runs that were not ended)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/exe") == exe:
                out.append(int(pid))
        except OSError:
            pass
    return out


def checkpoint_testbench(spawn, ptckpt, testbench_bin, tmp_path, address: str, config: str,
                         at_vector: int | None = None) -> Path:
    """The testbench checkpointed (dump --kill, with the vendor plugin) at its region of
    interest, or once its log shows vector `at_vector`.  The plugin refuses a freeze in
    the middle of an emulator transaction ("dump again"); a testbench that ended before a
    dump went through is started again (up to three times)."""
    for attempt in range(3):
        bench = start_testbench(spawn, testbench_bin, tmp_path, address, config, name=f"slot{attempt}")
        bench.wait_for_line("REGION 1", timeout=10)
        if at_vector is not None:
            log = bench.slot / "run.log"
            wait_until(lambda: f"vector {at_vector} " in log.read_text(), 20, message=f"vector {at_vector}")
        for tries in range(20):
            image = tmp_path / f"img{attempt}-{tries}"
            res = ptckpt("dump", bench.pid, "-D", image, "--kill", "--plugin", VENDOR)
            if res.returncode == 0:
                bench.wait_exit(10)
                return image
            if not bench.alive():
                break
            assert "dump again" in res.stderr, res.stderr
    raise AssertionError(f"no checkpoint of the testbench: {res.stderr}")


@pytest.fixture
def testbench_image(spawn, ptckpt, testbench_bin, tmp_path):
    """The testbench checkpointed at its region of interest, and an emulator serving every run."""
    emulator = start_emulator(spawn, options=("--per-connection",))
    image = checkpoint_testbench(spawn, ptckpt, testbench_bin, tmp_path, emulator.address, CONFIG)
    yield image, dict(os.environ, EMULATOR_ADDRESS=emulator.address)
    kill_pids(_leftovers(str(testbench_bin)))
    reap_orphans()


def _campaign(ptckpt, image, env, out, *extra):
    res = ptckpt("campaign", "-D", image, "--plugin", VENDOR, "--file-policy", "warn", "-o", out,
                 "--inject", "flip:symbol=design_state,bits=1", "--timeout", "30s", *extra, env=env)
    assert res.returncode == 0, res.stderr
    return res


def test_campaign_of_ten_runs_masks_and_detects_and_repeats(ptckpt, testbench_image, testbench_bin, tmp_path):
    image, env = testbench_image
    res = _campaign(ptckpt, image, env, tmp_path / "results", "--runs", "10", "--jobs", "2", "--seed", "100")
    rows = _rows(tmp_path / "results")
    assert [r["index"] for r in rows] == [str(i) for i in range(11)]      # the reference, then 10 runs
    ref, runs = rows[0], rows[1:]
    assert ref["outcome"] == "reference" and ref["status"] == "0"
    assert [r["seed"] for r in runs] == [str(100 + i) for i in range(10)]
    outcomes = {r["outcome"] for r in runs}
    assert outcomes == {"masked", "detected"}, rows
    data = json.loads((tmp_path / "results" / "results.json").read_text())
    masked_low: set[int] = set()
    for run in data["runs"]:
        (fault,) = run["faults"]
        (bit,) = fault["bits"]
        assert fault["target"] == "design_state"
        # width 32: the upper half of each 64-bit word never reaches the design
        if bit % 64 >= 32:
            assert run["outcome"] == "masked", run
        elif run["outcome"] == "masked":
            # a lower-half flip is masked only in the word the next READ_REG overwrites before
            # it is used: the freeze came between a vector's writes and its read (CI saw it)
            masked_low.add(bit // 64)
        assert run["status"] == 0 and run["outcome"] in ("masked", "detected")
        stdout = Path(tmp_path / "results" / "runs" / f"{run['index']:04d}" / "stdout").read_text()
        assert stdout.startswith("SIGNATURE ")
        assert (run["signature"] == ref["signature"]) == (run["outcome"] == "masked")
    assert len(masked_low) <= 1, f"lower-half flips masked in words {masked_low}"
    assert f"10 runs: {data['summary'].get('masked', 0)} masked, {data['summary'].get('detected', 0)} detected, " \
           f"0 crashed, 0 hung" in res.stdout
    assert _leftovers(str(testbench_bin)) == [], "nothing is left running"
    # the runs were copies of one template, each with its own emulator connection (the vendor
    # plugin's restored event in each copy): restored one by one instead, the same seeds give
    # the same faults and outcomes
    assert data["runs_as"] == "copies of a template"
    _campaign(ptckpt, image, env, tmp_path / "again", "--runs", "3", "--seed", "100", "--no-clones")
    assert json.loads((tmp_path / "again" / "results.json").read_text())["runs_as"] == "restores"
    again = json.loads((tmp_path / "again" / "results.json").read_text())["runs"]
    assert [(r["seed"], r["faults"], r["outcome"]) for r in again] == \
           [(r["seed"], r["faults"], r["outcome"]) for r in data["runs"][:3]]


def test_campaign_check_command_judges_runs(ptckpt, testbench_image, tmp_path):
    image, env = testbench_image
    ref = tmp_path / "ref.txt"
    _campaign(ptckpt, image, env, tmp_path / "first", "--runs", "1", "--seed", "7")
    signature = (tmp_path / "first" / "runs" / "reference" / "stdout").read_text().split("\n")[0]
    ref.write_text(signature + "\n")
    _campaign(ptckpt, image, env, tmp_path / "checked", "--runs", "4", "--seed", "7", "--jobs", "2",
              "--check", f'head -n1 "$PTCKPT_STDOUT" | cmp -s - {ref}')
    rows = _rows(tmp_path / "checked")
    assert len(rows) == 4, "no reference run with a check"
    first = _rows(tmp_path / "first")[1]
    assert rows[0]["outcome"] == first["outcome"], "same seed, same verdict through the check"
    for r in rows:
        assert r["check"] == ("pass" if r["outcome"] == "masked" else "fail")


def test_runs_that_hang_are_killed_and_runs_that_crash_are_counted(spawn, ptckpt, tmp_path):
    target = spawn("counter")                      # never ends by itself: every run hangs
    _dump_kill(ptckpt, target, tmp_path / "img")
    try:
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", tmp_path / "hung", "--runs", "2", "--jobs", "2",
                     "--inject", "set:symbol=poke,value=77", "--check", "true", "--timeout", "1s",
                     "--file-policy", "ignore")
        assert res.returncode == 0, res.stderr
        assert [r["outcome"] for r in _rows(tmp_path / "hung")] == ["hung", "hung"]
        assert "0 masked, 0 detected, 0 crashed, 2 hung" in res.stdout
        assert not os.path.exists(f"/proc/{target.pid}") or open(f"/proc/{target.pid}/stat").read().split()[2] == "Z"
        assert _leftovers(str(target.argv[0])) == []
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", tmp_path / "crash", "--runs", "2",
                     "--inject", "reg:name=rip,value=0x10", "--check", "true", "--file-policy", "ignore")
        assert res.returncode == 0, res.stderr
        rows = _rows(tmp_path / "crash")
        assert [(r["outcome"], r["reason"]) for r in rows] == [("crashed", "signal 11")] * 2
        # a -o that holds results already is refused, not mixed with the new runs
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", tmp_path / "crash", "--runs", "1",
                     "--inject", "reg:name=rip,value=0x10", "--check", "true", "--file-policy", "ignore")
        assert res.returncode == 2 and "not empty" in res.stderr, res.stderr
        # a symbol the image does not define is refused before any run, in one line, no -o made
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", tmp_path / "typo", "--runs", "2",
                     "--inject", "set:symbol=no_such_symbol,value=1", "--check", "true", "--file-policy", "ignore")
        assert res.returncode == ExitCode.USAGE and len(res.stderr.splitlines()) == 1, res.stderr
        assert "--inject set:symbol=no_such_symbol,value=1: symbol 'no_such_symbol' not found" in res.stderr
        assert not (tmp_path / "typo").exists()
        # runs whose restore fails are "error", and the campaign's exit status says so
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", tmp_path / "err", "--runs", "2", "--json",
                     "--inject", "set:addr=0x10,value=1", "--check", "true", "--file-policy", "ignore")
        assert res.returncode == ExitCode.RUNS_FAILED, res.stderr
        out = json.loads(res.stdout)
        assert out["summary"] == {"error": 2} and out["out"] == str(tmp_path / "err")
        assert out["runs"] == json.loads((tmp_path / "err" / "results.json").read_text())["runs"]
        assert res.stderr.startswith("ptckpt: error: 2 of 2 runs could not be restored") and \
            "0x10" in res.stderr, res.stderr
    finally:
        kill_pids(_leftovers(str(target.argv[0])))
        reap_orphans()


# One frame of the campaign's bar: "campaign runs ━━━━━  33% 1/3 runs 1 crashed 0:00:02"
_RUNS_FRAME = re.compile(r"campaign (?P<phase>\w+) [━╸╺ ]*\s+(?P<pct>\d+)% (?P<done>\d+)/(?P<total>\d+) runs"
                         r"(?P<tally>(?:\s+\d+ \w+,?)*)\s+(?P<eta>\d+:\d\d:\d\d|-:--:--)")


def _runs_frames(shown: str) -> list[re.Match]:
    frames = re.split(r"\x1b\[2K|\r|\n", shown)         # rich redraws the line: one frame each
    return [m for f in frames if (m := _RUNS_FRAME.search(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f)))]


def _on_terminal(argv: list[str], env=None) -> str:
    """What a command draws on a terminal (script(1) gives it one), escapes and all."""
    import shlex
    res = subprocess.run(["script", "-qec", shlex.join(argv), "/dev/null"], stdin=subprocess.DEVNULL,
                         capture_output=True, timeout=120, env=env, check=False)
    shown = res.stdout.decode(errors="replace")
    assert res.returncode == 0, shown
    return shown


def test_the_campaign_bar_names_its_phase_and_counts_the_runs_by_outcome():
    """Issue 37: the campaign's bar (progress.RunsBar, as the campaign's progress callback)
    names its phase (the reference run, then the runs), the percentage, the runs done of all,
    the outcomes so far in their usual order and the time left."""
    import sys

    from ptckpt.campaign_types import OUTCOMES
    code = "; ".join([
        "import time", "from ptckpt import progress",
        f"bar = progress.RunsBar('campaign', 4, {OUTCOMES!r}, 'reference', after=0)",
        "time.sleep(0.5)", "bar(0, 4, {}, None)", "time.sleep(0.5)",
        "bar(1, 4, {'crashed': 1}, 65.0)", "time.sleep(0.5)",
        "bar(3, 4, {'crashed': 1, 'masked': 2}, 5.0)", "time.sleep(0.5)", "bar.close()"])
    frames = _runs_frames(_on_terminal([sys.executable, "-c", code]))
    seen = [(f["phase"], f["pct"], f["done"], f["total"], f["tally"].strip(), f["eta"]) for f in frames]
    assert ("reference", "0", "0", "4", "", "-:--:--") in seen, seen
    assert ("runs", "0", "0", "4", "", "-:--:--") in seen, seen
    assert ("runs", "25", "1", "4", "1 crashed", "0:01:05") in seen, seen
    assert ("runs", "75", "3", "4", "2 masked, 1 crashed", "0:00:05") in seen, seen
    assert seen.index(("reference", "0", "0", "4", "", "-:--:--")) < seen.index(("runs", "25", "1", "4", "1 crashed", "0:01:05"))


def test_campaign_shows_live_progress_on_a_terminal_and_writes_a_report(spawn, ptckpt, ptckpt_cmd, tmp_path):
    """On a terminal (script(1) gives it one) the campaign draws a bar as runs end (phase,
    percent, runs done, outcomes so far, time left), gone before the table; -q draws none.
    report.html is one offline page with the outcome counts, the values set by fault site and
    the run-time histogram as inline SVG (tests/test_report.py: the chart of bits flipped)."""
    import html.parser
    target = spawn("counter")
    _dump_kill(ptckpt, target, tmp_path / "img")
    env = dict(os.environ, PTCKPT_PROGRESS_AFTER="0")
    try:
        def campaign(out, *flags):
            return _on_terminal(ptckpt_cmd + [*flags, "campaign", "-D", str(tmp_path / "img"), "-o", str(out),
                                              "--runs", "3", "--jobs", "1", "--inject", "reg:name=rip,value=0x10",
                                              "--check", "true", "--file-policy", "ignore"], env=env)
        shown = campaign(tmp_path / "out")
        frames = _runs_frames(shown)
        assert frames and {f["phase"] for f in frames} == {"runs"}, shown
        assert any(f["done"] == "1" and f["pct"] == "33" and f["tally"].strip() == "1 crashed"
                   and f["eta"] != "-:--:--" for f in frames), shown
        assert any(f["done"] == "3" and f["pct"] == "100" and f["tally"].strip() == "3 crashed" for f in frames), shown
        bar_end = [m.end() for m in re.finditer(r"\d/3 runs", shown)][-1]
        assert bar_end < shown.index("run    1"), "the bar goes before the table"
        quiet = campaign(tmp_path / "quiet", "-q")
        assert not _runs_frames(quiet) and "run    1" in quiet, quiet
        page = (tmp_path / "out" / "report.html").read_text()
        parser = html.parser.HTMLParser()
        parser.feed(page)
        assert page.count("<svg") == 1 and "3 runs: 0 masked, 0 detected, 3 crashed, 0 hung" in page
        assert "No run flipped a bit" in page             # so no chart of bits: the run times only
        assert "rip = 0x10" in page or "rip" in page
        assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', ""), "nothing fetched"
        assert (tmp_path / "out" / "report.html").stat().st_mode & 0o077 == 0
    finally:
        kill_pids(_leftovers(str(target.argv[0])))
        reap_orphans()


def test_durations_and_bad_campaigns(ptckpt, tmp_path):
    assert (parse_duration("30s"), parse_duration("2m"), parse_duration("500ms"), parse_duration("3")) == \
           (30, 120, 0.5, 3)
    with pytest.raises(UsageError):
        parse_duration("soon")
    res = ptckpt("campaign", "-D", tmp_path / "nothing", "-o", tmp_path / "out", "--inject", "flip:bits=1")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "symbol=NAME or addr" in res.stderr


def test_campaign_with_breakpoint_faults(ptckpt, testbench_image, testbench_bin, tmp_path):
    """The faults come at run time: at the 5th STEP after the restore a design_state bit flips."""
    image, env = testbench_image
    res = ptckpt("campaign", "-D", image, "--plugin", VENDOR, "--file-policy", "warn", "-o", tmp_path / "bp",
                 "--inject", "call:function=step,n=5,flip=design_state,bits=1", "--runs", "4", "--jobs", "2",
                 "--seed", "9", "--timeout", "30s", env=env)
    assert res.returncode == 0, res.stderr
    runs = json.loads((tmp_path / "bp" / "results.json").read_text())["runs"]
    assert len(runs) == 4 and {r["outcome"] for r in runs} <= {"masked", "detected"}, runs
    for r in runs:
        (fault,) = r["faults"]
        assert fault["target"] == "call 5 of step: design_state" and len(fault["bits"]) == 1
    assert _leftovers(str(testbench_bin)) == []


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_campaign_runs_of_a_server_image_each_get_a_network_namespace(spawn, ptckpt, fixture_bins, tmp_path):
    """An image holding a listener and a UDP socket on one loopback port: two runs at once
    would fight over the port; the campaign restores each in a network namespace of its own."""
    port = _free_port()
    target = spawn("netcount", port, 40, 20000)
    image = tmp_path / "img"
    _dump_kill(ptckpt, target, image)
    from ptckpt import campaign
    assert campaign._holds_loopback_sockets(str(image))        # so every run gets --netns
    out = tmp_path / "results"
    try:
        res = ptckpt("campaign", "-D", image, "-o", out, "--runs", "4", "--jobs", "2", "--seed", "7",
                     "--inject", "flip:symbol=spare,bits=1", "--timeout", "30s", "--file-policy", "warn")
        assert res.returncode == 0, res.stderr
        rows = _rows(out)
        assert [r["outcome"] for r in rows] == ["reference"] + ["masked"] * 4, rows
        for run in ["reference", "0001", "0002", "0003", "0004"]:
            text = (out / "runs" / run / "stdout").read_text()
            assert f"DONE 40 {port}" in text, text
    finally:
        kill_pids(_leftovers(str(fixture_bins["netcount"])))
        reap_orphans()


@pytest.mark.parametrize("make", ["missing", "file", "empty"])
def test_a_campaign_of_a_non_image_fails_before_any_run_leaving_nothing(ptckpt, tmp_path, make):
    """-D that is no image: the image's own error and exit code, before the reference run,
    and no -o left behind (the same command, corrected, is not refused for it)."""
    image = tmp_path / "img"
    if make == "file":
        image.write_text("x")
    elif make == "empty":
        image.mkdir()
    res = ptckpt("campaign", "-D", image, "-o", tmp_path / "out", "--runs", "2",
                 "--inject", "flip:symbol=design_state,bits=1", timeout=30)
    assert res.returncode == ExitCode.NOT_AN_IMAGE, res.stderr
    assert len(res.stderr.splitlines()) == 1 and "reference run" not in res.stderr, res.stderr
    assert str(image) in res.stderr
    assert not (tmp_path / "out").exists()


def test_a_failed_reference_run_says_why_with_its_own_exit_code_and_the_retry_reuses_out(spawn, ptckpt, tmp_path):
    """The reference run fails: the restore's own exit code when the restore failed (15: a file
    changed under --file-policy strict), REFERENCE_FAILED when the program did not succeed (it
    hung); one line naming where the run's output is; -o, holding only the failed reference,
    is taken again by the same command, corrected (not refused as "not empty")."""
    target = spawn("counter")
    _dump_kill(ptckpt, target, tmp_path / "img")
    out = tmp_path / "out"
    reference = out / "runs" / "reference"
    try:
        with open(target.out_path, "a") as f:
            f.write("changed since the dump\n")
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", out, "--runs", "2",
                     "--inject", "set:symbol=poke,value=77", "--file-policy", "strict", "--timeout", "20s")
        assert res.returncode == ExitCode.INCOMPATIBLE, res.stderr
        assert len(res.stderr.splitlines()) == 1 and "reference run" in res.stderr, res.stderr
        assert str(reference) in res.stderr and "changed" in res.stderr, res.stderr
        assert (reference / "stderr").exists() and not (out / "results.csv").exists()
        # retried: -o is reused; the counter never ends, so now the reference hangs
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", out, "--runs", "2",
                     "--inject", "set:symbol=poke,value=77", "--file-policy", "ignore", "--timeout", "1s")
        assert res.returncode == ExitCode.REFERENCE_FAILED, res.stderr
        assert len(res.stderr.splitlines()) == 1 and "not empty" not in res.stderr, res.stderr
        assert "timed out" in res.stderr and str(reference) in res.stderr, res.stderr
        assert _leftovers(str(target.argv[0])) == []
        # and once more, with a check (no reference): the campaign runs in the same -o
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", out, "--runs", "1",
                     "--inject", "reg:name=rip,value=0x10", "--check", "true", "--file-policy", "ignore")
        assert res.returncode == 0, res.stderr
        assert [r["outcome"] for r in _rows(out)] == ["crashed"]
        assert not reference.exists(), "the failed reference's output went with the retry"
        # a -o that holds a campaign's results is still refused
        res = ptckpt("campaign", "-D", tmp_path / "img", "-o", out, "--runs", "1",
                     "--inject", "reg:name=rip,value=0x10", "--check", "true", "--file-policy", "ignore")
        assert res.returncode == ExitCode.USAGE and "not empty" in res.stderr, res.stderr
    finally:
        kill_pids(_leftovers(str(target.argv[0])))
        reap_orphans()
