"""Every kind of kernel object a tree can hold, and who answers for it: one table.

Each row names a kind as /proc or the kernel shows it (an fd kind, an anon_inode name, a
socket's family, type and protocol, a mapping kind, a namespace file; and, kept beside the
code that checks them, the fields of /proc status, the keys of fdinfo and the VmFlags of
smaps) and either the module that dumps and restores it, or the refusal a dump gives,
with the way out.  The dump's checks look kinds up here (resources.files for fds and
sockets, resources.memory for mappings, ptckpt.claims for namespaces): a kind the table
does not know is refused, never passed over.  ``ptckpt check --kinds`` prints the table
(ptckpt.check.kinds_table, with the rows those modules keep).

Adding a kind: its module under resources/ (dump and restore halves side by side), its
row in resources.registry (its operations, and which keys of this table it answers for),
then its row here, naming that module (an anonymous-fd kind: one row in resources.anonfds'
KINDS instead of the registry's, whose "fd states" row dispatches through them).
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats.model import FdKind, VmaKind


@dataclass(frozen=True)
class Kind:
    """One row: `by` the module that dumps and restores it, or `refusal` why a dump refuses
    it and the way out ({fd} is the fd number where the row is an fd's)."""

    family: str
    name: str
    by: str = ""
    refusal: str = ""

    @property
    def restored(self) -> bool:
        return bool(self.by)


def _fds(family: str, rows: dict) -> dict:
    return {k: Kind(family, getattr(k, "name", str(k)).lower(), *v) for k, v in rows.items()}


def _anon(module: str) -> tuple[str]:
    """A kind of resources.anonfds' registry: its own module, one row there."""
    return (f"resources.{module} (state from fdinfo, object made again in ptckpt, handed over; "
            f"a row of resources.anonfds)",)


_BY_PATH = "resources.files (reopened by path at its offset and flags; deleted: a ghost file in the image)"

# -- fds, by the kind resources.files.classify_fd gives them --------------------------
FD: dict[FdKind, Kind] = _fds("fd", {
    FdKind.REGULAR: (_BY_PATH,),
    FdKind.DIRECTORY: (_BY_PATH,),
    FdKind.PATH: ("resources.files (O_PATH, reopened by path)",),
    FdKind.CHARDEV: ("resources.files (device nodes reopened by path)",),
    FdKind.PIPE: ("resources.pipes (made in ptckpt with their bytes, handed over)",),
    FdKind.FIFO: ("resources.pipes (FIFOs reopened by path, with their bytes)",),
    FdKind.SOCKET: ("by family, type and protocol: see the socket rows",),
    FdKind.EVENTFD: _anon("eventfd"), FdKind.TIMERFD: _anon("timerfd"), FdKind.SIGNALFD: _anon("signalfd"),
    FdKind.INOTIFY: _anon("inotify"), FdKind.FANOTIFY: _anon("fanotify"), FdKind.MEMFD: _anon("memfd"),
    FdKind.MQUEUE: _anon("mqueue"),
    FdKind.EPOLL: ("resources.epoll (its watches registered again once every fd exists)",),
    FdKind.TTY: ("resources.terminals (by path; a shell job's terminal is the restore's own)",),
    FdKind.PTY_MASTER: ("resources.terminals (the pair made again, queued data both ways)",),
    FdKind.PTY_SLAVE: ("resources.terminals (with its master in the tree, or the controlling terminal)",),
    FdKind.PIDFD: ("resources.pidfds (of a member, a zombie or a reaped process of the tree)",),
    FdKind.NSFS: ("resources.nsfs (the process's own namespace, or one with a mount point)",),
    FdKind.BLOCKDEV: ("", "a block device opened as a file; checkpoint when the program has closed it"),
    FdKind.IO_URING: ("", "an io_uring instance; its rings, registered files and buffers and the "
                          "requests in flight live in the kernel, which lets no one read them back or "
                          "make them again; checkpoint when the program has closed its ring (e.g. a "
                          "build without io_uring), or name it with --external fd:{fd} for a plugin "
                          "that makes one again"),
    FdKind.USERFAULTFD: ("", "a userfaultfd: the page faults it serves and its registrations live in "
                             "the kernel; checkpoint when the program has closed it"),
    FdKind.PERF_EVENT: ("", "a perf event counter; checkpoint when the program has closed it"),
    FdKind.BPF: ("", "an eBPF object (map, program or link); checkpoint when the program has closed it"),
    FdKind.ANON_INODE: ("", "an anonymous-inode kind this ptckpt does not know"),
    FdKind.UNKNOWN: ("", "a kind of file this ptckpt does not know"),
})

# -- anon_inode:NAME links, and the fd kind each is -------------------------------------
ANON_INODES: dict[str, FdKind] = {
    "[eventfd]": FdKind.EVENTFD, "[eventpoll]": FdKind.EPOLL, "[timerfd]": FdKind.TIMERFD,
    "[signalfd]": FdKind.SIGNALFD, "inotify": FdKind.INOTIFY, "[fanotify]": FdKind.FANOTIFY,
    "[io_uring]": FdKind.IO_URING, "[userfaultfd]": FdKind.USERFAULTFD, "[pidfd]": FdKind.PIDFD,
    "[perf_event]": FdKind.PERF_EVENT,
}


def anon_inode_kind(name: str) -> FdKind:
    """The fd kind of anon_inode:NAME: one the table knows, else ANON_INODE (refused)."""
    if name.startswith("bpf"):
        return FdKind.BPF
    return ANON_INODES.get(name, FdKind.ANON_INODE)


# -- sockets, by (family, type, protocol); "*" matches any -------------------------------
_TCP, _UDP = "resources.inet (TCP: listening, or established with --tcp-established / --tcp-close)", \
    "resources.inet (UDP: addresses, options, queued datagrams sent again)"
SOCKETS: dict[tuple[str, str, str], Kind] = {key: Kind("socket", " ".join(key), *v) for key, v in {
    ("AF_UNIX", "*", "*"): ("resources.sockets (names, connections, queues, fds and credentials in flight)",),
    ("AF_NETLINK", "*", "*"): ("resources.netlink (protocol, port id, groups)",),
    **{(fam, "SOCK_STREAM", p): (_TCP,) for fam in ("AF_INET", "AF_INET6") for p in ("0", "6")},
    **{(fam, "SOCK_DGRAM", p): (_UDP,) for fam in ("AF_INET", "AF_INET6") for p in ("0", "17")},
    **{(fam, "SOCK_DGRAM", "136"): ("resources.inet (UDP-Lite, with its checksum coverage)",)
       for fam in ("AF_INET", "AF_INET6")},
    ("AF_INET", "SOCK_DGRAM", "1"): ("resources.inet (ICMP ping socket: echo id, peer, options)",),
    ("AF_INET6", "SOCK_DGRAM", "58"): ("resources.inet (ICMPv6 ping socket: echo id, peer, options)",),
    **{(fam, "SOCK_RAW", "*"): ("resources.inet (raw IP socket, any protocol: address, peer, options "
                                "such as IP_HDRINCL and ICMP filters; made again with CAP_NET_RAW, "
                                "packets queued refused)",) for fam in ("AF_INET", "AF_INET6")},
    ("AF_PACKET", "*", "*"): ("", "a packet socket"),
}.items()}


def socket_kind(family: str, type_: str, protocol: str) -> Kind:
    """The row of a socket (its family, type and protocol as the dump's details name them);
    one the table does not know is refused."""
    for key in ((family, type_, protocol), (family, type_, "*"), (family, "*", "*")):
        if key in SOCKETS:
            return SOCKETS[key]
    return Kind("socket", f"{family} {type_} {protocol}", "", "a socket of this family and type")


# -- mappings, by resources.memory.classify_vma's kind ------------------------------------
_MAPPED = "resources.memory (mapped again at its address, its saved pages filled)"
MAPPINGS: dict[VmaKind, Kind] = _fds("mapping", {
    VmaKind.ANON_PRIVATE: (_MAPPED,), VmaKind.HEAP: (_MAPPED,), VmaKind.STACK: (_MAPPED,),
    VmaKind.ANON_SHARED: ("resources.memory (one object per shared mapping, made once for every process)",),
    VmaKind.FILE_PRIVATE: ("resources.memory (the file by path, its written pages saved; a deleted "
                           "file or memfd from the image)",),
    VmaKind.FILE_SHARED: ("resources.memory (the file by path; deleted: a ghost file in the image)",),
    VmaKind.SHMEM: ("resources.memory, resources.sysvipc (memfd, /dev/shm and SysV segments, "
                    "with their data)",),
    VmaKind.VDSO: ("resources.vdso, resources.memory (its bytes saved; this kernel's vdso moved to its "
                   "address, or, for another kernel build's, the image's bytes with each function's entry "
                   "leading into this kernel's vdso: the vdso proxy)",),
    VmaKind.VVAR: ("resources.memory (with the vdso)",), VmaKind.VVAR_VCLOCK: ("resources.memory (with the vdso)",),
    VmaKind.VSYSCALL: ("the kernel's own (the same in every process)",),
    VmaKind.DEVICE: ("resources.memory (the device node mapped again by path)",),
    VmaKind.OTHER: ("", "a kind of mapping ptckpt cannot make again"),
})

# -- the instruction set a process runs (its program's ELF class) ------------------------
ABIS: dict[str, Kind] = {n: Kind("abi", n, *v) for n, v in {
    "x86_64": ("ptckpt.tracee, the restorer stub (64-bit registers, syscalls and signal frames)",),
    "ia32": ("ptckpt.tracee (x86_64 syscalls injected in 64-bit mode, the compat ones through "
             "int $0x80; returnframe32: their way home), resources.threads (TLS entries, the compat robust list), resources.memory "
             "(this kernel's 32-bit vdso), resources.signals (ia32 handlers), resources.files (the "
             "compat openat: no O_LARGEFILE): 32-bit processes in any tree (64-bit parents and "
             "children too), with everything a 64-bit one may hold",),
}.items()}


# -- namespace files of /proc/PID/ns ------------------------------------------------------
_OWN = "ptckpt's own: a member in another is refused (claims.check_namespaces), run ptckpt in it"
NAMESPACES: dict[str, Kind] = {n: Kind("namespace", n, *v) for n, v in {
    "pid": ("resources.pids (the same pids, or a pid namespace of its own with --pidns)",),
    "pid_for_children": ("resources.pids: its own pid namespace (another, after an "
                         "unshare(CLONE_NEWPID) not yet followed by a fork, is refused)",),
    "net": ("ptckpt's own at dump (claims.check_namespaces); at restore the restore's own, or one "
            "of its own with --netns (ptckpt.netns)",),
    "mnt": (_OWN,), "uts": (_OWN,), "ipc": (_OWN,), "user": (_OWN,), "cgroup": (_OWN,),
    "time": (_OWN,), "time_for_children": (_OWN,),
}.items()}
