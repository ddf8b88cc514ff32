"""The image's records as frozen dataclasses.

These are what the rest of ptckpt speaks; :mod:`ptckpt.formats.records` maps
each one to a construct Struct and back.  Fields may only be appended (with a
default), never removed or reordered: an older image then still parses, with
the new fields at their defaults.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

PAGE_SIZE = 4096

# x86_64 struct user_regs_struct (arch/x86/include/asm/user_64.h), in order.
GP_REG_NAMES = (
    "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8",
    "rax", "rcx", "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags",
    "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs",
)


class VmaKind(enum.IntEnum):
    """What a mapping is, as far as a restore cares."""

    ANON_PRIVATE = 1     # private anonymous memory (incl. thread stacks)
    ANON_SHARED = 2      # MAP_SHARED|MAP_ANONYMOUS ("/dev/zero (deleted)")
    FILE_PRIVATE = 3     # private mapping of a file (text, data, MAP_PRIVATE)
    FILE_SHARED = 4      # shared mapping of a regular file
    SHMEM = 5            # memfd, /dev/shm or SysV segment (shmem-backed)
    HEAP = 6             # [heap]
    STACK = 7            # [stack]
    VDSO = 8             # [vdso]
    VVAR = 9             # [vvar]
    VVAR_VCLOCK = 10     # [vvar_vclock]
    VSYSCALL = 11        # [vsyscall]
    DEVICE = 12          # a mapped character device
    OTHER = 13           # anything else, named by its path


class Restart(enum.IntEnum):
    """How a thread frozen inside a syscall must be resumed (DESIGN.md)."""

    NONE = 0             # not in a syscall, or the syscall had completed
    REEXECUTE = 1        # -ERESTARTSYS/-ERESTARTNOINTR/-ERESTARTNOHAND: rax=orig_rax, rip-=2
    RESTART_BLOCK = 2    # -ERESTART_RESTARTBLOCK: restart_syscall, needs the kernel's restart block


class FdKind(enum.IntEnum):
    REGULAR = 1
    DIRECTORY = 2
    PIPE = 3
    FIFO = 4
    SOCKET = 5
    EVENTFD = 6
    EPOLL = 7
    TIMERFD = 8
    SIGNALFD = 9
    INOTIFY = 10
    FANOTIFY = 11
    TTY = 12             # a terminal that is not a pty (console, serial ...)
    PTY_MASTER = 13
    PTY_SLAVE = 14
    CHARDEV = 15
    BLOCKDEV = 16
    MEMFD = 17
    PIDFD = 18
    IO_URING = 19
    USERFAULTFD = 20
    PERF_EVENT = 21
    BPF = 22
    MQUEUE = 23
    ANON_INODE = 24      # another anon_inode:[...] kind
    PATH = 25            # O_PATH descriptor
    UNKNOWN = 26
    NSFS = 27            # a namespace file


@dataclass(frozen=True)
class Inventory:
    """One per image: what made it, where, and which processes it holds."""

    ptckpt_version: str
    kernel_release: str
    arch: str
    page_size: int
    xfeatures: int            # XCR0 of the dumping machine (xsave features enabled)
    xstate_size: int          # bytes of the NT_X86_XSTATE regset
    root_pid: int
    pids: tuple[int, ...]     # every process in the image, root first
    realtime_ns: int          # clocks at the moment every thread was frozen
    monotonic_ns: int
    boottime_ns: int
    hostname: str
    fd_kinds_unsupported: tuple[str, ...] = ()   # "pid fd -> target" not restorable yet
    pid_level: int = 0        # how deep the tree's own pid namespace was below the dumper's
                              # (0: the same); every pid in the image is as the tree saw it
    real_pids: tuple[tuple[int, int], ...] = ()  # (virtual, real) per process and thread when
                              # pid_level > 0, real: as the dumper saw it (since format 5)
    netlock: str = ""         # the network lock (ptckpt.netlock id) holding the dumped TCP
                              # connections until a restore releases it (since format 6)
    image_id: str = ""        # random, unique to this image (since format 12)
    parent: str = ""          # incremental: the parent image's directory, relative to this
                              # one's, whose pages the PAGE_PARENT ranges are (since 12)
    parent_id: str = ""       # and the parent's image_id, checked when the chain is read
    memory_only: bool = False  # a pre-dump: memory to be a parent, nothing to restore (since 12)


@dataclass(frozen=True)
class Task:
    """One process: identity, relations and the per-process kernel state."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    comm: str
    state: str                # one letter from /proc/PID/stat
    exe: str
    cwd: str
    root: str
    umask: int
    personality: int
    nice: int
    sched_policy: int
    rt_priority: int
    oom_score_adj: int
    timerslack_ns: int
    exit_signal: int
    tids: tuple[int, ...]     # every thread, the leader first
    cmdline: tuple[str, ...] = ()
    dumpable: int = 1
    pdeath_signal: int = 0    # prctl(PR_GET_PDEATHSIG), since format 2
    child_subreaper: bool = False   # prctl(PR_GET_CHILD_SUBREAPER), since format 2
    thp_disable: bool = False       # prctl(PR_GET_THP_DISABLE), since format 8
    mdwe: int = 0                   # prctl(PR_GET_MDWE), since format 8
    memory_merge: bool = False      # prctl(PR_GET_MEMORY_MERGE), since format 8
    spec_ctrl: tuple[int, ...] = ()  # PR_GET_SPECULATION_CTRL of store bypass, indirect
                                     # branch, L1D flush (since format 8)
    shares_files: bool = False      # one fd table with its parent (CLONE_FILES), since format 8
    shares_fs: bool = False         # one cwd/root/umask with its parent (CLONE_FS), since format 8
    cgroups: str = ""               # /proc/PID/cgroup as it read at dump (since format 8)
    coredump_filter: int = -1       # /proc/PID/coredump_filter; -1: not recorded (since format 8)
    loginuid: int = 2**32 - 1       # /proc/PID/loginuid (audit); unset (since format 8)
    stop_signal: int = 0            # state "T": the signal of its group stop (SIGSTOP, SIGTSTP,
                                    # SIGTTIN, SIGTTOU); 0: not recorded, SIGSTOP (since format 13)
    # the cgroup directories it and its threads are in, their ancestors and descendants, as
    # ptckpt.resources.process.dump_cgroup_dirs writes them: a restore makes those gone since
    # (since format 17)
    cgroup_dirs: str = ""


