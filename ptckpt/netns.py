"""Network namespaces for the restore side (layer 2).

* :func:`new_netns` makes a fresh network namespace without moving the
  caller, brings its loopback device up and returns an fd to it;
* :func:`entered` moves the calling thread into a namespace for the span of
  a ``with`` block (sockets created there, and children forked there, belong
  to it), and back afterwards;
* :func:`current_netns_id` / :func:`open_netns` name and open a thread's or
  process's namespace (/proc/PID/ns/net).

An nsfs fd (from :func:`new_netns` or :func:`open_netns`) keeps its
namespace alive after the last process in it has gone: close it when done.
Every fd made here is O_CLOEXEC.

Python 3.11 has neither os.setns nor os.unshare (both came in 3.12), so
setns(2) and unshare(2) are called through ctypes.

Errors are translated at one choke point, :func:`_wrap_oserror`, which sits
on every public function:

* EPERM, ENOSYS, EOPNOTSUPP, and EINVAL from unshare (no CONFIG_NET_NS):
  the kernel refuses -> :class:`NetnsUnavailable` (exit code
  MISSING_FEATURE)
* a pid without /proc/PID -> :class:`ptckpt.errors.NoSuchProcess`
* any other OSError -> :class:`NetnsError`

An fd that is not a network namespace is a caller's mistake: ValueError.

What the kernel does, as measured on Linux 6.18 (x86_64, root)
--------------------------------------------------------------

* setns(fd, CLONE_NEWNET) and unshare(CLONE_NEWNET) move only the calling
  thread, and work in a multi-threaded process.  /proc/self/ns/net is the
  namespace of the thread-group LEADER, so a thread moved by
  :func:`entered` sees its own only in /proc/thread-self/ns/net; that is
  what :func:`current_netns_id` reads by default.  The same holds for
  /proc/net (a link to self/net): a moved thread that is not the leader
  reads the leader's /proc/net/tcp.
* A socket belongs for good to the namespace its creator was in when it
  called socket(); where it is used later does not matter.  A sock_diag
  netlink socket answers for its own namespace, so
  :func:`ptckpt.inetdiag.inet_sockets` called inside :func:`entered` lists
  the sockets of the entered namespace, and only those.
* A fresh namespace has one device, ``lo``, DOWN and without addresses.
  Setting IFF_UP (SIOCSIFFLAGS) gives it 127.0.0.1/8 and ::1/128, and that
  is all loopback TCP/UDP needs.  Before that, connect() to 127.0.0.1
  fails with ENETUNREACH and bind() to ::1 with EADDRNOTAVAIL, while bind()
  to ANY IPv4 address (10.0.0.1 too) succeeds (presumably because no local
  routing table exists yet to refuse it).  So bring `lo` up before
  restoring sockets.
* The namespace lives as long as a process is in it or an nsfs fd (or a bind
  mount) refers to it; the helper thread that created it may exit at once.
* Ports are per namespace: 127.0.0.1:PORT bound inside does not conflict
  with the same address and port bound outside.
* So are net sysctls: a fresh namespace has net.ipv4.ping_group_range "1 0"
  (no group, not even root's, may open an ICMP ping socket), whatever the
  creator's says; :func:`new_netns` copies the creator's value in.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as _errno
import fcntl
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

from ptckpt import procfs
from ptckpt.errors import ExitCode, NoSuchProcess, OSErrorTranslator, PtckptError

# --- kernel constants ---------------------------------------------------------

CLONE_NEWNET = 0x40000000           # include/uapi/linux/sched.h
NS_GET_NSTYPE = 0xB703              # include/uapi/linux/nsfs.h: _IO(0xb7, 0x3)
SIOCGIFFLAGS = 0x8913               # include/uapi/linux/sockios.h
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1                        # include/uapi/linux/if.h

_IFREQ = struct.Struct("=16sh22x")  # struct ifreq: ifr_name, ifr_flags, rest of the union
LOOPBACK = "lo"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.unshare.argtypes = (ctypes.c_int,)

T = TypeVar("T")


# --- errors of this layer -------------------------------------------------------

class NetnsError(PtckptError):
    """A network namespace operation failed unexpectedly."""

    def __init__(self, what: str, reason: str, err: int | None = None):
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason
        self.errno = err


class NetnsUnavailable(NetnsError):
    """The kernel refuses: no network namespaces, or not privileged enough."""

    exit_code = ExitCode.MISSING_FEATURE


_REFUSED = frozenset({_errno.EPERM, _errno.ENOSYS, _errno.EOPNOTSUPP})


_ERRORS = OSErrorTranslator(NetnsError, NetnsUnavailable, _REFUSED, "refused by the kernel")
_wrap_oserror = _ERRORS.wrap


# --- raw calls ------------------------------------------------------------------------

def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _unshare_netns() -> None:
    if _libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        if err == _errno.EINVAL:        # CLONE_NEWNET unknown: CONFIG_NET_NS is off
            err = _errno.EOPNOTSUPP
        raise OSError(err, os.strerror(err))


def _proc_ns_path(pid: int | str) -> str:
    return f"/proc/{pid}/ns/net"


def _open_ns(pid: int | str) -> int:
    """An O_CLOEXEC nsfs fd for the network namespace of pid ("self", "thread-self")."""
    try:
        return os.open(_proc_ns_path(pid), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        if isinstance(pid, int):
            raise NoSuchProcess(pid) from None
        raise


def _require_netns_fd(fd: int) -> None:
    """ValueError unless fd is an nsfs fd of a network namespace."""
    try:
        nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError as err:
        if err.errno in (_errno.ENOTTY, _errno.EINVAL):
            raise ValueError(f"fd {fd} is not a namespace fd") from None
        raise
    if nstype != CLONE_NEWNET:
        raise ValueError(f"fd {fd} is a namespace fd, but not of a network namespace "
                         f"(type {nstype:#x})")


def in_helper_thread(fn: Callable[[], T]) -> T:
    """Run fn in a short-lived thread of its own and return (or raise) what it did.

    setns/unshare there move only that thread, never the caller.
    """
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:            # handed back to the caller below
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="ptckpt-netns", daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _set_loopback_up() -> None:
    """IFF_UP on `lo` of the calling thread's network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        name = LOOPBACK.encode()
        raw = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, _IFREQ.pack(name, 0))
        _name, flags = _IFREQ.unpack(raw)
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, _IFREQ.pack(name, flags | IFF_UP))


