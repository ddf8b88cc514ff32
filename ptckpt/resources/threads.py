"""Threads: registers, extended state, sigmask, rseq, robust list, tid address, sigaltstack.

Dump half: :func:`dump_thread_frozen` (the thread must be stopped by us).
The restore half arrives with the restorer.
"""

from __future__ import annotations

import os
import signal
import struct
from typing import Sequence

from .. import procfs
from ..formats.model import GP_REG_NAMES, Restart, Thread
from ..errors import PtckptError, UnsupportedResource
from ..tracee import (ERESTARTNOHAND, I386_SYSCALLS as I386, TLS_ENTRIES, USER32_CS, Regs, RemotePtr,
                      RemoteSyscalls, Task, compat_mode, syscall_restart, xstate_header)
from .pids import clone_args

PR_GET_TID_ADDRESS = 40
PR_SET_NAME = 15


def dump_thread_frozen(task: Task, remote: RemoteSyscalls, comm: str = "") -> Thread:
    """Capture one thread.  `remote` is an injection scope on this very thread.

    The general registers are taken before anything is injected (the scope
    saved them on entry), so they are exactly what PTRACE_GETREGS gave at the
    freeze; the restart fix-up is recorded next to them, not applied.
    """
    regs = remote.saved_regs
    assert regs is not None
    xstate = task.get_xstate()
    xstate_bv, _xcr0 = xstate_header(xstate)
    rseq = task.get_rseq()
    compat = compat_mode(regs)
    robust_head, robust_len = _compat_robust_list(remote) if compat else task.get_robust_list()
    kind, nr = syscall_restart(regs)
    if compat and kind and nr == I386["restart_syscall"]:
        nr = restarted_syscall_compat(regs, remote.mem)
    elif not compat and nr == NR_RESTART_SYSCALL:
        nr = restarted_syscall(regs, remote.mem)
    # Readable only from inside: the calling thread's own clear_child_tid and
    # alternate signal stack.
    with remote.scratch(8) as buf:
        remote.checked("prctl", PR_GET_TID_ADDRESS, int(buf), step="dump thread")
        clear_child_tid = struct.unpack("<Q", remote.mem.read(buf, 8))[0]
    with remote.scratch(24) as buf:
        remote.checked("sigaltstack", 0, int(buf), step="dump thread")
        ss_sp, ss_flags, ss_size = struct.unpack("<QixxxxQ", remote.mem.read(buf, 24))
    return Thread(
        cpus=dump_affinity(task.tid),
        sched=dump_sched(task.tgid, task.tid),
        tid=task.tid,
        regs=regs.values(),
        xstate=xstate,
        xfeatures=xstate_bv,
        sigmask=task.get_sigmask(),
        rseq_addr=rseq.addr,
        rseq_len=rseq.size,
        rseq_sig=rseq.signature,
        rseq_flags=rseq.flags,
        robust_list=robust_head,
        robust_list_len=robust_len,
        clear_child_tid=clear_child_tid,
        sas_sp=ss_sp,
        sas_flags=ss_flags,
        sas_size=ss_size,
        restart=Restart(kind),
        syscall_nr=nr,
        comm=comm,
        tls=dump_tls(task) if compat else (),
    )


def _compat_robust_list(remote: RemoteSyscalls) -> tuple[int, int]:
    """A 32-bit thread's robust futex list is the kernel's compat one, which only the
    compat get_robust_list answers (the x86_64 call shows the native list: none)."""
    with remote.scratch(8) as buf:
        remote.checked_compat("get_robust_list", 0, int(buf), int(buf) + 4, step="dump thread")
        head, length = struct.unpack("<II", remote.mem.read(buf, 8))
    return head, length


EMPTY_TLS_FLAGS = 0x28        # read_exec_only | seg_not_present: how an unused entry reads


