"""Fault injection at restore (ptckpt.faults, restore --inject/--seed): memory by symbol or
address, registers, every random choice from the seed, each fault logged."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from ptckpt.errors import ExitCode, UsageError
from ptckpt.faults import parse_spec

from conftest import kill_pids, reap_orphans, wait_until
from test_restore import _dump_kill, _one_line, _restore


def test_spec_language():
    s = parse_spec("flip:symbol=design_state+8,bits=3,size=16")
    assert (s.kind, s.symbol, s.bits, s.size, s.addr, s.pid) == ("flip", "design_state+8", 3, 16, None, 0)
    s = parse_spec("set:addr=0x1000,value=0xff,size=2,pid=7")
    assert (s.kind, s.addr, s.value, s.size, s.pid) == ("set", 0x1000, 0xff, 2, 7)
    s = parse_spec("reg:name=rax,bits=2")
    assert (s.kind, s.register, s.bits, s.value) == ("reg", "rax", 2, None)
    for bad, why in [("zap:symbol=x", "KIND"), ("flip:bits=1", "symbol=NAME or addr"),
                     ("flip:symbol=x,addr=1", "one of them"), ("set:symbol=x", "value"),
                     ("flip:symbol=x,colour=red", "'colour=red'"), ("flip:symbol=x,bits=two", "not a number"),
                     ("reg:value=1", "name="), ("reg:name=rax", "value=V or bits=N"),
                     ("flip:symbol=x,bits=0", "bits must be"), ("set:symbol=x,value=1,size=3", "size")]:
        with pytest.raises(UsageError, match=why):
            parse_spec(bad)


def _counter_image(spawn, ptckpt, tmp_path):
    target = spawn("counter")
    _dump_kill(ptckpt, target, tmp_path / "img")
    return target


def _value(target) -> int:
    text = open(target.out_path).read()
    return int(text) if text.endswith("\n") else 0


def test_set_by_symbol_takes_effect_and_is_logged(spawn, ptckpt, tmp_path):
    target = _counter_image(spawn, ptckpt, tmp_path)
    try:
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--inject", "set:symbol=poke,value=5000000",
                     "--seed", "3", "--faults-log", tmp_path / "faults.json")
        assert res.returncode == 0, res.stderr
        assert "fault (seed 3): set:symbol=poke,value=5000000: poke at 0x" in res.stderr
        wait_until(lambda: _value(target) > 5000000, 10, message="the counter goes on from the poked value")
        log = json.loads((tmp_path / "faults.json").read_text())
        assert log["seed"] == 3 and log["specs"] == ["set:symbol=poke,value=5000000"]
        (fault,) = log["faults"]
        assert (fault["target"], fault["pid"], fault["after"]) == ("poke", target.pid, (5000000).to_bytes(8, "little").hex())
        assert oct((tmp_path / "faults.json").stat().st_mode & 0o777) == "0o600"
    finally:
        kill_pids([target.pid])


def _flip_run(ptckpt, tmp_path, seed: int, name: str):
    """Restore (waiting) with one bit of `counter` flipped: the counter sees it (exit 4)."""
    log = tmp_path / f"{name}.json"
    res = ptckpt("restore", "-D", tmp_path / "img", "--inject", "flip:symbol=counter,bits=1",
                 "--seed", seed, "--faults-log", log, "--file-policy", "warn")
    return res, json.loads(log.read_text())["faults"][0]


def test_flip_is_chosen_by_the_seed_and_detected_by_the_program(spawn, ptckpt, tmp_path):
    target = _counter_image(spawn, ptckpt, tmp_path)
    try:
        first, fault = _flip_run(ptckpt, tmp_path, 42, "a")
        assert first.returncode == 4, first.stderr            # "BAD counter": the program noticed
        assert fault["bits"] == sorted(random.Random(42).sample(range(64), 1))
        before, after = (int.from_bytes(bytes.fromhex(fault[k]), "little") for k in ("before", "after"))
        assert before ^ after == 1 << fault["bits"][0]
        second, again = _flip_run(ptckpt, tmp_path, 42, "b")
        assert (second.returncode, again) == (4, fault), "the same seed makes the same fault"
        _third, other = _flip_run(ptckpt, tmp_path, 43, "c")
        assert other["bits"] == sorted(random.Random(43).sample(range(64), 1))
    finally:
        kill_pids([target.pid])
        reap_orphans()


def test_register_fault_crashes_the_program(spawn, ptckpt, tmp_path):
    target = _counter_image(spawn, ptckpt, tmp_path)
    try:
        res = ptckpt("restore", "-D", tmp_path / "img", "--inject", "reg:name=rip,value=0x10", "--seed", "1")
        assert res.returncode == 128 + signal.SIGSEGV, res.stderr
        assert "register rip of" in res.stderr
    finally:
        kill_pids([target.pid])
        reap_orphans()


def test_bad_injections_are_refused_cleanly(spawn, ptckpt, tmp_path):
    target = _counter_image(spawn, ptckpt, tmp_path)
    try:
        _one_line(ptckpt("restore", "-D", tmp_path / "img", "--inject", "flip:bits=1"), ExitCode.USAGE,
                  "symbol=NAME or addr")
        res = ptckpt("restore", "-D", tmp_path / "img", "--inject", "flip:symbol=no_such_symbol")
        assert res.returncode != 0 and "no_such_symbol" in res.stderr and "Traceback" not in res.stderr
        assert "killed" in res.stderr and not os.path.exists(f"/proc/{target.pid}")
        res = ptckpt("restore", "-D", tmp_path / "img", "--inject", "set:symbol=poke,value=1,pid=99999")
        assert res.returncode != 0 and "pid=99999" in res.stderr
        assert not os.path.exists(f"/proc/{target.pid}"), "nothing half-restored is left"
        assert _restore(ptckpt, tmp_path / "img") == target.pid   # the image is as it was
    finally:
        kill_pids([target.pid])


def _appctl_image(spawn, ptckpt, tmp_path, request=None, build="x86_64"):
    """appctl counting, dumped with --kill; `build` "-m32": its 32-bit build (a call's
    arguments on the stack, its result in eax)."""
    appctl = "appctl" if build == "x86_64" else str(request.getfixturevalue("fixture_bins32")["appctl"])
    target = spawn(appctl, "count", 1000)
    _dump_kill(ptckpt, target, tmp_path / "img")
    return target


BUILDS = pytest.mark.parametrize("build", ["x86_64", "-m32"])


@BUILDS
def test_call_fault_changes_an_argument_at_the_nth_call_then_runs_untraced(spawn, ptckpt, tmp_path, request,
                                                                           build):
    """pause_us(us) runs once per step of appctl: its 5th call after the restore sleeps 1.5 s."""
    target = _appctl_image(spawn, ptckpt, tmp_path, request, build)
    try:
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--seed", "1", "--faults-log",
                     tmp_path / "faults.json", "--inject", "call:function=pause_us,n=5,arg=0,value=1500000")
        assert res.returncode == 0, res.stderr
        assert "call 5 of pause_us: argument 0" in res.stderr and "0x3e8 -> 0x16e360" in res.stderr
        with open(f"/proc/{target.pid}/status") as f:
            assert "TracerPid:\t0" in f.read(), "untraced once the fault is made"
        stuck = _value(target)
        time.sleep(0.8)
        assert _value(target) == stuck, "the 5th step sleeps 1.5 s"
        wait_until(lambda: _value(target) > stuck + 20, 10, message="then it counts on")
        (fault,) = json.loads((tmp_path / "faults.json").read_text())["faults"]
        assert (fault["before"], fault["after"]) == (hex(1000), hex(1500000))
    finally:
        kill_pids([target.pid])


@BUILDS
def test_call_fault_on_a_return_value(spawn, ptckpt, tmp_path, request, build):
    target = _appctl_image(spawn, ptckpt, tmp_path, request, build)
    try:
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--inject",
                     "call:function=next_value,n=3,ret=1000000")
        assert res.returncode == 0, res.stderr
        assert "call 3 of next_value: return value" in res.stderr
        wait_until(lambda: _value(target) > 1000000, 10, message="the counter goes on from the changed return")
    finally:
        kill_pids([target.pid])


def test_call_fault_in_libc_flips_memory_and_the_waiting_restore_reports_the_exit(spawn, ptckpt, tmp_path):
    """A breakpoint on libc's nanosleep; at its 6th call a bit of `counter` flips, the counter
    fixture notices (exit 4), and the waiting restore reports that although its breakpoint
    loop saw the end first."""
    target = _counter_image(spawn, ptckpt, tmp_path)
    try:
        res = ptckpt("restore", "-D", tmp_path / "img", "--seed", "5",
                     "--inject", "call:function=libc.so.6:clock_nanosleep,n=6,flip=counter,bits=1")
        assert res.returncode == 4, res.stderr
        assert "call 6 of libc.so.6:clock_nanosleep: counter" in res.stderr
    finally:
        kill_pids([target.pid])
        reap_orphans()
