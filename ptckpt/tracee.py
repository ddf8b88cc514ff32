"""Tracee control: the one module that touches python-ptrace.

Layer 1 of the design (DESIGN.md).  It exposes snake_case objects:

* :class:`Task` -- one kernel thread: seize/interrupt/wait/detach, registers
  (NT_PRSTATUS and NT_X86_XSTATE regsets), sigmask, queued siginfo, rseq
  configuration, robust list.
* :class:`AddressSpace` -- the memory of one thread group: bulk reads with
  process_vm_readv, /proc/PID/mem for the rest.
* :class:`Session` -- tid -> Task for everything we seized, freeze and
  resume of whole processes.
* :func:`remote_syscalls` -- the injection scope (rr's AutoRemoteSyscalls):
  saves the thread's registers, runs syscalls at a ``syscall`` instruction
  inside the tracee and puts everything back on exit, even while an exception
  unwinds.

python-ptrace gives the ptrace() binding, ``user_regs_struct`` and the syscall
table; the requests it lacks (SEIZE, INTERRUPT, LISTEN, GETREGSET for xstate,
PEEKSIGINFO, GET/SETSIGMASK, GET_RSEQ_CONFIGURATION) are added here and
nowhere else.  Every PtraceError / OSError is translated into the typed errors
of :mod:`ptckpt.errors` by :func:`_ptrace` and :func:`_translate_os_error`; no
bare OSError or PtraceError leaves this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import logging
import os
import signal
import struct
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from ptrace.binding import func as _pt
from ptrace.binding.linux_struct import user_regs_struct as _user_regs_struct
from ptrace.error import PtraceError
from ptrace.syscall.linux.x86_64 import SYSCALL_NAMES as _SYSCALL_NAMES

from .errors import (
    AccessDenied,
    RemoteSyscallError,
    TargetVanished,
    TraceeError,
)
from . import returnframe, returnframe32, state, testhooks
from .formats.model import GP_REG_NAMES, PAGE_SIZE

# --- ptrace requests python-ptrace lacks (include/uapi/linux/ptrace.h) ------
PTRACE_GETREGS = 12
PTRACE_SETOPTIONS = 0x4200
PTRACE_SETREGS = 13
PTRACE_GETREGSET = 0x4204
PTRACE_SECCOMP_GET_FILTER = 0x420C
PTRACE_SECCOMP_GET_METADATA = 0x420D
PTRACE_SETREGSET = 0x4205
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_LISTEN = 0x4208
PTRACE_PEEKSIGINFO = 0x4209
PTRACE_GETSIGMASK = 0x420A
PTRACE_SETSIGMASK = 0x420B
PTRACE_GET_SYSCALL_INFO = 0x420E
PTRACE_GET_RSEQ_CONFIGURATION = 0x420F
PTRACE_PEEKSIGINFO_SHARED = 1
PTRACE_EVENT_STOP = 128
PTRACE_EVENT_FORK, PTRACE_EVENT_VFORK, PTRACE_EVENT_CLONE, PTRACE_EVENT_EXEC = 1, 2, 3, 4
PTRACE_SINGLESTEP = 9
PTRACE_O_TRACESYSGOOD = 0x1
PTRACE_O_TRACEFORK = 0x2
PTRACE_O_TRACECLONE = 0x8
PTRACE_O_TRACEEXEC = 0x10
PTRACE_O_EXITKILL = 0x100000
PTRACE_O_SUSPEND_SECCOMP = 0x200000
SUSPEND_SECCOMP = PTRACE_O_SUSPEND_SECCOMP if os.geteuid() == 0 else 0   # needs CAP_SYS_ADMIN
NT_PRSTATUS = 1
NT_X86_XSTATE = 0x202
WALL = 0x40000000                     # __WALL: wait for clone children (threads) too
PTRACE_GET_THREAD_AREA = 25           # a GDT TLS entry (struct user_desc) of the tracee
PTRACE_SET_THREAD_AREA = 26

# Code segments (arch/x86/include/asm/segment.h): a thread whose cs is __USER32_CS runs
# 32-bit (ia32, compat) code; a tracer may set cs, and the thread returns to user space
# in that mode (through IRET).  Injected syscalls in a compat thread run in 64-bit mode
# (the x86_64 syscalls, at a `syscall` instruction); the few whose compat form differs in
# what it sets (SA_IA32_ABI of a sigaction, the compat robust list) run as i386 syscalls
# through `int $0x80`, which works from either mode.  In a live compat thread both lead home
# should ptckpt vanish meanwhile (ptckpt.returnframe32).
USER32_CS = 0x23
USER_CS = 0x33
TLS_ENTRIES = range(12, 15)           # GDT_ENTRY_TLS_MIN .. +GDT_ENTRY_TLS_ENTRIES (x86_64)
USER_DESC_SIZE = 16                   # struct user_desc (asm/ldt.h)
# i386 syscall numbers (arch/x86/entry/syscalls/syscall_32.tbl) of the compat calls we make
I386_SYSCALLS = {"restart_syscall": 0, "nanosleep": 162, "rt_sigaction": 174, "clock_nanosleep": 267,
                 "set_robust_list": 311, "get_robust_list": 312, "clock_nanosleep_time64": 407,
                 "futex": 240, "futex_time64": 422, "openat": 295}

# Kernel-internal restart codes a thread frozen in a syscall shows in rax
# (include/linux/errno.h).
ERESTARTSYS = 512
ERESTARTNOINTR = 513
ERESTARTNOHAND = 514
ERESTART_RESTARTBLOCK = 516

# Lowest number wins: the table also lists the x32 entries (512+) under the same names.
SYSCALL_NUMBERS = {name: nr for nr, name in sorted(_SYSCALL_NAMES.items(), reverse=True)}
SYSCALL_NUMBERS.update({"clone3": 435, "pidfd_open": 434, "pidfd_getfd": 438,
                        "rseq": 334, "mseal": 462})

XSTATE_BUFFER_SIZE = 64 * 1024        # far above any XSAVE area a CPU has today

log = logging.getLogger("ptckpt.tracee")


class TraceEvent(enum.IntEnum):
    """The PTRACE_EVENT_* a followed tracee stops with (``WaitStatus.event``)."""

    FORK = PTRACE_EVENT_FORK
    VFORK = PTRACE_EVENT_VFORK
    CLONE = PTRACE_EVENT_CLONE
    EXEC = PTRACE_EVENT_EXEC


class TraceOptions(enum.IntFlag):
    """The PTRACE_O_* options :meth:`Task.seize` takes."""

    SYSGOOD = PTRACE_O_TRACESYSGOOD     # syscall stops tell themselves apart (SIGTRAP | 0x80)
    FORK = PTRACE_O_TRACEFORK           # follow forks: the child starts traced and stopped
    CLONE = PTRACE_O_TRACECLONE         # follow clones (threads)
    EXEC = PTRACE_O_TRACEEXEC           # an exec event stop
    EXITKILL = PTRACE_O_EXITKILL        # the tracee dies with its tracer


class RemotePtr(int):
    """An address in a tracee's address space (never one of ours)."""

    def __repr__(self) -> str:
        return f"RemotePtr({self:#x})"

    def __add__(self, other: int) -> "RemotePtr":
        return RemotePtr(int(self) + other)

    def __sub__(self, other: int) -> "RemotePtr":
        return RemotePtr(int(self) - other)


