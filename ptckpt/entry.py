"""The ``ptckpt`` command's entry point: the signal handlers first, then the CLI.

The handlers go in before anything heavy is imported, so that SIGINT, SIGTERM or SIGHUP
at any moment of a command unwind it like an error (a dump undoes what it did: the
target resumed, the network lock removed, no image left) and end it with one line.
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


def _on_signal(signo, _frame) -> None:
    # once: a second signal must not interrupt the undoing of the first
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signo)


def install() -> None:
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def main() -> None:
    install()
    try:
        from .cli import main as cli_main
    except Interrupted as stop:
        import sys
        sys.stderr.write(f"ptckpt: interrupted by {stop.name}\n")
        sys.exit(128 + stop.signo)
    cli_main()
