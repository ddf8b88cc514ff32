"""signalfd fds: the mask, and the object again.

Dump half (:func:`dump`, through resources.anonfds.dump_anon_fd), from its fdinfo and a
copy of the fd (pidfd_getfd), which shares the target's open file description:

signalfd: ``sigmask`` (hex).

Restore half (:func:`make`, through resources.anonfds.create_anon_fd), with the
status flags (O_NONBLOCK ...) of the recorded description:

signalfd with its mask;
"""

from __future__ import annotations

import ctypes
import struct

from .. import procfs
from ..formats.model import FdKind, SignalfdState
from .fdstate import O_CLOEXEC, O_NONBLOCK, FdKindOps, Target, check, closing_on_error, field, proto, set_status_flags

SFD_NONBLOCK = O_NONBLOCK
SFD_CLOEXEC = O_CLOEXEC

_signalfd = proto("signalfd", ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int)


# --- dump half -----------------------------------------------------------------

def dump(t: Target, info: procfs.FdInfo) -> SignalfdState:
    return SignalfdState(mask=int(field(t, info, "sigmask"), 16),
                         flags=info.flags & SFD_NONBLOCK)


# --- restore half --------------------------------------------------------------

def make(state: SignalfdState, flags: int) -> int:
    sigset = struct.pack("Q", state.mask) + bytes(120)      # glibc's sigset_t is 128 bytes
    fd = check(_signalfd(-1, sigset, SFD_CLOEXEC | SFD_NONBLOCK), "signalfd")
    with closing_on_error(fd):
        set_status_flags(fd, flags)
    return fd


def describe(state: SignalfdState) -> str:
    return f"signalfd (mask {state.mask:#x})"


KIND = FdKindOps(FdKind.SIGNALFD, SignalfdState, dump, make, describe)
