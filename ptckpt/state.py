"""A command's commit and signal state: what SIGINT, SIGTERM and SIGHUP do at each moment.

Until the command's result exists, a signal unwinds it like an error (Interrupted, raised
where the command was: a dump undoes what it did); once the result exists (committed()),
a signal is noted and reported after the command says what it did; while a restored
process runs and ptckpt waits for it, signals go to that process (forward_to()).

This module imports nothing of ptckpt, so that the library (dump, restore) marks its
commit here without importing the command's entry point or the CLI.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: raised where the command was, to unwind it."""

    def __init__(self, signo: int):
        super().__init__(signo)
        self.signo = signo

    @property
    def name(self) -> str:
        return signal.Signals(self.signo).name


_finishing: list[int] = []     # past the point of no return: the signals that came since
_past_commit = False


_held: list[int] = []        # signals that came inside a step that must not be cut in two
_holding = 0


def _on_signal(signo, _frame) -> None:
    # once: a second signal must not interrupt the undoing of the first
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if _past_commit:
        _finishing.append(signo)
        return
    if _holding:
        _held.append(signo)
        return
    raise Interrupted(signo)


def hold() -> None:
    """A step begins that a signal must not cut in two (a thread of the tracee runs an
    injected syscall between its start and its stop: unwound in the middle, the tracee
    would still be running it when the undoing sets its registers).  A signal that comes
    before let_go() unwinds the command there."""
    global _holding
    _holding += 1


def let_go(*, failed: bool = False) -> None:
    """The step begun by hold() is over: a signal that came meanwhile unwinds now, unless
    the step `failed` (its own error unwinds the command then, and the signal is dropped)."""
    global _holding
    _holding -= 1
    if _holding or not _held:
        return
    if failed:
        _held.clear()
        return
    raise Interrupted(_held.pop(0))


def committed() -> None:
    """The command's result exists (an image renamed into place): from here on a signal no
    longer unwinds it, so that it ends saying what it did (an image is complete if and
    only if the command said so); the signal is reported once it is done."""
    global _past_commit
    _past_commit = True


def not_committed() -> None:
    """The result could not be made after all (committed() came just before the attempt):
    the command fails with that error, and a signal that came meanwhile changes nothing."""
    global _past_commit
    _past_commit = False
    _finishing.clear()


def unwind_again() -> None:
    """The result was reported: signals unwind the command again (a restore waiting for its
    process), and one that came meanwhile does so now."""
    global _past_commit
    _past_commit = False
    if _finishing:
        raise Interrupted(_finishing.pop(0))
    install()


def forward_to(pid: int) -> None:
    """The restored process runs and ptckpt waits for it, as a shell waits for its job:
    SIGINT, SIGTERM and SIGHUP (and one that came since the result was said) go to it, and
    ptckpt goes on waiting, to exit with its status."""
    import os
    global _past_commit
    _past_commit = False
    came, _finishing[:] = list(_finishing), []

    def forward(signo, _frame) -> None:
        try:
            os.kill(pid, signo)
        except ProcessLookupError:
            pass                                   # it ended already: the wait says how
    for sig in SIGNALS:
        signal.signal(sig, forward)
    for signo in came:
        forward(signo, None)


def report_late_signal() -> None:
    if _finishing:
        import sys
        sys.stderr.write(f"ptckpt: {signal.Signals(_finishing[0]).name} came after the result was "
                         "complete: the command finished first\n")


def install() -> None:
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
