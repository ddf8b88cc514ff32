"""The table of resource kinds: what each kind does at dump and at restore, in the order of work.

Each :class:`Row` names a kind of state the tree shares or holds (pipes, ghost files, unix
sockets, fd states, locks ...), the resources module holding its dump and restore halves,
and the operations it has; an operation a kind lacks is None:

- ``capture(Capture) -> records``: its image-wide records, read from the frozen tree
  once every process was captured (dump.capture in ptckpt.pipeline.dump);
- ``plan(ProcessImage) -> problems``: what this host lacks for it, said before a restore
  builds anything (ptckpt.restore.plan_problems);
- ``create(Handoff)``: its objects made in ptckpt before the stubs exist, each fd put in
  ``Handoff.opened`` as it is made, so that a failure closes it (restore.build_handoff);
- ``install(Install)``: per process, inside its stub by injected syscalls, at one of the
  points of fix-up named by ``install_at`` (restore.fix_up);
- ``describe(record) -> str``: a record of it in a message.

The dump's tree-level capture, the restore's hand-off and each process's fd work loop over
this table instead of naming kinds.  What the pipelines still do of a kind themselves: at
dump, a process's own fds, owners, locks and aio rings (its ProcessImage's fields); at
restore, what is made at other points than the hand-off (saved files put back, the SysV
objects, the pidfds once every process exists) and the notification groups settled once
the tree is rebuilt.  tests/test_layout.py lists those calls with the reason
(DONE_OUTSIDE_THE_TABLE) and fails on any other.  ptckpt/kinds.py is
the table of what the kernel shows (an fd kind, a socket's family, a mapping kind) and who
answers for it, or the refusal: a row here says in ``answers`` which of those keys it
answers for, and tests/test_kinds.py checks that the two agree.  The kinds this ptckpt
refuses are kinds.py's (the dump's checks read them there); :func:`table` lists them
after the rows, each with its refusal.

Adding a kind: its module under resources/ (dump and restore halves side by side), one
row in :data:`ROWS` (where its work falls in the order below), and the row naming its
module in ptckpt/kinds.py; where it captures, its name in :data:`CAPTURE_ORDER` and
:data:`IMAGE_ORDER` too.

**Why the order matters.**  :data:`ROWS` is the restore's order.  Made in ptckpt: ghost
files before the fd states (an inotify watch is put on a deleted file's path) and before
the files opened by path; the fd states (memfds) before the shared memory objects that
map them; unix sockets last of the descriptions, since their queues carry any of the
others in flight.  Installed in each process: aio rings right after its memory; the
pidfds received before the fd table is put in place; the epolls' registrations once
every fd exists; after the task's cwd and root, ptckpt's fds of deleted directories
closed and then the locks, last of the fd work (closing any fd of a file drops the POSIX
locks on it); the fd owners after the credentials (F_SETOWN records the setter's, which
decide whom SIGIO may reach).  The dump's order is :data:`CAPTURE_ORDER`: the pidfds
first, then what is held outside refused, before anything is taken (reading a pending
connection's data accepts it, which only a kill makes good: the unix sockets come last);
the fd states and ghost files before the sockets (a refusal there comes before the
network lock is taken).  The records lie in the image in :data:`IMAGE_ORDER`, the order
images have always had them in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .. import kinds
from ..formats.model import (EpollState, Fd, FdKind, GhostFile, InFlightFd, InetSocket, MsgImage, NetlinkSocket,
                             PidfdState, PipeBuffer, ProcessImage, Pty, SavedFile, SemImage, ShmImage, Terminal,
                             UnixSocket, VmaKind, Zombie)
from ..plan import pty_slaves, root_stdio
from ..errors import RestoreFailed
from . import (aio, anonfds, epoll, files, inet, inotify, locks, memory, netlink, nsfs, pidfds, pids, pipes,
               sharing, sockets, sysvipc, terminals, threads)

# The points of a process's fix-up where rows install (restore.fix_up runs them in this order).
MEMORY = "memory"            # right after its address space is rebuilt
FD_TABLE = "fd table"        # every fd at its number
AFTER_FDS = "after the fds"  # what needs every fd in place
AFTER_TASK = "after the task"   # after its cwd, root and mm fields
AFTER_CREDS = "after the creds"
INSTALL_POINTS = (MEMORY, FD_TABLE, AFTER_FDS, AFTER_TASK, AFTER_CREDS)


@dataclass(frozen=True)
class Row:
    """One kind: its module, what it answers for in ptckpt.kinds, its operations."""

    name: str
    module: str                               # resources.<module> holds its halves
    parts: tuple[str, ...] = ()               # the modules of the kinds it dispatches to
    answers: tuple = ()                       # kinds.FD keys, socket families, kinds.MAPPINGS keys
    records: tuple[type, ...] = ()            # the image-wide records it writes
    capture: Callable[["Capture"], list] | None = None
    plan: Callable[[ProcessImage], list[str]] | None = None
    create: Callable[["Handoff"], None] | None = None
    install: Callable[["Install"], None] | None = None
    install_at: str = FD_TABLE
    own_table: bool = True                    # installs only where the process has its own fd table
    describe: Callable[[object], str] | None = None
    refusal: str = ""

    @property
    def operations(self) -> tuple[str, ...]:
        return tuple(op for op in ("capture", "plan", "create", "install", "describe")
                     if getattr(self, op) is not None)


# --- the dump: what capture operations read ----------------------------------------------

@dataclass
class Capture:
    """What the tree-level capture works on: the frozen tree's images (fd descriptions
    numbered), and the records each row captured so far, by row name."""

    root: int
    images: dict[int, ProcessImage]           # the held-outside row drops shell stdio owners
    net: inet.InetDump
    flight: sockets.InFlight                  # the fds in flight, but those of claimed sockets
    fds: dict[int, list[Fd]]                  # each member's fds but those a plugin claimed
    held: dict[int, list[Fd]]                 # those, and the fds in flight (flight.holder's)
    stdio: set[int]                           # the descriptions of the root's stdio
    zombies: Sequence[int] = ()
    save_files: Sequence[str] = ()
    ext_unix_sk: bool = False
    scan: sharing.Scan | None = None          # what the held-outside row found
    records: dict[str, list] = field(default_factory=dict)

    @classmethod
    def frozen(cls, root: int, images: dict[int, ProcessImage], net: inet.InetDump | None,
               flight: sockets.InFlight | None, **options) -> "Capture":
        """The capture of a frozen tree; fds claimed as external by a plugin are not its business."""
        fds = {p: [f for f in im.fds if not f.external] for p, im in images.items()}
        stdio = {f.desc for f in fds[root] if f.fd <= 2 and f.kind in files.STDIO_KINDS}
        flight = (flight or sockets.InFlight()).without(
            {f.ino for im in images.values() for f in im.fds if f.external and f.kind is FdKind.SOCKET})
        held = {**fds, flight.holder: flight.fds} if flight.fds else fds
        return cls(root, dict(images), net if net is not None else inet.InetDump(inet.Policy(), ""),
                   flight, fds, held, stdio, **options)


def capture_frozen(ctx: Capture) -> None:
    """Every row's capture, in :data:`CAPTURE_ORDER`, into ``ctx.records``."""
    for name in CAPTURE_ORDER:
        ctx.records[name] = list(BY_NAME[name].capture(ctx))


