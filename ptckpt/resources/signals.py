"""Signals: dispositions (by injection) and queued signals (PTRACE_PEEKSIGINFO).

Dump half: :func:`dump_sigactions_frozen`, :func:`dump_pending_frozen`.
"""

from __future__ import annotations

import struct
from typing import Iterable

from ..formats.model import PendingSignal, Sigaction
from ..tracee import RemoteSyscalls, Task

NSIG = 64
KERNEL_SIGACTION = struct.Struct("<QQQQ")   # struct sigaction as rt_sigaction sees it (x86_64)


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


def restore_sigactions_frozen(remote: RemoteSyscalls, actions: Iterable[Sigaction]) -> None:
    """rt_sigaction(sig, &act, NULL, 8) for every signal (defaults too: exec kept ignored ones)."""
    with remote.scratch(KERNEL_SIGACTION.size) as buf:
        for a in actions:
            if a.signo in (SIGKILL, SIGSTOP):
                continue
            remote.mem.write(buf, KERNEL_SIGACTION.pack(a.handler, a.flags, a.restorer, a.mask))
            remote.checked("rt_sigaction", a.signo, int(buf), 0, 8,
                           step=f"restore the disposition of signal {a.signo}")


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
