"""Backend of ``ptckpt diff A B``: two images compared record by record, memory page by page.

Records are paired by what they are, not by where they sit in a file: a process by
pid, a thread by tid, a VMA by its address range, an fd by its number, a POSIX timer
by id, a signal by number.  Objects the restore makes again (pipes, sockets, the state
of eventfds and the like) are paired by the first (pid, fd) holding them, since their
inode numbers are new after a restore; a number that refers to one (a socket's peer,
an fd's description) is compared as that holder.

Memory is compared over the address ranges both images map, in blocks read from the
two pages files (never all at once), page by page where a block differs; a page a
child shares copy-on-write with its parent is read from the parent's pages, and a
page of anonymous memory that one image saved and the other left out is compared
with zeros (a dump leaves zero pages out).

Some fields are expected to differ between two checkpoints of the same state: the
clocks at the freeze, the time left on timers, the numbers of re-created objects ...
They are listed once, in :data:`EXPECTED`, each with its reason; the result keeps
them apart from the differences that matter.

Example::

    result = diff_images("/tmp/ckpt-a", "/tmp/ckpt-b")
    print(result.table())
    result.agree            # True: nothing differs but the EXPECTED fields
"""

from __future__ import annotations

import dataclasses
import os
import resource
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ptckpt.formats.image import ImageReader
from ptckpt.formats.model import (FD_STATE_TYPES, GP_REG_NAMES, PAGE_SIZE, EpollState, Fd, FdKind, GhostFile,
                                  InetMode, InetSocket, Inventory, Itimer, MsgImage, NetlinkSocket, PipeBuffer,
                                  PosixTimer, ProcessImage, SemImage, ShmImage, Task, Terminal, Thread,
                                  TimerfdState, UnixSocket, Vma, VmaKind)

from .resources.memory import ZERO_DROPPABLE
from .resources.tcp import CRAFTED_INTO
from .resources.threads import reexecuted_regs
from .show import _printable, _table, record_to_json

SCHEMA_VERSION = 1
BLOCK = 1 << 20                     # bytes of each side read at a time when comparing memory


# =============================================================================
# the fields expected to differ
# =============================================================================

@dataclass(frozen=True)
class Site:
    """Where a record is: its process (0: image-wide) and whether that is the root."""

    pid: int = 0
    root: bool = False
    rseq_pages: frozenset[int] = frozenset()   # pages holding its threads' rseq areas (both images)


@dataclass(frozen=True)
class Expected:
    """Fields of one record type that may differ between two checkpoints of the same
    state; `when(a, b, site)` narrows it to some records."""

    record: type
    fields: frozenset[str]
    reason: str
    when: Callable[[Any, Any, Site], bool] | None = None


# Kinds of fd whose object a restore makes anew: a new inode (and so a new name, like
# "pipe:[4242]"), on its own pseudo file system.
RECREATED_FDS = frozenset({FdKind.PIPE, FdKind.SOCKET, FdKind.EVENTFD, FdKind.EPOLL, FdKind.TIMERFD,
                           FdKind.SIGNALFD, FdKind.INOTIFY, FdKind.FANOTIFY, FdKind.MEMFD, FdKind.PIDFD,
                           FdKind.ANON_INODE, FdKind.MQUEUE, FdKind.PTY_MASTER, FdKind.PTY_SLAVE})
_STDIO_FDS = frozenset({FdKind.TTY, FdKind.PTY_SLAVE, FdKind.PTY_MASTER, FdKind.PIPE, FdKind.SOCKET})
_SCHEDULED = frozenset("RSD")
_RESUMED = "frozen in a syscall, restored about to make it again: compared as it resumes"
_RECREATED = "a restore makes the object again: a new inode, name and times"
_NUMBERED = "the number the kernel gave a re-created object (compared as the (pid, fd) holding it)"


def _fs(*names: str) -> frozenset[str]:
    return frozenset(names)


# Two more are not a field's: a thread frozen in a syscall is compared as it resumes
# (_RESUMED, _Comparer.thread_regs), and memory without the kernel's fields of each rseq
# area (_RSEQ_REASON, _rseq_masks).
_TCP_MAXSEG = (6, 2)                # (IPPROTO_TCP, TCP_MAXSEG)


def _cow_pages(v) -> frozenset[int]:
    return frozenset(a for cs, ce in v.cow for a in range(cs, ce, PAGE_SIZE))


def _rseq_pages(*procs) -> frozenset[int]:
    """The pages the rseq areas of the processes' threads are on (at most one or two per thread)."""
    return frozenset(a & ~(PAGE_SIZE - 1) for proc in procs for t in proc.threads if t.rseq_addr and t.rseq_len
                     for a in (t.rseq_addr, t.rseq_addr + t.rseq_len - 1))


def _without_maxseg(options) -> list:
    return [o for o in options if tuple(o[:2]) != _TCP_MAXSEG]


