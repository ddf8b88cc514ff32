"""The ``ptckpt`` command's entry point: the signal handlers first, then the CLI.

The handlers (ptckpt.state) go in before anything heavy is imported, so that SIGINT,
SIGTERM or SIGHUP at any moment of a command unwind it like an error (a dump undoes what
it did: the target resumed, the network lock removed, no image left) and end it with one
line.
"""

from __future__ import annotations

from .state import Interrupted, install, report_late_signal


def main() -> None:
    install()
    try:
        from .cli import main as cli_main
    except Interrupted as stop:
        import sys
        sys.stderr.write(f"ptckpt: interrupted by {stop.name}\n")
        sys.exit(128 + stop.signo)
    try:
        cli_main()
    finally:
        report_late_signal()
