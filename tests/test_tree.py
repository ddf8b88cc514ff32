"""Process trees: the whole tree is dumped, and restored in the same shape with the same pids."""

from __future__ import annotations

import json
import os
import time

import pytest

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader

from conftest import idle_script, kill_pids, reap_orphans, wait_until
from test_restore import _dump_kill, _one_line, _restore

_TREE = r'''
import os, sys, time
out = sys.argv[1]
kids = []
for i in range(2):
    pid = os.fork()
    if pid == 0:
        me, parent, n = os.getpid(), os.getppid(), 0
        while True:
            n += 1
            if os.getppid() != parent or os.getpid() != me or os.getpgid(0) != os.getpgid(parent):
                open(out + f".{i}", "w").write("FAIL relation\n")
                os._exit(4)
            with open(out + f".{i}", "w") as f:
                f.write(f"{n:20d} {me} {parent}\n")
            time.sleep(0.01)
    kids.append(pid)
print("KIDS", *kids, flush=True)
print("READY", os.getpid(), flush=True)
n = 0
while True:
    n += 1
    with open(out, "w") as f:
        f.write(f"{n:20d}\n")
    time.sleep(0.01)
'''


def _line(path) -> list[str]:
    """The member's state line; its file is rewritten all the time (truncated, then written),
    so a partial read retries, for up to 3 s: a writer descheduled between its truncate
    and its write leaves the file empty that long on a loaded machine."""
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        text = open(path).read()
        assert not text.startswith("FAIL"), text
        if text.endswith("\n"):
            return text.split()
        time.sleep(0.001)
    raise AssertionError(f"{path} never held a whole line")


def _counts(path) -> int:
    return int(_line(path)[0])


