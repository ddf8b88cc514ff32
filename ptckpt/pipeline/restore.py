"""Restore as named stages: collect, plan, open, create, rebuild, hand off, resume.

``restore(directory)`` runs them over one :class:`RestoreRun`:

1. collect  -- open the image and validate every record (magic, version, checksums;
               the page data is checked in a thread meanwhile); the plugins' pre_restore;
2. plan     -- refuse what cannot work before any process exists (ptckpt.plan's checks
               that hold on any host, and this host's: arch, vdso, xstate, pids, files);
3. open     -- the page sources, the lazy page server, files saved in the image;
4. create   -- in ptckpt, the descriptions the stubs inherit (pipes, sockets, ptys, fd
               state, shared memory objects: the hand-off), then the root's stub;
5. rebuild  -- SysV objects, the tree of stubs, each process fixed up by injected syscalls;
6. hand off -- what must be done before any of them runs: the page check's verdict, the
               terminal, the network lock lifted, app blocks marked, stops sent again;
7. resume   -- every thread let go (the program that asked to hold first), then the
               plugins' resumed event and the breakpoints.

Between 5 and 6 a caller's `before_resume(result)` runs, every process rebuilt, not one
instruction of its own run yet, the image's network lock still on (ptckpt.group holds each
member there until all are); if it raises, the tree is killed as for any failure (its
connections, still in repair mode, say nothing to their peers), and the error goes on.

Stages 3 to 7 register what undoes them on the run's undo stack: a failure (or a signal)
anywhere kills what was half-built, lifts what was locked and removes what was made, and
says why.  The rebuilding itself is ptckpt.restore's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from .. import appblock, breakpoints, progress, restored, testhooks
from ..state import committed, not_committed
from .. import netns as netns_mod
from .. import plugins as plugin_mod
from ..restore import (Host, RestoreResult, at_restored_pids, build_handoff, check_external,
    checking_pages, create_tree, epoll_registrars, file_identities, fix_up, fix_up_order,
    front_of_terminal, group_helpers, job_leads_new_pty, leader_on_callers_terminal, new_tty,
    open_pages, plan_problems, pty_ttys, raise_nofile, reap_traced_threads, rebuild_memory,
    restore_sysv, resume_holding_first, settle_notifications, start_lazy_server, under)
from ..errors import CorruptImage, Incompatible, PtckptError, RestoreFailed, UnsupportedResource, UsageError
from ..formats.image import ImageReader
from ..formats.model import InetMode, PageRun, PidfdState, ProcessImage, ShmImage
from ..plan import init_root_refused, memory_objects, plan_handoff, queue_refusal
from ..plugins import Plugin, Plugins, ProcessHandle
from ..resources import creds, filepolicy, files, inet, memory, pidfds, pids, process, signals, sockets, sysvipc
from ..resources import terminals
from . import Undo, stage

log = logging.getLogger("ptckpt.restore")


@dataclass(frozen=True)
class RestoreOptions:
    """What the restore was asked (the library's keywords, the command's flags)."""

    pidns: bool = False
    netns: bool = False
    file_policy: filepolicy.FilePolicy = filepolicy.FilePolicy()
    new_pty: bool = False
    plugins: Sequence[Plugin] = ()
    hold_timeout: float = 30.0
    lazy: bool = False
    held: bool = False              # restore_held: the plugin channel stays open in the tree
    creds_later: bool = False       # a held tree keeps ptckpt's credentials (its copies take theirs)
    before_resume: object = None
    group: object = None
    page_server: str | None = None  # the page data a dump sent there (ptckpt.pagestream) ...
    token: bytes = b""              # ... with this token
    tcp_close: bool = False         # connections dumped with --tcp-established come back closed
    cgroup_roots: tuple = ()        # ((controller or "", new root), ...): --cgroup-root
    cgroups: str = "join"           # or "ignore": the tree stays in the restorer's cgroups


class PageSource(NamedTuple):
    """Where some of a process's saved pages are: an open page file, the offset its data
    starts at, and the runs of pages it holds (an incremental image has several)."""

    fd: int
    base: int
    runs: Sequence[PageRun]


@dataclass
class Handoff:
    """What ptckpt made for the stubs to inherit: {description or object key: fd}, and its
    own ends (the new pty's master, the plugin channel), which the stubs do not get."""

    fds: dict
    pty_master: int = -1
    channel: int = -1


@dataclass
class RestoreRun:
    """The state the stages share."""

    directory: str
    opts: RestoreOptions
    cleanup: contextlib.ExitStack
    undo: Undo = field(default_factory=Undo)
    started: float = field(default_factory=time.monotonic)
    oom_before: int = 0
    image: ImageReader | None = None
    page_check: object = None
    pidns: bool = False
    procs: dict[int, ProcessImage] = field(default_factory=dict)
    events: Plugins | None = None
    plan: dict = field(default_factory=dict)
    verdict: filepolicy.Verdict | None = None
    helpers: list = field(default_factory=list)
    pages: dict[int, list[PageSource]] = field(default_factory=dict)
    server: object = None
    net: inet.InetRestore | None = None
    credentials: sockets.QueuedCredentials = field(default_factory=sockets.QueuedCredentials)
    pidfds_made: dict[int, int] = field(default_factory=dict)
    handoff: Handoff = field(default_factory=lambda: Handoff({}))
    stub: object = None
    created: dict = field(default_factory=dict)
    result: RestoreResult | None = None
    rebuilt: set[int] = field(default_factory=set)
    to_detach: list = field(default_factory=list)
    breaks: dict[int, list] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)
    joins: bool = False
    leads: bool = False
    cgroup_warnings: list = field(default_factory=list)

    @property
    def root(self) -> int:
        return self.image.inventory.root_pid

    @property
    def members(self) -> list[int]:
        return list(self.image.inventory.pids)


