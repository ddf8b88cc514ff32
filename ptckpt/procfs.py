"""Plain /proc parsers returning typed records (layer 2: no ptrace here).

Every reader takes the pid (and a tid where the file exists per thread) and
a keyword ``procfs`` naming the procfs root, so tests can point it at a
fixture tree.  Results are the NamedTuples and frozen dataclasses declared
at the top of this module.

Errors are translated at one choke point, :func:`_wrap_exceptions`, which
sits on every public reader:

* PermissionError            -> :class:`ptckpt.errors.AccessDenied`
* ProcessLookupError (ESRCH) -> :class:`ptckpt.errors.NoSuchProcess`, but see below
* FileNotFoundError          -> NoSuchProcess if ``<procfs>/<pid>`` is gone,
  NoSuchProcess(tid, "thread") if only the thread is gone,
  :class:`ZombieProcess` for a zombie, :class:`ptckpt.errors.KernelThread`
  for a kernel thread (exe, cwd ... do not resolve), otherwise
  :class:`ProcEntryMissing` (the process is alive but the file is not there:
  kernel built without it ...; :class:`FdGone` for an fd closed meanwhile)
* ProcessLookupError (ESRCH) on an existing pid: the task has no mm, same
  classification (zombie, kernel thread)
* any other OSError          -> :class:`ProcfsError`

so no bare OSError leaves this module, but from the readers of system-wide files
(/proc/sys, /proc/cpuinfo, /proc/locks ...): with no process to name, theirs pass as
they are.

This is the one module that knows /proc's files and formats; the places elsewhere that
still name a /proc path (writes to tunables, files opened again through their links)
are listed in :data:`ELSEWHERE` with their reasons, and tests/test_layout.py holds
every other module to that list.

PAGEMAP_SCAN, as verified on Linux 6.18 (x86_64, root): ioctl number
0xc0606610, struct pm_scan_arg 96 bytes, PAGE_IS_* values as in
include/uapi/linux/fs.h; a read-only anonymous page reports
PRESENT|PFNZERO, the huge zero page PRESENT|PFNZERO|HUGE, a written THP
PRESENT|HUGE, clean page cache and shmem PRESENT|FILE; WRITTEN is set on
every page not uffd-wp protected, so it means nothing without uffd-wp.

Field numbers in comments are those of ``man 5 proc`` (1-based).  Kernel
sources cited are fs/proc/array.c (stat, status), fs/proc/task_mmu.c (maps,
smaps, pagemap, PAGEMAP_SCAN), fs/proc/base.c (the rest).
"""

from __future__ import annotations

import ctypes
import enum
import errno as _errno
import fcntl
import functools
import inspect
import mmap
import os
import re
import threading
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from ptckpt.errors import AccessDenied, KernelThread, NoSuchProcess, ProcessError, PtckptError

PAGE_SIZE = mmap.PAGESIZE
PAGE_SHIFT = PAGE_SIZE.bit_length() - 1
_U64_MAX = 2**64 - 1

# PROT_* bits as in <sys/mman.h> (asm-generic/mman-common.h).
PROT_READ = 0x1
PROT_WRITE = 0x2
PROT_EXEC = 0x4

# include/linux/sched.h
PF_KTHREAD = 0x00200000


# --- errors of this layer ---------------------------------------------------

class ProcfsError(ProcessError):
    """Reading a /proc file of a live process failed in an unexpected way."""

    def __init__(self, pid: int, path: str, reason: str, err: int | None = None):
        super().__init__(pid, f"process {pid}: cannot read {path}: {reason}")
        self.path = path
        self.reason = reason
        self.errno = err


class ProcEntryMissing(ProcfsError):
    """The process exists but this /proc entry does not (fd closed meanwhile,
    mapping gone, kernel built without the file ...)."""

    def __init__(self, pid: int, path: str):
        super().__init__(pid, path, "no such file", _errno.ENOENT)


class FdGone(ProcEntryMissing):
    """The fd was closed between list_fds() and a read of its entries."""

    def __init__(self, pid: int, fd: int, path: str):
        super().__init__(pid, path)
        self.fd = fd


class ZombieProcess(NoSuchProcess):
    """The process has exited but was not reaped: its /proc files are mostly empty."""

    def __init__(self, pid: int):
        ProcessError.__init__(self, pid, f"process {pid} is a zombie (exited, not yet reaped)")


# What the choke point makes of a FileNotFoundError: the process is gone (or a zombie),
# a kernel thread, or alive without that entry.  Callers that skip a missing file catch it.
GONE_OR_MISSING = (NoSuchProcess, KernelThread, ProcEntryMissing)


# --- records ----------------------------------------------------------------

class MapEntry(NamedTuple):
    """One line of /proc/PID/maps (man 5 proc, "/proc/pid/maps")."""

    start: int
    end: int
    perms: str          # "rwxp" / "r--s" as printed
    prot: int           # PROT_READ | PROT_WRITE | PROT_EXEC
    shared: bool        # 's' in the fourth perms column (MAP_SHARED)
    offset: int         # file offset in bytes (pgoff << PAGE_SHIFT)
    dev_major: int
    dev_minor: int
    inode: int
    path: str           # "" when anonymous; "[heap]", "[stack]", "[vdso]", "[anon:NAME]" ...
    deleted: bool       # the kernel appended " (deleted)" (stripped from path)

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_pseudo(self) -> bool:
        """A kernel-named area such as [heap], [stack], [vdso], [vvar], [anon:x]."""
        return self.path.startswith("[")


class SmapsEntry(NamedTuple):
    """One VMA of /proc/PID/smaps: the maps line, its counters and VmFlags."""

    start: int
    end: int
    perms: str
    prot: int
    shared: bool
    offset: int
    dev_major: int
    dev_minor: int
    inode: int
    path: str
    deleted: bool
    # "Rss", "Pss", "Private_Dirty", "Swap", "AnonHugePages" ... in kB; the
    # few unit-less lines ("THPeligible", "ProtectionKey") are plain numbers.
    counters: dict[str, int]
    vmflags: str        # the VmFlags line as printed, e.g. "rd wr mr mw me ac sd"

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def vmflag_set(self) -> frozenset[str]:
        return frozenset(self.vmflags.split())

    def map_entry(self) -> MapEntry:
        return MapEntry(*self[:11])


class PageCategory(enum.IntFlag):
    """PAGE_IS_* of include/uapi/linux/fs.h (Linux 6.7+), reported by PAGEMAP_SCAN."""

    WPALLOWED = 1 << 0    # uffd async write-protect is enabled for the page
    WRITTEN = 1 << 1      # written since write-protected (not uffd-wp)
    FILE = 1 << 2         # not an anonymous page: page cache or shmem / shared anon
    PRESENT = 1 << 3      # mapped in the page table
    SWAPPED = 1 << 4      # swap entry in the page table
    PFNZERO = 1 << 5      # the (huge) zero page: read but never written
    HUGE = 1 << 6         # THP or hugetlb mapped
    SOFT_DIRTY = 1 << 7   # soft-dirty bit (CONFIG_MEM_SOFT_DIRTY; off on our machines)


PAGE_IS_WPALLOWED = int(PageCategory.WPALLOWED)
PAGE_IS_WRITTEN = int(PageCategory.WRITTEN)
PAGE_IS_FILE = int(PageCategory.FILE)
PAGE_IS_PRESENT = int(PageCategory.PRESENT)
PAGE_IS_SWAPPED = int(PageCategory.SWAPPED)
PAGE_IS_PFNZERO = int(PageCategory.PFNZERO)
PAGE_IS_HUGE = int(PageCategory.HUGE)
PAGE_IS_SOFT_DIRTY = int(PageCategory.SOFT_DIRTY)
_PM_SCAN_CATEGORIES = 0xFF

# What scan_pages reports by default: enough to tell anonymous data from
# clean page cache; HUGE and SOFT_DIRTY would only fragment the runs.
DEFAULT_RETURN_MASK = PAGE_IS_PRESENT | PAGE_IS_SWAPPED | PAGE_IS_FILE


class PageRun(NamedTuple):
    """Pages [start, end) sharing the same PAGE_IS_* categories (masked)."""

    start: int
    end: int
    categories: int

    @property
    def npages(self) -> int:
        return (self.end - self.start) >> PAGE_SHIFT

    @property
    def is_file(self) -> bool:
        return bool(self.categories & PAGE_IS_FILE)

    @property
    def is_present(self) -> bool:
        return bool(self.categories & PAGE_IS_PRESENT)

    @property
    def is_swapped(self) -> bool:
        return bool(self.categories & PAGE_IS_SWAPPED)

    @property
    def is_zero(self) -> bool:
        return bool(self.categories & PAGE_IS_PFNZERO)

    @property
    def is_huge(self) -> bool:
        return bool(self.categories & PAGE_IS_HUGE)


class ScanMethod(enum.Enum):
    """How scan_pages walks the page tables."""

    AUTO = "auto"          # PAGEMAP_SCAN when the kernel has it, else PAGEMAP
    IOCTL = "ioctl"        # PAGEMAP_SCAN only (Linux 6.7+)
    PAGEMAP = "pagemap"    # read 8 bytes per page from /proc/PID/pagemap


class PagemapEntry(NamedTuple):
    """One decoded u64 of /proc/PID/pagemap (Documentation/admin-guide/mm/pagemap.rst)."""

    present: bool          # bit 63
    swapped: bool          # bit 62
    file_or_shared: bool   # bit 61: file page or shared anon
    exclusive: bool        # bit 56: page exclusively mapped (since 4.2)
    uffd_wp: bool          # bit 57: pte is uffd-wp write-protected (since 5.17)
    soft_dirty: bool       # bit 55
    pfn: int               # bits 0-54 when present (0 unless CAP_SYS_ADMIN, since 4.0)
    swap_type: int         # bits 0-4 when swapped
    swap_offset: int       # bits 5-54 when swapped


