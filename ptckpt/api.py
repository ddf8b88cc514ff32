"""The Python API, the one way in: the ``ptckpt`` command (ptckpt.cli), plugins' authors and
tests all call these functions.  Every option of ``ptckpt dump``, ``ptckpt pre-dump`` and
``ptckpt restore`` is a keyword here, named after its flag (``--remap-path`` is
`remap_path`); what the command prints is the value returned.

    import signal, ptckpt

    image = ptckpt.dump(pid, "/tmp/ckpt", leave_running=False)      # ptckpt dump PID --kill
    proc = ptckpt.restore("/tmp/ckpt", pidns=True,                   # ptckpt restore --pidns
                          remap_path=["/slot3=/slot7"], set_env={"DISPLAY": ":7"})
    proc.signal(signal.SIGUSR1)
    status = proc.wait(timeout=30)                                   # its exit status
    proc.kill()                                                      # (nothing if it ended)
    ptckpt.api.stop("/tmp/pid")                                      # ptckpt stop /tmp/pid

Only ``restore --detach`` and ``--pidfile`` have no keyword: :func:`restore` always returns
once the tree runs, and the :class:`Restored` handle it returns replaces them (its `pid`,
`wait()`, `signal()`).  ``--json`` is the command's way of printing the same result.

Each option's text is parsed here and nowhere else: a compression spec by
:func:`parse_compress`, a duration by :func:`parse_duration`, file policies by
:func:`parse_file_policy`, plugin specs by :func:`load_plugins`.  Errors are the CLI's: every one is a
:class:`ptckpt.errors.PtckptError` with the message the command prints and the exit code it
exits with (``err.exit_code``); bad usage is a :class:`ptckpt.errors.UsageError`.

A restored process is a child of the calling process (so is the minimal init of a --pidns
restore, which is what :meth:`Restored.wait` waits for then): the handle waits only for
that process, never for other children of the caller.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import signal as _signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import UsageError

if TYPE_CHECKING:
    from .dump import DumpResult
    from .group import GroupDumpResult, GroupRestoreResult
    from .plugins import Plugin
    from .resources.filepolicy import FilePolicy
    from .restore import Finding, RestoreResult
    from .stop import Stopped

__all__ = ["dump", "pre_dump", "restore", "stop", "check_image", "group_dump", "group_restore", "Restored", "DumpResult",
           "parse_compress", "parse_duration", "parse_file_policy", "load_plugins"]



def __getattr__(name: str):
    """api.DumpResult (dump's result type), imported when first asked for: the API itself
    imports the library only in the function called, so that the CLI's commands that need
    none of it (compact, run, check) start fast."""
    if name == "DumpResult":
        from .dump import DumpResult
        return DumpResult
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --- each option's text, parsed in one place --------------------------------------------

def parse_compress(spec: str | None) -> tuple[str, int] | None:
    """``--compress zstd[:LEVEL]`` -> ("zstd", LEVEL) (level 3 unless given), None for none.
    The one parser of the spec: dump, pre-dump, run and compact all come here."""
    if not spec:
        return None
    from .formats.compression import parse_spec
    try:
        return parse_spec(spec)
    except ValueError as err:
        raise UsageError(f"--compress: {err}") from None


def parse_duration(value: float | str) -> float:
    """Seconds: a number as it is, or the text a flag takes ("10s", "2m", "500ms")."""
    if isinstance(value, str):
        from .units import parse_duration as from_text
        return from_text(value)
    return float(value)


def parse_file_policy(policy: FilePolicy | Sequence[str] | None) -> FilePolicy:
    """``--file-policy`` items (strict, warn, ignore, PATTERN=POLICY) -> a FilePolicy."""
    from .resources.filepolicy import FilePolicy, parse_policy
    if isinstance(policy, FilePolicy):
        return policy
    try:
        return parse_policy(list(policy or ()))
    except ValueError as err:
        raise UsageError(str(err)) from None


def load_plugins(plugins: Sequence[Plugin | str]) -> list[Plugin]:
    """Plugin objects, or ``--plugin`` specs (module:Class, file.py[:Class], an entry point
    name) loaded as the command loads them."""
    from .plugins import load_plugin
    return [load_plugin(p) if isinstance(p, str) else p for p in plugins]


def _pairs(values: Sequence[str] | Mapping[str, str]) -> list[str]:
    if isinstance(values, Mapping):
        return [f"{k}={v}" for k, v in values.items()]
    if isinstance(values, str):
        raise UsageError(f"a list of NAME=VALUE items is expected, not the string {values!r}")
    return [os.fspath(v) for v in values]


def _items(values: Sequence[str]) -> list[str]:
    if isinstance(values, str):
        raise UsageError(f"a list is expected, not the string {values!r}")
    return list(values)


# --- dump ---------------------------------------------------------------------------------

def dump(pid: int, directory: str | os.PathLike | None = None, *,
         leave_running: bool = True,
         save_files: Sequence[str] = (),
         skip_files: Sequence[str] = (),
         external: Sequence[str] = (),
         plugins: Sequence[Plugin | str] = (),
         critical_timeout: float | str = 10.0,
         tcp_established: bool = False,
         tcp_close: bool = False,
         ext_unix_sk: bool = False,
         prev: str | os.PathLike | None = None,
         track_mem: bool = False,
         compress: str | None = None,
         background: bool | None = None,
         page_server: str | None = None,
         token_file: str | os.PathLike | None = None) -> DumpResult:
    """``ptckpt dump PID -D DIRECTORY``: checkpoint `pid` and all its descendants into
    `directory` (default ./ckpt-PID; it must not exist or be empty).

    leave_running     resume the tree after the dump (True), or kill it once the image is
                      on disk (False: ``--kill``)
    save_files        ``--save-file`` patterns: files whose contents go into the image
    skip_files        ``--skip-file`` patterns: fds recorded but not reopened at restore
    external          ``--external`` addresses (tcp:HOST:PORT, unix:PATH, listen:...,
                      fd:N): connections to something outside, re-made at restore
    plugins           Plugin objects or ``--plugin`` specs
    critical_timeout  seconds (or "10s") to wait for a critical section to end
    tcp_established   dump established TCP connections (TCP_REPAIR, network lock)
    tcp_close         established TCP connections come back closed
    ext_unix_sk       a unix datagram socket connected outside is connected again by path
    prev              incremental: write only the pages changed since image `prev`
    track_mem         leave memory write-protected for a later ``prev`` dump
    compress          "zstd" or "zstd:LEVEL": compress the page data
    background        copy memory while the tree runs (True), or frozen (False:
                      ``--freeze-all``); None: by size, for a leave-running dump of more
                      than 64 MiB (never with ``--kill``)
    page_server       HOST:PORT or unix:PATH of a ``ptckpt page-server``: the page data goes
                      there as it is read, never to `directory` (which holds the rest);
                      restore it with ``restore(..., page_server=...)``
    token_file        the page server's token (default $PTCKPT_TOKEN)

    Returns the result the command summarises (directory, pids, threads, VMAs, pages,
    bytes, seconds, frozen_seconds, warnings; page_server and image_id: where the
    page data went, as pages/IMAGE_ID/ there)."""
    from .dump import DumpMode
    from .pipeline.dump import dump as _dump
    loaded = load_plugins(plugins)
    if external:
        from .builtins import External
        loaded.append(External(_items(external)))
    return _dump(pid, os.fspath(directory) if directory is not None else None,
                 mode=DumpMode.LEAVE_RUNNING if leave_running else DumpMode.KILL,
                 save_files=_items(save_files), skip_files=_items(skip_files), plugins=loaded,
                 critical_timeout=parse_duration(critical_timeout), tcp_established=tcp_established,
                 tcp_close=tcp_close, ext_unix_sk=ext_unix_sk,
                 prev=os.fspath(prev) if prev is not None else None, track_mem=track_mem,
                 compress=parse_compress(compress), background=background,
                 **_page_server(page_server, token_file))


def _page_server(address: str | None, token_file: str | os.PathLike | None) -> dict:
    """The `page_server` and `token` keywords of the library's dump and restore: the
    address checked and the token read (``--page-server``, ``--token-file``)."""
    if not address:
        if token_file is not None:
            raise UsageError("--token-file goes with --page-server")
        return {}
    from .transfer import parse_address, read_token
    parse_address(address)
    return {"page_server": address, "token": read_token(os.fspath(token_file) if token_file is not None else None)}


def pre_dump(pid: int, directory: str | os.PathLike | None = None, *,
             prev: str | os.PathLike | None = None,
             compress: str | None = None,
             plugins: Sequence[Plugin | str] = ()) -> DumpResult:
    """``ptckpt pre-dump PID -D DIRECTORY``: write the memory of `pid`'s tree while it runs
    (frozen only to write-protect it), as the parent of a later ``dump(..., prev=DIRECTORY)``
    that then writes only what changed.  A pre-dump cannot be restored.

    prev              write only the pages changed since pre-dump (or dump) `prev`
    compress          "zstd" or "zstd:LEVEL", as for :func:`dump`
    plugins           Plugin objects or ``--plugin`` specs (the dump events)

    Returns the result the command summarises, as :func:`dump`'s."""
    from .dump import DumpMode
    from .pipeline.dump import dump as _dump
    return _dump(pid, os.fspath(directory) if directory is not None else None, mode=DumpMode.LEAVE_RUNNING,
                 plugins=load_plugins(plugins), prev=os.fspath(prev) if prev is not None else None,
                 track_mem=True, pre_dump=True, compress=parse_compress(compress))


# --- restore ------------------------------------------------------------------------------

@dataclass
class Restored:
    """A restored process tree, as :func:`restore` leaves it: running, a child of the caller.

    `pid` is the root's pid as the caller sees it, `vpid` the image's (what the process
    itself sees), `pids` every process's (image pid -> pid here), `init_pid` the minimal
    init of a pid-namespaced restore (0 without).  `faults` are the faults ``inject`` made
    (with `seed`, the seed they were drawn with).  With ``new_pty`` and no
    ``new_pty_program``, `pty_master` is the new pty's master (the caller's to read, write
    and close, or to :meth:`relay`; -1 otherwise).  After a lazy restore, `page_server` is
    the pid of the process putting its memory in (it exits when all is in; 0 without),
    `page_server_watchdog` its watchdog's, `page_server_log` their log and `lazy_bytes`
    what was left to them."""

    pid: int
    vpid: int
    init_pid: int = 0
    pids: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    faults: list[Any] = field(default_factory=list)
    seed: int | None = None
    pty_master: int = -1
    page_server: int = 0
    page_server_watchdog: int = 0
    page_server_log: str = ""
    lazy_bytes: int = 0
    _status: int | None = None
    _result: RestoreResult | None = field(default=None, repr=False)

    @property
    def waited(self) -> int:
        """What wait() waits for: the init of a --pidns restore (it ends with the root, and
        its status is the root's), else the root itself."""
        return self.init_pid or self.pid

    def summary(self) -> str:
        """The line ``ptckpt restore`` prints: what was restored where, in how long."""
        if self._result is not None:
            return self._result.summary()
        return f"restored pid {self.vpid} as {self.pid} in {self.seconds:.3f} s"

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the tree's root to end; its shell-style status (128+N for signal N), or
        None if it still runs after `timeout` seconds.  Once it has ended, ptckpt's record
        of it goes (``ptckpt stop`` has nothing to end) and a terminal the restore put it in
        front of goes back as it was."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._status is None:
            try:
                got, status = os.waitpid(self.waited, 0 if deadline is None else os.WNOHANG)
            except ChildProcessError:           # reaped by someone else: status unknown
                self._ended(0)
                break
            if got == self.waited:
                from .restore import shell_status
                self._ended(shell_status(status))
                break
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)
        return self._status

    def _ended(self, status: int) -> None:
        from .restored import forget
        self._status = status
        forget(self.pid)
        result = self._result
        if result is None:
            return
        if result.terminal_was is not None:     # the shell job ended: the terminal goes back
            from .resources import terminals
            terminals.put_back(result.terminal_was)      # as it was (a job killed may leave it raw)
        elif result.terminal >= 0:
            from .resources import terminals
            terminals.give_back(result.terminal, result.foreground_was)
        self._result = None                     # done once

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

    def relay(self, stdin_fd: int = 0, stdout_fd: int = 1) -> int:
        """``restore --new-pty`` without ``--detach``: copy between the caller's terminal
        (`stdin_fd`, `stdout_fd`) and the tree's new pty until the root ends; its
        shell-style status.  The master is closed then."""
        if self.pty_master < 0:
            raise UsageError("relay: the restore made no new pty (new_pty, or the image's stdio "
                             "was on no terminal)")
        from .resources import terminals
        try:
            with contextlib.suppress(OSError):       # its screen is new: a redraw
                terminals.redraw(os.getpgid(self.pid))
            status = terminals.relay(self.pty_master, stdin_fd=stdin_fd, stdout_fd=stdout_fd,
                                     until_pid=self.waited)
        finally:
            os.close(self.pty_master)
            self.pty_master = -1
        if self._status is None:
            self._ended(status)
        return self._status

    def why_killed(self) -> str | None:
        """After a lazy restore: the page server's (or its watchdog's) line saying it killed
        the tree, if it did (e.g. a corrupt block of page data)."""
        if not self.page_server_log:
            return None
        from .lazypages import why_killed
        return why_killed(self.page_server_log)


