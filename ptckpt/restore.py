"""Restore's rebuilding: what the stages of ptckpt.pipeline.restore call (layer 5).

``ptckpt.pipeline.restore.restore(directory)`` runs these stages, each logged:

1. collect  -- open the image and validate every file (magic, version,
               checksums) before anything else;
2. plan     -- refuse what cannot work, before any process exists: another
               arch or a vdso of another size, xstate features this CPU lacks,
               mapped files missing or changed (size, mtime, inode), fds of
               kinds not restorable yet, a busy pid (named, with --pidns as
               the way out);
3. create   -- clone3(set_tid) a child (in a fresh pid namespace with
               ``pidns``), seized, which execs the restorer stub and sits at
               the exec event;
4. fix up   -- by syscall injection in the stub: gadget page, empty address
               space, vdso moved, every VMA mapped and filled, fds, cwd and
               other task state, mm fields (PR_SET_MM_MAP), dispositions,
               threads (clone3 set_tid), per-thread state, pending signals,
               credentials; then the gadget is unmapped;
5. resume   -- registers, xstate and sigmasks set, every thread detached.

A failure in 3-4 kills the half-built process and raises an error naming the
step (an injected syscall's name, errno and arguments included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import re
import resource
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import appblock, cpuid, procfs
from . import plugins as plugin_mod
from .errors import ExitCode, Incompatible, PluginError, PtckptError, UnsupportedResource
from .plan import image_problems, memory_objects, plan_handoff, queue_refusal
from .plugins import Plugins, ProcessHandle
from .formats.image import ImageReader
from .formats.model import (GP_REG_NAMES, PAGE_SIZE, EpollState, FanotifyState, Fd, FdKind,
                            InotifyState, MsgImage, ProcessImage, SemImage, ShmImage, VmaKind)
from .resources import (anonfds, creds, filepolicy, files, inet, membarrier, memory, pids, process, registry,
                        signals, sockets, sysvipc, terminals, threads, timers, vdso)
from .restorer.stub import gadget_address
from .tracee import AddressSpace, RemotePtr, probe_task, remote_syscalls, xstate_header

log = logging.getLogger("ptckpt.restore")


@dataclass
class RestoreResult:
    pid: int                      # as ptckpt sees it (outer pid namespace)
    vpid: int                     # the image's pid (what the process sees)
    init_pid: int = 0             # the --pidns init, 0 without
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    pty_master: int = -1          # new_pty: the master of the new pty (the caller's to close)
    terminal: int = -1            # shell job: ptckpt's terminal fd the tree was put in front of ...
    foreground_was: int = 0       # ... and the process group that was its foreground before
    terminal_was: terminals.Saved | None = None   # ptckpt's terminal before the restore touched it
    foreground: int = 0           # shell job: the restored group put in front of it
    pids: dict[int, int] = field(default_factory=dict)    # image (virtual) pid -> pid seen here
    exit_status: int | None = None  # its wait status when it ended already (and was reaped) at return
    lazy_bytes: int = 0           # lazy: bytes left to the page server when the tree started
    lazy_server: int = 0          # ... its pid, its watchdog's, and their log
    lazy_watchdog: int = 0
    lazy_log: str = ""

    def summary(self) -> str:
        where = f" in a new pid namespace (init {self.init_pid})" if self.init_pid else ""
        text = f"restored pid {self.vpid}{where} as {self.pid} in {self.seconds:.3f} s"
        if self.init_pid and len(self.pids) > 1:
            text += "; pids (virtual -> real): " + ", ".join(f"{v} -> {r}" for v, r in self.pids.items())
        if self.lazy_server:
            text += (f"; {self.lazy_bytes / 2**20:.1f} MiB come in lazily from page server {self.lazy_server} "
                     f"(watchdog {self.lazy_watchdog}, log {self.lazy_log})")
        return text


# --- plan: refuse before anything exists -------------------------------------------

@dataclass(frozen=True)
class Host:
    """What the plan compares an image with: this machine, read once per restore."""

    maps: tuple                 # ptckpt's own mappings (this kernel's vdso layout)
    xcr0: int                   # xsave features enabled on this CPU
    xstate_size: int            # bytes of the NT_X86_XSTATE regset here
    vdso: bytes = b""           # this kernel's 64-bit vdso (ptckpt's own)

    @functools.cached_property
    def maps32(self) -> tuple:
        """The mappings of this kernel's 32-bit vdso (memory.probe_vdso32), asked for once:
        only for an image with a 32-bit process."""
        return tuple(memory.probe_vdso32()[0])

    @classmethod
    def probe(cls) -> "Host":
        """XCR0 and xstate size come from a throwaway child's NT_X86_XSTATE."""
        with probe_task() as task:
            xs = task.get_xstate()
        return cls(tuple(procfs.read_maps(os.getpid())), xstate_header(xs)[1], len(xs), vdso.own_text())


def plan_problems(image: ImageReader, proc: ProcessImage, host: Host, *, pidns: bool,
                  handed: dict[int, Fd], objects: set) -> None:
    """Refuse what a restore of `proc` cannot make here: this host's checks (arch, page
    size, vdso layout, xsave features, free pids), then ptckpt.plan's that hold on any host."""
    inv = image.inventory
    if inv.arch != os.uname().machine:
        raise Incompatible(f"the image is for {inv.arch}, this machine is {os.uname().machine}")
    if inv.page_size != PAGE_SIZE:
        raise Incompatible(f"the image has {inv.page_size}-byte pages, this machine {PAGE_SIZE}")
    vdso_verdict(image, proc, host)
    xcr0, xsize = host.xcr0, host.xstate_size
    for t in proc.threads:
        missing = t.xfeatures & ~xcr0
        if missing:
            raise Incompatible(f"thread {t.tid} uses xsave features {missing:#x} "
                               f"({', '.join(cpuid.xfeature_names(missing))}) this CPU does not "
                               f"have (image {t.xfeatures:#x}, CPU {xcr0:#x})")
        if len(t.xstate) != xsize:
            raise Incompatible(f"thread {t.tid} has a {len(t.xstate)}-byte xstate area, this CPU "
                               f"{xsize} bytes")
    bad = image_problems(image, proc, handed, objects)
    if bad:
        raise UnsupportedResource(proc.task.pid, "; ".join(bad))
    gone = registry.plan_problems(proc)
    if gone:
        raise Incompatible(f"process {proc.task.pid}: " + "; ".join(gone))
    if not pidns:
        pids.check_pids_free(list(proc.task.tids))