@dataclass(frozen=True)
class Creds:
    uids: tuple[int, int, int, int]   # real, effective, saved, fs
    gids: tuple[int, int, int, int]
    groups: tuple[int, ...]
    cap_inh: int
    cap_prm: int
    cap_eff: int
    cap_bnd: int
    cap_amb: int
    no_new_privs: int
    seccomp: int
    securebits: int = 0       # prctl(PR_GET_SECUREBITS), since format 8
    seccomp_filters: tuple[bytes, ...] = ()   # classic BPF programs, oldest first (format 8)
    seccomp_flags: tuple[int, ...] = ()       # SECCOMP_FILTER_FLAG_* of each (format 8)


@dataclass(frozen=True)
class Mm:
    """mm_struct fields (/proc/PID/stat fields 26-28, 45-51) plus auxv."""

    start_code: int
    end_code: int
    start_data: int
    end_data: int
    start_brk: int
    brk: int
    start_stack: int
    arg_start: int
    arg_end: int
    env_start: int
    env_end: int
    exe_file: str
    auxv: tuple[tuple[int, int], ...]   # (AT_* type, value) pairs, AT_NULL excluded
    membarrier: int = 0             # membarrier(2) registrations: the MEMBARRIER_CMD_REGISTER_*
                                    # bits MEMBARRIER_CMD_GET_REGISTRATIONS returns (since format 13)


@dataclass(frozen=True)
class Rlimit:
    resource: int             # RLIMIT_* number
    cur: int                  # RLIM_INFINITY is 2**64-1
    max: int


