"""The app block of a cooperating program (ptckpt.app, ptckpt.h), seen from outside.

* :func:`locate` -- its address: a mapping of the memfd ``ptckpt-app`` (Python
  programs) or the ELF symbol ``ptckpt_app`` of the executable (C programs);
  None for a program that does not cooperate (the common case, found cheaply:
  the executable is only parsed when its bytes hold the symbol's name);
* :func:`wait_outside_critical` -- what a dump does before it freezes: wait until
  no process of the tree is inside a critical section, or fail naming the section;
* :func:`mark` -- after a dump (CONTINUED) or a restore (RESTORED): the state, a
  new generation, the request cleared, the image's directory.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from . import procfs
from .app import (LAYOUT, MAGIC, MEMFD_NAME, OFF_GENERATION, OFF_LAST_IMAGE, OFF_REQUEST, OFF_STATE, SYMBOL,
                  CONTINUED, FAILED, RESTORED)
from .errors import CriticalSection, PtckptError
from .tracee import AddressSpace

__all__ = ["AppState", "locate", "read", "wait_outside_critical", "mark", "CONTINUED", "FAILED", "RESTORED"]

_HAS_SYMBOL: dict[tuple, bool] = {}


@dataclass(frozen=True)
class AppState:
    critical: int
    request: int
    state: int
    hold_tid: int
    generation: int
    section: str
    last_image: str


def _mentions_symbol(path: str) -> bool:
    """Does the file hold the bytes "ptckpt_app\\0" (a string table entry)?  Cached by inode."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    key = (st.st_dev, st.st_ino, st.st_mtime_ns)
    if key not in _HAS_SYMBOL:
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                _HAS_SYMBOL[key] = m.find(SYMBOL.encode() + b"\0") >= 0
        except (OSError, ValueError):
            _HAS_SYMBOL[key] = False
    return _HAS_SYMBOL[key]


def locate(pid: int, exe: str | None = None) -> int | None:
    """The app block's address in `pid`, or None.  `exe`: the executable's path when
    /proc/PID/exe does not tell it (a process being restored)."""
    try:
        maps = procfs.read_maps(pid)
        name = os.path.basename(exe or procfs.read_exe(pid))
    except (PtckptError, OSError):
        return None
    for m in maps:
        if m.path == f"/memfd:{MEMFD_NAME}" and m.shared and m.offset == 0 and _magic_at(pid, m.start):
            return m.start
    if not _mentions_symbol(exe or f"/proc/{pid}/exe"):
        return None
    from .symbols import SymbolError, SymbolTable
    try:
        sym = SymbolTable.for_process(pid).lookup(SYMBOL, object=name)
    except SymbolError:
        return None
    return sym.address if _magic_at(pid, sym.address) else None


def _magic_at(pid: int, addr: int) -> bool:
    try:
        with AddressSpace(pid) as mem:
            return mem.read(addr, len(MAGIC)) == MAGIC
    except PtckptError:
        return False


def read(pid: int, addr: int) -> AppState:
    with AddressSpace(pid) as mem:
        raw = mem.read(addr, LAYOUT.size)
    _magic, critical, request, state, hold, gen, section, last = LAYOUT.unpack(raw)
    text = lambda b: b.split(b"\0", 1)[0].decode(errors="replace")     # noqa: E731
    return AppState(critical, request, state, hold, gen, text(section), text(last))


def locate_all(pids: Iterable[int]) -> dict[int, int]:
    return {p: a for p in pids if (a := locate(p)) is not None}


def busy(blocks: dict[int, int]) -> tuple[int, AppState] | None:
    """The first process inside a critical section, with its block, or None."""
    for pid, addr in blocks.items():
        try:
            st = read(pid, addr)
        except PtckptError:
            continue                 # it exited: the freeze will tell
        if st.critical > 0:
            return pid, st
    return None


def wait_outside_critical(blocks: dict[int, int], deadline: float, timeout: float) -> float:
    """Until no process of `blocks` is in a critical section; the seconds waited.
    CriticalSection (naming the process and section) once `deadline` (monotonic) passes."""
    started = time.monotonic()
    while True:
        found = busy(blocks)
        if found is None:
            return time.monotonic() - started
        if time.monotonic() > deadline:
            pid, st = found
            raise CriticalSection(pid, st.section or "critical section", timeout)
        time.sleep(0.001)


def mark(pid: int, addr: int, state: int, image: str) -> None:
    """The program learns that a dump (CONTINUED) or a restore (RESTORED) happened, or that
    the checkpoint it asked for failed (FAILED)."""
    gen = read(pid, addr).generation
    room = LAYOUT.size - OFF_LAST_IMAGE
    path = os.fsencode(image)[:room - 1]
    with AddressSpace(pid) as mem:
        mem.write(addr + OFF_LAST_IMAGE, path + bytes(room - len(path)))
        mem.write(addr + OFF_STATE, struct.pack("<i", state))
        mem.write(addr + OFF_REQUEST, struct.pack("<i", 0))
        mem.write(addr + OFF_GENERATION, struct.pack("<Q", gen + 1))     # last: the program polls it


def hold_tid(pid: int, addr: int) -> int:
    return read(pid, addr).hold_tid


def requested(pid: int, addr: int) -> bool:
    """Has the program asked for a checkpoint (ptckpt.app.checkpoint)?"""
    return read(pid, addr).request != 0