def image_records(ctx: Capture) -> list:
    """The captured records in the order the image holds them (:data:`IMAGE_ORDER`)."""
    return [r for name in IMAGE_ORDER for r in ctx.records.get(name, ())]


def _capture_held_outside(ctx: Capture) -> list:
    ctx.scan = sharing.scan_frozen(ctx.root, ctx.images, ctx.fds, ctx.held, ctx.stdio, ctx.flight)
    return []


def _capture_fd_states(ctx: Capture) -> list:
    """The state of each eventfd, timerfd, signalfd, inotify, memfd, mqueue, fanotify and
    epoll description, once per description."""
    out, seen = [], set()
    for p, flist in ctx.fds.items():
        for f in flist:
            if f.desc in seen:
                continue
            if f.kind in anonfds.ANON_FD_KINDS:
                out.append(dataclasses.replace(anonfds.dump_anon_fd(p, f.fd, f.kind), desc=f.desc))
            elif f.kind is FdKind.EPOLL:
                out.append(dataclasses.replace(epoll.dump_epoll(p, f.fd, flist), desc=f.desc))
            else:
                continue
            seen.add(f.desc)
    return out


def _capture_ghost_files(ctx: Capture) -> list:
    ghosts = files.dump_ghost_files(ctx.held, {p: list(im.vmas) for p, im in ctx.images.items()},
                                    {p: im.task for p, im in ctx.images.items()})
    inotify.check_deleted_watches(ctx.fds, ctx.records["fd states"], {("ghost", g.dev, g.ino) for g in ghosts})
    return ghosts


