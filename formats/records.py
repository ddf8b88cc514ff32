"""Binary layout of the image records: one construct Struct per record.

Grammar (every integer little-endian)::

    file    := header entry*                     (PAGES files: header, zero padding, page data)
    header  := magic    b"PTCK"
               file_kind u16                     FileKind: INVENTORY=1 CORE=2 PAGEMAP=3 PAGES=4
               version   u16                     FORMAT_VERSION of the writer
               payload_length u64                bytes after the header (PAGES: after the padding)
               crc32     u32                     zlib.crc32 of the payload
               reserved  u32                     0
                                                 = 24 bytes; a PAGES header is zero-padded to
                                                 PAGES_DATA_OFFSET (4096) so page data is page-aligned
    entry   := kind     u16                      EntryKind, unique across all file kinds
               reserved u16                      0
               length   u32
               payload  [length]                 the record Struct of `kind`
    string  := VarInt n, n bytes                 UTF-8; kernel-supplied text (paths, comm, argv ...)
                                                 with surrogateescape, so any bytes round-trip
    array   := VarInt count, count items
    bool    := u8 (0 or 1)

    INVENTORY file := INVENTORY PLUGIN* ZOMBIE* PIPE* UNIX_SOCKET* SYSV_SHM* SYSV_SEM* SYSV_MSG* GHOST_FILE*
                      SAVED_FILE* EVENTFD* TIMERFD* SIGNALFD* INOTIFY* MEMFD* MQUEUE*
                      EPOLL* TERMINAL* INET_SOCKET* NETLINK_SOCKET* IN_FLIGHT_FD* FANOTIFY* PTY*
                      PIDFD*
                                                 (the image-wide records follow the INVENTORY)
    CORE file      := TASK CREDS MM RLIMIT* VMA* THREAD* SIGACTION* PENDING_SIGNAL* FD* FILE_LOCK*
                      POSIX_TIMER* ITIMER* FD_OWNER* AIO_RING*
    PAGEMAP file   := PAGE_RUN* PAGE_SUMS PAGE_PARENT* PAGE_FRAMES? PAGE_SERVER?
                                                 (PAGE_SUMS from format 10, PAGE_PARENT and
                                                 PAGE_FRAMES from 12, PAGE_SERVER from 16;
                                                 PAGE_SUMS hash the data as stored)
    PAGES file     := (no entries: the payload is the page data)

Evolution rules:

* New entry kinds, like new fields, come with a FORMAT_VERSION bump.  A reader refuses an
  image of a newer version, so an entry of a kind it does not know in an image it reads is
  damage: :func:`decode_entries` returns it as a :class:`RawEntry`, and the image reader
  refuses it (skipping it would lose what it held).
* A reader ignores payload bytes beyond the fields it knows.  New fields are only
  ever appended to a record, declared with :func:`Since` (parsed only from images of
  that version or newer, older images leave the dataclass default), and come with a
  FORMAT_VERSION bump.  Fields are never removed, reordered or renumbered, and
  neither are enum values.
* Unknown enum values (VmaKind, FdKind, Restart ...) parse to plain ints and build
  back unchanged.

The records themselves are the frozen dataclasses of :mod:`ptckpt.formats.model`;
each ``*Record`` below is an Adapter, so ``TaskRecord.parse(b) -> Task`` and
``TaskRecord.build(task) -> bytes``.  :func:`encode_entry` / :func:`decode_entries`
add and strip the entry framing.  Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

from construct import (
    Adapter,
    Array,
    Bytes,
    Const,
    ConstructError,
    Default,
    Flag,
    GreedyBytes,
    If,
    Int8ul,
    Int16ul,
    Int32sl,
    Int32ul,
    Int64sl,
    Int64ul,
    PascalString,
    Prefixed,
    PrefixedArray,
    Sequence as CSequence,
    Struct,
    Switch,
    VarInt,
    this,
)

from ptckpt.formats.model import (
    GP_REG_NAMES,
    AioRing,
    FanotifyMark,
    FanotifyState,
    EpollState,
    EpollTarget,
    EventfdState,
    InotifyState,
    InotifyWatch,
    MemfdState,
    MqueueState,
    PidfdState,
    SignalfdState,
    Terminal,
    TimerfdState,
    PAGE_SIZE,
    Creds,
    Fd,
    FdOwner,
    FdKind,
    GhostFile,
    HeldLock,
    InetSocket,
    InFlightFd,
    Itimer,
    NetlinkSocket,
    InetMode,
    Inventory,
    Mm,
    MsgImage,
    PageRun,
    PageSums,
    ParentPages,
    PageFrames,
    PageServerPages,
    PendingSignal,
    PosixTimer,
    Pty,
    Restart,
    PipeBuffer,
    PluginData,
    Rlimit,
    SavedFile,
    SemImage,
    ShmImage,
    Sigaction,
    Task,
    Thread,
    UnixSocket,
    Vma,
    VmaKind,
    Zombie,
)

MAGIC = b"PTCK"
FORMAT_VERSION = 17                # 2: trees (desc, zombies, pipes, unix sockets, pdeath)
                                   # 3: files (build-ids, skipped fds, saved files)
                                   # 4: plugins (PLUGIN records, external fds)
                                   # 5: pid namespaces (virtual pids, the real ones beside)
                                   # 6: network sockets (INET_SOCKET, NETLINK_SOCKET, the lock)
                                   # 7: timers (POSIX_TIMER, ITIMER)
                                   # 8: kernel-state breadth (caps, prctl, VMA flags, deleted
                                   #    paths, in-flight fds, notification fds, terminals)
                                   # 9: senders' credentials queued in unix sockets
                                   # 10: page data hashed by block (PAGE_SUMS in the pagemap)
                                   # 11: files open for appending hashed up to their size
                                   # 12: incremental images (parent, PAGE_PARENT), compressed
                                   #     page data (PAGE_FRAMES), image ids, pre-dumps
                                   # 13: membarrier registrations, the signal of a group stop
                                   # 14: pidfds (PIDFD); ptys: typed input not read yet, hung-up slaves
                                   # 15: 32-bit (ia32) threads' TLS entries (THREAD tls)
                                   # 16: page data on a page server (PAGE_SERVER in the pagemap)
                                   # 17: a pty slave's owner and mode (PTY slave_uid/gid/mode); deleted
                                   #     device nodes, FIFOs, sockets, symlinks (GHOST_FILE rdev, target);
                                   #     a relative unix socket name's directory (UNIX_SOCKET name_dir);
                                   #     cgroups: the directories a process needs (TASK
                                   #     cgroup_dirs), a thread's own (THREAD cgroups);
                                   #     a thread's own credentials (THREAD creds)
HEADER_SIZE = 24
PAGES_DATA_OFFSET = PAGE_SIZE      # page data starts here in a PAGES file
ENTRY_HEADER_SIZE = 8
SIGINFO_SIZE = 128                 # sizeof(siginfo_t) on every Linux arch


class FileKind(enum.IntEnum):
    INVENTORY = 1
    CORE = 2
    PAGEMAP = 3
    PAGES = 4


class EntryKind(enum.IntEnum):
    """Entry kinds; the numbers are unique across all file kinds and never reused.

    Gaps are deliberate: 21-29 for more per-process
    records, 30 and up for more image-wide ones.
    """

    INVENTORY = 1
    PLUGIN = 2
    ZOMBIE = 3
    PIPE = 4
    UNIX_SOCKET = 5
    SYSV_SHM = 6
    SYSV_SEM = 7
    SYSV_MSG = 8
    GHOST_FILE = 9
    SAVED_FILE = 30
    EVENTFD = 31
    TIMERFD = 32
    SIGNALFD = 33
    INOTIFY = 34
    MEMFD = 35
    MQUEUE = 36
    EPOLL = 37
    TERMINAL = 38
    INET_SOCKET = 39
    NETLINK_SOCKET = 40
    FANOTIFY = 45
    IN_FLIGHT_FD = 49
    PTY = 53
    PIDFD = 54
    TASK = 10
    CREDS = 11
    MM = 12
    RLIMIT = 13
    VMA = 14
    THREAD = 15
    SIGACTION = 16
    PENDING_SIGNAL = 17
    FD = 18
    FILE_LOCK = 19
    PAGE_RUN = 20
    PAGE_SUMS = 23
    PAGE_PARENT = 24
    PAGE_FRAMES = 25
    PAGE_SERVER = 27
    POSIX_TIMER = 21
    ITIMER = 22
    FD_OWNER = 26
    AIO_RING = 28


class EntryDecodeError(ValueError):
    """An entry could not be decoded; :mod:`~ptckpt.formats.image` turns it into CorruptImage."""

    def __init__(self, offset: int, kind: int | None, reason: str):
        what = _kind_name(kind) + " entry" if kind is not None else "entry"
        super().__init__(f"{what} at payload offset {offset}: {reason}")
        self.offset = offset
        self.kind = kind
        self.reason = reason


@dataclass(frozen=True)
class RawEntry:
    """An entry of a kind this version does not know, kept verbatim."""

    kind: int
    payload: bytes


@dataclass(frozen=True)
class FileHeader:
    file_kind: FileKind | int
    version: int
    payload_length: int
    crc32: int


# --- building blocks ---------------------------------------------------------

class IntEnumOf(Adapter):
    """An integer field holding `enum_cls`; values the enum lacks stay plain ints."""

    def __init__(self, subcon, enum_cls: type[enum.IntEnum]):
        super().__init__(subcon)
        self.enum_cls = enum_cls

    def _decode(self, obj, context, path):
        try:
            return self.enum_cls(obj)
        except ValueError:
            return obj

    def _encode(self, obj, context, path):
        return int(obj)


class KernelText(Adapter):
    """str <-> UTF-8 bytes with surrogateescape, i.e. os.fsencode/os.fsdecode in UTF-8 mode.

    Used for everything the kernel hands over as raw bytes (paths, comm, argv,
    hostname ...), so a name that is not valid UTF-8 survives the round trip.
    The codec is spelled out instead of calling os.fsencode so an image does not
    depend on the locale of the machine that wrote or reads it.
    """

    def _decode(self, obj, context, path):
        return obj.decode("utf-8", "surrogateescape")

    def _encode(self, obj, context, path):
        return obj.encode("utf-8", "surrogateescape")


def _to_tuples(value):
    if isinstance(value, list):          # construct's ListContainer is a list
        return tuple(_to_tuples(v) for v in value)
    return value


class Record(Adapter):
    """Maps a Struct whose field names match `cls`'s fields to the frozen dataclass and back.

    Arrays become tuples; a field the image predates (a :func:`Since` field that
    parsed to None) takes the dataclass default.
    """

    def __init__(self, cls: type, subcon):
        super().__init__(subcon)
        self.cls = cls
        self.field_names = tuple(f.name for f in dataclasses.fields(cls))
        struct_names = tuple(sc.name for sc in subcon.subcons if sc.name)
        if set(struct_names) != set(self.field_names):
            raise TypeError(f"{cls.__name__}: Struct fields {struct_names} != dataclass fields {self.field_names}")

    def _decode(self, obj, context, path):
        values = {}
        for name in self.field_names:
            value = obj[name]
            if value is not None:
                values[name] = _to_tuples(value)
        return self.cls(**values)

    def _encode(self, obj, context, path):
        if not isinstance(obj, self.cls):
            raise TypeError(f"expected {self.cls.__name__}, got {type(obj).__name__}")
        return {name: getattr(obj, name) for name in self.field_names}


def Since(version: int, subcon):
    """A field appended in format `version`: parsed only from images of that version or newer.

    Usage, when a field is appended::  ``"new_field" / Since(2, Int64ul)``
    together with a default on the dataclass field and FORMAT_VERSION = 2.
    The ``version`` parse/build parameter (default FORMAT_VERSION) selects the
    layout; image files pass their header's version when parsing.
    """
    return If(lambda ctx: ctx._params.get("version", FORMAT_VERSION) >= version, subcon)


Utf8 = PascalString(VarInt, "utf8")                  # text ptckpt itself produces
Text = KernelText(Prefixed(VarInt, GreedyBytes))     # text from the kernel: any bytes
Blob = Prefixed(VarInt, GreedyBytes)


# --- INVENTORY ---------------------------------------------------------------
# uname(2) release/machine/nodename, sysconf(_SC_PAGESIZE), XCR0 via xgetbv /
# CPUID leaf 0xd (arch/x86/include/asm/fpu/xstate.h), the NT_X86_XSTATE regset
# size, clock_gettime(CLOCK_REALTIME/MONOTONIC/BOOTTIME) at freeze time.
InventoryRecord = Record(Inventory, Struct(
    "ptckpt_version" / Utf8,
    "kernel_release" / Text,
    "arch" / Utf8,
    "page_size" / Int32ul,
    "xfeatures" / Int64ul,
    "xstate_size" / Int32ul,
    "root_pid" / Int32ul,
    "pids" / PrefixedArray(VarInt, Int32ul),
    "realtime_ns" / Int64sl,          # struct timespec: signed
    "monotonic_ns" / Int64sl,
    "boottime_ns" / Int64sl,
    "hostname" / Text,
    "fd_kinds_unsupported" / PrefixedArray(VarInt, Text),
    "pid_level" / Since(5, VarInt),
    "real_pids" / Since(5, PrefixedArray(VarInt, CSequence(Int32ul, Int32ul))),
    "netlock" / Since(6, Utf8),
    "image_id" / Since(12, Utf8),
    "parent" / Since(12, Text),
    "parent_id" / Since(12, Utf8),
    "memory_only" / Since(12, Flag),
))

# --- TASK --------------------------------------------------------------------
# man 5 proc: /proc/PID/stat (pid, comm, state, ppid, pgrp, session, nice (19),
# rt_priority (40), policy (41), exit_signal (38)), /proc/PID/status (Umask,
# Tgid, threads from /proc/PID/task), /proc/PID/{exe,cwd,root} links,
# /proc/PID/cmdline, /proc/PID/personality, /proc/PID/oom_score_adj,
# /proc/PID/timerslack_ns; dumpable from prctl(PR_GET_DUMPABLE).
TaskRecord = Record(Task, Struct(
    "pid" / Int32ul,
    "ppid" / Int32ul,
    "pgid" / Int32ul,
    "sid" / Int32ul,
    "comm" / Text,
    "state" / Utf8,
    "exe" / Text,
    "cwd" / Text,
    "root" / Text,
    "umask" / Int32ul,
    "personality" / Int32ul,
    "nice" / Int32sl,
    "sched_policy" / Int32ul,         # may carry SCHED_RESET_ON_FORK (0x40000000)
    "rt_priority" / Int32ul,
    "oom_score_adj" / Int32sl,
    "timerslack_ns" / Int64ul,
    "exit_signal" / Int32sl,
    "tids" / PrefixedArray(VarInt, Int32ul),
    "cmdline" / PrefixedArray(VarInt, Text),
    "dumpable" / Int32ul,
    "pdeath_signal" / Since(2, Int32ul),      # prctl(PR_GET_PDEATHSIG)
    "child_subreaper" / Since(2, Flag),       # prctl(PR_GET_CHILD_SUBREAPER)
    "thp_disable" / Since(8, Flag),           # prctl(PR_GET_THP_DISABLE)
    "mdwe" / Since(8, Int32ul),               # prctl(PR_GET_MDWE): PR_MDWE_* flags
    "memory_merge" / Since(8, Flag),          # prctl(PR_GET_MEMORY_MERGE): KSM for all memory
    "spec_ctrl" / Since(8, PrefixedArray(VarInt, Int32ul)),   # PR_GET_SPECULATION_CTRL per PR_SPEC_*
    "shares_files" / Since(8, Flag),          # kcmp(KCMP_FILES) with its parent: CLONE_FILES
    "shares_fs" / Since(8, Flag),             # kcmp(KCMP_FS) with its parent: CLONE_FS
    "cgroups" / Since(8, Text),               # /proc/PID/cgroup
    "coredump_filter" / Since(8, Int32sl),    # /proc/PID/coredump_filter (core(5))
    "loginuid" / Since(8, Int32ul),           # /proc/PID/loginuid
    "stop_signal" / Since(13, Int32ul),       # the group stop's signal (PTRACE_EVENT_STOP status)
    "cgroup_dirs" / Since(17, Text),          # its cgroup directories, one tab-separated line each
))

# --- CREDS -------------------------------------------------------------------
# man 5 proc: /proc/PID/status Uid:/Gid: (real, effective, saved, fs), Groups:,
# CapInh/CapPrm/CapEff/CapBnd/CapAmb (include/linux/capability.h), NoNewPrivs,
# Seccomp (SECCOMP_MODE_*).
CredsRecord = Record(Creds, Struct(
    "uids" / Array(4, Int32ul),
    "gids" / Array(4, Int32ul),
    "groups" / PrefixedArray(VarInt, Int32ul),
    "cap_inh" / Int64ul,
    "cap_prm" / Int64ul,
    "cap_eff" / Int64ul,
    "cap_bnd" / Int64ul,
    "cap_amb" / Int64ul,
    "no_new_privs" / Int32ul,
    "seccomp" / Int32ul,
    "securebits" / Since(8, Int32ul),         # prctl(PR_GET_SECUREBITS)
    "seccomp_filters" / Since(8, PrefixedArray(VarInt, Blob)),   # struct sock_filter[] each
    "seccomp_flags" / Since(8, PrefixedArray(VarInt, Int32ul)),
))

# --- MM ----------------------------------------------------------------------
# struct mm_struct (include/linux/mm_types.h) as man 5 proc /proc/PID/stat
# fields 26-28 (startcode, endcode, startstack) and 45-51 (start_data ..
# env_end), start_brk/brk from prctl(PR_SET_MM_MAP) semantics, /proc/PID/auxv
# (Elf64_auxv_t pairs, include/uapi/linux/auxvec.h), exe_file: /proc/PID/exe;
# mm->membarrier_state as membarrier(2) MEMBARRIER_CMD_GET_REGISTRATIONS reports it
# (enum membarrier_cmd, include/uapi/linux/membarrier.h).
MmRecord = Record(Mm, Struct(
    "start_code" / Int64ul,
    "end_code" / Int64ul,
    "start_data" / Int64ul,
    "end_data" / Int64ul,
    "start_brk" / Int64ul,
    "brk" / Int64ul,
    "start_stack" / Int64ul,
    "arg_start" / Int64ul,
    "arg_end" / Int64ul,
    "env_start" / Int64ul,
    "env_end" / Int64ul,
    "exe_file" / Text,
    "auxv" / PrefixedArray(VarInt, CSequence(Int64ul, Int64ul)),
    "membarrier" / Since(13, Int32ul),        # membarrier(MEMBARRIER_CMD_GET_REGISTRATIONS)
))

# --- RLIMIT ------------------------------------------------------------------
# prlimit(2) struct rlimit64 (include/uapi/linux/resource.h); man 5 proc
# /proc/PID/limits.  RLIM_INFINITY = 2**64-1.
RlimitRecord = Record(Rlimit, Struct(
    "resource" / Int32ul,
    "cur" / Int64ul,
    "max" / Int64ul,
))

# --- VMA ---------------------------------------------------------------------
# man 5 proc: /proc/PID/maps (address, perms, offset, dev, inode, pathname) and
# /proc/PID/smaps VmFlags; struct vm_area_struct (include/linux/mm_types.h);
# file_size/file_mtime_ns from stat(2) of /proc/PID/map_files/START-END.
VmaRecord = Record(Vma, Struct(
    "start" / Int64ul,
    "end" / Int64ul,
    "prot" / Int32ul,
    "shared" / Flag,
    "kind" / IntEnumOf(Int16ul, VmaKind),
    "pgoff" / Int64ul,
    "dev_major" / Int32ul,
    "dev_minor" / Int32ul,
    "inode" / Int64ul,
    "path" / Text,
    "vmflags" / Utf8,
    "file_size" / Int64ul,
    "file_mtime_ns" / Int64sl,
    "file_deleted" / Flag,
    "build_id" / Since(3, Utf8),      # NT_GNU_BUILD_ID of the mapped ELF file (elf(5)), hex
    "guards" / Since(8, PrefixedArray(VarInt, Array(2, Int64ul))),   # guard regions in it
    "cow" / Since(8, PrefixedArray(VarInt, Array(2, Int64ul))),      # shared copy-on-write with the parent
))

# --- THREAD ------------------------------------------------------------------
# PTRACE_GETREGS: struct user_regs_struct (arch/x86/include/asm/user_64.h), 27
# u64 in GP_REG_NAMES order; PTRACE_GETREGSET NT_X86_XSTATE (struct xregs_state,
# arch/x86/include/asm/fpu/types.h; xfeatures = its header.xfeatures);
# PTRACE_GETSIGMASK; PTRACE_GET_RSEQ_CONFIGURATION (struct
# ptrace_rseq_configuration, include/uapi/linux/ptrace.h); get_robust_list(2);
# clear_child_tid via PR_GET_TID_ADDRESS; sigaltstack(2) stack_t (ss_flags
# stored as u32: SS_AUTODISARM is bit 31); man 5 proc /proc/PID/task/TID/syscall
# and /proc/PID/task/TID/comm.
ThreadRecord = Record(Thread, Struct(
    "tid" / Int32ul,
    "regs" / Array(len(GP_REG_NAMES), Int64ul),
    "xstate" / Blob,
    "xfeatures" / Int64ul,
    "sigmask" / Int64ul,
    "rseq_addr" / Int64ul,
    "rseq_len" / Int32ul,
    "rseq_sig" / Int32ul,
    "rseq_flags" / Int32ul,
    "robust_list" / Int64ul,
    "robust_list_len" / Int64ul,
    "clear_child_tid" / Int64ul,
    "sas_sp" / Int64ul,
    "sas_flags" / Int32ul,
    "sas_size" / Int64ul,
    "restart" / IntEnumOf(Int8ul, Restart),
    "syscall_nr" / Int64sl,           # -1: not in a syscall
    "comm" / Text,
    "cpus" / Since(8, PrefixedArray(VarInt, Int16ul)),   # CPU affinity, () for all online
    "sched" / Since(8, PrefixedArray(VarInt, Int32sl)),  # policy, rt_priority, nice
    # struct user_desc (asm/ldt.h) of each used GDT TLS entry, PTRACE_GET_THREAD_AREA:
    # entry_number, base_addr, limit, flags (seg_32bit .. useable as the kernel packs them)
    "tls" / Since(15, PrefixedArray(VarInt, Array(4, Int32ul))),
    "cgroups" / Since(17, Text),              # /proc/PID/task/TID/cgroup, "" when its process's
    "creds" / Since(17, PrefixedArray(VarInt, CredsRecord)),   # its own CREDS, none when its process's
))

# --- SIGACTION ---------------------------------------------------------------
# rt_sigaction(2) struct kernel_sigaction (sa_handler, sa_flags, sa_restorer,
# sa_mask; include/linux/signal_types.h, arch/x86/include/uapi/asm/signal.h).
SigactionRecord = Record(Sigaction, Struct(
    "signo" / Int32ul,
    "handler" / Int64ul,
    "flags" / Int64ul,
    "restorer" / Int64ul,
    "mask" / Int64ul,
))

# --- PENDING_SIGNAL ----------------------------------------------------------
# PTRACE_PEEKSIGINFO (struct ptrace_peeksiginfo_args, PTRACE_PEEKSIGINFO_SHARED
# for the process queue): raw siginfo_t (include/uapi/asm-generic/siginfo.h).
PendingSignalRecord = Record(PendingSignal, Struct(
    "tid" / Int32ul,
    "siginfo" / Bytes(SIGINFO_SIZE),
))

# --- FD ----------------------------------------------------------------------
# man 5 proc: /proc/PID/fd/N (readlink), /proc/PID/fdinfo/N (pos, flags,
# mnt_id and per-kind extra lines, kept in `details`), fstat(2) via
# /proc/PID/fd/N (st_dev, st_ino, st_mode, st_rdev, st_size, st_mtim).
FdRecord = Record(Fd, Struct(
    "fd" / Int32ul,
    "kind" / IntEnumOf(Int16ul, FdKind),
    "path" / Text,
    "flags" / Int32ul,
    "pos" / Int64sl,                  # loff_t
    "cloexec" / Flag,
    "mnt_id" / Int32ul,
    "dev" / Int64ul,
    "ino" / Int64ul,
    "mode" / Int32ul,
    "rdev" / Int64ul,
    "size" / Int64sl,                 # off_t
    "mtime_ns" / Int64sl,
    "details" / PrefixedArray(VarInt, CSequence(Text, Text)),
    "desc" / Since(2, VarInt),        # open file description number (kcmp(2) KCMP_FILE groups)
    "skipped" / Since(3, Flag),       # dump --skip-file
    "external" / Since(4, Text),      # claimed external by a plugin (its note)
    "append_hash" / Since(11, Int64ul),   # xxh3-64 of an O_APPEND file's bytes up to `size`
))

# --- PLUGIN ------------------------------------------------------------------
# ptckpt.plugins: each plugin used (pid -1) and the data it saved per (pid, key).
PluginDataRecord = Record(PluginData, Struct(
    "name" / Text,
    "version" / Text,
    "pid" / Int32sl,
    "key" / Text,
    "data" / Blob,
))

# --- FILE_LOCK ---------------------------------------------------------------
# The "lock:" lines of /proc/PID/fdinfo/N (man 5 proc, fs/locks.c
# lock_get_status): FLOCK, POSIX or OFDLCK, READ or WRITE, byte range.
HeldLockRecord = Record(HeldLock, Struct(
    "fd" / Int32ul,
    "kind" / Utf8,
    "type" / Utf8,
    "start" / Int64sl,
    "end" / Int64sl,
    "pid" / Int32sl,
))

# --- ZOMBIE ------------------------------------------------------------------
# man 5 proc /proc/PID/stat of a zombie: pid, ppid (4), pgrp (5), session (6),
# exit_code (52, the wait(2) status).
ZombieRecord = Record(Zombie, Struct(
    "pid" / Int32ul,
    "ppid" / Int32ul,
    "pgid" / Int32ul,
    "sid" / Int32ul,
    "wait_status" / Int32ul,
))

# --- PIPE --------------------------------------------------------------------
# pipe(7): a pipe's buffer, copied without consuming it by tee(2); capacity from
# fcntl(F_GETPIPE_SZ).  A FIFO (mkfifo(3)) also carries its path.
PipeRecord = Record(PipeBuffer, Struct(
    "ino" / Int64ul,
    "capacity" / Int32ul,
    "data" / Blob,
    "path" / Text,
))

# Socket options (UNIX_SOCKET, INET_SOCKET, NETLINK_SOCKET): getsockopt(2) values as
# (level, optname, value bytes), in the order a restore sets them.
_SOCKOPTS = PrefixedArray(VarInt, CSequence(Int32sl, Int32sl, Blob))


class _OptionsAdapter(Adapter):
    """[(level, name, value)] <-> tuple of tuples."""

    def _decode(self, obj, context, path):
        return tuple((o[0], o[1], bytes(o[2])) for o in obj)

    def _encode(self, obj, context, path):
        return [list(o) for o in obj]


# --- UNIX_SOCKET -------------------------------------------------------------
# unix(7); sock_diag(7) NETLINK_SOCK_DIAG unix_diag_msg (include/uapi/linux/
# unix_diag.h): udiag_ino, udiag_type, udiag_state, UNIX_DIAG_NAME, UNIX_DIAG_PEER,
# UNIX_DIAG_RQLEN (listen backlog), UNIX_DIAG_SHUTDOWN; the receive queue read
# with MSG_PEEK and SO_PEEK_OFF (socket(7)); UNIX_DIAG_ICONS (pending connections,
# read by accept(2) on a copy of the listener); UNIX_DIAG_VFS against stat(2) of the
# bound path (deleted or replaced names; the socket file's mode and owner); SIOCUNIXFILE
# (the directory a relative name was bound in).
UnixSocketRecord = Record(UnixSocket, Struct(
    "ino" / Int64ul,
    "type" / Int16ul,
    "state" / Int16ul,
    "name" / Blob,
    "peer" / Int64ul,
    "peer_name" / Blob,
    "backlog" / Int32ul,
    "shutdown" / Int8ul,
    "queue" / PrefixedArray(VarInt, Blob),
    "listener" / Int64ul,
    "options" / Since(6, _OptionsAdapter(_SOCKOPTS)),
    "pending" / Since(8, Flag),
    "deleted" / Since(8, Flag),
    "file_mode" / Since(8, Int32ul),
    "file_uid" / Since(8, Int32ul),
    "file_gid" / Since(8, Int32ul),
    "queue_fds" / Since(8, PrefixedArray(VarInt, PrefixedArray(VarInt, VarInt))),
    "queue_creds" / Since(9, PrefixedArray(VarInt, Array(3, Int64sl))),
    "name_dir" / Since(17, Text),
))

# --- POSIX_TIMER, ITIMER ----------------------------------------------------------
# timer_create(2) / man 5 proc /proc/PID/timers (ID, signal: signo/sigev_value, notify:
# how/pid|tid.N, ClockID); timer_gettime(2) struct itimerspec; timer_getoverrun(2);
# getitimer(2) struct itimerval.
PosixTimerRecord = Record(PosixTimer, Struct(
    "id" / Int32sl,
    "clockid" / Int32sl,
    "signo" / Int32sl,
    "notify" / Int32sl,
    "tid" / Int32sl,
    "value" / Int64ul,
    "interval_ns" / Int64ul,
    "left_ns" / Int64ul,
    "overrun" / Int32sl,
))
ItimerRecord = Record(Itimer, Struct(
    "which" / Int32ul,
    "interval_us" / Int64ul,
    "left_us" / Int64ul,
))

# --- FD_OWNER ----------------------------------------------------------------------
# fcntl(2) F_GETOWN_EX (struct f_owner_ex: type, pid) and F_GETSIG of an fd's open file
# description; the pid as the tree sees it.
FdOwnerRecord = Record(FdOwner, Struct(
    "fd" / Int32ul,
    "owner_type" / Int32ul,
    "pid" / Int32sl,
    "signo" / Int32ul,
))


# --- AIO_RING -------------------------------------------------------------------
# io_setup(2): the "[aio]" mapping of /proc/PID/maps is the context's ring, struct
# aio_ring (fs/aio.c: id, nr, head, tail, magic, features, header_length) followed by
# nr struct io_event (include/uapi/linux/aio_abi.h, 32 bytes each).
AioRingRecord = Record(AioRing, Struct(
    "start" / Int64ul,
    "end" / Int64ul,
    "nr" / Int32ul,
    "head" / Int32ul,
    "tail" / Int32ul,
    "events" / Blob,                  # the io_event slots from head to tail
))


# --- PAGE_RUN ----------------------------------------------------------------
# A run of consecutive present pages (man 5 proc /proc/PID/pagemap bits 63/62,
# or mincore-style detection) stored contiguously in pages-PID.img at `offset`
# bytes into the page data.  Hot path: encode_page_runs/decode_entries use the
# equivalent struct format _PAGE_RUN below; tests check they agree.
PageRunRecord = Record(PageRun, Struct(
    "vaddr" / Int64ul,
    "npages" / Int64ul,
    "offset" / Int64ul,
))

# --- PAGE_SUMS ---------------------------------------------------------------
# xxh3-64 (https://xxhash.com) of each block of the page data, u64 little-endian each,
# packed in one blob: checked by block as a restore reads the pages (formats/pagesums.py).
PageSumsRecord = Record(PageSums, Struct(
    "block_size" / Int32ul,
    "sums" / Blob,
))


# --- PAGE_PARENT, PAGE_FRAMES ---------------------------------------------------
# Incremental images: pages unchanged since the parent image (the Inventory names it).
ParentPagesRecord = Record(ParentPages, Struct(
    "vaddr" / Int64ul,
    "npages" / Int64ul,
))
# Compressed page data: (raw u32, stored u32) per zstd frame, in file order.
PageFramesRecord = Record(PageFrames, Struct(
    "codec" / Utf8,
    "level" / Int32sl,
    "sizes" / Blob,
))
# Page data sent to a page server (dump --page-server): where it is there, and the PAGES
# header it has there (data length, crc32), so that the image is validated without it.
PageServerPagesRecord = Record(PageServerPages, Struct(
    "address" / Utf8,
    "path" / Utf8,
    "length" / Int64ul,
    "crc32" / Int32ul,
))


# --- SYSV_SHM, SYSV_SEM, SYSV_MSG -------------------------------------------------
# svipc(7); shmctl(2)/semctl(2)/msgctl(2) IPC_STAT (struct ipc64_perm, shmid64_ds,
# semid64_ds, msqid64_ds), /proc/sysvipc/{shm,sem,msg}; segment bytes read through
# a read-only shmat, semaphore values by semctl(GETALL), messages by msgrcv(MSG_COPY).
_IPC_OWNER = ("uid" / Int32ul, "gid" / Int32ul, "cuid" / Int32ul, "cgid" / Int32ul)
ShmImageRecord = Record(ShmImage, Struct(
    "key" / Int32sl,
    "shmid" / Int32ul,
    "perms" / Int32ul,
    "size" / Int64ul,
    *_IPC_OWNER,
    "cpid" / Int32ul,
    "lpid" / Int32ul,
    "nattch" / Int64ul,
    "atime" / Int64sl,
    "dtime" / Int64sl,
    "ctime" / Int64sl,
    "destroyed" / Flag,
    "locked" / Flag,
    "data" / Blob,
))
SemImageRecord = Record(SemImage, Struct(
    "key" / Int32sl,
    "semid" / Int32ul,
    "perms" / Int32ul,
    *_IPC_OWNER,
    "values" / PrefixedArray(VarInt, Int16ul),     # semval is an unsigned short
    "pids" / PrefixedArray(VarInt, Int32ul),
    "otime" / Int64sl,
    "ctime" / Int64sl,
))
MsgImageRecord = Record(MsgImage, Struct(
    "key" / Int32sl,
    "msqid" / Int32ul,
    "perms" / Int32ul,
    *_IPC_OWNER,
    "qbytes" / Int64ul,
    "messages" / PrefixedArray(VarInt, CSequence(Int64sl, Blob)),   # (mtype, text)
    "lspid" / Int32ul,
    "lrpid" / Int32ul,
    "stime" / Int64sl,
    "rtime" / Int64sl,
    "ctime" / Int64sl,
))


# --- GHOST_FILE --------------------------------------------------------------
# A deleted file still open or mapped (/proc/PID/fd/N or map_files link ending in
# " (deleted)"), or a deleted directory open or a cwd/root: fstat(2) identity, mode,
# owner, times and size, and the bytes of its data extents (lseek(2) SEEK_DATA/SEEK_HOLE;
# before format 8: its whole contents, no extents).  A file with other links left
# (st_nlink > 0) has its name_to_handle_at(2) file handle instead of its contents.
# listxattr(2)/getxattr(2): its extended attributes (POSIX ACLs are system.posix_acl_*).
# A device node's st_rdev and a symbolic link's readlinkat(2) target (format 17: an O_PATH
# fd or a device opened, whose name was deleted).
GhostFileRecord = Record(GhostFile, Struct(
    "dev" / Int64ul,
    "ino" / Int64ul,
    "path" / Text,
    "mode" / Int32ul,
    "uid" / Int32ul,
    "gid" / Int32ul,
    "data" / Blob,
    "mtime_ns" / Since(8, Int64sl),
    "atime_ns" / Since(8, Int64sl),
    "size" / Since(8, Int64ul),
    "extents" / Since(8, PrefixedArray(VarInt, CSequence(Int64ul, Int64ul))),
    "handle" / Since(8, Blob),
    "xattrs" / Since(8, PrefixedArray(VarInt, CSequence(Text, Blob))),
    "rdev" / Since(17, Int64ul),
    "target" / Since(17, Text),
))


# --- SAVED_FILE --------------------------------------------------------------
# dump --save-file PATTERN: stat(2) mode, owner, mtime and the contents of a file.
SavedFileRecord = Record(SavedFile, Struct(
    "path" / Text,
    "mode" / Int32ul,
    "uid" / Int32ul,
    "gid" / Int32ul,
    "mtime_ns" / Int64sl,
    "data" / Blob,
))


# --- EVENTFD TIMERFD SIGNALFD INOTIFY MEMFD MQUEUE ------------------------------
# The state of an fd of those kinds, per open file description (`desc`, as Fd.desc).
# eventfd(2) (fdinfo eventfd-count, eventfd-semaphore); timerfd_create(2)
# (timerfd_gettime, fdinfo ticks/settime flags); signalfd(2) (fdinfo sigmask);
# inotify(7) (fdinfo wd/mask/fhandle, resolved to paths with open_by_handle_at(2));
# memfd_create(2) (contents, F_GET_SEALS); mq_overview(7) (mq_getattr, messages).
EventfdRecord = Record(EventfdState, Struct(
    "desc" / VarInt,
    "count" / Int64ul,
    "flags" / Int32ul,
))
TimerfdRecord = Record(TimerfdState, Struct(
    "desc" / VarInt,
    "clockid" / Int32ul,
    "flags" / Int32ul,
    "settime_flags" / Int32ul,
    "value_ns" / Int64sl,
    "interval_ns" / Int64sl,
    "ticks" / Int64ul,
    "expires_ns" / Int64sl,
))
SignalfdRecord = Record(SignalfdState, Struct(
    "desc" / VarInt,
    "mask" / Int64ul,
    "flags" / Int32ul,
))


class _WatchAdapter(Adapter):
    """(wd, path, mask) <-> InotifyWatch."""

    def _decode(self, obj, context, path):
        return InotifyWatch(obj[0], obj[1], obj[2])

    def _encode(self, obj, context, path):
        return list(obj)


InotifyRecord = Record(InotifyState, Struct(
    "desc" / VarInt,
    "watches" / PrefixedArray(VarInt, _WatchAdapter(CSequence(Int32sl, Text, Int32ul))),
    "flags" / Int32ul,
    # watches on deleted files: (wd, st_dev, st_ino) of the inode (a GHOST_FILE)
    "deleted" / Since(8, PrefixedArray(VarInt, CSequence(Int32sl, Int64ul, Int64ul))),
))
MemfdRecord = Record(MemfdState, Struct(
    "desc" / VarInt,
    "name" / Text,
    "contents" / Blob,
    "size" / Int64ul,
    "seals" / Int32ul,
    "mode" / Int32ul,
    "pos" / Int64sl,
))
MqueueRecord = Record(MqueueState, Struct(
    "desc" / VarInt,
    "name" / Text,
    "maxmsg" / Int64sl,
    "msgsize" / Int64sl,
    "flags" / Int32ul,
    "messages" / PrefixedArray(VarInt, CSequence(Int32ul, Blob)),     # (priority, bytes)
    "mode" / Int32ul,
    "uid" / Int32ul,
    "gid" / Int32ul,
    "unlinked" / Flag,
))



class _MarkAdapter(Adapter):
    """(kind, path, mflags, mask, ignored_mask) <-> FanotifyMark."""

    def _decode(self, obj, context, path):
        return FanotifyMark(*obj)

    def _encode(self, obj, context, path):
        return list(obj)


# fanotify(7): fdinfo "fanotify flags:X event-flags:Y" and one line per mark (inode:
# ino/sdev/f_handle, mount: mnt_id, file system: sdev), fs/notify/fdinfo.c; marks by path.
FanotifyRecord = Record(FanotifyState, Struct(
    "desc" / VarInt,
    "init_flags" / Int32ul,
    "event_flags" / Int32ul,
    "marks" / PrefixedArray(VarInt, _MarkAdapter(CSequence(Int8ul, Text, Int32ul, Int64ul, Int64ul))),
    "flags" / Int32ul,
))


# pidfd_open(2): fdinfo "Pid:" (-1 once the process is reaped; kernel/pid.c pidfd_show_fdinfo),
# the description's flags (PIDFD_NONBLOCK = O_NONBLOCK, PIDFD_THREAD = O_EXCL,
# include/uapi/linux/pidfd.h), and which descriptions refer to one process (pidfs inode).
PidfdRecord = Record(PidfdState, Struct(
    "desc" / VarInt,
    "pid" / Int32sl,
    "flags" / Int32ul,
    "target" / VarInt,
))


class _TargetAdapter(Adapter):
    """(tfd, events, data) <-> EpollTarget."""

    def _decode(self, obj, context, path):
        return EpollTarget(obj[0], obj[1], obj[2])

    def _encode(self, obj, context, path):
        return list(obj)


# epoll(7): fdinfo "tfd: N events: X data: Y" lines (fs/eventpoll.c ep_show_fdinfo).
EpollRecord = Record(EpollState, Struct(
    "desc" / VarInt,
    "targets" / PrefixedArray(VarInt, _TargetAdapter(CSequence(Int32ul, Int32ul, Int64ul))),
    # kcmp(2) KCMP_EPOLL_TFD: the description holding a target whose fd number was closed
    "sources" / Since(8, PrefixedArray(VarInt, VarInt)),
))


# termios(3) (TCGETS2: struct termios2), tty_ioctl(4) TIOCGWINSZ, TIOCGPGRP/TIOCGSID
# or /proc/PID/stat tpgid and session (man 5 proc) for the controlling terminal.
TerminalRecord = Record(Terminal, Struct(
    "desc" / VarInt,
    "termios" / Blob,
    "rows" / Int16ul,
    "cols" / Int16ul,
    "xpixel" / Int16ul,
    "ypixel" / Int16ul,
    "fg_pgrp" / Int32sl,
    "sid" / Int32sl,
    "controlling" / Flag,
))


# --- PTY ---------------------------------------------------------------------------
# pty(7), tty_ioctl(4): TIOCGPTN (the index), TCGETS2 and TIOCGWINSZ on the master (they act
# on the pair), TIOCGSID and TIOCGPGRP on the master (the slave's session and foreground
# group), TIOCGPTLCK, TIOCGPKT; the bytes read from the master that the slave had written;
# those read from the slave that the master had written (n_tty's read buffer: canonical
# reads line by line, then the unfinished line with ICANON off); a slave whose master was
# closed is hung up (tty_vhangup: its ioctls fail with EIO); the slave's owner and mode
# (fstat of it: /dev/pts/N, fchown and fchmod'd by its program or grantpt).
PtyRecord = Record(Pty, Struct(
    "desc" / VarInt,
    "index" / VarInt,
    "termios" / Blob,
    "rows" / Int16ul,
    "cols" / Int16ul,
    "xpixel" / Int16ul,
    "ypixel" / Int16ul,
    "sid" / Int32sl,
    "fg_pgrp" / Int32sl,
    "locked" / Flag,
    "packet" / Flag,
    "output" / Blob,
    "input" / Since(14, Blob),
    "input_lines" / Since(14, PrefixedArray(VarInt, VarInt)),
    "hung_up" / Since(14, Flag),
    "slave_uid" / Since(17, Int32sl),
    "slave_gid" / Since(17, Int32sl),
    "slave_mode" / Since(17, Int32sl),
))


# --- INET_SOCKET ---------------------------------------------------------------
# ip(7), ipv6(7), tcp(7), udp(7); inet_diag (include/uapi/linux/inet_diag.h) for the
# state; getsockopt(2) values of the options that differ from a new socket's; TCP_REPAIR
# (include/uapi/linux/tcp.h: TCP_REPAIR_QUEUE, TCP_QUEUE_SEQ, TCP_REPAIR_WINDOW = struct
# tcp_repair_window, TCP_TIMESTAMP, TCP_INFO tcpi_options/tcpi_{snd,rcv}_wscale, TCP_MAXSEG)
# with both queues read by MSG_PEEK in repair mode; ioctl SIOCOUTQNSD for the unsent part;
# UDP datagrams peeked with SO_PEEK_OFF (socket(7)) with their senders; MCAST_MSFILTER
# (struct group_filter) for multicast memberships; SO_GET_FILTER (struct sock_filter[]).
class _DatagramAdapter(Adapter):
    def _decode(self, obj, context, path):
        return tuple((d[0], d[1], bytes(d[2])) for d in obj)

    def _encode(self, obj, context, path):
        return [list(d) for d in obj]


InetSocketRecord = Record(InetSocket, Struct(
    "ino" / Int64ul,
    "family" / Int16ul,
    "type" / Int16ul,
    "protocol" / Int16ul,
    "state" / Int8ul,
    "mode" / IntEnumOf(Int8ul, InetMode),
    "src" / Utf8,
    "sport" / Int16ul,
    "dst" / Utf8,
    "dport" / Int16ul,
    "shutdown" / Int8ul,
    "backlog" / Int32ul,
    "options" / _OptionsAdapter(_SOCKOPTS),
    "rcv_seq" / Int32ul,
    "snd_seq" / Int32ul,
    "recv_queue" / Blob,
    "send_queue" / Blob,
    "unsent" / Int32ul,
    "mss" / Int32ul,
    "tcp_options" / Int8ul,
    "snd_wscale" / Int8ul,
    "rcv_wscale" / Int8ul,
    "timestamp" / Int32ul,
    "window" / PrefixedArray(VarInt, Int32ul),
    "listener" / Int64ul,
    "peer" / Int64ul,
    "datagrams" / _DatagramAdapter(PrefixedArray(VarInt, CSequence(Utf8, Int16ul, Blob))),
    "multicast" / PrefixedArray(VarInt, CSequence(Int32ul, Utf8)),
    "filter" / Blob,
))

# --- NETLINK_SOCKET ------------------------------------------------------------
# netlink(7): struct sockaddr_nl of getsockname/getpeername (nl_pid, nl_groups).
NetlinkSocketRecord = Record(NetlinkSocket, Struct(
    "ino" / Int64ul,
    "type" / Int16ul,
    "protocol" / Int16ul,
    "portid" / Int32ul,
    "groups" / Int32ul,
    "dst_portid" / Int32ul,
    "dst_group" / Int32ul,
    "options" / _OptionsAdapter(_SOCKOPTS),
))


# --- IN_FLIGHT_FD ----------------------------------------------------------------
# unix(7) SCM_RIGHTS: a file description queued in a socket, as MSG_PEEK installed it
# in the dumper (net/unix/af_unix.c unix_peek_fds); the FD record's fields.
InFlightFdRecord = Record(InFlightFd, Struct(
    "fd" / FdRecord,
))


# --- the record table and entry framing --------------------------------------

RECORDS: dict[EntryKind, Record] = {
    EntryKind.INVENTORY: InventoryRecord,
    EntryKind.PLUGIN: PluginDataRecord,
    EntryKind.ZOMBIE: ZombieRecord,
    EntryKind.PIPE: PipeRecord,
    EntryKind.UNIX_SOCKET: UnixSocketRecord,
    EntryKind.SYSV_SHM: ShmImageRecord,
    EntryKind.SYSV_SEM: SemImageRecord,
    EntryKind.SYSV_MSG: MsgImageRecord,
    EntryKind.GHOST_FILE: GhostFileRecord,
    EntryKind.SAVED_FILE: SavedFileRecord,
    EntryKind.EVENTFD: EventfdRecord,
    EntryKind.TIMERFD: TimerfdRecord,
    EntryKind.SIGNALFD: SignalfdRecord,
    EntryKind.INOTIFY: InotifyRecord,
    EntryKind.MEMFD: MemfdRecord,
    EntryKind.MQUEUE: MqueueRecord,
    EntryKind.EPOLL: EpollRecord,
    EntryKind.TERMINAL: TerminalRecord,
    EntryKind.INET_SOCKET: InetSocketRecord,
    EntryKind.NETLINK_SOCKET: NetlinkSocketRecord,
    EntryKind.IN_FLIGHT_FD: InFlightFdRecord,
    EntryKind.PTY: PtyRecord,
    EntryKind.TASK: TaskRecord,
    EntryKind.CREDS: CredsRecord,
    EntryKind.MM: MmRecord,
    EntryKind.RLIMIT: RlimitRecord,
    EntryKind.VMA: VmaRecord,
    EntryKind.THREAD: ThreadRecord,
    EntryKind.SIGACTION: SigactionRecord,
    EntryKind.PENDING_SIGNAL: PendingSignalRecord,
    EntryKind.FD: FdRecord,
    EntryKind.FILE_LOCK: HeldLockRecord,
    EntryKind.PAGE_RUN: PageRunRecord,
    EntryKind.PAGE_SUMS: PageSumsRecord,
    EntryKind.PAGE_PARENT: ParentPagesRecord,
    EntryKind.PAGE_FRAMES: PageFramesRecord,
    EntryKind.PAGE_SERVER: PageServerPagesRecord,
    EntryKind.POSIX_TIMER: PosixTimerRecord,
    EntryKind.ITIMER: ItimerRecord,
    EntryKind.FD_OWNER: FdOwnerRecord,
    EntryKind.AIO_RING: AioRingRecord,
    EntryKind.FANOTIFY: FanotifyRecord,
    EntryKind.PIDFD: PidfdRecord,
}
KIND_OF: dict[type, EntryKind] = {rec.cls: kind for kind, rec in RECORDS.items()}

# Which entry kinds each file kind holds.
FILE_ENTRY_KINDS: dict[FileKind, frozenset[EntryKind]] = {
    FileKind.INVENTORY: frozenset({EntryKind.INVENTORY, EntryKind.PLUGIN, EntryKind.ZOMBIE, EntryKind.PIPE,
                                   EntryKind.UNIX_SOCKET, EntryKind.SYSV_SHM, EntryKind.SYSV_SEM,
                                   EntryKind.SYSV_MSG, EntryKind.GHOST_FILE, EntryKind.SAVED_FILE,
                                   EntryKind.EVENTFD, EntryKind.TIMERFD, EntryKind.SIGNALFD,
                                   EntryKind.INOTIFY, EntryKind.MEMFD, EntryKind.MQUEUE,
                                   EntryKind.EPOLL, EntryKind.TERMINAL, EntryKind.INET_SOCKET,
                                   EntryKind.NETLINK_SOCKET, EntryKind.IN_FLIGHT_FD,
                                   EntryKind.FANOTIFY, EntryKind.PTY, EntryKind.PIDFD}),
    FileKind.CORE: frozenset({
        EntryKind.TASK, EntryKind.CREDS, EntryKind.MM, EntryKind.RLIMIT,
        EntryKind.VMA, EntryKind.THREAD, EntryKind.SIGACTION,
        EntryKind.PENDING_SIGNAL, EntryKind.FD, EntryKind.FILE_LOCK, EntryKind.POSIX_TIMER,
        EntryKind.ITIMER, EntryKind.FD_OWNER, EntryKind.AIO_RING,
    }),
    FileKind.PAGEMAP: frozenset({EntryKind.PAGE_RUN, EntryKind.PAGE_SUMS, EntryKind.PAGE_PARENT,
                                 EntryKind.PAGE_FRAMES, EntryKind.PAGE_SERVER}),
    FileKind.PAGES: frozenset(),
}

# The entry grammar as one construct (encode_entry/decode_entries are the fast
# equivalents used on real images; tests keep them in step).
Entry = Struct(
    "kind" / IntEnumOf(Int16ul, EntryKind),
    "reserved" / Default(Int16ul, 0),
    "payload" / Prefixed(Int32ul, Switch(this.kind, RECORDS, default=GreedyBytes)),
)

Header = Struct(
    "magic" / Const(MAGIC),
    "file_kind" / IntEnumOf(Int16ul, FileKind),
    "version" / Int16ul,
    "payload_length" / Int64ul,
    "crc32" / Int32ul,
    "reserved" / Default(Int32ul, 0),
)

_ENTRY_HEADER = struct.Struct("<HHI")
_PAGE_RUN = struct.Struct("<QQQ")
_PAGE_RUN_ENTRY = struct.Struct("<HHIQQQ")
_PARENT = struct.Struct("<QQ")
_PARENT_ENTRY = struct.Struct("<HHIQQ")

AnyRecord = Union[Inventory, Task, Creds, Mm, Rlimit, Vma, Thread, Sigaction,
                  PendingSignal, Fd, PageRun, PageSums, ParentPages, PageFrames, Zombie, PipeBuffer, UnixSocket, ShmImage,
                  SemImage, MsgImage, GhostFile, SavedFile, EventfdState, TimerfdState,
                  SignalfdState, InotifyState, MemfdState, MqueueState, EpollState, HeldLock,
                  Terminal, PluginData, InetSocket, NetlinkSocket, PosixTimer, Itimer, FdOwner, InFlightFd,
                  AioRing, FanotifyState, Pty, PidfdState,
                  RawEntry]


def _kind_name(kind: int) -> str:
    try:
        return EntryKind(kind).name
    except ValueError:
        return f"kind {kind}"


def build_record(record: AnyRecord) -> bytes:
    """The payload bytes of one record (no entry framing)."""
    if isinstance(record, RawEntry):
        return bytes(record.payload)
    try:
        rec = RECORDS[KIND_OF[type(record)]]
    except KeyError:
        raise TypeError(f"not an image record: {type(record).__name__}") from None
    try:
        return rec.build(record)
    except (ConstructError, UnicodeError, TypeError, ValueError, struct.error) as err:
        raise ValueError(f"cannot encode {record!r}: {err}") from err


def parse_record(kind: int, payload: bytes, *, version: int = FORMAT_VERSION) -> AnyRecord:
    """Decode one payload of `kind`; unknown kinds come back as RawEntry.

    Raises EntryDecodeError (offset 0) if the payload does not decode.
    """
    return _decode_payload(kind, payload, version, 0)


def encode_entry(record: AnyRecord) -> bytes:
    """kind + reserved + length + payload of one record (RawEntry re-encodes verbatim)."""
    kind = record.kind if isinstance(record, RawEntry) else KIND_OF.get(type(record))
    payload = build_record(record)
    return _ENTRY_HEADER.pack(kind, 0, len(payload)) + payload


def encode_entries(records: Iterable[AnyRecord]) -> bytes:
    return b"".join(encode_entry(r) for r in records)


def encode_page_runs(runs: Iterable[PageRun | tuple[int, int, int]]) -> bytes:
    """PAGE_RUN entries for many runs at once; same bytes as encode_entry on each."""
    pack = _PAGE_RUN_ENTRY.pack
    kind, size = EntryKind.PAGE_RUN, _PAGE_RUN.size
    out = []
    for run in runs:
        vaddr, npages, offset = (run.vaddr, run.npages, run.offset) if isinstance(run, PageRun) else run
        out.append(pack(kind, 0, size, vaddr, npages, offset))
    return b"".join(out)


def encode_parent_pages(ranges: Iterable[ParentPages]) -> bytes:
    """PAGE_PARENT entries for many ranges at once; same bytes as encode_entry on each."""
    pack = _PARENT_ENTRY.pack
    kind, size = EntryKind.PAGE_PARENT, _PARENT.size
    return b"".join(pack(kind, 0, size, r.vaddr, r.npages) for r in ranges)


def _decode_payload(kind: int, payload, version: int, offset: int) -> AnyRecord:
    if kind == EntryKind.PAGE_RUN:
        if len(payload) < _PAGE_RUN.size:
            raise EntryDecodeError(offset, kind, f"payload of {len(payload)} bytes, need {_PAGE_RUN.size}")
        return PageRun(*_PAGE_RUN.unpack_from(payload))
    if kind == EntryKind.PAGE_PARENT:
        if len(payload) < _PARENT.size:
            raise EntryDecodeError(offset, kind, f"payload of {len(payload)} bytes, need {_PARENT.size}")
        return ParentPages(*_PARENT.unpack_from(payload))
    rec = RECORDS.get(kind)
    if rec is None:
        return RawEntry(kind, bytes(payload))
    try:
        return rec.parse(bytes(payload), version=version)
    except (ConstructError, UnicodeError, TypeError, ValueError) as err:
        raise EntryDecodeError(offset, kind, _one_line(err)) from err


_CONSTRUCT_PATH = re.compile(r"Error in path \(parsing\) -> (\S+)\s*")
_SHORT_READ = re.compile(r"stream read less than specified amount, expected (\d+), found (\d+)")


def _one_line(err: Exception) -> str:
    """construct's words for a decoding error, as one line of ours: which field, and why
    (a field that wants more bytes than the entry has left is the usual one)."""
    text = str(err).strip() or type(err).__name__
    field = ""
    m = _CONSTRUCT_PATH.search(text)
    if m:
        field = f"field {m.group(1)}: "
        text = text[:m.start()] + text[m.end():]
    m = _SHORT_READ.search(text)
    if m:
        text = f"wants {m.group(1)} bytes, {m.group(2)} left"
    return field + " ".join(text.split())


def decode_entries(data, *, version: int = FORMAT_VERSION) -> list[AnyRecord]:
    """Every entry of a file payload, in order; unknown kinds as RawEntry.

    `version` is the file header's version (gates :func:`Since` fields).
    Raises EntryDecodeError on a truncated entry or an undecodable payload.
    """
    view = memoryview(data).cast("B")
    end = len(view)
    pos = 0
    out: list[AnyRecord] = []
    unpack_header = _ENTRY_HEADER.unpack_from
    while pos < end:
        if end - pos < ENTRY_HEADER_SIZE:
            raise EntryDecodeError(pos, None, f"truncated entry header ({end - pos} bytes left)")
        kind, reserved, length = unpack_header(view, pos)
        if reserved:
            raise EntryDecodeError(pos, kind, "non-zero reserved bytes in the entry header")
        start = pos + ENTRY_HEADER_SIZE
        if start + length > end:
            raise EntryDecodeError(pos, kind, f"length {length} overruns the payload ({end - start} bytes left)")
        out.append(_decode_payload(kind, view[start:start + length], version, pos))
        pos = start + length
    return out


# --- file header ---------------------------------------------------------------

def build_header(file_kind: FileKind, payload_length: int, crc32: int,
                 *, version: int = FORMAT_VERSION) -> bytes:
    """The 24-byte file header (PAGES files: pad it to PAGES_DATA_OFFSET yourself)."""
    return Header.build(dict(file_kind=file_kind, version=version,
                             payload_length=payload_length, crc32=crc32))


def parse_header(data: bytes) -> FileHeader:
    """Decode a header; the caller checks len(data) >= HEADER_SIZE and the magic first."""
    h = Header.parse(data)
    return FileHeader(h.file_kind, h.version, h.payload_length, h.crc32)


def build_file(file_kind: FileKind, records: Sequence[AnyRecord]) -> bytes:
    """A whole INVENTORY/CORE/PAGEMAP file: header + entries."""
    payload = encode_entries(records)
    return build_header(file_kind, len(payload), zlib.crc32(payload)) + payload

