"""The one validation layer every reader of an image goes through (ImageReader.open).

Checksums prove the bytes are the ones written; this proves they make sense together,
so that an image whose records were edited, mixed with another image's or written by a
broken tool is refused with one line by `show`, `restore`, `diff` and the API alike,
before anything is built from it.  Every check names the file and what is wrong.

What is checked: every field declared as an enum holds one of its members; addresses
are page-aligned and inside the user address space; mappings are ordered and disjoint;
page runs lie inside the mappings and do not overlap; pids, tids, fds, signal numbers,
resource numbers and timer ids are in range and unique where the kernel makes them so;
every reference (a thread's tid, a lock's or owner's fd, a pending signal's thread, the
root pid, a descriptor shared between records) points at something the image holds.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing

from ptckpt.errors import CorruptImage
from ptckpt.formats import model
from ptckpt.formats.model import GP_REG_NAMES, PAGE_SIZE, ProcessImage

PID_MAX = 1 << 22                 # PID_MAX_LIMIT on 64-bit
USER_TOP = 0x7FFFFFFFF000 + PAGE_SIZE   # TASK_SIZE_MAX (4-level paging)
USER_TOP_LA57 = 1 << 56
VSYSCALL = (0xFFFFFFFFFF600000, 0xFFFFFFFFFF601000)
NSIG = 64
FD_MAX = 1 << 30                  # fs.nr_open's ceiling
XSTATE_MAX = 64 * 1024
RLIMITS = 16
SIGINFO_SIZE = 128
STOP_SIGNALS = (0, 19, 20, 21, 22)    # not recorded, SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU
MEMBARRIER_REGISTRATIONS = 0x154      # MEMBARRIER_CMD_REGISTER_{GLOBAL,PRIVATE}_EXPEDITED, _SYNC_CORE, _RSEQ
PIDFD_FLAGS = 0o4200                  # PIDFD_NONBLOCK (O_NONBLOCK) | PIDFD_THREAD (O_EXCL)


class _Refused(Exception):
    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name
        self.message = message


def _fail(name: str, message: str) -> typing.NoReturn:
    raise _Refused(name, message)


@functools.cache
def _enum_fields(cls: type) -> tuple[tuple[str, type], ...]:
    hints = typing.get_type_hints(cls, vars(model))
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls)
                 if isinstance(hints.get(f.name), type) and issubclass(hints[f.name], enum.Enum))


def check_enums(name: str, record) -> None:
    """Every enum field holds a member (the parser lets unknown numbers through as ints)."""
    for field, cls in _enum_fields(type(record)):
        value = getattr(record, field)
        if not isinstance(value, cls):
            _fail(name, f"{type(record).__name__.upper()} {field} {value!r} is no {cls.__name__}")


def _user_address(addr: int) -> bool:
    return 0 <= addr <= USER_TOP_LA57


def _unique(name: str, what: str, values) -> None:
    seen = set()
    for v in values:
        if v in seen:
            _fail(name, f"{what} {v} appears twice")
        seen.add(v)


def check_inventory(name: str, inv: model.Inventory) -> None:
    if inv.page_size != PAGE_SIZE:
        _fail(name, f"page size {inv.page_size}, this machine's is {PAGE_SIZE}")
    if not inv.pids:
        _fail(name, "no processes")
    for pid in inv.pids:
        if not 0 < pid < PID_MAX:
            _fail(name, f"pid {pid} out of range")
    if inv.root_pid not in inv.pids:
        _fail(name, f"root pid {inv.root_pid} is not among the image's pids")
    if not 0 <= inv.xstate_size <= XSTATE_MAX:
        _fail(name, f"xstate size {inv.xstate_size} out of range")
    if not 0 <= inv.pid_level <= 32:
        _fail(name, f"pid namespace level {inv.pid_level} out of range")
    for virtual, real in inv.real_pids:
        if not (0 < virtual < PID_MAX and 0 < real < PID_MAX):
            _fail(name, f"pid pair ({virtual}, {real}) out of range")


def _check_vmas(name: str, proc: ProcessImage) -> list[tuple[int, int]]:
    spans = []
    last_end = 0
    for v in sorted(proc.vmas, key=lambda v: v.start):
        check_enums(name, v)
        what = f"mapping {v.start:#x}-{v.end:#x}"
        if v.start % PAGE_SIZE or v.end % PAGE_SIZE or v.start >= v.end:
            _fail(name, f"{what}: not a page-aligned, non-empty range")
        if (v.start, v.end) != VSYSCALL and not (_user_address(v.start) and v.end <= USER_TOP_LA57):
            _fail(name, f"{what}: outside the user address space")
        if v.start < last_end:
            _fail(name, f"{what}: overlaps another mapping")
        last_end = v.end
        if v.prot & ~7 or v.prot < 0:
            _fail(name, f"{what}: protection {v.prot:#x}")
        if v.pgoff < 0 or v.pgoff % PAGE_SIZE:
            _fail(name, f"{what}: file offset {v.pgoff}")
        if not (0 <= v.dev_major < 1 << 12 and 0 <= v.dev_minor < 1 << 20 and 0 <= v.inode < 1 << 64):
            _fail(name, f"{what}: device {v.dev_major}:{v.dev_minor} or inode {v.inode} out of range")
        for s, e in (*v.guards, *v.cow):
            if not (v.start <= s < e <= v.end) or s % PAGE_SIZE or e % PAGE_SIZE:
                _fail(name, f"{what}: a guard or shared range {s:#x}-{e:#x} outside it")
        spans.append((v.start, v.end))
    return spans


def check_page_runs(name: str, runs, spans: list[tuple[int, int]]) -> None:
    """Runs inside the mappings (contiguous mappings may share a run), none overlapping."""
    merged: list[list[int]] = []
    for s, e in spans:
        if merged and merged[-1][1] == s:
            merged[-1][1] = e
        else:
            merged.append([s, e])
    import bisect
    starts = [m[0] for m in merged]
    prev_end = -1
    for run in sorted(runs, key=lambda r: r.vaddr):
        end = run.vaddr + run.npages * PAGE_SIZE
        i = bisect.bisect_right(starts, run.vaddr) - 1
        if i < 0 or end > merged[i][1]:
            _fail(name, f"page run {run.vaddr:#x}+{run.npages} pages lies outside the mappings")
        if run.vaddr < prev_end:
            _fail(name, f"page run {run.vaddr:#x} overlaps another")
        prev_end = end


def check_process(name: str, pid: int, proc: ProcessImage, xstate_size: int) -> list[tuple[int, int]]:
    """Every record of one process in range and consistent with the others (in this order,
    which decides the error reported first); the spans of its mappings."""
    _check_task(name, proc.task)
    if proc.mm.membarrier & ~MEMBARRIER_REGISTRATIONS:
        _fail(name, f"MM membarrier registrations {proc.mm.membarrier:#x}: unknown bits")
    tids = _check_threads(name, pid, proc, xstate_size)
    spans = _check_vmas(name, proc)
    _check_signals(name, proc, tids)
    fds = _check_fds(name, proc)
    _unique(name, "rlimit", [r.resource for r in proc.rlimits])
    for r in proc.rlimits:
        if not 0 <= r.resource < RLIMITS:
            _fail(name, f"rlimit {r.resource}")
    _check_locks_and_owners(name, proc, fds)
    _check_timers(name, proc, tids)
    for ring in proc.aio_rings:
        if ring.start % PAGE_SIZE or ring.end <= ring.start or not any(s <= ring.start and ring.end <= e
                                                                       for s, e in spans):
            _fail(name, f"AIO ring {ring.start:#x}: not one of the mappings")
    return spans


def _check_task(name: str, task) -> None:
    """The TASK record's fields in their ranges."""
    for field in ("ppid", "pgid", "sid"):
        if not 0 <= getattr(task, field) < PID_MAX:
            _fail(name, f"TASK {field} {getattr(task, field)} out of range")
    if not 0 <= task.umask <= 0o777:
        _fail(name, f"TASK umask {task.umask:#o}")
    for line in task.cgroups.splitlines():
        hierarchy, _, rest = line.partition(":")
        if not hierarchy.isdigit() or ":" not in rest or not rest.split(":", 1)[1].startswith("/"):
            _fail(name, f"TASK cgroup line {line!r} is not ID:CONTROLLERS:/PATH")
    for line in task.cgroup_dirs.splitlines():
        fields = line.split("\t")
        shape = {"d": 6, "f": 6, "p": 4}.get(fields[0])
        if shape != len(fields) or not fields[2].startswith("/") or (
                shape == 6 and not (set(fields[3]) <= set("01234567") and fields[3]
                                    and fields[4].isdigit() and fields[5].isdigit())):
            _fail(name, f"TASK cgroup directory line {line!r} is not d|f CONTROLLERS /PATH MODE UID GID "
                        f"or p CONTROLLERS /PATH VALUE")
    for field, low, high in (("nice", -20, 19), ("rt_priority", 0, 99), ("oom_score_adj", -1000, 1000),
                             ("personality", 0, 2**32 - 1), ("sched_policy", 0, 2**31 - 1),
                             ("timerslack_ns", 0, 2**63 - 1), ("dumpable", 0, 2), ("mdwe", 0, 2**31 - 1),
                             ("coredump_filter", -1, 2**32 - 1)):
        if not low <= getattr(task, field) <= high:
            _fail(name, f"TASK {field} {getattr(task, field)} out of range")
    if len(task.spec_ctrl) not in (0, 3) or any(not 0 <= v < 2**31 for v in task.spec_ctrl):
        _fail(name, "TASK speculation controls malformed")
    if not -1 <= task.exit_signal <= NSIG or not 0 <= task.pdeath_signal <= NSIG:
        _fail(name, "TASK exit or parent-death signal out of range")
    if task.stop_signal not in STOP_SIGNALS or (task.stop_signal and task.state != "T"):
        _fail(name, f"TASK stop signal {task.stop_signal} (state {task.state!r}): not a stop signal "
                    f"of a stopped process")