def restore(directory: str, *, pidns: bool = False, netns: bool = False,
            file_policy: filepolicy.FilePolicy = filepolicy.FilePolicy(), new_pty: bool = False,
            plugins: Sequence[Plugin] = (), hold_timeout: float = 30.0, lazy: bool = False,
            before_resume=None, group=None, page_server: str | None = None, token: bytes = b"",
            tcp_close: bool = False, cgroup_roots: Mapping[str, str] | None = None,
            cgroups: str = "join") -> RestoreResult:
    """Recreate the processes of image `directory`; returns once they run (detached from ptckpt).

    Every file reopened by path is compared with what the image recorded (size, mtime,
    inode; build-id of mapped ELF files); `file_policy` says, per path, whether a change
    refuses the restore (FilesChanged), warns, or is ignored.

    The root's stdio on a terminal becomes ptckpt's own stdio (a shell job): the
    image's termios are put on ptckpt's terminal and, if the job was in the
    foreground, its process group becomes the terminal's foreground group.  With
    `new_pty` it gets a new pty instead, with the recorded termios and window size,
    as its controlling terminal (for a session leader); result.pty_master is its
    master, for the caller to relay or hand to a program.

    `plugins` get the restore events (ptckpt.plugins): pre_restore, restored, resumed;
    every plugin the image was made with must be among them.

    A program with an app block (ptckpt.app, ptckpt.h) reads RESTORED there.  If it
    asked to hold the resume (hold_resume()), only that thread runs until it says
    ready(), up to `hold_timeout` seconds (then a warning, and the rest runs too).

    An image of a tree that lived in a pid namespace of its own records the pids it had
    there; it is restored in a new pid namespace whether `pidns` is asked or not.

    With `netns` the tree gets a network namespace of its own (loopback up), where
    its sockets are made: copies of one server image listen on the same ports at
    once.  A TCP connection to a peer outside the image cannot go there (refused).
    TCP connections dumped with --tcp-established are rebuilt in repair mode and
    leave it, and the image's network lock goes, once every process is rebuilt; with
    `tcp_close` they come back closed, accept-queue ones dropped (CRIU's --tcp-close).

    The tree goes back into its cgroups (made again where gone), or under other roots
    (`cgroup_roots`: api.restore's cgroup_root), or with `cgroups` "ignore" stays in ours.

    With `lazy` the processes run before their private anonymous memory is in: a page
    server process (ptckpt.lazypages) puts it in, what they touch first; result.lazy_*
    name it, its watchdog and their log.

    `page_server` (with `token`): where the page data of an image dumped with
    --page-server is (ptckpt.pagestream): fetched into memory before the rebuild, or with
    `lazy` a block at a time as the processes touch it.  The server is reached (and the
    token checked) before anything is made.

    `before_resume(result)` runs once every process is rebuilt, before any runs and before
    the network lock goes; if it raises, they are killed and the error goes on.  `group` (ptckpt.group.Barrier): the
    group this restore is a member of, where the plugins' ctx.barrier(name) meets the others.
    """
    opts = RestoreOptions(pidns, netns, file_policy, new_pty, tuple(plugins), hold_timeout, lazy,
                          before_resume=before_resume, group=group, page_server=page_server, token=token,
                          tcp_close=tcp_close, cgroup_roots=tuple(sorted((cgroup_roots or {}).items())),
                          cgroups=cgroups)
    run = _staged(directory, opts, (("before resume", call_before_resume), ("hand off", hand_off),
                                    ("resume", resume)))
    run.result.seconds = time.monotonic() - run.started
    return run.result


