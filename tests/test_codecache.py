"""ptckpt.codecache: the methods of dataclasses, compiled once and kept for the commands."""

from __future__ import annotations

import os
import subprocess
import sys

from ptckpt import codecache

PROBE = """
import dataclasses, sys
from ptckpt import codecache
codecache.install()
import ptckpt.pipeline.dump, ptckpt.pipeline.restore
from_file = codecache._added == 0

@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int = 2
    tags: tuple = dataclasses.field(default_factory=tuple)

p = Point(1)
assert p == Point(1, 2, ()) and p != Point(1, 3) and hash(p) == hash(Point(1))
assert repr(p) == "Point(x=1, y=2, tags=())", repr(p)
try:
    p.x = 3
except dataclasses.FrozenInstanceError:
    pass
else:
    raise AssertionError("frozen")
print("from-file" if from_file else "compiled", codecache._added)
"""


def _run(tmp_path, code: str, *, cache, **env):
    full = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    full.update(PTCKPT_DATACLASS_CACHE=str(cache), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                          cwd=tmp_path, timeout=60)


def test_a_built_file_gives_the_methods_exec_would_make(tmp_path):
    cache = tmp_path / "methods.marshal"
    before = _run(tmp_path, PROBE, cache=cache)
    assert before.returncode == 0, before.stderr
    assert before.stdout.startswith("compiled")          # no file: compiled as always
    built = _run(tmp_path, "from ptckpt import codecache; codecache.build()", cache=cache)
    assert built.returncode == 0, built.stderr
    assert cache.is_file() and not cache.stat().st_mode & 0o022
    after = _run(tmp_path, PROBE, cache=cache)
    assert after.returncode == 0, after.stderr
    # the modules' methods all came from the file; the probe's class is new (1 method
    # each: __init__, __repr__, __eq__, __setattr__, __delattr__, __hash__)
    assert after.stdout.split() == ["from-file", "6"], after.stdout


def test_an_untrusted_or_broken_file_is_not_used(tmp_path):
    cache = tmp_path / "methods.marshal"
    assert _run(tmp_path, "from ptckpt import codecache; codecache.build()", cache=cache).returncode == 0
    assert codecache._load(str(cache))
    os.chmod(cache, 0o666)                                # others may write it: not code to run
    assert codecache._load(str(cache)) == {}
    os.chmod(cache, 0o644)
    os.chown(cache, 65534, 65534)                         # another user's
    assert codecache._load(str(cache)) == {}
    os.chown(cache, 0, 0)
    import marshal
    methods = marshal.loads(cache.read_bytes())["methods"]
    cache.write_bytes(marshal.dumps({"magic": b"\x00\x00\r\n", "methods": methods}))
    assert codecache._load(str(cache)) == {}              # another interpreter's bytecode
    cache.write_bytes(b"\x00garbage" * 100)              # not marshal data
    assert codecache._load(str(cache)) == {}
    res = _run(tmp_path, PROBE, cache=cache)
    assert res.returncode == 0 and res.stdout.startswith("compiled"), res.stderr


def test_the_command_writes_the_file_only_where_bytecode_may_be_written(tmp_path):
    cache = tmp_path / "methods.marshal"
    cmd = [sys.executable, "-m", "ptckpt", "check", "--kinds"]     # imports the records
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PTCKPT_DATACLASS_CACHE"] = str(cache)
    res = subprocess.run(cmd, capture_output=True, text=True, env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
    assert res.returncode == 0, res.stderr
    assert not cache.exists()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert cache.is_file() and codecache._load(str(cache))