@dataclass(frozen=True)
class Vma:
    start: int
    end: int
    prot: int                 # PROT_READ|PROT_WRITE|PROT_EXEC bits
    shared: bool
    kind: VmaKind
    pgoff: int                # byte offset into the file
    dev_major: int
    dev_minor: int
    inode: int
    path: str                 # maps path column ("" for plain anonymous)
    vmflags: str              # smaps VmFlags, space separated ("rd wr mr mw me ac")
    file_size: int = 0        # st_size of the mapped file at dump (0 if none)
    file_mtime_ns: int = 0
    file_deleted: bool = False
    build_id: str = ""        # GNU build-id of a mapped ELF file, hex (since format 3)
    guards: tuple[tuple[int, int], ...] = ()   # (start, end) guard regions (MADV_GUARD_INSTALL)
                                               # inside it (since format 8)
    cow: tuple[tuple[int, int], ...] = ()      # (start, end) runs of pages it still shares
                                               # copy-on-write with its parent's same mapping:
                                               # not saved here, inherited (since format 8)


@dataclass(frozen=True)
class PageRun:
    """One run of saved pages: npages pages at vaddr, at byte `offset` of pages-PID.img's data."""

    vaddr: int
    npages: int
    offset: int


@dataclass(frozen=True)
class PageSums:
    """The xxh3-64 of every `block_size` bytes of pages-PID.img's data, the last block maybe
    shorter: 8 bytes each, little-endian, in file order (format 10; formats/pagesums.py)."""

    block_size: int
    sums: bytes


@dataclass(frozen=True)
class ParentPages:
    """Incremental image: npages pages at vaddr are unchanged since the parent image, which
    holds them (or, where the parent has no page, they were zero) (format 12)."""

    vaddr: int
    npages: int


@dataclass(frozen=True)
class PageFrames:
    """Compressed page data (format 12): pages-PID.img's data is a sequence of frames, each
    the zstd compression of `raw` bytes of page data into `stored` bytes; PageRun offsets
    count raw bytes.  `sizes` packs (raw u32, stored u32) little-endian per frame."""

    codec: str                # "zstd"
    level: int
    sizes: bytes


@dataclass(frozen=True)
class PageServerPages:
    """The page data is not in the image directory (format 16): ``dump --page-server`` sent
    it to a page server, which holds it as `path` (under its directory), a PAGES file whose
    header records `length` bytes of data with checksum `crc32`.  `address` is where the
    page server listened at the dump (what ``restore --page-server`` is told by default in
    messages; the restore is given the address to use)."""

    address: str
    path: str
    length: int
    crc32: int


@dataclass(frozen=True)
class Thread:
    tid: int
    regs: tuple[int, ...]     # GP_REG_NAMES order, exactly as PTRACE_GETREGS gave
    xstate: bytes             # NT_X86_XSTATE regset, as PTRACE_GETREGSET gave
    xfeatures: int            # XSTATE_BV of this thread's xsave header
    sigmask: int
    rseq_addr: int
    rseq_len: int
    rseq_sig: int
    rseq_flags: int
    robust_list: int
    robust_list_len: int
    clear_child_tid: int
    sas_sp: int               # sigaltstack
    sas_flags: int
    sas_size: int
    restart: Restart
    syscall_nr: int           # orig_rax when frozen inside a syscall, else -1
    comm: str = ""
    cpus: tuple[int, ...] = ()   # sched_getaffinity; () when every online CPU (since format 8)
    sched: tuple[int, ...] = ()  # (policy, rt_priority, nice) of this thread (since format 8)
    # GDT TLS entries of a 32-bit (ia32) thread: (entry_number, base_addr, limit, flags) of
    # struct user_desc, the used ones (since format 15)
    tls: tuple[tuple[int, int, int, int], ...] = ()
    # /proc/PID/task/TID/cgroup where it differs from its process's (cgroup v1 moves threads
    # one by one), else "" (since format 17)
    cgroups: str = ""
    # its own credentials (uids, gids, capability sets, securebits, no_new_privs, seccomp
    # mode and filter chain) where they differ from its process's, else () (since format 17)
    creds: tuple[Creds, ...] = ()


@dataclass(frozen=True)
class Sigaction:
    signo: int
    handler: int              # SIG_DFL 0, SIG_IGN 1, else an address
    flags: int
    restorer: int
    mask: int


@dataclass(frozen=True)
class PendingSignal:
    tid: int                  # 0: the process-wide (shared) queue
    siginfo: bytes            # 128 raw bytes of siginfo_t