EXPECTED: tuple[Expected, ...] = (
    Expected(Inventory, _fs("realtime_ns", "monotonic_ns", "boottime_ns"), "clocks at the freeze"),
    Expected(Inventory, _fs("real_pids"), "real pids of a tree in a pid namespace of its own: "
                                          "each restore's namespace is another"),
    Expected(Inventory, _fs("netlock"), "each dump takes a network lock of its own"),
    Expected(Inventory, _fs("image_id", "parent", "parent_id", "memory_only"),
             "every image has an id of its own; an incremental one names its parent (memory is compared "
             "through the chain)"),
    Expected(Inventory, _fs("pids"), "the order the tree was walked in (processes are compared by pid)"),
    Expected(Task, _fs("state"), "running or sleeping at the moment of the freeze",
             lambda a, b, s: a.state in _SCHEDULED and b.state in _SCHEDULED),
    Expected(Task, _fs("ppid"), "the root's parent is outside the image (whoever restored it)",
             lambda a, b, s: s.root),
    Expected(PosixTimer, _fs("left_ns"), "time left on an armed timer"),
    Expected(PosixTimer, _fs("overrun"), "an overrun count cannot be set: it starts again from 0"),
    Expected(Itimer, _fs("left_us"), "time left on an armed timer"),
    Expected(TimerfdState, _fs("value_ns", "expires_ns"), "time left on an armed timer"),
    Expected(TimerfdState, _fs("ticks"), "expirations of a running timer not read yet: they go on counting"),
    Expected(Fd, _fs("details.ticks", "details.it_value"), "a running timerfd: expirations, time left",
             lambda a, b, s: a.kind is FdKind.TIMERFD),
    Expected(Fd, _fs("ino", "dev", "path", "mnt_id", "mtime_ns"), _RECREATED,
             lambda a, b, s: a.kind is b.kind and a.kind in RECREATED_FDS),
    Expected(Fd, _fs("ino", "dev", "path", "mnt_id", "mtime_ns", "size", "kind", "mode", "rdev", "flags",
                     "pos", "desc"),
             "the root's stdio: a restore gives the tree its own",
             lambda a, b, s: s.root and a.fd <= 2 and (a.kind in _STDIO_FDS or b.kind in _STDIO_FDS)),
    Expected(Vma, _fs("inode", "dev_major", "dev_minor", "file_mtime_ns"), _RECREATED,
             lambda a, b, s: a.kind is b.kind and a.kind in (VmaKind.ANON_SHARED, VmaKind.SHMEM)
             and not a.path.startswith(("/dev/shm/", "/SYSV"))),
    Expected(Vma, _fs("vmflags"), "\"gu\" says a mapping may hold guard pages (its guard pages are "
             "compared): the kernel's hint, carried over to any mapping merged with one that held them",
             lambda a, b, s: set(a.vmflags.split()) ^ set(b.vmflags.split()) == {"gu"}),
    Expected(Vma, _fs("cow"), "a page holding a thread's rseq area: the kernel writes the thread's CPU there "
             "each time it comes back to user space after a context switch (a wait, a preemption, a ptrace "
             "stop), which ends that page's copy-on-write sharing with the parent.  A dump sees it shared "
             "only in the rare window before either process wrote it (2 of 400 sharedfd runs), and the "
             "original loses it as soon as it runs again (3 of 3: SIGCONT, SIGSTOP); a restored thread has "
             "written it already: the restore registers rseq, then runs further injected syscalls in it",
             lambda a, b, s: _cow_pages(a) ^ _cow_pages(b) <= s.rseq_pages),
    Expected(ShmImage, _fs("atime", "dtime", "ctime", "cpid", "lpid", "nattch"),
             "times and last pids of a System V segment (for information)"),
    Expected(SemImage, _fs("otime", "ctime", "pids"), "times and last pids of a semaphore set"),
    Expected(MsgImage, _fs("stime", "rtime", "ctime", "lspid", "lrpid"), "times and last pids of a queue"),
    Expected(InetSocket, _fs("timestamp"), "the TCP timestamp clock runs"),
    Expected(InetSocket, _fs("ino"), _NUMBERED, lambda a, b, s: a.mode != InetMode.PENDING),
    Expected(InetSocket, _fs("options"), "TCP_MAXSEG reads the connection's current MSS, which the kernel works "
             "out again on each send from the path and the window (a repaired connection reads 536 less its "
             "options until it first sends)",
             lambda a, b, s: _without_maxseg(a.options) == _without_maxseg(b.options)),
    Expected(InetSocket, _fs("window"), "snd_wl1 of a half-closed connection is the sequence number of the "
             "segment that last updated its send window: at restore, the crafted FIN or ACK that takes the "
             "rebuilt connection into its state (FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING)",
             lambda a, b, s: a.state == b.state and a.state in CRAFTED_INTO and a.window[1:] == b.window[1:]),
    Expected(Fd, _fs("ino", "mtime_ns"), "a deleted file (ghost) is made again: a new inode",
             lambda a, b, s: a.path.endswith(" (deleted)") and a.path == b.path),
    Expected(Vma, _fs("inode", "file_mtime_ns"), "a deleted file (ghost) is made again: a new inode",
             lambda a, b, s: a.file_deleted and b.file_deleted),
    Expected(GhostFile, _fs("ino", "dev", "handle"), "a deleted file (ghost) is made again: a new inode"),
    Expected(GhostFile, _fs("atime_ns"), "the access time of a deleted file moves as it is read"),
    Expected(UnixSocket, _fs("ino"), "a connection not accepted yet has a number of ptckpt's",
             lambda a, b, s: a.pending),
    # field "": the record is in one image only (the other side None)
    Expected(Vma, _fs(""), "the kernel's vsyscall page shows in a 32-bit process restored by ptckpt (as by "
             "CRIU): its address space was begun by a 64-bit program, and nothing clears that flag; 32-bit "
             "code cannot call it", lambda a, b, s: (a or b).kind is VmaKind.VSYSCALL and (a is None or b is None)),
)