def _capture_unix_sockets(ctx: Capture) -> list:
    return ctx.flight.records() + sockets.dump_unix_sockets(
        ctx.held, ctx.stdio, leave_running=ctx.net.policy.leave_running, flight=ctx.flight,
        external=ctx.ext_unix_sk)


def _capture_pidfds(ctx: Capture) -> list:
    return pidfds.dump_pidfds({p: im.fds for p, im in ctx.images.items()},
                              {p: im.task.tids for p, im in ctx.images.items()}, ctx.zombies)


# --- the restore: what create and install operations work on -----------------------------

@dataclass
class Handoff:
    """What build_handoff makes for the stubs to inherit: ``opened`` ({description or object
    key: fd}), filled row by row; ``afterwards`` runs once every row made its objects, or
    one failed (the ghost files unlinked)."""

    image: object                              # formats.image.ImageReader
    procs: dict[int, ProcessImage]
    plan: dict[int, Fd]                        # ptckpt.plan.plan_handoff's
    new_pty: bool = False
    net: inet.InetRestore | None = None
    credentials: sockets.QueuedCredentials | None = None
    opened: dict = field(default_factory=dict)
    ghost_paths: dict = field(default_factory=dict)
    made: dict = field(default_factory=dict)   # memfd objects by (major, minor, ino), for their mappings
    afterwards: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def later(self) -> set[int]:
        """Descriptions made once the tree exists, not here: the pidfds."""
        return {s.desc for s in self.image.fd_states if isinstance(s, PidfdState)}

    def sockets_of(self, inos: set) -> dict[int, Fd]:
        return {d: f for d, f in self.plan.items() if f.kind is FdKind.SOCKET and f.ino in inos}


def create(ctx: Handoff) -> None:
    """Every row's create, in table order; ``ctx.afterwards`` then runs."""
    with ctx.afterwards:
        for row in ROWS:
            if row.create is not None:
                row.create(ctx)


def _create_pipes(ctx: Handoff) -> None:
    inos = {b.ino for b in ctx.image.pipes}
    descs = {d: f for d, f in ctx.plan.items() if f.kind in pipes.PIPE_KINDS and f.ino in inos}
    ctx.opened.update(pipes.create_pipes(ctx.image.pipes, descs))


def _create_ghost_files(ctx: Handoff) -> None:
    ctx.ghost_paths = files.create_ghost_files(list(ctx.image.ghost_files))
    ctx.afterwards.callback(files.remove_ghost_files, ctx.ghost_paths)   # deleted again: only the open files hold them
    files.open_ghost_files(ctx.image.ghost_files, ctx.procs, ctx.ghost_paths, ctx.opened)


def _create_inet_sockets(ctx: Handoff) -> None:
    inos = {r.ino for r in ctx.image.inet_sockets}
    if inos:
        net = ctx.net if ctx.net is not None else inet.InetRestore(ctx.image.inet_sockets)
        ctx.opened.update(net.create(ctx.sockets_of(inos)))


def _create_netlink_sockets(ctx: Handoff) -> None:
    inos = {r.ino for r in ctx.image.netlink_sockets}
    ctx.opened.update(netlink.create_netlink_sockets(ctx.image.netlink_sockets, ctx.sockets_of(inos)))