TLS_ENTRY_MIN = 12        # GDT_ENTRY_TLS_MIN on x86_64: the three TLS entries are 12, 13, 14


def _check_threads(name: str, pid: int, proc: ProcessImage, xstate_size: int) -> set[int]:
    """The THREAD records: the leader's among them, each in range, and the same tids as the
    TASK's list; the set of tids."""
    if not proc.threads:
        _fail(name, "no THREAD entry")
    _unique(name, "thread", [t.tid for t in proc.threads])
    tids = {t.tid for t in proc.threads}
    if pid not in tids:
        _fail(name, f"no THREAD for the leader {pid}")
    for t in proc.threads:
        for line in t.cgroups.splitlines():
            hierarchy, _, rest = line.partition(":")
            if not hierarchy.isdigit() or ":" not in rest or not rest.split(":", 1)[1].startswith("/"):
                _fail(name, f"THREAD {t.tid} cgroup line {line!r} is not ID:CONTROLLERS:/PATH")
    for t in proc.threads:
        check_enums(name, t)
        if not 0 < t.tid < PID_MAX:
            _fail(name, f"thread {t.tid} out of range")
        if len(t.regs) != len(GP_REG_NAMES) or any(not 0 <= r < 2**64 for r in t.regs):
            _fail(name, f"thread {t.tid}: {len(t.regs)} registers, expected {len(GP_REG_NAMES)}")
        if len(t.xstate) > XSTATE_MAX or (xstate_size and len(t.xstate) != xstate_size):
            _fail(name, f"thread {t.tid}: xstate of {len(t.xstate)} bytes, the image says {xstate_size}")
        if not 0 <= t.sigmask < 2**64:
            _fail(name, f"thread {t.tid}: signal mask out of range")
        if len(t.sched) not in (0, 3) or (t.sched and not (0 <= t.sched[0] < 2**31 and 0 <= t.sched[1] <= 99
                                                            and -20 <= t.sched[2] <= 19)):
            _fail(name, f"thread {t.tid}: scheduling {t.sched} malformed")
        if any(not 0 <= c < 8192 for c in t.cpus):
            _fail(name, f"thread {t.tid}: CPU affinity out of range")
        if t.sas_size < 0 or not 0 <= t.sas_flags < 2**32:
            _fail(name, f"thread {t.tid}: alternate signal stack malformed")
        if len({e[0] for e in t.tls}) != len(t.tls) or any(not TLS_ENTRY_MIN <= e[0] < TLS_ENTRY_MIN + 3
                                                           for e in t.tls):
            _fail(name, f"thread {t.tid}: TLS entries {[e[0] for e in t.tls]} are not GDT entries 12-14 once each")
    if set(proc.task.tids) != tids:
        _fail(name, "TASK's thread list and the THREAD entries disagree")
    return tids