def expected_reason(record: Any, name: str, a: Any, b: Any, site: Site) -> str:
    """Why field `name` of records a and b (of one type) may differ, or "" if it must not."""
    for rule in EXPECTED:
        if isinstance(record, rule.record) and name in rule.fields and (rule.when is None or rule.when(a, b, site)):
            return rule.reason
    return ""


# =============================================================================
# the result
# =============================================================================

@dataclass(frozen=True)
class Difference:
    """One field of one record that differs (field "" : the record is in one image only)."""

    what: str                 # "process 123 fd 4", "image", "unix socket 123:5"
    field: str                # "pos", "regs.rip"; "" for a whole record
    a: Any                    # JSON-able values (None: absent)
    b: Any
    expected: str = ""        # why this may differ (EXPECTED), "" when it must not

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "field": self.field, "a": self.a, "b": self.b,
                "expected": self.expected or None}


@dataclass(frozen=True)
class PageDifference:
    """The pages of one mapping (as image A has it) whose contents differ."""

    pid: int
    start: int                # the mapping, as in image A
    end: int
    path: str
    pages: int                # pages that differ
    compared: int             # pages of the mapping both images map
    ranges: tuple[tuple[int, int], ...]   # (start, end) address ranges of the differing pages

    @property
    def what(self) -> str:
        return f"process {self.pid} memory {self.start:#x}-{self.end:#x}" + (f" {self.path}" if self.path else "")

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "pid": self.pid, "start": self.start, "end": self.end, "path": self.path,
                "pages": self.pages, "compared": self.compared, "ranges": [list(r) for r in self.ranges]}


@dataclass
class DiffResult:
    a: str
    b: str
    differences: list[Difference] = field(default_factory=list)
    memory: list[PageDifference] = field(default_factory=list)
    pages_compared: int = 0   # pages compared (both images map them, saved in either)

    @property
    def unexpected(self) -> list[Difference]:
        return [d for d in self.differences if not d.expected]

    @property
    def expected(self) -> list[Difference]:
        return [d for d in self.differences if d.expected]

    @property
    def agree(self) -> bool:
        """Nothing differs but the EXPECTED fields."""
        return not self.unexpected and not self.memory

    def to_json(self, *, expected: bool = True) -> dict[str, Any]:
        """The stable JSON form (README: "ptckpt diff")."""
        shown = self.differences if expected else self.unexpected
        return {
            "schema": SCHEMA_VERSION,
            "a": self.a,
            "b": self.b,
            "agree": self.agree,
            "differences": [d.to_json() for d in shown],
            "memory": [m.to_json() for m in self.memory],
            "pages_compared": self.pages_compared,
            "counts": {"differences": len(self.unexpected), "expected": len(self.expected),
                       "pages": sum(m.pages for m in self.memory)},
        }

    def table(self, *, expected: bool = True) -> str:
        """Readable tables: the differences, the memory that differs, then (unless
        `expected` is False) the expected differences with their reasons."""
        pages = sum(m.pages for m in self.memory)
        head = (f"{_printable(self.a)} and {_printable(self.b)}: "
                + ("agree" if self.agree else "differ")
                + f" ({len(self.unexpected)} field(s) differ, {pages} of {self.pages_compared} page(s); "
                + f"{len(self.expected)} expected difference(s){'' if expected else ' hidden'})")
        parts = [head]
        if self.unexpected:
            parts.append(_table(["WHAT", "FIELD", "A", "B"],
                                [[_printable(d.what), d.field or "-", _cell(d.a), _cell(d.b)]
                                 for d in self.unexpected]))
        if self.memory:
            parts.append("memory:\n" + _table(
                ["WHAT", "PAGES", "OF", "RANGES"],
                [[_printable(m.what), m.pages, m.compared, _ranges_text(m.ranges)] for m in self.memory],
                right=(1, 2)))
        if expected and self.expected:
            parts.append("expected (see README, ptckpt diff):\n" + _table(
                ["WHAT", "FIELD", "A", "B", "WHY"],
                [[_printable(d.what), d.field, _cell(d.a), _cell(d.b), d.expected] for d in self.expected]))
        return "\n\n".join(parts) + "\n"


