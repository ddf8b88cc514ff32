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
