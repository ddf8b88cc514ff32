"""Application control for the checkpointed program itself, without preload or linking ptckpt.

A program that wants to cooperate keeps a small *app block* in its memory, which
ptckpt reads and writes from outside (``ptckpt dump``, ``ptckpt restore``,
``ptckpt run``): in C the global ``ptckpt_app`` of ``ptckpt.h`` (found by its
ELF symbol; :func:`include_dir` says where the header is), in Python a page of a
memfd named ``ptckpt-app`` that this module maps (found in /proc/PID/maps).

    from ptckpt import app

    with app.critical("flush"):     # not frozen in here: a dump waits for the end
        ...
    if app.checkpoint() == app.RESTORED:   # under `ptckpt run`: checkpoint me now
        reconnect()                        # this is a restart of that checkpoint
    app.hold_resume()               # after a restore, only this thread runs ...
    app.ready()                     # ... until this (the others stay stopped)

The layout (little-endian, LAYOUT below) is the same in both languages:

    0   char[8]  magic "PTCKAPP1"
    8   int32    critical    depth of critical sections (the program)
    12  int32    request     1: checkpoint me (the program; ptckpt run clears it)
    16  int32    state       0, CONTINUED after a dump, RESTORED after a restore,
                             FAILED when a requested checkpoint could not be taken (ptckpt)
    20  int32    hold_tid    thread that runs alone after a restore until it clears this
    24  uint64   generation  +1 at every dump and restore (ptckpt)
    32  char[64]  section    name of the outermost critical section (the program)
    96  char[168] last_image directory of the last checkpoint (ptckpt)

This module is light: it imports nothing of ptckpt and may be copied into a program.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import time

MAGIC = b"PTCKAPP1"
LAYOUT = struct.Struct("<8siiiiQ64s168s")
OFF_CRITICAL, OFF_REQUEST, OFF_STATE, OFF_HOLD_TID, OFF_GENERATION, OFF_SECTION, OFF_LAST_IMAGE = \
    8, 12, 16, 20, 24, 32, 96
MEMFD_NAME = "ptckpt-app"
SYMBOL = "ptckpt_app"
CONTROL_ENV = "PTCKPT_CONTROL"         # set by `ptckpt run`: its control socket

CONTINUED = 1
RESTORED = 2
FAILED = 3                             # the checkpoint asked for could not be taken
NO_SUPERVISOR = -1

_lock = threading.RLock()
_block: mmap.mmap | None = None


def include_dir() -> str:
    """The directory of ptckpt.h (for cc -I)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def _mem() -> mmap.mmap:
    """The app block: a page of a memfd named ptckpt-app, mapped shared, made on first use."""
    global _block
    with _lock:
        if _block is None:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, mmap.PAGESIZE)
                block = mmap.mmap(fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)                 # the mapping keeps it
            block[0:8] = MAGIC
            _block = block
        return _block


def _get(offset: int, fmt: str = "<i") -> int:
    return struct.unpack_from(fmt, _mem(), offset)[0]


def _put(offset: int, value: int, fmt: str = "<i") -> None:
    struct.pack_into(fmt, _mem(), offset, value)


def _gettid() -> int:
    return threading.get_native_id()


@contextlib.contextmanager
def critical(name: str = "critical section"):
    """A critical section: ptckpt does not freeze the program inside (a dump waits for its
    end, up to its timeout, then names `name` in its error)."""
    enter(name)
    try:
        yield
    finally:
        leave()


def enter(name: str = "critical section") -> None:
    mem = _mem()
    with _lock:
        depth = _get(OFF_CRITICAL)
        if depth == 0:
            raw = name.encode()[:63]
            mem[OFF_SECTION:OFF_SECTION + 64] = raw + bytes(64 - len(raw))
        _put(OFF_CRITICAL, depth + 1)


def leave() -> None:
    with _lock:
        _put(OFF_CRITICAL, max(_get(OFF_CRITICAL) - 1, 0))


def in_critical() -> int:
    return _get(OFF_CRITICAL)


def checkpoint(timeout: float | None = None) -> int:
    """Ask `ptckpt run` for a checkpoint of this program now and wait for it: CONTINUED
    (the dump is done, this is the original process) or RESTORED (this is a restart of
    that checkpoint), FAILED if it could not be taken (`ptckpt run` says why).
    NO_SUPERVISOR without `ptckpt run`.  TimeoutError after `timeout`."""
    if not os.environ.get(CONTROL_ENV):
        return NO_SUPERVISOR
    _mem()
    before = _get(OFF_GENERATION, "<Q")
    _put(OFF_REQUEST, 1)
    deadline = None if timeout is None else time.monotonic() + timeout
    while _get(OFF_GENERATION, "<Q") == before:
        if deadline is not None and time.monotonic() > deadline:
            _put(OFF_REQUEST, 0)
            raise TimeoutError("no checkpoint was taken")
        time.sleep(0.001)
    return _get(OFF_STATE)


def state() -> int:
    """0 (nothing happened yet), CONTINUED after the last dump, RESTORED after a restore."""
    return _get(OFF_STATE)


def generation() -> int:
    return _get(OFF_GENERATION, "<Q")


def last_image() -> str:
    raw = bytes(_mem()[OFF_LAST_IMAGE:OFF_LAST_IMAGE + 168])
    return raw.split(b"\0", 1)[0].decode(errors="surrogateescape")


def hold_resume() -> None:
    """After a restore, this thread runs alone (the others stay stopped) until ready()."""
    _put(OFF_HOLD_TID, _gettid())


def ready() -> None:
    """This program is in a well-behaved state: the other threads may run."""
    _put(OFF_HOLD_TID, 0)