_CELL = 48


def _cell(value: Any) -> str:
    if value is None:
        return "(absent)"
    if isinstance(value, dict) and set(value) == {"size", "crc32"}:
        return f"{value['size']} bytes crc {value['crc32']:#010x}"
    text = _printable(str(value)) if isinstance(value, str) else _printable(repr(value))
    return text if len(text) <= _CELL else text[:_CELL - 3] + "..."


def _ranges_text(ranges: Sequence[tuple[int, int]], limit: int = 4) -> str:
    text = ", ".join(f"{s:#x}-{e:#x}" for s, e in ranges[:limit])
    return text + (f", ... ({len(ranges)} ranges)" if len(ranges) > limit else "")


# =============================================================================
# pairing and comparing records
# =============================================================================

class _Names:
    """One image's numbers of re-created objects, each as the first (pid, fd) holding it."""

    def __init__(self, reader: ImageReader):
        self.by_ino: dict[int, str] = {}
        self.by_desc: dict[int, str] = {}
        for pid in sorted(reader.pids):
            for f in sorted(reader.process(pid).fds, key=lambda f: f.fd):
                label = f"{pid}:{f.fd}"
                if f.kind in (FdKind.SOCKET, FdKind.PIPE, FdKind.FIFO):
                    self.by_ino.setdefault(f.ino, label)
                if f.desc:
                    self.by_desc.setdefault(f.desc, label)
        self._in_flight(reader)

    def _in_flight(self, reader: ImageReader) -> None:
        """Descriptions in flight in unix sockets, named by the socket, message and place
        carrying them (a socket in flight may carry more: named in later rounds)."""
        for _round in range(8):
            before = len(self.by_desc)
            for u in reader.unix_sockets:
                carrier = self.by_ino.get(u.ino)
                for i, descs in enumerate(u.queue_fds if carrier else ()):
                    for j, d in enumerate(descs):
                        self.by_desc.setdefault(d, f"{carrier} message {i} fd {j}")
            for f in reader.in_flight:
                if f.desc in self.by_desc and f.kind in (FdKind.SOCKET, FdKind.PIPE, FdKind.FIFO):
                    self.by_ino.setdefault(f.ino, self.by_desc[f.desc])
            if len(self.by_desc) == before:
                break

    def ino(self, value: int) -> str | int:
        return self.by_ino.get(value, value) if value else 0

    def desc(self, value: int) -> str | int:
        return self.by_desc.get(value, value) if value else 0

    def descs(self, value: tuple[tuple[int, ...], ...]) -> tuple:
        return tuple(tuple(self.desc(d) for d in item) for item in value)


# Fields holding the number of a re-created object: compared as its holder.
_REFERENCES: dict[tuple[type, str], str] = {
    (UnixSocket, "ino"): "ino", (UnixSocket, "peer"): "ino", (UnixSocket, "listener"): "ino",
    (UnixSocket, "queue_fds"): "descs",
    (InetSocket, "listener"): "ino", (InetSocket, "peer"): "ino",
    (NetlinkSocket, "ino"): "ino", (PipeBuffer, "ino"): "ino",
    (Fd, "desc"): "desc", (Terminal, "desc"): "desc",
    **{(cls, "desc"): "desc" for cls in FD_STATE_TYPES},
}


