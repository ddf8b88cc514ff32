"""Dump's capturing: what the stages of ptckpt.pipeline.dump call (layer 5).

``ptckpt.pipeline.dump.dump(pid, directory)`` runs these stages, each logged:

1. check    -- the pid exists, is a user process, nobody else traces it, the
               destination is free (all before the target is touched);
2. freeze   -- PTRACE_SEIZE + PTRACE_INTERRUPT every thread, re-scanning
               /proc/PID/task until no new thread appears;
3. capture  -- VMAs, threads, signals, mm, task, creds, rlimits, fds (with
               syscall injection where only the inside can tell), then pages;
4. write    -- records into a temporary image directory, renamed into place
               only when complete;
5. release  -- resume every thread where it was (``LEAVE_RUNNING``) or kill
               the target, only after the image is on disk (``KILL``).

Any failure in 2-4 removes the temporary directory and resumes the target
as it was: a dump never harms what it dumps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import os
import select
import time
from collections.abc import Sequence
from dataclasses import dataclass

from . import appblock, claims, kinds, procfs
from .errors import (PtckptError, AccessDenied, AlreadyTraced, KernelThread, NoSuchProcess, OwnAncestor,
                     PluginError, TargetVanished, UnsupportedResource)
from .formats.image import ImageWriter
from .increment import MemoryPlan
from .plugins import Plugins, ProcessHandle, SharedResource
from .formats.model import FdKind, PendingSignal, ProcessImage, Vma
from .resources import (aio, creds, filepolicy, files, inet, locks, memory, pids as pidns, process, registry,
                        signals, sockets, threads, timers)
from .tracee import AddressSpace, Session, StopKind, find_syscall_insn, remote_syscalls, xstate_header

log = logging.getLogger("ptckpt.dump")

PF_KTHREAD = 0x00200000


BUILD_IDS: dict = {}          # (st_dev, st_ino, mtime) -> build-id, shared by the processes of a dump


class DumpMode(enum.Enum):
    LEAVE_RUNNING = "leave-running"
    KILL = "kill"


@dataclass
class DumpResult:
    directory: str
    pids: list[int]
    threads: int = 0
    vmas: int = 0
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0
    frozen_seconds: float = 0.0
    warnings: list[str] = dataclasses.field(default_factory=list)
    page_server: str = ""          # dump --page-server: where the page data went
    image_id: str = ""
    netlock_at: float = 0.0        # time.time() the connections were locked (the freeze); 0: none

    def summary(self) -> str:
        from .units import count, size
        procs = f"{len(self.pids)} processes, " if len(self.pids) > 1 else ""
        text = (f"dumped {self.pids[0]} to {self.directory}: {procs}{count(self.threads, 'thread')}, "
                f"{count(self.vmas, 'VMA')}, {count(self.pages, 'page')} ({size(self.bytes)}), "
                f"{self.seconds:.3f} s (frozen {self.frozen_seconds:.3f} s)")
        if self.page_server:
            text += f"; the page data is on the page server at {self.page_server} (pages/{self.image_id}/)"
        return text


def check_target(pid: int) -> None:
    """Refuse, by name, a pid that cannot be dumped -- before touching it."""
    if pid <= 0:
        raise NoSuchProcess(pid)
    status = procfs.read_status(pid)
    stat = procfs.read_stat(pid)
    if status.kthread or stat.flags & PF_KTHREAD:
        raise KernelThread(pid, status.name)
    if status.tgid != pid:
        raise NoSuchProcess(pid, "process (that is a thread id; give its process id "
                                 f"{status.tgid})")
    if status.state.startswith("Z"):
        raise NoSuchProcess(pid, "live process (it is a zombie)")
    if pid == os.getpid():
        raise AccessDenied(pid, "checkpoint ptckpt itself as")
    _refuse_own_ancestor(pid)
    refuse_other_abi(pid)
    _refuse_if_traced(pid)


def refuse_other_abi(pid: int) -> None:
    """A program of an instruction set the table of kinds (ptckpt.kinds.ABIS) does not say
    is restored is refused by name before anything is injected."""
    if not is_32_bit(pid):
        return
    row = kinds.ABIS["ia32"]
    if not row.restored:
        raise UnsupportedResource(pid, f"{procfs.comm_or_unknown(pid)}, a 32-bit ({row.name}) program",
                                  why=row.refusal, way_out="checkpoint its x86_64 build, or a tree without it")


def is_32_bit(pid: int) -> bool:
    """The process runs a 32-bit program (ELF class 1 in /proc/PID/exe)."""
    try:
        head = procfs.read_exe_head(pid, 5)
    except (OSError, PtckptError):
        return False                             # no program to read (gone): the freeze says so
    return head[:4] == b"\x7fELF" and head[4] == 1


SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "tcsh", "csh", "busybox"})


def _refuse_own_ancestor(pid: int) -> None:
    """The tree of an ancestor of ptckpt holds ptckpt itself, which cannot trace itself:
    refuse by name (the freeze would otherwise fail on ptckpt's own pid)."""
    ancestors = procfs.ancestors(os.getpid())
    if pid in ancestors:
        name = procfs.comm_or_unknown(pid)
        if ancestors.index(pid) == 0:
            how = "the shell that runs it" if name in SHELLS else "the program that runs it"
        else:
            how = f"ptckpt runs {ancestors.index(pid) + 1} levels below it"
        raise OwnAncestor(pid, name, how)


def _refuse_if_traced(pid: int) -> None:
    for tid in procfs.list_tids(pid):
        try:
            tracer = procfs.read_status(pid, tid=tid).tracer_pid
        except NoSuchProcess:
            continue
        if tracer and tracer != os.getpid():
            raise AlreadyTraced(pid, tracer, procfs.comm_or_unknown(tracer))


def freeze_outside_critical(session: Session, root: int, timeout: float, events: Plugins | None = None):
    """Freeze the tree when none of its processes is inside a critical section (their app
    blocks say) and no plugin says it is busy (a transaction in flight): wait for that,
    freeze, and if one entered a section in between or a plugin says busy, thaw, wait
    again (the plugins' pre_dump) and freeze again, up to `timeout` seconds in all.
    (pids, zombies, app blocks {pid: address})."""
    deadline = time.monotonic() + timeout
    blocks = appblock.locate_all(running_tree(root))
    while True:
        if blocks:
            waited = appblock.wait_outside_critical(blocks, deadline, timeout)
            if waited > 0.01:
                log.info("waited %.3f s for a critical section to end", waited)
        try:
            pids, zombies = freeze_tree_frozen(session, root)
        except AccessDenied:
            _refuse_if_traced(root)
            raise
        blocks.update(appblock.locate_all(p for p in pids if p not in blocks))
        if appblock.busy(blocks) is not None:
            log.info("a critical section began while freezing: thaw and wait")
            session.resume_all()                  # the session is empty again, ready to re-freeze
            continue
        busy = _plugins_busy(events, root, pids, zombies)
        if busy is None:
            return pids, zombies, {p: a for p, a in blocks.items() if p in pids}
        name, why = busy
        session.resume_all()
        if time.monotonic() > deadline:
            raise PluginError(name, "busy", f"{why}, still after {timeout:g} s of tries (--critical-timeout)")
        log.info("plugin %s: %s: thaw, wait for a quiet moment and freeze again", name, why)
        running = running_tree(root)
        view = pidns.pid_view(root, running)
        events.run("pre_dump", [ProcessHandle(p, view.of(p)) for p in running])


def _plugins_busy(events: Plugins | None, root: int, pids: list[int], zombies) -> tuple[str, str] | None:
    if not events:
        return None
    view = pidns.pid_view(root, pids, zombies)
    return events.busy([ProcessHandle(p, view.of(p)) for p in pids])


def running_tree(root: int) -> list[int]:
    """`root` and its descendants as they are now (running: a fork may add more)."""
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        out.append(p)
        with contextlib.suppress(PtckptError):
            todo += [c for c in procfs.read_children(p) if not _is_zombie(c)]
    return out


def plugins_frozen(events: Plugins, session: Session, images: dict[int, ProcessImage],
                    view: pidns.PidView):
    """The shared resources offered for election, then `frozen` for every member; the fds
    the plugins claimed as external are marked so in the images.  Plugins see the
    image's pids (proc.vpid, holders, claims)."""
    events.elect(_shared_resources(images, view))
    handles = []
    for p, im in images.items():
        leader = next(t for t in session.threads_of(p) if t.tid == p)
        handles.append(ProcessHandle(p, view.of(p), pidns.virtual_process(view, im),
                                     tasks={view.of(t.tid): t for t in session.threads_of(p)},
                                     remote_scope=functools.partial(_leader_scope, leader, p, im)))
    log.info("plugins: frozen")
    events.run("frozen", handles)
    claimed = {(view.real(vp), fd): note for (vp, fd), note in events.external().items()}
    for (p, fd) in claimed:
        if p not in images or fd not in {f.fd for f in images[p].fds}:
            raise PluginError(claimed[(p, fd)], "frozen",
                              f"claimed fd {fd} of {view.of(p)}, which it does not have")
    return {p: dataclasses.replace(im, fds=tuple(
                dataclasses.replace(f, external=claimed[(p, f.fd)]) if (p, f.fd) in claimed else f
                for f in im.fds)) for p, im in images.items()}


@contextlib.contextmanager
def _leader_scope(task, pid: int, image: ProcessImage):
    with AddressSpace(pid) as mem:
        with remote_syscalls(task, mem, find_syscall_insn(mem, image.vmas)) as remote:
            yield remote


def _shared_resources(images: dict[int, ProcessImage], view: pidns.PidView) -> list[SharedResource]:
    """Descriptions held by more than one process, and memory objects mapped by more than one
    (holders by the image's pids)."""
    by_desc: dict[int, SharedResource] = {}
    for p, im in images.items():
        for f in im.fds:
            res = by_desc.setdefault(f.desc, SharedResource("fd", f.desc, f.path, []))
            res.holders.append((view.of(p), f.fd))
    by_mem: dict[tuple, SharedResource] = {}
    for p, im in images.items():
        for v in im.vmas:
            key = memory.shared_object_key(v)
            if key is not None:
                res = by_mem.setdefault(key, SharedResource("memory", key, v.path, []))
                if view.of(p) not in {q for q, _ in res.holders}:
                    res.holders.append((view.of(p), v.start))
    return [r for r in list(by_desc.values()) + list(by_mem.values())
            if len({p for p, _ in r.holders}) > 1]


def freeze_tree_frozen(session: Session, root: int) -> tuple[list[int], list[int]]:
    """Freeze `root` and all its descendants: (their pids, parents before children; zombies left out).

    A frozen process cannot fork, so re-reading the children of every member
    until no unfrozen one appears catches a fork that raced the freeze.
    """
    order: list[int] = []
    frozen: set[int] = set()
    zombies: list[int] = []
    while True:
        todo = [root] if root not in frozen else []
        for member in order:
            for c in procfs.read_children(member):
                if c in frozen or c in todo or c in zombies:
                    continue
                if _is_zombie(c):
                    zombies.append(c)
                else:
                    todo.append(c)
        if not todo:
            return order, zombies
        for member in todo:
            if member != root:
                _refuse_if_traced(member)
            try:
                session.freeze_process(member)
            except TargetVanished:
                if member == root:
                    raise
                continue              # a child that exited meanwhile
            except AccessDenied:
                if member == root or not _becomes_zombie(member):
                    raise
                zombies.append(member)    # it was exiting: seize refuses a task in exit
                continue
            frozen.add(member)
            order.append(member)


def capture_sharing_frozen(root: int, images: dict[int, ProcessImage], net: inet.InetDump | None = None,
                           flight: sockets.InFlight | None = None, *, zombies: Sequence[int] = (),
                           save_files: Sequence[str] = (), ext_unix_sk: bool = False) -> registry.Capture:
    """What the members of a frozen tree share (their fd descriptions numbered already), each
    kind of resources.registry capturing its own in the registry's order: the capture,
    whose ``images`` are the images to write and whose records (registry.image_records)
    the image-wide ones.

    Inet sockets go through `net` (the dump's policy for TCP connections, and what it
    holds until the dump ends); without it, a tree holding one is refused.  An fd of a kind
    no restore can make again is refused, by name, and so is what the tree shares with a
    process outside it (resources.sharing).  `flight` (sockets.peek_queues_frozen) has the
    unix sockets' queues and the fds in flight in them, numbered with the tree's: those
    files are dumped as if held by one more process (ptckpt, which holds copies), and
    recorded as IN_FLIGHT_FD.  `zombies`: the tree's; `save_files`: the path patterns of
    files whose contents go into the image.
    """
    capture = registry.Capture.frozen(root, images, net, flight, zombies=zombies, save_files=save_files,
                                      ext_unix_sk=ext_unix_sk)
    registry.capture_frozen(capture)
    return capture


def mark_skipped(image: ProcessImage, patterns: Sequence[str]) -> ProcessImage:
    fds = tuple(dataclasses.replace(f, skipped=True)
                if f.kind is FdKind.REGULAR and any(filepolicy.path_matches(p, f.path) for p in patterns)
                else f for f in image.fds)
    return dataclasses.replace(image, fds=fds)


def _becomes_zombie(pid: int, timeout: float = 0.2) -> bool:
    """A task refused to PTRACE_SEIZE because it is in exit shows as a zombie a moment later."""
    deadline = time.monotonic() + timeout
    while not _is_zombie(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _is_zombie(pid: int) -> bool:
    try:
        return procfs.read_stat(pid).state in ("Z", "X")
    except PtckptError:
        return True


def capture_process_frozen(session: Session, pid: int, writer: ImageWriter, vpid: int, plan: MemoryPlan,
                            parent: ProcessImage | None = None, cow: dict | None = None,
                            lent: Sequence[tuple[int, int]] = ()):
    """One frozen member; `parent`: its parent's image, when a member too, and `cow` the
    pages they share copy-on-write (memory.shared_with_parent): saved once, in the parent's;
    `lent`: the ranges of this process's pages its children share (read without pinning)."""
    refuse_other_abi(pid)                        # a member of another instruction set, before any injection
    tasks = session.threads_of(pid)
    leader = next(t for t in tasks if t.tid == pid)
    # While we trace it, /proc says 't'; whether it was stopped by a signal (SIGSTOP & co)
    # shows in how the freeze found it, and by which one in that stop's status
    # (PTRACE_EVENT_STOP carries the group stop's signal: SIGTSTP for a ^Z).
    group_stopped = leader.stop is not None and leader.stop.kind is StopKind.GROUP_STOP
    stop_signal = leader.stop.signo if group_stopped else 0     # taken now: injections change .stop
    status, stat = procfs.read_status(pid), procfs.read_stat(pid)     # frozen: one reading serves all
    statuses = {t.tid: status if t.tid == pid else procfs.read_status(pid, t.tid) for t in tasks}
    creds.refuse_strict_mode(pid, statuses)
    with AddressSpace(pid) as mem:
        # the smaps the freeze started reading (procfs.read_ahead) is taken once the leader's
        # injections are done: the kernel walks the page tables meanwhile
        maps = procfs.read_maps(pid)
        gadget = find_syscall_insn(mem, maps)
        if not (parent is not None and cow):     # a background dump's last copy, meanwhile too
            plan.copy_early(pid, mem, memory.merge_spans(lent))
        vmas: list = []
        thread_records = []
        task_record = mm = sigactions = None
        own_creds = {}                           # each thread's: credentials are per thread
        for task in [leader] + [t for t in tasks if t is not leader]:
            comm = _thread_comm(pid, task.tid)
            with remote_syscalls(task, mem, gadget) as remote:
                thread_records.append(threads.dump_thread_frozen(task, remote, comm))
                own_creds[task.tid] = creds.dump_creds_frozen(pid, statuses[task.tid], remote, task)
                if task is leader:
                    sigactions = signals.dump_sigactions_frozen(remote)
                    posix_timers, itimers = timers.dump_timers_frozen(pid, remote)
                    timers.check_dumpable(pid, posix_timers, [t.tid for t in tasks])
                    mm = process.dump_mm_frozen(pid, stat, remote)
                    task_record = process.dump_task(pid, [t.tid for t in tasks], status, stat, remote)
                    for tid, st in statuses.items():
                        claims.check_status(pid, tid, st.raw)
                    claims.check_numa(pid, remote, maps)
                    claims.check_namespaces(pid)
                    claims.check_label(pid)
                    if group_stopped:
                        task_record = dataclasses.replace(task_record, state="T", stop_signal=stop_signal)
                    plan.prepare(pid, vpid, remote)
                    vmas = _frozen_vmas(pid, plan, parent, cow)
                    aio.check_in_flight_frozen(pid, remote, vmas)
        thread_records = [dataclasses.replace(t, cgroups=process.thread_cgroups(pid, t.tid, task_record.cgroups),
                                              creds=creds.thread_creds(own_creds[t.tid], own_creds[pid]))
                          for t in thread_records]
        task_record = dataclasses.replace(task_record, cgroup_dirs=process.dump_cgroup_dirs(
            [task_record.cgroups] + [t.cgroups for t in thread_records]))
        fds = plan.visible_fds(pid, files.dump_fds(pid))
        _check_fdinfo(pid, fds)
        aio_rings = aio.dump_aio_rings_frozen(pid, mem, vmas)
        pending = signals.dump_pending_frozen(tasks)
        for task in tasks:   # signals we held back while freezing are still pending
            pending.extend(PendingSignal(task.tid, info) for _sig, info in task.deferred_signals)
        image = ProcessImage(
            task=task_record,
            creds=own_creds[pid],
            mm=mm,
            rlimits=tuple(process.dump_rlimits(pid)),
            vmas=tuple(vmas),
            threads=tuple(thread_records),
            sigactions=tuple(sigactions),
            pending=tuple(pending),
            fds=tuple(fds),
            locks=tuple(locks.to_records(locks.dump_process_locks(pid, [f.fd for f in fds]))),
            timers=tuple(posix_timers),
            itimers=tuple(itimers),
            owners=tuple(files.dump_owners(pid, fds)),
            aio_rings=tuple(aio_rings),
        )
        saved = plan.save_pages(pid, vpid, vmas, writer, mem, memory.merge_spans(lent))
        stats = saved[1] if saved is not None else memory.PageStats()
    _bv, xcr0 = xstate_header(thread_records[0].xstate)
    return image, stats, xcr0, len(thread_records[0].xstate)


def _frozen_vmas(pid: int, plan: MemoryPlan, parent: ProcessImage | None, cow: dict | None) -> list[Vma]:
    try:
        vmas = plan.clean_vmas(pid, memory.dump_vmas(pid, BUILD_IDS))
    except procfs.ZombieProcess:       # killed while frozen, after its smaps was read ahead
        raise TargetVanished(pid, "capture") from None
    memory.check_vmas(pid, vmas)
    if parent is not None and cow:
        vmas = memory.with_cow(vmas, parent.vmas, cow)
    return vmas


def _check_fdinfo(pid: int, fds) -> None:
    """Every fd of a kind a restore makes again shows nothing in its fdinfo that it would
    drop (ptckpt.claims); the kinds no restore makes are refused by files.unsupported_fds."""
    for f in fds:
        if f.kind in files.RESTORABLE_KINDS or f.kind is FdKind.SOCKET:
            try:
                text = procfs.read_fdinfo_text(pid, f.fd)
            except (OSError, PtckptError):
                continue                          # closed meanwhile by another thread? it is frozen
            claims.check_fdinfo(pid, f.fd, f.kind.name, text)


def wait_gone(pid: int, timeout: float = 3.0) -> None:
    """After --kill: until `pid` has ended (a zombie, or reaped), as its pidfd says.  Its
    reaping is its parent's: init reaps lazily on these machines (DESIGN.md, about a
    second), and a restore of the image waits for a zombie holding one of its pids
    (pids.check_pids_free), so the dump does not wait for that."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)      # readable once the whole thread group ended
        poller.poll(timeout * 1000)
    finally:
        os.close(fd)


def _thread_comm(pid: int, tid: int) -> str:
    try:
        return procfs.read_comm(pid, tid=tid)
    except (NoSuchProcess, TargetVanished):
        return ""