class Stat(NamedTuple):
    """/proc/PID/stat or /proc/PID/task/TID/stat, every field of man 5 proc by name.

    Notes on what the kernel (fs/proc/array.c, do_task_stat) really shows:
    * the mm fields (26-28 and 45-51) are 0 unless the reader may ptrace-read
      the task, and always 0 for kernel threads and zombies;
    * kstkesp/kstkeip (29, 30) are 0 except while the task dumps core;
    * wchan (35) is only 0 or 1 nowadays: read /proc/PID/wchan for the name;
    * signal/blocked/sigignore/sigcatch (31-34) are truncated, obsolete:
      use read_status();
    * brk is NOT here: field 47 is start_brk only.  The current program break
      is the end of the [heap] VMA (when there is one) or must be read by
      injecting brk(0) into the tracee; that is left to the callers.
    Older kernels print fewer fields; the missing trailing ones read as 0.
    """

    pid: int                    # (1)
    comm: str                   # (2) up to 15 bytes, may contain spaces and parens
    state: str                  # (3)
    ppid: int                   # (4)
    pgrp: int                   # (5)
    session: int                # (6)
    tty_nr: int                 # (7)
    tpgid: int                  # (8)
    flags: int                  # (9) PF_* (include/linux/sched.h)
    minflt: int                 # (10)
    cminflt: int                # (11)
    majflt: int                 # (12)
    cmajflt: int                # (13)
    utime: int                  # (14) clock ticks
    stime: int                  # (15)
    cutime: int                 # (16)
    cstime: int                 # (17)
    priority: int               # (18)
    nice: int                   # (19)
    num_threads: int            # (20)
    itrealvalue: int            # (21) always 0 since 2.6.17
    start_time: int             # (22) clock ticks after boot
    vsize: int                  # (23) bytes
    rss: int                    # (24) pages
    rsslim: int                 # (25)
    start_code: int             # (26)
    end_code: int               # (27)
    start_stack: int            # (28)
    kstkesp: int                # (29)
    kstkeip: int                # (30)
    signal: int                 # (31)
    blocked: int                # (32)
    sigignore: int              # (33)
    sigcatch: int               # (34)
    wchan: int                  # (35)
    nswap: int                  # (36)
    cnswap: int                 # (37)
    exit_signal: int            # (38)
    processor: int              # (39)
    rt_priority: int            # (40)
    policy: int                 # (41) SCHED_*
    delayacct_blkio_ticks: int  # (42)
    guest_time: int             # (43)
    cguest_time: int            # (44)
    start_data: int             # (45)
    end_data: int               # (46)
    start_brk: int              # (47)
    arg_start: int              # (48)
    arg_end: int                # (49)
    env_start: int              # (50)
    env_end: int                # (51)
    exit_code: int              # (52)

    @property
    def is_kthread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


@dataclass(frozen=True, slots=True)
class Status:
    """/proc/PID/status (fs/proc/array.c, proc_pid_status).

    Signal and capability masks are ints (the file prints them in hex);
    ``vm`` holds the "Vm*", "Rss*" and "HugetlbPages" lines in kB (absent for
    kernel threads); ``raw`` holds every line's text, for what is not typed.
    """

    name: str
    umask: int | None               # "Umask:" (4.7+), octal
    state: str                      # the letter of "State:", e.g. "S"
    tgid: int
    ngid: int
    pid: int
    ppid: int
    tracer_pid: int
    uids: tuple[int, int, int, int]  # real, effective, saved set, filesystem
    gids: tuple[int, int, int, int]
    fd_size: int
    groups: tuple[int, ...]
    nstgid: tuple[int, ...]         # outermost namespace first
    nspid: tuple[int, ...]
    nspgid: tuple[int, ...]
    nssid: tuple[int, ...]
    kthread: bool                   # "Kthread:" (6.x) or PF_KTHREAD from stat
    threads: int
    sig_q: tuple[int, int]          # queued, RLIMIT_SIGPENDING
    sig_pnd: int
    shd_pnd: int
    sig_blk: int
    sig_ign: int
    sig_cgt: int
    cap_inh: int
    cap_prm: int
    cap_eff: int
    cap_bnd: int
    cap_amb: int
    no_new_privs: bool
    seccomp: int                    # 0 disabled, 1 strict, 2 filter
    seccomp_filters: int
    core_dumping: bool
    cpus_allowed_list: str
    mems_allowed_list: str
    voluntary_ctxt_switches: int
    nonvoluntary_ctxt_switches: int
    vm: dict[str, int] = field(default_factory=dict)
    raw: dict[str, str] = field(default_factory=dict)


class AuxEntry(NamedTuple):
    """One (a_type, a_val) pair of /proc/PID/auxv (AT_* of include/uapi/linux/auxvec.h)."""

    type: int
    value: int


class Rlimit(NamedTuple):
    """One line of /proc/PID/limits; RLIM_INFINITY ("unlimited") is 2**64-1."""

    resource: int       # RLIMIT_CPU = 0 .. RLIMIT_RTTIME = 15
    cur: int
    max: int


class FdInfo(NamedTuple):
    """/proc/PID/fdinfo/FD (fs/proc/fd.c seq_show plus the file's show_fdinfo).

    ``extra`` maps each further line's key to the raw text after it, in
    order, one list item per line with that key, e.g.::

        eventfd:  {"eventfd-count": ["0"], "eventfd-id": ["1"]}
        timerfd:  {"clockid": ["1"], "ticks": ["0"], "settime flags": ["01"],
                   "it_value": ["(0, 0)"], "it_interval": ["(0, 0)"]}
        epoll:    {"tfd": ["5 events: 19 data: ...", ...]}
        inotify:  {"inotify": ["wd:1 ino:... sdev:... mask:...", ...]}
    """

    pos: int
    flags: int          # O_* flags, printed in octal (O_CLOEXEC included)
    mnt_id: int
    ino: int | None     # "ino:" since 5.14
    extra: dict[str, list[str]]


class SyscallInfo(NamedTuple):
    """/proc/PID/task/TID/syscall (fs/proc/base.c, proc_pid_syscall)."""

    running: bool               # the file said "running": no register snapshot
    nr: int | None              # syscall number; -1 when blocked outside a syscall
    args: tuple[int, ...]       # the six argument registers (empty when nr == -1)
    sp: int | None
    pc: int | None

    @property
    def in_syscall(self) -> bool:
        return self.nr is not None and self.nr >= 0


# --- the choke point --------------------------------------------------------

def _process_gone(pid: int, procfs: str) -> bool:
    return not os.path.exists(f"{procfs}/{pid}")


def _stat_or_none(pid: int, procfs: str) -> Stat | None:
    try:
        with open(f"{procfs}/{pid}/stat", "rb") as f:
            return _parse_stat(f.read())
    except (OSError, ValueError):
        return None


def _why_no_mm(pid: int, procfs: str) -> PtckptError | None:
    """Why a process that has a /proc directory lacks a file or an mm."""
    if _process_gone(pid, procfs):
        return NoSuchProcess(pid)
    st = _stat_or_none(pid, procfs)
    if st is None:
        return NoSuchProcess(pid)        # went away just now
    if st.state in ("Z", "X"):
        return ZombieProcess(pid)
    if st.is_kthread:
        return KernelThread(pid, st.comm)
    return None


def _translate(err: OSError, pid: int, tid: int | None, procfs: str) -> PtckptError:
    path = err.filename if isinstance(err.filename, str) else os.fsdecode(err.filename or "")
    if isinstance(err, PermissionError):
        return AccessDenied(pid, "read /proc of", f"{path}: {err.strerror}" if path else "")
    if isinstance(err, ProcessLookupError):
        # ESRCH from a file of an existing directory: the task has no mm
        # (exited, zombie) or never had one (kernel thread: auxv, environ ...)
        return _why_no_mm(pid, procfs) or NoSuchProcess(pid)
    if isinstance(err, FileNotFoundError):
        if _process_gone(pid, procfs):
            return NoSuchProcess(pid)
        if tid is not None and not os.path.exists(f"{procfs}/{pid}/task/{tid}"):
            return NoSuchProcess(tid, "thread")
        # readlink of exe/cwd/root gives ENOENT for zombies and kernel threads
        return _why_no_mm(pid, procfs) or ProcEntryMissing(pid, path)
    return ProcfsError(pid, path, err.strerror or str(err), err.errno)


def _wrap_exceptions(fn):
    """Translate OSError raised by a reader into ptckpt errors (see module doc).

    The arguments are bound only on the error path, so the happy path costs
    one try block.
    """
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as err:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            raise _translate(err, a["pid"], a.get("tid"), a["procfs"]) from err

    return wrapper


def _path(procfs: str, pid: int, tid: int | None, name: str) -> str:
    if tid is None:
        return f"{procfs}/{pid}/{name}"
    return f"{procfs}/{pid}/task/{tid}/{name}"


# --- files read ahead ---------------------------------------------------------
# /proc/PID/smaps and numa_maps cost the kernel a walk of every page table (~70 and
# ~40 ms for 4 GiB of small pages).  A dump that has frozen a tree starts them at
# once, each in a thread of its own (the read is the kernel's work, done without the
# GIL), and goes on injecting; the reader of the file then takes what the thread read.
# Only what cannot change while the tree is frozen is read ahead, and only then.

_AHEAD: dict[str, "_ReadAhead"] = {}
_AHEAD_FILES = ("smaps", "numa_maps")


class _ReadAhead:
    def __init__(self, path: str):
        self.data: bytes | None = None
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, args=(path,), daemon=True,
                                       name=f"ptckpt read {path}")
        self.thread.start()

    def _run(self, path: str) -> None:
        try:
            self.data = _read_whole(path)
        except OSError as err:
            self.error = err

    def result(self) -> bytes:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.data


def read_ahead(pids, *, names=_AHEAD_FILES, procfs: str = "/proc") -> None:
    """Start reading /proc/PID/NAME of frozen processes (`names`: of _AHEAD_FILES), for
    their readers to take; forget_read_ahead() before the processes run again."""
    for pid in pids:
        for name in names:
            path = f"{procfs}/{pid}/{name}"
            if path not in _AHEAD:
                _AHEAD[path] = _ReadAhead(path)