# --- public API -----------------------------------------------------------------------

@_wrap_oserror("reading a network namespace id")
def current_netns_id(pid: int | str = "thread-self") -> int:
    """The inode number identifying the network namespace of `pid`.

    `pid` is a process (or thread) id, "self" (the thread-group leader of
    this process) or "thread-self" (the calling thread: the default, which
    follows :func:`entered`).  Two ids are equal exactly when the namespaces
    are the same (all nsfs inodes live on one device).
    """
    try:
        return os.stat(_proc_ns_path(pid)).st_ino
    except FileNotFoundError:
        if isinstance(pid, int):
            raise NoSuchProcess(pid) from None
        raise


@_wrap_oserror("opening a network namespace")
def open_netns(pid: int | str = "thread-self") -> int:
    """An O_CLOEXEC fd on the network namespace of `pid` (see current_netns_id).

    The caller owns the fd; it keeps the namespace alive until closed.
    """
    return _open_ns(pid)


@contextlib.contextmanager
def entered(ns_fd: int) -> Iterator[None]:
    """Move the calling thread into the network namespace `ns_fd` for a ``with`` block.

    Sockets created inside belong to that namespace for good; processes
    forked inside start there.  On the way out, normal or by an exception,
    the thread goes back to the namespace it was in.  Enter and leave on the
    same thread.  Only that thread moves: other threads, and /proc/self
    when the caller is not the main thread, stay where they were.
    """
    home = _enter(ns_fd)
    try:
        yield
    finally:
        _leave(home)


@_wrap_oserror("entering a network namespace")
def _enter(ns_fd: int) -> int:
    """setns into ns_fd; the fd of the namespace we came from (to _leave with)."""
    _require_netns_fd(ns_fd)
    home = _open_ns("thread-self")
    try:
        _setns(ns_fd)
    except BaseException:
        os.close(home)
        raise
    return home


@_wrap_oserror("going back to the original network namespace")
def _leave(home: int) -> None:
    try:
        _setns(home)
    finally:
        os.close(home)


@_wrap_oserror("bringing up the loopback device")
def loopback_up(ns_fd: int) -> None:
    """Set `lo` up in the network namespace ns_fd (the caller does not move)."""
    _require_netns_fd(ns_fd)

    def inside() -> None:
        _setns(ns_fd)
        _set_loopback_up()
    in_helper_thread(inside)


@_wrap_oserror("creating a network namespace", _REFUSED)
def new_netns() -> int:
    """A fresh network namespace with `lo` up: an O_CLOEXEC nsfs fd to it.

    The caller does not move: the namespace is made by unshare(CLONE_NEWNET)
    in a short-lived helper thread, which opens it, brings `lo` up and
    exits.  The fd keeps the namespace alive; close it when done (enter it
    with :func:`entered`).
    """
    def make() -> int:
        inherited = _read_sysctls()
        _unshare_netns()
        fd = _open_ns("thread-self")
        try:
            _set_loopback_up()
            _write_sysctls(inherited)
        except BaseException:
            os.close(fd)
            raise
        return fd
    return in_helper_thread(make)


# Per-namespace settings a fresh namespace takes from the one it is made from: without
# them a program restored there could not do what it did (ping_group_range: a fresh
# namespace says "1 0", no group may open ping sockets, root's neither).
INHERITED_SYSCTLS = ("net/ipv4/ping_group_range",)


def _read_sysctls() -> dict[str, str]:
    """The calling thread's namespace's values (/proc/sys/net is the current thread's)."""
    out = {}
    for name in INHERITED_SYSCTLS:
        with contextlib.suppress(OSError):
            out[name] = procfs.read_sysctl(name)
    return out


def _write_sysctls(values: dict[str, str]) -> None:
    for name, value in values.items():
        with contextlib.suppress(OSError), open(f"/proc/sys/{name}", "w") as f:
            f.write(value)
