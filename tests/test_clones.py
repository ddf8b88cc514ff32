"""Template clones (ptckpt.clones): a campaign's runs as copy-on-write copies of one restored,
held template -- the same outcomes as restoring the image for every run, each copy with its
own memory and file offsets, nothing left behind when the campaign is killed."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ptckpt import clones
from ptckpt.builtins import Inject
from ptckpt.tracee import AddressSpace

from conftest import kill_pids, reap_orphans, wait_until
from test_restore import _dump_kill

REST = "the rest of the input, read after the restore\n"


def _running(exe: str) -> list[int]:
    """Processes running `exe`: the template, its copies and their inits."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/exe") == exe:
                out.append(int(pid))
        except OSError:
            pass
    return out


@pytest.fixture
def campaigner_image(spawn, ptckpt, fixture_bins, tmp_path):
    """An image of fixtures/campaigner that has read 8 bytes of its input, with `wait_ms` of
    its wait left (about), and the pid it had; copies still running are killed at the end."""
    made = []

    def make(wait_ms: int = 1500, heap_kib: int = 1024) -> tuple[Path, int]:
        source = tmp_path / f"input{len(made)}"
        source.write_text("HEADHEAD" + REST)
        target = spawn("campaigner", source, wait_ms, heap_kib, out=False)
        image = tmp_path / f"img{len(made)}"
        _dump_kill(ptckpt, target, image)
        made.append(image)
        return image, target.pid
    yield make
    kill_pids(_running(str(fixture_bins["campaigner"])))
    reap_orphans()


def _table(out: Path) -> list[tuple]:
    with open(out / "results.csv", newline="") as f:
        return [tuple(v for k, v in r.items() if k not in ("seconds", "host")) for r in csv.DictReader(f)]


def test_copies_give_the_table_of_full_restores(campaigner_image, ptckpt, tmp_path):
    """The same seeds give the same outcome table, faults and stdout signatures whether each
    run restores the image or is a copy of the template; every copy reads the input from
    the dumped offset and has the original pid, its init as parent."""
    image, pid = campaigner_image()
    args = ["campaign", "-D", image, "--runs", "8", "--jobs", "2", "--seed", "40", "--timeout", "30s",
            "--inject", "set:symbol=stop,value=1", "--inject", "flip:symbol=table,bits=1"]
    copies = ptckpt(*args, "-o", tmp_path / "copies", "--json")
    assert copies.returncode == 0, copies.stderr
    full = ptckpt(*args, "-o", tmp_path / "full", "--no-clones", "--json")
    assert full.returncode == 0, full.stderr
    assert json.loads(copies.stdout)["runs_as"] == "copies of a template"
    assert json.loads(full.stdout)["runs_as"] == "restores"
    assert _table(tmp_path / "copies") == _table(tmp_path / "full")
    outcomes = {r["outcome"] for r in json.loads(copies.stdout)["runs"]}
    assert outcomes <= {"masked", "detected"} and len(outcomes) == 2, outcomes   # both kinds of bit
    for run in sorted((tmp_path / "copies" / "runs").iterdir()):
        lines = (run / "stdout").read_text().splitlines()
        assert lines[0] == "rest " + REST.rstrip("\n"), (run, lines)
        assert lines[-1] == f"pid {pid} ppid 1", (run, lines)


def test_a_copy_owns_its_memory_and_offsets(campaigner_image, tmp_path):
    """A copy's writes (its heap, a flipped bit of `table`) are seen neither by the template
    nor by the next copies; two copies at once each read the input from the dumped offset."""
    image, pid = campaigner_image(wait_ms=60000)
    template = clones.Template(str(image))
    try:
        table = template.symbols().resolve("table")
        before = AddressSpace(template.task.tgid).read(table, 64 * 8)

        def run(name: str, *specs: str) -> clones.Copy:
            d = tmp_path / name
            d.mkdir()
            for f in ("stdout", "stderr"):
                (d / f).touch()
            return template.copy(str(d / "stdout"), str(d / "stderr"),
                                 [Inject(["set:symbol=stop,value=1", *specs], seed=7)])

        def wait(copy: clones.Copy) -> int:
            wait_until(lambda: copy.ended() is not None, 20, message="the copy's end")
            status = copy.ended()
            copy.end()
            return status

        assert os.WEXITSTATUS(wait(run("first", "flip:symbol=table,bits=3"))) == 0
        both = [run("second"), run("third")]
        assert [os.WEXITSTATUS(wait(c)) for c in both] == [0, 0]
        assert AddressSpace(template.task.tgid).read(table, 64 * 8) == before
        for name in ("first", "second", "third"):
            text = (tmp_path / name / "stdout").read_text()
            assert text.startswith("rest " + REST) and f"pid {pid} ppid 1" in text, (name, text)
            assert (tmp_path / name / "stderr").read_text() == ""
    finally:
        template.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["SIGINT", "SIGKILL"])