@dataclass(frozen=True)
class Fd:
    fd: int
    kind: FdKind
    path: str                 # readlink of /proc/PID/fd/N
    flags: int                # open flags from fdinfo (O_CLOEXEC included)
    pos: int
    cloexec: bool
    mnt_id: int
    dev: int                  # st_dev of the open file
    ino: int                  # st_ino
    mode: int                 # st_mode
    rdev: int                 # st_rdev (devices, ttys)
    size: int                 # st_size at dump
    mtime_ns: int
    details: tuple[tuple[str, str], ...] = field(default=())   # fdinfo extras, socket family/type ...
    desc: int = 0             # the open file description, numbered across the whole tree
                              # (fds that share one after dup/fork have the same desc; since format 2)
    skipped: bool = False     # dump --skip-file: recorded, not reopened at restore (since format 3)
    external: str = ""        # claimed as external by a plugin (its note): not saved, a plugin
                              # must give the process a new one at restore (since format 4)
    append_hash: int = 0      # a regular file open O_APPEND: xxh3-64 of its first `size` bytes at
                              # dump, so that a restore knows it only grew since (0: none; format 11)


@dataclass(frozen=True)
class HeldLock:
    """A file lock the process holds through fd `fd` (since format 3)."""

    fd: int
    kind: str                 # "flock" | "posix" | "ofd"
    type: str                 # "read" | "write"
    start: int
    end: int                  # last byte locked, inclusive; -1: to EOF
    pid: int                  # as /proc/PID/fdinfo showed it


@dataclass(frozen=True)
class PosixTimer:
    """A POSIX timer of the process (timer_create), with the time it had left."""

    id: int                   # the timer id the process holds
    clockid: int              # CLOCK_* or an encoded CPU clock (negative)
    signo: int
    notify: int               # SIGEV_SIGNAL 0, SIGEV_NONE 1, SIGEV_THREAD 2, | SIGEV_THREAD_ID 4
    tid: int                  # the thread signalled (SIGEV_THREAD_ID), else 0
    value: int                # sigev_value
    interval_ns: int
    left_ns: int              # 0: disarmed
    overrun: int = 0          # timer_getoverrun at the dump (not settable)


@dataclass(frozen=True)
class FdOwner:
    """Who gets SIGIO/SIGURG for an fd's open file description (fcntl F_SETOWN_EX, F_SETSIG):
    recorded for an fd with an owner or a signal set (since format 8)."""

    fd: int
    owner_type: int           # F_OWNER_TID 0, F_OWNER_PID 1, F_OWNER_PGRP 2
    pid: int                  # as the tree sees it; 0: no owner
    signo: int                # F_GETSIG: 0 is SIGIO


@dataclass(frozen=True)
class Itimer:
    """An armed interval timer (setitimer(2))."""

    which: int                # ITIMER_REAL 0, ITIMER_VIRTUAL 1, ITIMER_PROF 2
    interval_us: int
    left_us: int


@dataclass(frozen=True)
class AioRing:
    """An AIO context (io_setup(2)): its ring mapping at `start` (the context id), the
    ring's number of event slots, its head and tail, and the completions not yet
    reaped (the io_event slots from head to tail, 32 bytes each; since format 8)."""

    start: int
    end: int
    nr: int
    head: int
    tail: int
    events: bytes = b""


@dataclass(frozen=True)
class ProcessImage:
    """Everything core-PID.img holds, decoded."""

    task: Task
    creds: Creds
    mm: Mm
    rlimits: tuple[Rlimit, ...]
    vmas: tuple[Vma, ...]
    threads: tuple[Thread, ...]
    sigactions: tuple[Sigaction, ...]
    pending: tuple[PendingSignal, ...]
    fds: tuple[Fd, ...]
    locks: tuple[HeldLock, ...] = ()
    timers: tuple["PosixTimer", ...] = ()        # since format 7
    itimers: tuple["Itimer", ...] = ()
    owners: tuple["FdOwner", ...] = ()           # since format 8
    aio_rings: tuple["AioRing", ...] = ()        # since format 8


# --- image-wide records (inventory.img, since format 2) ------------------------

