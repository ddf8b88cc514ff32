"""Points where a test may have ptckpt die, to prove that nothing is harmed when it does.

``PTCKPT_TEST_DIE_AT=POINT:N[:SIGNAL]`` makes the N-th arrival at POINT (counted in this
process) send ptckpt SIGNAL (default SIGKILL: as an OOM killer or a user's kill -9 would,
with no chance to undo anything; SIGINT or SIGTERM: as a user would, to be unwound).
Points: ``inject-set`` (an injected syscall's registers are in, the thread not yet
stepped), ``inject-entry`` and ``inject-exit`` (the thread stopped at its entry or exit);
``restore-stub`` (a stub seized), ``restore-fixup`` (a process rebuilt, before the next),
``restore-resume`` (the tree rebuilt, not yet let go), ``restore-pidns`` (--pidns: the init made
the stub, not yet seized), ``restore-fill-beside`` (ptckpt's thread filling pages beside the
tracee's reads, after a chunk); ``lazy-copy`` (the lazy page server, before a background copy);
``page-server-file`` and ``page-server-write`` (``ptckpt page-server``, before it receives a
file pushed, or a piece of page data a dump streams).
Unset (the normal case), reached() costs a comparison.

``PTCKPT_TEST_LAZY_PACE=SECONDS`` makes the lazy page server wait that long (answering
faults meanwhile) before each background copy, so that a test can act while pages are
still missing.
"""

from __future__ import annotations

import os
import signal

_POINT, _, _REST = os.environ.get("PTCKPT_TEST_DIE_AT", "").partition(":")
_COUNT, _, _SIGNAL = _REST.partition(":")
_left = int(_COUNT) if _POINT and _COUNT.isdigit() else 0
_signo = getattr(signal, _SIGNAL, signal.SIGKILL) if _SIGNAL.startswith("SIG") else signal.SIGKILL


def reached(point: str) -> None:
    global _left
    if _left and point == _POINT:
        _left -= 1
        if _left == 0:
            os.kill(os.getpid(), _signo)


def lazy_pace() -> float:
    try:
        return float(os.environ.get("PTCKPT_TEST_LAZY_PACE", "0"))
    except ValueError:
        return 0.0
