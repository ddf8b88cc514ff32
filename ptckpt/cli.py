"""The ``ptckpt`` command: a thin typer layer over the library API.

Each command parses its options, calls one library function and renders the
result.  Library errors (:class:`ptckpt.errors.PtckptError`) become one line
on stderr and the error's exit code; an unexpected exception is reported as a
bug in one line too (``PTCKPT_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import signal
import sys
from typing import Annotated, Optional

import typer

from . import __version__
from .state import forward_to, unwind_again
from .errors import ExitCode, PtckptError, UsageError, exhausted

app = typer.Typer(
    add_completion=False,           # ours below: --show-completion SHELL names the shell
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="Transparent checkpoint/restore of running Linux processes, from outside (ptrace, /proc, syscall injection).",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ptckpt {__version__}")
        raise typer.Exit()


_SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")


def _shell(value: str) -> str:
    """The shell named (bash, zsh, fish, powershell, pwsh), or this one ($SHELL) when none is."""
    if not value:
        from typer._completion_shared import _get_shell_name
        value = _get_shell_name() or os.path.basename(os.environ.get("SHELL", "")) or "bash"
    if value not in _SHELLS:
        raise typer.BadParameter(f"{value!r} is not a shell completion is made for ({', '.join(_SHELLS)})")
    return value


def _show_completion(value: Optional[str]) -> None:
    if value is not None:
        from typer._completion_shared import get_completion_script
        typer.echo(get_completion_script(prog_name="ptckpt", complete_var="_PTCKPT_COMPLETE", shell=_shell(value)))
        raise typer.Exit()


def _install_completion(value: Optional[str]) -> None:
    if value is not None:
        from typer._completion_shared import install
        shell, path = install(shell=_shell(value), prog_name="ptckpt", complete_var="_PTCKPT_COMPLETE")
        typer.echo(f"{shell} completion installed in {path} (for shells started from now on)", err=True)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[Optional[bool], typer.Option("--version", "-V", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
    show_completion: Annotated[Optional[str], typer.Option(
        "--show-completion", metavar="[SHELL]", callback=_show_completion,
        is_eager=True, expose_value=False,
        help="Print the completion script of SHELL (bash, zsh, fish, powershell, pwsh; default: this shell).")] = None,
    install_completion: Annotated[Optional[str], typer.Option(
        "--install-completion", metavar="[SHELL]", callback=_install_completion,
        is_eager=True, expose_value=False,
        help="Add completion to the start-up file of SHELL (default: this shell).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log each phase on stderr (before or after the command).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No summary lines on stderr, only the results on stdout (the image directory, the pid), errors and warnings (before or after the command; not with -v).")] = False,
) -> None:
    """ptckpt: checkpoint a running process into an image directory, inspect it, check this machine.

    Example: ptckpt dump 1234 -D /tmp/ckpt
    """
    global _quiet
    if quiet and verbose:
        raise UsageError("-q (--quiet) and -v (--verbose) ask for opposite things: give one")
    _quiet = quiet
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="ptckpt: %(message)s", stream=sys.stderr)


_quiet = False


def _summary(text: str) -> None:
    """A summary line (what was dumped, restored, how long), on stderr: results (the image
    directory, a pid, tables, JSON) go to stdout, what is said about them to stderr.  Left
    out with -q."""
    if not _quiet:
        typer.echo(text, err=True)


def _progress_bar(what: str, as_json: bool):
    """A progress bar on stderr while a dump or restore moves memory for more than a second:
    on a terminal only, not with -q or --json."""
    from . import progress
    if _quiet or as_json or not sys.stderr.isatty():
        return contextlib.nullcontext()
    return progress.showing(progress.Bar(what))


@contextlib.contextmanager
def _runs_bar(what: str, total: int, first_phase: str, as_json: bool):
    """A campaign's progress bar on stderr (phase, percent, runs done, outcomes, time left),
    called as the campaign's progress(done, total, counts, eta); None (no bar) off a
    terminal, with -q or --json."""
    from . import progress
    from .campaign_types import OUTCOMES
    if _quiet or as_json or not sys.stderr.isatty():
        yield None
        return
    bar = progress.RunsBar(what, total, OUTCOMES, first_phase)
    try:
        yield bar
    finally:
        bar.close()


_CONTROL = {c: f"\\x{c:02x}" for c in range(32) if c != 9} | {10: "\\n", 13: "\\r", 127: "\\x7f"}


def one_line(text: str) -> str:
    """An error for stderr as one line: control characters in it (a path from an image or a
    process may hold newlines) are shown escaped."""
    return text.translate(_CONTROL)


def _fail(err: PtckptError) -> typer.Exit:
    why = exhausted(err)
    typer.echo(f"ptckpt: error: {one_line(str(err))}" + (f"; {why}" if why else ""), err=True)
    return typer.Exit(code=ExitCode.EXHAUSTED if why else err.exit_code)


@app.command()
def dump(
    pid: Annotated[int, typer.Argument(help="Process to checkpoint (with all its threads).")],
    directory: Annotated[Optional[str], typer.Option("-D", "--directory",
                                                     help="Image directory (default ./ckpt-PID); must not exist or be empty.")] = None,
    leave_running: Annotated[bool, typer.Option("--leave-running/--kill",
                                                help="Resume the target after the dump (default), or kill it once the image is on disk.")] = True,
    save_files: Annotated[Optional[list[str]], typer.Option("--save-file", metavar="PATTERN",
                                                           help="Store the contents of the open or mapped files matching PATTERN (an absolute path glob; ** spans directories; DIR/ means all under DIR) in the image; restore puts them back. Repeatable.")] = None,
    external: Annotated[Optional[list[str]], typer.Option("--external", metavar="ADDR",
                                                          help="tcp:HOST:PORT (tcp:[::1]:PORT), unix:PATH, listen:HOST:PORT, listen-unix:PATH or fd:N: a connection (or a listener) to something outside the checkpoint (emulator, licence server): not saved; at restore a plugin (or --reconnect) must re-make it. Repeatable.")] = None,
    plugins: Annotated[Optional[list[str]], typer.Option("--plugin", metavar="SPEC",
                                                        help="Load a plugin: module:Class, a file path (file.py or file.py:Class) or an entry point name of group ptckpt.plugins. Repeatable.")] = None,
    skip_files: Annotated[Optional[list[str]], typer.Option("--skip-file", metavar="PATTERN",
                                                           help="Record the fds of files matching PATTERN but do not reopen them at restore (the fd stays closed). Repeatable.")] = None,
    critical_timeout: Annotated[str, typer.Option("--critical-timeout", help="How long to wait for a critical section the program marked (ptckpt.app, ptckpt.h) to end before giving up.")] = "10s",
    tcp_established: Annotated[bool, typer.Option("--tcp-established", help="Dump established TCP connections (TCP_REPAIR: sequence numbers, both queues, options) under a network lock; without it (or --tcp-close, --external fd:N) a tree holding one is refused.")] = False,
    tcp_close: Annotated[bool, typer.Option("--tcp-close", help="Established TCP connections come back closed, as CRIU's (state CLOSE, both ways shut: reads give EOF, writes EPIPE); connections not yet accepted are dropped.")] = False,
    ext_unix_sk: Annotated[bool, typer.Option("--ext-unix-sk", help="A unix datagram socket connected to a socket outside the tree bound to a path is connected to that path again at restore (CRIU's --ext-unix-sk); without it such a tree is refused.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object (schema in the README) instead of the directory and a summary line.")] = False,
    prev: Annotated[Optional[str], typer.Option("--prev", metavar="DIR", help="Incremental: write only the pages changed since image DIR (a dump or pre-dump of this tree made with --track-mem, --prev or pre-dump); the image refers to DIR for the rest, and tracks on.")] = None,
    track_mem: Annotated[bool, typer.Option("--track-mem", help="Leave the memory write-protected (userfaultfd, asynchronous) so that a later dump --prev of this image writes only the pages changed since.")] = False,
    compress: Annotated[Optional[str], typer.Option("--compress", metavar="zstd[:LEVEL]", help="Compress the page data (zstd, on every CPU; level 3 unless given, negative levels are faster).")] = None,
    background: Annotated[Optional[bool], typer.Option("--background/--freeze-all", help="Copy the memory while the tree runs (write-protected, without faults), then freeze it only to copy what it wrote meanwhile; --freeze-all keeps it frozen for the whole copy. Default: --background for a leave-running dump of more than 64 MiB.", show_default=False)] = None,
    page_server: Annotated[Optional[str], typer.Option("--page-server", metavar="ADDRESS", help="HOST:PORT or unix:PATH: send the memory pages to this `ptckpt page-server` as they are read, not to disk: the image directory holds everything else and says where the pages are (restore --page-server).")] = None,
    token_file: Annotated[Optional[str], typer.Option("--token-file", metavar="FILE", help="With --page-server: the page server's token (default $PTCKPT_TOKEN).")] = None,
) -> None:
    """Checkpoint process PID into an image directory.

    Example: ptckpt dump 1234 -D /tmp/ckpt --kill --save-file '/slot3/state/**'
    """
    from . import api
    try:
        with _progress_bar("dump", as_json):
            result = api.dump(pid, directory, leave_running=leave_running, save_files=save_files or (),
                              skip_files=skip_files or (), external=external or (), plugins=plugins or (),
                              critical_timeout=critical_timeout, tcp_established=tcp_established,
                              tcp_close=tcp_close, ext_unix_sk=ext_unix_sk, prev=prev, track_mem=track_mem,
                              compress=compress, background=background, page_server=page_server,
                              token_file=token_file)
    except PtckptError as err:
        raise _fail(err) from None
    _render_dump(result, as_json)


@app.command("pre-dump")
def pre_dump(
    pid: Annotated[int, typer.Argument(help="Process to pre-dump (with all its threads and children).")],
    directory: Annotated[Optional[str], typer.Option("-D", "--directory", help="Image directory (default ./ckpt-PID); must not exist or be empty.")] = None,
    prev: Annotated[Optional[str], typer.Option("--prev", metavar="DIR", help="Write only the pages changed since image DIR.")] = None,
    compress: Annotated[Optional[str], typer.Option("--compress", metavar="zstd[:LEVEL]", help="Compress the page data.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
) -> None:
    """Write the memory of PID while it runs (frozen only to scan and write-protect it), as
    the parent of a later `ptckpt dump --prev DIR`, which then writes only what changed.

    Example: ptckpt pre-dump 1234 -D pre && ptckpt dump 1234 -D final --prev pre --kill
    """
    from . import api
    try:
        with _progress_bar("pre-dump", as_json):
            result = api.pre_dump(pid, directory, prev=prev, compress=compress)
    except PtckptError as err:
        raise _fail(err) from None
    _render_dump(result, as_json)


def _render_dump(result, as_json: bool) -> None:
    """What dump and pre-dump print: the warnings, then the directory and the summary line,
    or one JSON object."""
    for warning in result.warnings:
        typer.echo(f"ptckpt: warning: {one_line(warning)}", err=True)
    if as_json:
        typer.echo(json.dumps({"directory": result.directory, "pids": result.pids, "threads": result.threads,
                               "vmas": result.vmas, "pages": result.pages, "bytes": result.bytes,
                               "seconds": round(result.seconds, 6),
                               "frozen_seconds": round(result.frozen_seconds, 6),
                               "warnings": result.warnings,
                               "page_server": {"address": result.page_server, "pages": f"pages/{result.image_id}"}
                               if result.page_server else None}))
        return
    typer.echo(result.directory)
    _summary(result.summary())


@app.command()
def restore(
    directory: Annotated[str, typer.Option("-D", "--directory", help="Image directory written by `ptckpt dump`.")],
    pidns: Annotated[bool, typer.Option("--pidns", help="Restore into a fresh pid namespace (with a minimal init), where the original pids are free.")] = False,
    netns: Annotated[bool, typer.Option("--netns", help="Restore into a fresh network namespace (loopback up), where the image's ports are free: with --pidns, copies of one server image run at once.")] = False,
    detach: Annotated[bool, typer.Option("--detach", help="Return once the process runs and print its pid, instead of waiting for it.")] = False,
    lazy: Annotated[bool, typer.Option("--lazy", help="Let the processes run before their private anonymous memory is in: a page server process puts it in (what they touch first) and exits when all is in; its log says when.")] = False,
    pidfile: Annotated[Optional[str], typer.Option("--pidfile", help="With --detach: write the restored process's pid (as seen from here) to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object on stdout once the tree runs (schema in the README) instead of the pid.")] = False,
    plugins: Annotated[Optional[list[str]], typer.Option("--plugin", metavar="SPEC",
                                                        help="Load a plugin (as for dump); every plugin the image was made with must be given. Repeatable.")] = None,
    remap_path: Annotated[Optional[list[str]], typer.Option("--remap-path", metavar="OLD=NEW",
                                                            help="Reopen every file, mapping, cwd and exe under OLD from under NEW, and run the tree in a mount namespace where NEW is bind-mounted on OLD (later opens under OLD land in NEW). Repeatable.")] = None,
    reconnect: Annotated[bool, typer.Option("--reconnect", help="Dial every external connection (dump --external) again and give the process the new socket at the same fd.")] = False,
    remap_addr: Annotated[Optional[list[str]], typer.Option("--remap-addr", metavar="OLD=NEW",
                                                            help="With --reconnect (implied): dial NEW instead of OLD (tcp:HOST:PORT or unix:PATH), or listen at NEW instead of OLD (listen:HOST:PORT or listen-unix:PATH). Repeatable.")] = None,
    set_env: Annotated[Optional[list[str]], typer.Option("--set-env", metavar="NAME=VALUE",
                                                         help="After the restore, getenv(NAME) in every process returns VALUE. Repeatable.")] = None,
    unset_env: Annotated[Optional[list[str]], typer.Option("--unset-env", metavar="NAME",
                                                           help="After the restore, NAME is not in the environment. Repeatable.")] = None,
    new_pty: Annotated[bool, typer.Option("--new-pty", help="Give a tree that was on a terminal a new pty (same termios and window size) instead of this terminal; ptckpt relays between the two until the restored process exits.")] = False,
    new_pty_program: Annotated[Optional[str], typer.Option("--new-pty-program", metavar="COMMAND",
                                                           help="With --new-pty: run COMMAND with the pty's master as its stdin and stdout (e.g. 'socat - UNIX-LISTEN:/tmp/job.sock') instead of relaying; PTCKPT_PTS and PTCKPT_PID are set for it.")] = None,
    file_policy: Annotated[Optional[list[str]], typer.Option("--file-policy", metavar="POLICY",
                                                             help="What a file changed since the dump (size, mtime, inode, build-id) does: strict (refuse, the default), warn or ignore; PATTERN=POLICY for the paths matching PATTERN (first match wins). Repeatable.")] = None,
    inject: Annotated[Optional[list[str]], typer.Option("--inject", metavar="SPEC",
                                                        help="A fault to make (the forms are listed above); pid=P for another process than the root. Repeatable.")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed of every random choice of --inject (default: a random one, printed).")] = None,
    inherit_stdio: Annotated[bool, typer.Option("--inherit-stdio", help="The root's stdin, stdout and stderr are ptckpt's own, not what they were at dump.")] = False,
    faults_log: Annotated[Optional[str], typer.Option("--faults-log", metavar="FILE",
                                                      help="Write the seed and the faults made (JSON) to FILE.")] = None,
    page_server: Annotated[Optional[str], typer.Option("--page-server", metavar="ADDRESS", help="HOST:PORT or unix:PATH of the `ptckpt page-server` a dump --page-server sent the memory pages to: they are fetched into memory before the rebuild, or with --lazy as the processes touch them.")] = None,
    token_file: Annotated[Optional[str], typer.Option("--token-file", metavar="FILE", help="With --page-server: the page server's token (default $PTCKPT_TOKEN).")] = None,
    tcp_close: Annotated[bool, typer.Option("--tcp-close", help="TCP connections dumped with --tcp-established come back closed (state CLOSE, both ways shut: reads give EOF, writes EPIPE), as CRIU's restore --tcp-close; connections not yet accepted are dropped; the network lock goes.")] = False,
    cgroup_root: Annotated[Optional[list[str]], typer.Option("--cgroup-root", metavar="[CONTROLLER:]PATH",
                                                             help="Restore the tree's cgroups under PATH: in each hierarchy the tree's common cgroup is replaced by PATH (made if missing), what is below it follows. With CONTROLLER (cpu, name=systemd, v2 ...) only in that hierarchy; without, in every hierarchy no other --cgroup-root names. As CRIU's --cgroup-root. Repeatable.")] = None,
    cgroups: Annotated[str, typer.Option("--cgroups", metavar="MODE",
                                         help="join (the default): the tree goes back into its cgroups, made again where gone; ignore: no cgroup is joined or made, the tree stays in ptckpt's (as CRIU's --manage-cgroups=ignore).")] = "join",
) -> None:
    """Recreate the checkpointed process so that it continues where it was frozen.

    Without --detach, ptckpt stays and exits with the restored process's exit status.

    Faults (--inject SPEC), made before the restored process runs: flip:symbol=NAME[+OFF],bits=N[,size=B]
    | flip:addr=A,bits=N[,size=B] | set:symbol=NAME,value=V[,size=B] | set:addr=A,value=V[,size=B]
    | reg:name=REG,value=V | reg:name=REG,bits=N[,tid=T]; or once it runs, at the Nth call of
    function F: call:function=F,n=N,arg=I,value=V | call:function=F,n=N,ret=V
    | call:function=F,n=N,flip=SYMBOL,bits=B.

    Example: ptckpt restore -D /tmp/ckpt-1234 --pidns --detach --pidfile /tmp/pid
    """
    _check_restore_usage(detach, pidfile, new_pty, new_pty_program)
    from . import api
    try:
        with _progress_bar("restore", as_json):
            tree = api.restore(directory, pidns=pidns, netns=netns, lazy=lazy, file_policy=file_policy or (),
                               plugins=plugins or (), remap_path=remap_path or (), set_env=set_env or (),
                               unset_env=unset_env or (), reconnect=reconnect, remap_addr=remap_addr or (),
                               inject=inject or (), seed=seed, faults_log=faults_log, new_pty=new_pty,
                               new_pty_program=new_pty_program, inherit_stdio=inherit_stdio,
                               page_server=page_server, token_file=token_file, tcp_close=tcp_close,
                               cgroup_root=cgroup_root or (), cgroups=cgroups)
    except PtckptError as err:
        raise _fail(err) from None
    _render_restore(tree, as_json=as_json, detach=detach, pidfile=pidfile)


def _check_restore_usage(detach: bool, pidfile: str | None, new_pty: bool, new_pty_program: str | None) -> None:
    """The restore's options that go together only in some ways (exit USAGE otherwise)."""
    if pidfile and not detach:
        typer.echo("ptckpt: error: --pidfile needs --detach", err=True)
        raise typer.Exit(code=ExitCode.USAGE)
    if new_pty and detach and not new_pty_program:
        typer.echo("ptckpt: error: --new-pty with --detach needs --new-pty-program (someone must "
                   "hold the pty's master)", err=True)
        raise typer.Exit(code=ExitCode.USAGE)


