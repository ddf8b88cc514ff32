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


class _Transient:
    """A transient rich progress line on stderr ("WHAT PHASE ━━━━━━━ ..."), started by a
    subclass's _show once the work has taken `after` seconds ($PTCKPT_PROGRESS_AFTER, 0.5 s
    by default) or is expected to, and gone when closed."""

    def __init__(self, what: str, after: float | None = None):
        self.what = what
        self.after = float(os.environ.get("PTCKPT_PROGRESS_AFTER", AFTER)) if after is None else after
        self.started = time.monotonic()
        self.name = ""
        self._bar = None
        self._task = None
        self._closed = False
        self._lock = threading.Lock()
        self._timer = threading.Timer(self.after, self._on_time)
        self._timer.daemon = True
        self._timer.start()

    def _show(self, due: bool = False) -> None:
        raise NotImplementedError

    def _on_time(self) -> None:
        with self._lock:
            self._show(due=True)

    def _description(self) -> str:
        return f"{self.what} {self.name}".rstrip()

    def _late(self) -> bool:
        return time.monotonic() - self.started >= self.after

    def _start(self, *columns) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), *columns,
                             console=Console(stderr=True), transient=True)
        self._task = self._bar.add_task(self._description(), total=None)
        self._bar.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._timer.cancel()
            if self._bar is not None:
                self._bar.stop()
                self._bar = None


class Bar(_Transient):
    """A transient rich progress bar on stderr: "dump copy ━━━━━━━  42% 0.4/1.0 GiB 280.1 MiB/s
    0:00:02".  It shows once the work has taken `after` seconds ($PTCKPT_PROGRESS_AFTER,
    0.5 s by default), or earlier when the rate so far says the work will take longer."""

    def __init__(self, what: str, after: float | None = None):
        super().__init__(what, after)
        self.phase_started = self.started
        self.total = self.done = 0

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
            if not (due or self._late() or self._expected_long()):
                return
            from rich.progress import TimeRemainingColumn
            self._start(_Column(lambda t: f"{t.percentage:3.0f}%" if t.total else ""),
                        _Column(lambda t: amounts(int(t.completed), t.total)),
                        _Column(lambda t: rate(t.finished_speed or t.speed) if t.total else ""),
                        TimeRemainingColumn())
        self._bar.update(self._task, total=max(self.total, self.done) or None, completed=self.done,
                         description=self._description())


def clock(seconds: float | None) -> str:
    """'0:01:05' for 65 s (as the dump's bar shows time left); '-:--:--' before there is one."""
    if seconds is None:
        return "-:--:--"
    s = max(0, round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RunsBar(_Transient):
    """A campaign's transient bar on stderr: "campaign runs ━━━━━  30% 3/10 runs 2 masked,
    1 crashed 0:00:12" (the phase, the part done, the runs ended, their outcomes so far in
    the order of `outcomes`, the time left).  Call it as the campaign's
    ``progress(done, total, counts, eta)``; :meth:`phase` names what it waits for before
    (a campaign's ``reference`` run).  It shows once the campaign has taken `after` seconds."""

    def __init__(self, what: str, total: int, outcomes: tuple[str, ...], phase: str = "",
                 after: float | None = None):
        super().__init__(what, after)
        self.name = phase
        self.total, self.done = total, 0
        self.outcomes = outcomes
        self.counts: dict[str, int] = {}
        self.eta: float | None = None
        self.bytes: tuple[int, int] | None = None     # (moved, expected) while a template is built

    def building(self, name: str = "template") -> "_Building":
        """A progress sink (for :func:`showing`) for the restore of the campaign's template:
        while it moves memory the bar is in phase `name` and counts bytes, then it goes back
        to the phase it was in."""
        return _Building(self, name)

    def phase(self, name: str) -> None:
        with self._lock:
            self.name = name
            self._show()

    def __call__(self, done: int, total: int, counts, eta: float | None, phase: str = "runs") -> None:
        with self._lock:
            self.name = phase
            self.done, self.total, self.counts, self.eta = done, total, dict(counts), eta
            self._show()

    def tally(self) -> str:
        """'2 masked, 1 crashed': the outcomes seen so far, in their order."""
        return ", ".join(f"{self.counts[o]} {o}" for o in self.outcomes if self.counts.get(o))

    def _show(self, due: bool = False) -> None:
        if self._closed:
            return
        if self._bar is None:
            if not (due or self._late()):
                return
            self._start(_Column(lambda t: f"{100 * t.completed / max(t.total or 1, 1):3.0f}%"),
                        _Column(lambda t: self._amount()),
                        _Column(lambda t: self.tally()),
                        _Column(lambda t: clock(self.eta if self.done else None)))
        # drawn at once: a campaign's runs end seldom, and each count is worth seeing
        done, total = self.bytes if self.bytes is not None else (self.done, self.total)
        self._bar.update(self._task, total=max(total, 1), completed=done, description=self._description(),
                         refresh=True)

    def _amount(self) -> str:
        return amounts(*self.bytes) if self.bytes is not None else f"{self.done}/{self.total} runs"


class _Building:
    """RunsBar.building's sink: the template's restore shown in the campaign's bar."""

    def __init__(self, bar: RunsBar, name: str):
        self.bar, self.name, self.before = bar, name, None

    def phase(self, _name: str) -> None:
        with self.bar._lock:
            if self.bar.bytes is None:
                self.before, self.bar.name, self.bar.bytes = self.bar.name, self.name, (0, 0)
            self.bar._show()

    def expect(self, nbytes: int) -> None:
        self._add(0, nbytes)

    def moved(self, nbytes: int) -> None:
        self._add(nbytes, 0)

    def _add(self, moved: int, expected: int) -> None:
        with self.bar._lock:
            if self.bar.bytes is None:
                self.before, self.bar.name, self.bar.bytes = self.bar.name, self.name, (0, 0)
            done, total = self.bar.bytes
            self.bar.bytes = (done + moved, total + expected)
            self.bar._show()

    def close(self) -> None:
        """The template is built (or the restore gave up): back to the campaign's phase."""
        with self.bar._lock:
            if self.bar.bytes is not None:
                self.bar.name, self.bar.bytes = self.before, None
                self.bar._show()


def _Column(text):                                  # noqa: N802 - a column class, made on first use
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Column(ProgressColumn):
        def render(self, task) -> Text:
            return Text(text(task))
    return Column()