def reading_ahead(pid: int, name: str, *, procfs: str = "/proc") -> bool:
    """Whether /proc/PID/NAME is being read ahead (and not taken yet)."""
    return f"{procfs}/{pid}/{name}" in _AHEAD


def forget_read_ahead() -> None:
    """What was read ahead and not taken is dropped (the processes are to run again)."""
    pending = list(_AHEAD.values())
    _AHEAD.clear()
    for ahead in pending:
        ahead.thread.join()


def _read(path: str) -> bytes:
    ahead = _AHEAD.pop(path, None) if _AHEAD else None
    if ahead is not None:
        return ahead.result()
    return _read_whole(path)


def _read_whole(path: str) -> bytes:
    """The whole file, in big reads: the kernel fills each at once (seq_file), so a thread
    reading ahead takes the GIL back a few times, not once a page, while the tracer's
    thread holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as err:     # the error of a read (EPERM, ESRCH) names no file
        if err.filename is None:
            err.filename = path
        raise
    finally:
        os.close(fd)


def _read_text(path: str) -> str:
    return os.fsdecode(_read(path))


# --- maps and smaps ---------------------------------------------------------

_PROT_OF = {
    b"---": 0,
    b"r--": PROT_READ,
    b"-w-": PROT_WRITE,
    b"--x": PROT_EXEC,
    b"rw-": PROT_READ | PROT_WRITE,
    b"r-x": PROT_READ | PROT_EXEC,
    b"-wx": PROT_WRITE | PROT_EXEC,
    b"rwx": PROT_READ | PROT_WRITE | PROT_EXEC,
}
_DELETED = b" (deleted)"


def _parse_map_line(line: bytes) -> tuple:
    """The 11 MapEntry fields of one maps/smaps header line.

    Layout (fs/proc/task_mmu.c, show_vma_header_prefix + show_map_vma):
    "start-end perms offset major:minor inode", then, if the VMA has a name,
    padding to column 73 and the name.  The name is a d_path (starts with
    '/'), a pseudo name ("[heap]", "[anon:x]") or "/memfd:x (deleted)"; it
    can hold spaces and any byte but '\\n', which seq_path() escapes as
    "\\012".  A name that really ends in " (deleted)" is indistinguishable
    from a deleted file: the kernel gives no other hint.
    """
    parts = line.split(None, 5)
    addr, perms, offset, dev, inode = parts[:5]
    start, _, end = addr.partition(b"-")
    major, _, minor = dev.partition(b":")
    deleted = False
    if len(parts) == 6:
        name = parts[5]
        if name.endswith(_DELETED):
            name = name[: -len(_DELETED)]
            deleted = True
        if b"\\012" in name:
            name = name.replace(b"\\012", b"\n")
        path = os.fsdecode(name)
    else:
        path = ""
    return (
        int(start, 16), int(end, 16), perms.decode("ascii"), _PROT_OF[perms[:3]],
        perms[3:4] == b"s", int(offset, 16), int(major, 16), int(minor, 16),
        int(inode), path, deleted,
    )


@_wrap_exceptions
def read_maps(pid: int, *, procfs: str = "/proc") -> list[MapEntry]:
    """The VMAs of /proc/PID/maps, in address order."""
    data = _read(f"{procfs}/{pid}/maps")
    return [MapEntry._make(_parse_map_line(line)) for line in data.splitlines() if line]


_HEX_START = frozenset(b"0123456789abcdef")
_KEY_CACHE: dict[bytes, str] = {}


@_wrap_exceptions
def read_smaps(pid: int, *, procfs: str = "/proc") -> list[SmapsEntry]:
    """Every VMA of /proc/PID/smaps with its counters and VmFlags.

    One pass over the lines: a VMA header starts with a lowercase hex digit,
    every other line with an upper-case key ("Rss:", ..., "VmFlags:").
    Takes a few tens of ms for thousands of VMAs; the kernel's own walk of
    the page tables usually costs more.
    """
    data = _read(f"{procfs}/{pid}/smaps")
    out: list[SmapsEntry] = []
    head: tuple | None = None
    counters: dict[str, int] = {}
    vmflags = ""
    key_cache = _KEY_CACHE
    make = SmapsEntry._make
    for line in data.split(b"\n"):
        if not line:
            continue
        if line[0] in _HEX_START:
            if head is not None:
                out.append(make(head + (counters, vmflags)))
            head = _parse_map_line(line)
            counters = {}
            vmflags = ""
            continue
        key, _, rest = line.partition(b":")
        if key == b"VmFlags":
            vmflags = rest.strip().decode("ascii")
            continue
        name = key_cache.get(key)
        if name is None:
            name = key_cache.setdefault(key, key.decode("ascii"))
        words = rest.split()
        if words:
            try:
                counters[name] = int(words[0])
            except ValueError:      # not a number: not a counter we know
                pass
    if head is not None:
        out.append(make(head + (counters, vmflags)))
    return out


MAP_FILES_CAPABILITY = "CAP_CHECKPOINT_RESTORE (or CAP_SYS_ADMIN)"


@_wrap_exceptions
def map_file_path(pid: int, start: int, end: int, dev: tuple[int, int], inode: int,
                  path: str, *, procfs: str = "/proc") -> str:
    """A path that opens the very file mapped at start-end (dev is (major, minor) and
    inode as /proc/PID/maps shows them; path is the mapping's name there).

    /proc/PID/map_files/START-END (lowercase hex, fs/proc/base.c) names it whatever its
    path now is, but following that link needs MAP_FILES_CAPABILITY in the initial user
    namespace.  Without it (a user dumping its own process): /proc/PID/fd/N of an fd the
    process holds on the same file, else the mapped path while it still names that file
    (same device and inode).  AccessDenied naming the capability when neither does (a
    deleted or replaced file only the mapping holds).  FileNotFoundError when there is
    no such mapping."""
    link = f"{procfs}/{pid}/map_files/{start:x}-{end:x}"
    try:
        os.stat(link)
        return link
    except PermissionError:
        pass
    except FileNotFoundError:
        if _process_gone(pid, procfs):
            raise
        raise FileNotFoundError(_errno.ENOENT, "no such mapping", link) from None

    def same(candidate: str) -> bool:
        try:
            st = os.stat(candidate)
        except OSError:
            return False
        return st.st_ino == inode and (os.major(st.st_dev), os.minor(st.st_dev)) == dev

    if path.startswith("/") and not path.endswith(" (deleted)") and same(path):
        return path
    fd_dir = f"{procfs}/{pid}/fd"
    for name in os.listdir(fd_dir):
        if same(f"{fd_dir}/{name}"):
            return f"{fd_dir}/{name}"
    raise AccessDenied(pid, "reach a mapped file of",
                       f"{path} mapped at {start:#x}-{end:#x} is reachable only through "
                       f"{link}, which needs {MAP_FILES_CAPABILITY}; run ptckpt as root or with "
                       f"that capability, or checkpoint while the process holds an fd on it")


def stat_map_file(pid: int, start: int, end: int, *, dev: tuple[int, int] = (0, 0), inode: int = 0,
                  path: str = "", procfs: str = "/proc") -> os.stat_result | None:
    """os.stat() of the file behind a VMA (through :func:`map_file_path`).  None when
    there is no such mapping (anonymous VMA, or bounds not of one VMA)."""
    try:
        where = map_file_path(pid, start, end, dev, inode, path, procfs=procfs)
    except ProcEntryMissing:
        return None
    try:
        return os.stat(where)
    except FileNotFoundError:
        if _process_gone(pid, procfs):
            raise NoSuchProcess(pid) from None
        return None
    except OSError as err:
        raise _translate(err, pid, None, procfs) from err


# --- pagemap and PAGEMAP_SCAN -----------------------------------------------

# /proc/PID/pagemap: one u64 per virtual page (Documentation/admin-guide/mm/pagemap.rst)
PM_PFN_MASK = (1 << 55) - 1
PM_SOFT_DIRTY = 1 << 55
PM_EXCLUSIVE = 1 << 56
PM_UFFD_WP = 1 << 57
PM_FILE = 1 << 61
PM_SWAP = 1 << 62
PM_PRESENT = 1 << 63


def decode_pagemap_entry(value: int) -> PagemapEntry:
    present = bool(value & PM_PRESENT)
    swapped = bool(value & PM_SWAP)
    low = value & PM_PFN_MASK
    return PagemapEntry(
        present=present,
        swapped=swapped,
        file_or_shared=bool(value & PM_FILE),
        exclusive=bool(value & PM_EXCLUSIVE),
        uffd_wp=bool(value & PM_UFFD_WP),
        soft_dirty=bool(value & PM_SOFT_DIRTY),
        pfn=low if present else 0,
        swap_type=low & 0x1F if swapped else 0,
        swap_offset=low >> 5 if swapped else 0,
    )


def pagemap_values(raw: bytes) -> memoryview:
    """The u64 entries of a read_pagemap() result, without copying."""
    return memoryview(raw).cast("Q")


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    chunks = []
    while size > 0:
        b = os.pread(fd, size, offset)
        if not b:
            break
        chunks.append(b)
        size -= len(b)
        offset += len(b)
    return b"".join(chunks)


def _check_range(start: int, end: int) -> tuple[int, int]:
    if start < 0 or end < start:
        raise ValueError(f"bad address range {start:#x}-{end:#x}")
    mask = PAGE_SIZE - 1
    return start & ~mask, (end + mask) & ~mask


def _check_short_pagemap(pid: int, procfs: str) -> None:
    """Raise if a short pagemap read means the process is gone.

    pagemap_read() returns 0 bytes once the mm is gone (exit, zombie), and
    stops at the end of the user address space (mm->task_size: [vsyscall]
    lies beyond it); only the latter is a normal short read.
    """
    err = _why_no_mm(pid, procfs)
    if err is not None:
        raise err


@_wrap_exceptions
def read_pagemap(pid: int, start: int, end: int, *, procfs: str = "/proc") -> bytes:
    """Raw /proc/PID/pagemap entries for [start, end): 8 bytes per page.

    Use pagemap_values() / decode_pagemap_entry() on the result.  PFNs read
    as 0 without CAP_SYS_ADMIN (since 4.0).  Pages past the end of the user
    address space (the kernel stops reading there) come back as zeros.
    """
    start, end = _check_range(start, end)
    path = f"{procfs}/{pid}/pagemap"
    want = ((end - start) >> PAGE_SHIFT) * 8
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = _pread_all(fd, want, (start >> PAGE_SHIFT) * 8)
    finally:
        os.close(fd)
    if len(data) != want:
        _check_short_pagemap(pid, procfs)
        data += bytes(want - len(data))     # past the user address space: absent
    return data


def _IOWR(typ: str, nr: int, size: int) -> int:
    # include/uapi/asm-generic/ioctl.h: dir(2) size(14) type(8) nr(8)
    return (3 << 30) | (size << 16) | (ord(typ) << 8) | nr


class _PmScanArg(ctypes.Structure):
    """struct pm_scan_arg, include/uapi/linux/fs.h (Linux 6.7)."""

    _fields_ = [
        ("size", ctypes.c_uint64),               # sizeof(struct pm_scan_arg)
        ("flags", ctypes.c_uint64),              # PM_SCAN_WP_MATCHING, PM_SCAN_CHECK_WPASYNC
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
        ("walk_end", ctypes.c_uint64),           # out: where the walk stopped
        ("vec", ctypes.c_uint64),                # struct page_region * (in OUR memory)
        ("vec_len", ctypes.c_uint64),
        ("max_pages", ctypes.c_uint64),          # 0 = no limit
        ("category_inverted", ctypes.c_uint64),  # categories that match when 0
        ("category_mask", ctypes.c_uint64),      # all of these must match
        ("category_anyof_mask", ctypes.c_uint64),  # at least one must match
        ("return_mask", ctypes.c_uint64),        # categories reported in page_region
    ]


# struct page_region { __u64 start, end, categories; } is read as 3 u64s.
PAGEMAP_SCAN = _IOWR("f", 16, ctypes.sizeof(_PmScanArg))   # 0xc0606610 on x86_64
assert ctypes.sizeof(_PmScanArg) == 96


def _probe_pagemap_scan() -> bool:
    """Whether this kernel answers PAGEMAP_SCAN (an empty scan of ourselves)."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        arg = _PmScanArg(size=ctypes.sizeof(_PmScanArg))
        fcntl.ioctl(fd, PAGEMAP_SCAN, arg)
        return True
    except OSError:     # ENOTTY before 6.7
        return False
    finally:
        os.close(fd)


HAS_PAGEMAP_SCAN = _probe_pagemap_scan()


@functools.cache
def zero_page_pfn() -> int | None:
    """PFN of the kernel's shared zero page, or None when PFNs are hidden.

    Found the way a process meets it: read (never write) a fresh private
    anonymous page and look at our own pagemap.  That PFN is static
    (empty_zero_page); the *huge* zero page is refcounted and may move, so
    the pagemap fallback does not try to recognise it.
    """
    m = mmap.mmap(-1, PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf = (ctypes.c_char * PAGE_SIZE).from_buffer(m)
        try:
            _ = buf[0]          # read fault: maps the zero page
            addr = ctypes.addressof(buf)
        finally:
            del buf
        fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            raw = os.pread(fd, 8, (addr >> PAGE_SHIFT) * 8)
        finally:
            os.close(fd)
    except OSError:
        return None
    finally:
        m.close()
    if len(raw) != 8:
        return None
    (value,) = struct.unpack("=Q", raw)
    pfn = value & PM_PFN_MASK
    if not value & PM_PRESENT or pfn == 0:
        return None
    return pfn


def _scan_masks(skip_zero: bool, skip_file: bool, return_mask: int) -> tuple[int, int, int, int]:
    """(category_inverted, category_mask, category_anyof_mask, return_mask)."""
    inverted = mask = 0
    if skip_zero:
        inverted |= PAGE_IS_PFNZERO
        mask |= PAGE_IS_PFNZERO
    if skip_file:
        inverted |= PAGE_IS_FILE
        mask |= PAGE_IS_FILE
    anyof = PAGE_IS_PRESENT | PAGE_IS_SWAPPED
    if return_mask & ~_PM_SCAN_CATEGORIES:
        raise ValueError(f"return_mask {return_mask:#x} has unknown PAGE_IS_* bits")
    return inverted, mask, anyof, return_mask


def _append_runs(runs: list[PageRun], new) -> None:
    """Extend runs with new ones, merging the first new run into the last old
    one when it continues it (a run cut at a chunk or buffer boundary)."""
    it = iter(new)
    first = next(it, None)
    if first is None:
        return
    if runs:
        last = runs[-1]
        if last.end == first.start and last.categories == first.categories:
            runs[-1] = PageRun(last.start, first.end, first.categories)
            runs.extend(it)
            return
    runs.append(first)
    runs.extend(it)


def _scan_ioctl(fd: int, start: int, end: int, masks: tuple[int, int, int, int],
                max_regions: int, pid: int, path: str, flags: int = 0) -> list[PageRun]:
    """Walk [start, end) with PAGEMAP_SCAN, looping while the buffer fills up.

    The kernel merges adjacent pages of equal (masked) categories into one
    page_region and stops, setting walk_end, when vec is full; runs cut at
    such a boundary are merged again here.  vec lives in our memory: the
    ioctl copies to the caller, it only walks the target's page tables.
    """
    inverted, mask, anyof, ret = masks
    # a region is at least one page: no need for more slots than pages
    max_regions = max(1, min(max_regions, (end - start) >> PAGE_SHIFT))
    vec = (ctypes.c_uint64 * (3 * max_regions))()
    view = memoryview(vec).cast("B").cast("Q")
    arg = _PmScanArg(
        size=ctypes.sizeof(_PmScanArg), flags=flags, vec=ctypes.addressof(vec), vec_len=max_regions,
        category_inverted=inverted, category_mask=mask,
        category_anyof_mask=anyof, return_mask=ret,
    )
    runs: list[PageRun] = []
    pos = start
    while pos < end:
        arg.start = pos
        arg.end = end
        arg.walk_end = 0
        try:
            n = fcntl.ioctl(fd, PAGEMAP_SCAN, arg)
        except OSError as err:     # name the file in the error
            raise OSError(err.errno, err.strerror, path) from err
        vals = view[: 3 * n].tolist()
        _append_runs(runs, map(PageRun._make, zip(vals[0::3], vals[1::3], vals[2::3])))
        # Kernel quirk (seen on 6.18): when vec fills up exactly with the
        # last pages of the range, walk_end points back at the start of the
        # kernel's last internal batch (<= 512 regions), although the regions
        # up to the end were all reported; resuming there would report them
        # twice.  The regions come in address order, so resume after the last.
        next_pos = max(arg.walk_end, vals[-2] if n else 0)
        if next_pos <= pos:
            raise ProcfsError(pid, path, f"PAGEMAP_SCAN made no progress at {pos:#x}")
        pos = next_pos
    return runs


# Fallback: categories from the top byte (bits 56-63) of each pagemap entry.
def _top_byte_category(b: int) -> int:
    present, swapped = b & 0x80, b & 0x40          # bits 63, 62
    c = 0 if b & 0x02 else PAGE_IS_WRITTEN          # bit 57 uffd-wp
    if present:
        c |= PAGE_IS_PRESENT
    elif swapped:
        c |= PAGE_IS_SWAPPED
    if (present or swapped) and b & 0x20:           # bit 61 file / shared anon
        c |= PAGE_IS_FILE
    return c


_TOP_TABLE = bytes(_top_byte_category(b) for b in range(256))
# bit 55 (soft-dirty) is bit 7 of byte 6 of the little-endian entry
_SD_TABLE = bytes(PAGE_IS_SOFT_DIRTY if b & 0x80 else 0 for b in range(256))
# 0xff ("this page maps the zero page") -> PAGE_IS_PFNZERO
_ZERO_FLAG_TABLE = bytes(PAGE_IS_PFNZERO if b else 0 for b in range(256))
# Run finder over the per-page output bytes; 0 = not reported.
_RUN_RE = re.compile(rb"([^\x00])\1*", re.DOTALL)
_FALLBACK_CHUNK_PAGES = 1 << 16     # 512 KiB of pagemap per pread


@functools.cache
def _filter_table(masks: tuple[int, int, int, int]) -> bytes:
    """Per-category byte -> output byte: 0 when the page is skipped, else its
    returned categories | 1 (the fallback never produces WPALLOWED (bit 0)
    or HUGE, so bit 0 is free to mark "reported")."""
    inverted, mask, anyof, ret = masks
    out = bytearray(256)
    for c in range(256):
        t = c ^ inverted
        if (t & mask) != mask or (anyof and not t & anyof):
            continue
        out[c] = (c & ret & ~PAGE_IS_WPALLOWED) | 1
    return bytes(out)


@functools.cache
def _zero_pfn_tables(zero_pfn: int) -> tuple[bytes, ...]:
    """For byte k (0-7) of a pagemap entry: a translate table giving 0xff
    where that byte agrees with "present, PFN == zero_pfn", else 0."""
    low = zero_pfn.to_bytes(8, "little")
    tables = []
    for k in range(8):
        if k < 6:
            ok = [b == low[k] for b in range(256)]
        elif k == 6:    # bits 48-54 of the PFN; bit 55 is soft-dirty
            ok = [(b & 0x7F) == low[6] for b in range(256)]
        else:           # bits 56-63: present (63); the PFN ends at bit 54
            ok = [bool(b & 0x80) for b in range(256)]
        tables.append(bytes(0xFF if x else 0 for x in ok))
    return tuple(tables)


def _or_bytes(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") | int.from_bytes(b, "little")).to_bytes(len(a), "little")


def _scan_pagemap_fd(fd: int, start: int, end: int, masks: tuple[int, int, int, int],
                     zero_pfn: int | None, pid: int, procfs: str, path: str) -> list[PageRun]:
    """The PAGEMAP_SCAN semantics computed from classic pagemap entries.

    Works in bulk, without a Python loop per page: slicing raw[k::8] picks
    byte k of every entry, bytes.translate maps it (the top byte to PAGE_IS_*
    bits; every byte, for the zero page, to "agrees with the zero page's
    PFN"), big-int AND/OR combine the columns, and a regex finds the runs.
    What it cannot know: WPALLOWED, HUGE (needs /proc/kpageflags), and the
    huge zero page (reported as data); a zero page is only recognised when
    PFNs are visible (root).
    """
    table = _filter_table(masks)
    want_sd = bool((masks[0] | masks[1] | masks[2] | masks[3]) & PAGE_IS_SOFT_DIRTY)
    zero_tables = _zero_pfn_tables(zero_pfn) if zero_pfn is not None else None
    runs: list[PageRun] = []
    page = start >> PAGE_SHIFT
    last_page = end >> PAGE_SHIFT
    while page < last_page:
        count = min(_FALLBACK_CHUNK_PAGES, last_page - page)
        raw = _pread_all(fd, count * 8, page * 8)
        if len(raw) != count * 8:
            _check_short_pagemap(pid, procfs)
            count = len(raw) // 8       # past the user address space: nothing there
            if not count:
                break
        cats = raw[7::8].translate(_TOP_TABLE)
        if want_sd:
            cats = _or_bytes(cats, raw[6::8].translate(_SD_TABLE))
        if zero_tables is not None:
            same = int.from_bytes(raw[7::8].translate(zero_tables[7]), "little")
            for k in range(7):
                if not same:
                    break
                same &= int.from_bytes(raw[k::8].translate(zero_tables[k]), "little")
            if same:
                cats = _or_bytes(cats, same.to_bytes(count, "little").translate(_ZERO_FLAG_TABLE))
        out = cats.translate(table)
        base = page << PAGE_SHIFT
        _append_runs(runs, [
            PageRun(base + (m.start() << PAGE_SHIFT), base + (m.end() << PAGE_SHIFT),
                    out[m.start()] & ~1)
            for m in _RUN_RE.finditer(out)])
        page += count
    return runs


@_wrap_exceptions
def scan_pages(pid: int, start: int, end: int, *,
               skip_zero: bool = True,
               skip_file: bool = False,
               return_mask: int = DEFAULT_RETURN_MASK,
               method: ScanMethod = ScanMethod.AUTO,
               max_regions: int = 16384,
               procfs: str = "/proc") -> list[PageRun]:
    """Runs of pages in [start, end) that hold data: present or swapped and,
    with ``skip_zero``, not the (huge) zero page.

    Each run carries its PAGE_IS_* categories masked by ``return_mask``
    (default PRESENT | SWAPPED | FILE), and adjacent pages share a run only
    when those agree.  FILE means "not an anonymous page": clean page cache
    of a file mapping, or shmem / MAP_SHARED|MAP_ANONYMOUS memory.  For a
    *private* file mapping only the non-FILE pages are the process's own
    (written, copied on write): pass ``skip_file=True`` or drop the FILE
    runs.  Careful with shared mappings: their pages are FILE, and pages
    never faulted in by this process (or swapped shmem pages, which leave
    no swap entry in the page table) are not reported at all.

    ``method``: PAGEMAP_SCAN ioctl (Linux 6.7+) with a buffer of
    ``max_regions`` page_regions, or parsing /proc/PID/pagemap (see
    _scan_pagemap_fd for what that cannot see).  AUTO uses the ioctl and
    falls back when the kernel (or the file: a fixture tree) refuses it.
    """
    start, end = _check_range(start, end)
    masks = _scan_masks(skip_zero, skip_file, return_mask)
    if not skip_zero:
        masks = masks[:3] + (masks[3] | PAGE_IS_PFNZERO,)
    path = f"{procfs}/{pid}/pagemap"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if start == end:
            return []
        if method is ScanMethod.IOCTL or (method is ScanMethod.AUTO and HAS_PAGEMAP_SCAN):
            try:
                return _scan_ioctl(fd, start, end, masks, max_regions, pid, path)
            except OSError as err:
                # ENOTTY: no PAGEMAP_SCAN (before 6.7, or not a procfs file);
                # EFAULT: the range goes past the user address space, e.g.
                # [vsyscall], which access_ok() refuses; the pagemap reader
                # reports such pages as absent.
                if err.errno == _errno.EFAULT or (
                        method is ScanMethod.AUTO and err.errno in (_errno.ENOTTY, _errno.EINVAL)):
                    pass
                else:
                    raise
        zero_pfn = zero_page_pfn() if skip_zero or masks[3] & PAGE_IS_PFNZERO else None
        return _scan_pagemap_fd(fd, start, end, masks, zero_pfn, pid, procfs, path)
    finally:
        os.close(fd)


PM_SCAN_WP_MATCHING = 1 << 0


@_wrap_exceptions
def scan_written(pid: int, start: int, end: int, *, protect: bool = False, only_written: bool = False,
                 procfs: str = "/proc") -> list[PageRun]:
    """Runs of pages in [start, end) written since they were write-protected (uffd-wp):
    present or swapped, without the uffd-wp bit.  A page of a mapping no userfaultfd
    write-protects never has the bit, so it always counts as written.

    ``protect``: write-protect every present or swapped page of the range instead
    (PM_SCAN_WP_MATCHING; the range must be registered for asynchronous uffd-wp,
    the kernel skips mappings that are not) and return them; with ``only_written``,
    only the written ones: they are reported and protected again in one atomic step.
    """
    start, end = _check_range(start, end)
    if start == end:
        return []
    anyof = PAGE_IS_PRESENT | PAGE_IS_SWAPPED
    masks = (0, 0, anyof, 0) if protect and not only_written else (0, PAGE_IS_WRITTEN, anyof, PAGE_IS_WRITTEN)
    path = f"{procfs}/{pid}/pagemap"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _scan_ioctl(fd, start, end, masks, 16384, pid, path,
                           flags=PM_SCAN_WP_MATCHING if protect else 0)
    finally:
        os.close(fd)


# --- stat and status --------------------------------------------------------

def _parse_stat(data: bytes) -> Stat:
    # "pid (comm) state ppid ...": comm is up to 15 bytes of anything, so
    # split at the FIRST '(' and the LAST ')' (fs/proc/array.c, do_task_stat).
    lpar = data.index(b"(")
    rpar = data.rindex(b")")
    pid = int(data[:lpar])
    comm = os.fsdecode(data[lpar + 1:rpar])
    rest = data[rpar + 1:].split()
    state = rest[0].decode("ascii")
    nums = [int(x) for x in rest[1:]]
    nfields = len(Stat._fields) - 3
    if len(nums) < nfields:
        nums += [0] * (nfields - len(nums))
    return Stat(pid, comm, state, *nums[:nfields])


@_wrap_exceptions
def read_stat(pid: int, tid: int | None = None, *, procfs: str = "/proc") -> Stat:
    """/proc/PID/stat, or /proc/PID/task/TID/stat when tid is given."""
    return _parse_stat(_read(_path(procfs, pid, tid, "stat")))


def _ints(text: str, base: int = 10) -> tuple[int, ...]:
    return tuple(int(x, base) for x in text.split())


def _unescape_name(text: str) -> str:
    # proc_task_name(..., escape=true) escapes only '\n' and '\\'
    # (seq_escape_str with ESCAPE_SPACE | ESCAPE_SPECIAL, "\n\\").
    if "\\" not in text:
        return text
    return re.sub(r"\\(n|\\)", lambda m: "\n" if m.group(1) == "n" else "\\", text)


_VM_KEYS = ("Vm", "Rss", "HugetlbPages")


@_wrap_exceptions
def read_status(pid: int, tid: int | None = None, *, procfs: str = "/proc") -> Status:
    """/proc/PID/status (or the thread's, with tid)."""
    raw: dict[str, str] = {}
    for line in _read_text(_path(procfs, pid, tid, "status")).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            raw[key] = value.strip()

    def num(key: str, default: int = 0) -> int:
        v = raw.get(key)
        return int(v) if v else default

    def hexnum(key: str) -> int:
        v = raw.get(key)
        return int(v, 16) if v else 0

    def four(key: str) -> tuple[int, int, int, int]:
        v = _ints(raw.get(key, ""))
        return tuple(v) if len(v) == 4 else (v + (0, 0, 0, 0))[:4]   # type: ignore[return-value]

    if "Kthread" in raw:
        kthread = raw["Kthread"] == "1"
    else:
        # before 6.x (Kthread: line) only PF_KTHREAD in stat field 9 tells
        kthread = read_stat(pid, tid, procfs=procfs).is_kthread
    sig_q = _ints(raw.get("SigQ", "0/0").replace("/", " "))
    vm = {}
    for key, value in raw.items():
        if key.startswith(_VM_KEYS) and value.endswith("kB"):
            vm[key] = int(value.split()[0])
    umask = raw.get("Umask")
    return Status(
        name=_unescape_name(raw.get("Name", "")),
        umask=int(umask, 8) if umask else None,
        state=raw.get("State", "?")[:1],
        tgid=num("Tgid"),
        ngid=num("Ngid"),
        pid=num("Pid"),
        ppid=num("PPid"),
        tracer_pid=num("TracerPid"),
        uids=four("Uid"),
        gids=four("Gid"),
        fd_size=num("FDSize"),
        groups=_ints(raw.get("Groups", "")),
        nstgid=_ints(raw.get("NStgid", "")),
        nspid=_ints(raw.get("NSpid", "")),
        nspgid=_ints(raw.get("NSpgid", "")),
        nssid=_ints(raw.get("NSsid", "")),
        kthread=kthread,
        threads=num("Threads"),
        sig_q=(sig_q[0], sig_q[1]) if len(sig_q) == 2 else (0, 0),
        sig_pnd=hexnum("SigPnd"),
        shd_pnd=hexnum("ShdPnd"),
        sig_blk=hexnum("SigBlk"),
        sig_ign=hexnum("SigIgn"),
        sig_cgt=hexnum("SigCgt"),
        cap_inh=hexnum("CapInh"),
        cap_prm=hexnum("CapPrm"),
        cap_eff=hexnum("CapEff"),
        cap_bnd=hexnum("CapBnd"),
        cap_amb=hexnum("CapAmb"),
        no_new_privs=raw.get("NoNewPrivs") == "1",
        seccomp=num("Seccomp"),
        seccomp_filters=num("Seccomp_filters"),
        core_dumping=raw.get("CoreDumping") == "1",
        cpus_allowed_list=raw.get("Cpus_allowed_list", ""),
        mems_allowed_list=raw.get("Mems_allowed_list", ""),
        voluntary_ctxt_switches=num("voluntary_ctxt_switches"),
        nonvoluntary_ctxt_switches=num("nonvoluntary_ctxt_switches"),
        vm=vm,
        raw=raw,
    )


# --- tasks and children -----------------------------------------------------

@_wrap_exceptions
def list_tids(pid: int, *, procfs: str = "/proc") -> list[int]:
    """Thread ids of the thread group of pid: pid (the leader) first, then sorted."""
    tids = sorted(int(name) for name in os.listdir(f"{procfs}/{pid}/task") if name.isdigit())
    if pid in tids:
        tids.remove(pid)
        tids.insert(0, pid)
    return tids


def children_or_none(pid: int) -> list[int]:
    """read_children, or [] for a process that is gone (or never was)."""
    try:
        return read_children(pid)
    except (PtckptError, OSError):
        return []


@_wrap_exceptions
def read_children(pid: int, *, procfs: str = "/proc") -> list[int]:
    """Children of every thread of pid, sorted (union of task/*/children).

    The children file (CONFIG_PROC_CHILDREN, 3.5+) is per thread: a child
    belongs to the thread that forked it.  A thread that exits while we read
    is skipped; a tree without the file raises ProcEntryMissing.
    """
    children: set[int] = set()
    for name in os.listdir(f"{procfs}/{pid}/task"):
        try:
            data = _read(f"{procfs}/{pid}/task/{name}/children")
        except (FileNotFoundError, ProcessLookupError):
            if os.path.isdir(f"{procfs}/{pid}/task/{name}"):
                raise
            continue
        children.update(int(x) for x in data.split())
    if not os.path.isdir(f"{procfs}/{pid}"):
        raise NoSuchProcess(pid)
    return sorted(children)


# --- small files ------------------------------------------------------------

_AUXV_PAIR = struct.Struct("=QQ")   # x86_64: two unsigned longs


@_wrap_exceptions
def read_auxv(pid: int, *, procfs: str = "/proc") -> list[AuxEntry]:
    """The ELF auxiliary vector the process was started with, without AT_NULL.

    64-bit layout only (a 32-bit tracee has 4-byte pairs).  Empty for kernel
    threads and for zombies.
    """
    data = _read(f"{procfs}/{pid}/auxv")
    out = []
    for a_type, a_val in _AUXV_PAIR.iter_unpack(data[: len(data) - len(data) % 16]):
        if a_type == 0:     # AT_NULL ends the vector
            break
        out.append(AuxEntry(a_type, a_val))
    return out


@_wrap_exceptions
def read_auxv_bytes(pid: int, *, procfs: str = "/proc") -> bytes:
    """/proc/PID/auxv as the kernel gives it, the AT_NULL pair included: what
    prctl(PR_SET_MM_MAP) takes back as the auxv of a process."""
    return _read(f"{procfs}/{pid}/auxv")


# fs/proc/base.c, lnames[]: the text of each line, indexed by RLIMIT_*.
RLIMIT_NAMES = (
    "Max cpu time",           # RLIMIT_CPU 0
    "Max file size",          # RLIMIT_FSIZE 1
    "Max data size",          # RLIMIT_DATA 2
    "Max stack size",         # RLIMIT_STACK 3
    "Max core file size",     # RLIMIT_CORE 4
    "Max resident set",       # RLIMIT_RSS 5
    "Max processes",          # RLIMIT_NPROC 6
    "Max open files",         # RLIMIT_NOFILE 7
    "Max locked memory",      # RLIMIT_MEMLOCK 8
    "Max address space",      # RLIMIT_AS 9
    "Max file locks",         # RLIMIT_LOCKS 10
    "Max pending signals",    # RLIMIT_SIGPENDING 11
    "Max msgqueue size",      # RLIMIT_MSGQUEUE 12
    "Max nice priority",      # RLIMIT_NICE 13
    "Max realtime priority",  # RLIMIT_RTPRIO 14
    "Max realtime timeout",   # RLIMIT_RTTIME 15
)
RLIM_INFINITY = _U64_MAX


def _rlim(text: str) -> int:
    return RLIM_INFINITY if text == "unlimited" else int(text)


@_wrap_exceptions
def read_limits(pid: int, *, procfs: str = "/proc") -> list[Rlimit]:
    """Resource limits from /proc/PID/limits, in RLIMIT_* order.

    Lines are "%-25s %-20s %-20s %-10s" (name, soft, hard, units); the names
    have spaces, so lines are matched against the known names.  Values are
    in the rlimit's own unit (seconds for CPU, microseconds for RTTIME).
    """
    out = []
    for line in _read_text(f"{procfs}/{pid}/limits").splitlines()[1:]:
        for resource, name in enumerate(RLIMIT_NAMES):
            if line.startswith(name + " "):
                soft, hard = line[len(name):].split()[:2]
                out.append(Rlimit(resource, _rlim(soft), _rlim(hard)))
                break
    out.sort()
    return out


# "key:\tvalue" where the key may contain spaces ("settime flags") but is
# followed by whitespace; lines like "inotify wd:1 ino:..." have no such
# colon and are keyed by their first word.
_FDINFO_KEY = re.compile(r"([A-Za-z0-9_][A-Za-z0-9_ -]*?):\s+(.*)")


def _fd_gone(err: FileNotFoundError, pid: int, fd: int, procfs: str) -> Exception:
    """FdGone if only the fd vanished, else what the choke point makes of err."""
    if _process_gone(pid, procfs) or _why_no_mm(pid, procfs) is not None:
        return err
    return FdGone(pid, fd, err.filename or f"{procfs}/{pid}/fd/{fd}")


@_wrap_exceptions
def read_fdinfo(pid: int, fd: int, *, procfs: str = "/proc") -> FdInfo:
    """/proc/PID/fdinfo/FD: pos, flags (octal), mnt_id, ino, and the rest raw.

    Raises FdGone if the fd was closed meanwhile.
    """
    pos = flags = mnt_id = 0
    ino = None
    extra: dict[str, list[str]] = {}
    try:
        text = _read_text(f"{procfs}/{pid}/fdinfo/{fd}")
    except FileNotFoundError as err:
        raise _fd_gone(err, pid, fd, procfs) from err
    for line in text.splitlines():
        if not line.strip():
            continue
        m = _FDINFO_KEY.match(line)
        if m:
            key, value = m.group(1), m.group(2).strip()
        else:
            key, _, value = line.strip().partition(" ")
            value = value.strip()
        if key == "pos":
            pos = int(value)
        elif key == "flags":
            flags = int(value, 8)
        elif key == "mnt_id":
            mnt_id = int(value)
        elif key == "ino":
            ino = int(value)
        else:
            extra.setdefault(key, []).append(value)
    return FdInfo(pos, flags, mnt_id, ino, extra)


@_wrap_exceptions
def read_fdinfo_text(pid: int, fd: int, *, procfs: str = "/proc") -> str:
    """/proc/PID/fdinfo/FD as the kernel prints it (what read_fdinfo parses), for checks
    that look at every line.  Raises FdGone if the fd was closed meanwhile."""
    try:
        return _read_text(f"{procfs}/{pid}/fdinfo/{fd}")
    except FileNotFoundError as err:
        raise _fd_gone(err, pid, fd, procfs) from err


@_wrap_exceptions
def list_fds(pid: int, *, procfs: str = "/proc") -> list[int]:
    """Open file descriptors of pid, sorted."""
    return sorted(int(name) for name in os.listdir(f"{procfs}/{pid}/fd") if name.isdigit())


@_wrap_exceptions
def readlink_fd(pid: int, fd: int, *, procfs: str = "/proc") -> str:
    """The target of /proc/PID/fd/FD: a path, or "pipe:[ino]", "socket:[ino]",
    "anon_inode:[eventfd]" ...; a deleted file ends in " (deleted)".
    Raises FdGone if the fd was closed meanwhile."""
    try:
        return os.readlink(f"{procfs}/{pid}/fd/{fd}")
    except FileNotFoundError as err:
        raise _fd_gone(err, pid, fd, procfs) from err


@_wrap_exceptions
def socket_fds(pid: int, *, procfs: str = "/proc") -> dict[int, int]:
    """{inode: fd} of the sockets pid holds (its /proc/PID/fd links "socket:[INO]"), the
    lowest fd of each; an fd closed meanwhile is skipped.  One readlink per fd, nothing
    opened: cheap enough for a frozen tree's critical path."""
    out: dict[int, int] = {}
    for fd in list_fds(pid, procfs=procfs):
        try:
            link = os.readlink(f"{procfs}/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if link.startswith("socket:["):
            out.setdefault(int(link[8:-1]), fd)
    return out


def _split_nul(data: bytes) -> list[str]:
    if data.endswith(b"\0"):
        data = data[:-1]
    if not data:
        return []
    return [os.fsdecode(x) for x in data.split(b"\0")]


@_wrap_exceptions
def read_cmdline(pid: int, *, procfs: str = "/proc") -> list[str]:
    """argv as the process now shows it (NUL separated); [] for kernel threads."""
    return _split_nul(_read(f"{procfs}/{pid}/cmdline"))


@_wrap_exceptions
def read_environ(pid: int, *, procfs: str = "/proc") -> list[str]:
    """The initial environment block, as "KEY=VALUE" strings in order.

    A list, not a dict: entries need not contain '=' and keys may repeat.
    """
    return _split_nul(_read(f"{procfs}/{pid}/environ"))


@_wrap_exceptions
def read_comm(pid: int, tid: int | None = None, *, procfs: str = "/proc") -> str:
    """The task's comm (up to 15 bytes), from /proc/PID[/task/TID]/comm."""
    data = _read(_path(procfs, pid, tid, "comm"))
    return os.fsdecode(data[:-1] if data.endswith(b"\n") else data)


def comm_or_unknown(pid: int) -> str:
    """The comm of `pid` for a message, or "?" when it is gone or unreadable."""
    try:
        return read_comm(pid)
    except (PtckptError, OSError):
        return "?"


def ancestors(pid: int, *, procfs: str = "/proc") -> list[int]:
    """The parent, grandparent ... of `pid` up to its pid namespace's init (or 1); those
    that could not be read (gone meanwhile) end the list."""
    out: list[int] = []
    try:
        while pid > 1:
            pid = read_stat(pid, procfs=procfs).ppid
            if pid <= 0 or pid in out:
                break
            out.append(pid)
    except PtckptError:
        pass
    return out


@_wrap_exceptions
def read_exe(pid: int, *, procfs: str = "/proc") -> str:
    """The executable's path (" (deleted)" appended by the kernel if unlinked)."""
    return os.readlink(f"{procfs}/{pid}/exe")


@_wrap_exceptions
def read_exe_head(pid: int, size: int, *, procfs: str = "/proc") -> bytes:
    """The first `size` bytes of the program the process runs (its ELF header)."""
    with open(f"{procfs}/{pid}/exe", "rb") as f:
        return f.read(size)


@_wrap_exceptions
def read_cwd(pid: int, *, procfs: str = "/proc") -> str:
    return os.readlink(f"{procfs}/{pid}/cwd")


@_wrap_exceptions
def read_root(pid: int, *, procfs: str = "/proc") -> str:
    return os.readlink(f"{procfs}/{pid}/root")


@_wrap_exceptions
def read_oom_score_adj(pid: int, *, procfs: str = "/proc") -> int:
    return int(_read(f"{procfs}/{pid}/oom_score_adj"))


@_wrap_exceptions
def read_timerslack_ns(pid: int, *, procfs: str = "/proc") -> int:
    """The task's timer slack; per thread in the kernel, but the file exists
    only at /proc/PID (pass a tid as pid for another thread).  Reading needs
    PTRACE_MODE_ATTACH (4.6+)."""
    return int(_read(f"{procfs}/{pid}/timerslack_ns"))


@_wrap_exceptions
def read_personality(pid: int, *, procfs: str = "/proc") -> int:
    """personality(2) flags; the file holds them as 8 hex digits."""
    return int(_read(f"{procfs}/{pid}/personality"), 16)


@_wrap_exceptions
def read_syscall(pid: int, tid: int | None = None, *, procfs: str = "/proc") -> SyscallInfo:
    """The syscall a (stopped or blocked) thread is in.

    Formats (fs/proc/base.c, proc_pid_syscall): "running"; "-1 SP PC" when
    blocked outside a syscall; "NR A1 A2 A3 A4 A5 A6 SP PC" (NR decimal,
    the rest 0x-hex).  Needs PTRACE_MODE_ATTACH.
    """
    text = _read_text(_path(procfs, pid, tid, "syscall")).strip()
    if text == "running":
        return SyscallInfo(True, None, (), None, None)
    words = text.split()
    nr = int(words[0])
    vals = tuple(int(w, 16) for w in words[1:])
    return SyscallInfo(False, nr, vals[:-2], vals[-2], vals[-1])


@_wrap_exceptions
def read_wchan(pid: int, tid: int | None = None, *, procfs: str = "/proc") -> str:
    """Symbol name the task sleeps in, or "0" (also when hidden by kptr_restrict)."""
    return _read_text(_path(procfs, pid, tid, "wchan")).strip()


@_wrap_exceptions
def read_sessionid(pid: int, *, procfs: str = "/proc") -> int:
    """The audit session id; 4294967295 (AUDIT_SID_UNSET) when none."""
    return int(_read(f"{procfs}/{pid}/sessionid"))


def fd_holders(links: set[str], exclude: set[int], *, procfs: str = "/proc") -> dict[str, list[tuple[int, int]]]:
    """{link: [(pid, fd) ...]} for every process outside `exclude` with an fd whose
    /proc/PID/fd link is one of `links` ("pipe:[123]", "socket:[456]", a FIFO's path).

    Processes that exit or deny access during the scan are skipped.
    """
    out: dict[str, list[tuple[int, int]]] = {}
    if not links:
        return out
    for name in os.listdir(procfs):
        if not name.isdigit() or int(name) in exclude:
            continue
        pid = int(name)
        try:
            fds = os.listdir(f"{procfs}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"{procfs}/{pid}/fd/{fd}")
            except OSError:
                continue
            if link in links:
                out.setdefault(link, []).append((pid, int(fd)))
    return out


# --- fds, namespaces, mounts, timers of one process -----------------------------

@_wrap_exceptions
def stat_fd(pid: int, fd: int, *, procfs: str = "/proc") -> os.stat_result:
    """stat(2) of the open file /proc/PID/fd/FD leads to (the link followed): the file's
    dev, ino, mode, size ..., whatever its name now.  Raises FdGone if the fd was closed
    meanwhile."""
    try:
        return os.stat(f"{procfs}/{pid}/fd/{fd}")
    except FileNotFoundError as err:
        raise _fd_gone(err, pid, fd, procfs) from err


@_wrap_exceptions
def list_namespaces(pid: int, *, procfs: str = "/proc") -> list[str]:
    """The entries of /proc/PID/ns, sorted: one per kind of namespace the kernel has
    ("cgroup", "ipc", "mnt", "net", "pid", "pid_for_children", "time" ...)."""
    return sorted(os.listdir(f"{procfs}/{pid}/ns"))


@_wrap_exceptions
def stat_namespace(pid: int | str, name: str, *, procfs: str = "/proc") -> os.stat_result:
    """stat(2) of /proc/PID/ns/NAME: the nsfs inode of that namespace (st_dev, st_ino
    identify it; two processes share it when both are equal).  `pid` may be "self"."""
    return os.stat(f"{procfs}/{pid}/ns/{name}")


@_wrap_exceptions
def read_mountinfo(pid: int | str, *, procfs: str = "/proc") -> list[bytes]:
    """The lines of /proc/PID/mountinfo (man 5 proc: mount id, parent id, major:minor,
    root, mount point, options, optional fields, "-", fstype, source, super options),
    undecoded: paths are escaped (space, tab, newline, backslash as \\ooo) and need not be
    UTF-8.  `pid` may be "self"."""
    return _read(f"{procfs}/{pid}/mountinfo").splitlines()


def mount_fstypes(pid: int, *, procfs: str = "/proc") -> dict[int, str]:
    """mnt_id -> filesystem type of the mounts pid sees (mountinfo field 1 and the first
    after " - "); {} when mountinfo cannot be read."""
    out: dict[int, str] = {}
    try:
        lines = read_mountinfo(pid, procfs=procfs)
    except (PtckptError, OSError):
        return out
    for line in lines:
        left, _, right = line.partition(b" - ")
        out[int(left.split(b" ", 1)[0])] = os.fsdecode(right.split(b" ", 1)[0])
    return out


@_wrap_exceptions
def read_mounts(pid: int | str, *, procfs: str = "/proc") -> list[str]:
    """The lines of /proc/PID/mounts, in fstab(5) format (device, mount point, fstype,
    options, 0, 0; spaces in names as \\040), of the mounts pid sees.  `pid` may be "self"."""
    return _read_text(f"{procfs}/{pid}/mounts").splitlines()


@_wrap_exceptions
def read_id_map(pid: int | str, name: str, *, procfs: str = "/proc") -> list[tuple[int, int, int]]:
    """/proc/PID/uid_map or gid_map (NAME): (first id inside, first id outside, count) per
    line of the user namespace of pid (man 7 user_namespaces); the initial namespace shows
    (0, 0, 4294967295).  `pid` may be "self"."""
    out = []
    for line in _read_text(f"{procfs}/{pid}/{name}").splitlines():
        inside, outside, count = (int(x) for x in line.split())
        out.append((inside, outside, count))
    return out


def capable_in_initial_ns(cap: int) -> bool:
    """Whether ptckpt has capability `cap` (CAP_* number) effective in the initial user
    namespace: what an operation on the host itself (mknod of a device, TIOCSTI on another's
    tty) asks.  False where it cannot be told."""
    try:
        eff = read_status(os.getpid()).cap_eff
        initial = read_id_map("self", "uid_map") == [(0, 0, 4294967295)]
    except (OSError, PtckptError, ValueError):
        return False
    return initial and bool(eff >> cap & 1)


class Statm(NamedTuple):
    """/proc/PID/statm, in pages (man 5 proc)."""

    size: int
    resident: int
    shared: int


@_wrap_exceptions
def read_statm(pid: int, *, procfs: str = "/proc") -> Statm:
    size, resident, shared = (int(x) for x in _read(f"{procfs}/{pid}/statm").split()[:3])
    return Statm(size, resident, shared)


@_wrap_exceptions
def read_numa_maps(pid: int, *, procfs: str = "/proc") -> list[str]:
    """The lines of /proc/PID/numa_maps (fs/proc/task_mmu.c, show_numa_map): per VMA its
    start address, the memory policy ("default", "bind:0-1", "interleave:0-1" ...), then
    counters.  Only on kernels built with CONFIG_NUMA (else ProcEntryMissing)."""
    return _read_text(f"{procfs}/{pid}/numa_maps").splitlines()


@_wrap_exceptions
def read_attr_current(pid: int | str, *, procfs: str = "/proc") -> str:
    """The LSM label of the process, /proc/PID/attr/current (an AppArmor profile with its
    mode, a SELinux context ...), without the trailing NUL or newline some LSMs add."""
    return _read_text(f"{procfs}/{pid}/attr/current").strip("\0\n ")


@_wrap_exceptions
def read_net_table(pid: int | str, name: str, *, procfs: str = "/proc") -> list[str]:
    """The lines of /proc/PID/net/NAME ("icmp", "igmp", "udp" ...) of the network namespace
    of pid, the header line included (the tables print one; igmp's is a header too)."""
    return _read_text(f"{procfs}/{pid}/net/{name}").splitlines()


@_wrap_exceptions
def read_cgroup(pid: int | str, tid: int | None = None, *, procfs: str = "/proc") -> str:
    """/proc/PID/cgroup (or one thread's, /proc/PID/task/TID/cgroup) as printed:
    "hierarchy-id:controllers:path" per line (man 7 cgroups), "0::/path" for the v2 hierarchy."""
    return _read_text(f"{procfs}/{pid}/cgroup" if tid is None else f"{procfs}/{pid}/task/{tid}/cgroup")


@_wrap_exceptions
def read_text_file(pid: int, name: str, *, procfs: str = "/proc") -> str:
    """/proc/PID/NAME for a one-value file ("coredump_filter": hex; "loginuid", "sessionid",
    "oom_score_adj": decimal ...), without surrounding whitespace."""
    return _read_text(f"{procfs}/{pid}/{name}").strip()


@_wrap_exceptions
def read_timers(pid: int, *, procfs: str = "/proc") -> str:
    """/proc/PID/timers (fs/proc/base.c show_timer, CONFIG_CHECKPOINT_RESTORE), a block of
    four lines per POSIX timer::

        ID: 1
        signal: 14/0000000000000007
        notify: signal/tid.946
        ClockID: 0
    """
    return _read_text(f"{procfs}/{pid}/timers")


@_wrap_exceptions
def read_thread_children(pid: int, tid: int, *, procfs: str = "/proc") -> list[int]:
    """The children one thread forked, from /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN),
    in the order the kernel lists them (read_children unites those of every thread)."""
    return [int(x) for x in _read(f"{procfs}/{pid}/task/{tid}/children").split()]


# --- system-wide files ----------------------------------------------------------
# No process to name in an error: an OSError of these passes to the caller as it is.

def pid_exists(pid: int | str, *, procfs: str = "/proc") -> bool:
    """Whether /proc/PID exists: a process (or a thread, by its tid) of this pid namespace,
    a zombie included."""
    return os.path.exists(f"{procfs}/{pid}")


def list_pids(*, procfs: str = "/proc") -> list[int]:
    """Every pid /proc lists (the processes of procfs's pid namespace), in directory order."""
    return [int(name) for name in os.listdir(procfs) if name.isdigit()]


def read_sysctl(name: str, *, procfs: str = "/proc") -> str:
    """/proc/sys/NAME ("kernel/pid_max", "net/ipv4/ip_forward" ...) without surrounding
    whitespace.  Those of a namespace (net/, kernel/msg* ...) are the calling thread's."""
    with open(f"{procfs}/sys/{name}") as f:
        return f.read().strip()


def read_cpu_flags(*, procfs: str = "/proc") -> set[str]:
    """The "flags" line of /proc/cpuinfo (that of the first CPU) as a set, empty if none."""
    with open(f"{procfs}/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def read_vmstat(*, procfs: str = "/proc") -> dict[str, int]:
    """/proc/vmstat: counter name -> value ("oom_kill" since 4.13, "pgfault" ...)."""
    out = {}
    with open(f"{procfs}/vmstat") as f:
        for line in f:
            key, _, value = line.partition(" ")
            out[key] = int(value)
    return out


def read_locks(*, procfs: str = "/proc") -> list[str]:
    """The lines of /proc/locks (fs/locks.c, lock_get_status): "N: POSIX  ADVISORY  WRITE
    PID MAJ:MIN:INODE START END", "->" lines for the waiters, of every lock the kernel
    holds in this pid namespace's view."""
    with open(f"{procfs}/locks") as f:
        return f.read().splitlines()


def read_kernel_cmdline(*, procfs: str = "/proc") -> list[str]:
    """The words of /proc/cmdline, the kernel's boot parameters."""
    with open(f"{procfs}/cmdline") as f:
        return f.read().split()


def read_sysvipc(kind: str, *, procfs: str = "/proc") -> str:
    """/proc/sysvipc/KIND ("shm", "sem", "msg": ipc/util.c sysvipc_proc_show): a header
    line naming the columns, then one line of numbers per object of the caller's IPC
    namespace (perms in octal, the rest decimal)."""
    with open(f"{procfs}/sysvipc/{kind}") as f:
        return f.read()


# --- who else touches /proc, and why --------------------------------------------
# This module is the one that knows /proc's formats: every other module reads /proc
# through the functions above.  What others still name a /proc path for is not a read of
# a /proc file's format: they write a tunable, reopen a file through its link, hand a
# path to a tracee, or read a file's own contents through /proc.  Each such place, by
# (module, function), with its reason; tests/test_layout.py fails on any other.

ELSEWHERE: dict[tuple[str, str], str] = {
    # writes: /proc files that are knobs, not reports
    ("ptckpt.netns", "_write_sysctls"): "writes the net sysctls a new network namespace inherits",
    ("ptckpt.resources.pids", "_enter_own_user_namespace"): "writes setgroups, uid_map, gid_map of ptckpt's "
                                                            "new user namespace",
    ("ptckpt.resources.process", "restore_task_frozen"): "writes a restored process's oom_score_adj, "
                                                         "timerslack_ns ..., coredump_filter",
    ("ptckpt.resources.process", "expendable"): "writes oom_score_adj of a process being made",
    ("ptckpt.resources.sysvipc", "IpcKind.next_id_path"): "the *_next_id sysctl written to choose an id, "
                                                          "named in messages",
    ("ptckpt.resources.vdso", "own_text"): "reads ptckpt's own vdso through /proc/self/mem (memory, not a report)",
    ("ptckpt.tracee", "AddressSpace.__init__"): "/proc/PID/mem: the tracee's memory, read and written",
    # a file opened again through its /proc link (the file's data, not /proc's)
    ("ptckpt.appblock", "locate"): "opens the program through /proc/PID/exe to look for a symbol",
    ("ptckpt.resources.files", "dump_fd"): "hashes the head of an O_APPEND file through its fd link",
    ("ptckpt.resources.files", "dump_ghost_files"): "copies a deleted file through its fd, cwd or root link",
    ("ptckpt.resources.files", "_open_linked"): "a /proc/PID/fd path a restore opens a file again by",
    ("ptckpt.resources.inotify", "make"): "adds watches through a placeholder's /proc/self/fd path",
    ("ptckpt.resources.locks", "_break_lease"): "opens the leased file through its fd link to break the lease",
    ("ptckpt.resources.memfd", "make"): "opens a memfd again with the image's access mode",
    ("ptckpt.resources.memfd", "reopen_memfd"): "opens a memfd again with another access mode",
    ("ptckpt.resources.memory", "_new_object"): "opens a mapped object again through /proc/self/map_files",
    ("ptckpt.resources.memory", "fill_pages_in_target"): "the pages file by a path the tracee can open",
    ("ptckpt.resources.memory", "fill_pages"): "opens the pages file again (its own file description)",
    ("ptckpt.resources.mqueue", "dump"): "opens a message queue again to read it without moving its fd",
    ("ptckpt.resources.mqueue", "_reopen_queue"): "opens a queue again whose name is gone",
    ("ptckpt.resources.nsfs", "_with_id"): "opens an nsfs fd's file for NS_GET_ID",
    ("ptckpt.resources.nsfs", "reopen_path"): "the path a restored process opens its own namespace by",
    ("ptckpt.resources.nsfs", "_enter_and_open"): "opens the calling thread's namespace after setns",
    ("ptckpt.resources.pipes", "dump_pipes"): "opens a pipe through its fd link to read its buffer",
    ("ptckpt.resources.pipes", "_create_one"): "opens a pipe end again by its /proc/self/fd path",
    ("ptckpt.resources.process", "restore_root_frozen"): "a made-again root directory, by a path for chroot",
    ("ptckpt.resources.process", "_set_loginuid"): "the path the tracee opens to write its own loginuid",
    ("ptckpt.resources.sockets", "_socket_file"): "a socket's relative bound path, seen from its cwd",
    ("ptckpt.restore", "open_pages"): "opens the pages file again with O_DIRECT",
    ("ptckpt.restore", "at_restored_pids.moved"): "rewrites an image's /proc/PID paths to the new pid",
    ("ptckpt.symbols", "_open_mapped"): "opens a mapped file through map_files to read its ELF symbols "
                                        "(errors as this module's)",
    ("ptckpt.symbols", "_open_by_path"): "opens a mapped file through /proc/PID/root when map_files is denied",
    ("ptckpt.netns", "_proc_ns_path"): "the nsfs file setns(2) enters and current_netns_id stats, under "
                                       "netns's own error translation",
    # reads left in modules other work is changing now (32-bit support, the tracee layer):
    # each has a reader here (read_stat, read_status, list_tids, read_pagemap)
    ("ptckpt.resources.memory", "_pagemap"): "guard pages from pagemap (memory.py is being reworked)",
    ("ptckpt.tracee", "_alive"): "a thread's state from stat (tracee.py is being reworked)",
    ("ptckpt.tracee", "_shadow_stack"): "x86_Thread_features of a thread's status (tracee.py is being reworked)",
    ("ptckpt.tracee", "Session.freeze_process"): "the tids of task/ (tracee.py is being reworked)",
    ("ptckpt.tracee", "_parent_of"): "the ppid from stat (tracee.py is being reworked)",
}