@dataclass
class Held:
    """A tree restored and held (:func:`restore_held`): every thread stopped under ptrace,
    traced by the thread that restored it, not one instruction of its own run yet.  The
    init of its pid namespace kills it should ptckpt die first."""

    run: RestoreRun

    @property
    def root(self) -> ProcessImage:
        return self.run.procs[self.run.root]

    @property
    def task(self):
        """The root's (only, for a copy) thread, stopped."""
        return self.run.created[self.run.root]

    @property
    def channel(self) -> tuple[int, int]:
        """(ptckpt's end, the fd number of the tree's end) of the plugin channel, which a
        held tree keeps open: ptckpt sends fds over it (-1, -1: none)."""
        return self.run.handoff.channel, self.run.handoff.fds.get("plugin-channel", -1)

    def close(self) -> None:
        """Kill the held tree and its pid namespace."""
        _kill_tree(self.run)
        if self.run.handoff.channel >= 0:
            os.close(self.run.handoff.channel)
            self.run.handoff.channel = -1


def restore_held(directory: str, *, plugins: Sequence[Plugin] = (),
                 file_policy: filepolicy.FilePolicy = filepolicy.FilePolicy(), creds_later: bool = False) -> Held:
    """Restore image `directory` in a new pid namespace up to the point where it would run,
    and keep it there (ptckpt.clones makes copies of it): the stages of :func:`restore`
    but the terminal, the stop signals and the resume.  Its fds 0-2 are what `plugins`
    give it (else the image's).  With `creds_later` its processes keep ptckpt's
    credentials, seccomp filters and parent-death signal (the caller sets them)."""
    opts = RestoreOptions(pidns=True, file_policy=file_policy, plugins=tuple(plugins), new_pty=False,
                          held=True, creds_later=creds_later)
    return Held(_staged(directory, opts, (("hold", hold),)))


def _staged(directory: str, opts: RestoreOptions, last: Sequence) -> RestoreRun:
    """collect and plan, then open, create, rebuild and the `last` stages under the run's
    undo stack: a failure kills what was half-built and says why."""
    oom_before = process.oom_kills()
    raise_nofile()
    for line in inet.stale_lock_cleanup():
        log.warning("%s", line)
    with contextlib.ExitStack() as cleanup:
        run = RestoreRun(directory, opts, cleanup, oom_before=oom_before)
        stage("collect", collect, run)
        stage("plan", plan, run)
        try:
            with run.undo:
                for name, fn in (("open", open_sources), ("create", create), ("rebuild", rebuild), *last):
                    stage(name, fn, run)
        except BaseException as err:
            said = _said(run, err)
            if said is None:
                raise
            raise said from err
    return run