def _render_restore(tree, *, as_json: bool, detach: bool, pidfile: str | None) -> None:
    """What a restore says once its tree runs (warnings, faults, the summary, the JSON
    result), then: relay for a new pty, the pid for --detach, or wait for the process and
    exit with its status."""
    for warning in tree.warnings:
        typer.echo(f"ptckpt: warning: {one_line(warning)}", err=True)
    for fault in tree.faults:
        typer.echo(f"ptckpt: fault (seed {tree.seed}): {fault}", err=True)
    if tree.pty_master >= 0:                     # --new-pty, no program: ptckpt relays
        typer.echo(tree.summary(), err=True)
        unwind_again()
        raise typer.Exit(code=tree.relay())
    _summary(tree.summary())
    if as_json:
        typer.echo(json.dumps({"pid": tree.pid, "vpid": tree.vpid, "init_pid": tree.init_pid,
                               "pids": {str(v): r for v, r in tree.pids.items()},
                               "seconds": round(tree.seconds, 6), "warnings": tree.warnings,
                               "lazy": {"server": tree.page_server, "watchdog": tree.page_server_watchdog,
                                        "log": tree.page_server_log, "bytes": tree.lazy_bytes}
                               if tree.page_server else None}))
    if detach:
        if pidfile:
            with open(pidfile, "w") as f:
                f.write(f"{tree.pid}\n")
        if not as_json:
            typer.echo(tree.pid)
        return
    _wait_for_restored(tree)


