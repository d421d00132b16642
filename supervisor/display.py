"""Output for a person: aligned tables, ages as "12s ago", sizes, a progress bar on a terminal,
and ``printable``, which every line shown to a person goes through."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Sequence
from typing import TextIO

# What a terminal acts on instead of showing: C0 controls but newline and tab (ESC starts colour,
# cursor moves, window titles, OSC 52 clipboard writes), DEL, C1 controls (U+009B is a one-byte
# CSI), and the bidirectional overrides that reorder what a line seems to say.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` as a terminal shows it harmlessly: every character a terminal would act on
    (``_UNPRINTABLE``: ESC sequences in a heartbeat's host, a state's reason, a manifest field)
    written as its escape (``\\x1b``), and a lone surrogate (JSON's ``"\\ud800"``, which a
    terminal's encoding refuses) as ``\\ud800``; newlines and tabs kept."""
    out = _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1], text)
    return out.encode("utf-8", "backslashreplace").decode("utf-8") if not out.isascii() else out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f}s ago"
    if s < 90 * 60:
        return f"{s / 60:.0f}m ago"
    if s < 36 * 3600:
        return f"{s / 3600:.1f}h ago"
    return f"{s / 86400:.1f}d ago"


def human_duration(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.1f}s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; numbers right-aligned."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_num(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric, strict=True)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _is_num(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


class ProgressBar:
    """A one-line bar on a terminal, redrawn at most 10 times a second; silent elsewhere."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.done = 0
        self.enabled = self.stream.isatty()
        self._last = 0.0

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(self.done / self.total, 1.0)
            filled = int(frac * self.width)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {frac * 100:5.1f}% {human_bytes(self.done)}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