# --- 1. collect ------------------------------------------------------------------------

def collect(run: RestoreRun) -> None:
    log.info("collect %s", run.directory)
    opts = run.opts
    source = None
    if opts.page_server:
        from ..pagestream import RemoteSource
        log.info("connect to the page server at %s", opts.page_server)
        source = RemoteSource(opts.page_server, opts.token, lazy=opts.lazy)
        run.cleanup.callback(source.close)
    run.image = run.cleanup.enter_context(ImageReader(run.directory, verify_pages=False,
                                                      defer_frames=opts.lazy, pages_from=source))
    run.page_check = run.cleanup.enter_context(checking_pages(run.image, opts.lazy))
    image, root = run.image, run.root
    if image.inventory.memory_only:
        raise UsageError(f"{image.path} is a pre-dump, memory only: restore the dump made "
                         f"with --prev {run.directory} (or a later one)")
    run.pidns = opts.pidns
    if image.inventory.pid_level and not run.pidns:
        log.info("the tree lived in a pid namespace of its own: restored in a new one")
        run.pidns = True
    if run.pidns and root == 1:
        raise init_root_refused(root)
    run.procs = {p: image.process(p) for p in run.members}
    plugin_mod.check_present(image.plugin_data, opts.plugins)
    run.events = Plugins(opts.plugins, image.path, restore=True, data=image.plugin_data, group=opts.group)
    if run.events:
        # first of all: a plugin may change what is restored (proc.image), e.g. remap paths
        log.info("plugins: pre_restore")
        handles = [ProcessHandle(0, p, run.procs[p]) for p in run.members]
        run.events.run("pre_restore", handles)
        run.procs = {h.vpid: h.image for h in handles}
    if opts.cgroups == "ignore":
        run.procs = process.ignore_cgroups(run.procs)
    else:
        run.procs, run.cgroup_warnings = process.reroot_cgroups(run.procs, dict(opts.cgroup_roots))
    check_external(run.procs, run.events)


# --- 2. plan ---------------------------------------------------------------------------

def plan(run: RestoreRun) -> None:
    log.info("plan %s", " ".join(map(str, run.members)))
    image, procs, events = run.image, run.procs, run.events
    run.plan = plan_handoff(image, procs)
    host = Host.probe()
    objects = memory_objects(procs)
    for p in run.members:
        plan_problems(image, procs[p], host, pidns=run.pidns, handed=run.plan, objects=objects)
        creds.check_restorable(p, procs[p].creds, procs[p].threads)
    unsent = queue_refusal(image, procs)            # as the dump's check found none, none here
    if unsent is not None:
        raise unsent
    identities = file_identities(procs, {f.path for f in image.saved_files})
    moved = [i for i in identities if any(under(i.path, d) for d in events.moved())] if events else []
    missing = sorted({i.path for i in moved if not os.path.exists(i.path)})
    if missing:
        raise Incompatible("moved by a plugin (--remap-path) but missing: " + ", ".join(missing))
    run.verdict = filepolicy.evaluate([i for i in identities if i not in moved], run.opts.file_policy)
    if run.verdict.refused:
        raise filepolicy.FilesChanged(run.verdict.refused)
    if run.opts.netns and not run.opts.tcp_close:
        outside = [r for r in image.inet_sockets if r.mode is InetMode.REPAIRED and not r.peer]
        if outside:
            raise UnsupportedResource(run.root, f"{inet.describe(outside[0])} leads outside the image: "
                                                f"it cannot be restored into a new network namespace (--netns)")
    run.helpers = group_helpers(procs, image.zombies)
    if not run.pidns:
        pids.check_pids_free([z.pid for z in image.zombies] + [h.pid for h in run.helpers])


# --- 3. open ---------------------------------------------------------------------------

