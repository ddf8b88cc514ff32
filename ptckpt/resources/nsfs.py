"""Namespace files held open: an fd on /proc/PID/ns/KIND, or on a namespace bind-mounted
somewhere (``ip netns add`` mounts one at /run/netns/NAME).

An nsfs fd pins a namespace; what it names is an identity, not a path.  Two kinds come
back:

* a namespace the process is in itself (the fd's inode is that of one of its
  /proc/PID/ns entries; /proc/self/ns/net as zdtm's proc-self opens it): the dump records
  which entry (detail ``("ns", "net")``), the restore opens /proc/self/ns/<entry> inside
  the restored process, so the fd names the namespace the process is in after the restore
  (a restore with --netns: its new one), as it did before;
* a namespace opened through a mount point (its /proc/PID/fd link is that path), or one
  the process is not in, bind-mounted where ptckpt can see it (a line of
  /proc/self/mountinfo with file system type nsfs whose root is the fd's link text): the
  dump records the mount point (detail ``("ns-bound", path)``), the restore opens it in
  ptckpt and hands it over.  Only on a host where that very namespace is still mounted
  there: another namespace of the same name (deleted and added again) is refused before
  anything is built (:func:`host_problems`), by the namespace's NS_GET_ID where the
  kernel has it (inode numbers are used again), else by its inode.

Any other namespace (another process's, with no name on this host) has nothing a restore
could find it by: the dump refuses it, by name, with the ways out (:func:`refusal`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import struct
from collections.abc import Iterable

from .. import procfs
from ..errors import PtckptError, RestoreFailed
from ..netns import in_helper_thread
from ..formats.model import Fd, FdKind

NS_DETAIL = "ns"                # an entry of /proc/PID/ns: the process's own namespace
BOUND_DETAIL = "ns-bound"       # a mount point of the namespace (another one)
ID_DETAIL = "ns-id"             # its NS_GET_ID, when the kernel has it
NS_GET_ID = (2 << 30) | (8 << 16) | (0xB7 << 8) | 0xD    # include/uapi/linux/nsfs.h: _IOR(0xb7, 0xd, __u64)

# /proc/PID/ns entries, by the prefix of the link text they read as; the plain entry first
# (pid_for_children and time_for_children read as pid:[..] and time:[..] too).
ENTRIES = {
    "cgroup": ("cgroup",), "ipc": ("ipc",), "mnt": ("mnt",), "net": ("net",),
    "pid": ("pid", "pid_for_children"), "time": ("time", "time_for_children"),
    "user": ("user",), "uts": ("uts",),
}


def kind_of(link: str) -> str:
    """'net' for 'net:[4026531833]' ("" for a mount point's path)."""
    return "" if link.startswith("/") else link.split(":", 1)[0]


# --- dump half -----------------------------------------------------------------------

def dump_details(pid: int, fd: int, link: str, st: os.stat_result | None) -> list[tuple[str, str]]:
    """The details of an nsfs fd of `pid` (its link text, the stat of its file): the entry of
    /proc/PID/ns it is, or a mount point of it, or nothing (refused by :func:`refusal`)."""
    if st is None:
        return []
    if link.startswith("/"):                   # opened through a mount point: that name
        return _with_id([(BOUND_DETAIL, link)], pid, fd)
    for entry in ENTRIES.get(kind_of(link), ()):
        with contextlib.suppress(OSError, PtckptError):
            own = procfs.stat_namespace(pid, entry)
            if (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino):
                return [(NS_DETAIL, entry)]
    path = mount_point(link, st)
    return _with_id([(BOUND_DETAIL, path)], pid, fd) if path else []


def _with_id(details: list[tuple[str, str]], pid: int, fd: int) -> list[tuple[str, str]]:
    """A bound namespace's id beside its path: inode numbers are used again by namespaces
    made later (one deleted and added again under its name got the same one here)."""
    ident = ns_id(f"/proc/{pid}/fd/{fd}")
    return details + [(ID_DETAIL, str(ident))] if ident else details


def ns_id(path: str) -> int:
    """The namespace's 64-bit id (NS_GET_ID, Linux 6.18; unlike its inode number, never
    given to another namespace later), or 0 where the kernel lacks it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        return struct.unpack("Q", fcntl.ioctl(fd, NS_GET_ID, bytes(8)))[0]
    except OSError:
        return 0
    finally:
        os.close(fd)


def mount_point(link: str, st: os.stat_result) -> str:
    """Where ptckpt sees namespace `link` bind-mounted ("" if nowhere): an nsfs mount whose
    root is the link text (man 5 proc: mountinfo fields 4, root, and 5, mount point) and
    whose file is that namespace still."""
    with contextlib.suppress(OSError, PtckptError):
        for line in procfs.read_mountinfo("self"):
            left, _, right = line.partition(b" - ")
            fields = left.split(b" ")
            if not right.startswith(b"nsfs ") or len(fields) < 5 or os.fsdecode(fields[3]) != link:
                continue
            path = _unescape(os.fsdecode(fields[4]))
            with contextlib.suppress(OSError):
                here = os.stat(path)
                if (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino):
                    return path
    return ""


def _unescape(path: str) -> str:
    """mountinfo's octal escapes (space, tab, newline, backslash) undone."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def refusal(f: Fd) -> str | None:
    """Why a restore cannot give fd `f` back (None: it can)."""
    if own_entry(f) or bound_path(f):
        return None
    kind = kind_of(f.path)
    return (f"fd {f.fd} -> {f.path} (a {kind} namespace the process is not in, mounted nowhere "
            f"ptckpt can see: no restore could find it again; close the fd before the dump, or "
            f"give the namespace a name on this host (for a net namespace: ip netns attach NAME PID, "
            f"or a bind mount of /proc/PID/ns/{kind}) and dump again, or name it with "
            f"--external fd:{f.fd} for a plugin that opens it again)")


# --- restore half --------------------------------------------------------------------

def own_entry(f: Fd) -> str:
    """The /proc/self/ns entry fd `f` was ("" if none)."""
    entry = dict(f.details).get(NS_DETAIL, "") if f.kind is FdKind.NSFS else ""
    return entry if entry in {e for entries in ENTRIES.values() for e in entries} else ""


def bound_path(f: Fd) -> str:
    """The mount point of the other namespace fd `f` was on ("" if none)."""
    return dict(f.details).get(BOUND_DETAIL, "") if f.kind is FdKind.NSFS and not own_entry(f) else ""


def reopen_path(f: Fd) -> str:
    """What the restored process opens for an fd of its own namespace."""
    return f"/proc/self/ns/{own_entry(f)}"


# Kinds a thread may enter by itself (setns moves only the calling thread): an fd of one
# opened as /proc/thread-self/ns/<kind> from inside reads as "net:[N]", as the dumped one
# did; the others are opened at their mount point (their link text is then that path).
_PER_THREAD = ("net", "uts", "ipc")
_libc = ctypes.CDLL(None, use_errno=True)


def open_bound(f: Fd) -> int:
    """An fd (O_CLOEXEC) of the namespace bound at `f`'s mount point, in ptckpt."""
    path, kind = bound_path(f), kind_of(f.path)
    flags = f.flags & os.O_ACCMODE | os.O_CLOEXEC
    try:
        if kind not in _PER_THREAD:
            return os.open(path, flags)
        return in_helper_thread(lambda: _enter_and_open(path, kind, flags))
    except OSError as err:
        raise RestoreFailed(f"cannot reopen fd {f.fd} ({f.path}) at {path}: {err.strerror}") from None


def _enter_and_open(path: str, kind: str, flags: int) -> int:
    ns = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(ns, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(ns)
    return os.open(f"/proc/thread-self/ns/{kind}", flags)


def host_problems(fds: Iterable[Fd]) -> list[str]:
    """Bound namespaces this host does not have any more at their mount point (gone, or
    another namespace mounted there since the dump)."""
    out = []
    for f in fds:
        path = bound_path(f)
        if not path or f.skipped or f.external:
            continue
        try:
            st = os.stat(path)
        except OSError as err:
            out.append(f"fd {f.fd} -> {f.path}: its namespace was mounted at {path}, which is gone "
                       f"({err.strerror}); restore where it still exists")
            continue
        recorded = int(dict(f.details).get(ID_DETAIL, "0"))
        if (st.st_dev, st.st_ino) != (f.dev, f.ino) or recorded and ns_id(path) != recorded:
            out.append(f"fd {f.fd} -> {f.path}: {path} holds another namespace now than at the dump "
                       f"(made since, under that name): the one of the dump is gone")
    return out