def _cgroup_options(cgroup_root: Sequence[str] | str, cgroups: str) -> dict[str, str]:
    """restore's cgroup_root items parsed ({controller or "": new root}), checked with `cgroups`."""
    from .resources.process import parse_cgroup_roots
    if cgroups not in ("join", "ignore"):
        raise UsageError(f"cgroups {cgroups!r}: join or ignore")
    roots = parse_cgroup_roots([cgroup_root] if isinstance(cgroup_root, str) else cgroup_root)
    if roots and cgroups == "ignore":
        raise UsageError("--cgroup-root and --cgroups ignore exclude each other")
    return roots


def restore(directory: str | os.PathLike, *, pidns: bool = False, netns: bool = False, lazy: bool = False,
            file_policy: FilePolicy | Sequence[str] = (), plugins: Sequence[Plugin | str] = (),
            remap_path: Sequence[str] | Mapping[str, str] = (), set_env: Sequence[str] | Mapping[str, str] = (),
            unset_env: Sequence[str] = (), reconnect: bool = False,
            remap_addr: Sequence[str] | Mapping[str, str] = (), inject: Sequence[str] = (),
            seed: int | None = None, faults_log: str | os.PathLike | None = None, new_pty: bool = False,
            new_pty_program: str | Sequence[str] | None = None, inherit_stdio: bool = False,
            hold_timeout: float | str = 30.0, page_server: str | None = None,
            token_file: str | os.PathLike | None = None, tcp_close: bool = False,
            cgroup_root: Sequence[str] = (), cgroups: str = "join") -> Restored:
    """``ptckpt restore -D DIRECTORY --detach``: recreate the image's processes and return
    once they run.

    pidns            in a fresh pid namespace (with a minimal init), where the pids are free
    netns            in a fresh network namespace (loopback up), where the ports are free
    lazy             run before the private anonymous memory is in (a page server fills it)
    file_policy      a FilePolicy, or ``--file-policy`` items: "strict" (the default),
                     "warn", "ignore", "PATTERN=POLICY"
    plugins          Plugin objects or ``--plugin`` specs; every plugin the image was made
                     with must be among them
    remap_path       "OLD=NEW" items (or {OLD: NEW}): files, mappings, cwd and exe under OLD
                     reopened under NEW, and NEW bind-mounted on OLD for the tree
    set_env          "NAME=VALUE" items (or {NAME: VALUE}): getenv(NAME) gives VALUE after
    unset_env        names no longer in the environment after
    reconnect        dial every external connection (dump ``external``) again
    remap_addr       "OLD=NEW" addresses to dial (or listen at) instead (implies reconnect)
    inject           fault specs made before the tree runs (flip:..., set:..., reg:...)
    seed             the seed of inject's random choices (default: a random one, in the
                     handle's `seed`)
    faults_log       write the seed and the faults made there (JSON)
    new_pty          a tree that was on a terminal gets a new pty (same termios and window
                     size): its master is the handle's `pty_master`, or goes to...
    new_pty_program  ... this command (a string split as a shell would, or an argv), run
                     with the master as its stdin and stdout, PTCKPT_PTS and PTCKPT_PID set
    inherit_stdio    the root's stdin, stdout and stderr are the caller's own
    hold_timeout     seconds (or "30s") a program that holds its resume (ptckpt.app) may
                     keep the rest of the tree waiting
    page_server      HOST:PORT or unix:PATH of the ``ptckpt page-server`` an image dumped
                     with ``page_server`` sent its page data to: fetched into memory before
                     the rebuild, or with `lazy` a block at a time as the tree touches it
    token_file       the page server's token (default $PTCKPT_TOKEN)
    tcp_close        TCP connections dumped with tcp_established come back closed (over,
                     both ways shut), those waiting in an accept queue are dropped, and the
                     image's network lock goes (as CRIU's restore --tcp-close)
    cgroup_root      "[CONTROLLER:]PATH" items: the tree's cgroups go under PATH (its
                     common cgroup in a hierarchy replaced by PATH), in the hierarchy of
                     CONTROLLER (cpu, name=systemd, v2 ...), or without one in every
                     hierarchy no item names (as CRIU's --cgroup-root)
    cgroups          "join" (the default: the cgroups of the dump, made again where gone)
                     or "ignore": no cgroup joined or made, the tree stays in the caller's
                     (as CRIU's --manage-cgroups=ignore)

    Returns a :class:`Restored` handle.  The caller becomes a child subreaper, so that the
    tree's orphans come back to it."""
    if new_pty_program and not new_pty:
        raise UsageError("--new-pty-program needs --new-pty")
    policy = parse_file_policy(file_policy)
    hold = parse_duration(hold_timeout)
    roots = _cgroup_options(cgroup_root, cgroups)
    remote = _page_server(page_server, token_file)
    loaded, injector = _restore_plugins(plugins, remap_path=remap_path, set_env=set_env, unset_env=unset_env,
                                        reconnect=reconnect, remap_addr=remap_addr, inject=inject, seed=seed,
                                        faults_log=faults_log, inherit_stdio=inherit_stdio)
    from .resources.pids import become_subreaper
    from .pipeline.restore import restore as _restore
    from .restore import shell_status
    become_subreaper()                  # orphans of the tree come back to the caller, not init
    result = _restore(os.fspath(directory), pidns=pidns, netns=netns, file_policy=policy,
                      new_pty=new_pty, plugins=loaded, hold_timeout=hold, lazy=lazy, tcp_close=tcp_close,
                      cgroup_roots=roots, cgroups=cgroups, **remote)
    restored = _handle(result, injector)
    if result.exit_status is not None and not result.init_pid:
        restored._ended(shell_status(result.exit_status))
    if new_pty:
        _hand_over_pty(restored, result, new_pty_program)
    return restored