def dump_tls(task: Task) -> tuple[tuple[int, int, int, int], ...]:
    """The thread's used GDT TLS entries (set_thread_area: a 32-bit program's %gs points at
    one), as struct user_desc's (entry_number, base_addr, limit, flags)."""
    out = []
    for entry in TLS_ENTRIES:
        desc = struct.unpack("<IIII", task.get_thread_area(entry))
        if desc[1:] != (0, 0, EMPTY_TLS_FLAGS):
            out.append(desc)
    return tuple(out)


def is_compat(thread: Thread) -> bool:
    """The thread was frozen running 32-bit (ia32) code."""
    return thread.regs[GP_REG_NAMES.index("cs")] == USER32_CS


def compat_process(threads: Sequence[Thread], pid: int) -> bool:
    """A 32-bit (ia32) process: its leader was frozen running 32-bit code."""
    return any(is_compat(t) for t in threads if t.tid == pid)


NR_RESTART_SYSCALL = 219
NR_FUTEX = 202
FUTEX_WAIT, FUTEX_WAIT_BITSET, FUTEX_FLAGS = 0, 9, 128 | 256      # | FUTEX_PRIVATE_FLAG, CLOCK_REALTIME


def restarted_syscall(regs, mem) -> int:
    """The syscall a thread frozen in restart_syscall was restarting, from its arguments.

    A thread frozen once in a sleep (a leave-running dump, ``ptckpt run``) goes on in
    restart_syscall with the kernel's restart block, which a new process does not have:
    executed again there, it would fail with EINTR.  The registers still hold the
    original call's arguments, and they tell the sleeps that restart this way apart:
    clock_nanosleep(clock id, flags 0|TIMER_ABSTIME, req, rem); futex(uaddr, a wait op,
    val, timeout); nanosleep(req, rem) with req a valid timespec.  Anything else keeps
    restart_syscall (and meets EINTR, as under CRIU).
    """
    if regs.rdi < 16 and regs.rsi in (0, TIMER_ABSTIME) and regs.rdx >= 0x1000:
        return NR_CLOCK_NANOSLEEP
    if regs.rdi >= 0x1000 and (regs.rsi & ~FUTEX_FLAGS) in (FUTEX_WAIT, FUTEX_WAIT_BITSET) and regs.rsi:
        return NR_FUTEX
    if regs.rdi >= 0x1000 and (regs.rsi == 0 or regs.rsi >= 0x1000):
        try:
            sec, nsec = struct.unpack("<qq", mem.read(RemotePtr(regs.rdi), 16))
        except PtckptError:
            return NR_RESTART_SYSCALL
        if sec >= 0 and 0 <= nsec < 1_000_000_000:
            return NR_NANOSLEEP
    return NR_RESTART_SYSCALL


def restarted_syscall_compat(regs, mem) -> int:
    """restarted_syscall for a 32-bit thread (i386 numbers, arguments in ebx, ecx, edx, esi).

    The sleeps come in two forms, a 32-bit glibc using either: clock_nanosleep with an
    8-byte timespec, or clock_nanosleep_time64 with a 16-byte one (futex and futex_time64
    alike).  The registers cannot tell them apart; the timespec can: the remaining time the
    kernel wrote at the freeze (or the request, without a `rem`) is read both ways
    (_timespec_is_64).
    Anything else keeps restart_syscall (and meets EINTR)."""
    if regs.rbx < 16 and regs.rcx in (0, TIMER_ABSTIME) and regs.rdx >= 0x1000:
        wide = _timespec_is_64(mem, regs.rsi if regs.rsi and not regs.rcx & TIMER_ABSTIME else regs.rdx)
        if wide is not None:
            return I386["clock_nanosleep_time64" if wide else "clock_nanosleep"]
    if regs.rbx >= 0x1000 and (regs.rcx & ~FUTEX_FLAGS) in (FUTEX_WAIT, FUTEX_WAIT_BITSET) and regs.rcx:
        wide = _timespec_is_64(mem, regs.rsi) if regs.rsi >= 0x1000 else False
        if wide is not None:
            return I386["futex_time64" if wide else "futex"]
    return I386["restart_syscall"]