def vdso_verdict(image: ImageReader, proc: ProcessImage, host: Host) -> vdso.Verdict:
    """How the image's vdso is made here (resources.vdso), or Incompatible naming why not.
    A 32-bit process's: this kernel's 32-bit vdso, only where it is laid out as the image's."""
    if threads.compat_process(proc.threads, proc.task.pid):
        why = memory.vdso_mismatch(proc.vmas, host.maps32)
        if why:
            raise Incompatible(f"cannot restore on this kernel: {why}; a 32-bit vdso has no proxy")
        return vdso.Verdict(False, "this kernel's 32-bit vdso, laid out as the image's")
    if image.remote_pages(proc.task.pid) is not None:     # dump --page-server: the bytes come with the pages
        return vdso.Verdict(False, "its saved bytes are on the page server: compared once they are fetched")
    return vdso.judge(proc.vmas, functools.partial(image.read_memory, proc.task.pid), host.maps, host.vdso,
                      proc.threads)


@dataclass
class Finding:
    """One line of `ptckpt check --image`: what was looked at, and what a restore here would meet."""

    what: str
    ok: bool
    detail: str
    exit_code: int = 0            # restore's exit code for it (0: fine)


def preflight(directory: str) -> list[Finding]:
    """Whether image `directory` can be restored on this host, and how: the checks restore's
    plan makes before it builds anything (format, chain, architecture, vdso layout, xsave
    features, pids, mapped and open files, plugins), each as a Finding; nothing is made."""
    out: list[Finding] = []
    try:
        image = ImageReader(directory, verify_pages=False)
    except PtckptError as err:
        return [Finding("image", False, str(err), err.exit_code)]
    with image:
        inv = image.inventory
        chain = f", incremental on {inv.parent}" if inv.parent else ""
        out.append(Finding("image", not inv.memory_only,
                           f"format {image.version}, {len(inv.pids)} process(es) of {inv.hostname}, "
                           f"kernel {inv.kernel_release}{chain}" if not inv.memory_only else
                           "a pre-dump (memory only): restore the dump made with --prev on it",
                           0 if not inv.memory_only else ExitCode.USAGE))
        procs = {p: image.process(p) for p in inv.pids}
        host = Host.probe()
        handoff, objects = plan_handoff(image, procs), memory_objects(procs)
        bad = []
        for p, proc in procs.items():
            try:
                plan_problems(image, proc, host, pidns=True, handed=handoff, objects=objects)
            except PtckptError as err:
                bad.append(err)
        unsent = queue_refusal(image, procs)
        if unsent is not None:
            bad.append(unsent)
        for p, proc in procs.items():
            try:
                verdict = vdso_verdict(image, proc, host)
                out.append(Finding("vdso", True, (f"process {p}: " if len(procs) > 1 else "") + verdict.detail))
            except PtckptError as err:
                out.append(Finding("vdso", False, str(err), err.exit_code))
        out.append(Finding("this host", not bad, "; ".join(str(e) for e in bad) or
                           f"{os.uname().machine}, this kernel's vdso layout, the xsave features used "
                           f"(CPU {host.xcr0:#x})", bad[0].exit_code if bad else 0))
        busy = []
        if not inv.pid_level:
            for p, proc in procs.items():
                try:
                    pids.check_pids_free(list(proc.task.tids), zombie_wait=0)
                except PtckptError as err:
                    busy.append(str(err))
        out.append(Finding("pids", not busy, "; ".join(busy) + " (restore --pidns gives it a pid namespace "
                           "where they are free)" if busy else
                           ("a pid namespace of its own" if inv.pid_level else
                            f"free here: {' '.join(map(str, inv.pids))}"),
                           ExitCode.PID_BUSY if busy else 0))
        saved = {f.path for f in image.saved_files}
        verdict = filepolicy.evaluate(file_identities(procs, saved), filepolicy.FilePolicy())
        changed = verdict.refused + verdict.warnings
        out.append(Finding("files", not verdict.refused,
                           ("changed since the dump: " + "; ".join(changed) +
                            (" (--file-policy warn or ignore to go on)" if verdict.refused else ""))
                           if changed else "every file it uses is as it was",
                           filepolicy.FilesChanged.exit_code if verdict.refused else 0))
        needs = [f"{n} {v}".strip() for n, v in plugin_mod.required(image.plugin_data)]
        out.append(Finding("plugins", True, ("needs " + ", ".join(needs) + " (--plugin)") if needs else "none needed"))
    return out


