"""What a small command loads: `ptckpt dump` and `ptckpt restore` of a small process import
the library they use and none of the heavy modules they do not (bench/small_commands: on
such a process most of a command's time is the interpreter and its imports).

Read from the interpreter's own import log (PYTHONPROFILEIMPORTTIME, as `python -X
importtime`), never from a timing, so it holds on a loaded machine: it fails when a
module-level import of one of these comes back on the way of a dump or a restore."""

from __future__ import annotations

import os
import re

# module -> why a dump or a restore of a plain process has no use for it
NOT_LOADED = {
    "elftools": "build-ids come from the PT_NOTE segments (filepolicy.build_id); pyelftools only "
                "for a file whose segments do not say",
    "rich": "typer's help and pretty errors only",
    "click": "typer carries its own",
    "dask": "campaign --backend dask:// only",
    "distributed": "campaign --backend dask:// only",
    "cloudpickle": "Dask's",
    "msgpack": "Dask's",
    "jinja2": "not used by ptckpt",
    "yaml": "not used by ptckpt",
    "ptckpt.campaign": "the campaign command",
    "ptckpt.cluster": "the Dask backend",
    "ptckpt.report": "a campaign's report",
    "ptckpt.diff": "the diff command",
    "ptckpt.show": "the show command",
    "ptckpt.core": "the core command",
    "ptckpt.migrate": "the migrate command",
    "ptckpt.transfer": "push, page-server and migrate",
    "ptckpt.run": "the run command",
    "ptckpt.check": "the check command",
    "ptckpt.lazypages": "restore --lazy",
    "ptckpt.symbols": "breakpoints and faults by symbol",
}

_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| ( *)(\S+)$", re.MULTILINE)


def _imported(stderr: str) -> set[str]:
    return {m.group(2) for m in _LINE.finditer(stderr)}


def _unwanted(stderr: str) -> list[str]:
    loaded = _imported(stderr)
    assert "ptckpt.cli" in loaded, "no import log: PYTHONPROFILEIMPORTTIME was not honoured"
    return [f"{name} ({why})" for name, why in NOT_LOADED.items()
            if name in loaded or any(m.startswith(name + ".") for m in loaded)]


def _logged() -> dict[str, str]:
    return {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}


def test_a_small_dump_and_restore_import_nothing_heavy_they_do_not_use(spawn, ptckpt, tmp_path):
    from conftest import wait_pid_free
    target = spawn("counter")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "running", env=_logged())
    assert res.returncode == 0, res.stderr
    assert _unwanted(res.stderr) == [], "dump (leave running)"
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill", env=_logged())
    assert res.returncode == 0, res.stderr
    assert _unwanted(res.stderr) == [], "dump --kill"
    target.wait_exit(10)
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach", env=_logged())
    assert res.returncode == 0, res.stderr
    assert _unwanted(res.stderr) == [], "restore --detach"
    target.adopt(target.pid)
    target.wait_progress()


def test_the_guard_sees_an_eager_import(ptckpt):
    """The log is read right: a command that does load one of them is caught (show imports
    ptckpt.show)."""
    res = ptckpt("show", "/nonexistent-image", env=_logged())
    assert "ptckpt.show (the show command)" in _unwanted(res.stderr)