@dataclass(frozen=True)
class PluginData:
    """A plugin the image was made with (pid -1, no key), or data it saved (since format 4)."""

    name: str
    version: str
    pid: int                  # the image pid the data belongs to; 0: the whole tree; -1: the plugin
    key: str
    data: bytes = field(repr=False)


@dataclass(frozen=True)
class Zombie:
    """A child that has exited and waits to be reaped by its parent (a member)."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    wait_status: int          # what waitpid(2) will report (man 5 proc stat field 52)


@dataclass(frozen=True)
class PipeBuffer:
    """The buffer of a pipe or FIFO held inside the tree: its bytes at the freeze, in order."""

    ino: int
    capacity: int             # F_GETPIPE_SZ
    data: bytes
    path: str = ""            # a FIFO's path; "" for an anonymous pipe


@dataclass(frozen=True)
class UnixSocket:
    """An AF_UNIX socket held inside the tree (sock_diag plus what its fd tells)."""

    ino: int
    type: int                 # SOCK_STREAM 1, SOCK_DGRAM 2, SOCK_SEQPACKET 5
    state: int                # TCP_ESTABLISHED 1, TCP_CLOSE 7, TCP_LISTEN 10
    name: bytes               # bound address: a path, b"\0..." abstract, b"" unbound
    peer: int                 # inode of the peer socket, 0 for none
    peer_name: bytes          # the peer's bound address (what getpeername says)
    backlog: int              # listen() backlog of a listening socket
    shutdown: int             # RCV_SHUTDOWN 1 | SEND_SHUTDOWN 2
    queue: tuple[bytes, ...]  # its receive queue: one item per message (a stream: one item)
    listener: int = 0         # an accepted socket: inode of the listening socket it came from
    options: tuple[tuple[int, int, bytes], ...] = ()   # (level, optname, value) to set again (format 6)
    pending: bool = False     # a connection in a listener's accept queue, not yet accepted (format 8):
                              # ino is a number of ptckpt's, listener its listener, peer its client
                              # end (0: closed), queue what the client sent it
    deleted: bool = False     # its bound path names no longer its socket file (unlinked or replaced)
    file_mode: int = 0        # st_mode of its socket file (0: none or unknown), and its owner
    file_uid: int = 0
    file_gid: int = 0
    queue_fds: tuple[tuple[int, ...], ...] = ()   # per queue item, the descriptions (Fd.desc) it
                                                  # carries in flight (SCM_RIGHTS); () when none
    queue_creds: tuple[tuple[int, int, int], ...] = ()   # per queue item, the (pid, uid, gid) its
                              # reader gets with it (SCM_CREDENTIALS, SO_PASSCRED on; pid as the
                              # tree sees it, 0: none); () when the reader gets none (format 9)
    name_dir: str = ""        # a relative name: the directory it was bound in, "" when unknown (the
                              # holder's cwd is taken then) or for an absolute name (format 17)


@dataclass(frozen=True)
class InFlightFd:
    """A file description in flight in a unix socket's queue (SCM_RIGHTS), as the fd a
    peek at dump installed in ptckpt showed it; fd.desc numbers it with the tree's fds
    (format 8)."""

    fd: Fd


class InetMode(enum.IntEnum):
    """How an inet socket comes back (InetSocket.mode)."""

    PLAIN = 0            # made again from its addresses and options (unbound, bound, listening, UDP)
    REPAIRED = 1         # an established or half-closed TCP connection, rebuilt with TCP_REPAIR
    CLOSED = 2           # dump --tcp-close: the connection comes back reset (ECONNRESET, then EOF)
    PENDING = 3          # a connection in a listener's accept queue (its client end is in the tree)


@dataclass(frozen=True)
class InetSocket:
    """An AF_INET or AF_INET6 socket held inside the tree (TCP or UDP).

    Addresses are text as the socket module prints them ("" when unbound); `state` is the
    kernel's TCP state number (a UDP socket: 7 TCP_CLOSE, 1 TCP_ESTABLISHED once connected).
    The TCP_REPAIR fields describe a REPAIRED connection: `snd_seq` is write_seq (the
    sequence number after the last byte queued, a FIN not counted), `rcv_seq` is rcv_nxt
    (after the last byte received, a FIN not counted); `send_queue` holds every byte not yet
    acknowledged, the last `unsent` of them never sent; `window` is struct tcp_repair_window.
    """

    ino: int                                   # socket inode (a PENDING one: a number of ptckpt's)
    family: int                                # AF_INET 2, AF_INET6 10
    type: int                                  # SOCK_STREAM 1, SOCK_DGRAM 2, SOCK_RAW 3
    protocol: int                              # IPPROTO_TCP 6, IPPROTO_UDP 17 (raw: any)
    state: int
    mode: int = InetMode.PLAIN
    src: str = ""
    sport: int = 0
    dst: str = ""
    dport: int = 0
    shutdown: int = 0                          # RCV_SHUTDOWN 1 | SEND_SHUTDOWN 2
    backlog: int = 0                           # listen() backlog
    options: tuple[tuple[int, int, bytes], ...] = ()   # (level, optname, value) to set again
    rcv_seq: int = 0
    snd_seq: int = 0
    recv_queue: bytes = b""
    send_queue: bytes = b""
    unsent: int = 0
    mss: int = 0
    tcp_options: int = 0                       # tcp_info.tcpi_options (TCPI_OPT_*)
    snd_wscale: int = 0
    rcv_wscale: int = 0
    timestamp: int = 0                         # TCP_TIMESTAMP
    window: tuple[int, ...] = ()               # snd_wl1, snd_wnd, max_window, rcv_wnd, rcv_wup
    listener: int = 0                          # PENDING: inode of the listener whose queue held it
    peer: int = 0                              # the other end's inode when it is in the tree too
    datagrams: tuple[tuple[str, int, bytes], ...] = ()  # UDP: queued (sender address, port, payload)
    multicast: tuple[tuple[int, str], ...] = ()         # (ifindex, group) memberships
    filter: bytes = b""                        # classic BPF socket filter (struct sock_filter[])


@dataclass(frozen=True)
class NetlinkSocket:
    """An AF_NETLINK socket held inside the tree, bound or not, with nothing queued."""

    ino: int
    type: int                                  # SOCK_RAW 3 or SOCK_DGRAM 2
    protocol: int                              # NETLINK_ROUTE 0 ...
    portid: int                                # bound port id (0: not bound)
    groups: int                                # multicast group bitmask (groups 1-32)
    dst_portid: int = 0                        # connect()ed destination
    dst_group: int = 0
    options: tuple[tuple[int, int, bytes], ...] = ()


@dataclass(frozen=True)
class GhostFile:
    """A file deleted while the tree still had it open or mapped: its bytes go into the image
    (a device node, FIFO, socket or symbolic link, which has no bytes: what it was)."""

    dev: int                  # st_dev, st_ino of the deleted file (fds and VMAs name it so)
    ino: int
    path: str                 # where it was, without " (deleted)"
    mode: int                 # st_mode
    uid: int
    gid: int
    data: bytes = field(repr=False)  # the bytes of `extents`, one after another (before format 8: all)
    mtime_ns: int = 0                # since format 8
    atime_ns: int = 0
    size: int = 0                    # st_size (holes included)
    extents: tuple[tuple[int, int], ...] = ()   # (offset, length) of each data extent (SEEK_DATA/SEEK_HOLE)
    handle: bytes = b""              # a name deleted while the file has other links: its file handle
    xattrs: tuple[tuple[str, bytes], ...] = ()  # extended attributes (name, value), ACLs among them
    rdev: int = 0                    # since format 17: a device node's st_rdev
    target: str = ""                 # since format 17: a symbolic link's target


@dataclass(frozen=True)
class SavedFile:
    """dump --save-file: a file's contents kept in the image and put back before a restore."""

    path: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    data: bytes = field(repr=False)


