"""A dumper interrupted at random moments (SIGINT, SIGTERM, SIGKILL) leaves no network lock
behind once the next ptckpt command ran, and the target's connections carry on.

The target is a real process holding an established TCP connection to the test (a peer
outside the tree), dumped with --tcp-established while it runs: the dump locks the
connection with nftables and reads it in repair mode.  SIGINT and SIGTERM unwind the dump
(the lock removed, repair mode ended, the target resumed); after SIGKILL the kernel resumes
the target and the next ptckpt command (here `ptckpt check`) removes the dead dumper's
lock and takes the connection out of repair mode.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from ptckpt import netlock
from conftest import needs_network_lock, kill_pids, trials, wait_until

pytestmark = needs_network_lock()

ECHO = r"""
import os, socket, sys
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
listener.close()
while True:
    data = conn.recv(65536)
    if not data:
        break
    conn.sendall(data)
"""


@pytest.fixture
def echo_target():
    proc = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True, text=True)
    try:
        port = int(proc.stdout.readline())
        peer = socket.create_connection(("127.0.0.1", port), timeout=5)
        yield proc, peer
    finally:
        kill_pids([proc.pid])
        proc.wait()


def _echo_works(peer: socket.socket, n: int) -> None:
    message = f"ping {n} ".encode() * 1000
    peer.sendall(message)
    got = b""
    deadline = time.monotonic() + 10
    while len(got) < len(message) and time.monotonic() < deadline:
        got += peer.recv(1 << 16)
    assert got == message, f"trial {n}: the connection did not carry on ({len(got)} of {len(message)} bytes)"


def _ptckpt(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ptckpt", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, **kw)


def _handles_signals(pid: int) -> bool:
    """ptckpt's own handlers are in (SIGTERM caught): the command has begun.  Before that
    the interpreter is still starting and nothing of a dump has happened yet; a signal
    then ends it with Python's own words (or none), which is not what is tested here."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return True                                       # it ended already
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _state(pid: int) -> tuple[str, int]:
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return fields["State"].split()[0], int(fields["TracerPid"])


def test_interrupted_dumps_leave_no_lock_and_the_connection_carries_on(echo_target, tmp_path):
    proc, peer = echo_target
    _echo_works(peer, -1)
    started = time.monotonic()
    done = _ptckpt("dump", str(proc.pid), "-D", str(tmp_path / "whole"), "--tcp-established")
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0, err
    span = time.monotonic() - started
    _echo_works(peer, 0)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    dumpers: list[int] = []
    sent = [sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL) for _ in range(trials(6))]
    rng.shuffle(sent)
    for n, sig in enumerate(sent, 1):
        directory = tmp_path / f"ckpt-{n}"
        dumper = _ptckpt("dump", str(proc.pid), "-D", str(directory), "--tcp-established")
        dumpers.append(dumper.pid)
        wait_until(lambda: _handles_signals(dumper.pid), timeout=10, interval=0.001)
        time.sleep(rng.uniform(0.0, span))
        dumper.send_signal(sig)
        _out, err = dumper.communicate(timeout=60)
        where = f"trial {n} ({signal.Signals(sig).name}, seed {seed}): rc {dumper.returncode}: {err.strip()}"
        if sig != signal.SIGKILL and dumper.returncode != 0:
            assert "Traceback" not in err, where
            assert err.strip().count("\n") == 0, where             # one line
        checker = _ptckpt("check")                                 # the next ptckpt command
        checker.communicate(timeout=60)
        left = [i for i in netlock.list_locks() if i.owner_pid in dumpers]
        assert not left, f"{where}: locks left: {[i.id for i in left]}"
        wait_until(lambda: _state(proc.pid)[1] == 0, timeout=5)
        assert proc.poll() is None, f"{where}: the target died"
        state, tracer = _state(proc.pid)
        assert state in "SR" and tracer == 0, f"{where}: target {state}, traced by {tracer}"
        _echo_works(peer, n)
        shutil.rmtree(directory, ignore_errors=True)
        for stale in tmp_path.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
