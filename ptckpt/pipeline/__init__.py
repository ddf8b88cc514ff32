"""The pipelines: a restore (and a dump) as named stages over one shared state.

Each stage is a function of the run's state, logged by name, that registers the undoing of
what it made on the run's undo stack (:class:`Undo`): a failure or a signal anywhere
unwinds every stage done so far, last first, and a run that reaches its commit point drops
the stack.  What is closed whatever happens (fds, page files) goes on the run's cleanup
stack instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger("ptckpt.pipeline")


class Undo(contextlib.ExitStack):
    """An ExitStack whose callbacks run only when the block fails: commit() drops them."""

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.pop_all()
            return False
        return super().__exit__(exc_type, exc, tb)

    def commit(self) -> None:
        """From here on nothing is undone: the callbacks are dropped."""
        self.pop_all()

    def on_failure(self, fn: Callable, *args) -> None:
        """`fn(*args)` if the run fails after this point; its own errors do not hide the first."""
        def quietly() -> None:
            try:
                fn(*args)
            except Exception as err:                 # the original failure is the one to report
                log.warning("undoing %s: %s", getattr(fn, "__name__", fn), err)
        self.callback(quietly)


def stage(name: str, fn: Callable, run) -> None:
    """Run one stage of a pipeline, logged by its name."""
    log.debug("stage %s", name)
    fn(run)
