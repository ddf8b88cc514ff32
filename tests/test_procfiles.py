"""A file a process holds open under /proc/PID of a process of its tree is opened again
under that process's restored pid (ptckpt.restore.at_restored_pids)."""

from __future__ import annotations

import os
import signal

import pytest

from test_restore import _dump_kill, _restore
from conftest import kill_pids, reap_orphans, wait_until

PARENT = r"""
import ctypes, os, signal, sys, time
child = os.fork()
if child == 0:
    ctypes.CDLL(None).prctl(15, b"proc-child", 0, 0, 0)       # PR_SET_NAME
    while True: time.sleep(0.05)
time.sleep(0.2)
fd = os.open(f"/proc/{child}/comm", os.O_RDONLY)
def on_usr2(*a):
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(os.pread(fd, 64, 0).decode())
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
signal.signal(signal.SIGUSR2, on_usr2)
print("KID", child, flush=True)
print("READY", os.getpid(), flush=True)
while True: time.sleep(0.05)
"""


@pytest.mark.proc_differs("fds", reason="with --pidns the restored process has another outer pid")
@pytest.mark.parametrize("pidns", [False, True], ids=["same-pids", "pidns"])
def test_a_file_under_proc_of_a_member_follows_it(spawn, ptckpt, tmp_path, pidns):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = spawn(str(script))
    child = int(next(l for l in parent.preamble if l.startswith("KID")).split()[1])
    members = [parent.pid, child]
    try:
        _dump_kill(ptckpt, parent, tmp_path / "img", members)
        pid = _restore(ptckpt, tmp_path / "img", *(["--pidns"] if pidns else []))
        parent.adopt(pid)
        kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
        assert len(kids) == 1
        members.append(int(kids[0]))
        assert os.readlink(f"/proc/{pid}/fd/3") == f"/proc/{kids[0]}/comm"
        os.kill(pid, signal.SIGUSR2)
        wait_until(lambda: os.path.exists(parent.out_path), 5)
        assert open(parent.out_path).read() == "proc-child\n"
    finally:
        kill_pids(members + [parent.pid])
        reap_orphans()