def _tree(spawn, tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(_TREE)
    target = spawn(str(script))
    kids = [int(x) for x in next(line for line in target.preamble if line.startswith("KIDS")).split()[1:]]
    wait_until(lambda: all(os.path.exists(f"{target.out_path}.{i}") for i in range(2)), 5)
    return target, kids


def _assert_tree_goes_on(target, kids, pid_of=lambda p: p):
    outs = [str(target.out_path)] + [f"{target.out_path}.{i}" for i in range(2)]
    before = [_counts(o) for o in outs]
    wait_until(lambda: all(_counts(o) > b + 5 for o, b in zip(outs, before)), 10,
               message="every member counts on")
    for i, kid in enumerate(kids):
        _n, me, parent = _line(outs[i + 1])
        assert (int(me), int(parent)) == (kid, target.pid), "getpid/getppid unchanged inside"


def test_tree_is_dumped_whole(spawn, ptckpt, tmp_path):
    target, kids = _tree(spawn, tmp_path)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    assert "3 processes" in res.stderr                         # the summary line
    with ImageReader(tmp_path / "img") as image:
        assert list(image.inventory.pids) == [target.pid] + sorted(kids)
        for kid in kids:
            assert image.process(kid).task.ppid == target.pid
    _assert_tree_goes_on(target, kids)


@pytest.mark.proc_differs("fds", reason="the tree's members open and close their state files all the "
                                       "time: an fd open at the dump may be closed again when the restore "
                                       "is looked at")
def test_tree_round_trip_keeps_shape_and_pids(spawn, ptckpt, tmp_path):
    target, kids = _tree(spawn, tmp_path)
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        for kid in kids:
            wait_until(lambda: not os.path.exists(f"/proc/{kid}"), 5, message=f"{kid} gone")
        assert _restore(ptckpt, tmp_path / "img") == target.pid
        with open(f"/proc/{target.pid}/task/{target.pid}/children") as f:
            assert sorted(int(x) for x in f.read().split()) == sorted(kids)
        _assert_tree_goes_on(target, kids)
    finally:
        kill_pids(kids)
        reap_orphans()


def test_tree_in_a_fresh_pid_namespace(spawn, ptckpt, tmp_path):
    target, kids = _tree(spawn, tmp_path)
    outer = 0
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        res = ptckpt("restore", "-D", tmp_path / "img", "--pidns", "--detach")
        assert res.returncode == 0, res.stderr
        outer = int(res.stdout.split()[-1])
        table = res.stderr.split("pids (virtual -> real): ")[1].strip()
        assert table.startswith(f"{target.pid} -> {outer}, ") and all(f"{k} -> " in table for k in kids)
        with open(f"/proc/{outer}/status") as f:
            nspid = next(line.split()[1:] for line in f if line.startswith("NSpid:"))
        assert int(nspid[-1]) == target.pid
        _assert_tree_goes_on(target, kids)        # the members report their inner pids
    finally:
        if outer:
            with open(f"/proc/{outer}/stat") as f:
                init = int(f.read().rsplit(")", 1)[1].split()[1])
            kill_pids([init])                     # ends the namespace
        kill_pids(kids)
        reap_orphans()


def _init_of(outer: int) -> int:
    with open(f"/proc/{outer}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.proc_differs("fds", reason="the tree's members open and close their state files all the "
                                       "time: an fd open at the dump may be closed again when the restore "
                                       "is looked at")
def test_tree_living_in_a_pid_namespace_is_dumped_with_its_own_pids(spawn, ptckpt, tmp_path):
    """Restored with --pidns, the tree knows itself by its inner pids: a dump of it records
    those (the outer ones beside, for show), and its restore gives them back in a new namespace."""
    target, kids = _tree(spawn, tmp_path)
    inits = []
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        res = ptckpt("restore", "-D", tmp_path / "img", "--pidns", "--detach")
        assert res.returncode == 0, res.stderr
        outer = int(res.stdout.split()[-1])
        inits.append(_init_of(outer))
        outer_kids = sorted(int(x) for x in open(f"/proc/{outer}/task/{outer}/children").read().split())
        _assert_tree_goes_on(target, kids)
        res = ptckpt("dump", outer, "-D", tmp_path / "img2", "--kill")
        assert res.returncode == 0, res.stderr
        with ImageReader(tmp_path / "img2") as image:
            inv = image.inventory
            assert (inv.root_pid, list(inv.pids), inv.pid_level) == (target.pid, [target.pid] + sorted(kids), 1)
            assert (target.pid, outer) in inv.real_pids
            assert sorted(r for v, r in inv.real_pids if v in kids) == outer_kids
            root = image.process(target.pid).task
            assert (root.ppid, root.pgid, root.sid) == (1, target.pid, target.pid)
            assert all(image.process(k).task.ppid == target.pid for k in kids)
        shown = ptckpt("show", tmp_path / "img2", "--summary")
        assert shown.returncode == 0, shown.stderr
        assert "pids (virtual -> real): the tree lived in a pid namespace 1 level(s) below" in shown.stdout
        rows = [line.split() for line in shown.stdout.splitlines()]
        assert [str(target.pid), str(outer), "process"] in [r[:3] for r in rows]
        wait_until(lambda: not os.path.exists(f"/proc/{inits[0]}"), 5, message="the first namespace ended")
        res = ptckpt("restore", "-D", tmp_path / "img2", "--detach")      # no --pidns: the image asks
        assert res.returncode == 0, res.stderr
        assert "in a new pid namespace" in res.stderr
        again = int(res.stdout.split()[-1])
        inits.append(_init_of(again))
        assert again != target.pid
        _assert_tree_goes_on(target, kids)        # inner pids and parents as before
    finally:
        kill_pids(inits)
        kill_pids([target.pid] + kids)
        reap_orphans()


def test_show_prints_the_pid_table_of_a_tree_in_the_dumpers_namespace(spawn, ptckpt, tmp_path):
    target, kids = _tree(spawn, tmp_path)
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img")
    assert res.returncode == 0, res.stderr
    shown = ptckpt("show", tmp_path / "img", "--summary")
    assert "the tree lived in the dumper's pid namespace, virtual = real" in shown.stdout
    as_json = json.loads(ptckpt("show", tmp_path / "img").stdout)
    assert {(r["virtual"], r["real"]) for r in as_json["pids"]} >= {(p, p) for p in [target.pid] + kids}
    rows = [line.split()[:3] for line in shown.stdout.splitlines()]
    for pid in [target.pid] + kids:
        assert [str(pid), str(pid), "process"] in rows


def test_pipe_shared_with_a_process_outside_the_tree_is_refused_naming_both_ends(spawn, ptckpt, tmp_path):
    holder = spawn(str(idle_script(tmp_path, "holder.py", "import os, time\nr, w = os.pipe()\n"
                                   "open(__file__ + '.fds', 'w').write(f'{r} {w}')\n")), out=False)
    r, w = map(int, open(tmp_path / "holder.py.fds").read().split())
    # The writer opens the holder's pipe through /proc: one pipe, two processes, no common tree.
    writer = spawn(str(idle_script(tmp_path, "writer.py", "import os, time\n"
                                   f"w = os.open('/proc/{holder.pid}/fd/{w}', os.O_WRONLY)\n")), out=False)
    res = ptckpt("dump", writer.pid, "-D", tmp_path / "img")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"process {writer.pid} fd", "pipe:[",
              "outside the tree", f"pid {holder.pid} fd")
    assert not (tmp_path / "img").exists()
    with open(f"/proc/{writer.pid}/status") as f:
        assert "TracerPid:\t0" in f.read(), "the writer runs on, untraced"


_SESSIONS = r'''
import os, signal, sys, time
def child(fn):
    pid = os.fork()
    if pid == 0:
        fn()
        while True:
            time.sleep(0.05)
    return pid
def leader():                     # a session of three: A (leader), B (its own group), C (in B's group)
    os.setsid()
    b = child(lambda: os.setpgid(0, 0))
    time.sleep(0.2)
    child(lambda: os.setpgid(0, b))
a = child(leader)
stopped = child(lambda: os.kill(os.getpid(), signal.SIGSTOP))
time.sleep(0.6)
print("READY", os.getpid(), flush=True)
while True:
    time.sleep(0.05)
'''


def _stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return {"state": fields[0], "ppid": int(fields[1]), "pgid": int(fields[2]), "sid": int(fields[3])}