def _handle(result, injector) -> Restored:
    """The Restored handle of a pipeline's result (and the faults its injector made)."""
    return Restored(pid=result.pid, vpid=result.vpid, init_pid=result.init_pid, pids=dict(result.pids),
                    seconds=result.seconds, warnings=list(result.warnings),
                    faults=list(injector.faults) if injector else [],
                    seed=injector.seed if injector else None, pty_master=result.pty_master,
                    page_server=result.lazy_server, page_server_watchdog=result.lazy_watchdog,
                    page_server_log=result.lazy_log, lazy_bytes=result.lazy_bytes, _result=result)


def _hand_over_pty(restored: Restored, result, program: str | Sequence[str] | None) -> None:
    """--new-pty: the new pty's master stays the handle's, or goes to `program`."""
    if result.pty_master < 0:
        restored.warnings.append("--new-pty: the image's stdio was on no terminal")
    elif program:
        from .resources import terminals
        argv = shlex.split(program) if isinstance(program, str) else list(program)
        try:
            terminals.spawn_on_master(result.pty_master, argv, env={"PTCKPT_PID": str(result.pid)})
        finally:
            os.close(result.pty_master)
            restored.pty_master = -1


def _restore_plugins(plugins: Sequence[Plugin | str], *, remap_path: Sequence[str] | Mapping[str, str], set_env: Sequence[str] | Mapping[str, str],
                     unset_env: Sequence[str], reconnect: bool, remap_addr: Sequence[str] | Mapping[str, str], inject: Sequence[str],
                     seed: int | None, faults_log: str | os.PathLike | None, inherit_stdio: bool):
    """The plugins a restore runs: those given, then the built-in ones its options ask for
    (remap-path first, so that every other plugin sees the new paths); and the inject
    plugin, whose faults the handle reports."""
    from .builtins import InheritStdio, Inject, Reconnect, RemapPath, SetEnv
    loaded = load_plugins(plugins)
    if inherit_stdio:
        loaded.append(InheritStdio())
    injector = None
    if inject:
        if seed is None:
            seed = random.SystemRandom().randrange(2**32)
        injector = Inject(_items(inject), seed, os.fspath(faults_log) if faults_log is not None else None)
        loaded.append(injector)
    if reconnect or remap_addr:
        loaded.append(Reconnect(_pairs(remap_addr)))
    if remap_path:
        loaded.insert(0, RemapPath(_pairs(remap_path)))
    if set_env or unset_env:
        loaded.append(SetEnv(_pairs(set_env), _items(unset_env)))
    return loaded, injector


