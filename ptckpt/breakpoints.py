"""Breakpoints without preload: int3 at a function's entry, a callback on its calls.

:func:`run` takes the stopped, traced threads of one process (a restore leaves
them so) and the :class:`Breakpoint` s registered for it, writes an int3 at each
address, lets the threads run and handles every hit: the callback gets a
:class:`Hit` (the call's number, its registers to read and change, the process's
memory, and :meth:`Hit.on_return` for a callback when that call returns); it
returns True to keep the breakpoint.  Once no breakpoint is left the original
bytes are back and every thread is detached: the program runs on untraced.

Calls are counted per breakpoint over all threads; while one thread steps over
its breakpoint another could pass it uncounted (a call count is exact for a
function one thread calls).  A fork gets the original bytes back in the child,
which runs untraced; an exec ends the breakpoints of that process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import PtckptError, TargetVanished
from .formats.model import GP_REG_NAMES
from .tracee import USER32_CS, AddressSpace, StopKind, Task, TraceEvent, WaitStatus

log = logging.getLogger("ptckpt.breakpoints")

INT3 = b"\xcc"
ARG_REGISTERS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")       # the SysV x86-64 calling convention
# A 32-bit (ia32) thread's calls follow the i386 System V convention: arguments are 4-byte
# words on the stack above the return address (cdecl), the result comes back in eax.


@dataclass
class Breakpoint:
    address: int
    callback: Callable[["Hit"], bool]
    name: str = ""
    calls: int = 0
    active: bool = True


@dataclass
class Hit:
    """One call reaching a breakpoint: what the callback sees and changes."""

    number: int                     # 1 for the first call since the breakpoints went in
    tid: int
    proc: object                    # a ProcessHandle-like object: read/write/symbol ...
    regs: dict[str, int]
    changed: dict[str, int] = field(default_factory=dict)
    returns: list[Callable[["Hit"], None]] = field(default_factory=list)

    @property
    def compat(self) -> bool:
        """The call is made by 32-bit (ia32) code: its arguments are on the stack."""
        return self.regs.get("cs") == USER32_CS

    def _stack_arg(self, index: int) -> int:
        return (self.regs["rsp"] + 4 + 4 * index) & 0xFFFFFFFF

    def arg(self, index: int) -> int:
        """Argument `index` (from 0) of the call, read at its entry: a register, or for a
        32-bit call the word on the stack (a 4-byte int or pointer; a 64-bit argument is
        two words)."""
        if self.compat:
            with AddressSpace(self.tid) as mem:
                return int.from_bytes(mem.read(self._stack_arg(index), 4), "little")
        return self.regs[ARG_REGISTERS[index]]

    def set_arg(self, index: int, value: int) -> None:
        if self.compat:
            with AddressSpace(self.tid) as mem:
                mem.write(self._stack_arg(index), (value & 0xFFFFFFFF).to_bytes(4, "little"))
            return
        if index >= len(ARG_REGISTERS):
            raise PtckptError(f"argument {index} of a call is not in a register (the first six are)")
        self.set(**{ARG_REGISTERS[index]: value})

    @property
    def result(self) -> int:
        """What the call returned (at its return): rax, or eax for a 32-bit call."""
        return self.regs["rax"] & (0xFFFFFFFF if self.compat else 2**64 - 1)

    def set_result(self, value: int) -> None:
        self.set(rax=value & (0xFFFFFFFF if self.compat else 2**64 - 1))

    def set(self, **values: int) -> None:
        for name, value in values.items():
            if name not in self.regs:
                raise PtckptError(f"no register {name!r}")
            self.regs[name] = value & (2**64 - 1)
            self.changed[name] = self.regs[name]

    def on_return(self, callback: Callable[["Hit"], None]) -> None:
        """Call `callback` when this call returns (its Hit: rax is the return value)."""
        self.returns.append(callback)


def _regs(task: Task) -> dict[str, int]:
    return dict(zip(GP_REG_NAMES, task.get_regs().values()))


def _set_regs(task: Task, values: dict[str, int]) -> None:
    regs = task.get_regs()
    for name, value in values.items():
        setattr(regs, name, value)
    task.set_regs(regs)


class _Session:
    def __init__(self, pid: int, tasks: list[Task], breakpoints: list[Breakpoint], proc):
        self.pid = pid
        self.tasks = {t.tid: t for t in tasks}
        self.bps = {b.address: b for b in breakpoints}
        self.proc = proc
        self.original: dict[int, bytes] = {}
        self.returns: dict[tuple[int, int], tuple[int, list, Hit]] = {}   # (tid, addr) -> (rsp, callbacks, hit)
        self.exit_status: int | None = None     # the process's wait status, if it ended (and we reaped it)

    # bytes
    def _insert(self, addr: int) -> None:
        with AddressSpace(self.pid) as mem:
            if addr not in self.original:
                self.original[addr] = mem.read(addr, 1)
            mem.write(addr, INT3)

    def _remove(self, addr: int, pid: int | None = None) -> None:
        if addr in self.original:
            with AddressSpace(pid or self.pid) as mem:
                mem.write(addr, self.original[addr])

    def _wanted(self, addr: int) -> bool:
        bp = self.bps.get(addr)
        return (bp is not None and bp.active) or any(a == addr for (_t, a) in self.returns)

    def done(self) -> bool:
        return not any(b.active for b in self.bps.values()) and not self.returns

    # the loop
    def run(self, deadline: float | None) -> None:
        for addr in self.bps:
            self._insert(addr)
        for task in self.tasks.values():
            task.resume(0)
        while self.tasks and not self.done():
            if deadline is not None and time.monotonic() > deadline:
                log.warning("breakpoints: time is up, %d call(s) never came",
                            sum(b.active for b in self.bps.values()))
                break
            busy = False
            for task in list(self.tasks.values()):
                got = task.poll()
                if got is None:
                    continue
                busy = True
                st, raw = got
                if st.kind is StopKind.EXITED and task.tid == self.pid and raw >= 0:
                    self.exit_status = raw
                self._handle(task, st)
            if not busy:
                time.sleep(0.0005)
        self.finish()

    def _handle(self, task: Task, st: WaitStatus) -> None:
        if st.kind is StopKind.EXITED:
            del self.tasks[task.tid]
            return
        if st.kind is StopKind.SIGNAL and st.signo == signal.SIGTRAP:
            rip = task.get_regs().rip - 1
            if rip in self.original:             # ours (perhaps one taken out meanwhile)
                self._hit(task, rip)
                return
        if st.kind is StopKind.EVENT:
            self._event(task, st)
            return
        sig = st.signo if st.kind is StopKind.SIGNAL else 0
        task.resume(sig)

    def _hit(self, task: Task, addr: int) -> None:
        regs = _regs(task)
        regs["rip"] = addr
        changed = {"rip": addr}
        key = (task.tid, addr)
        if key in self.returns and self.returns[key][0] == regs["rsp"]:
            _rsp, callbacks, call = self.returns.pop(key)
            ret = Hit(call.number, task.tid, self.proc, regs)
            for cb in callbacks:
                cb(ret)
            changed.update(ret.changed)
        bp = self.bps.get(addr)
        if bp is not None and bp.active:
            bp.calls += 1
            hit = Hit(bp.calls, task.tid, self.proc, regs)
            bp.active = bool(bp.callback(hit))
            changed.update(hit.changed)
            if hit.returns:
                width = 4 if hit.compat else 8           # the return address a call pushed
                with AddressSpace(self.pid) as mem:
                    ret_addr = int.from_bytes(mem.read(regs["rsp"], width), "little")
                self.returns[(task.tid, ret_addr)] = (regs["rsp"] + width, hit.returns, hit)
                self._insert(ret_addr)
        _set_regs(task, changed)
        # step over: the original byte for one instruction, then the int3 again if wanted
        self._remove(addr)
        if changed.get("rip", addr) == addr:
            task.single_step()
        if self._wanted(addr):
            self._insert(addr)
        task.resume(0)

    def _event(self, task: Task, st: WaitStatus) -> None:
        new = task.get_event_msg()
        if st.event == TraceEvent.CLONE:
            self.tasks[new] = Task.followed(new, self.pid)     # it reports a stop of its own
        elif st.event in (TraceEvent.FORK, TraceEvent.VFORK):
            child = Task.followed(new, new)
            with contextlib.suppress(TargetVanished):
                child.wait()                    # its first stop
                for addr in self.original:
                    self._remove(addr, new)     # the child has the int3s too: take them out
                child.detach()
        elif st.event == TraceEvent.EXEC:
            self.original.clear()               # a new program: no breakpoints in it
            for b in self.bps.values():
                b.active = False
            self.returns.clear()
        task.resume(0)

    def finish(self) -> None:
        """The original bytes back, every thread detached (stopped first, so none is
        inside our int3 while its byte changes)."""
        for task in list(self.tasks.values()):
            with contextlib.suppress(PtckptError):
                task.interrupt()
        for task in list(self.tasks.values()):
            with contextlib.suppress(PtckptError):
                while True:
                    st = task.wait()
                    if st.kind in (StopKind.INTERRUPT, StopKind.GROUP_STOP):
                        break
                    if st.kind is StopKind.SIGNAL and st.signo == signal.SIGTRAP:
                        rip = task.get_regs().rip - 1
                        if rip in self.original:          # it hit one on the way: undo the trap
                            _set_regs(task, {"rip": rip})
                            task.resume(0)
                            continue
                    if st.kind is StopKind.SIGNAL:
                        task.deferred_signals.append((st.signo, b""))
                    task.resume(0)
        for addr in list(self.original):
            with contextlib.suppress(PtckptError):
                self._remove(addr)
        self.original.clear()
        for task in self.tasks.values():
            sigs = [s for s, _ in task.deferred_signals]
            task.deferred_signals.clear()
            task.detach(0)
            for sig in sigs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(task.tgid, sig)


def run(pid: int, tasks: list[Task], breakpoints: list[Breakpoint], proc, *,
        timeout: float | None = None) -> int | None:
    """Run the stopped, traced `tasks` of `pid` with `breakpoints` until none is left (or
    the process ends, or `timeout` passes); then everything is detached.  The process's
    wait status if it ended meanwhile and this reaped it (it was ptckpt's child), else None."""
    session = _Session(pid, tasks, breakpoints, proc)
    session.run(None if timeout is None else time.monotonic() + timeout)
    return session.exit_status