def _wait_for_restored(tree) -> None:
    """Stay with the restored process, forwarding ^C & co to it, and exit with its status
    (saying why, when something killed it)."""
    forward_to(tree.pid)                         # said: ^C & co now go to the restored process
    status = tree.wait()                         # (its record goes, the terminal comes back)
    if status == 128 + signal.SIGKILL:
        why = tree.why_killed()
        if why:
            typer.echo(f"ptckpt: {why}", err=True)
    raise typer.Exit(code=status)


@app.command()
def campaign(
    directory: Annotated[str, typer.Option("-D", "--directory", help="Image directory written by `ptckpt dump`.")],
    inject: Annotated[list[str], typer.Option("--inject", metavar="SPEC", help="Fault made in every run (as for restore --inject: its forms in ptckpt restore -h). Repeatable.")],
    out: Annotated[str, typer.Option("-o", "--out", help="Directory for results.csv, results.json and runs/NNNN/{stdout,stderr,faults.json}.")],
    runs: Annotated[int, typer.Option("--runs", help="How many runs (each with its own seed: --seed, --seed+1, ...).")] = 10,
    jobs: Annotated[int, typer.Option("--jobs", help="Runs at the same time.")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the first run.")] = 1,
    timeout: Annotated[str, typer.Option("--timeout", help="A run still going after this (30s, 2m ...) is killed and counted as hung.")] = "60s",
    check: Annotated[Optional[str], typer.Option("--check", metavar="CMD", help="Shell command judging each run (exit 0: right); it gets PTCKPT_STDOUT, PTCKPT_RUN_DIR, PTCKPT_SEED, PTCKPT_STATUS. Without it, a run is right when its stdout equals the reference run's.")] = None,
    plugin: Annotated[Optional[list[str]], typer.Option("--plugin", metavar="SPEC", help="Plugin for every restore. Repeatable.")] = None,
    file_policy: Annotated[Optional[list[str]], typer.Option("--file-policy", metavar="POLICY", help="As for restore (runs rewrite their files: warn or ignore is usual). Repeatable.")] = None,
    set_env: Annotated[Optional[list[str]], typer.Option("--set-env", metavar="NAME=VALUE", help="As for restore. Repeatable.")] = None,
    remap_path: Annotated[Optional[list[str]], typer.Option("--remap-path", metavar="OLD=NEW", help="As for restore. Repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print results.json's object on stdout instead of the table.")] = False,
    clones: Annotated[bool, typer.Option("--clones/--no-clones", help="Runs as copy-on-write copies of the image restored once, held stopped (a single-threaded process of files and memory, faults not at calls: see README); --no-clones: each run restores the image.")] = True,
    backend: Annotated[str, typer.Option("--backend", metavar="local|dask://HOST:PORT", help="Where runs execute: here (--jobs at a time), or as tasks of a Dask scheduler (pip install 'ptckpt\\[cluster]'), whose workers fetch the image once and run as many at a time as they have threads.")] = "local",
) -> None:
    """Restore an image many times with faults injected, each run in its own pid namespace.

    One reference run without faults comes first; then --runs runs, --jobs at a
    time, each with its own seed. Every run is classified masked, detected,
    crashed, hung (killed at --timeout) or error; the table goes to stdout and to
    OUT/results.csv, OUT/results.json and OUT/report.html. Exit 25 when some runs
    could not be restored (outcome error); when the reference run fails, the exit code
    of its restore (if that failed) or 27, and a retry reuses OUT.

    Example: ptckpt campaign -D /tmp/ckpt -o results --runs 100 --jobs 2 --timeout 30s --inject 'flip:symbol=design_state,bits=1'
    """
    from .campaign import CampaignSpec, fault_text, run_campaign
    from .units import parse_duration
    extra: list[str] = []
    for option, values in (("--plugin", plugin), ("--file-policy", file_policy), ("--set-env", set_env),
                           ("--remap-path", remap_path)):
        for v in values or ():
            extra += [option, v]
    try:
        from .faults import parse_spec
        for text in inject:
            parse_spec(text)
        spec = CampaignSpec(image=directory, runs=runs, inject=inject, out=out, seed=seed, jobs=jobs,
                            timeout=parse_duration(timeout), check=check or "", restore_args=extra,
                            backend=backend, clones=clones)
        with _runs_bar("campaign", runs, "runs" if check else "reference", as_json) as bar:
            if bar is None:
                result = run_campaign(spec, progress=bar)
            else:
                from .progress import showing
                with showing(bar.building("template")):      # the template's restore, in bytes
                    result = run_campaign(spec, progress=bar)
    except PtckptError as err:
        raise _fail(err) from None
    if as_json:
        typer.echo(json.dumps({**result.as_json(), "out": os.path.abspath(result.out)}))
    else:
        for r in result.runs:
            typer.echo(f"run {r.index:4d}  seed {r.seed:<10d} {r.outcome:9s} {fault_text(r.faults)}  {r.reason}".rstrip())
        typer.echo(result.summary())
    errors = result.counts().get("error", 0)
    if errors:
        first = next(r for r in result.runs if r.outcome == "error")
        typer.echo(f"ptckpt: error: {errors} of {len(result.runs)} runs could not be restored "
                   f"(run {first.index}: {one_line(first.reason)})", err=True)
        raise typer.Exit(code=ExitCode.RUNS_FAILED)


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: Annotated[list[str], typer.Argument(help="The command to run (after --).")],
    directory: Annotated[Optional[str], typer.Option("-D", "--directory", help="Where checkpoints (ckpt-NNNN) and the control socket go (default ./ptckpt-run-PID).")] = None,
    interval: Annotated[Optional[str], typer.Option("--interval", help="Take a checkpoint this often (30s, 5m ...).")] = None,
    critical_timeout: Annotated[str, typer.Option("--critical-timeout", help="How long a checkpoint waits for a critical section (ptckpt.app) to end.")] = "10s",
    tcp_established: Annotated[bool, typer.Option("--tcp-established", help="Checkpoints take established TCP connections (as dump --tcp-established).")] = False,
    tcp_close: Annotated[bool, typer.Option("--tcp-close", help="Checkpoints record established TCP connections as closed (as dump --tcp-close).")] = False,
    incremental: Annotated[bool, typer.Option("--incremental/--full", help="Each checkpoint after the first writes only the pages changed since the one before (dump --prev), or every checkpoint writes all memory.")] = True,
    keep: Annotated[int, typer.Option("--keep", metavar="N", help="Keep the last N checkpoints (0: all); an older one is folded into the next (ptckpt compact) before it goes.")] = 0,
    compress: Annotated[Optional[str], typer.Option("--compress", metavar="zstd[:LEVEL]", help="Compress the checkpoints' page data.")] = None,
) -> None:
    """Run COMMAND under ptckpt: checkpoints at intervals, on the program's request
    (ptckpt.app / ptckpt.h) and on `ptckpt control`; ends with COMMAND's exit status.

    Example: ptckpt run -D /tmp/run --interval 30s -- ./testbench out /slot3 tcp:127.0.0.1:5000
    """
    from . import api
    from .run import Supervisor
    try:
        every = api.parse_duration(interval) if interval else 0.0
        if keep < 0:
            raise UsageError("--keep takes a count >= 0")
        sup = Supervisor(command, directory or f"ptckpt-run-{os.getpid()}", interval=every,
                         critical_timeout=api.parse_duration(critical_timeout),
                         tcp_established=tcp_established, tcp_close=tcp_close,
                         incremental=incremental, keep=keep, compress=api.parse_compress(compress))
        status = sup.run()
    except PtckptError as err:
        raise _fail(err) from None
    for c in sup.state.checkpoints:
        _summary(f"ptckpt: checkpoint ({c.reason}) {c.image} in {c.seconds:.3f} s")
    for f in sup.state.failures:
        typer.echo(f"ptckpt: checkpoint ({f['reason']}) failed: {f['error']}", err=True)
    raise typer.Exit(code=status)