def _create_ptys(ctx: Handoff) -> None:
    """The tree's own pty pairs, master and slaves."""
    slaves = pty_slaves(ctx.image, ctx.procs)
    for rec in ctx.image.ptys:
        mine = [d for d, n in slaves.items() if n == rec.index and d in ctx.plan]
        if rec.sid > 0:                          # one more slave: the session leader's TIOCSCTTY
            mine.append(terminals.ctty_key(rec))  # (it may hold none: opened and closed it)
        master_flags = ctx.plan[rec.desc].flags if rec.desc in ctx.plan else os.O_RDWR | terminals.O_LARGEFILE
        master, slave_fds = terminals.create_pty(rec, [ctx.plan[d].flags if d in ctx.plan
                                                       else os.O_RDWR | terminals.O_LARGEFILE for d in mine],
                                                 master_flags)
        if master >= 0:
            ctx.opened[rec.desc] = master
        ctx.opened.update(zip(mine, slave_fds))


def _create_fd_states(ctx: Handoff) -> None:
    """The anonymous-inode files (epolls, memfds, eventfds ...) but those made later; each
    memfd's object goes in ``ctx.made`` too, for the mappings of it."""
    later = ctx.later
    for state in ctx.image.fd_states:
        f = ctx.plan.get(state.desc)
        if f is None or state.desc in later:
            continue
        key = (os.major(f.dev), os.minor(f.dev), f.ino) if f.kind is FdKind.MEMFD else None
        if key in ctx.made:                       # another description of one memfd
            ctx.opened[state.desc] = anonfds.reopen_memfd(ctx.made[key], state, f.flags)
            continue
        ctx.opened[state.desc] = (epoll.create_epoll() if isinstance(state, EpollState)
                                  else anonfds.create_anon_fd(state, f.flags, ctx.ghost_paths))
        if key is not None:                       # the same object for its mappings
            ctx.made[key] = ctx.opened[state.desc]


def _open_files(ctx: Handoff) -> None:
    """Every description of the plan not made yet, nor later (pidfds, unix sockets): a new
    pty for the terminal (--new-pty), ptckpt's own fd for the root's stdio, a bound
    namespace, or the file by path."""
    image, opened = ctx.image, ctx.opened
    stdio = root_stdio(ctx.procs[image.inventory.root_pid])
    skip = ctx.later | set(ctx.sockets_of({u.ino for u in image.unix_sockets}))
    compat = {f.desc for p in ctx.procs.values() if threads.compat_process(p.threads, p.task.pid) for f in p.fds}
    for d, f in ctx.plan.items():
        if d in opened or d in skip:
            continue
        tty = next((t for t in image.terminals if t.desc == d), None) if ctx.new_pty else None
        if tty is not None and "pty-master" not in opened:
            opened["pty-master"], opened[d], _path = terminals.open_new_pty(terminals.from_record(tty))
        elif d in stdio:
            try:
                opened[d] = os.dup(f.fd)
            except OSError:
                raise RestoreFailed(f"fd {f.fd} was {f.path} ({f.kind.name.lower()}) and ptckpt "
                                    f"restore has no fd {f.fd} of its own to give it") from None
        elif nsfs.bound_path(f):
            opened[d] = nsfs.open_bound(f)
        else:
            opened[d] = files.open_description(f, ctx.ghost_paths.get(files.ghost_key(f)), compat=d in compat)


def _create_unix_sockets(ctx: Handoff) -> None:
    inos = {u.ino for u in ctx.image.unix_sockets}
    cwd_of = {f.ino: proc.task.cwd for proc in ctx.procs.values() for f in proc.fds if f.ino in inos}
    ctx.opened.update(sockets.create_unix_sockets(
        ctx.image.unix_sockets, ctx.sockets_of(inos), cwd_of,
        {d: fd for d, fd in ctx.opened.items() if isinstance(d, int)}, ctx.credentials))


def _create_shared_memory(ctx: Handoff) -> None:
    ctx.opened.update(memory.create_shared_objects((v for proc in ctx.procs.values() for v in proc.vmas),
                                                   ctx.made))