class StopKind(enum.Enum):
    """Why a tracee is stopped, decoded from a wait status."""

    INTERRUPT = "interrupt"           # PTRACE_EVENT_STOP after PTRACE_INTERRUPT
    GROUP_STOP = "group-stop"         # PTRACE_EVENT_STOP for SIGSTOP & co
    SYSCALL = "syscall"               # syscall-enter/exit stop (TRACESYSGOOD)
    SIGNAL = "signal"                 # signal-delivery-stop
    EVENT = "event"                   # another PTRACE_EVENT_*
    EXITED = "exited"                 # gone: exited or killed


@dataclass(frozen=True)
class WaitStatus:
    kind: StopKind
    signo: int = 0                    # stop signal, or the killing signal
    exit_code: int = 0
    event: int = 0

    @classmethod
    def decode(cls, status: int) -> "WaitStatus":
        if os.WIFEXITED(status):
            return cls(StopKind.EXITED, exit_code=os.WEXITSTATUS(status))
        if os.WIFSIGNALED(status):
            return cls(StopKind.EXITED, signo=os.WTERMSIG(status))
        sig = os.WSTOPSIG(status)
        event = (status >> 16) & 0xFF
        if event == PTRACE_EVENT_STOP:
            if sig in (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
                return cls(StopKind.GROUP_STOP, signo=sig, event=event)
            return cls(StopKind.INTERRUPT, signo=sig, event=event)
        if event:
            return cls(StopKind.EVENT, signo=sig, event=event)
        if sig == (signal.SIGTRAP | 0x80):
            return cls(StopKind.SYSCALL, signo=signal.SIGTRAP)
        return cls(StopKind.SIGNAL, signo=sig)


# --- the one choke point for ptrace errors --------------------------------

def _ptrace(request: int, tid: int, addr: int = 0, data: int = 0, *, what: str = "") -> int:
    try:
        return _pt.ptrace(request, tid, addr, data)
    except PtraceError as err:
        raise _translate_errno(err.errno or 0, tid, what or f"ptrace request {request:#x}") from None


def _translate_errno(err: int, pid: int, what: str) -> Exception:
    if err == errno.ESRCH:
        if not _alive(pid):
            return TargetVanished(pid, what)
        return TraceeError(pid, f"{what} on {pid}: thread is not stopped for us (ESRCH)")
    if err == errno.EPERM:
        return AccessDenied(pid)
    return TraceeError(pid, f"{what} on {pid} failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})")


def _alive(tid: int) -> bool:
    """The thread exists and is neither a zombie nor dead."""
    try:
        with open(f"/proc/{tid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X", b"x")


def _translate_os_error(exc: OSError, pid: int, what: str) -> Exception:
    if isinstance(exc, (ProcessLookupError, FileNotFoundError)) or exc.errno == errno.ESRCH:
        return TargetVanished(pid, what)
    if isinstance(exc, PermissionError):
        return AccessDenied(pid, what)
    return TraceeError(pid, f"{what} on {pid} failed: {exc.strerror or exc}")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _host_syscall(nr: int, *args: int) -> int:
    """A syscall made by ptckpt itself; returns the result or -errno."""
    res = _libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a & (2**64 - 1)) for a in args])
    return -ctypes.get_errno() if res == -1 else res


# ptckpt's own i386 syscalls: 64-bit code may make them with `int $0x80` where the kernel has
# ia32 emulation.  A thunk (machine code in a page below 4 GiB, read+exec) takes
# (nr, a1, a2, a3, a4) in the x86_64 calling convention and makes the i386 call with them
# in eax, ebx, ecx, edx, esi; its pointers must lie below 4 GiB too (a buffer page there).
_I386_THUNK = bytes.fromhex(
    "53"            # push %rbx
    "89f8"          # mov %edi,%eax        nr
    "89f3"          # mov %esi,%ebx        a1
    "87ca"          # xchg %ecx,%edx       a2 -> ecx, a3 -> edx
    "4489c6"        # mov %r8d,%esi        a4
    "cd80"          # int $0x80
    "5b"            # pop %rbx
    "c3"            # ret
)
_MAP_32BIT = 0x40
_i386: tuple | None = None      # (the thunk, the buffer's address, its size), made once


def _i386_call() -> tuple:
    global _i386
    if _i386 is None:
        mmap_, mprotect = _libc.mmap, _libc.mprotect
        mmap_.restype, mmap_.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_int, ctypes.c_long]
        code = mmap_(None, 3 * PAGE_SIZE, 3, 0x22 | _MAP_32BIT, -1, 0)     # RW, private anonymous
        if code in (None, 2**64 - 1):
            raise OSError(ctypes.get_errno(), "mmap of the i386 thunk")
        ctypes.memmove(code, _I386_THUNK, len(_I386_THUNK))
        if mprotect(ctypes.c_void_p(code), PAGE_SIZE, 5) != 0:                  # read+exec
            raise OSError(ctypes.get_errno(), "mprotect of the i386 thunk")
        thunk = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                                 ctypes.c_uint32, ctypes.c_uint32)(code)
        _i386 = (thunk, code + PAGE_SIZE, 2 * PAGE_SIZE)
    return _i386