def open_sources(run: RestoreRun) -> None:
    image = run.image
    run.net = inet.InetRestore(image.inet_sockets, image.inventory.netlock, tcp_close=run.opts.tcp_close)
    run.undo.on_failure(run.net.abort)
    run.cleanup.callback(run.credentials.close)
    run.cleanup.callback(pidfds.close_all, run.pidfds_made)
    progress.phase("read")
    for p in run.members:
        run.pages[p] = []
        for fd, base, runs in image.page_sources(p):
            run.pages[p].append(PageSource(open_pages(fd), base, runs))
            run.cleanup.callback(os.close, run.pages[p][-1].fd)
    progress.phase("rebuild")
    if run.opts.lazy:
        from .. import lazypages
        run.server = lazypages.Server()
        run.undo.on_failure(run.server.abort)
        for p in run.members:
            for source, check in zip(run.pages[p], image.lazy_checks(p)):
                run.server.add_source(source.fd, check)
    files.put_back_saved_files(list(image.saved_files))


# --- 4. create -------------------------------------------------------------------------

def create(run: RestoreRun) -> None:
    image, procs, events, opts = run.image, run.procs, run.events, run.opts
    made, cgroup_warnings = process.make_cgroup_dirs([p.task.cgroup_dirs for p in procs.values()])
    run.undo.on_failure(process.remove_cgroup_dirs, made)
    ns_fd = netns_mod.new_netns() if opts.netns else -1
    if ns_fd >= 0:
        run.cleanup.callback(os.close, ns_fd)
    pidfd_states = [s for s in image.fd_states if isinstance(s, PidfdState)]
    with netns_mod.entered(ns_fd) if opts.netns else contextlib.nullcontext():
        # the tree's sockets are made in its network namespace, and it is born there
        fds = build_handoff(image, procs, run.plan, opts.new_pty, events.installs(),
                               bool(events) or bool(pidfd_states), run.net, run.credentials)
        run.handoff = Handoff(fds, fds.pop("pty-master", -1), fds.pop("plugin-channel-ours", -1))
        run.cleanup.callback(_close_all, fds)
        if run.handoff.channel >= 0 and not opts.held:      # a held tree's is the Held's
            run.cleanup.callback(os.close, run.handoff.channel)
        if run.handoff.pty_master >= 0:
            run.undo.on_failure(os.close, run.handoff.pty_master)
        for _pid, _number, fd in events.installs() if events else ():
            run.cleanup.callback(os.close, fd)
        log.info("create %d", run.root)
        run.stub = pids.start_stub(run.root, pidns=run.pidns)
        run.undo.on_failure(_kill_tree, run)
        process.expendable(run.stub.pid)
    verdict = run.verdict
    left_out = [u for u in image.inventory.fd_kinds_unsupported if "not dumped" in u]
    run.result = RestoreResult(pid=run.stub.pid, vpid=run.root, init_pid=run.stub.init_pid,
                                  pty_master=run.handoff.pty_master,
                                  warnings=[f"the image left out {u}" for u in left_out]
                                  + [f"changed since the dump: {w}" for w in verdict.warnings + verdict.accepted]
                                  + run.cgroup_warnings + cgroup_warnings)
    run.created = {run.root: run.stub.task}


# --- 5. rebuild ------------------------------------------------------------------------