def test_a_killed_campaign_leaves_no_template_or_copy(campaigner_image, fixture_bins, tmp_path, sig):
    image, _pid = campaigner_image(wait_ms=60000)
    exe = str(fixture_bins["campaigner"])
    argv = [sys.executable, "-m", "ptckpt", "campaign", "-D", str(image), "-o", str(tmp_path / "out"),
            "--runs", "4", "--jobs", "2", "--check", "true", "--timeout", "60s",
            "--inject", "flip:symbol=table,bits=1"]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        # the template, two copies and their two inits
        wait_until(lambda: len(_running(exe)) >= 5, 30, message=lambda: f"copies running: {_running(exe)}")
        os.kill(proc.pid, sig)
        proc.wait(20)
        wait_until(lambda: not _running(exe), 10, message=lambda: f"left behind: {_running(exe)}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reap_orphans()


def test_images_a_copy_cannot_own_take_the_full_path(spawn, ptckpt, campaigner_image, tmp_path):
    """A threaded process, a restore option a template cannot take and a call: fault are
    named as the reason and the runs restore the image instead."""
    target = spawn("threads")
    threaded = tmp_path / "threaded"
    _dump_kill(ptckpt, target, threaded)
    assert "threads" in clones.campaign_refusal(str(threaded), ["flip:symbol=counters,bits=1"], ())
    image, _pid = campaigner_image()
    assert clones.campaign_refusal(str(image), ["flip:symbol=table,bits=1"], ()) is None
    assert "--unset-env" in clones.campaign_refusal(str(image), ["flip:symbol=table,bits=1"], ("--unset-env", "X"))
    assert "call" in clones.campaign_refusal(str(image), ["call:function=read,n=1,ret=0"], ())


def test_a_copy_dumped_is_the_image_but_its_stdio(campaigner_image, ptckpt, tmp_path):
    """A copy, checkpointed while it waits, against the image it was made from: every page
    the same, every record the same but for the run's stdio (fds 0-2), its thread's
    registers and syscall state (it ran), and the depth of its pid namespace (the
    template's, then its own)."""
    image, _pid = campaigner_image(wait_ms=60000)
    template = clones.Template(str(image))
    try:
        (tmp_path / "stdout").touch()
        (tmp_path / "stderr").touch()
        copy = template.copy(str(tmp_path / "stdout"), str(tmp_path / "stderr"))
        res = ptckpt("dump", copy.pid, "-D", tmp_path / "copy", "--leave-running")
        assert res.returncode == 0, res.stderr
        assert copy.ended() is None, "the copy runs on after its dump"
    finally:
        template.close()
    res = ptckpt("diff", image, tmp_path / "copy", "--json")
    found = json.loads(res.stdout)
    assert found["pages_compared"] > 200 and found["memory"] == [], found["memory"]
    unexpected = [(d["what"], d["field"]) for d in found["differences"] if not d.get("expected")]
    running = ("restart", "syscall_nr", "xstate", "xfeatures")    # where it was when frozen: it ran
    for what, field in unexpected:
        assert (what == "image" and field == "pid_level") or what.endswith((" fd 0", " fd 1", " fd 2")) or \
            (" thread " in what and (field.startswith("regs.") or field in running)), (what, field, unexpected)


def test_a_program_of_another_user_is_copied_with_its_credentials(spawn, ptckpt, fixture_bins, tmp_path):
    """The template of a program without CAP_SYS_ADMIN keeps ptckpt's credentials (it must
    make namespaces and choose pids); each copy takes the program's before it runs."""
    shared = Path(tempfile.mkdtemp(prefix="ptckpt-clones-"))     # the program must reach its input
    template = None
    try:
        shared.chmod(0o755)
        source = shared / "input"
        source.write_text("HEADHEAD" + REST)
        source.chmod(0o644)
        target = spawn("/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                       fixture_bins["campaigner"], source, 60000, out=False)
        image = tmp_path / "img"
        _dump_kill(ptckpt, target, image)
        template = clones.Template(str(image))
        assert template.creds_later
        assert "Uid:\t0\t0" in Path(f"/proc/{template.task.tgid}/status").read_text()
        for f in ("stdout", "stderr"):
            (tmp_path / f).touch()
        copy = template.copy(str(tmp_path / "stdout"), str(tmp_path / "stderr"),
                             [Inject(["set:symbol=stop,value=1"], seed=1)])
        wait_until(lambda: copy.ended() is not None, 20, message="the copy's end")
        status = Path(f"/proc/{copy.pid}/status").read_text()
        assert "Uid:\t65534\t65534\t65534\t65534" in status and "CapEff:\t0000000000000000" in status, status
        assert copy.ended() == 0, (tmp_path / "stderr").read_text()
        assert (tmp_path / "stdout").read_text().startswith("rest " + REST)
    finally:
        if template is not None:
            template.close()
        shutil.rmtree(shared, ignore_errors=True)


def test_the_bar_names_the_reference_run_then_the_runs(campaigner_image, ptckpt_cmd, tmp_path):
    """On a terminal, a campaign without --check shows its reference phase (the reference
    run alone, first), then the runs phase up to 100%."""
    from test_campaign import _on_terminal, _runs_frames
    image, _pid = campaigner_image()
    shown = _on_terminal(ptckpt_cmd + ["campaign", "-D", str(image), "-o", str(tmp_path / "out"), "--runs", "4",
                                       "--inject", "set:symbol=stop,value=1"],
                         env=dict(os.environ, PTCKPT_PROGRESS_AFTER="0"))
    frames = _runs_frames(shown)
    phases = [f["phase"] for f in frames]
    assert "reference" in phases and "runs" in phases, shown
    assert phases.index("runs") > phases.index("reference") and "reference" not in phases[phases.index("runs"):]
    assert any(f["phase"] == "runs" and f["pct"] == "100" and f["done"] == "4" for f in frames), shown


_TEMPLATE_FRAME = re.compile(r"campaign template [━╸╺ ]*\s+(?P<pct>\d+)% (?P<done>[\d.]+)/(?P<total>[\d.]+) "
                             r"(?P<unit>MiB|GiB)")


def test_the_bar_shows_the_template_restore_in_bytes(campaigner_image, ptckpt_cmd, tmp_path):
    """Issue 37: a campaign whose template takes a while to restore shows it in its bar: the
    template phase counting the bytes of its memory up to 100%, then the reference run and
    the runs."""
    from test_campaign import _on_terminal, _runs_frames
    image, _pid = campaigner_image(heap_kib=384 * 1024)
    shown = _on_terminal(ptckpt_cmd + ["campaign", "-D", str(image), "-o", str(tmp_path / "out"), "--runs", "2",
                                       "--inject", "set:symbol=stop,value=1"],
                         env=dict(os.environ, PTCKPT_PROGRESS_AFTER="0"))
    plain = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", f) for f in re.split(r"\x1b\[2K|\r|\n", shown)]
    template = [m for f in plain if (m := _TEMPLATE_FRAME.search(f))]
    assert template, shown
    assert {m["unit"] for m in template} == {"MiB"} and float(template[-1]["total"]) >= 384, template[-1].group(0)
    assert any(m["pct"] == "100" and m["done"] == m["total"] for m in template), [m.group(0) for m in template]
    assert len({m["done"] for m in template}) > 2, "the bytes move in steps, not in one jump"
    phases = [f["phase"] for f in _runs_frames(shown)]
    assert "reference" in phases and "runs" in phases, shown
