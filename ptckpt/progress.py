"""Progress of a dump or restore, for whoever shows it.

The library names the phase it is in (:func:`phase`: a dump's ``freeze``, ``copy`` and
``write``, a restore's ``read`` and ``rebuild``), says how many bytes of memory the phase
is about to move (:func:`expect`, once per process or batch of ranges, so the total grows
as a tree is walked) and how many it moved (:func:`moved`), from any thread.  A phase
starts its count at zero.  Nobody listens unless a sink is installed with
:func:`showing`: the CLI installs a :class:`Bar`, a rich progress bar on stderr (phase,
percent, bytes and rate in binary units, time left) that shows once the work is expected
to take more than half a second, and goes when it ends.

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
AFTER = 0.5                 # seconds: work expected to take longer than this gets a bar
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def phase(name: str) -> None:
    """The work enters phase `name`; its bytes are counted from zero."""
    sink = _sink
    if sink is not None:
        sink.phase(name)


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
    """`sink` (phase(name), expect(n), moved(n), close()) hears the progress while the block runs."""
    global _sink
    before, _sink = _sink, sink
    try:
        yield
    finally:
        _sink = before
        sink.close()


def binary_unit(n: float) -> tuple[int, str]:
    """(divisor, name) of the binary unit `n` bytes read best in: (2**30, 'GiB') for 1.5 GiB."""
    for i, name in enumerate(_UNITS):
        if n < 1024 ** (i + 1) or i == len(_UNITS) - 1:
            return 1024 ** i, name
    raise AssertionError("unreachable")       # pragma: no cover


def amounts(done: int, total: int | None) -> str:
    """'0.3/1.0 GiB': both in the unit of the total."""
    unit, name = binary_unit(max(total or 0, done))
    digits = 0 if unit == 1 else 1
    return f"{done / unit:.{digits}f}/{total / unit:.{digits}f} {name}" if total else ""


def rate(per_second: float | None) -> str:
    """'279.5 MiB/s'; '' before there is one."""
    if not per_second:
        return ""
    unit, name = binary_unit(per_second)
    return f"{per_second / unit:.1f} {name}/s"


class Bar:
    """A transient rich progress bar on stderr: "dump copy ━━━━━━━  42% 0.4/1.0 GiB 280.1 MiB/s
    0:00:02".  It shows once the work has taken `after` seconds ($PTCKPT_PROGRESS_AFTER,
    0.5 s by default), or earlier when the rate so far says the work will take longer."""

    def __init__(self, what: str, after: float | None = None):
        self.what = what
        self.after = float(os.environ.get("PTCKPT_PROGRESS_AFTER", AFTER)) if after is None else after
        self.started = time.monotonic()
        self.name = ""
        self.phase_started = self.started
        self.total = self.done = 0
        self._bar = None
        self._task = None
        self._closed = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(self.after, self._on_time)
        self._timer.daemon = True
        self._timer.start()

    def phase(self, name: str) -> None:
        with self._lock:
            self.name = name
            self.phase_started = time.monotonic()
            self.total = self.done = 0
            if self._bar is not None:
                self._bar.reset(self._task, total=None, description=self._description())
            self._show()

    def expect(self, nbytes: int) -> None:
        with self._lock:
            self.total += nbytes
            self._show()

    def moved(self, nbytes: int) -> None:
        with self._lock:
            self.done += nbytes
            self._show()

    def _on_time(self) -> None:
        with self._lock:
            self._show(due=True)

    def _description(self) -> str:
        return f"{self.what} {self.name}".rstrip()

    def _expected_long(self) -> bool:
        """By the rate so far, the phase ends more than `after` seconds after the start."""
        now = time.monotonic()
        spent = now - self.phase_started
        if not self.done or not self.total or spent < min(0.1, self.after / 5):
            return False
        left = spent * (self.total - self.done) / self.done
        return now + left - self.started >= self.after

    def _show(self, due: bool = False) -> None:
        if self._closed:
            return
        if self._bar is None:
            if not (due or time.monotonic() - self.started >= self.after or self._expected_long()):
                return
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 _Column(lambda t: f"{t.percentage:3.0f}%" if t.total else ""),
                                 _Column(lambda t: amounts(int(t.completed), t.total)),
                                 _Column(lambda t: rate(t.finished_speed or t.speed) if t.total else ""),
                                 TimeRemainingColumn(),
                                 console=Console(stderr=True), transient=True)
            self._task = self._bar.add_task(self._description(), total=None)
            self._bar.start()
        self._bar.update(self._task, total=max(self.total, self.done) or None, completed=self.done,
                         description=self._description())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._timer.cancel()
            if self._bar is not None:
                self._bar.stop()
                self._bar = None


def _Column(text):                                  # noqa: N802 - a column class, made on first use
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Column(ProgressColumn):
        def render(self, task) -> Text:
            return Text(text(task))
    return Column()
