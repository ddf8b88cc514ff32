"""The ``ptckpt`` command's entry point: the signal handlers first, then the CLI.

The handlers (ptckpt.state) go in before anything heavy is imported, so that SIGINT,
SIGTERM or SIGHUP at any moment of a command unwind it like an error (a dump undoes what
it did: the target resumed, the network lock removed, no image left) and end it with one
line.

When the command is over, everything left is frozen out of the garbage collector
(gc.freeze): the interpreter's exit then frees what module teardown releases and skips
the full collections over every object the command made, ~15 ms of a small command.
Objects caught in reference cycles are then not finalized at exit: what ptckpt writes is
closed (or committed) before its command returns.

The methods of the dataclasses it defines come compiled from ptckpt.codecache.
"""

from __future__ import annotations

from .state import Interrupted, install, report_late_signal


def main() -> None:
    install()
    try:
        from . import codecache
        codecache.install()                  # dataclasses' methods compiled once (its doc)
        from .cli import main as cli_main
    except Interrupted as stop:
        import sys
        sys.stderr.write(f"ptckpt: interrupted by {stop.name}\n")
        sys.exit(128 + stop.signo)
    try:
        cli_main()
    finally:
        report_late_signal()
        codecache.save()
        import gc
        gc.freeze()