@dataclass
class Install:
    """One process being fixed up: its injection scope and what it is given."""

    remote: object                              # tracee.RemoteSyscalls inside its stub
    vpid: int
    proc: ProcessImage
    handed: dict                                # build_handoff's, as the stubs inherited it
    inherited: list[int]                        # the fds its stub has
    own_table: bool                             # False: it shares its parent's (the parent installs)
    epolls: list[tuple[int, EpollState]] = field(default_factory=list)
    channel: int = -1                           # ptckpt's end of the plugin channel ...
    chan: int = -1                              # ... and the stubs' end
    dirs: dict = field(default_factory=dict)    # ptckpt's fds of deleted directories
    pidfds_made: dict | None = None
    received: dict = field(default_factory=dict)   # {desc: number} of the pidfds received


def install(ctx: Install, at: str) -> None:
    """The installs of every row at point `at` of the fix-up, in table order."""
    for row in ROWS:
        if row.install is not None and row.install_at == at and (ctx.own_table or not row.own_table):
            row.install(ctx)


def _install_pidfds(ctx: Install) -> None:
    # the pidfds ptckpt made once the tree existed come over the channel, above every fd
    if ctx.pidfds_made:
        ctx.received = pidfds.install_pidfds_frozen(
            ctx.remote, ctx.channel, ctx.chan, ctx.pidfds_made, ctx.proc.fds,
            1 + max([2, *ctx.inherited] + [f.fd for f in ctx.proc.fds]))


def _install_fds(ctx: Install) -> None:
    files.restore_fds_frozen(ctx.remote, list(ctx.proc.fds), ctx.inherited, {**ctx.handed, **ctx.received},
                             extra=[(fd, key[2]) for key, fd in ctx.handed.items()
                                    if isinstance(key, tuple) and key[:2] == ("install", ctx.vpid)],
                             keep={ctx.chan, *ctx.dirs.values()})
    pidfds.close_received_frozen(ctx.remote, ctx.received)      # in place now: the copies go


def _install_epoll_targets(ctx: Install) -> None:
    for epfd, state in ctx.epolls:
        epoll.restore_targets_frozen(ctx.remote, epfd, state, ctx.proc.fds)


def _close_ghost_dirs(ctx: Install) -> None:
    """ptckpt's fds of deleted directories (a cwd or root, fchdir()ed into by now)."""
    for fd in set(ctx.dirs.values()) & set(ctx.inherited):
        ctx.remote.checked("close", fd, step=f"close ptckpt's fd {fd} of a deleted directory")


def _install_locks(ctx: Install) -> None:
    for fd, held in locks.from_records(ctx.proc.locks).items():
        locks.restore_locks_frozen(ctx.remote, fd, held)


def _describe_fd_state(state) -> str:
    if isinstance(state, EpollState):
        return f"epoll ({len(state.targets)} registrations)"
    return anonfds.describe(state)


# --- the table -----------------------------------------------------------------------------

_ANON = tuple(row.kind for row in anonfds.KINDS)
_ANON_RECORDS = tuple(row.state for row in anonfds.KINDS)
_ANON_MODULES = tuple(row.dump.__module__.rpartition(".")[2] for row in anonfds.KINDS)