@app.command()
def control(
    target: Annotated[str, typer.Argument(help="The run: its control socket, its -D directory, or the pid of `ptckpt run` or of its command.")],
    command: Annotated[str, typer.Argument(help="checkpoint | status | stop")],
) -> None:
    """Talk to a `ptckpt run`: take a checkpoint now, print its status (JSON), or stop it.

    Example: ptckpt control /tmp/run checkpoint
    """
    from .run import control as _control
    if command not in ("checkpoint", "status", "stop"):
        typer.echo(f"ptckpt: error: unknown command {command!r} (checkpoint, status, stop)", err=True)
        raise typer.Exit(code=ExitCode.USAGE)
    try:
        reply = _control(target, command)
    except PtckptError as err:
        raise _fail(err) from None
    if not reply.get("ok"):
        typer.echo(f"ptckpt: error: {reply.get('error')}", err=True)
        raise typer.Exit(code=ExitCode.CONTROL)
    if command == "checkpoint":
        typer.echo(reply["image"])
    elif command == "status":
        typer.echo(json.dumps(reply, indent=2))
    else:
        _summary(f"stopped {reply['stopped']}: killed with its children; the run ends")


@app.command()
def compact(
    directory: Annotated[str, typer.Option("-D", "--directory", help="The image to fold: the newest of an incremental chain.")],
    out: Annotated[Optional[str], typer.Option("-o", "--out", help="Write the folded image here; without it, DIRECTORY is replaced (same image id: images made on it still find it) and its parents may be removed.")] = None,
    compress: Annotated[Optional[str], typer.Option("--compress", metavar="zstd[:LEVEL]", help="Compress the folded image's page data (default: as the image's).")] = None,
) -> None:
    """Fold an incremental chain (dump --prev, pre-dump) into one image that needs no parent.

    Example: ptckpt compact -D ckpt-0005 -o ckpt-full
    """
    from . import api
    from .compact import compact as _compact
    try:
        typer.echo(_compact(directory, out, compress=api.parse_compress(compress)))
    except PtckptError as err:
        raise _fail(err) from None