def _check_signals(name: str, proc: ProcessImage, tids: set[int]) -> None:
    """The dispositions, one per signal, and the pending signals (of the process's threads)."""
    _unique(name, "signal", [s.signo for s in proc.sigactions])
    for s in proc.sigactions:
        if not 1 <= s.signo <= NSIG:
            _fail(name, f"SIGACTION for signal {s.signo}")
    for p in proc.pending:
        if len(p.siginfo) != SIGINFO_SIZE:
            _fail(name, f"pending signal: siginfo of {len(p.siginfo)} bytes")
        signo = int.from_bytes(p.siginfo[:4], "little", signed=True)
        if not 1 <= signo <= NSIG:
            _fail(name, f"pending signal {signo}")
        if p.tid and p.tid not in tids:
            _fail(name, f"pending signal for thread {p.tid}, which the process does not have")


def _check_fds(name: str, proc: ProcessImage) -> set[int]:
    """The fd records, one per number, each in range; the set of fd numbers."""
    _unique(name, "fd", [f.fd for f in proc.fds])
    fds = set()
    for f in proc.fds:
        check_enums(name, f)
        if not 0 <= f.fd < FD_MAX:
            _fail(name, f"fd {f.fd} out of range")
        if f.desc < 0:
            _fail(name, f"fd {f.fd}: description {f.desc}")
        fds.add(f.fd)
    return fds


