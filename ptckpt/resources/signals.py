"""Signals: dispositions (by injection) and queued signals (PTRACE_PEEKSIGINFO).

Dump half: :func:`dump_sigactions_frozen`, :func:`dump_pending_frozen`.
Restore half: the dispositions, the queues, and :func:`stop_signal_again` for a process
that was stopped (job control).
"""

from __future__ import annotations

import signal
import struct
from typing import Callable, Iterable

from ..formats.model import PendingSignal, ProcessImage, Sigaction
from ..tracee import RemoteSyscalls, Task

NSIG = 64
KERNEL_SIGACTION = struct.Struct("<QQQQ")   # struct sigaction as rt_sigaction sees it (x86_64)
# struct compat_sigaction (include/linux/compat.h): handler, flags, restorer as u32, the mask
# as two u32 words (the same bytes as one little-endian u64)
COMPAT_SIGACTION = struct.Struct("<IIIQ")


def dump_sigactions_frozen(remote: RemoteSyscalls) -> list[Sigaction]:
    """rt_sigaction(sig, NULL, &old, 8) for every signal, run inside the target.

    Dispositions live in the kernel's sighand_struct and nothing in /proc shows
    handler addresses, so the process has to be asked from inside.
    """
    out: list[Sigaction] = []
    with remote.scratch(KERNEL_SIGACTION.size) as buf:
        for sig in range(1, NSIG + 1):
            remote.checked("rt_sigaction", sig, 0, int(buf), 8, step="dump signal dispositions")
            handler, flags, restorer, mask = KERNEL_SIGACTION.unpack(
                remote.mem.read(buf, KERNEL_SIGACTION.size))
            out.append(Sigaction(sig, handler, flags, restorer, mask))
    return out


def dump_pending_frozen(tasks: Iterable[Task]) -> list[PendingSignal]:
    """Per-thread queues of every thread, then the shared (process-wide) queue once."""
    out: list[PendingSignal] = []
    tasks = list(tasks)
    for task in tasks:
        out.extend(PendingSignal(task.tid, info) for info in task.peek_siginfo(shared=False))
    if tasks:
        out.extend(PendingSignal(0, info) for info in tasks[0].peek_siginfo(shared=True))
    return out


# --- restore half ------------------------------------------------------------

SIGKILL, SIGSTOP = 9, 19
ALL_BLOCKED = (2**64 - 1) & ~(1 << (SIGKILL - 1)) & ~(1 << (SIGSTOP - 1))


def restore_sigactions_frozen(remote: RemoteSyscalls, actions: Iterable[Sigaction], compat: bool = False) -> None:
    """rt_sigaction(sig, &act, NULL, 8) for every signal (defaults too: exec kept ignored ones).

    `compat`: a 32-bit process's, through the i386 rt_sigaction: only a compat call marks
    a handler SA_IA32_ABI, which makes the kernel deliver its signals in ia32 frames
    (the x86_64 call would give a 32-bit handler a 64-bit frame)."""
    layout = COMPAT_SIGACTION if compat else KERNEL_SIGACTION
    with remote.scratch(layout.size) as buf:
        for a in actions:
            if a.signo in (SIGKILL, SIGSTOP):
                continue
            remote.mem.write(buf, layout.pack(a.handler, a.flags, a.restorer, a.mask))
            step = f"restore the disposition of signal {a.signo}"
            if compat:
                remote.checked_compat("rt_sigaction", a.signo, int(buf), 0, 8, step=step)
            else:
                remote.checked("rt_sigaction", a.signo, int(buf), 0, 8, step=step)


def restore_pending_frozen(remote: RemoteSyscalls, tgid: int, pending: Iterable[PendingSignal]) -> None:
    """Queue the saved signals again, from inside (so any si_code is allowed): the
    process-wide ones from its leader, a thread's own from that very thread (the kernel
    lets a thread queue a kernel-made siginfo only to itself)."""
    for p in pending:
        signo = struct.unpack_from("<i", p.siginfo, 0)[0]
        with remote.scratch(p.siginfo) as info:
            if p.tid:
                remote.checked("rt_tgsigqueueinfo", tgid, p.tid, signo, int(info),
                               step=f"queue signal {signo} for thread {p.tid}")
            else:
                remote.checked("rt_sigqueueinfo", tgid, signo, int(info),
                               step=f"queue signal {signo} for the process")


def stop_signal_again(proc: ProcessImage, orphaned: Callable[[], bool]) -> tuple[int, str]:
    """The signal that stops a restored process that was stopped: the one that stopped it,
    so that its parent's waitpid(WUNTRACED) reports the same WSTOPSIG (CRIU's zdtm
    stopped03); SIGSTOP for an image that did not record it.  SIGTSTP, SIGTTIN and SIGTTOU
    stop only by their default action, unblocked, and the kernel discards them in an
    orphaned process group (`orphaned()`, asked only for those): where one would not stop
    it, SIGSTOP does, and the second value says why (else "")."""
    sig = proc.task.stop_signal or SIGSTOP
    if sig == SIGSTOP:
        return sig, ""
    name = _signal_name(sig)
    why = ""
    if any(a.signo == sig and a.handler != 0 for a in proc.sigactions):
        why = f"it has a disposition for {name} now"
    elif proc.threads and all(t.sigmask & (1 << (sig - 1)) for t in proc.threads):
        why = f"every thread blocks {name}"
    elif orphaned():
        why = f"its process group {proc.task.pgid} is orphaned here (the kernel discards {name})"
    if why:
        return SIGSTOP, (f"process {proc.task.pid} was stopped by {name} and is stopped by SIGSTOP "
                         f"instead: {why}")
    return sig, ""


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
