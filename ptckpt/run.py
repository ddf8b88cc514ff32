"""``ptckpt run``: a command under ptckpt's supervision, and ``ptckpt control`` to talk to it.

:class:`Supervisor` starts the command as its child with ``PTCKPT_CONTROL`` (its
control socket, DIR/control.sock) in the environment, and until the command ends:

* takes a checkpoint (a leave-running dump, DIR/ckpt-NNNN) every `interval`,
  when the program asks for one through its app block (ptckpt.app.checkpoint(),
  ptckpt_checkpoint() of ptckpt.h), and when a control client says ``checkpoint``;
* answers control clients, one JSON line per command line: ``checkpoint``
  (``{"ok": true, "image": DIR}``), ``status`` (the pid, the command, every
  checkpoint taken and every one that failed) and ``stop`` (the command's tree is
  killed; the run ends).

The run ends with the command's exit status (shell-style, 128+N for a signal).
The tracer only attaches while it dumps: between checkpoints the command runs
untraced.  :func:`control` is the client side.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from . import appblock, procfs
from .errors import ControlError, PtckptError, UsageError

log = logging.getLogger("ptckpt.run")

SOCKET_NAME = "control.sock"
ENV = "PTCKPT_CONTROL"


@dataclass
class Checkpoint:
    image: str
    reason: str                 # "interval" | "program" | "control"
    seconds: float
    frozen_seconds: float
    at: float                   # time.time()


@dataclass
class RunState:
    pid: int
    command: list[str]
    directory: str
    interval: float
    checkpoints: list[Checkpoint] = field(default_factory=list)
    failures: list[dict] = field(default_factory=list)


class Supervisor:
    def __init__(self, argv: Sequence[str], directory: str, *, interval: float = 0.0,
                 critical_timeout: float = 10.0, tcp_established: bool = False, tcp_close: bool = False,
                 incremental: bool = True, keep: int = 0, compress: tuple[str, int] | None = None):
        if not argv:
            raise UsageError("ptckpt run needs a command (after --)")
        self.argv = list(argv)
        self.directory = os.path.abspath(directory)
        self.interval = interval
        self.critical_timeout = critical_timeout
        self.tcp = dict(tcp_established=tcp_established, tcp_close=tcp_close)   # dump's TCP policy
        self.incremental, self.keep, self.compress = incremental, keep, compress
        self.child: subprocess.Popen | None = None
        self.listener: socket.socket | None = None
        self.clients: list[socket.socket] = []
        self.state: RunState | None = None
        self._block: int | None = None
        self._block_checked = 0.0

    # --- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        os.chmod(self.directory, 0o700)
        path = os.path.join(self.directory, SOCKET_NAME)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o077)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(8)
        env = dict(os.environ, **{ENV: path})
        try:
            self.child = subprocess.Popen(self.argv, env=env, close_fds=True)
        except OSError as err:
            self.close()
            raise UsageError(f"cannot run {self.argv[0]}: {err.strerror}") from None
        self.state = RunState(self.child.pid, self.argv, self.directory, self.interval)
        log.info("run %s as %d, control socket %s", self.argv[0], self.child.pid, path)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self.clients.clear()
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, SOCKET_NAME))

    def run(self) -> int:
        """Supervise until the command ends; its shell-style exit status.  The caller becomes
        a child subreaper first, so that the command's orphans come back to it."""
        from .resources.pids import become_subreaper
        become_subreaper()
        self.start()
        try:
            return self.loop()
        finally:
            self.stop_child()
            self.close()

    def loop(self) -> int:
        next_interval = time.monotonic() + self.interval if self.interval else None
        while True:
            status = self.child.poll()
            if status is not None:
                return 128 - status if status < 0 else status
            if next_interval is not None and time.monotonic() >= next_interval:
                self.checkpoint("interval")
                next_interval = time.monotonic() + self.interval
            block = self._app_block()
            if block is not None:
                with contextlib.suppress(PtckptError):
                    if appblock.requested(self.child.pid, block):
                        self.checkpoint("program")
            ready, _, _ = select.select([self.listener] + self.clients, [], [], 0.01)
            for s in ready:
                if s is self.listener:
                    conn, _ = self.listener.accept()
                    self.clients.append(conn)
                elif self._serve(s) == "stop":
                    self.stop_child()
                    status = self.child.wait()
                    return 128 - status if status < 0 else status

    def stop_child(self) -> None:
        """Kill the command and every process it started that is still its descendant."""
        if self.child is None or self.child.poll() is not None:
            return
        from .dump import running_tree
        with contextlib.suppress(PtckptError):
            for pid in reversed(running_tree(self.child.pid)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.child.wait()

    # --- checkpoints -------------------------------------------------------------
    def _app_block(self) -> int | None:
        """The command's app block (looked for again every half second until found: a
        Python program maps it on first use)."""
        if self._block is None and time.monotonic() - self._block_checked > 0.5:
            self._block_checked = time.monotonic()
            self._block = appblock.locate(self.child.pid)
        return self._block

    def checkpoint(self, reason: str) -> dict:
        from .dump import DumpMode
        from .pipeline.dump import dump
        n = len(self.state.checkpoints) + len(self.state.failures) + 1
        directory = os.path.join(self.directory, f"ckpt-{n:04d}")
        log.info("checkpoint %d (%s) -> %s", n, reason, directory)
        last = self.state.checkpoints[-1].image if self.state.checkpoints else None
        try:
            result = dump(self.child.pid, directory, mode=DumpMode.LEAVE_RUNNING,
                          critical_timeout=self.critical_timeout, **self.tcp, compress=self.compress,
                          track_mem=self.incremental, prev=last if self.incremental else None,
                          background=None)
        except PtckptError as err:
            self.state.failures.append({"reason": reason, "error": str(err), "at": time.time()})
            log.warning("checkpoint %d failed: %s", n, err)
            block = self._app_block()
            if reason == "program" and block is not None:
                with contextlib.suppress(PtckptError):      # the program stops waiting
                    appblock.mark(self.child.pid, block, appblock.FAILED, "")
            return {"ok": False, "error": str(err)}
        self.state.checkpoints.append(Checkpoint(result.directory, reason, round(result.seconds, 3),
                                                 round(result.frozen_seconds, 3), time.time()))
        self._retire()
        return {"ok": True, "image": result.directory}

    def _retire(self) -> None:
        """--keep N: the oldest checkpoints go, each folded into the next one first
        (in place: the next keeps its id, so the chain after it still holds)."""
        from .compact import compact
        while self.keep and len(self.state.checkpoints) > self.keep:
            oldest, nxt = self.state.checkpoints[0], self.state.checkpoints[1]
            try:
                if self.incremental:
                    compact(nxt.image)
                shutil.rmtree(oldest.image)
            except (PtckptError, OSError) as err:
                log.warning("cannot retire checkpoint %s: %s", oldest.image, err)
                return
            log.info("retired %s", oldest.image)
            self.state.checkpoints.pop(0)

    # --- control ---------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> str:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            self.clients.remove(conn)
            conn.close()
            return ""
        command = data.decode(errors="replace").strip().split()[0] if data.strip() else ""
        if command == "checkpoint":
            reply = self.checkpoint("control")
        elif command == "status":
            reply = {"ok": True, "running": self.child.poll() is None, **asdict(self.state)}
        elif command == "stop":
            reply = {"ok": True, "stopped": self.child.pid}
        else:
            reply = {"ok": False, "error": f"unknown command {command!r} (checkpoint, status, stop)"}
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(reply).encode() + b"\n")
        return command


