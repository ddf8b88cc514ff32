"""Progress of the memory a dump or restore moves, for whoever shows it.

The library says how many bytes it is about to move (:func:`expect`, once per process or
batch of ranges, so the total grows as a tree is walked) and how many it moved
(:func:`moved`), from any thread.  Nobody listens unless a sink is installed with
:func:`showing`: the CLI installs a :class:`Bar`, a rich progress bar on stderr (bytes,
rate, time left) that shows only once the work has taken a second, and goes when it ends.

Example::

    with progress.showing(progress.Bar("dump")):
        dump(...)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

_sink = None
MIN_BYTES = 16 << 20        # a bar for this much memory at least (a small process slowed by load: none)


def expect(nbytes: int) -> None:
    """`nbytes` more will be moved."""
    sink = _sink
    if sink is not None and nbytes:
        sink.expect(nbytes)


def moved(nbytes: int) -> None:
    """`nbytes` were moved."""
    sink = _sink
    if sink is not None and nbytes:
        sink.moved(nbytes)


def finish() -> None:
    """The moving is over: the sink goes now (a restored tree may be about to draw on the
    terminal the bar is on)."""
    sink = _sink
    if sink is not None:
        sink.close()


@contextlib.contextmanager
def showing(sink) -> Iterator[None]:
    """`sink` (expect(n), moved(n), close()) hears the progress while the block runs."""
    global _sink
    before, _sink = _sink, sink
    try:
        yield
    finally:
        _sink = before
        sink.close()


class Bar:
    """A transient rich progress bar on stderr, shown once `after` seconds have gone
    ($PTCKPT_PROGRESS_AFTER, 1 s by default) with MIN_BYTES or more to move."""

    def __init__(self, what: str, after: float | None = None):
        self.what = what
        self.after = float(os.environ.get("PTCKPT_PROGRESS_AFTER", "1")) if after is None else after
        self.started = time.monotonic()
        self.total = self.done = 0
        self._bar = None
        self._task = None
        self._lock = threading.Lock()

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes
            self._show()

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self._show()

    def _show(self) -> None:
        if self._bar is None:
            if time.monotonic() - self.started < self.after or self.total < MIN_BYTES:
                return
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                 TransferSpeedColumn(), TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task(self.what, total=max(self.total, self.done))
            self._bar.start()
        self._bar.update(self._task, total=max(self.total, self.done), completed=self.done)

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
