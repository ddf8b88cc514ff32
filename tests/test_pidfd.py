"""pidfds round-trip (CRIU's zdtm static/pidfd_*): a pidfd of a member of the tree refers to the
restored process, one of a dead process to a dead process (the pidfds of one dead process to one),
with their flags; a pidfd of a process outside the tree, or of a thread, is refused at dump."""

from __future__ import annotations

from ptckpt.errors import ExitCode
from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import FdKind, PidfdState

from conftest import pid_alive
from test_restore import _dump_kill, _one_line, _restore


def _preamble(target, key: str) -> int:
    return int(next(line for line in target.preamble if line.startswith(key + " ")).split()[1])


def test_pidfds_of_self_child_zombie_and_dead_come_back(spawn, ptckpt, tmp_path):
    target = spawn("pidfds")
    child, zombie = _preamble(target, "CHILD"), _preamble(target, "ZOMBIE")
    _dump_kill(ptckpt, target, tmp_path / "img", members=[child, zombie])
    with ImageReader(tmp_path / "img") as image:
        states = {s.desc: s for s in image.fd_states if isinstance(s, PidfdState)}
        fds = {f.fd: f for f in image.process(target.pid).fds if f.kind is FdKind.PIDFD}
    by_pid: dict[int, list[PidfdState]] = {}
    for f in fds.values():
        by_pid.setdefault(states[f.desc].pid, []).append(states[f.desc])
    assert set(by_pid) == {target.pid, child, zombie, -1}, by_pid
    dead = by_pid[-1]
    assert len(dead) == 2 and dead[0].target == dead[1].target, "one dead process, one target"
    assert len({s.target for s in states.values()}) == 4
    flags = {s.flags for s in by_pid[target.pid]}
    assert {0, 0o4000} <= flags <= {0, 0o4000, 0o200}         # PIDFD_NONBLOCK, PIDFD_THREAD kept
    assert _restore(ptckpt, tmp_path / "img") == target.pid
    target.signal()
    target.wait_for_line(r"^VERIFY 1 OK$")        # fdinfo, signals, inodes, poll, waitid: its checks
    assert target.wait_exit() == 0
    target.assert_ok()


def test_pidfd_of_a_process_outside_the_tree_is_refused_at_dump(spawn, ptckpt, tmp_path):
    target = spawn("pidfds", "outside")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, "pidfd of process", "outside the tree",
              "close the pidfd before the dump")
    assert not (tmp_path / "img").exists()
    assert pid_alive(target.pid), "a refused dump leaves the target running"
    target.signal()                               # it goes on
    assert target.alive()


def test_pidfd_of_another_thread_is_refused_at_dump(spawn, ptckpt, tmp_path):
    target = spawn("pidfds", "thread")
    tid = _preamble(target, "THREAD")
    res = ptckpt("dump", target.pid, "-D", tmp_path / "img", "--kill")
    _one_line(res, ExitCode.UNSUPPORTED_RESOURCE, f"pidfd of thread {tid}", "not its leader")
    assert pid_alive(target.pid)