def file_identities(procs: dict[int, ProcessImage], saved: set[str]) -> list[filepolicy.FileIdentity]:
    """What the image recorded of every file a restore reopens by path: mapped files (with
    their build-id) and regular files open as fds; not the deleted, skipped or saved ones."""
    out = []
    for proc in procs.values():
        for v in proc.vmas:
            if (v.kind in (VmaKind.FILE_PRIVATE, VmaKind.FILE_SHARED) and not v.file_deleted
                    and v.path.startswith("/") and v.path not in saved):
                out.append(filepolicy.FileIdentity(v.path, v.file_size, v.file_mtime_ns, v.inode,
                                                   os.makedev(v.dev_major, v.dev_minor), v.build_id))
        for f in proc.fds:
            if (f.kind is FdKind.REGULAR and not f.skipped and not f.external and files.ghost_key(f) is None
                    and f.path not in saved and tree_proc_pid(f.path, procs) is None):
                out.append(filepolicy.FileIdentity(f.path, f.size, f.mtime_ns, f.ino, f.dev,
                                                   append_hash=f.append_hash))
    return out


# --- create, fix up, resume ---------------------------------------------------------

def start_lazy_server(server, result: RestoreResult, pids: list[int]) -> None:
    """The lazy page server leaves ptckpt for a process of its own, before the tree runs."""
    result.warnings += server.warnings
    if not server.spaces:
        server.abort()
        return
    result.lazy_bytes = server.lazy_bytes
    result.lazy_server, result.lazy_watchdog, result.lazy_log = server.start_daemon(pids)
    log.info("lazy: %.1f MiB left to page server %d", server.lazy_bytes / 2**20, result.lazy_server)


@contextlib.contextmanager
def checking_pages(image: ImageReader, lazy: bool = False):
    """The image's page data checked in a thread while the restore goes on (its verdict is
    asked before the restored processes run); stopped when the restore ends otherwise.
    `lazy`: only what the lazy page server cannot check block by block as it serves."""
    check = image.page_check(lazy)
    try:
        yield check
    finally:
        check.cancel()


def settle_notifications(states, handed: dict) -> None:
    """Once the tree is rebuilt: inotify queues emptied of the events the restore caused (its
    opens of the tree's files, the unlinks of ghost files; a queue was empty at dump), and
    fanotify groups marked (their marks would have queued the same)."""
    for state in states:
        if state.desc not in handed:
            continue
        if isinstance(state, InotifyState):
            anonfds.drain_inotify(handed[state.desc])
        elif isinstance(state, FanotifyState):
            anonfds.mark_fanotify(handed[state.desc], state)


def reap_traced_threads(tgid: int) -> None:
    """The threads ptckpt traces in a killed process are its to reap (__WALL), or the
    process never stops being a zombie and the wait for it never ends."""
    try:
        tids = [t for t in procfs.list_tids(tgid) if t != tgid]
    except (OSError, PtckptError):
        return
    # The leader last: it is a zombie once its threads are gone.  Traced, it is ours to reap
    # first too (the parent, an init of --pidns, would otherwise wait for it for ever while
    # ptckpt waited for that init: a failed restore of a tree hung so).
    for tid in tids + [tgid]:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(tid, WALL)


def restore_sysv(objects) -> list[tuple[sysvipc.IpcKind, int]]:
    """Make the image's SysV objects exist again (same ids, keys, contents); returns those
    that were made anew (a failed restore removes them; the others existed already)."""
    kinds = {ShmImage: (sysvipc.IpcKind.SHM, sysvipc.restore_shm, "shmid"),
             SemImage: (sysvipc.IpcKind.SEM, sysvipc.restore_sem, "semid"),
             MsgImage: (sysvipc.IpcKind.MSG, sysvipc.restore_msg, "msqid")}
    existing = ({(sysvipc.IpcKind.SHM, s.shmid) for s in sysvipc.list_shm()}
                | {(sysvipc.IpcKind.SEM, s.semid) for s in sysvipc.list_sem()}
                | {(sysvipc.IpcKind.MSG, q.msqid) for q in sysvipc.list_msg()}) if objects else set()
    made: list[tuple[sysvipc.IpcKind, int]] = []
    try:
        for obj in objects:
            kind, make, id_field = kinds[type(obj)]
            make(obj)
            if (kind, getattr(obj, id_field)) not in existing:
                made.append((kind, getattr(obj, id_field)))
    except BaseException:
        for kind, ipc_id in made:
            with contextlib.suppress(PtckptError):
                sysvipc.remove_object(kind, ipc_id)
        raise
    return made


def under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def check_external(procs: dict[int, ProcessImage], events: Plugins) -> None:
    """Every fd a plugin marked external at dump must be claimed, or given, by a plugin now."""
    taken = events.claimed() | {(p, n) for p, n, _fd in events.installs()} if events else set()
    for p, proc in procs.items():
        for f in proc.fds:
            if f.external and (p, f.fd) not in taken:
                raise PluginError("(none)", "pre_restore",
                                  f"process {p} fd {f.fd} ({f.path}) is external ({f.external}) and no "
                                  f"plugin claimed it")


def install_fd_frozen(remote, channel: int, theirs: int, cloexec: dict[int, bool], vpid: int, number: int,
                local_fd: int) -> None:
    """A plugin's `restored`: send ptckpt's fd over the channel, the process receives it (with
    the close-on-exec flag the image's fd of that number had)."""
    with socket.socket(fileno=os.dup(channel)) as sock:
        socket.send_fds(sock, [b"f"], [local_fd])
    plugin_mod.receive_fd_frozen(remote, theirs, number, cloexec=cloexec.get(number, False))