def check_image(directory: str | os.PathLike) -> list[Finding]:
    """``ptckpt check --image DIRECTORY``: whether the image can be restored on this host,
    building nothing; one finding per thing looked at (what, ok, detail, exit_code)."""
    from .restore import preflight
    return preflight(os.fspath(directory))


# --- stop ---------------------------------------------------------------------------------

def stop(target: int | str | os.PathLike, *, timeout: float | str = 5.0, force: bool = False) -> Stopped:
    """``ptckpt stop PID|PIDFILE``: end a tree ptckpt restored (SIGTERM to its root, SIGKILL
    after `timeout` seconds, a --pidns tree's init too).  `target` is its pid or the file
    ``restore --pidfile`` wrote.  A process ptckpt did not restore is refused
    (:class:`ptckpt.errors.NotRestored`) unless `force` (``--force``).  Returns what the
    command summarises (pid, killed, init_pid)."""
    from .stop import stop as _stop, target_pid
    pid = target if isinstance(target, int) else target_pid(os.fspath(target))
    return _stop(pid, parse_duration(timeout), force=force)


# --- groups across hosts ------------------------------------------------------------------

def _specs(plugins: Sequence[str]) -> list[str]:
    """A group's plugins: ``--plugin`` specs (each worker loads them), not objects."""
    specs = _items(plugins)
    for p in specs:
        if not isinstance(p, str):
            raise UsageError(f"a group's plugins are --plugin specs (each worker loads its own), not {p!r}")
    return specs


