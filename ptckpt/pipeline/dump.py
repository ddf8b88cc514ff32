"""Dump as named stages: check, freeze, capture, write, commit, release.

``dump(pid)`` runs them over one :class:`DumpRun`:

1. check    -- the target may be dumped (it exists, is no kernel thread, no other tracer
               holds it); the image directory made (a temporary one beside it); the
               plugins' pre_dump;
2. freeze   -- memory copied first while the tree runs (background dumps); then every
               thread of the tree frozen outside the critical sections the program marked,
               and at once (--tcp-established) the TCP connections the capture will read
               locked (ptckpt.netlock; found from the tree's fds and the kernel's socket
               table; without --tcp-established nothing is looked at);
3. capture  -- each process (memory, threads, fds, ...), then what the tree shares (fd
               descriptions, pipes, sockets (the connections read in repair mode under the
               freeze's lock, with what it lacked added), SysV objects, zombies);
4. write    -- the records and the inventory; then the restore's own plan run on them
               (ptckpt.plan), so that no image a restore would refuse is ever committed;
5. commit   -- the image renamed into place (from here a signal no longer unwinds it);
6. release  -- the caller's before_release, then the tree resumed (or killed), the
               network lock lifted, the plugins' post_dump.

Three hooks let a caller act between the stages (ptckpt.group meets the other members of
a group there): `before_freeze(result)` just before the tree is frozen (a memory copy
while it runs is done), `after_freeze(result)` once every thread is frozen and its
connections locked (result.netlock_at), nothing captured yet, and `before_release(result)`
once the image is committed, the tree still frozen.  Each may raise: the dump fails, the tree running on (or resumed where it was,
whatever the mode), and the error goes on.

What the stages make is undone on two stacks: the image's (the temporary directory, the
memory tracking) until the commit, the tree's (the network lock, the freeze) until the
release, so that a dump that fails leaves the target running as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .. import __version__, appblock, claims, procfs, progress
from ..state import committed, not_committed
from ..dump import (BUILD_IDS, DumpMode, DumpResult, capture_process_frozen, capture_sharing_frozen,
    check_target, freeze_outside_critical, mark_skipped, plugins_frozen, running_tree, wait_gone)
from .. import plan as restore_plan
from ..errors import PtckptError, UsageError
from ..formats.image import ImageWriter
from ..formats.model import Inventory, ProcessImage
from ..increment import MemoryPlan
from ..plugins import Plugin, Plugins, ProcessHandle
from ..resources import aio, files, filepolicy, inet, memory, process, registry, sockets
from ..resources import pids as pidns
from ..tracee import Session
from . import Undo, stage

log = logging.getLogger("ptckpt.dump")


@dataclass(frozen=True)
class DumpOptions:
    """What the dump was asked (the library's keywords, the command's flags)."""

    mode: DumpMode = DumpMode.LEAVE_RUNNING
    save_files: Sequence[str] = ()
    skip_files: Sequence[str] = ()
    plugins: Sequence[Plugin] = ()
    critical_timeout: float = 10.0
    tcp_established: bool = False
    tcp_close: bool = False
    ext_unix_sk: bool = False
    prev: str | None = None
    track_mem: bool = False
    pre_dump: bool = False
    compress: tuple[str, int] | None = None
    background: bool | None = False
    before_release: object = None
    after_freeze: object = None
    before_freeze: object = None
    group: object = None
    page_server: str | None = None       # send the page data there (ptckpt.pagestream) ...
    token: bytes = b""                   # ... with this token


@dataclass
class DumpRun:
    """The state the stages share."""

    pid: int
    directory: str
    opts: DumpOptions
    result: DumpResult
    cleanup: contextlib.ExitStack
    image_undo: Undo = field(default_factory=Undo)
    tree_undo: Undo = field(default_factory=Undo)
    started: float = field(default_factory=time.monotonic)
    plan: MemoryPlan | None = None
    writer: ImageWriter | None = None
    session: Session = field(default_factory=Session)
    flight: sockets.InFlight = field(default_factory=sockets.InFlight)
    net: inet.InetDump | None = None
    events: Plugins | None = None
    frozen_at: float = 0.0
    zombies: list = field(default_factory=list)
    blocks: dict = field(default_factory=dict)
    view: object = None
    clocks: tuple = ()
    xstate: tuple[int, int] = (0, 0)
    images: dict[int, ProcessImage] = field(default_factory=dict)
    shared: list = field(default_factory=list)


def dump(pid: int, directory: str | None = None, *,
         mode: DumpMode = DumpMode.LEAVE_RUNNING,
         save_files: Sequence[str] = (), skip_files: Sequence[str] = (),
         plugins: Sequence[Plugin] = (), critical_timeout: float = 10.0,
         tcp_established: bool = False, tcp_close: bool = False, ext_unix_sk: bool = False,
         prev: str | None = None, track_mem: bool = False, pre_dump: bool = False,
         compress: tuple[str, int] | None = None, background: bool | None = False,
         before_release=None, after_freeze=None, before_freeze=None, group=None,
         page_server: str | None = None, token: bytes = b"") -> DumpResult:
    """Checkpoint process `pid` and its descendants into `directory` (default ./ckpt-PID)
    through the stages check, freeze, capture, write, commit, release.  The options are
    ptckpt.api.dump's (which documents them), parsed: `mode` (ptckpt.dump.DumpMode), plugin
    objects, `compress` as ("zstd", LEVEL), `pre_dump` (memory only, the tree running, as a
    parent for the real dump), and `page_server` with its `token` (the page data goes to
    that server as it is read: ptckpt.pagestream; `directory` holds the records).

    Hooks for ptckpt's own callers: `before_freeze(result)` runs just before the freeze
    (raising: nothing was frozen); `after_freeze(result)` once the tree is frozen and, with
    `tcp_established`, its connections locked, before anything is captured (result.pids:
    its processes; result.netlock_at: when the lock was taken, 0 for none);
    `before_release(result)` once the image is committed, the tree still frozen
    (ptckpt.migrate sends the image and has it restored elsewhere then).  If either of the last two raises, the tree resumes where it
    was, whatever `mode`, and the error goes on.  `group` (ptckpt.group.Barrier): the group
    this dump is a member of, where the plugins' ctx.barrier(name) waits for every member.
    """
    opts = DumpOptions(mode, tuple(save_files), tuple(skip_files), tuple(plugins), critical_timeout,
                       tcp_established, tcp_close, ext_unix_sk, prev, track_mem, pre_dump, compress,
                       background, before_release, after_freeze, before_freeze, group, page_server, token)
    _check_options(opts)
    BUILD_IDS.clear()
    for line in inet.stale_lock_cleanup():
        log.warning("%s", line)
    directory = directory or f"ckpt-{pid}"
    with contextlib.ExitStack() as cleanup:
        run = DumpRun(pid, directory, opts, DumpResult(directory=os.path.abspath(directory), pids=[pid]),
                      cleanup)
        with run.tree_undo:
            with run.image_undo:
                for name, fn in (("check", check), ("freeze", freeze), ("capture", capture),
                                 ("write", write), ("commit", commit)):
                    stage(name, fn, run)
            stage("release", release, run)
    run.result.seconds = time.monotonic() - run.started
    return run.result


def _check_options(opts: DumpOptions) -> None:
    if opts.tcp_established and opts.tcp_close:
        raise UsageError("--tcp-established and --tcp-close exclude each other")
    if opts.page_server:
        for given, flag in ((opts.prev, "--prev"), (opts.track_mem, "--track-mem"), (opts.pre_dump, "pre-dump"),
                            (opts.compress, "--compress")):
            if given:
                raise UsageError(f"--page-server streams whole, uncompressed page data: not with {flag}")
    for pattern in (*opts.save_files, *opts.skip_files):
        try:
            filepolicy.check_pattern(pattern)
        except ValueError as err:
            raise UsageError(str(err)) from None


# --- 1. check --------------------------------------------------------------------------

def check(run: DumpRun) -> None:
    opts, pid = run.opts, run.pid
    sink = None
    if opts.page_server:                                 # before anything touches the process
        from ..pagestream import PageServerSink
        log.info("connect to the page server at %s", opts.page_server)
        sink = PageServerSink(opts.page_server, opts.token)
        run.cleanup.callback(sink.abort)
    log.info("check %d", pid)
    check_target(pid)
    run.plan = MemoryPlan(run.directory, prev=opts.prev, track_mem=opts.track_mem, pre_dump=opts.pre_dump,
                          killing=opts.mode is DumpMode.KILL, background=opts.background)
    run.cleanup.callback(run.plan.close)
    run.writer = ImageWriter(run.directory, compress=opts.compress, pages_to=sink)
    run.writer.create()
    if sink is not None:
        sink.image_id = run.writer.image_id
        run.result.page_server, run.result.image_id = opts.page_server, run.writer.image_id
    run.image_undo.on_failure(run.plan.close)            # before the tree runs on (tree_undo)
    run.image_undo.on_failure(run.plan.failed)
    run.image_undo.on_failure(run.writer.abort)
    run.cleanup.callback(lambda: run.flight.close())       # the flight of the end, peeked or not
    run.net = inet.InetDump(inet.Policy(established=opts.tcp_established, close=opts.tcp_close,
                                        leave_running=opts.mode is DumpMode.LEAVE_RUNNING),
                            run.result.directory)
    run.events = Plugins(opts.plugins, run.result.directory, group=opts.group)
    if run.events:
        log.info("plugins: pre_dump")
        running = running_tree(pid)
        view = pidns.pid_view(pid, running)
        run.events.run("pre_dump", [ProcessHandle(p, view.of(p)) for p in running])


# --- 2. freeze -------------------------------------------------------------------------

def freeze(run: DumpRun) -> None:
    pid = run.pid
    run.tree_undo.on_failure(run.session.resume_all)       # the last to undo: the tree runs on
    run.tree_undo.on_failure(run.net.abort)
    running = running_tree(pid)
    if run.plan.wants_background(running):
        log.info("copy the memory of %s while it runs", " ".join(map(str, running)))
        progress.phase("copy")
        run.plan.precopy(running, pidns.pid_view(pid, running).of, run.writer)
    if run.opts.before_freeze is not None:
        run.opts.before_freeze(run.result)
    log.info("freeze the tree of %d", pid)
    progress.phase("freeze")
    members, run.zombies, run.blocks = freeze_outside_critical(run.session, pid, run.opts.critical_timeout,
                                                               run.events)
    run.result.pids = members
    run.frozen_at = time.monotonic()
    for m in members:                            # the kernel's page-table walks, while we inject
        procfs.read_ahead([m], names=("smaps", "numa_maps") if claims.numa_by_file(m) else ("smaps",))
    run.cleanup.callback(procfs.forget_read_ahead)
    run.clocks = process.current_clocks()
    run.view = pidns.pid_view(pid, members, run.zombies)
    # --tcp-established: locked before anyone goes on, but for the connections a plugin
    # claimed in pre_dump (it may talk over them in frozen)
    claimed = {(run.view.real(vp), fd) for vp, fd in run.events.external()} if run.events else set()
    if run.net.lock_frozen(members, pid, claimed):
        run.result.netlock_at = run.net.locked_at
    if run.view.level:
        log.info("the tree lives in a pid namespace of its own: its pids there are recorded")
    if run.opts.after_freeze is not None:
        run.opts.after_freeze(run.result)        # if it fails the tree resumes (tree_undo)


# --- 3. capture ------------------------------------------------------------------------

def capture(run: DumpRun) -> None:
    progress.phase("copy")
    _capture_processes(run)
    progress.phase("write")
    run.plan.drop_precopies()                               # ended before the freeze
    log.info("capture what the tree shares")
    pid, opts = run.pid, run.opts
    images = process.dump_sharing(run.images, pid)
    if opts.skip_files:
        images = {p: mark_skipped(im, opts.skip_files) for p, im in images.items()}
    run.flight = sockets.peek_queues_frozen({p: im.fds for p, im in images.items()}, pid)
    numbered = files.number_descriptions({**{p: list(im.fds) for p, im in images.items()},
                                          run.flight.holder: run.flight.fds})
    run.flight.fds = numbered.pop(run.flight.holder)
    images = {p: dataclasses.replace(im, fds=tuple(numbered[p])) for p, im in images.items()}
    if run.events:
        images = plugins_frozen(run.events, run.session, images, run.view)
    # each kind of resources.registry in its order (the pidfds first, the unix sockets last)
    shared = capture_sharing_frozen(pid, images, run.net, run.flight, zombies=run.zombies,
                                    save_files=opts.save_files, ext_unix_sk=opts.ext_unix_sk)
    shared.records["plugins"] = run.events.image_records()
    run.images, run.shared = shared.images, pidns.virtual_records(run.view, registry.image_records(shared))
    procfs.forget_read_ahead()


def _capture_processes(run: DumpRun) -> None:
    """Each member: its memory (pages it still shares copy-on-write with its parent left to
    the parent's), threads, fds and the rest (dump.capture_process_frozen)."""
    members, result = run.result.pids, run.result
    parents = {m: procfs.read_stat(m).ppid for m in members}
    cow = {m: memory.shared_with_parent(m, parents[m]) for m in members if parents[m] in parents}
    if any(parents[m] in parents for m in members) and not memory.page_frames_visible():
        log.warning("pages a parent and its child share copy-on-write are not seen without "
                    "CAP_SYS_ADMIN (pagemap shows no page frames): a restore gives each its own "
                    "copy (the same contents, more memory)")
    lent: dict[int, list] = {}        # a parent's pages its children share: read unpinned
    for m, runs in cow.items():
        lent.setdefault(parents[m], []).extend(r for rs in runs.values() for r in rs)
    for member in members:
        log.info("capture %d", member)
        image, stats, xcr0, xsize = capture_process_frozen(
            run.session, member, run.writer, run.view.of(member), run.plan, run.images.get(parents[member]),
            cow.get(member), lent.get(member, ()))
        run.xstate = (xcr0, xsize)
        result.threads += len(image.threads)
        result.vmas += len(image.vmas)
        result.pages += stats.pages
        result.bytes += stats.bytes
        run.images[member] = image


# --- 4. write --------------------------------------------------------------------------

def write(run: DumpRun) -> None:
    view, writer, opts = run.view, run.writer, run.opts
    for member in run.result.pids:
        log.info("write %d", member)
        writer.write_process(pidns.virtual_process(view, run.images[member]))
    realtime, monotonic, boottime = run.clocks
    net = run.net
    writer.write_inventory(Inventory(
        ptckpt_version=__version__, kernel_release=os.uname().release, arch=os.uname().machine,
        page_size=os.sysconf("SC_PAGE_SIZE"), xfeatures=run.xstate[0], xstate_size=run.xstate[1],
        root_pid=view.of(run.pid), pids=tuple(map(view.of, run.result.pids)),
        realtime_ns=realtime, monotonic_ns=monotonic, boottime_ns=boottime,
        hostname=socket.gethostname(), pid_level=view.level, real_pids=view.pairs(),
        netlock=net.lock.id if net.lock is not None and opts.mode is DumpMode.KILL else "",
        **run.plan.inventory_fields(),
    ), run.shared)
    for member in run.result.pids:               # a completion while frozen: requests in flight
        aio.check_rings_quiet(member, run.images[member].aio_rings)
    if not opts.pre_dump:                        # never yes to an image the restore would refuse
        log.info("plan a restore of the image")
        restore_plan.check_restorable(writer.temp_path)
    else:                                        # the memory is written while the tree runs
        net.release(killed=False)
        run.session.resume_all()
        run.result.frozen_seconds = time.monotonic() - run.frozen_at
        log.info("write the memory of %s, running", " ".join(map(str, run.result.pids)))
        progress.phase("copy")
        run.plan.run_deferred(run.result)
        progress.phase("write")


# --- 5. commit -------------------------------------------------------------------------

def commit(run: DumpRun) -> None:
    committed()                            # SIGINT & co from here: noted, not unwinding
    try:
        run.writer.commit()
    except BaseException:
        not_committed()
        raise
    run.image_undo.commit()                      # the image stays, whatever comes
    run.plan.committed(run.writer.image_id)
    run.result.warnings = run.plan.untracked


# --- 6. release ------------------------------------------------------------------------

def release(run: DumpRun) -> None:
    opts, result, net = run.opts, run.result, run.net
    if opts.before_release is not None:
        opts.before_release(result)              # if it fails the tree resumes (tree_undo)
    log.info("release %s (%s)", " ".join(map(str, result.pids)), opts.mode.value)
    run.tree_undo.commit()
    if opts.mode is DumpMode.LEAVE_RUNNING:
        for p, addr in run.blocks.items():       # the program learns it continues after a dump
            with contextlib.suppress(PtckptError):
                appblock.mark(p, addr, appblock.CONTINUED, result.directory)
    if opts.mode is DumpMode.KILL:
        for member in reversed(result.pids):
            run.session.kill_process(member)
        net.release(killed=True)                 # silently: the connections were in repair mode
        result.frozen_seconds = time.monotonic() - run.frozen_at
        wait_gone(run.pid)
    elif not opts.pre_dump:
        net.release(killed=False)                # repair mode off, the lock gone, then it runs
        run.session.resume_all()
        result.frozen_seconds = time.monotonic() - run.frozen_at
    if run.events:
        log.info("plugins: post_dump")
        run.events.run("post_dump", [ProcessHandle(p, run.view.of(p)) for p in result.pids])