@app.command()
def show(
    directory: Annotated[str, typer.Argument(help="Image directory written by `ptckpt dump`.")],
    summary: Annotated[bool, typer.Option("--summary", help="Human-readable tables instead of JSON.")] = False,
) -> None:
    """Decode an image to JSON (page bytes left out), or print tables with --summary.

    Example: ptckpt show /tmp/ckpt-1234 --summary
    """
    from .show import image_summary, image_to_json
    try:
        if summary:
            typer.echo(image_summary(directory))
        else:
            typer.echo(json.dumps(image_to_json(directory), indent=2))
    except PtckptError as err:
        raise _fail(err) from None


@app.command()
def stop(
    target: Annotated[str, typer.Argument(metavar="PID|PIDFILE", help="The restored process (its pid as seen here, or the file restore --pidfile wrote).")],
    timeout: Annotated[str, typer.Option("--timeout", help="How long it has to end on SIGTERM before SIGKILL.")] = "5s",
    force: Annotated[bool, typer.Option("--force", help="Stop it even if ptckpt did not restore it (no record of it): any process, as kill would.")] = False,
) -> None:
    """End a detached restored tree: SIGTERM to its root, SIGKILL after --timeout, and with
    --pidns the namespace's init too (it ignores SIGTERM), which ends the rest of it.
    A process ptckpt did not restore is refused (exit 26) unless --force.

    Example: ptckpt restore -D /tmp/ckpt --pidns --detach --pidfile /tmp/pid; ptckpt stop /tmp/pid
    """
    from .stop import stop as _stop, target_pid
    from .units import parse_duration
    try:
        result = _stop(target_pid(target), parse_duration(timeout), force=force)
    except PtckptError as err:
        raise _fail(err) from None
    _summary(result.summary())