def rebuild(run: RestoreRun) -> None:
    image, procs, result, opts = run.image, run.procs, run.result, run.opts
    for kind, ipc_id in restore_sysv(image.sysv):
        run.undo.on_failure(sysvipc.remove_object, kind, ipc_id)
    run.joins = not opts.new_pty and leader_on_callers_terminal(image, procs)
    if run.joins:
        result.warnings.append(f"session leader {run.root} was restored into ptckpt restore's session, in front "
                               f"of its terminal (--new-pty gives it a session and a terminal of its own)")
    run.leads = opts.new_pty and job_leads_new_pty(image, procs)
    if run.leads:
        result.warnings.append(f"process {run.root} was restored as the leader of a session of its own, whose "
                               f"controlling terminal is the new pty (it was in its shell's session)")
    _create_tree(run)
    members = run.members
    run.procs = procs = at_restored_pids(procs, {p: run.created[p].tgid for p in members})
    run.credentials.fill({p: run.created[p].tgid for p in members})
    run.breaks = {p: [] for p in members}                  # plugins' breakpoints
    epolls = epoll_registrars(procs, image.fd_states)
    for p in fix_up_order(procs):
        warnings, tasks = fix_up(run.created[p], p, procs[p], image.page_runs(p), run.pages[p],
                                    run.handoff.fds, epolls.get(p, []), run.events, run.handoff.channel,
                                    run.breaks[p], memory_done=p in run.rebuilt, lazy=run.server,
                                    pidfds_made=run.pidfds_made, creds_later=run.opts.creds_later,
                                    keep_channel=run.opts.held)
        result.warnings += warnings
        run.to_detach += tasks
        testhooks.reached("restore-fixup")
    result.pids = {p: run.created[p].tgid for p in members}


def _create_tree(run: RestoreRun) -> None:
    """Every member's stub in its place in the tree (the parents' memory first where a child
    inherits part of it), and the pidfds once every member and zombie exists."""
    image, procs, handed = run.image, run.procs, run.handoff.fds
    early = {procs[p].task.ppid for p in run.members if memory.inherited_vmas(procs[p].vmas)}
    pidfd_states = [s for s in image.fd_states if isinstance(s, PidfdState)]

    def memory_first(p: int) -> None:
        if p in early and p not in run.rebuilt:
            if run.server is not None:          # its children inherit these pages: in first
                run.server.ready(run.pages[p])
            rebuild_memory(run.created[p], procs[p], image.page_runs(p), run.pages[p], handed)
            run.rebuilt.add(p)

    def make_pidfds(everyone: dict) -> None:
        # every member and zombie exists now (the zombies not ended yet)
        run.pidfds_made.update(pidfds.create_pidfds(pidfd_states, {p: t.tgid for p, t in everyone.items()}))
    create_tree(procs, image.zombies, run.helpers, run.created,
                   new_tty(image, procs, handed) if run.opts.new_pty else None,
                   run.events.bind_mounts() if run.events else [], own_session=not run.joins, lead=run.leads,
                   ptys=pty_ttys(image, procs, handed), memory_first=memory_first, all_made=make_pidfds)


def call_before_resume(run: RestoreRun) -> None:
    """The caller's before_resume hook, the tree rebuilt and held, the lock still on."""
    if run.opts.before_resume is not None:
        run.opts.before_resume(run.result)


# --- 6. hand off -----------------------------------------------------------------------

def hold(run: RestoreRun) -> None:
    """What a held tree needs before it (or a copy of it) may run: the page check's verdict,
    notifications settled, the network lock lifted, app blocks marked RESTORED."""
    log.info("wait for the page check")
    run.page_check.wait()                     # before any of them runs an instruction of its own
    if run.server is not None:
        run.server.check()                    # a bad block met while serving ptckpt's own reads
    settle_notifications(run.image.fd_states, run.handoff.fds)
    progress.finish()                         # off the terminal before the tree draws on it
    run.net.finish()                          # the lock goes, the connections leave repair mode
    run.blocks = {p: a for p in run.members
                  if (a := appblock.locate(run.created[p].tgid, exe=run.procs[p].task.exe)) is not None}
    for p, addr in run.blocks.items():        # the program learns it was restored
        appblock.mark(run.created[p].tgid, addr, appblock.RESTORED, run.image.path)