# --- fds of the other kinds: their state, per open file description (since format 3) ---

@dataclass(frozen=True)
class EventfdState:
    """An eventfd: its counter, and EFD_SEMAPHORE | EFD_NONBLOCK as the description had them."""

    count: int
    flags: int
    desc: int = 0            # the open file description (Fd.desc) it is the state of

    @property
    def semaphore(self) -> bool:
        return bool(self.flags & 1)          # EFD_SEMAPHORE


@dataclass(frozen=True)
class TimerfdState:
    """A timerfd.  value_ns is the time left at dump (0: disarmed); expires_ns the
    absolute expiry on `clockid` at dump (used for TFD_TIMER_ABSTIME timers);
    ticks the expirations not yet read."""

    clockid: int
    flags: int               # TFD_NONBLOCK as recorded
    settime_flags: int       # TFD_TIMER_ABSTIME | TFD_TIMER_CANCEL_ON_SET
    value_ns: int
    interval_ns: int
    ticks: int
    expires_ns: int
    desc: int = 0

    @property
    def armed(self) -> bool:
        return self.value_ns > 0


@dataclass(frozen=True)
class SignalfdState:
    """A signalfd: the signals it accepts, bit N-1 for signal N."""

    mask: int
    flags: int               # SFD_NONBLOCK as recorded
    desc: int = 0

    @property
    def signals(self) -> frozenset[int]:
        return frozenset(n + 1 for n in range(64) if self.mask >> n & 1)


