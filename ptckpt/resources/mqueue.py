"""POSIX message queue fds: attributes and messages, and the queue again.

Dump half (:func:`dump`, through resources.anonfds.dump_anon_fd), from its fdinfo and a
copy of the fd (pidfd_getfd), which shares the target's open file description:

mqueue: attributes by mq_getattr; the link is the queue's name as mq_open(3) takes it
("/name", " (deleted)" appended once mq_unlink()ed). Messages cannot be peeked, so they
are all received through a fresh non-blocking description of the queue and sent back, in
the order received (highest priority first, oldest first within one priority), with their
priorities: the queue is the same afterwards.

Restore half (:func:`make`, through resources.anonfds.create_anon_fd), with the
status flags (O_NONBLOCK ...) of the recorded description:

mqueue opened by name: created (O_EXCL, with its attributes, mode and owner) when it is
gone, then filled with the messages. When a queue of that name exists (it outlived the
checkpointed processes), it is taken to be the original: it must have the same maxmsg and
msgsize, and it is emptied and refilled, because a restart must begin from the
checkpointed state. A queue that was unlinked is made under a temporary name, filled, and
unlinked again. The description handed back is a fresh open of the queue with the recorded
access mode.

Limits: the queue of ptckpt's IPC namespace is used at both ends; an mq_notify registration is
refused; while the messages are out (between receive and send at dump, drain and refill at
restore) a process outside the tree blocked in mq_timedsend/mq_timedreceive on the same
queue could slip a message in or take one, which the dump detects (the message count
differs afterwards) but cannot undo.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import os
import re
import stat as _stat
import time

from .. import procfs
from ..errors import PtckptError
from ..formats.model import FdKind, MqueueState
from .fdstate import (MQUEUE_MAGIC, O_ACCMODE, O_CLOEXEC, O_NONBLOCK, FdKindOps, Target, check, closing_on_error,
                      copy_of, fs_type, proto, set_status_flags)

class _MqAttr(ctypes.Structure):
    _fields_ = [("mq_flags", ctypes.c_long), ("mq_maxmsg", ctypes.c_long),
                ("mq_msgsize", ctypes.c_long), ("mq_curmsgs", ctypes.c_long),
                ("_reserved", ctypes.c_long * 4)]


_c_int, _c_uint, _c_char_p = ctypes.c_int, ctypes.c_uint, ctypes.c_char_p
# mq_open is variadic (mode, attr); on x86_64 integer and pointer arguments are
# passed the same way either way.
_mq_open = proto("mq_open", _c_int, _c_char_p, _c_int, _c_uint, ctypes.POINTER(_MqAttr))
_mq_getattr = proto("mq_getattr", _c_int, _c_int, ctypes.POINTER(_MqAttr))
_mq_send = proto("mq_send", _c_int, _c_int, _c_char_p, ctypes.c_size_t, _c_uint)
_mq_receive = proto("mq_receive", ctypes.c_ssize_t, _c_int, ctypes.c_void_p, ctypes.c_size_t,
                    ctypes.POINTER(_c_uint))
_mq_unlink = proto("mq_unlink", _c_int, _c_char_p)


# --- dump half -----------------------------------------------------------------

def is_mqueue(pid: int, fd: int) -> bool:
    """Is fd `fd` of `pid` a POSIX message queue?  (mq_open(3) opens it on the IPC
    namespace's internal mount, which /proc/PID/mountinfo does not list.)"""
    try:
        with copy_of(Target(pid, fd, "")) as copy:
            return fs_type(copy) == MQUEUE_MAGIC
    except OSError:
        return False


def dump(t: Target, info: procfs.FdInfo) -> MqueueState:
    path = t.link.removesuffix(" (deleted)")
    name = "/" + path.rsplit("/", 1)[-1]
    with copy_of(t) as copy:
        if fs_type(copy) != MQUEUE_MAGIC:
            raise t.unsupported("not a POSIX message queue")
        attr = _getattr(copy)
        st = os.fstat(copy)
        # A description of our own, non-blocking and readable whatever the target's is.
        own = os.open(f"/proc/self/fd/{copy}", os.O_RDWR | O_NONBLOCK | O_CLOEXEC)
    try:
        notify_pid = _mq_status(own).get("NOTIFY_PID", "0")
        if notify_pid != "0":
            raise t.unsupported(f"an mq_notify registration (by pid {notify_pid})")
        messages = _take_and_put_back(t, own, attr.mq_msgsize)
    finally:
        os.close(own)
    if len(messages) != attr.mq_curmsgs:
        raise PtckptError(f"process {t.pid} fd {t.fd} ({t.link}): held {attr.mq_curmsgs} "
                          f"messages but {len(messages)} were read: another process uses it")
    return MqueueState(name=name, maxmsg=attr.mq_maxmsg, msgsize=attr.mq_msgsize,
                       flags=attr.mq_flags & O_NONBLOCK, messages=tuple(messages),
                       mode=_stat.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid,
                       unlinked=t.link.endswith(" (deleted)"))


def _take_and_put_back(t: Target, qd: int, msgsize: int) -> list[tuple[int, bytes]]:
    """Every message of the queue, received and sent back in the same order.

    What was received is sent back even when receiving fails halfway.
    """
    messages: list[tuple[int, bytes]] = []
    try:
        _drain(qd, msgsize, messages)
    finally:
        try:
            _refill(qd, messages)
        except OSError as err:
            raise PtckptError(f"process {t.pid} fd {t.fd} ({t.link}): could not put its "
                              f"messages back ({err.strerror}); the queue lost some") from None
    return messages


def _getattr(qd: int) -> _MqAttr:
    attr = _MqAttr()
    check(_mq_getattr(qd, ctypes.byref(attr)), "mq_getattr")
    return attr


def _mq_status(qd: int) -> dict[str, str]:
    """The queue's status line ("QSIZE:.. NOTIFY:.. SIGNO:.. NOTIFY_PID:..") as a dict."""
    text = os.pread(qd, 256, 0).decode(errors="replace")
    return dict(re.findall(r"([A-Z_]+):(\S+)", text))


def _drain(qd: int, msgsize: int,
           out: list[tuple[int, bytes]] | None = None) -> list[tuple[int, bytes]]:
    """Receive every message of the non-blocking queue `qd` into `out`: [(priority, bytes)]."""
    buf = ctypes.create_string_buffer(max(msgsize, 1))
    prio = ctypes.c_uint()
    out = [] if out is None else out
    while True:
        n = _mq_receive(qd, buf, len(buf), ctypes.byref(prio))
        if n < 0:
            err = ctypes.get_errno()
            if err == _errno.EAGAIN:
                return out
            raise OSError(err, f"mq_receive: {os.strerror(err)}")
        out.append((prio.value, buf.raw[:n]))


def _refill(qd: int, messages: list[tuple[int, bytes]] | tuple[tuple[int, bytes], ...]) -> None:
    """Send `messages` in order: within a priority they queue in sending order."""
    for prio, data in messages:
        check(_mq_send(qd, data, len(data), prio), "mq_send")


# --- restore half --------------------------------------------------------------

def make(state: MqueueState, flags: int) -> int:
    qd = _open_queue(state)
    try:
        _drain(qd, state.msgsize)
        try:
            _refill(qd, state.messages)
        except BlockingIOError:
            raise OSError(_errno.EAGAIN, f"its {len(state.messages)} messages do not fit") from None
        fd = _reopen_queue(state, qd, flags & O_ACCMODE)
    finally:
        os.close(qd)
    with closing_on_error(fd):
        set_status_flags(fd, flags)
    return fd


def _reopen_queue(state: MqueueState, qd: int, access: int) -> int:
    """A description of the queue with the recorded access mode, made as mq_open(3) makes
    one: an open() through /proc/self/fd would add O_LARGEFILE, which F_GETFL then shows."""
    if access == os.O_RDWR:
        return fcntl.fcntl(qd, fcntl.F_DUPFD_CLOEXEC, 0)
    if not state.unlinked:
        return check(_mq_open(os.fsencode(state.name), access | O_CLOEXEC | O_NONBLOCK, 0, None),
                      f"mq_open {state.name}")
    return os.open(f"/proc/self/fd/{qd}", access | O_CLOEXEC)     # no name left to open it by


def _open_queue(state: MqueueState) -> int:
    """A non-blocking O_RDWR description of the queue: the existing one of the name
    (same attributes required), or a new one (unlinked again if it was)."""
    attr = _MqAttr(0, state.maxmsg, state.msgsize, 0)
    create = os.O_RDWR | O_NONBLOCK | os.O_CREAT | os.O_EXCL
    if state.unlinked:
        name = f"/ptckpt-{os.getpid()}-{time.monotonic_ns()}"
        qd = check(_mq_open(os.fsencode(name), create, state.mode, ctypes.byref(attr)),
                    f"mq_open {name}")
        _mq_unlink(os.fsencode(name))
        created = True
    else:
        qd = _mq_open(os.fsencode(state.name), create, state.mode, ctypes.byref(attr))
        created = qd >= 0
        if not created:
            if ctypes.get_errno() != _errno.EEXIST:
                check(qd, f"mq_open {state.name}")
            qd = check(_mq_open(os.fsencode(state.name), os.O_RDWR | O_NONBLOCK, 0, None),
                        f"mq_open {state.name}")
    with closing_on_error(qd):
        if created:
            os.fchown(qd, state.uid, state.gid)
            os.fchmod(qd, state.mode)         # mq_open applied the umask
        else:
            have = _getattr(qd)
            if (have.mq_maxmsg, have.mq_msgsize) != (state.maxmsg, state.msgsize):
                raise OSError(_errno.EEXIST, f"a queue of that name exists with maxmsg "
                                             f"{have.mq_maxmsg} and msgsize {have.mq_msgsize}, "
                                             f"not {state.maxmsg} and {state.msgsize}")
    return qd


def describe(state: MqueueState) -> str:
    return f"mqueue {state.name}"


KIND = FdKindOps(FdKind.MQUEUE, MqueueState, dump, make, describe)