class _Comparer:
    def __init__(self, a: ImageReader, b: ImageReader, out: DiffResult):
        self.a, self.b = a, b
        self.names = (_Names(a), _Names(b))
        self.out = out

    def add(self, what: str, name: str, va: Any, vb: Any, expected: str = "") -> None:
        self.out.differences.append(Difference(what, name, va, vb, expected))

    def record(self, what: str, ra: Any, rb: Any, site: Site = Site()) -> None:
        """Compare two records of one type field by field (a missing one: a whole-record difference)."""
        if ra is None or rb is None:
            self.add(what, "", None if ra is None else record_to_json(ra),
                     None if rb is None else record_to_json(rb), expected_reason(ra or rb, "", ra, rb, site))
            return
        ja, jb = record_to_json(ra), record_to_json(rb)
        for f in dataclasses.fields(ra):
            va, vb = getattr(ra, f.name), getattr(rb, f.name)
            ref = _REFERENCES.get((type(ra), f.name))
            if ref is not None:
                ta, tb = getattr(self.names[0], ref)(va), getattr(self.names[1], ref)(vb)
                if ta != tb:
                    self.add(what, f.name, ta, tb, expected_reason(ra, f.name, ra, rb, site))
                elif va != vb:
                    self.add(what, f.name, va, vb, _NUMBERED)
                continue
            if va == vb:
                continue
            reason = expected_reason(ra, f.name, ra, rb, site)
            if isinstance(ra, Thread) and f.name in ("regs", "restart", "syscall_nr"):
                self.thread_regs(what, f.name, ra, rb, ja, jb)
            elif (type(ra), f.name) in _UNORDERED:
                if sorted(va) != sorted(vb):
                    self.add(what, f.name, ja[f.name], jb[f.name], reason)
            elif isinstance(ra, Fd) and f.name == "details":
                da, db = _details(va), _details(vb)
                for k in sorted(da.keys() | db.keys()):
                    if da.get(k) != db.get(k):
                        name = f"details.{k}"
                        self.add(what, name, _one(da.get(k)), _one(db.get(k)),
                                 expected_reason(ra, name, ra, rb, site))
            else:
                self.add(what, f.name, ja[f.name], jb[f.name], reason)

    def thread_regs(self, what: str, name: str, ra: Thread, rb: Thread, ja: dict, jb: dict) -> None:
        """A thread frozen inside a syscall it must execute again resumes with rax = the
        syscall and rip on the syscall instruction (threads.reexecuted_regs): two threads
        are compared as they go on when no handler runs first."""
        na = dict(zip(GP_REG_NAMES, reexecuted_regs(ra).values()))
        nb = dict(zip(GP_REG_NAMES, reexecuted_regs(rb).values()))
        if name != "regs":
            self.add(what, name, ja[name], jb[name], _RESUMED if na == nb else "")
            return
        for reg, x in ja["regs"].items():
            y = jb["regs"].get(reg)
            if x != y:
                self.add(what, f"regs.{reg}", _hex(x), _hex(y), _RESUMED if na[reg] == nb[reg] else "")

    def records(self, what: Callable[[Any], str], ra: Iterable, rb: Iterable, key: Callable[[Any], Any],
                site: Callable[[Any], Site] = lambda r: Site()) -> None:
        """Pair two lists of records by key(record) and compare each pair."""
        left = _keyed(ra, key)
        right = _keyed(rb, key)
        for k in sorted(left.keys() | right.keys(), key=_sort_key):
            x, y = left.get(k), right.get(k)
            self.record(what(x if x is not None else y), x, y, site(x if x is not None else y))


# Fields whose order means nothing: an epoll's registrations (fdinfo lists them in the
# order of its red-black tree, by the kernel's file addresses).
_UNORDERED = {(EpollState, "targets")}