class InotifyWatch(NamedTuple):
    """One watch: its descriptor, the path of the watched inode, its mask (with
    IN_ONESHOT / IN_EXCL_UNLINK, as fdinfo shows them)."""

    wd: int
    path: str
    mask: int


@dataclass(frozen=True)
class InotifyState:
    """An inotify instance: its watches by increasing wd."""

    watches: tuple[InotifyWatch, ...]
    flags: int               # IN_NONBLOCK as recorded
    desc: int = 0
    # (wd, st_dev, st_ino) of each watch on a deleted file (since format 8): its path is
    # where the file was, and the inode is a GhostFile of the image.
    deleted: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class MemfdState:
    """A memfd: name (without "memfd:"), contents (size bytes), seals (F_SEAL_*),
    permission bits and the description's offset."""

    name: str
    contents: bytes
    size: int
    seals: int
    mode: int
    pos: int
    desc: int = 0


@dataclass(frozen=True)
class MqueueState:
    """A POSIX message queue: its name ("/name"), attributes, the description's
    mq_flags (O_NONBLOCK), and its messages as (priority, bytes) in queue order."""

    name: str
    maxmsg: int
    msgsize: int
    flags: int
    messages: tuple[tuple[int, bytes], ...]
    mode: int
    uid: int
    gid: int
    unlinked: bool = False
    desc: int = 0



class EpollTarget(NamedTuple):
    """One registration of an epoll instance: the watched fd's number in the registering
    process, the event mask (EPOLLET, EPOLLONESHOT ... included) and the data word."""

    tfd: int
    events: int
    data: int


@dataclass(frozen=True)
class EpollState:
    """An epoll instance and what it watches."""

    targets: tuple[EpollTarget, ...]
    desc: int = 0
    # Per target (since format 8): 0, or the description (Fd.desc) that holds its file now
    # when the fd number it was registered through has been closed (or holds another file).
    sources: tuple[int, ...] = ()


@dataclass(frozen=True)
class PidfdState:
    """A pidfd (pidfd_open(2), since format 14): the process it refers to, as the tree sees it
    (fdinfo Pid:, a member or a zombie of the tree), or -1 once that process has exited and
    been reaped; the description's PIDFD_NONBLOCK (O_NONBLOCK) and PIDFD_THREAD (O_EXCL) flags.
    `target` numbers the processes the image's pidfds refer to, from 1: descriptions with
    the same number refer to one process (the pidfs inode at dump), which is how the
    pidfds of one dead process come back referring to one dead process again."""

    pid: int
    flags: int
    target: int
    desc: int = 0

    @property
    def dead(self) -> bool:
        return self.pid == -1


@dataclass(frozen=True)
class Terminal:
    """A terminal the root's stdio was on: its settings and job control (since format 3)."""

    termios: bytes            # struct termios2 as TCGETS2 gives it
    rows: int
    cols: int
    xpixel: int
    ypixel: int
    fg_pgrp: int              # its foreground process group, -1 if unknown
    sid: int                  # the session it is the controlling terminal of, -1 if unknown
    controlling: bool         # the root's controlling terminal
    desc: int = 0


