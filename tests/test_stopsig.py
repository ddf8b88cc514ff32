"""A stopped child comes back stopped by the signal that stopped it (SIGTSTP, SIGTTIN, not
always SIGSTOP): its parent's waitid(WSTOPPED) and waitpid(WUNTRACED) report that signal after
the restore, and SIGCONT lets it go on (CRIU's zdtm static/stopped, stopped01-04)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import Sigaction
from ptckpt.resources import pids, signals

from conftest import proc_stat, wait_until
from test_restore import _dump_kill, _restore


def _stopped_family(spawn, *args):
    target = spawn("stopsig", *args)
    child = int(next(line for line in target.preamble if line.startswith("CHILD")).split()[1])
    wait_until(lambda: proc_stat(child).state == "T", 5, message=f"child {child} stopped")
    return target, child


@pytest.mark.parametrize("stop, again", [("TSTP", ""), ("TTIN", ""), ("STOP", "kill"),
                                         ("STOP", "tkill"), ("STOP", "pending-tstp")])
def test_stopped_child_keeps_its_stop_signal(spawn, ptckpt, tmp_path, stop, again):
    target, child = _stopped_family(spawn, stop, *([again] if again else []))
    _dump_kill(ptckpt, target, tmp_path / "img", members=[child])
    with ImageReader(tmp_path / "img") as image:
        task = image.process(child).task
    assert (task.state, task.stop_signal) == ("T", getattr(signal, f"SIG{stop}"))
    assert _restore(ptckpt, tmp_path / "img") == target.pid
    wait_until(lambda: proc_stat(child).state == "T", 5, message=f"restored child {child} stopped")
    target.signal()
    target.wait_for_line(rf"^VERIFY 1 OK {stop}$")
    assert "CHILD continued" in target.out_lines()
    assert target.wait_exit() == 0
    target.assert_ok()


def test_orphaned_process_groups_are_told_apart(spawn):
    """The parent leads its own session (spawn's start_new_session), whose parent is outside
    it: orphaned.  The child's group has the parent, in the same session, outside it: not."""
    target, child = _stopped_family(spawn, "STOP")
    assert pids.pgrp_orphaned(target.pid)
    assert not pids.pgrp_orphaned(child)


def _stopped(stop_signal, *, handler=0, sigmask=0):
    return SimpleNamespace(task=SimpleNamespace(pid=7, pgid=7, stop_signal=stop_signal),
                           sigactions=[Sigaction(signal.SIGTSTP, handler, 0, 0, 0)],
                           threads=[SimpleNamespace(sigmask=sigmask)])


def _never_asked():
    raise AssertionError("SIGSTOP stops an orphaned process group too: no need to ask")


def test_where_the_signal_would_not_stop_it_sigstop_does():
    tstp = signal.SIGTSTP
    assert signals.stop_signal_again(_stopped(tstp), lambda: False) == (tstp, "")
    assert signals.stop_signal_again(_stopped(0), _never_asked) == (signal.SIGSTOP, "")      # format 12
    assert signals.stop_signal_again(_stopped(signal.SIGSTOP), _never_asked) == (signal.SIGSTOP, "")
    for proc, orphaned, words in ((_stopped(tstp), True, "process group 7 is orphaned"),
                                  (_stopped(tstp, handler=0x401000), False, "a disposition for SIGTSTP"),
                                  (_stopped(tstp, sigmask=1 << (tstp - 1)), False, "every thread blocks")):
        sig, why = signals.stop_signal_again(proc, lambda: orphaned)
        assert sig == signal.SIGSTOP and "stopped by SIGTSTP" in why and words in why, why