def hand_off(run: RestoreRun) -> None:
    image, procs, created, result = run.image, run.procs, run.created, run.result
    hold(run)
    if not run.opts.new_pty:
        # Only now: until here ^C reaches ptckpt (and ends the restore), not the job.
        run.undo.on_failure(_terminal_back, result)
        front_of_terminal(image, procs, created, result)
        if result.foreground:
            # Its screen is not the one it drew on: a window change is pending at its first
            # instruction, so it redraws before it reads a key (sent once it ran, the redraw
            # could wipe what it drew for the first keys).
            terminals.redraw(result.foreground)
    log.info("resume %s", " ".join(map(str, run.members)))
    for p in run.members:
        if procs[p].task.state == "T":
            # It was stopped (SIGSTOP & co): it stops again as soon as it is let go, by the
            # same signal (its parent's waitpid(WUNTRACED) tells which).
            tgid = created[p].tgid
            sig, why = signals.stop_signal_again(procs[p], lambda: pids.pgrp_orphaned(tgid))
            if why:
                result.warnings.append(why)
            os.kill(tgid, sig)
    for obj in image.sysv:
        if isinstance(obj, ShmImage) and obj.destroyed:
            sysvipc.mark_destroyed(obj.shmid)     # attached again: now it may go
    if run.server is not None:
        start_lazy_server(run.server, result, [created[p].tgid for p in run.members])
    unrecorded = restored.record(result.pid, image.path)   # `ptckpt stop` may end it
    run.undo.on_failure(restored.forget, result.pid)
    if unrecorded is not None:
        result.warnings.append(unrecorded)


# --- 7. resume -------------------------------------------------------------------------

def resume(run: RestoreRun) -> None:
    created, result, procs = run.created, run.result, run.procs
    traced = {created[p].tgid: p for p in run.members if run.breaks[p]}
    # From the first thread let go the tree is restored: a signal no longer unwinds it
    # (that would kill a running program and say "interrupted").
    testhooks.reached("restore-resume")
    committed()
    try:
        result.warnings += resume_holding_first([t for t in run.to_detach if t.tgid not in traced],
                                                   run.blocks, created, run.opts.hold_timeout)
    except BaseException:
        not_committed()
        raise
    run.stub.release()                        # the --pidns init stops watching ptckpt
    if run.events:
        log.info("plugins: resumed")
        run.events.run("resumed", [ProcessHandle(created[p].tgid, p, procs[p]) for p in run.members])
    for tgid, p in traced.items():
        log.info("resume %d with %d breakpoint(s)", p, len(run.breaks[p]))
        status = breakpoints.run(tgid, [t for t in run.to_detach if t.tgid == tgid], run.breaks[p],
                                 ProcessHandle(tgid, p, procs[p]))
        if status is not None and tgid == result.pid:
            result.exit_status = status


# --- undoing ---------------------------------------------------------------------------

def _kill_tree(run: RestoreRun) -> None:
    """Every process made so far killed and reaped, and the stub (its --pidns init) with them."""
    for task in run.created.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(task.tgid, signal.SIGKILL)
    for task in run.created.values():
        reap_traced_threads(task.tgid)
    run.stub.kill()


def _terminal_back(result: RestoreResult) -> None:
    """The user's terminal as it was before the restore took it."""
    if result.terminal_was is not None:
        terminals.put_back(result.terminal_was)
        result.terminal_was = None


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)


def _said(run: RestoreRun, err: BaseException) -> PtckptError | None:
    """What a failure once processes existed is reported as (None: as it is)."""
    if run.stub is None:
        return None
    root = run.root
    if isinstance(err, CorruptImage):         # the page check: said as such, exit code too
        return CorruptImage(err.path, f"{err.reason}; the half-restored processes were killed "
                                      f"before they ran")
    if isinstance(err, PtckptError) and process.oom_kills() > run.oom_before:
        failed = RestoreFailed(f"restore of {root} failed, the half-restored processes were "
                               f"killed: {err} (the OOM killer ended a process meanwhile)")
        failed.errno = errno.ENOMEM
        return failed
    if isinstance(err, PtckptError) and not isinstance(err, RestoreFailed):
        return RestoreFailed(f"restore of {root} failed, the half-restored processes were killed: {err}")
    return None
