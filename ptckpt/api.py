"""The Python API: `ptckpt dump` and `ptckpt restore` as functions, with keyword options
named after the command's flags.

    import signal, ptckpt

    image = ptckpt.dump(pid, "/tmp/ckpt", leave_running=False)      # ptckpt dump PID --kill
    proc = ptckpt.restore("/tmp/ckpt", pidns=True)                   # ptckpt restore --pidns
    proc.signal(signal.SIGUSR1)
    status = proc.wait(timeout=30)                                   # its exit status
    proc.kill()                                                      # (nothing if it ended)
    ptckpt.api.stop("/tmp/pid")                                      # ptckpt stop /tmp/pid

Errors are the CLI's: every one is a :class:`ptckpt.errors.PtckptError` with the message the
command prints and the exit code it exits with (``err.exit_code``).

A restored process is a child of the calling process (so is the minimal init of a --pidns
restore, which is what :meth:`Restored.wait` waits for then): the handle waits only for
that process, never for other children of the caller.
"""

from __future__ import annotations

import os
import signal as _signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .dump import DumpMode, DumpResult
from .pipeline.dump import dump as _dump
from .errors import UsageError
from .plugins import Plugin, load_plugin
from .resources.filepolicy import FilePolicy, parse_policy

if TYPE_CHECKING:
    from .stop import Stopped

__all__ = ["dump", "restore", "stop", "Restored", "DumpResult"]


def _plugins(plugins: Sequence[Plugin | str]) -> list[Plugin]:
    """Plugin objects, or the CLI's --plugin specs (module:Class, file.py[:Class], an entry
    point name) loaded as the command would."""
    return [load_plugin(p) if isinstance(p, str) else p for p in plugins]


def dump(pid: int, directory: str | os.PathLike | None = None, *, leave_running: bool = True,
         tcp_established: bool = False, tcp_close: bool = False, ext_unix_sk: bool = False,
         save_files: Sequence[str] = (), skip_files: Sequence[str] = (),
         plugins: Sequence[Plugin | str] = (), external: Sequence[str] = (),
         critical_timeout: float = 10.0, prev: str | os.PathLike | None = None, track_mem: bool = False,
         compress: str | None = None, background: bool | None = None) -> DumpResult:
    """``ptckpt dump PID -D DIRECTORY``: checkpoint `pid` and all its descendants.

    `leave_running=False` is ``--kill``; `ext_unix_sk` is ``--ext-unix-sk``.  `save_files`, `skip_files` and `external` take
    what ``--save-file``, ``--skip-file`` and ``--external`` take, one item each.  `prev`,
    `track_mem`, `compress` ("zstd[:LEVEL]") and `background` (None: by size; False is
    ``--freeze-all``) are the options of the same names.  Returns the result the command
    summarises (directory, pids, threads, pages, bytes, seconds, warnings)."""
    loaded = _plugins(plugins)
    if external:
        from .builtins import External
        loaded.append(External(list(external)))
    return _dump(pid, os.fspath(directory) if directory is not None else None,
                 mode=DumpMode.LEAVE_RUNNING if leave_running else DumpMode.KILL,
                 save_files=save_files, skip_files=skip_files, plugins=loaded,
                 critical_timeout=critical_timeout, tcp_established=tcp_established, tcp_close=tcp_close,
                 ext_unix_sk=ext_unix_sk, prev=os.fspath(prev) if prev is not None else None, track_mem=track_mem,
                 compress=_compression(compress),
                 background=background if leave_running or background else False)


def _compression(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    from .formats.compression import parse_spec
    try:
        return parse_spec(spec)
    except ValueError as err:
        raise UsageError(f"compress: {err}") from None


@dataclass
class Restored:
    """A restored process tree, as :func:`restore` leaves it: running, a child of the caller.

    `pid` is the root's pid as the caller sees it, `vpid` the image's (what the process
    itself sees), `pids` every process's (image pid -> pid here), `init_pid` the minimal
    init of a pid-namespaced restore (0 without).  After a lazy restore, `page_server` is
    the pid of the process putting its memory in (it exits when all is in; 0 without) and
    `page_server_log` its log."""

    pid: int
    vpid: int
    init_pid: int = 0
    pids: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    page_server: int = 0
    page_server_log: str = ""
    _status: int | None = None

    @property
    def waited(self) -> int:
        """What wait() waits for: the init of a --pidns restore (it ends with the root, and
        its status is the root's), else the root itself."""
        return self.init_pid or self.pid

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the tree's root to end; its shell-style status (128+N for signal N), or
        None if it still runs after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._status is None:
            try:
                got, status = os.waitpid(self.waited, 0 if deadline is None else os.WNOHANG)
            except ChildProcessError:           # reaped by someone else: status unknown
                self._status = 0
                break
            if got == self.waited:
                from .restore import shell_status
                from .restored import forget
                self._status = shell_status(status)
                forget(self.pid)                # the tree ended: `ptckpt stop` has nothing to end
                break
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)
        return self._status

    def alive(self) -> bool:
        return self.wait(timeout=0) is None

    def signal(self, sig: int = _signal.SIGTERM) -> None:
        """Send `sig` to the root (nothing if it has ended)."""
        if self.alive():
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """End the whole tree (its pid namespace too) and reap what is the caller's."""
        if not self.alive():
            return
        for p in (self.init_pid, *self.pids.values(), self.pid):
            if p:
                try:
                    os.kill(p, _signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.wait()


def restore(directory: str | os.PathLike, *, pidns: bool = False, netns: bool = False,
            file_policy: FilePolicy | Sequence[str] = (), plugins: Sequence[Plugin | str] = (),
            hold_timeout: float = 30.0, lazy: bool = False) -> Restored:
    """``ptckpt restore -D DIRECTORY --detach``: recreate the image's processes and return
    once they run (``--lazy`` with `lazy`).  `file_policy` takes a FilePolicy or what ``--file-policy`` takes (e.g.
    ``["warn"]`` or ``["/slot3/=ignore"]``)."""
    from .resources.pids import become_subreaper
    from .pipeline.restore import restore as _restore
    from .restore import shell_status
    if not isinstance(file_policy, FilePolicy):
        try:
            file_policy = parse_policy(list(file_policy))
        except ValueError as err:
            raise UsageError(str(err)) from None
    become_subreaper()                  # orphans of the tree come back to the caller, not init
    result = _restore(os.fspath(directory), pidns=pidns, netns=netns, file_policy=file_policy,
                      plugins=_plugins(plugins), hold_timeout=hold_timeout, lazy=lazy)
    restored = Restored(pid=result.pid, vpid=result.vpid, init_pid=result.init_pid, pids=dict(result.pids),
                        seconds=result.seconds, warnings=list(result.warnings),
                        page_server=result.lazy_server, page_server_log=result.lazy_log)
    if result.exit_status is not None and not result.init_pid:
        restored._status = shell_status(result.exit_status)
    return restored


def stop(target: int | str | os.PathLike, *, timeout: float = 5.0, force: bool = False) -> Stopped:
    """``ptckpt stop PID|PIDFILE``: end a tree ptckpt restored (SIGTERM to its root, SIGKILL
    after `timeout` seconds, a --pidns tree's init too).  `target` is its pid or the file
    ``restore --pidfile`` wrote.  A process ptckpt did not restore is refused
    (:class:`ptckpt.errors.NotRestored`) unless `force` (``--force``).  Returns what the
    command summarises (pid, killed, init_pid)."""
    from .stop import stop as _stop, target_pid
    pid = target if isinstance(target, int) else target_pid(os.fspath(target))
    return _stop(pid, timeout, force=force)