ROWS: tuple[Row, ...] = (
    Row("aio rings", "aio", install=lambda ctx: aio.restore_aio_rings_frozen(ctx.remote, ctx.proc.aio_rings),
        install_at=MEMORY, own_table=False),
    Row("pipes", "pipes", answers=(FdKind.PIPE, FdKind.FIFO), records=(PipeBuffer,),
        capture=lambda ctx: pipes.dump_pipes(ctx.held, ctx.scan.internal_pipes), create=_create_pipes),
    Row("ghost files", "files", records=(GhostFile,), capture=_capture_ghost_files, create=_create_ghost_files,
        install=_close_ghost_dirs, install_at=AFTER_TASK),
    Row("inet sockets", "inet", answers=("AF_INET", "AF_INET6"), records=(InetSocket,),
        capture=lambda ctx: ctx.net.capture_frozen(ctx.fds, ctx.stdio), create=_create_inet_sockets,
        describe=inet.describe),
    Row("netlink sockets", "netlink", answers=("AF_NETLINK",), records=(NetlinkSocket,),
        capture=lambda ctx: netlink.dump_netlink_sockets(ctx.fds), create=_create_netlink_sockets,
        describe=netlink.describe),
    Row("ptys", "terminals", answers=(FdKind.PTY_MASTER, FdKind.PTY_SLAVE), records=(Pty,),
        capture=lambda ctx: (terminals.dump_ptys_frozen(ctx.scan.masters, set(ctx.images))
                             + [terminals.hung_up_record(n) for n in ctx.scan.hung]),
        create=_create_ptys),
    Row("fd states", "anonfds", parts=(*_ANON_MODULES, "epoll"), answers=(*_ANON, FdKind.EPOLL),
        records=(*_ANON_RECORDS, EpollState),
        capture=_capture_fd_states, create=_create_fd_states, install=_install_epoll_targets,
        install_at=AFTER_FDS, describe=_describe_fd_state),
    Row("pidfds", "pidfds", answers=(FdKind.PIDFD,), records=(PidfdState,), capture=_capture_pidfds,
        install=_install_pidfds),
    Row("files", "files", answers=(FdKind.REGULAR, FdKind.DIRECTORY, FdKind.PATH, FdKind.CHARDEV),
        create=_open_files, install=_install_fds),
    Row("unix sockets", "sockets", answers=("AF_UNIX",), records=(InFlightFd, UnixSocket),
        capture=_capture_unix_sockets, create=_create_unix_sockets),
    Row("shared memory objects", "memory", answers=(VmaKind.ANON_SHARED, VmaKind.SHMEM),
        create=_create_shared_memory),
    Row("locks", "locks", install=_install_locks, install_at=AFTER_TASK),
    Row("fd owners", "files",
        install=lambda ctx: files.restore_owners_frozen(ctx.remote, list(ctx.proc.fds), list(ctx.proc.owners)),
        install_at=AFTER_CREDS),
    Row("terminals", "terminals", answers=(FdKind.TTY,), records=(Terminal,),
        capture=lambda ctx: terminals.dump_stdio_terminals(ctx.root, ctx.fds[ctx.root])),
    Row("namespace files", "nsfs", answers=(FdKind.NSFS,), plan=lambda proc: nsfs.host_problems(proc.fds)),
    Row("held outside", "sharing", capture=_capture_held_outside),
    Row("saved files", "files", records=(SavedFile,),
        capture=lambda ctx: (files.dump_saved_files(files.file_holders(ctx.images), ctx.save_files)
                             if ctx.save_files else [])),
    Row("sysv objects", "sysvipc", records=(ShmImage, SemImage, MsgImage),
        capture=lambda ctx: sysvipc.dump_used_frozen(ctx.images)),
    Row("zombies", "pids", records=(Zombie,), capture=lambda ctx: [pids.zombie_record(z) for z in ctx.zombies]),
)

BY_NAME: dict[str, Row] = {row.name: row for row in ROWS}

CAPTURE_ORDER: tuple[str, ...] = (
    "pidfds", "held outside", "fd states", "ghost files", "pipes", "inet sockets", "netlink sockets",
    "terminals", "ptys", "unix sockets", "saved files", "sysv objects", "zombies")

# "plugins": the plugins' own records (Plugins.image_records), which the dump puts there.
IMAGE_ORDER: tuple[str, ...] = (
    "pipes", "inet sockets", "netlink sockets", "fd states", "terminals", "ptys", "ghost files",
    "unix sockets", "pidfds", "plugins", "saved files", "sysv objects", "zombies")


def plan_problems(proc: ProcessImage) -> list[str]:
    """What this host lacks for the kinds `proc` holds (every row's plan)."""
    return [problem for row in ROWS if row.plan is not None for problem in row.plan(proc)]


def describe(record) -> str:
    """A record of the image in a message, by the row that writes it."""
    for row in ROWS:
        if isinstance(record, row.records) and row.describe is not None:
            return row.describe(record)
    return type(record).__name__


def table() -> Iterator[Row]:
    """The rows, then each kind ptckpt.kinds refuses as a row of its refusal."""
    yield from ROWS
    for row in (*kinds.FD.values(), *kinds.SOCKETS.values(), *kinds.MAPPINGS.values()):
        if not row.restored:
            yield Row(f"{row.family} {row.name}", "", refusal=row.refusal)
