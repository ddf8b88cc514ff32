"""Threads: registers, extended state, sigmask, rseq, robust list, tid address, sigaltstack.

Dump half: :func:`dump_thread_frozen` (the thread must be stopped by us).
The restore half arrives with the restorer.
"""

from __future__ import annotations

import struct

from ..formats.model import Restart, Thread
from ..tracee import RemoteSyscalls, Task, syscall_restart, xstate_header

PR_GET_TID_ADDRESS = 40


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
    # Readable only from inside: the calling thread's own clear_child_tid and
    # alternate signal stack.
    with remote.scratch(8) as buf:
        remote.checked("prctl", PR_GET_TID_ADDRESS, int(buf), step="dump thread")
        clear_child_tid = struct.unpack("<Q", remote.mem.read(buf, 8))[0]
    with remote.scratch(24) as buf:
        remote.checked("sigaltstack", 0, int(buf), step="dump thread")
        ss_sp, ss_flags, ss_size = struct.unpack("<QixxxxQ", remote.mem.read(buf, 24))
    return Thread(
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