def _descendants(pid):
    out = []
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        for c in map(int, f.read().split()):
            out += [c] + _descendants(c)
    return out


def test_sessions_groups_and_stopped_members_survive(spawn, ptckpt, tmp_path):
    script = tmp_path / "sessions.py"
    script.write_text(_SESSIONS)
    target = spawn(str(script), out=False)
    members = [target.pid] + _descendants(target.pid)
    assert len(members) == 5
    before = {p: _stat(p) for p in members}
    assert sum(1 for s in before.values() if s["state"] == "T") == 1
    assert len({s["sid"] for s in before.values()}) == 2          # the spawn's and A's sessions
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        for p in members:
            wait_until(lambda: not os.path.exists(f"/proc/{p}"), 5, message=f"{p} gone")
        _restore(ptckpt, tmp_path / "img")
        wait_until(lambda: all(_stat(p)["state"] != "t" for p in members), 5)
        after = {p: _stat(p) for p in members}
        for p in members:
            for key in ("ppid", "pgid", "sid"):
                assert after[p][key] == before[p][key], (p, key, before[p], after[p])
            assert (after[p]["state"] == "T") == (before[p]["state"] == "T"), (p, after[p])
    finally:
        kill_pids(members)
        reap_orphans()


def test_failure_halfway_kills_every_member(spawn, ptckpt, tmp_path):
    """The child's file became a directory: its reopen fails after the parent was rebuilt, and
    neither the parent nor the child is left behind."""
    data = tmp_path / "child.txt"
    script = idle_script(tmp_path, "halfway.py",
                         "import os, time\n"
                         "if os.fork() == 0:\n"
                         f"    f = open({str(data)!r}, 'w')\n"
                         "    while True: time.sleep(0.05)\n")
    target = spawn(str(script), out=False)
    wait_until(lambda: data.exists(), 5)
    with open(f"/proc/{target.pid}/task/{target.pid}/children") as f:
        child = int(f.read().split()[0])
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        wait_until(lambda: not os.path.exists(f"/proc/{child}"), 5)
        data.unlink()
        data.mkdir()
        _one_line(ptckpt("restore", "-D", tmp_path / "img", "--file-policy", "ignore"),
                  ExitCode.REMOTE_SYSCALL, "killed", "openat", "EISDIR", str(data))
        reap_orphans()
        wait_until(lambda: not os.path.exists(f"/proc/{target.pid}") and not os.path.exists(f"/proc/{child}"),
                   5, message="no member left")
    finally:
        kill_pids([child])
        reap_orphans()


_ORPHANED_GROUP = r'''
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)           # subreaper: the grandchild comes back to us
r, w = os.pipe()
leader = os.fork()
if leader == 0:
    os.setpgid(0, 0)
    if os.fork() == 0:                            # stays in the group after its leader exits
        while True: time.sleep(0.05)
    os._exit(0)
os.waitpid(leader, 0)
print("LEADER", leader, flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
'''


def test_process_group_whose_leader_exited_is_recreated(spawn, ptckpt, tmp_path):
    script = tmp_path / "orphaned.py"
    script.write_text(_ORPHANED_GROUP)
    target = spawn(str(script), out=False)
    leader = int(next(line for line in target.preamble if line.startswith("LEADER")).split()[1])
    [member] = _descendants(target.pid)
    assert _stat(member)["pgid"] == leader and not os.path.exists(f"/proc/{leader}")
    try:
        _dump_kill(ptckpt, target, tmp_path / "img")
        wait_until(lambda: not os.path.exists(f"/proc/{member}"), 5)
        _restore(ptckpt, tmp_path / "img")
        after = _stat(member)
        assert (after["ppid"], after["pgid"], after["sid"]) == (target.pid, leader, _stat(target.pid)["sid"])
        assert not os.path.exists(f"/proc/{leader}"), "the stand-in leader is gone, and reaped"
        assert _descendants(target.pid) == [member]
    finally:
        kill_pids([member])
        reap_orphans()


_FORKER = r'''
import os, time
print("READY", os.getpid(), flush=True)
while True:
    pid = os.fork()
    if pid == 0:
        time.sleep(0.02)
        os._exit(3)
    while True:
        try:
            got, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if not got:
            break
    time.sleep(0.001)
'''


def test_a_tree_forking_during_the_freeze_is_dumped_whole(spawn, ptckpt, tmp_path):
    """Forks racing the freeze: every dump holds a closed tree (each member's parent is in it,
    zombies are recorded with their parent) and the forker runs on."""
    script = tmp_path / "forker.py"
    script.write_text(_FORKER)
    target = spawn(str(script), out=False)
    for i in range(5):
        image_dir = tmp_path / f"img{i}"
        res = ptckpt("dump", target.pid, "-D", image_dir)
        assert res.returncode == 0, res.stderr
        with ImageReader(image_dir) as image:
            pids = set(image.inventory.pids)
            for p in image.inventory.pids[1:]:
                assert image.process(p).task.ppid in pids
            assert all(z.ppid in pids for z in image.zombies)
    time.sleep(0.1)
    assert _stat(target.pid)["state"] in "RS"
    reap_orphans()