def _details(pairs: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    """fdinfo extras by key, a key's values sorted (an epoll has one "tfd" line per target)."""
    out: dict[str, list[str]] = {}
    for k, v in pairs:
        out.setdefault(k, []).append(v)
    return {k: sorted(v) for k, v in out.items()}


def _one(values: list[str] | None) -> Any:
    return values[0] if values and len(values) == 1 else values


def _hex(value: Any) -> Any:
    return f"{value:#x}" if isinstance(value, int) else value


def _sort_key(key: Any) -> tuple:
    return tuple((0, k) if isinstance(k, int) else (1, str(k)) for k in (key if isinstance(key, tuple) else (key,)))


def _keyed(records: Iterable, key: Callable[[Any], Any]) -> dict[Any, Any]:
    """{key: record}; a key met twice gets a running number (records alike: pending signals)."""
    out: dict[Any, Any] = {}
    for r in records:
        k = key(r)
        n = 0
        while (k, n) in out:
            n += 1
        out[(k, n)] = r
    return {(k if n == 0 else (k, n)): r for (k, n), r in out.items()}


_RLIMITS = {getattr(resource, n): n.removeprefix("RLIMIT_") for n in dir(resource) if n.startswith("RLIMIT_")}
_ITIMERS = {0: "REAL", 1: "VIRTUAL", 2: "PROF"}


def _vma_text(v: Vma) -> str:
    return f"{v.start:#x}-{v.end:#x}" + (f" {v.path}" if v.path else "")


def _as_merged(vmas: Iterable[Vma]) -> list[Vma]:
    """Neighbouring mappings alike in all but their bounds as one: the kernel keeps two such
    apart while their anonymous pages have different origins (a fork, an earlier fault) and
    joins them when they are mapped again, which the program cannot tell."""
    out: list[Vma] = []
    for v in sorted(vmas, key=lambda v: v.start):
        last = out[-1] if out else None
        if (last is not None and last.end == v.start
                and (not last.path or v.pgoff == last.pgoff + (last.end - last.start))
                and dataclasses.replace(last, start=0, end=0, pgoff=0, guards=(), cow=())
                == dataclasses.replace(v, start=0, end=0, pgoff=0, guards=(), cow=())):
            out[-1] = dataclasses.replace(last, end=v.end, guards=last.guards + v.guards, cow=last.cow + v.cow)
        else:
            out.append(v)
    return out


def _compare_process(c: _Comparer, pid: int, pa: ProcessImage, pb: ProcessImage, root: bool) -> None:
    site = Site(pid, root, _rseq_pages(pa, pb))
    here = f"process {pid}"
    c.record(f"{here} task", pa.task, pb.task, site)
    c.record(f"{here} creds", pa.creds, pb.creds, site)
    c.record(f"{here} mm", pa.mm, pb.mm, site)
    c.records(lambda r: f"{here} rlimit {_RLIMITS.get(r.resource, r.resource)}", pa.rlimits, pb.rlimits,
              lambda r: r.resource, lambda r: site)
    c.records(lambda r: f"{here} vma {_vma_text(r)}", _as_merged(pa.vmas), _as_merged(pb.vmas),
              lambda r: (r.start, r.end),
              lambda r: site)
    c.records(lambda r: f"{here} thread {r.tid}", pa.threads, pb.threads, lambda r: r.tid, lambda r: site)
    c.records(lambda r: f"{here} signal {r.signo}", pa.sigactions, pb.sigactions, lambda r: r.signo,
              lambda r: site)
    c.records(lambda r: f"{here} pending signal (thread {r.tid or 'all'})", pa.pending, pb.pending,
              lambda r: (r.tid, r.siginfo[:4]), lambda r: site)
    c.records(lambda r: f"{here} fd {r.fd}", pa.fds, pb.fds, lambda r: r.fd, lambda r: site)
    c.records(lambda r: f"{here} {r.kind} lock fd {r.fd} {r.start}-{r.end}", pa.locks, pb.locks,
              lambda r: (r.fd, r.kind, r.start, r.end), lambda r: site)
    c.records(lambda r: f"{here} posix timer {r.id}", pa.timers, pb.timers, lambda r: r.id, lambda r: site)
    c.records(lambda r: f"{here} itimer {_ITIMERS.get(r.which, r.which)}", pa.itimers, pb.itimers,
              lambda r: r.which, lambda r: site)
    c.records(lambda r: f"{here} fd {r.fd} owner", pa.owners, pb.owners,
              lambda r: r.fd, lambda r: site)
    ua = sorted((e.kind, len(e.payload)) for e in c.a.unknown_entries(pid))
    ub = sorted((e.kind, len(e.payload)) for e in c.b.unknown_entries(pid))
    if ua != ub:
        c.add(f"{here} entries of unknown kinds", "(kind, size)", ua, ub)


def _held(names: _Names, what: str, ino: int) -> str:
    held = names.ino(ino)
    return f"{what} {held}" if isinstance(held, str) else f"{what} (ino {ino}, held by no fd)"


def _compare_shared(c: _Comparer) -> None:
    """The image-wide records of inventory.img."""
    a, b = c.a, c.b

    def by_holder(names: _Names, what: str) -> Callable[[Any], Any]:
        return lambda r: _held(names, what, r.ino) if r.mode != InetMode.PENDING else (  # by listener, peer
            _held(names, "pending connection on", r.listener) + f" from {r.dst}:{r.dport}")

    c.records(lambda r: f"zombie {r.pid}", a.zombies, b.zombies, lambda r: r.pid)
    _pair_by_side(c, a.pipes, b.pipes, lambda names, r: _held(names, "fifo" if r.path else "pipe", r.ino))
    _pair_by_side(c, a.unix_sockets, b.unix_sockets,
                  lambda names, r: _held(names, "pending connection on", r.listener) if r.pending
                  else _held(names, "unix socket", r.ino))
    _pair_by_side(c, a.in_flight, b.in_flight, lambda names, r: f"fd in flight in {names.desc(r.desc)}")
    _pair_by_side(c, a.inet_sockets, b.inet_sockets, lambda names, r: by_holder(names, "inet socket")(r))
    _pair_by_side(c, a.netlink_sockets, b.netlink_sockets,
                  lambda names, r: _held(names, "netlink socket", r.ino))
    _pair_by_side(c, a.fd_states, b.fd_states,
                  lambda names, r: f"{type(r).__name__.removesuffix('State').lower()} {names.desc(r.desc)}")
    _pair_by_side(c, a.terminals, b.terminals, lambda names, r: f"terminal {names.desc(r.desc)}")
    c.records(lambda r: f"sysv {type(r).__name__.removesuffix('Image').lower()} {_sysv_id(r)}", a.sysv, b.sysv,
              lambda r: (type(r).__name__, _sysv_id(r)))
    c.records(lambda r: f"ghost file {r.path}", a.ghost_files, b.ghost_files, lambda r: r.path)
    c.records(lambda r: f"saved file {r.path}", a.saved_files, b.saved_files, lambda r: r.path)
    c.records(lambda r: f"plugin {r.name} data {r.pid}/{r.key}", a.plugin_data, b.plugin_data,
              lambda r: (r.name, r.pid, r.key))


def _sysv_id(r: ShmImage | SemImage | MsgImage) -> int:
    return r.shmid if isinstance(r, ShmImage) else r.semid if isinstance(r, SemImage) else r.msqid


def _pair_by_side(c: _Comparer, ra: Iterable, rb: Iterable, label: Callable[[_Names, Any], str]) -> None:
    """Pair records whose key is a label each image computes with its own names."""
    left = _keyed(ra, lambda r: label(c.names[0], r))
    right = _keyed(rb, lambda r: label(c.names[1], r))
    for k in sorted(left.keys() | right.keys(), key=_sort_key):
        c.record(k if isinstance(k, str) else f"{k[0]} #{k[1]}", left.get(k), right.get(k))


# =============================================================================
# memory
# =============================================================================

# A piece of saved memory: [start, end) at file offset `offset` of descriptor `fd`.
_Piece = tuple[int, int, int, int]


class _Pages:
    """Where an image holds the bytes of a process's pages, copy-on-write pages resolved
    to the parent that holds them."""

    def __init__(self, reader: ImageReader):
        self.reader = reader
        self.runs: dict[int, list] = {}
        self.starts: dict[int, list[int]] = {}

    def _runs(self, pid: int):
        if pid not in self.runs:
            runs = sorted(self.reader.page_runs(pid), key=lambda r: r.vaddr)
            self.runs[pid] = runs
            self.starts[pid] = [r.vaddr for r in runs]
        return self.runs[pid], self.starts[pid]

    def pieces(self, pid: int, lo: int, hi: int, depth: int = 0) -> list[_Piece]:
        """The saved pieces of [lo, hi) of process pid, sorted by address."""
        runs, starts = self._runs(pid)
        out: list[_Piece] = []
        i = max(bisect_left(starts, lo) - 1, 0)
        while i < len(runs) and runs[i].vaddr < hi:
            r = runs[i]
            s, e = max(r.vaddr, lo), min(r.vaddr + r.npages * PAGE_SIZE, hi)
            if s < e:
                fd, offset = self.reader.pages_location(pid, r)
                out.append((s, e, fd, offset + s - r.vaddr))
            i += 1
        proc = self.reader.process(pid)
        parent = proc.task.ppid
        if depth < 64 and parent in self.reader.pids:
            for v in proc.vmas:
                for cs, ce in v.cow:
                    s, e = max(cs, lo), min(ce, hi)
                    if s < e:
                        out.extend(self.pieces(parent, s, e, depth + 1))
        out.sort()
        return out


def _segments(pa: list[_Piece], pb: list[_Piece], lo: int, hi: int) -> Iterator[tuple[int, int, Any, Any]]:
    """[lo, hi) cut where either side's pieces start or end: (start, end, piece of A or None,
    piece of B or None)."""
    edges = sorted({lo, hi} | {x for p in pa + pb for x in p[:2] if lo < x < hi})
    ia = ib = 0
    for s, e in zip(edges, edges[1:]):
        while ia < len(pa) and pa[ia][1] <= s:
            ia += 1
        while ib < len(pb) and pb[ib][1] <= s:
            ib += 1
        x = pa[ia] if ia < len(pa) and pa[ia][0] <= s else None
        y = pb[ib] if ib < len(pb) and pb[ib][0] <= s else None
        if x is not None or y is not None:
            yield s, e, x, y


def _read(piece: _Piece, s: int, n: int) -> bytes:
    data = os.pread(piece[2], n, piece[3] + s - piece[0])
    if len(data) != n:
        raise OSError(f"short read of page data at {piece[3] + s - piece[0]}")
    return data


_ZERO = bytes(BLOCK)


def _differing_pages(pa: list[_Piece], pb: list[_Piece], lo: int, hi: int, zero_ok: bool,
                     masks: Sequence[tuple[int, int]] = ()) -> tuple[list[int], list[int]]:
    """Addresses of the pages of [lo, hi) whose contents differ, and of those that differ only
    in the `masks` ranges (the kernel's fields of rseq areas).  A page saved on one side only
    is compared with zeros when `zero_ok` (anonymous memory), else it differs."""
    out: list[int] = []
    masked: list[int] = []
    for s, e, x, y in _segments(pa, pb, lo, hi):
        if (x is None or y is None) and not zero_ok:
            out.extend(range(s, e, PAGE_SIZE))
            continue
        at = s
        while at < e:
            n = min(BLOCK, e - at)
            da = _read(x, at, n) if x is not None else _ZERO[:n]
            db = _read(y, at, n) if y is not None else _ZERO[:n]
            if da != db:
                for off in range(0, n, PAGE_SIZE):
                    pa_, pb_ = da[off:off + PAGE_SIZE], db[off:off + PAGE_SIZE]
                    if pa_ != pb_:
                        same = _masked(pa_, at + off, masks) == _masked(pb_, at + off, masks)
                        (masked if same else out).append(at + off)
            at += n
    return out, masked


def _masked(page: bytes, addr: int, masks: Sequence[tuple[int, int]]) -> bytes:
    data = bytearray(page)
    for s, e in masks:
        if s < addr + PAGE_SIZE and e > addr:
            lo, hi = max(s, addr) - addr, min(e, addr + PAGE_SIZE) - addr
            data[lo:hi] = bytes(hi - lo)
    return bytes(data)


# struct rseq (include/uapi/linux/rseq.h): the fields the kernel writes on every return to
# user space: cpu_id_start, cpu_id (bytes 0-7), node_id, mm_cid (bytes 20-27).
_RSEQ_KERNEL_FIELDS = ((0, 8), (20, 28))
_RSEQ_REASON = "the CPU (and node, concurrency id) a thread last ran on: the kernel writes it into its rseq area"


def _rseq_masks(*procs: ProcessImage) -> list[tuple[int, int]]:
    out = set()
    for proc in procs:
        for t in proc.threads:
            if t.rseq_addr and t.rseq_len:
                out.update((t.rseq_addr + s, t.rseq_addr + min(e, t.rseq_len)) for s, e in _RSEQ_KERNEL_FIELDS
                           if s < t.rseq_len)
    return sorted(out)


def _ranges(addresses: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for addr in addresses:
        if out and out[-1][1] == addr:
            out[-1][1] = addr + PAGE_SIZE
        else:
            out.append([addr, addr + PAGE_SIZE])
    return tuple((s, e) for s, e in out)


def _compare_memory(pid: int, pa: ProcessImage, pb: ProcessImage, pages_a: _Pages, pages_b: _Pages,
                    out: DiffResult) -> None:
    """For each mapping of A, the pages both images map (whatever their VMA boundaries)."""
    masks = _rseq_masks(pa, pb)
    vb = sorted(pb.vmas, key=lambda v: v.start)
    starts_b = [v.start for v in vb]
    for va in sorted(pa.vmas, key=lambda v: v.start):
        differ: list[int] = []
        compared = 0
        i = max(bisect_left(starts_b, va.start) - 1, 0)
        while i < len(vb) and vb[i].start < va.end:
            other = vb[i]
            lo, hi = max(va.start, other.start), min(va.end, other.end)
            i += 1
            if lo >= hi:
                continue
            x, y = pages_a.pieces(pid, lo, hi), pages_b.pieces(pid, lo, hi)
            compared += sum(min(e, hi) - max(s, lo) for s, e in _union(x, y)) // PAGE_SIZE
            zero_ok = va.kind in ZERO_DROPPABLE and other.kind in ZERO_DROPPABLE
            more, kernel = _differing_pages(x, y, lo, hi, zero_ok, masks)
            differ += more
            for addr in kernel:
                out.differences.append(Difference(f"process {pid} memory {addr:#x}", "rseq cpu ids", "-", "-",
                                                  _RSEQ_REASON))
        out.pages_compared += compared
        if differ:
            out.memory.append(PageDifference(pid, va.start, va.end, va.path, len(differ), compared,
                                             _ranges(differ)))


def _union(x: list[_Piece], y: list[_Piece]) -> list[tuple[int, int]]:
    spans = sorted((p[0], p[1]) for p in x + y)
    out: list[list[int]] = []
    for s, e in spans:
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


# =============================================================================
# the entry point
# =============================================================================

def diff_images(a: str | os.PathLike, b: str | os.PathLike, *, memory: bool = True) -> DiffResult:
    """Compare images a and b; ImageReader's errors (NotAnImage, CorruptImage, ...) pass through.

    Example: ``diff_images("/tmp/ckpt-1", "/tmp/ckpt-2").agree``
    """
    out = DiffResult(os.fspath(a), os.fspath(b))
    with ImageReader(a) as ra, ImageReader(b) as rb:
        c = _Comparer(ra, rb, out)
        c.record("image", ra.inventory, rb.inventory)
        if ra.version != rb.version:
            c.add("image", "format_version", ra.version, rb.version)
        pages_a, pages_b = _Pages(ra), _Pages(rb)
        for pid in sorted(set(ra.pids) | set(rb.pids)):
            pa = ra.process(pid) if pid in ra.pids else None
            pb = rb.process(pid) if pid in rb.pids else None
            if pa is None or pb is None:
                c.add(f"process {pid}", "", _process_brief(pa), _process_brief(pb))
                continue
            _compare_process(c, pid, pa, pb, pid == ra.inventory.root_pid)
            if memory:
                _compare_memory(pid, pa, pb, pages_a, pages_b, out)
        _compare_shared(c)
    return out


def _process_brief(proc: ProcessImage | None) -> Any:
    if proc is None:
        return None
    return {"comm": proc.task.comm, "exe": proc.task.exe, "threads": len(proc.threads)}
