"""A restored process goes back into the cgroups it was in at dump (it starts in ptckpt
restore's), each thread into its own; a cgroup gone since the dump is made again as it was
(owner, modes, control files, the empty cgroups below it); one it cannot join is a warning,
not a silence (ptckpt.resources.process)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
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


def test_a_cgroup_gone_since_the_dump_is_made_again(spawn, ptckpt, tmp_path, cgroup):
    """Its owner and mode, a control file's owner and mode, a limit and an empty cgroup below
    it: all as at dump, the process in it."""
    path, key, rel = cgroup
    prop, value = ("cgroup.max.descendants", "7\n") if key == "" else ("memory.limit_in_bytes", "268435456\n")
    target = spawn("counter")
    os.mkdir(os.path.join(path, "empty"))
    os.chown(path, 1000, 1001)
    os.chmod(path, 0o751)
    os.chown(os.path.join(path, "cgroup.procs"), 1002, 1003)
    with open(os.path.join(path, prop), "w") as f:
        f.write(value)
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(target.pid))
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill").returncode == 0
    target.wait_exit(10)
    wait_pid_free(target.pid)
    os.rmdir(os.path.join(path, "empty"))
    os.rmdir(path)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    assert "cgroup" not in res.stderr
    assert _line(target.pid, key).endswith(":" + rel)
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1001, 0o751)
    st = os.stat(os.path.join(path, "cgroup.procs"))
    assert (st.st_uid, st.st_gid) == (1002, 1003)
    assert open(os.path.join(path, prop)).read() == value
    assert os.path.isdir(os.path.join(path, "empty"))
    os.rmdir(os.path.join(path, "empty"))


def _dumped_in_sub(spawn, ptckpt, tmp_path, where: str):
    """A counter put in the cgroup `sub` of hierarchy `where`, dumped to tmp_path/img and
    killed (its pid free again)."""
    os.mkdir(os.path.join(where, "sub"))
    target = spawn("counter")
    with open(os.path.join(where, "sub", "cgroup.procs"), "w") as f:
        f.write(str(target.pid))
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill").returncode == 0
    target.wait_exit(10)
    wait_pid_free(target.pid)
    return target


def test_a_hierarchy_not_mounted_at_restore_is_a_warning(spawn, ptckpt, tmp_path, named_hierarchy):
    """Where the process's cgroup cannot be joined (its hierarchy mounted nowhere), the
    restore says so."""
    where, key = named_hierarchy
    target = _dumped_in_sub(spawn, ptckpt, tmp_path, where)
    subprocess.run(["umount", where], check=True)
    try:
        res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
        assert res.returncode == 0, res.stderr
        target.adopt(target.pid)
        assert "stays in cgroup" in res.stderr and "/sub" in res.stderr
    finally:
        subprocess.run(["mount", "-t", "cgroup", "-o", f"none,{key}", "none", where], check=True)


@pytest.fixture
def named_hierarchy():
    """A cgroup v1 hierarchy of the test's own, with no controller (name=...), mounted at a
    temporary directory: (mount point, its key in /proc/PID/cgroup)."""
    key = f"name=ptckpt{uuid.uuid4().hex[:6]}"
    where = tempfile.mkdtemp(prefix="ptckpt-cg-")
    if subprocess.run(["mount", "-t", "cgroup", "-o", f"none,{key}", "none", where]).returncode:
        os.rmdir(where)
        pytest.skip("cannot mount a named cgroup v1 hierarchy here")
    yield where, key
    for top, _dirs, _files in sorted(os.walk(where), key=lambda t: -t[0].count("/")):
        if top != where:
            for tid in open(os.path.join(top, "tasks")).read().split():
                try:
                    with open(os.path.join(where, "tasks"), "w") as f:
                        f.write(tid)
                except OSError:
                    pass
            os.rmdir(top)
    subprocess.run(["umount", where])
    os.rmdir(where)


def test_a_thread_goes_back_to_its_own_cgroup(spawn, ptckpt, tmp_path, named_hierarchy):
    """cgroup v1 moves threads one by one: a thread in a cgroup other than its process's
    is restored there (and the cgroups, removed since the dump, made again)."""
    where, key = named_hierarchy
    os.makedirs(os.path.join(where, "proc", "thread"))
    target = spawn("threads")
    with open(os.path.join(where, "proc", "cgroup.procs"), "w") as f:
        f.write(str(target.pid))
    moved = target.tids[1]
    with open(os.path.join(where, "proc", "thread", "tasks"), "w") as f:
        f.write(str(moved))
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill").returncode == 0
    target.wait_exit(10)
    wait_pid_free(target.pid)
    os.rmdir(os.path.join(where, "proc", "thread"))
    os.rmdir(os.path.join(where, "proc"))
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    assert "cgroup" not in res.stderr

    def line(tid):
        return next(l for l in open(f"/proc/{target.pid}/task/{tid}/cgroup").read().splitlines()
                    if l.split(":")[1] == key)
    assert line(moved).endswith(":/proc/thread")
    assert all(line(t).endswith(":/proc") for t in [target.pid] + target.tids if t != moved)


def test_cgroup_root_puts_the_tree_under_another_root(spawn, ptckpt, tmp_path, named_hierarchy):
    """--cgroup-root CONTROLLER:PATH (CRIU's): the tree's common cgroup in that hierarchy is
    replaced by PATH, made with the cgroups below it, a thread in its own there too; the
    cgroups above the common one are not made again."""
    where, key = named_hierarchy
    os.makedirs(os.path.join(where, "old", "proc", "thread"))
    target = spawn("threads")
    with open(os.path.join(where, "old", "proc", "cgroup.procs"), "w") as f:
        f.write(str(target.pid))
    moved = target.tids[1]
    with open(os.path.join(where, "old", "proc", "thread", "tasks"), "w") as f:
        f.write(str(moved))
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill").returncode == 0
    target.wait_exit(10)
    wait_pid_free(target.pid)
    for gone in ("old/proc/thread", "old/proc", "old"):
        os.rmdir(os.path.join(where, gone))
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--cgroup-root", f"{key}:/new/root")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    assert key not in res.stderr

    def line(tid):
        return next(l for l in open(f"/proc/{target.pid}/task/{tid}/cgroup").read().splitlines()
                    if l.split(":")[1] == key)
    assert line(moved).endswith(":/new/root/thread")
    assert all(line(t).endswith(":/new/root") for t in [target.pid] + target.tids if t != moved)
    assert not os.path.exists(os.path.join(where, "old"))


def test_cgroups_ignore_leaves_the_tree_in_the_restorers_cgroups(spawn, ptckpt, tmp_path, named_hierarchy):
    """--cgroups ignore (CRIU's --manage-cgroups=ignore): no cgroup is joined or made."""
    where, key = named_hierarchy
    target = _dumped_in_sub(spawn, ptckpt, tmp_path, where)
    os.rmdir(os.path.join(where, "sub"))
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach", "--cgroups", "ignore")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    assert "cgroup" not in res.stderr
    assert _line(target.pid, key) == _line(os.getpid(), key)
    assert not os.path.exists(os.path.join(where, "sub"))


def test_cgroup_root_and_cgroups_ignore_exclude_each_other(ptckpt, tmp_path):
    res = ptckpt("restore", "-D", tmp_path, "--cgroups", "ignore", "--cgroup-root", "/new")
    assert res.returncode != 0 and "exclude each other" in res.stderr
    res = ptckpt("restore", "-D", tmp_path, "--cgroup-root", "new")
    assert res.returncode != 0 and "absolute cgroup path" in res.stderr


def test_a_restore_stopped_after_making_a_cgroup_again_removes_it(spawn, ptckpt, tmp_path, cgroup):
    """SIGTERM once the stub is seized (the gone cgroup, and the empty one below it, made
    again by then): the restore says it was interrupted, no process of the image is left,
    and the cgroups it made are gone again; the next restore makes them once more."""
    path, key, rel = cgroup
    target = spawn("counter")
    os.mkdir(os.path.join(path, "empty"))
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(target.pid))
    assert ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill").returncode == 0
    target.wait_exit(10)
    wait_pid_free(target.pid)
    os.rmdir(os.path.join(path, "empty"))
    os.rmdir(path)
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach",
                 env={**os.environ, "PTCKPT_TEST_DIE_AT": "restore-stub:1:SIGTERM"})
    assert res.returncode == 128 + signal.SIGTERM, res.stderr
    assert "interrupted by SIGTERM" in res.stderr and "Traceback" not in res.stderr
    wait_pid_free(target.pid)
    assert not os.path.exists(path), "the cgroups the restore made are removed again"
    res = ptckpt("restore", "-D", tmp_path / "img", "--detach")
    assert res.returncode == 0, res.stderr
    target.adopt(target.pid)
    assert _line(target.pid, key).endswith(":" + rel) and os.path.isdir(os.path.join(path, "empty"))
    os.rmdir(os.path.join(path, "empty"))