def _timespec_is_64(mem, addr: int) -> bool | None:
    """Whether the timespec at `addr` is a 16-byte one (True), an 8-byte one (False) or
    neither (None).  An 8-byte one with nanoseconds reads as a 16-byte one of more than
    2**32 seconds; a 16-byte one reads as an 8-byte one with 0 ns (the high half of its
    seconds), the only case both fit: then the 16-byte reading wins (were it the other,
    the sleep would differ by the nanoseconds read beyond it: less than a second)."""
    try:
        data = mem.read(RemotePtr(addr), 16)
    except PtckptError:
        return None
    sec32, nsec32 = struct.unpack_from("<ii", data)
    sec64, nsec64 = struct.unpack_from("<qq", data)
    narrow = sec32 >= 0 and 0 <= nsec32 < 1_000_000_000
    wide = 0 <= sec64 < 2**32 and (nsec64 & 0xFFFFFFFF) < 1_000_000_000
    if narrow and nsec32:
        return False
    if wide:
        return True
    return False if narrow else None


# --- restore half ------------------------------------------------------------

NR_NANOSLEEP = 35
NR_CLOCK_NANOSLEEP = 230
TIMER_ABSTIME = 1
SS_ONSTACK, SS_DISABLE = 1, 2
CLONE_THREAD_FLAGS = (0x100 | 0x200 | 0x400 | 0x800 | 0x10000 | 0x40000)
# CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM


def reexecuted_regs(thread: Thread):
    """The registers of a thread frozen inside a syscall as they are once the kernel decided
    to execute it again (no handler ran): rax = the syscall, rip back on the syscall
    instruction, orig_rax -1.  -ERESTART_RESTARTBLOCK has no restart block in a new process,
    so the syscall itself runs again; for nanosleep and relative clock_nanosleep the kernel
    had already written the remaining time to `rem` at the freeze, so that is what the
    thread sleeps.  (ptckpt.diff compares two threads in this form.)"""
    regs = Regs.from_values(thread.regs)
    if thread.restart is Restart.NONE:
        regs.orig_rax = 2**64 - 1
        return regs
    regs.rax = thread.syscall_nr
    regs.rip = regs.rip - 2
    regs.orig_rax = 2**64 - 1
    _sleep_what_is_left(thread, regs)
    return regs


def _sleep_what_is_left(thread: Thread, regs) -> None:
    if thread.restart is Restart.RESTART_BLOCK and compat_mode(regs):
        _sleep_what_was_left_compat(regs, thread.syscall_nr)
    elif thread.restart is Restart.RESTART_BLOCK:
        if thread.syscall_nr == NR_NANOSLEEP and regs.rsi:
            regs.rdi = regs.rsi                      # nanosleep(rem, rem)
        elif thread.syscall_nr == NR_CLOCK_NANOSLEEP and not regs.rsi & TIMER_ABSTIME and regs.r10:
            regs.rdx = regs.r10                      # clock_nanosleep(clk, 0, rem, rem)


def resume_regs(thread: Thread):
    """The registers a restored thread starts with: the dumped ones; a thread frozen inside a
    syscall gets them as the kernel leaves them in the middle of it (orig_rax the syscall,
    rax its -ERESTART* code, rip after the syscall instruction), so that the kernel's own
    restart logic decides when it goes on (set_final_state): a signal whose handler runs
    first makes the syscall fail with EINTR where the kernel would (a pause(), or a read
    without SA_RESTART), else it is executed again.  -ERESTART_RESTARTBLOCK needs the
    kernel's restart block, which a new process has not: it is presented as
    -ERESTARTNOHAND of the syscall itself (the same EINTR after a handler), sleeping what
    was left (reexecuted_regs)."""
    regs = Regs.from_values(thread.regs)
    if thread.restart is Restart.NONE:
        regs.orig_rax = 2**64 - 1
        return regs
    regs.orig_rax = thread.syscall_nr
    if thread.restart is Restart.RESTART_BLOCK:
        regs.rax = 2**64 - ERESTARTNOHAND
        _sleep_what_is_left(thread, regs)
    return regs