def group_dump(members: Sequence[str], directory: str | os.PathLike, *, backend: str,
               leave_running: bool = True, tcp_established: bool = False, tcp_close: bool = False,
               plugins: Sequence[str] = (), timeout: float | str = 60.0) -> GroupDumpResult:
    """``ptckpt group dump -D DIRECTORY --backend dask://HOST:PORT WORKER:PID ...``: one
    checkpoint of processes on several hosts (ptckpt.group): every member frozen before any
    is captured, every image taken before any member is resumed (or killed:
    ``leave_running=False``); the images in DIRECTORY/WORKER-PID/, with group.json.

    members           WORKER:PID items: WORKER the name of the Dask worker (``dask worker
                      --name``) on the host of PID
    backend           dask://HOST:PORT, the Dask scheduler
    tcp_established   dump established TCP connections (repair mode, network lock), on
    tcp_close         ... or they come back closed
    plugins           ``--plugin`` specs, loaded on each worker (ctx.barrier meets the others)
    timeout           seconds (or "60s") a member waits at a barrier for the others

    A member that fails: every member resumes as it was, and GroupFailed (exit 28) names
    it and why.  Returns the directory, the members (as in group.json) and times."""
    from .group import group_dump as _group_dump
    return _group_dump(_items(members), os.fspath(directory), backend, kill=not leave_running,
                       tcp_established=tcp_established, tcp_close=tcp_close, plugins=_specs(plugins),
                       timeout=parse_duration(timeout))