def raise_nofile() -> None:
    """ptckpt holds every fd the tree shares at once, above the image's own fd numbers, and the
    stubs inherit its limit: take the hard RLIMIT_NOFILE as the soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


CLONE_NEWNS, MS_BIND, MS_REC, MS_PRIVATE = 0x20000, 0x1000, 0x4000, 0x40000


def _private_mounts(task, binds: Sequence[tuple[str, str]]) -> None:
    """The root stub (before it has children, which inherit it) gets a private mount
    namespace in which each NEW is bind-mounted on its OLD (restore --remap-path)."""
    with _stub_syscalls(task) as remote:
        remote.checked("unshare", CLONE_NEWNS, step="--remap-path: a mount namespace of its own")
        with remote.scratch(b"/\0") as root:
            remote.checked("mount", 0, int(root), 0, MS_REC | MS_PRIVATE, 0,
                           step="--remap-path: make its mounts private")
        for new, old in binds:
            with remote.scratch(os.fsencode(new) + b"\0") as src, remote.scratch(os.fsencode(old) + b"\0") as dst:
                remote.checked("mount", int(src), int(dst), 0, MS_BIND | MS_REC, 0,
                               step=f"--remap-path: bind {new} on {old}")


def new_tty(image: ImageReader, procs: dict[int, ProcessImage], handed: dict):
    """(the new pty slave's fd number in the stubs, its Terminal record) for the root, or None."""
    for rec in image.terminals:
        if rec.desc in handed:
            return handed[rec.desc], rec
    return None


def leader_on_callers_terminal(image: ImageReader, procs: dict[int, ProcessImage]) -> bool:
    """The root led its session, its controlling terminal was its stdio, and ptckpt restore
    runs on a terminal of its own (in its session): then the root cannot have a session
    of its own with that terminal (TIOCSCTTY: EPERM, it is the caller's session's), and
    joins the caller's session instead."""
    root = procs[image.inventory.root_pid].task
    if root.sid != root.pid:
        return False
    for rec in image.terminals:
        f = next((f for f in procs[root.pid].fds if f.desc == rec.desc), None)
        if f is not None and rec.controlling and os.isatty(f.fd):
            return terminals.session_of(f.fd) == os.getsid(0)
    return False


def job_leads_new_pty(image: ImageReader, procs: dict[int, ProcessImage]) -> bool:
    """--new-pty for a shell job (its controlling terminal was its stdio, in its shell's
    session): the new pty can be its controlling terminal only in a session it leads,
    which it can lead when it led its process group and every group of the tree is the
    tree's (a group left outside would be in another session)."""
    root = procs[image.inventory.root_pid].task
    if root.sid == root.pid or root.pgid != root.pid:
        return False
    if not any(rec.controlling for rec in image.terminals):
        return False
    return all(proc.task.pgid in procs for proc in procs.values()) and not image.zombies


def front_of_terminal(image: ImageReader, procs: dict[int, ProcessImage], created: dict,
                       result: RestoreResult) -> None:
    """A shell job: the image's termios on ptckpt's terminal, and the job's own process group
    in front of it if it was in front when dumped."""
    root = procs[image.inventory.root_pid].task
    for rec in image.terminals:
        f = next((f for f in procs[root.pid].fds if f.desc == rec.desc), None)
        if f is None or not os.isatty(f.fd):
            continue
        group = created.get(root.pgid)
        front = group.tgid if group is not None and rec.fg_pgrp == root.pgid else None
        try:
            was = os.tcgetpgrp(f.fd)
        except OSError:
            was, front = 0, None                 # not our controlling terminal: settings only
        result.terminal_was = terminals.save(f.fd)
        terminals.apply_terminal_state(f.fd, terminals.from_record(rec), foreground_pgrp=front,
                                       winsize=False)
        if front is not None:
            result.terminal, result.foreground_was, result.foreground = f.fd, was, front
        return


def pty_ttys(image: ImageReader, procs: dict[int, ProcessImage], handed: dict) -> dict[int, tuple[int, int]]:
    """{session: (a slave fd of its pty in the stubs, foreground group or -1)} for each pty of
    the tree that is the controlling terminal of a session of the tree."""
    virtual = {real: v for v, real in image.inventory.real_pids}    # the ioctls saw the dumper's pids
    out = {}
    for rec in image.ptys:
        fd = handed.get(terminals.ctty_key(rec))
        sid = virtual.get(rec.sid, rec.sid)
        if fd is not None and sid in procs and procs[sid].task.sid == sid:
            out[sid] = (fd, virtual.get(rec.fg_pgrp, rec.fg_pgrp))
    return out


def create_tree(procs: dict[int, ProcessImage], zombies, helpers, created: dict, tty=None,
                 binds: Sequence[tuple[str, str]] = (), own_session: bool = True, lead: bool = False,
                 ptys: dict[int, tuple[int, int]] | None = None, memory_first=lambda pid: None,
                 all_made=lambda created: None) -> None:
    """Every member, zombie and group helper as a stub, children cloned inside their parent's
    stub; then sessions and process groups; then the zombies and helpers end.

    `tty` (the new pty's slave fd in the stubs, its Terminal record): it becomes the
    root session's controlling terminal, before any other member exists (the
    children inherit it), and its foreground group is set once the groups exist.

    `ptys` ({session leader: (slave fd in the stubs, foreground group)}): the tree's own
    ptys become the controlling terminals of the sessions they were, at the leader's
    creation too, and get their foreground groups back.

    own_session=False: a root that led its session stays in ptckpt restore's
    (it leads its own process group there), with the members of its session: the
    terminal it is restored onto is the controlling terminal of that session.
    lead=True: a root that did not lead its session leads one (with the members of
    its session), so that the new pty can be its controlling terminal.
    `memory_first(pid)` runs before a member's first child is cloned (a parent whose
    children share pages with it copy-on-write gets its memory first).  `all_made(created)`
    runs once every member, zombie and helper exists, before the zombies end (pidfds
    are made on them then).
    """
    members = list(procs)
    records = {p: procs[p].task for p in members}
    records.update({z.pid: z for z in zombies})
    root = members[0]
    if not own_session and records[root].sid == root:
        records[root] = dataclasses.replace(records[root], sid=0)      # no setsid: setpgid only
    if lead and records[root].sid != root:
        old = records[root].sid
        records.update({p: dataclasses.replace(r, sid=root) for p, r in records.items() if r.sid == old})
    _restore_session(created[root], records[root])
    if binds:
        _private_mounts(created[root], binds)
    if tty is not None and records[root].sid == root and tty[1].controlling:
        with _stub_syscalls(created[root]) as remote:
            terminals.make_controlling_tty_frozen(remote, tty[0])
    ptys = ptys or {}
    if root in ptys and records[root].sid == root:
        _controlling_pty(created[root], root, ptys[root][0])
    for p in members[1:] + [z.pid for z in zombies]:
        record = records[p]
        log.info("create %d (child of %d%s)", p, record.ppid, "" if p in procs else ", a zombie")
        memory_first(record.ppid)
        created[p] = _create_child(created[record.ppid], p, files=getattr(record, "shares_files", False),
                                   fs=getattr(record, "shares_fs", False))
        _restore_session(created[p], record)
        if p in ptys and record.sid == p:
            _controlling_pty(created[p], p, ptys[p][0])
    for h in helpers:
        log.info("create %d (stand-in leader of process group %d, whose leader exited)", h.pid, h.pgid)
        created[h.pid] = _create_child(created[h.ppid], h.pid)
        records[h.pid] = h
    # Group leaders first, so the groups exist when the others join them.
    for p in sorted(records, key=lambda p: records[p].pgid != p):
        _restore_pgid(created[p], records[p], created)
    if tty is not None and records[root].sid == root and tty[1].fg_pgrp in created:
        with _stub_syscalls(created[root]) as remote:
            # in the tree's own namespace the group has the image's number
            terminals.set_foreground_frozen(remote, tty[0], tty[1].fg_pgrp)
    for leader, (fd, fg) in ptys.items():
        if fg in created and leader in created:
            with _stub_syscalls(created[leader]) as remote:
                terminals.set_foreground_frozen(remote, fd, fg)
    all_made(created)
    for z in zombies:
        task = created.pop(z.pid)
        pids.end_stub(task, task.gadget or gadget_address(), z.wait_status)
    for h in helpers:
        task = created.pop(h.pid)
        pids.end_stub(task, task.gadget or gadget_address(), 0)
        with _stub_syscalls(created[h.ppid]) as remote:      # reap it: nobody may see it
            remote.checked("wait4", h.pid, 0, WALL, 0, step=f"reap group helper {h.pid}")


WALL = 0x40000000


def _controlling_pty(task, pid: int, fd: int) -> None:
    """A new session leader takes its pty (a slave the stub inherited) as controlling terminal,
    before its children are made (they inherit it)."""
    log.info("pty at fd %d: the controlling terminal of session %d", fd, pid)
    with _stub_syscalls(task) as remote:
        terminals.make_controlling_tty_frozen(remote, fd)


@dataclass(frozen=True)
class GroupHelper:
    """A process that exists only during the restore, to recreate a process group whose
    leader had exited: it takes the group's pid and leads it while the members join,
    then ends and is reaped by the member that created it."""

    pid: int
    ppid: int          # the member that creates it (one in the group's session)
    pgid: int
    sid: int


def group_helpers(procs: dict[int, ProcessImage], zombies) -> list[GroupHelper]:
    """A helper for each process group whose leader is neither a member nor a zombie.

    The root's own group, when led from outside the tree, is the shell job's:
    the restored tree joins ptckpt restore's group instead, as a single process does.
    """
    root = next(iter(procs.values())).task
    present = set(procs) | {z.pid for z in zombies}
    out: dict[int, GroupHelper] = {}
    for t in [proc.task for proc in procs.values()] + list(zombies):
        if t.pgid in present or t.pgid == root.pgid or t.pgid in out:
            continue
        creator = next((p.task.pid for p in procs.values() if p.task.sid == t.sid), t.pid)
        out[t.pgid] = GroupHelper(pid=t.pgid, ppid=creator, pgid=t.pgid, sid=t.sid)
    return list(out.values())


def build_handoff(image: ImageReader, procs: dict[int, ProcessImage], plan: dict[int, Fd],
                  new_pty: bool = False, installs: Sequence[tuple[int, int, int]] = (),
                  channel: bool = False, net: inet.InetRestore | None = None,
                  credentials: sockets.QueuedCredentials | None = None) -> dict:
    """Open what `plan` names, and make the shared memory objects, in ptckpt: inheritable
    and above every fd number of the image (so the stubs inherit them where no fd of
    theirs lands).  {desc: fd number} and {memory.shared_object_key: fd number}.

    Each kind of resources.registry makes its own, in the registry's order, adding to
    the hand-off as it goes, so that a failure closes whatever was opened before it."""
    made = registry.Handoff(image, procs, plan, new_pty, net, credentials)
    try:
        registry.create(made)
        _add_plugin_fds(installs, channel, made.opened)
        _move_above_image_fds(procs, installs, made.opened)
    except BaseException:
        for fd in made.opened.values():
            os.close(fd)
        raise
    return made.opened


def _add_plugin_fds(installs: Sequence[tuple[int, int, int]], channel: bool, opened: dict) -> None:
    """The fds plugins give in pre_restore, and the channel for those they give in `restored`."""
    for pid, number, fd in installs:
        opened[("install", pid, number)] = os.dup(fd)
    if channel:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        opened["plugin-channel-ours"], opened["plugin-channel"] = ours.detach(), theirs.detach()


def _move_above_image_fds(procs: dict[int, ProcessImage], installs: Sequence[tuple[int, int, int]],
                          opened: dict) -> None:
    """Every fd for the stubs moved above the image's fd numbers, inheritable (F_DUPFD: not
    close-on-exec); ptckpt's own ends stay where they are."""
    base = 1 + max([2] + [f.fd for proc in procs.values() for f in proc.fds]
                   + [number for _pid, number, _fd in installs])
    for d, fd in list(opened.items()):
        if d in ("pty-master", "plugin-channel-ours"):
            continue                          # ptckpt's own end: not for the stubs
        opened[d] = fcntl.fcntl(fd, fcntl.F_DUPFD, base)
        os.close(fd)


@contextlib.contextmanager
def _stub_syscalls(task):
    """Injection into a process that is still a stub: the stub's own gadget and stack, or the
    gadget its memory was rebuilt around (its own, or its parent's before it was cloned)."""
    with AddressSpace(task.tgid) as mem:
        with _injection(task, mem) as remote:
            yield remote


def _injection(task, mem: AddressSpace):
    if task.gadget is None:
        return remote_syscalls(task, mem, RemotePtr(gadget_address()), keep_regs=False)
    return remote_syscalls(task, mem, RemotePtr(task.gadget), keep_regs=False,
                           scratch_top=memory.gadget_scratch_top(task.gadget))


def rebuild_memory(task, proc: ProcessImage, runs, sources, handed: dict) -> None:
    """A stub's address space becomes the image's (before its children are cloned, when they
    inherit pages copy-on-write from it); its gadget moves, and the task remembers where."""
    with AddressSpace(task.tgid) as mem:
        with _injection(task, mem) as remote:
            _rebuild_memory_frozen(remote, mem, proc, runs, sources, handed)
            task.gadget = int(remote.gadget)


def _rebuild_memory_frozen(remote, mem, proc: ProcessImage, runs, sources, handed: dict, lazy=None) -> None:
    log.info("fix up %d: address space", proc.task.pid)
    compat = threads.compat_process(proc.threads, proc.task.pid)
    kernel = next((v for v in proc.vmas if v.kind is VmaKind.VDSO), None)
    if lazy is not None and kernel is not None:
        lazy.ready(sources, (kernel.start, kernel.end))       # the vdso's saved bytes, for vdso.judge
    proxy = None if compat else vdso.judge(proc.vmas, functools.partial(vdso.image_text, sources=sources),
                                           procfs.read_maps(os.getpid()), vdso.own_text(), proc.threads)
    if proxy is not None and proxy.proxy:
        log.info("fix up %d: vdso proxy: %s", proc.task.pid, proxy.detail)
    else:
        proxy = None
    memory.prepare_address_space_frozen(remote, mem, proc.vmas, compat=compat, proxy=proxy is not None)
    memory.restore_vmas_frozen(remote, mem, proc.vmas, runs, sources, handed, lazy, proxy)


def _restore_session(task, record) -> None:
    """A session leader gets its own session again (setsid, right after it is created, so the
    children created after it inherit the session).  Other sessions are the shell job's."""
    if record.sid == record.pid:
        with _stub_syscalls(task) as remote:
            remote.checked("setsid", step=f"new session for {record.pid}")


def _restore_pgid(task, record, created) -> None:
    """Process groups: its own, or that of another member (which leads it by then)."""
    if record.pgid == record.sid == record.pid:
        return                                    # setsid made it the group leader
    if record.pgid == record.pid or record.pgid in created:
        with _stub_syscalls(task) as remote:
            remote.checked("setpgid", 0, record.pgid, step=f"process group {record.pgid} for {record.pid}")


def _create_child(parent, pid: int, files: bool = False, fs: bool = False):
    """clone3(set_tid=[pid]) inside the parent's stub, before either is rebuilt: the child is
    a copy of the stub, stopped (the tracer follows forks), and becomes its own process
    (sharing the stub's fd table or fs state where the image says it shared its parent's)."""
    with _stub_syscalls(parent) as remote:
        child = threads.create_process_frozen(remote, pid, files=files, fs=fs)
    child.gadget = parent.gadget                 # a copy of the parent's address space
    return child


def fix_up_order(procs: dict[int, ProcessImage]) -> list[int]:
    """Members in the order they are rebuilt: one that shares its parent's fd table comes
    before that parent, which makes the table's fds for both (the fds the stubs were handed
    stay until the last of them is rebuilt)."""
    def depth(p: int) -> int:
        t = procs[p].task
        return depth(t.ppid) + 1 if t.shares_files and t.ppid in procs else 0
    return sorted(procs, key=lambda p: -depth(p))


def open_pages(fd: int) -> int:
    """The pages file again, O_DIRECT where possible: the data goes to the tracee, not our cache."""
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return os.dup(fd)


_PROC_PID = re.compile(r"^/proc/(\d+)(?=/|$)")


def tree_proc_pid(path: str, procs) -> int | None:
    """The member whose /proc directory `path` is under (/proc/PID/...), or None."""
    m = _PROC_PID.match(path)
    return int(m.group(1)) if m and int(m.group(1)) in procs else None


def at_restored_pids(procs: dict[int, ProcessImage], real: dict[int, int]) -> dict[int, ProcessImage]:
    """Files a member holds open under /proc/PID of a member (its own or another's) are
    opened again under that member's restored pid, as this /proc shows it."""
    def moved(f: Fd) -> Fd:
        p = tree_proc_pid(f.path, real)
        return f if p is None else dataclasses.replace(f, path=_PROC_PID.sub(f"/proc/{real[p]}", f.path))
    return {p: dataclasses.replace(proc, fds=tuple(map(moved, proc.fds))) for p, proc in procs.items()}


def epoll_registrars(procs: dict[int, ProcessImage], states) -> dict[int, list[tuple[int, EpollState]]]:
    """{pid: [(its epoll fd, state)]}: each epoll's registrations are made again by the first
    member holding it in an fd table of its own (at that member's fd numbers, as the image
    recorded them; one sharing its parent's table leaves it to the parent)."""
    todo = {s.desc: s for s in states if isinstance(s, EpollState)}
    out: dict[int, list[tuple[int, EpollState]]] = {}
    # A member that also holds the files of its closed-number targets first (the dump's);
    # never one that shares its parent's fd table (the parent registers for both).
    for whole in (True, False):
        for p, proc in procs.items():
            if proc.task.shares_files:
                continue
            held = {f.desc for f in proc.fds if not f.skipped}
            for f in proc.fds:
                state = todo.get(f.desc)
                if state is not None and not f.skipped and (not whole or held >= set(state.sources) - {0}):
                    out.setdefault(p, []).append((f.fd, todo.pop(f.desc)))
    return out


def fix_up(leader, vpid: int, proc: ProcessImage, runs, sources,
            handed: dict, epolls: list[tuple[int, EpollState]], events: Plugins | None = None,
            channel: int = -1, breaks: list | None = None, memory_done: bool = False, lazy=None,
            pidfds_made: dict | None = None, creds_later: bool = False, keep_channel: bool = False):
    """Rebuild one process from its stub (its memory first, unless `memory_done`; `lazy`:
    the lazypages.Server its anonymous memory is left to); returns (warnings, its tasks,
    still stopped).  The order of the steps matters: the kinds of resources.registry
    install at its points (INSTALL_POINTS: the fd table, then, after the task's cwd and
    root, the locks last of the fd work; the fd owners after the creds), creds after the
    signals, the plugins' `restored` event after all, the gadget last.  With `creds_later`
    (a held template: ptckpt.clones) the credentials, seccomp filters and parent-death
    signal are left as ptckpt's, for the caller to set; with `keep_channel` the plugin
    channel stays open in it."""
    warnings: list[str] = []
    inherited = procfs.list_fds(leader.tgid)
    with AddressSpace(leader.tgid) as mem:
        with _injection(leader, mem) as remote:
            if not memory_done:
                _rebuild_memory_frozen(remote, mem, proc, runs, sources, handed, lazy)
            chan = handed.get("plugin-channel", -1)
            dirs = {k: fd for k, fd in handed.items() if isinstance(k, tuple) and k[0] == "ghost-dir"}
            # own_table: else its parent makes the fds for both
            installing = registry.Install(remote, vpid, proc, handed, inherited, not proc.task.shares_files,
                                          epolls, channel, chan, dirs, pidfds_made)
            registry.install(installing, registry.MEMORY)
            log.info("fix up %d: files and task state", proc.task.pid)
            registry.install(installing, registry.FD_TABLE)
            registry.install(installing, registry.AFTER_FDS)
            warnings += _restore_task_and_mm_frozen(remote, proc, dirs)
            registry.install(installing, registry.AFTER_TASK)
            warnings += process.restore_rlimits(leader.tgid, proc.rlimits)
            warnings += process.restore_cgroups(leader.tgid, proc.task.cgroups)
            signals.restore_sigactions_frozen(remote, proc.sigactions,
                                              compat=threads.compat_process(proc.threads, proc.task.pid))
            log.info("fix up %d: threads", proc.task.pid)
            tasks = _create_threads_frozen(remote, mem, leader, proc)
            for t in proc.threads:
                warnings += process.restore_thread_cgroups(leader.tgid, tasks[t.tid].tid, t.cgroups)
            _restore_signals_frozen(remote, mem, leader, vpid, proc, tasks)
            if not creds_later:
                warnings += _restore_creds_frozen(remote, mem, leader, proc, tasks)
            registry.install(installing, registry.AFTER_CREDS)
            if not creds_later:
                process.restore_pdeath_signal_frozen(remote, proc.task)
            process.restore_mdwe_frozen(remote, proc.task)
            overrides = _run_restored_event(events, remote, leader, vpid, proc, tasks, channel, chan,
                                            breaks)
            if chan >= 0 and installing.own_table and not keep_channel:
                remote.checked("close", chan, step="close ptckpt's plugin channel")
            log.info("resume %d", proc.task.pid)
            _remove_gadget_frozen(remote)
        warnings += _set_final_states(proc, tasks, overrides)
    return warnings, [tasks[t.tid] for t in proc.threads if t.tid != proc.task.pid] + [leader]


def _thread_syscalls(task, mem: AddressSpace, remote):
    """Injection into another thread of a process being fixed up, at its leader's gadget."""
    return remote_syscalls(task, mem, remote.gadget, scratch_top=remote.scratch_top, keep_regs=False)


def _restore_task_and_mm_frozen(remote, proc: ProcessImage, dirs: dict) -> list[str]:
    """The task's own state, its mm fields and membarrier registrations, then its root."""
    warnings = process.restore_task_frozen(remote, proc.task, dirs)
    process.restore_mm_frozen(remote, proc.mm)
    membarrier.restore_registrations_frozen(remote, proc.mm.membarrier)
    process.restore_root_frozen(remote, proc.task, dirs)
    return warnings


def _create_threads_frozen(remote, mem: AddressSpace, leader, proc: ProcessImage) -> dict:
    """The process's other threads cloned, then each thread's own state set from inside it;
    {tid: Task}, the leader's included."""
    tasks = {proc.task.pid: leader}
    for t in proc.threads:
        if t.tid != proc.task.pid:
            tasks[t.tid] = threads.create_thread_frozen(remote, t.tid)
    for t in proc.threads:
        task = tasks[t.tid]
        if task is leader:
            threads.restore_thread_frozen(task, remote, t)
        else:
            with _thread_syscalls(task, mem, remote) as tremote:
                threads.restore_thread_frozen(task, tremote, t)
    return tasks


def _restore_signals_frozen(remote, mem: AddressSpace, leader, vpid: int, proc: ProcessImage,
                            tasks: dict) -> None:
    """Every thread's signals blocked, the timers, then the pending signals: the process's
    and each thread's own."""
    # Everything blocked while the saved signals are queued and the last
    # syscalls run: none may be delivered before the thread's own mask is back.
    for task in tasks.values():
        task.set_sigmask(signals.ALL_BLOCKED)
    timers.restore_timers_frozen(remote, proc.timers, proc.itimers)
    # A signal of a kernel's si_code may only be queued by its own thread (rt_tgsigqueueinfo).
    signals.restore_pending_frozen(remote, vpid, [p for p in proc.pending if p.tid in (0, vpid)])
    for tid, task in tasks.items():
        mine = [p for p in proc.pending if p.tid == tid and task is not leader]
        if mine:
            with _thread_syscalls(task, mem, remote) as tremote:
                signals.restore_pending_frozen(tremote, vpid, mine)


def _restore_creds_frozen(remote, mem: AddressSpace, leader, proc: ProcessImage, tasks: dict) -> list[str]:
    """Each thread's seccomp filters and credentials (they are per thread): its own where its
    THREAD record has them, else its process's.  The filters all threads share go in first,
    from the leader with TSYNC; then, in each thread, the rest of its own filters while it is
    still privileged, and its credentials after them (ptckpt.resources.creds)."""
    own = {t.tid: t.creds[0] if t.creds else proc.creds for t in proc.threads}
    own[proc.task.pid] = proc.creds
    shared = creds.shared_filters(list(own.values()))
    creds.restore_seccomp_frozen(remote, proc.creds, upto=shared)
    creds.restore_seccomp_frozen(remote, proc.creds, first=shared, tsync=False)
    warnings = creds.restore_creds_frozen(remote, proc.creds)
    for tid, task in tasks.items():
        if task is not leader:
            with _thread_syscalls(task, mem, remote) as tremote:
                creds.restore_seccomp_frozen(tremote, own[tid], first=shared, tsync=False)
                warnings += creds.restore_creds_frozen(tremote, own[tid])
    return warnings


def _run_restored_event(events: Plugins | None, remote, leader, vpid: int, proc: ProcessImage,
                        tasks: dict, channel: int, chan: int, breaks: list | None) -> dict:
    """The plugins' `restored` event for the rebuilt process; {tid: {register: value}} they
    set for its threads."""
    overrides: dict = {}
    if events:
        log.info("plugins: restored %d", vpid)
        events.run("restored", [ProcessHandle(
            leader.tgid, vpid, proc, tasks=tasks, remote_scope=lambda: contextlib.nullcontext(remote),
            fd_installer=functools.partial(install_fd_frozen, remote, channel, chan,
                                           {f.fd: f.cloexec for f in proc.fds}),
            reg_overrides=overrides, breakpoints=breaks)])
    return overrides


def _remove_gadget_frozen(remote) -> None:
    """The last injected syscall removes the gadget it runs from; the thread stops at its
    exit, before fetching another instruction."""
    gadget = int(remote.gadget)
    remote.checked("munmap", gadget & ~(PAGE_SIZE - 1), memory.GADGET_PAGES * PAGE_SIZE,
                   step="unmap the gadget")


def _set_final_states(proc: ProcessImage, tasks: dict, overrides: dict) -> list[str]:
    """Every thread's registers (a plugin's overrides on top), affinity and scheduling."""
    warnings: list[str] = []
    for t in proc.threads:
        if t.tid in overrides:                   # registers a plugin set in `restored`
            t = dataclasses.replace(t, regs=tuple(overrides[t.tid][name] for name in GP_REG_NAMES))
        threads.set_final_state(tasks[t.tid], t)
        warnings += threads.restore_affinity(tasks[t.tid], t)
        warnings += threads.restore_sched(tasks[t.tid], t)
    return warnings


def _virtual_tid(task) -> int:
    try:
        return procfs.read_status(task.tgid, task.tid).nspid[-1]
    except PtckptError:
        return task.tid


def resume_holding_first(tasks: list, blocks: dict[int, int], created: dict, timeout: float) -> list[str]:
    """Let every restored thread go; a thread the program named in its app block's
    hold_tid goes first, alone, until it clears it (the program is in a well-behaved
    state again).  Warnings for a hold that outlasted `timeout`."""
    holds = {}                                          # tgid -> (image pid, block, held tid)
    for p, addr in blocks.items():
        tid = appblock.hold_tid(created[p].tgid, addr)
        if tid:
            holds[created[p].tgid] = (p, addr, tid)
    first = [t for t in tasks if t.tgid in holds and _virtual_tid(t) == holds[t.tgid][2]]
    for task in first:
        task.detach()
    warnings = []
    deadline = time.monotonic() + timeout
    for task in first:
        p, addr, _tid = holds[task.tgid]
        log.info("resume: thread %d of %d runs alone until the program is ready", task.tid, p)
        while True:
            try:
                if not appblock.hold_tid(task.tgid, addr):
                    break
            except PtckptError:
                break                                   # it exited
            if time.monotonic() > deadline:
                warnings.append(f"process {p} held the other threads for more than {timeout:g} s "
                                f"(hold_resume without ready): they run now")
                break
            time.sleep(0.001)
    for task in tasks:
        if task not in first:
            task.detach()
    return warnings


def wait_restored(result: RestoreResult) -> int:
    """Wait for the restored process (or its --pidns init) and return a shell-style exit status."""
    target = result.init_pid or result.pid
    status = result.exit_status if not result.init_pid else None
    while status is None:
        try:
            got, status = os.waitpid(target, 0)
        except ChildProcessError:
            return 0
        if got == target:
            break
    return shell_status(status)


def shell_status(status: int) -> int:
    """A wait(2) status as a shell shows it: the exit code, or 128+N after signal N."""
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