def _check_locks_and_owners(name: str, proc: ProcessImage, fds: set[int]) -> None:
    """Locks and fd owners name fds the process has."""
    for lock in proc.locks:
        if lock.fd not in fds:
            _fail(name, f"a lock held through fd {lock.fd}, which the process does not have")
    for owner in proc.owners:
        if owner.fd not in fds:
            _fail(name, f"an owner of fd {owner.fd}, which the process does not have")
        if not 0 <= owner.signo <= NSIG:
            _fail(name, f"fd {owner.fd}: signal {owner.signo}")


def _check_timers(name: str, proc: ProcessImage, tids: set[int]) -> None:
    """POSIX timers (ids, signals, threads, times) and interval timers, one of each kind."""
    _unique(name, "timer", [t.id for t in proc.timers])
    for t in proc.timers:
        if t.id < 0 or not 0 <= t.signo <= NSIG or (t.tid and t.tid not in tids):
            _fail(name, f"POSIX timer {t.id}: id, signal or thread out of range")
        if t.interval_ns < 0 or t.left_ns < 0:
            _fail(name, f"POSIX timer {t.id}: negative time")
    _unique(name, "interval timer", [t.which for t in proc.itimers])
    for t in proc.itimers:
        if t.which not in (0, 1, 2) or t.interval_us < 0 or t.left_us < 0:
            _fail(name, f"interval timer {t.which}")


def check_tree(name: str, root: int, procs: dict[int, ProcessImage]) -> None:
    """Every process but the root has its parent in the image (the tree is the root and its
    descendants)."""
    for pid, proc in procs.items():
        if pid != root and proc.task.ppid not in procs:
            _fail(name, f"process {pid}: its parent {proc.task.ppid} is not in the image")


def check_shared(name: str, records, pids: set[int], descs: set[int]) -> None:
    for rec in records:
        check_enums(name, rec)
    _unique(name, "zombie", [z.pid for z in records if isinstance(z, model.Zombie)])
    for z in records:
        if isinstance(z, model.Zombie) and (not 0 < z.pid < PID_MAX or z.pid in pids):
            _fail(name, f"zombie {z.pid}: out of range or also a live process")
    zombies = {z.pid for z in records if isinstance(z, model.Zombie)}
    for r in records:
        if isinstance(r, model.PidfdState) and (
                r.pid != -1 and r.pid not in pids | zombies or r.flags & ~PIDFD_FLAGS or r.target < 1):
            _fail(name, f"pidfd (description {r.desc}) of {r.pid}: not a process or zombie of the image, "
                        f"nor -1 (dead), or flags {r.flags:#o} / target {r.target} out of range")
    for u in records:
        if isinstance(u, model.UnixSocket) and u.queue_creds and (
                len(u.queue_creds) != len(u.queue) or any(c[0] and c[0] not in pids for c in u.queue_creds)):
            _fail(name, f"unix socket {u.ino}: the credentials of its queue do not match its messages "
                        f"or name a process the image does not hold")


def refuse(path_of, fn, *args):
    """Run a check (its result returned); its refusal becomes CorruptImage naming the file
    (path_of(name))."""
    try:
        return fn(*args)
    except _Refused as err:
        raise CorruptImage(path_of(err.name), err.message) from None