# --- the client -------------------------------------------------------------------

def control_socket(target: str) -> str:
    """TARGET: the run's control socket, its directory, or the pid of the run or its command."""
    if os.path.isdir(target):
        target = os.path.join(target, SOCKET_NAME)
    if not target.isdigit():
        if not os.path.exists(target):
            raise ControlError(f"no run at {target}: no such socket")
        return target
    pid = int(target)
    for candidate in [pid] + procfs.children_or_none(pid):
        path = _control_env(candidate)
        if path:
            return path
    raise ControlError(f"process {pid} is not a `ptckpt run` nor run by one (no {ENV} in its environment)")


def _control_env(pid: int) -> str | None:
    """PTCKPT_CONTROL in the process's environment, or None."""
    try:
        entries = procfs.read_environ(pid)
    except PtckptError:
        return None
    return next((e.partition("=")[2] for e in entries if e.startswith(ENV + "=")), None)


def control(target: str, command: str, timeout: float = 120.0) -> dict:
    """Send `command` to the run at `target`; its JSON reply."""
    path = control_socket(target)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(path)
            s.sendall(command.encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        except OSError as err:
            raise ControlError(f"the run at {path} does not answer: {err.strerror or err}") from None
    if not reply:
        raise ControlError(f"the run at {path} closed the connection without an answer")
    return json.loads(reply)
