"""`ptckpt stop PID|PIDFILE`: end a detached restored tree cleanly.

Only a tree ptckpt restored: the restore left a record of its root (ptckpt.restored), and
a pid without a live one (another process, or the pid reused since) is refused
(NotRestored), unless `force`.

The root gets SIGTERM and a while to end (its own handlers run, as under a shell's kill);
then SIGKILL.  A tree restored with --pidns lives in a pid namespace whose init is
ptckpt's minimal one (it ignores SIGTERM, as every init does): once the root is gone the
init is killed too, which ends whatever else still runs in that namespace.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from . import procfs, restored
from .errors import NoSuchProcess, NotRestored, PtckptError, UsageError


@dataclass(frozen=True)
class Stopped:
    pid: int
    killed: bool            # it did not end on SIGTERM within the timeout
    init_pid: int = 0       # the init of its pid namespace, ended too (0: none)

    def summary(self) -> str:
        how = "killed (SIGTERM was not enough)" if self.killed else "ended on SIGTERM"
        ns = f"; its pid namespace ended with its init {self.init_pid}" if self.init_pid else ""
        return f"stopped {self.pid}: {how}{ns}"


def target_pid(what: str) -> int:
    """A pid, or the pid in a pidfile (restore --pidfile)."""
    text = what
    if not what.isdigit():
        try:
            with open(what) as f:
                text = f.read().strip()
        except OSError as err:
            raise UsageError(f"{what}: not a pid, and no pidfile to read ({err.strerror})") from None
    if not text.isdigit() or int(text) <= 0:
        raise UsageError(f"{what}: not a pid (nor a file holding one)")
    return int(text)


def _running(pid: int) -> bool:
    try:
        return not procfs.read_status(pid).state.startswith(("Z", "X"))
    except PtckptError:
        return False


def namespace_init(pid: int) -> int:
    """The init of `pid`'s own pid namespace, as seen from here, when `pid` lives in one
    that is not ours (its parent is pid 1 there), else 0."""
    try:
        status = procfs.read_status(pid)
        parent = procfs.read_status(status.ppid)
    except PtckptError:
        return 0
    if len(status.nspid) > 1 and len(parent.nspid) == len(status.nspid) and parent.nspid[-1] == 1:
        return status.ppid
    return 0


def stop(pid: int, timeout: float = 5.0, force: bool = False) -> Stopped:
    """End the restored tree whose root is `pid`; with `force`, whatever process `pid` is."""
    if not _running(pid):
        raise NoSuchProcess(pid)
    if not force and restored.recorded(pid) is None:
        raise NotRestored(pid, restored.record_dir())
    init = namespace_init(pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    killed = _running(pid)
    if killed:
        os.kill(pid, signal.SIGKILL)
    if init:
        try:
            os.kill(init, signal.SIGKILL)          # the rest of the namespace goes with it
        except ProcessLookupError:
            pass
    restored.forget(pid)
    return Stopped(pid, killed, init)
