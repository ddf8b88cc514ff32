"""Points where a test may have ptckpt die, to prove that nothing is harmed when it does.

``PTCKPT_TEST_DIE_AT=POINT:N`` makes the N-th arrival at POINT (counted in this process)
kill ptckpt with SIGKILL, as an OOM killer or a user's kill -9 would, with no chance to
undo anything.  Points: ``inject-set`` (an injected syscall's registers are in, the thread
not yet stepped), ``inject-entry`` and ``inject-exit`` (the thread stopped at its entry or
exit).  Unset (the normal case), reached() costs a comparison.
"""

from __future__ import annotations

import os
import signal

_POINT, _, _COUNT = os.environ.get("PTCKPT_TEST_DIE_AT", "").partition(":")
_left = int(_COUNT) if _POINT and _COUNT.isdigit() else 0


def reached(point: str) -> None:
    global _left
    if _left and point == _POINT:
        _left -= 1
        if _left == 0:
            os.kill(os.getpid(), signal.SIGKILL)