def compat_openat(path: str, flags: int, mode: int = 0) -> int:
    """openat(AT_FDCWD, path, flags, mode) made by ptckpt as an i386 syscall: the x86_64 one
    adds O_LARGEFILE to every open, which a description a 32-bit program opened without it
    must not have.  Returns the fd; raises OSError."""
    thunk, buf, size = _i386_call()
    raw = os.fsencode(path) + b"\0"
    if len(raw) > size:
        raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), path)
    ctypes.memmove(buf, raw, len(raw))
    fd = thunk(I386_SYSCALLS["openat"], 0xFFFFFF9C, buf, flags, mode)       # AT_FDCWD
    if fd < 0:
        raise OSError(-fd, os.strerror(-fd), path)
    return fd


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _RseqConfiguration(ctypes.Structure):
    # struct ptrace_rseq_configuration (include/uapi/linux/ptrace.h)
    _fields_ = [("rseq_abi_pointer", ctypes.c_uint64), ("rseq_abi_size", ctypes.c_uint32),
                ("signature", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("pad", ctypes.c_uint32)]


class _PeekSiginfoArgs(ctypes.Structure):
    # struct ptrace_peeksiginfo_args
    _fields_ = [("off", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("nr", ctypes.c_int32)]


@dataclass(frozen=True)
class Rseq:
    addr: int
    size: int
    signature: int
    flags: int


class Regs:
    """General registers of one thread (struct user_regs_struct), by name."""

    __slots__ = ("_raw",)

    def __init__(self, raw: _user_regs_struct):
        self._raw = raw

    @classmethod
    def from_values(cls, values: Sequence[int]) -> "Regs":
        raw = _user_regs_struct()
        for name, value in zip(GP_REG_NAMES, values):
            setattr(raw, name, value & (2**64 - 1))
        return cls(raw)

    def values(self) -> tuple[int, ...]:
        return tuple(getattr(self._raw, name) for name in GP_REG_NAMES)

    def copy(self) -> "Regs":
        return Regs.from_values(self.values())

    def __getattr__(self, name: str) -> int:
        return getattr(self._raw, name)

    def __setattr__(self, name: str, value: int) -> None:
        if name == "_raw":
            object.__setattr__(self, name, value)
        else:
            setattr(self._raw, name, value & (2**64 - 1))

    def signed(self, name: str) -> int:
        v = getattr(self._raw, name)
        return v - 2**64 if v >= 2**63 else v


def compat_mode(regs: Regs) -> bool:
    """The thread runs 32-bit (ia32) code: its code segment is __USER32_CS."""
    return regs.cs == USER32_CS


def syscall_restart(regs: Regs) -> tuple[int, int]:
    """Classify a thread frozen inside a syscall: (restart kind, syscall nr or -1).

    kind is 0 (none), 1 (re-execute: -ERESTARTSYS/-NOINTR/-NOHAND) or 2
    (-ERESTART_RESTARTBLOCK: restart_syscall with the kernel's restart block),
    as in arch_do_signal_or_restart (arch/x86/kernel/signal.c).
    """
    nr = regs.signed("orig_rax")
    if nr < 0:
        return 0, -1
    ret = regs.signed("rax")
    if ret in (-ERESTARTSYS, -ERESTARTNOINTR, -ERESTARTNOHAND):
        return 1, nr
    if ret == -ERESTART_RESTARTBLOCK:
        return 2, nr
    return 0, nr


class Task:
    """One kernel thread we have seized."""

    __slots__ = ("tid", "tgid", "stop", "seized", "deferred_signals", "gadget", "options")

    def __init__(self, tid: int, tgid: int):
        self.tid = tid
        self.tgid = tgid
        self.stop: WaitStatus | None = None     # last stop, None while running
        self.seized = False
        self.deferred_signals: list[tuple[int, bytes]] = []   # (signo, siginfo) held back
        self.gadget: int | None = None          # a restore stub's syscall gadget, once moved
        self.options: int | None = None         # the PTRACE_O_* we seized it with (None: not
                                                # ours to know, a followed clone's inherited ones)

    @classmethod
    def followed(cls, tid: int, tgid: int) -> "Task":
        """A thread the kernel attached to us when a traced one cloned or forked it (the
        CLONE/FORK options): seized already, it reports a stop of its own."""
        task = cls(tid, tgid)
        task.seized = True
        return task

    def __repr__(self) -> str:
        return f"Task(tid={self.tid}, tgid={self.tgid}, stop={self.stop})"

    def seccomp_filters(self) -> list[tuple[int, bytes]]:
        """The thread's seccomp filters, oldest first: (flags, classic BPF program bytes),
        through PTRACE_SECCOMP_GET_FILTER and _GET_METADATA (needs CAP_SYS_ADMIN)."""
        out = []
        index = 0
        while True:
            try:
                count = _pt.ptrace(PTRACE_SECCOMP_GET_FILTER, self.tid, index, 0)
            except PtraceError as err:
                if err.errno == errno.ENOENT:
                    break
                raise _translate_errno(err.errno or 0, self.tid, "PTRACE_SECCOMP_GET_FILTER") from None
            prog = ctypes.create_string_buffer(count * 8)
            _ptrace(PTRACE_SECCOMP_GET_FILTER, self.tid, index, ctypes.addressof(prog),
                    what="PTRACE_SECCOMP_GET_FILTER")
            meta = (ctypes.c_uint64 * 2)(index, 0)
            _ptrace(PTRACE_SECCOMP_GET_METADATA, self.tid, ctypes.sizeof(meta), ctypes.addressof(meta),
                    what="PTRACE_SECCOMP_GET_METADATA")
            out.append((int(meta[1]), prog.raw))
            index += 1
        return out[::-1]

    # -- control -----------------------------------------------------------
    def seize(self, options: int = PTRACE_O_TRACESYSGOOD) -> None:
        """Seize the thread; as root, with its seccomp filters suspended while we trace it (the
        syscalls we inject are ours, not the program's: a filter must neither refuse nor kill
        them; the suspension ends when we let go)."""
        global SUSPEND_SECCOMP
        if SUSPEND_SECCOMP:
            try:
                _pt.ptrace(PTRACE_SEIZE, self.tid, 0, options | SUSPEND_SECCOMP)
                self.seized = True
                self.options = options | SUSPEND_SECCOMP
                return
            except PtraceError as err:
                if err.errno not in (errno.EINVAL, errno.EPERM):
                    raise _translate_errno(err.errno or 0, self.tid, "PTRACE_SEIZE") from None
                SUSPEND_SECCOMP = 0          # a kernel without it (or not ours to use): go on without
        _ptrace(PTRACE_SEIZE, self.tid, 0, options, what="PTRACE_SEIZE")
        self.seized = True
        self.options = options

    def set_options(self, options: int) -> None:
        """PTRACE_SETOPTIONS: the thread's PTRACE_O_* from now on (all of them)."""
        _ptrace(PTRACE_SETOPTIONS, self.tid, 0, options, what="PTRACE_SETOPTIONS")

    def interrupt(self) -> None:
        _ptrace(PTRACE_INTERRUPT, self.tid, what="PTRACE_INTERRUPT")

    def wait(self) -> WaitStatus:
        """Wait for the next stop (or the end) of this thread."""
        while True:
            try:
                _, status = os.waitpid(self.tid, WALL)
            except ChildProcessError:
                self.stop = WaitStatus(StopKind.EXITED)
                self.seized = False
                raise TargetVanished(self.tgid, "waiting for a stop") from None
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            st = WaitStatus.decode(status)
            self.stop = None if st.kind is StopKind.EXITED else st
            if st.kind is StopKind.EXITED:
                self.seized = False
                raise TargetVanished(self.tgid, "waiting for a stop")
            return st

    def wait_frozen(self) -> WaitStatus:
        """After interrupt(): wait until the thread sits in an interrupt or group stop.

        A signal whose delivery-stop comes first is not delivered now (its
        handler would run in the middle of the dump): it is kept, with its
        siginfo, in ``deferred_signals``; the image records it as pending and
        the final resume sends it again.
        """
        while True:
            st = self.wait()
            if st.kind in (StopKind.INTERRUPT, StopKind.GROUP_STOP):
                return st
            if st.kind is StopKind.SIGNAL:
                self.deferred_signals.append((st.signo, self.get_siginfo()))
            # signal, syscall or other event stops: go on to the pending interrupt
            self.resume(0)

    def get_event_msg(self) -> int:
        msg = ctypes.c_ulong()
        _ptrace(_pt.PTRACE_GETEVENTMSG, self.tid, 0, ctypes.addressof(msg), what="PTRACE_GETEVENTMSG")
        return msg.value

    def get_siginfo(self) -> bytes:
        buf = ctypes.create_string_buffer(128)
        _ptrace(_pt.PTRACE_GETSIGINFO, self.tid, 0, ctypes.addressof(buf), what="PTRACE_GETSIGINFO")
        return buf.raw

    def resume(self, sig: int = 0) -> None:
        self.stop = None
        _ptrace(_pt.PTRACE_CONT, self.tid, 0, sig, what="PTRACE_CONT")

    def syscall_step(self) -> None:
        self.stop = None
        _ptrace(_pt.PTRACE_SYSCALL, self.tid, 0, 0, what="PTRACE_SYSCALL")

    def poll(self) -> tuple[WaitStatus, int] | None:
        """Without blocking: (the thread's next stop or end, the raw wait status; -1 when
        it is no child of ours any more), None while it runs."""
        try:
            got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
        except ChildProcessError:
            return WaitStatus(StopKind.EXITED), -1
        if got == 0:
            return None
        st = WaitStatus.decode(status)
        self.stop = None if st.kind is StopKind.EXITED else st
        return st, status

    def single_step(self) -> WaitStatus:
        """Run one instruction (PTRACE_SINGLESTEP) and wait for its SIGTRAP; a signal whose
        delivery-stop comes first is kept in ``deferred_signals`` (without its siginfo) and
        the step is asked again."""
        while True:
            try:
                _pt.ptrace(PTRACE_SINGLESTEP, self.tid, 0, 0)
            except PtraceError:
                raise TargetVanished(self.tgid, "single step") from None
            st = self.wait()
            if st.kind is StopKind.SIGNAL and st.signo == signal.SIGTRAP:
                return st
            if st.kind is StopKind.SIGNAL:      # a signal arrived first: keep it for later
                self.deferred_signals.append((st.signo, b""))

    def reap_end(self) -> None:
        """After it was killed: take this traced thread's stops until its end (a tracer
        sees it before the parent does; the parent still reaps it)."""
        while self.seized:
            try:
                _, status = os.waitpid(self.tid, WALL)
            except ChildProcessError:
                break
            if WaitStatus.decode(status).kind is StopKind.EXITED:
                break
        self.seized = False
        self.stop = WaitStatus(StopKind.EXITED)

    def detach(self, sig: int = 0) -> None:
        if not self.seized:
            return
        try:
            _ptrace(_pt.PTRACE_DETACH, self.tid, 0, sig, what="PTRACE_DETACH")
        except TargetVanished:
            self._release_if_dead()
        self.seized = False
        self.stop = None

    def _release_if_dead(self) -> None:
        """A tracee killed while seized stays a zombie held by its tracer, which its parent
        cannot reap, until the tracer waits for it (or exits: a tracer that lives on, a Dask
        worker, must): its end is collected here, unless it is ptckpt's own child, whose
        status is the caller's to collect."""
        if _parent_of(self.tgid) == os.getpid():
            return
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                got, status = os.waitpid(self.tid, os.WNOHANG | WALL)
            except ChildProcessError:
                return                              # no longer ours to wait for
            if got and WaitStatus.decode(status).kind is StopKind.EXITED:
                return
            if got:                                 # a stop on its way out: let go on
                with contextlib.suppress(Exception):
                    self.resume(0)
            else:
                time.sleep(0.01)

    # -- registers ---------------------------------------------------------
    def get_regs(self) -> Regs:
        raw = _user_regs_struct()
        _ptrace(PTRACE_GETREGS, self.tid, 0, ctypes.addressof(raw), what="PTRACE_GETREGS")
        return Regs(raw)

    def set_regs(self, regs: Regs) -> None:
        _ptrace(PTRACE_SETREGS, self.tid, 0, ctypes.addressof(regs._raw), what="PTRACE_SETREGS")

    def aim_syscall(self, at: int, nr: int, *args: int) -> None:
        """Point the stopped thread at the syscall instruction `at` with syscall `nr` and its
        arguments (rdi, rsi, rdx, r10, r8, r9) in place and no syscall to restart: its next
        resume runs that syscall.  The other registers stay as they are."""
        regs = self.get_regs()
        regs.rip = at
        regs.rax = nr
        regs.orig_rax = 2**64 - 1
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args):
            setattr(regs, name, value)
        self.set_regs(regs)

    def get_xstate(self) -> bytes:
        """The NT_X86_XSTATE regset (XSAVE layout, fx_sw_bytes at offset 464)."""
        buf = ctypes.create_string_buffer(XSTATE_BUFFER_SIZE)
        iov = _IoVec(ctypes.cast(buf, ctypes.c_void_p), XSTATE_BUFFER_SIZE)
        _ptrace(PTRACE_GETREGSET, self.tid, NT_X86_XSTATE, ctypes.addressof(iov),
                what="PTRACE_GETREGSET(NT_X86_XSTATE)")
        return buf.raw[: iov.iov_len]

    def set_xstate(self, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        iov = _IoVec(ctypes.cast(buf, ctypes.c_void_p), len(data))
        _ptrace(PTRACE_SETREGSET, self.tid, NT_X86_XSTATE, ctypes.addressof(iov),
                what="PTRACE_SETREGSET(NT_X86_XSTATE)")

    def get_sigmask(self) -> int:
        mask = ctypes.c_uint64()
        _ptrace(PTRACE_GETSIGMASK, self.tid, 8, ctypes.addressof(mask), what="PTRACE_GETSIGMASK")
        return mask.value

    def set_sigmask(self, mask: int) -> None:
        m = ctypes.c_uint64(mask)
        _ptrace(PTRACE_SETSIGMASK, self.tid, 8, ctypes.addressof(m), what="PTRACE_SETSIGMASK")

    def peek_siginfo(self, shared: bool) -> list[bytes]:
        """Queued siginfo_t records (128 bytes each), without dequeuing them."""
        out: list[bytes] = []
        batch = 32
        buf = ctypes.create_string_buffer(128 * batch)
        while True:
            args = _PeekSiginfoArgs(len(out), PTRACE_PEEKSIGINFO_SHARED if shared else 0, batch)
            n = _ptrace(PTRACE_PEEKSIGINFO, self.tid, ctypes.addressof(args),
                        ctypes.addressof(buf), what="PTRACE_PEEKSIGINFO")
            n = ctypes.c_long(n).value
            out.extend(buf.raw[i * 128:(i + 1) * 128] for i in range(n))
            if n < batch:
                return out

    def get_thread_area(self, entry: int) -> bytes:
        """The GDT TLS entry `entry` (struct user_desc, 16 bytes) of the thread; a 32-bit
        program's thread pointer (%gs) selects one."""
        buf = ctypes.create_string_buffer(USER_DESC_SIZE)
        _ptrace(PTRACE_GET_THREAD_AREA, self.tid, entry, ctypes.addressof(buf),
                what="PTRACE_GET_THREAD_AREA")
        return buf.raw

    def set_thread_area(self, desc: bytes) -> None:
        """Set the GDT TLS entry a struct user_desc names (its first field)."""
        buf = ctypes.create_string_buffer(desc, USER_DESC_SIZE)
        entry = struct.unpack_from("<I", desc)[0]
        _ptrace(PTRACE_SET_THREAD_AREA, self.tid, entry, ctypes.addressof(buf),
                what="PTRACE_SET_THREAD_AREA")

    def get_rseq(self) -> Rseq:
        conf = _RseqConfiguration()
        _ptrace(PTRACE_GET_RSEQ_CONFIGURATION, self.tid, ctypes.sizeof(conf),
                ctypes.addressof(conf), what="PTRACE_GET_RSEQ_CONFIGURATION")
        return Rseq(conf.rseq_abi_pointer, conf.rseq_abi_size, conf.signature, conf.flags)

    def get_robust_list(self) -> tuple[int, int]:
        head = ctypes.c_uint64()
        length = ctypes.c_size_t()
        res = _host_syscall(SYSCALL_NUMBERS["get_robust_list"], self.tid,
                            ctypes.addressof(head), ctypes.addressof(length))
        if res < 0:
            raise _translate_errno(-res, self.tid, "get_robust_list")
        return head.value, length.value


class AddressSpace:
    """Memory of one thread group, read and written from outside."""

    def __init__(self, pid: int):
        self.pid = pid
        self._return_path: returnframe.ReturnPath | None | bool = False
        self._compat_path: returnframe32.ReturnPath | None | bool = False
        self.told_no_way_home = False     # a 32-bit process's EXITKILL fallback logged
        try:
            self._mem = os.open(f"/proc/{pid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise _translate_os_error(exc, pid, "opening /proc/PID/mem") from None

    def close(self) -> None:
        if self._mem >= 0:
            os.close(self._mem)
            self._mem = -1

    def return_path(self) -> returnframe.ReturnPath | None:
        """How a thread of this group gets home from injected syscalls (looked up once)."""
        if self._return_path is False:
            self._return_path = returnframe.find_return_path(self)
        return self._return_path      # type: ignore[return-value]

    def compat_return_path(self) -> returnframe32.ReturnPath | None:
        """How a 32-bit thread of this group gets home from injected syscalls (looked up once)."""
        if self._compat_path is False:
            self._compat_path = returnframe32.find_return_path(self)
        return self._compat_path      # type: ignore[return-value]

    def __enter__(self) -> "AddressSpace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, addr: int, size: int) -> bytes:
        try:
            data = os.pread(self._mem, size, addr)
        except OSError as exc:
            data = self._read_vm(addr, size) if exc.errno == errno.EIO else None
            if data is None:
                raise _translate_os_error(exc, self.pid, f"reading {size} bytes at {addr:#x}") from None
        if len(data) != size:
            raise TraceeError(self.pid, f"short read of {size} bytes at {addr:#x}")
        return data

    def write(self, addr: int, data: bytes) -> None:
        try:
            n = os.pwrite(self._mem, data, addr)
        except OSError as exc:
            n = self._write_vm(addr, data) if exc.errno == errno.EIO else -1
            if n < 0:
                raise _translate_os_error(exc, self.pid, f"writing {len(data)} bytes at {addr:#x}") from None
        if n != len(data):
            raise TraceeError(self.pid, f"short write of {len(data)} bytes at {addr:#x}")

    # A page that only a userfaultfd brings (a lazy restore's) cannot come through
    # /proc/PID/mem, whose page lookup may not wait for it (EIO); process_vm_readv's may.
    def _read_vm(self, addr: int, size: int) -> bytes | None:
        buf = ctypes.create_string_buffer(size)
        local, remote = _IoVec(ctypes.addressof(buf), size), _IoVec(addr, size)
        got = _libc.process_vm_readv(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        return buf.raw[:got] if got == size else None

    def _write_vm(self, addr: int, data: bytes) -> int:
        buf = ctypes.create_string_buffer(data, len(data))
        local, remote = _IoVec(ctypes.addressof(buf), len(data)), _IoVec(addr, len(data))
        return _libc.process_vm_writev(self.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)

    def read_into(self, buffer: memoryview, ranges: Sequence[tuple[int, int]]) -> None:
        """Fill `buffer` with the bytes of (addr, length) ranges, in order.

        process_vm_readv with up to IOV_MAX remote iovecs per call; ranges it
        cannot read (unreadable protections) fall back to /proc/PID/mem.
        """
        def slow(addr: int, length: int, done: int) -> None:
            buffer[done:done + length] = self.read(addr, length)
        self._transfer(_libc.process_vm_readv, buffer, ranges, slow, "reading memory")

    def read_unpinned(self, buffer: memoryview, addr: int) -> None:
        """Fill `buffer` from `addr` through /proc/PID/mem, which pins no page: a page shared
        copy-on-write with another process stays shared (a pin, as process_vm_readv takes,
        makes the kernel give the pinned process a copy of its own)."""
        done = 0
        while done < len(buffer):
            try:
                n = os.preadv(self._mem, [buffer[done:]], addr + done)
            except OSError as exc:
                raise _translate_os_error(exc, self.pid, f"reading memory at {addr + done:#x}") from None
            if n <= 0:
                raise TraceeError(self.pid, f"short read of {len(buffer)} bytes at {addr:#x}")
            done += n

    def write_from(self, buffer: memoryview, ranges: Sequence[tuple[int, int]]) -> None:
        """Write consecutive bytes of `buffer` to (addr, length) ranges (process_vm_writev;
        /proc/PID/mem for ranges it cannot write)."""
        def slow(addr: int, length: int, done: int) -> None:
            self.write(addr, bytes(buffer[done:done + length]))
        self._transfer(_libc.process_vm_writev, buffer, ranges, slow, "writing memory")

    def _transfer(self, call, buffer: memoryview, ranges: Sequence[tuple[int, int]], slow,
                  what: str) -> None:
        local = (ctypes.c_char * len(buffer)).from_buffer(buffer)
        base = ctypes.addressof(local)
        done = 0
        i = 0
        while i < len(ranges):
            chunk = ranges[i:i + 1024]
            total = sum(length for _, length in chunk)
            remote = (_IoVec * len(chunk))(*[_IoVec(a, n) for a, n in chunk])
            liov = _IoVec(base + done, total)
            got = call(self.pid, ctypes.byref(liov), 1, remote, len(chunk), 0)
            if got == total:
                done += total
                i += len(chunk)
                continue
            if got < 0 and ctypes.get_errno() == errno.ESRCH:
                raise TargetVanished(self.pid, what)
            got = max(got, 0)
            # Skip the ranges moved completely, then take the faulting one the slow way.
            while chunk and got >= chunk[0][1]:
                got -= chunk[0][1]
                done += chunk[0][1]
                chunk = chunk[1:]
                i += 1
            addr, length = ranges[i]
            slow(addr, length, done)
            done += length
            i += 1


_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                                   ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
_libc.process_vm_writev.restype = ctypes.c_ssize_t
_libc.process_vm_writev.argtypes = _libc.process_vm_readv.argtypes


# --- the injection scope ----------------------------------------------------

def _find_in_vdso(mem: AddressSpace, code: bytes) -> RemotePtr | None:
    from . import procfs
    for m in procfs.read_maps(mem.pid):
        if m.path == "[vdso]":
            at = mem.read(m.start, m.end - m.start).find(code)
            if at >= 0:
                return RemotePtr(m.start + at)
    return None


def find_syscall_insn(mem: AddressSpace, maps: Sequence) -> RemotePtr | None:
    """Address of a `syscall` instruction (0f 05) in the tracee's [vdso], if any.

    The vdso of this kernel has real syscall instructions in its fallback
    paths (DESIGN.md).  Only those two bytes are ever executed: the thread is
    stopped at syscall exit, so what follows them does not matter.
    """
    for m in maps:
        if m.path == "[vdso]":
            code = mem.read(m.start, m.end - m.start)
            at = code.find(b"\x0f\x05")
            if at >= 0:
                return RemotePtr(m.start + at)
    return None


_planted: dict[int, int] = {}          # tgid -> scopes using the compat gadget in its vdso


def _plant(mem: AddressSpace, path: returnframe32.ReturnPath) -> None:
    """The compat way home's x86_64 gadget in place (once for all scopes of a process)."""
    if not _planted.get(mem.pid):
        mem.write(path.gadget, path.code)
    _planted[mem.pid] = _planted.get(mem.pid, 0) + 1


def _unplant(mem: AddressSpace, path: returnframe32.ReturnPath) -> None:
    """The vdso's padding back, when the last scope that used the gadget ends."""
    _planted[mem.pid] -= 1
    if not _planted[mem.pid]:
        del _planted[mem.pid]
        mem.write(path.gadget, path.padding)


class RemoteSyscalls:
    """Runs syscalls inside a stopped tracee thread.  Use through :func:`remote_syscalls`."""

    def __init__(self, task: Task, mem: AddressSpace, gadget: RemotePtr | None,
                 scratch_top: int | None = None, keep_regs: bool = True):
        self.task = task
        self.mem = mem
        self._gadget = gadget
        self._scratch_top = scratch_top
        self._keep_regs = keep_regs
        self._patched: tuple[int, bytes] | None = None
        self.saved_regs: Regs | None = None
        self._sp: int = 0
        self._entry: int | None = None            # rsp and rbp while injecting: the way home
        self._entry32: int | None = None          # esp of i386 calls on a compat thread's way home
        self._planted: returnframe32.ReturnPath | None = None   # its x86_64 gadget, in the vdso
        self._under_frame: tuple[int, bytes] | None = None
        self.used = False
        self.last_clone = 0          # tid (tracer's namespace) of the last thread cloned
        self.compat = False          # the thread runs 32-bit code (its own registers' cs)
        self._exitkill = False       # PTRACE_O_EXITKILL set for this scope
        self._int80: RemotePtr | None = None

    @property
    def gadget(self) -> RemotePtr | None:
        return self._gadget

    @property
    def scratch_top(self) -> int:
        """Where this scope's scratch memory starts (grows down); another thread's scope can share it."""
        return self._sp

    def move_gadget(self, gadget: RemotePtr, scratch_top: int) -> None:
        """Run further syscalls at `gadget`, with scratch memory below `scratch_top`."""
        self._gadget = gadget
        self._sp = scratch_top

    # enter/exit are driven by remote_syscalls()
    def _enter(self) -> None:
        if self.task.stop is None:
            raise TraceeError(self.task.tid, "remote syscalls need a stopped thread")
        self.saved_regs = self.task.get_regs()
        self.compat = compat_mode(self.saved_regs)
        if self._scratch_top is not None:
            self._sp = self._scratch_top
        else:
            # Scratch memory grows down from below the red zone of the current stack.
            self._sp = (self.saved_regs.rsp - 128) & ~0xF
        if self._keep_regs and self._scratch_top is None and self.compat:
            self._prepare_way_home_compat()
        if self._gadget is None:
            # No vdso: patch a syscall instruction over the bytes at rip, put back on exit.
            rip = self.saved_regs.rip
            self._patched = (rip, self.mem.read(rip, 2))
            self.mem.write(rip, b"\x0f\x05")
            self._gadget = RemotePtr(rip)
        elif self._keep_regs and self._scratch_top is None and not self.compat:
            self._prepare_way_home()
        options = self.task.options
        if self._keep_regs and self.compat and self._entry is None and options is not None \
                and not options & PTRACE_O_EXITKILL:
            # A compat thread without a way home (no usable return path in its vdso), left
            # with our registers, would run on in 64-bit mode into the vdso's int $0x80 with
            # our result as the syscall number.  Should ptckpt vanish meanwhile, the kernel
            # kills it instead (PTRACE_O_EXITKILL while the scope lasts).
            if not self.mem.told_no_way_home:
                self.mem.told_no_way_home = True
                log.warning("32-bit process %d: no way home for injected syscalls (no usable "
                            "return path in its vdso): should ptckpt be killed meanwhile, it "
                            "dies with it", self.task.tgid)
            self.task.set_options(options | PTRACE_O_EXITKILL)
            self._exitkill = True

    def _prepare_way_home(self) -> None:
        """A live thread: should ptckpt vanish mid-injection, the thread must find its own
        context again by itself (ptckpt.returnframe).  Without a return path (no vdso
        epilogue, no rt_sigreturn code mapped, a shadow stack) it goes as before."""
        path = self.mem.return_path()
        if path is None or _shadow_stack(self.task):
            return
        fpstate = returnframe.xsave_area(self.task.get_xstate())
        if fpstate is None:
            return
        assert self.saved_regs is not None
        frame = returnframe.build(path, self.saved_regs, self.task.get_sigmask(), fpstate)
        self._write_frame(frame.low, frame.data)
        self._gadget = RemotePtr(path.syscall)
        self._entry = frame.entry
        self._sp = frame.scratch_top

    def _prepare_way_home_compat(self) -> None:
        """A live 32-bit thread: its way home (ptckpt.returnframe32), an ia32 frame both
        kinds of injected syscalls lead into; the x86_64 ones from a gadget written into
        the vdso's padding for the time of the scope.  Without a return path it goes
        as before."""
        path = self.mem.compat_return_path()
        if path is None:
            return
        fpstate = returnframe32.fpstate(self.task.get_xstate())
        if fpstate is None:
            return
        assert self.saved_regs is not None
        frame = returnframe32.build(path, self.saved_regs, self.task.get_sigmask(), fpstate)
        self._write_frame(frame.low, frame.data)
        _plant(self.mem, path)
        self._planted = path
        self._gadget = RemotePtr(path.gadget)
        self._int80 = RemotePtr(path.int80)
        self._entry, self._entry32 = frame.entry64, frame.entry32
        self._sp = frame.scratch_top

    def _exit(self) -> None:
        if self._patched is not None:
            addr, old = self._patched
            with contextlib.suppress(Exception):
                self.mem.write(addr, old)
        if self._keep_regs and self.used and self.saved_regs is not None and self.task.seized:
            # Put the registers back verbatim, then let the thread reach an
            # interrupt stop again: it is then back inside get_signal(), where
            # the kernel's own syscall-restart logic runs when it resumes
            # (set at a syscall-exit stop, -ERESTARTSYS would reach the program).
            with contextlib.suppress(TargetVanished):
                self.task.set_regs(self.saved_regs)
                self._put_back_under_frame()
                self.task.interrupt()
                self.task.resume(0)
                self.task.wait_frozen()
        self._put_back_under_frame()
        if self._planted is not None:
            path, self._planted = self._planted, None
            with contextlib.suppress(Exception):
                _unplant(self.mem, path)
        if self._exitkill and self.task.seized and self.task.options is not None:
            with contextlib.suppress(TargetVanished):
                self.task.set_options(self.task.options)     # its own registers again: no kill

    def _write_frame(self, low: int, data: bytes) -> None:
        """The way home's bytes at `low`, what they cover kept for _put_back_under_frame."""
        self._under_frame = (low, self.mem.read(low, len(data)))
        self.mem.write(low, data)

    def _put_back_under_frame(self) -> None:
        """The stack bytes the way home covered, once the thread's registers are its own."""
        if self._under_frame is not None:
            low, old = self._under_frame
            self._under_frame = None
            with contextlib.suppress(Exception):
                self.mem.write(low, old)

    def syscall(self, nr: int | str, *args: int) -> int:
        """Run one syscall in the tracee; returns the raw result (-errno on failure).
        In a compat thread it runs in 64-bit mode (cs __USER_CS), an x86_64 syscall still."""
        if isinstance(nr, str):
            nr = SYSCALL_NUMBERS[nr]
        assert self.saved_regs is not None
        regs = self.saved_regs.copy()
        regs.rip = int(self._gadget)
        if self.compat:
            regs.cs = USER_CS              # 64-bit mode for the x86_64 syscall
        if self._entry is not None:
            regs.rsp = regs.rbp = self._entry     # the epilogue after the syscall leads home
        else:
            regs.rsp = self._sp - 64       # below the scratch data in use
        for name, value in zip(("rdi", "rsi", "rdx", "r10", "r8", "r9"), args):
            setattr(regs, name, value)
        return self._run(regs, nr).signed("rax")

    def compat_syscall(self, name: str, *args: int) -> int:
        """Run one i386 syscall (its ia32 form: compat structures, SA_IA32_ABI) through
        `int $0x80`, in the thread's own mode; pointers must lie below 4 GiB.  Returns the
        raw result (-errno on failure)."""
        assert self.saved_regs is not None
        regs = self.saved_regs.copy()
        regs.rip = int(self.int80())
        regs.rsp = self._entry32 if self._entry32 is not None else self._sp - 64
        for reg, value in zip(("rbx", "rcx", "rdx", "rsi", "rdi", "rbp"), args):
            setattr(regs, reg, value & 0xFFFFFFFF)
        result = self._run(regs, I386_SYSCALLS[name]).rax & 0xFFFFFFFF
        return result - 2**32 if result >= 2**31 else result

    def int80(self) -> RemotePtr:
        """An `int $0x80` instruction (cd 80) of the tracee: beside the gadget (a restore's
        gadget page holds one), else in its [vdso] (a 32-bit vdso's __kernel_vsyscall)."""
        if self._int80 is None:
            if self._gadget is not None and self.mem.read(self._gadget + 3, 2) == b"\xcd\x80":
                self._int80 = RemotePtr(self._gadget + 3)
            else:
                self._int80 = _find_in_vdso(self.mem, b"\xcd\x80")
        if self._int80 is None:
            raise TraceeError(self.task.tgid, f"no int $0x80 instruction in process {self.task.tgid}")
        return self._int80

    def _run(self, regs: Regs, nr: int) -> Regs:
        """Set `regs` with syscall `nr`, run it to its exit stop; the registers there."""
        regs.rax = nr
        regs.orig_rax = 2**64 - 1      # keep the kernel's restart logic off our registers
        self.task.set_regs(regs)
        self.used = True
        testhooks.reached("inject-set")
        state.hold()                   # from the step to the stop: not cut in two by a signal
        try:
            for expected in ("entry", "exit"):
                while True:
                    self.task.syscall_step()
                    st = self.task.wait()
                    if st.kind is StopKind.SYSCALL:
                        testhooks.reached(f"inject-{expected}")
                        break
                    if st.kind is StopKind.SIGNAL:
                        # A signal arrived meanwhile: keep it for the final resume.
                        self.task.deferred_signals.append((st.signo, self.task.get_siginfo()))
                        continue
                    if st.kind is StopKind.EVENT and st.event in (PTRACE_EVENT_CLONE, PTRACE_EVENT_FORK,
                                                                   PTRACE_EVENT_VFORK):
                        self.last_clone = self.task.get_event_msg()
                    # an interrupt or group stop while injecting: just go on
        except BaseException:
            state.let_go(failed=True)
            raise
        state.let_go()
        return self.task.get_regs()

    def checked(self, nr: int | str, *args: int, step: str | None = None) -> int:
        """Like :meth:`syscall`, but a failure raises RemoteSyscallError naming everything."""
        name = nr if isinstance(nr, str) else _SYSCALL_NAMES.get(nr, str(nr))
        res = self.syscall(nr, *args)
        if -4096 < res < 0:
            raise RemoteSyscallError(self.task.tgid, name, tuple(args), -res, step=step)
        return res

    def checked_compat(self, name: str, *args: int, step: str | None = None) -> int:
        """Like :meth:`compat_syscall`, but a failure raises RemoteSyscallError."""
        res = self.compat_syscall(name, *args)
        if -4096 < res < 0:
            raise RemoteSyscallError(self.task.tgid, f"{name} (i386)", tuple(args), -res, step=step)
        return res

    @contextlib.contextmanager
    def scratch(self, data: bytes | int) -> Iterator[RemotePtr]:
        """A nested scope: `data` (or that many zero bytes) placed on the tracee's stack.

        The bytes it overwrote are written back on exit, whatever happens.
        """
        payload = bytes(data) if isinstance(data, int) else data
        size = (len(payload) + 15) & ~15
        addr = self._sp - size
        old = self.mem.read(addr, size)
        self.mem.write(addr, payload)
        prev_sp = self._sp
        self._sp = addr
        try:
            yield RemotePtr(addr)
        finally:
            self._sp = prev_sp
            with contextlib.suppress(Exception):
                self.mem.write(addr, old)


def _shadow_stack(task: Task) -> bool:
    """The thread runs with a user shadow stack (rt_sigreturn would want its token)."""
    try:
        with open(f"/proc/{task.tgid}/task/{task.tid}/status") as f:
            return any(line.startswith("x86_Thread_features:") and line.split(":", 1)[1].strip()
                       for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def remote_syscalls(task: Task, mem: AddressSpace, gadget: RemotePtr | None, *,
                    scratch_top: int | None = None, keep_regs: bool = True) -> Iterator[RemoteSyscalls]:
    """``with remote_syscalls(task, mem, gadget) as remote:`` -- the injection scope.

    On exit (with keep_regs) the thread's registers are what they were and it
    sits in an interrupt stop again, so the kernel restarts a syscall it was
    frozen in; patched bytes are back, even when an exception unwinds.
    Without keep_regs (restore) the caller sets the final registers itself.
    """
    remote = RemoteSyscalls(task, mem, gadget, scratch_top, keep_regs)
    remote._enter()
    try:
        yield remote
    finally:
        remote._exit()


# --- a session: everything we seized -----------------------------------------

class Session:
    """The registry of seized threads (tid -> Task), with freeze and resume of processes."""

    def __init__(self) -> None:
        self.tasks: dict[int, Task] = {}

    def threads_of(self, pid: int) -> list[Task]:
        return [t for t in self.tasks.values() if t.tgid == pid]

    def freeze_process(self, pid: int) -> list[Task]:
        """Seize and interrupt every thread of `pid`, re-scanning until no new one appears."""
        while True:
            try:
                tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
            except FileNotFoundError:
                raise TargetVanished(pid, "freeze") from None
            new = [tid for tid in tids if tid not in self.tasks]
            if not new:
                break
            for tid in new:
                task = Task(tid, pid)
                try:
                    task.seize()
                except TargetVanished:
                    if tid == pid:
                        raise
                    continue          # a thread that just exited
                self.tasks[tid] = task
                task.interrupt()
            for tid in new:
                task = self.tasks.get(tid)
                if task is not None and task.stop is None:
                    try:
                        task.wait_frozen()
                    except TargetVanished:
                        if tid == pid:
                            raise
                        del self.tasks[tid]
        # drop threads that exited while we scanned
        return self.threads_of(pid)

    def resume_process(self, pid: int) -> None:
        """Detach every thread of `pid`; it runs on exactly where it was."""
        for task in self.threads_of(pid):
            task.detach(0)
            for signo, _info in task.deferred_signals:
                _host_syscall(SYSCALL_NUMBERS["tgkill"], task.tgid, task.tid, signo)
            task.deferred_signals.clear()
            del self.tasks[task.tid]

    def resume_all(self) -> None:
        for pid in sorted({t.tgid for t in self.tasks.values()}):
            self.resume_process(pid)

    def kill_process(self, pid: int) -> None:
        """SIGKILL `pid` and collect the end of each of its threads.  A process that is ptckpt's
        own child (the library's caller started it) is seen to end but not reaped: its exit
        status is the caller's to collect (subprocess.Popen.wait, os.waitpid)."""
        own = _parent_of(pid) == os.getpid()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        # Non-leader threads first: a dead leader is reported only after them.
        for task in sorted(self.threads_of(pid), key=lambda t: t.tid == pid):
            if own and task.tid == pid:
                _wait_end_unreaped(task)
            while task.seized:
                try:
                    task.wait()
                except TargetVanished:
                    break
                with contextlib.suppress(Exception):
                    task.resume(0)
            del self.tasks[task.tid]


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


_ENDED = frozenset({os.CLD_EXITED, os.CLD_KILLED, os.CLD_DUMPED})


def _wait_end_unreaped(task: Task) -> None:
    """Wait until `task` (a process leader that is our child) has ended, leaving it a zombie:
    its stops on the way are taken and it is let go on; its end is looked at (WNOWAIT) only."""
    while True:
        try:
            info = os.waitid(os.P_PID, task.tid, os.WEXITED | os.WNOWAIT | WALL)
        except ChildProcessError:
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if info is None or info.si_code in _ENDED:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(task.tid, WALL)                 # a stop on its way out: taken ...
        with contextlib.suppress(Exception):
            task.resume(0)                             # ... and let go on
    task.stop = WaitStatus(StopKind.EXITED)
    task.seized = False


@contextlib.contextmanager
def probe_task(*, changed: bool = False) -> Iterator[Task]:
    """A throwaway sleeping child of ptckpt, seized and frozen, killed on exit.

    For questions only a tracee answers: this CPU's xstate size and XCR0,
    whether PTRACE_SEIZE and friends work here.  `changed`: the caller changes it beyond
    repair (its vdso): it dies still stopped, never let run again (it would crash).
    """
    pid = os.fork()
    if pid == 0:
        time.sleep(10)
        os._exit(0)
    try:
        task = Task(pid, pid)
        task.seize()
        task.interrupt()
        task.wait_frozen()
        yield task
        if not changed:
            task.detach()
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def xstate_header(xstate: bytes) -> tuple[int, int]:
    """(XSTATE_BV of the xsave header, XCR0) of an NT_X86_XSTATE blob.

    For ptrace the kernel stores the enabled feature mask (XCR0) in the
    FXSAVE area's software-reserved bytes at offset 464 (gdb's
    I386_LINUX_XSAVE_XCR0_OFFSET); the XSAVE header with XSTATE_BV starts at 512.
    """
    if len(xstate) < 520:
        return 0, 0
    xstate_bv = struct.unpack_from("<Q", xstate, 512)[0]
    xcr0 = struct.unpack_from("<Q", xstate, 464)[0]
    return xstate_bv, xcr0


def page_align(n: int) -> int:
    return (n + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)


def pidfd_getfd(pid: int, fd: int) -> int:
    """A copy, in ptckpt, of the target's fd `fd` (pidfd_open + pidfd_getfd); the caller closes it."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        raise _translate_os_error(exc, pid, "pidfd_open") from None
    try:
        res = _host_syscall(SYSCALL_NUMBERS["pidfd_getfd"], pidfd, fd, 0)
    finally:
        os.close(pidfd)
    if res < 0:
        raise _translate_errno(-res, pid, f"pidfd_getfd of fd {fd}")
    return res


KCMP_FILE, KCMP_FILES, KCMP_FS = 0, 2, 3


def same_kernel_object(pid1: int, pid2: int, kind: int) -> bool:
    """kcmp(KCMP_FILES or KCMP_FS): do the two processes share one fd table, or one fs
    state (cwd, root, umask)?"""
    res = _host_syscall(SYSCALL_NUMBERS["kcmp"], pid1, pid2, kind, 0, 0)
    if res < 0:
        raise _translate_errno(-res, pid1, f"kcmp of pid {pid2}")
    return res == 0


def same_open_file(pid1: int, fd1: int, pid2: int, fd2: int) -> bool:
    """kcmp(KCMP_FILE): do the two fds refer to one open file description (dup, fork)?"""
    res = _host_syscall(SYSCALL_NUMBERS["kcmp"], pid1, pid2, KCMP_FILE, fd1, fd2)
    if res < 0:
        raise _translate_errno(-res, pid1, f"kcmp of fd {fd1} and pid {pid2} fd {fd2}")
    return res == 0


KCMP_EPOLL_TFD = 7


class _KcmpEpollSlot(ctypes.Structure):
    # struct kcmp_epoll_slot (include/uapi/linux/kcmp.h)
    _fields_ = [("efd", ctypes.c_uint32), ("tfd", ctypes.c_uint32), ("toff", ctypes.c_uint32)]


def epoll_holds(pid: int, fd: int, ep_pid: int, epfd: int, tfd: int, toff: int) -> bool:
    """kcmp(KCMP_EPOLL_TFD): is the file of fd `fd` of `pid` the one registered in epoll
    `epfd` of `ep_pid` as the `toff`-th item (from 0) under fd number `tfd`?"""
    slot = _KcmpEpollSlot(epfd, tfd, toff)
    res = _host_syscall(SYSCALL_NUMBERS["kcmp"], pid, ep_pid, KCMP_EPOLL_TFD, fd,
                        ctypes.addressof(slot))
    if res in (-errno.EBADF, -errno.ENOENT):
        return False
    if res < 0:
        raise _translate_errno(-res, pid, f"kcmp of fd {fd} and epoll {epfd} of pid {ep_pid}")
    return res == 0