def group_restore(directory: str | os.PathLike, *, backend: str, place: Sequence[str] | Mapping[str, str] = (),
                  plugins: Sequence[str] = (), file_policy: Sequence[str] = (), pidns: bool = False,
                  remap_path: Sequence[str] | Mapping[str, str] = (), set_env: Sequence[str] | Mapping[str, str] = (),
                  unset_env: Sequence[str] = (), timeout: float | str = 60.0) -> GroupRestoreResult:
    """``ptckpt group restore -D DIRECTORY --backend dask://HOST:PORT``: each member of a
    group image restored on its worker (or the one ``place`` names, "OLD=NEW" worker
    names), held until all are rebuilt, then resumed together.

    file_policy, pidns, remap_path, set_env, unset_env
                        as for :func:`restore` (``--file-policy`` items only), on every member
    plugins             ``--plugin`` specs, loaded on each worker
    timeout             seconds (or "60s") a member waits at a barrier for the others

    A failure anywhere kills every member made, and GroupFailed (exit 28) names the member
    and why.  Returns the members (member, worker, host, pid, vpid, init_pid, seconds)."""
    from .group import group_restore as _group_restore
    if isinstance(file_policy, str):
        raise UsageError(f"a list of --file-policy items is expected, not the string {file_policy!r}")
    from .builtins import RemapPath, SetEnv
    RemapPath(_pairs(remap_path))                 # their errors here, before any worker is asked
    SetEnv(_pairs(set_env), _items(unset_env))
    return _group_restore(os.fspath(directory), backend, place=_pairs(place), plugins=_specs(plugins),
                          file_policy=list(file_policy), pidns=pidns, remap_path=_pairs(remap_path),
                          set_env=_pairs(set_env), unset_env=_items(unset_env), timeout=parse_duration(timeout))