@app.command(name="page-server")
def page_server(
    listen: Annotated[str, typer.Option("--listen", metavar="HOST:PORT|unix:PATH", help="The one address to listen on.")],
    directory: Annotated[str, typer.Option("-D", "--directory", help="Where received images go (0700).")],
    token_file: Annotated[Optional[str], typer.Option("--token-file", metavar="FILE", help="The shared token (16 bytes or more); default $PTCKPT_TOKEN.")] = None,
    once: Annotated[bool, typer.Option("--once", help="Serve one connection, then exit.")] = False,
) -> None:
    """Receive images from `ptckpt push` and `ptckpt migrate` (and restore them when asked),
    on the address given and nothing else, for clients that know the token.

    Example: ptckpt page-server --listen 10.0.0.7:7070 -D /var/lib/ptckpt/in --token-file /etc/ptckpt/token
    """
    from .transfer import PageServer, read_token
    try:
        server = PageServer(listen, directory, read_token(token_file), once=once)
    except PtckptError as err:
        raise _fail(err) from None
    _summary(f"page server on {listen}, images into {os.path.abspath(directory)}")
    server.serve()


@app.command()
def push(
    directory: Annotated[str, typer.Option("-D", "--directory", help="Image directory (its parents go with it).")],
    to: Annotated[str, typer.Option("--to", metavar="HOST:PORT|unix:PATH", help="The page server.")],
    token_file: Annotated[Optional[str], typer.Option("--token-file", metavar="FILE", help="The shared token; default $PTCKPT_TOKEN.")] = None,
) -> None:
    """Send an image (with its parents) to a page server; prints where it is there.

    Example: ptckpt push -D /tmp/ckpt --to farm7:7070 --token-file ~/.ptckpt-token
    """
    from .transfer import push as _push, read_token
    try:
        where, sent = _push(directory, to, read_token(token_file))
    except PtckptError as err:
        raise _fail(err) from None
    typer.echo(where)
    _summary(f"sent {sent / 2**20:.1f} MiB to {to}")


@app.command()
def migrate(
    pid: Annotated[int, typer.Argument(help="Process to move (with its children).")],
    to: Annotated[str, typer.Option("--to", metavar="HOST:PORT|unix:PATH", help="The page server that restores it.")],
    token_file: Annotated[Optional[str], typer.Option("--token-file", metavar="FILE", help="The shared token; default $PTCKPT_TOKEN.")] = None,
    rounds: Annotated[int, typer.Option("--rounds", help="Pre-dump rounds sent while it runs, before the final (frozen) dump.")] = 2,
    restore_opt: Annotated[Optional[list[str]], typer.Option("--restore-opt", metavar="OPTION", help="An option for the restore there (--pidns, --netns, --lazy, --file-policy=P, --plugin=SPEC ...). Repeatable.")] = None,
    plugin: Annotated[Optional[list[str]], typer.Option("--plugin", metavar="SPEC", help="Plugin for the dumps here (as for dump). Repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
) -> None:
    """Move a running process tree to another host (or namespace) running `ptckpt page-server`:
    pre-dumps while it runs, a short final dump, the restore there; the process is killed here
    only once it runs there, and resumes here if anything fails before. Reports the downtime.

    Example: ptckpt migrate 1234 --to farm7:7070 --token-file ~/.ptckpt-token --restore-opt=--lazy
    """
    from .migrate import migrate as _migrate
    from .plugins import load_plugin
    from .transfer import read_token
    args: list[str] = []
    for opt in restore_opt or ():
        name, eq, value = opt.partition("=")
        args += [name, value] if eq else [name]
    try:
        result = _migrate(pid, to, read_token(token_file), rounds=rounds, restore_args=args,
                          plugins=[load_plugin(spec) for spec in plugin or ()])
    except PtckptError as err:
        raise _fail(err) from None
    if as_json:
        typer.echo(json.dumps({"pid": result.pid, "remote_pid": result.remote_pid, "remote_vpid": result.remote_vpid,
                               "rounds": result.rounds, "round_bytes": result.round_bytes,
                               "final_bytes": result.final_bytes, "downtime": round(result.downtime, 6),
                               "seconds": round(result.seconds, 6), "remote": result.remote}))
        return
    typer.echo(result.remote_pid)
    _summary(result.summary())


@app.command()
def core(
    directory: Annotated[str, typer.Option("-D", "--directory", help="Image directory written by `ptckpt dump`.")],
    out: Annotated[str, typer.Option("-o", "--out", help="Directory for the core files (core.PID, one per process).")],
) -> None:
    """Write an ELF core file per process of an image, for gdb and other debuggers.

    Each holds the process as it was at the checkpoint: its threads' registers, its memory
    and the files it had mapped (NT_FILE), as a kernel core dump would.

    Example: ptckpt core -D /tmp/ckpt -o /tmp/cores; gdb -batch -ex 'thread apply all bt' PROG /tmp/cores/core.PID
    """
    from .core import write_cores
    try:
        for r in write_cores(directory, out):
            typer.echo(f"{r.path}: process {r.pid}, {r.threads} thread{'s' if r.threads != 1 else ''}, "
                       f"{r.segments - 1} mappings")
    except PtckptError as err:
        raise _fail(err) from None


@app.command()
def diff(
    image_a: Annotated[str, typer.Argument(help="First image directory.")],
    image_b: Annotated[str, typer.Argument(help="Second image directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (schema in the README).")] = False,
    hide_expected: Annotated[bool, typer.Option("--hide-expected", help="Leave out the fields expected to differ (clocks, timers, numbers of re-created objects ...).")] = False,
    memory: Annotated[bool, typer.Option("--memory/--no-memory", help="Compare the memory contents too, page by page (default).")] = True,
) -> None:
    """Compare two images record by record and their memory page by page; print what differs.

    Exits 0 when they agree (apart from the fields expected to differ, listed apart), 22 when they differ.

    Example: ptckpt diff /tmp/ckpt-1 /tmp/ckpt-2 --hide-expected
    """
    from .diff import diff_images
    try:
        result = diff_images(image_a, image_b, memory=memory)
    except PtckptError as err:
        raise _fail(err) from None
    if as_json:
        typer.echo(json.dumps(result.to_json(expected=not hide_expected), indent=2))
    else:
        typer.echo(result.table(expected=not hide_expected), nl=False)
    if not result.agree:
        raise typer.Exit(code=ExitCode.DIFFERENT)


@app.command()
def check(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    image: Annotated[Optional[str], typer.Option("--image", metavar="DIR", help="Say instead whether image DIR can be restored on this host, and what stands in the way.")] = None,
    kinds: Annotated[bool, typer.Option("--kinds", help="Print instead the table of every kind of kernel object ptckpt knows (fds, sockets, mappings, namespaces, status fields, fdinfo keys, VmFlags): the module that dumps and restores it, or why a dump refuses it.")] = False,
) -> None:
    """List the kernel, CPU and privilege features ptckpt uses, present or absent.

    Exits 0 when dump and restore can work on this machine. With --image DIR: whether
    `ptckpt restore -D DIR` can work here (exit 0), else restore's exit code for the first
    thing in the way; nothing is restored.

    Example: ptckpt check --image /tmp/ckpt-1234
    """
    if kinds:
        from .check import kinds_table
        rows = kinds_table()
        if as_json:
            typer.echo(json.dumps([{"family": r.family, "kind": r.name, "restored": r.restored,
                                    "by": r.by, "refusal": r.refusal} for r in rows], indent=2))
            return
        width = max(len(r.name) for r in rows)
        for r in rows:
            typer.echo(f"{r.family:<10}  {r.name:<{width}}  " + (r.by if r.restored else f"REFUSED: {r.refusal}"))
        return
    if image is not None:
        from . import api
        findings = api.check_image(image)
        if as_json:
            typer.echo(json.dumps([{"what": f.what, "ok": f.ok, "detail": f.detail, "exit_code": f.exit_code}
                                   for f in findings], indent=2))
        else:
            width = max(len(f.what) for f in findings)
            for f in findings:
                typer.echo(f"{f.what:<{width}}  {'ok  ' if f.ok else 'NO  '}  {one_line(f.detail)}")
        blocking = [f for f in findings if not f.ok]
        if blocking:
            typer.echo(f"ptckpt: {image} cannot be restored here as it is: {one_line(blocking[0].detail)}", err=True)
            raise typer.Exit(code=blocking[0].exit_code or ExitCode.INCOMPATIBLE)
        return
    from .check import run_checks
    results = run_checks()
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        width = max(len(r.name) for r in results)
        for r in results:
            mark = "present" if r.present else "ABSENT "
            line = f"{r.name:<{width}}  {mark}  {r.detail}"
            if not r.present:
                line += f"  -- {r.cost}"
            typer.echo(line)
    if any(r.required and not r.present for r in results):
        typer.echo("ptckpt: dump/restore cannot work on this machine (see ABSENT required features)", err=True)
        raise typer.Exit(code=ExitCode.MISSING_FEATURE)


group_app = typer.Typer(no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]},
                        help="One checkpoint of processes on several hosts (a Dask worker on each), and its restore.")
