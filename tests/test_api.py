"""The Python API (ptckpt.api, whose functions ptckpt.dump and ptckpt.restore are): a program of
the user's own dumps a process it started and restores it, then waits for it, the way
README's example does.  The program runs in its own interpreter, as a user's would."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import kill_pids, reap_orphans
from ptckpt.errors import ExitCode, NoSuchProcess, PtckptError

PROGRAM = textwrap.dedent(r"""
    import os, signal, subprocess, sys, time
    import ptckpt

    counter, out, image = sys.argv[1:4]

    def value():
        try:
            with open(out) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def wait_for(cond, what):
        deadline = time.monotonic() + 10
        while not cond():
            if time.monotonic() > deadline:
                sys.exit(f"timed out: {what}")
            time.sleep(0.01)

    target = subprocess.Popen([counter, out], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    print("PID", target.pid, flush=True)
    wait_for(lambda: value() > 0, "the counter counts")
    bystander = os.fork()                    # a child of ours the library must leave alone
    if bystander == 0:
        time.sleep(0.3)
        os._exit(7)
    result = ptckpt.dump(target.pid, image, leave_running=False)
    print("DUMPED", result.pids == [target.pid], result.pages > 0, result.directory == image, flush=True)
    print("TARGET", target.wait(timeout=5), flush=True)   # its end is ours to collect, not the library's
    _, status = os.waitpid(bystander, 0)
    print("BYSTANDER", os.waitstatus_to_exitcode(status), flush=True)
    at_dump = value()
    proc = ptckpt.restore(image, pidns=True)
    print("RESTORED", proc.pid, proc.init_pid, proc.vpid == target.pid, proc.alive(), flush=True)
    wait_for(lambda: value() > at_dump + 10, "the restored counter goes on")
    print("WAIT", proc.wait(timeout=0.1), flush=True)
    proc.signal(signal.SIGTERM)
    print("STATUS", proc.wait(timeout=10), proc.alive(), flush=True)
    again = ptckpt.api.restore(image, pidns=True, file_policy=["warn"])   # the counter wrote since
    again.kill()
    print("KILLED", again.alive(), again.wait(), any("count" in w for w in again.warnings), flush=True)
""")


@pytest.fixture
def started():
    """Pids the program prints (PID, RESTORED): killed at the end whatever happened."""
    pids: list[int] = []
    yield pids
    kill_pids(pids)
    reap_orphans()


def test_a_program_dumps_and_restores_through_the_python_api(fixture_bins, tmp_path, started):
    script = tmp_path / "user.py"
    script.write_text(PROGRAM)
    res = subprocess.run([sys.executable, script, fixture_bins["counter"], tmp_path / "count",
                          str(tmp_path / "img")], capture_output=True, text=True, timeout=120)
    lines = res.stdout.splitlines()
    for line in lines:
        words = line.split()
        if words[0] in ("PID", "RESTORED"):
            started += [int(w) for w in words[1:3] if w.isdigit() and int(w) > 0]
    assert res.returncode == 0, res.stdout + res.stderr
    assert [l for l in lines if not l.startswith(("PID", "RESTORED"))] == [
        "DUMPED True True True", "TARGET -9", "BYSTANDER 7", "WAIT None", "STATUS 143 False", "KILLED False 137 True"]
    restored = next(l for l in lines if l.startswith("RESTORED")).split()
    assert restored[3:] == ["True", "True"] and int(restored[2]) > 0      # its own pid namespace


def test_api_errors_are_the_commands_errors(tmp_path):
    import ptckpt
    with pytest.raises(NoSuchProcess) as caught:
        ptckpt.dump(4194304 + 1, tmp_path / "img")
    assert caught.value.exit_code == ExitCode.NO_SUCH_PROCESS
    with pytest.raises(PtckptError) as caught:
        ptckpt.restore(tmp_path / "nothing")
    assert caught.value.exit_code == ExitCode.NOT_AN_IMAGE
    assert callable(ptckpt.dump) and callable(ptckpt.restore)
    from ptckpt.dump import DumpMode                    # the modules stay modules too
    assert DumpMode.KILL


# --- the front door: every option of the commands is a keyword of the API ------------------

# CLI options that print or detach, which the API's return value replaces
RENDERING = {"as_json"}
HANDLE_INSTEAD = {"detach", "pidfile"}        # the returned Restored handle


def _command_params(name: str) -> dict:
    import typer.main
    from ptckpt import cli
    return {p.name: p for p in typer.main.get_command(cli.app).commands[name].params}


@pytest.mark.parametrize("command,function", [("dump", "dump"), ("pre-dump", "pre_dump"), ("restore", "restore")])
def test_every_option_of_the_command_is_a_keyword_of_the_api(command, function):
    import inspect
    from ptckpt import api
    signature = inspect.signature(getattr(api, function))
    params = _command_params(command)
    missing = sorted(set(params) - RENDERING - HANDLE_INSTEAD - set(signature.parameters))
    assert not missing, f"`ptckpt {command}` options without a keyword in ptckpt.api.{function}: {missing}"
    for name, option in params.items():
        if name not in signature.parameters:
            continue
        keyword = signature.parameters[name]
        assert keyword.annotation is not inspect.Parameter.empty, f"{function}({name}) is not typed"
        if option.required or keyword.default is inspect.Parameter.empty:
            continue
        cli_default = option.default
        if name.endswith("timeout"):                      # "10s" on the command line, seconds here
            cli_default = api.parse_duration(cli_default)
        assert _unset(cli_default) == _unset(keyword.default), \
            f"{command} {name}: the command's default {option.default!r}, the API's {keyword.default!r}"
        flags = {o.lstrip("-").replace("-", "_") for o in option.opts}
        assert name in flags or name.removesuffix("s") in flags, \
            f"ptckpt.api.{function}({name}) is not named after its flag {option.opts}"


def _unset(value):
    """A list option's default: None on the command line, () in the API."""
    return () if value is None else value


@pytest.mark.parametrize("function", ["dump", "pre_dump", "restore"])
def test_help_shows_the_api_function_and_its_keywords(function):
    import inspect
    import pydoc
    import re
    import ptckpt
    from ptckpt import api
    assert getattr(ptckpt, function) is getattr(api, function), "the package's name is the API's function"
    assert inspect.isfunction(getattr(ptckpt, function))
    text = pydoc.render_doc(getattr(ptckpt, function), renderer=pydoc.plaintext)
    doc = inspect.getdoc(getattr(api, function))
    assert "ptckpt.api" in text and "*args" not in text
    for name, keyword in inspect.signature(getattr(api, function)).parameters.items():
        if keyword.kind is inspect.Parameter.KEYWORD_ONLY:
            assert f"{name}:" in text, name                            # typed in the signature
            assert re.search(rf"^{name} +\S", doc, re.M), f"{function}'s docstring says what {name} does"


def test_the_library_modules_stay_importable():
    import importlib
    import ptckpt
    from ptckpt.restore import preflight                    # the module beneath the function
    assert callable(preflight) and importlib.import_module("ptckpt.restore").preflight is preflight
    assert callable(ptckpt.restore) and ptckpt.restore.__module__ == "ptckpt.api"


def test_options_are_parsed_in_one_place():
    from ptckpt import api
    from ptckpt.errors import UsageError
    assert api.parse_compress("zstd") == ("zstd", 3) and api.parse_compress(None) is None
    with pytest.raises(UsageError, match="--compress: unknown compression 'lz4'"):
        api.parse_compress("lz4")
    assert api.parse_duration("2m") == 120.0 and api.parse_duration(1.5) == 1.5
    with pytest.raises(UsageError):
        api.parse_file_policy(["sometimes"])
    with pytest.raises(UsageError, match="needs --new-pty"):
        api.restore("/nonexistent", new_pty_program="cat")
    with pytest.raises(UsageError, match="not the string"):
        api.restore("/nonexistent", remap_path="/a=/b")


def _count(path) -> int:
    try:
        text = open(path).read()
    except OSError:
        return 0
    return int(text) if text.endswith("\n") else 0


def test_restore_with_the_commands_options_as_keywords(spawn, tmp_path):
    """The built-in plugins behind restore's flags, through the API: the counter's output
    moved from slot3 to slot7 (--remap-path), its environment edited (--set-env,
    --unset-env), a fault injected with a chosen seed and logged (--inject, --seed,
    --faults-log), --new-pty said to have no terminal to replace, --file-policy warn."""
    import json
    import os
    import shutil
    import ptckpt
    from ptckpt.symbols import SymbolTable, read_environ
    from ptckpt.tracee import AddressSpace
    from conftest import wait_pid_free, wait_until
    slot3, slot7 = tmp_path / "slot3", tmp_path / "slot7"
    slot3.mkdir()
    target = spawn("counter", slot3 / "count", out=False, env={"PATH": os.environ.get("PATH", ""), "GONE": "1"})
    wait_until(lambda: _count(slot3 / "count") > 0, 10, message="the counter counts")
    image = ptckpt.dump(target.pid, tmp_path / "img", leave_running=False)
    target.wait_exit(10)
    wait_pid_free(target.pid)
    at_dump = _count(slot3 / "count")
    slot7.mkdir()
    shutil.copy(slot3 / "count", slot7 / "count")
    tree = ptckpt.restore(image.directory, remap_path=[f"{slot3}={slot7}"], set_env={"PTCKPT_API": "yes"},
                          unset_env=["GONE"], inject=["set:symbol=poke,value=5000000"], seed=3,
                          faults_log=tmp_path / "faults.json", new_pty=True, file_policy=["warn"])
    try:
        assert tree.pid == target.pid and tree.alive()
        wait_until(lambda: _count(slot7 / "count") > 5000000, 10, message="the poked counter goes on in slot7")
        assert _count(slot3 / "count") == at_dump, "the old path is left alone"
        assert any(os.readlink(f"/proc/{tree.pid}/fd/{fd}") == str(slot7 / "count")
                   for fd in os.listdir(f"/proc/{tree.pid}/fd"))
        assert tree.seed == 3 and len(tree.faults) == 1 and "poke" in str(tree.faults[0])
        assert json.loads((tmp_path / "faults.json").read_text())["seed"] == 3
        assert "--new-pty: the image's stdio was on no terminal" in tree.warnings and tree.pty_master == -1
        with AddressSpace(tree.pid) as mem:
            env = read_environ(mem, SymbolTable.for_process(tree.pid))
        assert b"PTCKPT_API=yes" in env and not [e for e in env if e.startswith(b"GONE=")]
    finally:
        tree.kill()
    assert not tree.alive()
