"""A restored process goes back into the cgroups it was in at dump (it starts in ptckpt
restore's); one it cannot join is a warning, not a silence (ptckpt.resources.process)."""

from __future__ import annotations

import os
import uuid

import pytest

from ptckpt.resources import process

from conftest import wait_pid_free


def _writable_hierarchy() -> tuple[str, str]:
    """(mount point, the controllers' key in /proc/PID/cgroup) of a hierarchy we may make a
    cgroup in: the v2 one, else v1 memory."""
    for controllers, where in sorted(process.cgroup_mounts().items(), key=lambda kv: len(kv[0])):
        if controllers in (frozenset(), frozenset({"memory"})) and os.access(where, os.W_OK):
            return where, ",".join(sorted(controllers))
    pytest.skip("no writable cgroup hierarchy here")


@pytest.fixture
def cgroup():
    where, key = _writable_hierarchy()
    path = os.path.join(where, f"ptckpt-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(path)
    yield path, key, "/" + os.path.relpath(path, where)
    if not os.path.isdir(path):
        return
    for pid in open(os.path.join(path, "cgroup.procs")).read().split():
        try:
            with open(os.path.join(where, "cgroup.procs"), "w") as f:    # out, so it can go
                f.write(pid)
        except OSError:
            pass
    os.rmdir(path)


def _line(pid: int, key: str) -> str:
    return next(l for l in open(f"/proc/{pid}/cgroup").read().splitlines()
                if l.split(":")[1] == key)


def test_the_restored_process_is_back_in_its_cgroup(spawn, ptckpt, tmp_path, cgroup):
    path, key, rel = cgroup
    target = spawn("counter")
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(target.pid))
    assert _line(target.pid, key).endswith(":" + rel)
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill").returncode == 0
    target.wait_exit(10)
    wait_pid_free(target.pid)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    assert _line(target.pid, key).endswith(":" + rel)
    assert "cgroup" not in res.stderr


def test_a_cgroup_gone_since_the_dump_is_a_warning(spawn, ptckpt, tmp_path, cgroup):
    path, key, rel = cgroup
    target = spawn("counter")
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(target.pid))
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill").returncode == 0
    target.wait_exit(10)
    wait_pid_free(target.pid)
    os.rmdir(path)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    assert "stays in cgroup" in res.stderr and rel in res.stderr
    assert not _line(target.pid, key).endswith(":" + rel)