app.add_typer(group_app, name="group")


@group_app.command("dump")
def group_dump(
    members: Annotated[list[str], typer.Argument(metavar="WORKER:PID...", help="The members: each a process PID on the host of the Dask worker started with --name WORKER.")],
    directory: Annotated[str, typer.Option("-D", "--directory", help="Group image directory (must not exist or be empty): WORKER-PID/ per member and group.json.")],
    backend: Annotated[str, typer.Option("--backend", metavar="dask://HOST:PORT", help="The Dask scheduler whose named workers hold the members (pip install 'ptckpt\\[cluster]').")],
    leave_running: Annotated[bool, typer.Option("--leave-running/--kill", help="Resume every member after the dump (default), or kill them all once every image is taken.")] = True,
    tcp_established: Annotated[bool, typer.Option("--tcp-established", help="Dump established TCP connections (as for dump), the members' connections to each other too.")] = False,
    tcp_close: Annotated[bool, typer.Option("--tcp-close", help="Established TCP connections come back closed (as for dump).")] = False,
    plugins: Annotated[Optional[list[str]], typer.Option("--plugin", metavar="SPEC", help="A plugin, loaded on each worker (the same path there); its ctx.barrier(name) meets the other members. Repeatable.")] = None,
    timeout: Annotated[str, typer.Option("--timeout", help="How long a member waits at a barrier for the others before the group gives up.")] = "60s",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
) -> None:
    """Checkpoint processes on several hosts at one moment: every member frozen before any
    is captured, every image taken before any is resumed or killed. A member that fails:
    every member resumes as it was, one line names it (exit 28).

    Example: ptckpt group dump -D /tmp/grp --backend dask://10.0.0.1:8786 --tcp-established --kill A:4242 B:777
    """
    from . import api
    try:
        result = api.group_dump(members, directory, backend=backend, leave_running=leave_running,
                                tcp_established=tcp_established, tcp_close=tcp_close, plugins=plugins or (),
                                timeout=timeout)
    except PtckptError as err:
        raise _fail(err) from None
    if as_json:
        typer.echo(json.dumps({"directory": result.directory, "members": result.members,
                               "seconds": round(result.seconds, 6), "frozen_seconds": result.frozen_seconds}))
        return
    typer.echo(result.directory)
    _summary(result.summary())