def _sleep_what_was_left_compat(regs: Regs, nr: int) -> None:
    """resume_regs' remaining-time rule in i386 registers (req, rem in ebx, ecx; clock,
    flags, req, rem in ebx, ecx, edx, esi)."""
    if nr == I386["nanosleep"] and regs.rcx:
        regs.rbx = regs.rcx                          # nanosleep(rem, rem)
    elif nr in (I386["clock_nanosleep"], I386["clock_nanosleep_time64"]) and \
            not regs.rcx & TIMER_ABSTIME and regs.rsi:
        regs.rdx = regs.rsi                          # clock_nanosleep(clk, 0, rem, rem)


def create_thread_frozen(remote: RemoteSyscalls, tid: int):
    """clone3 a thread with tid `tid` into the process (CLONE_THREAD, set_tid); returns its Task.

    The tracer follows clones (PTRACE_O_TRACECLONE), so the new thread starts
    in a ptrace stop; its registers are all set before it runs.
    """
    return _clone_frozen(remote, tid, CLONE_THREAD_FLAGS, 0, f"create thread {tid}",
                         remote.task.tgid)


CLONE_FS, CLONE_FILES = 0x200, 0x400


def create_process_frozen(remote: RemoteSyscalls, pid: int, *, files: bool = False, fs: bool = False):
    """clone3 a child process with pid `pid` (set_tid, exit signal SIGCHLD) from the tracee,
    sharing its fd table or fs state where asked; the tracer follows forks, so it starts in
    a ptrace stop.  Returns its Task."""
    flags = (CLONE_FILES if files else 0) | (CLONE_FS if fs else 0)
    return _clone_frozen(remote, pid, flags, signal.SIGCHLD, f"create process {pid}", None)


def _clone_frozen(remote: RemoteSyscalls, tid: int, flags: int, exit_signal: int, step: str,
                  tgid: int | None):
    with remote.scratch(struct.pack("<i4x", tid)) as tidp:
        args = clone_args(int(tidp), flags=flags, exit_signal=exit_signal)
        with remote.scratch(args) as argp:
            remote.checked("clone3", int(argp), len(args), step=step)
    # clone3 returns the tid in the process's own pid namespace; the clone or
    # fork event told the tracer the tid in its namespace.
    new = remote.last_clone
    task = Task.followed(new, new if tgid is None else tgid)
    task.wait_frozen()
    return task


def restore_robust_list_frozen(remote: RemoteSyscalls, thread: Thread, *, step: str) -> None:
    """The thread's robust futex list again (a 32-bit thread's by the compat call: its
    list head has 4-byte pointers, 12 bytes, which the x86_64 call refuses)."""
    if thread.robust_list and is_compat(thread):
        remote.checked_compat("set_robust_list", thread.robust_list, thread.robust_list_len, step=step)
    elif thread.robust_list:
        remote.checked("set_robust_list", thread.robust_list, thread.robust_list_len, step=step)


def restore_thread_frozen(task: Task, remote: RemoteSyscalls, thread: Thread) -> None:
    """Per-thread kernel state, set from inside the thread itself; registers last."""
    if thread.rseq_addr:
        remote.checked("rseq", thread.rseq_addr, thread.rseq_len, 0, thread.rseq_sig,
                       step=f"register rseq of thread {thread.tid}")
    restore_robust_list_frozen(remote, thread, step=f"robust list of thread {thread.tid}")
    remote.checked("set_tid_address", thread.clear_child_tid, step=f"clear_child_tid of thread {thread.tid}")
    flags = thread.sas_flags & ~SS_ONSTACK
    if not flags & SS_DISABLE:
        with remote.scratch(struct.pack("<QixxxxQ", thread.sas_sp, flags, thread.sas_size)) as ss:
            remote.checked("sigaltstack", int(ss), 0, step=f"sigaltstack of thread {thread.tid}")
    if thread.comm:
        with remote.scratch(thread.comm.encode(errors="surrogateescape")[:15] + b"\0") as name:
            remote.checked("prctl", PR_SET_NAME, int(name), step=f"comm of thread {thread.tid}")


