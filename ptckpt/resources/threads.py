"""Threads: registers, extended state, sigmask, rseq, robust list, tid address, sigaltstack.

Dump half: :func:`dump_thread_frozen` (the thread must be stopped by us).
The restore half arrives with the restorer.
"""

from __future__ import annotations

import os
import signal
import struct

from .. import procfs
from ..formats.model import Restart, Thread
from ..errors import PtckptError, UnsupportedResource
from ..tracee import ERESTARTNOHAND, Regs, RemotePtr, RemoteSyscalls, Task, syscall_restart, xstate_header
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
    robust_head, robust_len = task.get_robust_list()
    kind, nr = syscall_restart(regs)
    if nr == NR_RESTART_SYSCALL:
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
    )


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
    if thread.restart is Restart.RESTART_BLOCK:
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


def restore_thread_frozen(task: Task, remote: RemoteSyscalls, thread: Thread) -> None:
    """Per-thread kernel state, set from inside the thread itself; registers last."""
    if thread.rseq_addr:
        remote.checked("rseq", thread.rseq_addr, thread.rseq_len, 0, thread.rseq_sig,
                       step=f"register rseq of thread {thread.tid}")
    if thread.robust_list:
        remote.checked("set_robust_list", thread.robust_list, thread.robust_list_len,
                       step=f"robust list of thread {thread.tid}")
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
    """(policy, rt_priority, nice) of one thread: each thread has its own."""
    st = procfs.read_stat(pid, tid)
    if st.policy & ~SCHED_RESET_ON_FORK == SCHED_DEADLINE:
        raise UnsupportedResource(pid, f"thread {tid} under SCHED_DEADLINE (its runtime, deadline "
                                  "and period are not restored yet)")
    return (st.policy, st.rt_priority, st.nice)


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
    task.set_regs(resume_regs(thread))
    if thread.restart is not Restart.NONE:
        task.interrupt()
        task.resume(0)
        task.wait_frozen()