@group_app.command("restore")
def group_restore(
    directory: Annotated[str, typer.Option("-D", "--directory", help="Group image directory written by `ptckpt group dump`.")],
    backend: Annotated[str, typer.Option("--backend", metavar="dask://HOST:PORT", help="The Dask scheduler whose named workers restore the members.")],
    place: Annotated[Optional[list[str]], typer.Option("--place", metavar="OLD=NEW", help="Restore the members dumped on worker OLD on worker NEW instead. Repeatable.")] = None,
    plugins: Annotated[Optional[list[str]], typer.Option("--plugin", metavar="SPEC", help="A plugin, loaded on each worker; every plugin the images were made with. Repeatable.")] = None,
    file_policy: Annotated[Optional[list[str]], typer.Option("--file-policy", metavar="POLICY", help="As for restore. Repeatable.")] = None,
    pidns: Annotated[bool, typer.Option("--pidns", help="Each member in a fresh pid namespace of its own (as for restore).")] = False,
    remap_path: Annotated[Optional[list[str]], typer.Option("--remap-path", metavar="OLD=NEW", help="As for restore, on every member. Repeatable.")] = None,
    set_env: Annotated[Optional[list[str]], typer.Option("--set-env", metavar="NAME=VALUE", help="As for restore, on every member. Repeatable.")] = None,
    unset_env: Annotated[Optional[list[str]], typer.Option("--unset-env", metavar="NAME", help="As for restore, on every member. Repeatable.")] = None,
    timeout: Annotated[str, typer.Option("--timeout", help="How long a member waits at a barrier for the others before the group gives up.")] = "60s",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
) -> None:
    """Restore a group image: each member rebuilt on its worker and held until all are,
    then all resumed together; prints WORKER:PID per member. A failure anywhere kills
    every member made, one line names it (exit 28).

    Example: ptckpt group restore -D /tmp/grp --backend dask://10.0.0.1:8786 --place B=C
    """
    from . import api
    try:
        result = api.group_restore(directory, backend=backend, place=place or (), plugins=plugins or (),
                                   file_policy=file_policy or (), pidns=pidns, remap_path=remap_path or (),
                                   set_env=set_env or (), unset_env=unset_env or (), timeout=timeout)
    except PtckptError as err:
        raise _fail(err) from None
    if as_json:
        typer.echo(json.dumps({"directory": result.directory, "members": result.members,
                               "seconds": round(result.seconds, 6)}))
        return
    for m in result.members:
        typer.echo(f"{m['worker']}:{m['pid']}")
    _summary(result.summary())


def _unwrap(doc: str) -> str:
    """A docstring with each paragraph on one line: typer's rich help keeps the source's line
    breaks, so a paragraph wrapped at 100 columns in the source broke oddly at 80."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


for _command in (*app.registered_commands, *group_app.registered_commands):
    if _command.callback.__doc__:
        _command.callback.__doc__ = _unwrap(_command.callback.__doc__)
if app.registered_callback is not None and app.registered_callback.callback.__doc__:
    app.registered_callback.callback.__doc__ = _unwrap(app.registered_callback.callback.__doc__)


try:                                # typer 0.26 carries its own click (pyproject pins it)
    from typer._click.exceptions import Abort as _Abort, ClickException as _ClickException
except ImportError:                 # pragma: no cover - a typer on the system click
    from click.exceptions import Abort as _Abort, ClickException as _ClickException


def _usage_error(err: _ClickException) -> None:
    """Bad usage (an unknown option, a pid that is no number ...): one line and exit 2."""
    ctx = getattr(err, "ctx", None)
    where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
    if err.format_message():        # none: the help was shown instead (no arguments at all)
        typer.echo(f"ptckpt: error: {one_line(err.format_message())}{where}", err=True)
    sys.exit(ExitCode.USAGE if err.exit_code == 2 else err.exit_code)


_GLOBAL_FLAGS = {"-v": "--verbose", "--verbose": "--verbose", "-q": "--quiet", "--quiet": "--quiet"}


def hoist_verbose(argv: list[str]) -> list[str]:
    """-v/--verbose and -q/--quiet anywhere before a `--` (`ptckpt dump 123 -v`) go in
    front of the command, where they are defined; what follows `--` (run's command) is
    left alone."""
    cut = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:cut], argv[cut:]
    if not any(a in _GLOBAL_FLAGS for a in head[1:]):
        return argv
    flags = list(dict.fromkeys(_GLOBAL_FLAGS[a] for a in head if a in _GLOBAL_FLAGS))
    return flags + [a for a in head if a not in _GLOBAL_FLAGS] + tail


def shell_by_default(argv: list[str]) -> list[str]:
    """--show-completion and --install-completion take the shell as their value, and
    without one (last, or before another option) this shell: "" stands for it."""
    out = []
    for i, a in enumerate(argv):
        out.append(a)
        if a in ("--show-completion", "--install-completion") and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("")
    return out


def _only_the_named_command(args: list[str]):
    """A context in which `app` holds only the command `args` name (the first word that is not
    a global flag), when it is one of its own: typer then builds that command's parser and not
    all of them, about 60 ms less on every run.  Help, and errors on unknown commands, see all."""
    name = next((a for a in args if not a.startswith("-")), None)
    everything = app.registered_commands
    chosen = [c for c in everything
              if (c.name or c.callback.__name__.lower().replace("_", "-")) == name]
    if not chosen:
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def only():
        app.registered_commands = chosen
        try:
            yield
        finally:
            app.registered_commands = everything
    return only()


def main() -> None:
    """Run the command (ptckpt.entry installs the signal handlers first)."""
    from .state import Interrupted
    try:
        if "_PTCKPT_COMPLETE" in os.environ:     # a completion script asks: typer's answer
            from typer._completion_classes import completion_init
            completion_init()
        args = shell_by_default(hoist_verbose(sys.argv[1:]))
        with _only_the_named_command(args):
            code = app(args=args, standalone_mode=False)
        if isinstance(code, int) and code:     # typer.Exit(code=...) of a command
            sys.exit(code)
    except _ClickException as err:
        _usage_error(err)
    except _Abort:                  # ^C seen by the parser (it turns KeyboardInterrupt into this)
        typer.echo("ptckpt: interrupted", err=True)
        sys.exit(130)
    except PtckptError as err:      # pragma: no cover - commands catch their own
        typer.echo(f"ptckpt: error: {one_line(str(err))}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        typer.echo("ptckpt: interrupted", err=True)
        sys.exit(130)
    except Interrupted as stop:
        typer.echo(f"ptckpt: interrupted by {stop.name}", err=True)
        sys.exit(128 + stop.signo)
    except Exception as err:  # a bug: one line unless asked for the traceback
        if os.environ.get("PTCKPT_DEBUG"):
            raise
        why = exhausted(err)
        if why:
            typer.echo(f"ptckpt: error: {one_line(str(err))}; {why}", err=True)
            sys.exit(ExitCode.EXHAUSTED)
        typer.echo(f"ptckpt: internal error: {type(err).__name__}: {one_line(str(err))} (PTCKPT_DEBUG=1 for a traceback)", err=True)
        sys.exit(ExitCode.INTERNAL)