class FanotifyMark(NamedTuple):
    """One mark of a fanotify group: on an inode, a mount or a file system (`kind`, one
    of FANOTIFY_MARK_KINDS), named by a path; the user flags the kernel shows for it
    (FAN_MARK_IGNORED_SURV_MODIFY, FAN_MARK_EVICTABLE, FAN_MARK_IGNORE), its mask and
    its ignored mask."""

    kind: int
    path: str
    mflags: int
    mask: int
    ignored_mask: int


FANOTIFY_MARK_KINDS = {0: "inode", 1: "mount", 2: "filesystem"}


@dataclass(frozen=True)
class FanotifyState:
    """A fanotify group (since format 8): its fanotify_init flags and event_f_flags, its
    marks, O_NONBLOCK of the description."""

    init_flags: int
    event_flags: int
    marks: tuple[FanotifyMark, ...]
    flags: int
    desc: int = 0


@dataclass(frozen=True)
class Pty:
    """A pty pair whose master the tree holds (a tmux server, script, expect; since format 8).

    Its slaves in the tree are the Fds of the pty's index (st_rdev); `output` is what the
    slave side wrote that the master had not read yet, given back to the new pair's master;
    `input` what was typed into the master that the slave side had not read yet, its first
    len(input_lines) lines (each as one canonical read returned it) then the rest, a line
    not ended yet (all of it when the slave was not in canonical mode).  `hung_up`: the tree
    had closed the master (the slaves it holds are hung up, /dev/pts/N (deleted)); `desc`
    is then 0 (no master), and the settings are not recorded.
    """

    desc: int                 # the master's open file description
    index: int                # N of /dev/pts/N
    termios: bytes            # struct termios2 of the pair (TCGETS2 on the master)
    rows: int
    cols: int
    xpixel: int
    ypixel: int
    sid: int                  # the session it is the controlling terminal of, -1: none
    fg_pgrp: int              # its foreground process group, -1: none
    locked: bool              # TIOCGPTLCK: the slave cannot be opened yet
    packet: bool              # TIOCGPKT: packet mode on the master
    output: bytes = b""
    input: bytes = b""                      # since format 14
    input_lines: tuple[int, ...] = ()       # since format 14
    hung_up: bool = False                   # since format 14
    slave_uid: int = -1                     # since format 17: the slave's owner, group and
    slave_gid: int = -1                     # permission bits (-1: not recorded, left as a
    slave_mode: int = -1                    # new pty's)


FD_STATE_TYPES = (EventfdState, TimerfdState, SignalfdState, InotifyState, MemfdState, MqueueState,
                  EpollState, FanotifyState, PidfdState)


# --- System V IPC objects the tree uses (inventory.img, since format 2) --------

@dataclass(frozen=True, slots=True)
class ShmImage:
    """A dumped shared memory segment.

    ``perms`` holds the permission bits only; SHM_DEST and SHM_LOCKED are
    ``destroyed`` and ``locked``.  A destroyed segment has key IPC_PRIVATE
    (the kernel drops the key at IPC_RMID).  cpid, lpid, nattch and the
    times are as before the dump's own attach, for information.
    """

    key: int
    shmid: int
    perms: int
    size: int
    uid: int
    gid: int
    cuid: int
    cgid: int
    cpid: int
    lpid: int
    nattch: int
    atime: int
    dtime: int
    ctime: int
    destroyed: bool
    locked: bool
    data: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class SemImage:
    """A dumped semaphore set: one value (and last-operator pid) per semaphore."""

    key: int
    semid: int
    perms: int
    uid: int
    gid: int
    cuid: int
    cgid: int
    values: tuple[int, ...]
    pids: tuple[int, ...]       # sempid per semaphore, for information
    otime: int = 0
    ctime: int = 0

    @property
    def nsems(self) -> int:
        return len(self.values)


@dataclass(frozen=True, slots=True)
class MsgImage:
    """A dumped message queue: its messages (mtype, text) in queue order."""

    key: int
    msqid: int
    perms: int
    uid: int
    gid: int
    cuid: int
    cgid: int
    qbytes: int                 # the queue's byte limit (msg_qbytes)
    messages: tuple[tuple[int, bytes], ...]
    lspid: int = 0
    lrpid: int = 0
    stime: int = 0
    rtime: int = 0
    ctime: int = 0