def online_cpus() -> set[int]:
    """The CPUs online on this host (/sys/devices/system/cpu/online, e.g. "0-3,6")."""
    out: set[int] = set()
    with open("/sys/devices/system/cpu/online") as f:
        for part in f.read().strip().split(","):
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def dump_affinity(tid: int) -> tuple[int, ...]:
    """The thread's CPU affinity; () when it may run on every online CPU (no choice made)."""
    cpus = os.sched_getaffinity(tid)
    return () if cpus >= online_cpus() else tuple(sorted(cpus))


SCHED_DEADLINE = 6
SCHED_RESET_ON_FORK = 0x40000000


def dump_sched(pid: int, tid: int) -> tuple[int, int, int]:
    """(policy, rt_priority, nice) of one thread: each thread has its own.  The policy is
    sched_getscheduler's, with SCHED_RESET_ON_FORK, which /proc/PID/stat leaves out."""
    st = procfs.read_stat(pid, tid)
    try:
        policy = os.sched_getscheduler(tid)
    except OSError as err:
        raise PtckptError(f"cannot read the scheduling policy of thread {tid} of process {pid}: "
                          f"{err.strerror}") from None
    if policy & ~SCHED_RESET_ON_FORK == SCHED_DEADLINE:
        raise UnsupportedResource(pid, f"thread {tid} under SCHED_DEADLINE (its runtime, deadline "
                                  "and period are not restored yet)")
    return (policy, st.rt_priority, st.nice)


def restore_sched(task: Task, thread: Thread) -> list[str]:
    """Scheduling policy, real-time priority and nice of one thread, from outside."""
    if not thread.sched:
        return []
    policy, prio, nice = thread.sched
    warnings = []
    try:
        if os.sched_getscheduler(task.tid) != policy or os.sched_getparam(task.tid).sched_priority != prio:
            os.sched_setscheduler(task.tid, policy, os.sched_param(prio))
    except OSError as err:
        warnings.append(f"thread {thread.tid}: cannot set scheduling policy {policy} priority "
                        f"{prio}: {err.strerror}")
    try:
        if os.getpriority(os.PRIO_PROCESS, task.tid) != nice:
            os.setpriority(os.PRIO_PROCESS, task.tid, nice)
    except OSError as err:
        warnings.append(f"thread {thread.tid}: cannot set nice {nice}: {err.strerror}")
    return warnings


def restore_affinity(task: Task, thread: Thread) -> list[str]:
    """From outside; the CPUs this host lacks are left out (a warning says so)."""
    if not thread.cpus:
        return []
    here = set(thread.cpus) & online_cpus()
    if not here:
        return [f"thread {thread.tid}: none of its CPUs {list(thread.cpus)} is online here; "
                "it runs on any"]
    os.sched_setaffinity(task.tid, here)
    if len(here) < len(thread.cpus):
        return [f"thread {thread.tid}: CPUs {sorted(set(thread.cpus) - here)} are not online here"]
    return []


def set_final_state(task: Task, thread: Thread) -> None:
    """Registers, extended state and signal mask: the last thing before the thread runs.  A
    thread frozen inside a syscall is then brought into an interrupt stop, inside the
    kernel's get_signal(): when it goes on, a pending signal is delivered first and the
    kernel's restart logic runs on its registers (resume_regs), as it would have for the
    original thread."""
    task.set_xstate(thread.xstate)
    task.set_sigmask(thread.sigmask)
    for desc in thread.tls:                      # before the registers: %gs selects one
        task.set_thread_area(struct.pack("<IIII", *desc))
    task.set_regs(resume_regs(thread))
    if thread.restart is not Restart.NONE:
        task.interrupt()
        task.resume(0)
        task.wait_frozen()
