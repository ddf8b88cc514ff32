"""Units on the command line: durations ("30s", "2m", "500ms")."""

from __future__ import annotations

import re

from .errors import UsageError


def parse_duration(text: str) -> float:
    """'30s', '2m', '500ms', '1h' or plain seconds -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*", str(text))
    if m is None:
        raise UsageError(f"bad duration {text!r} (e.g. 30s, 2m, 500ms)")
    return float(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m[2]]


def size(n: float) -> str:
    """Bytes as people read them: '512 B', '112.0 KiB', '1.0 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"          # pragma: no cover


def count(n: int, thing: str, plural: str | None = None) -> str:
    """'1 thread', '2 threads'."""
    return f"{n} {thing if n == 1 else plural or thing + 's'}"
