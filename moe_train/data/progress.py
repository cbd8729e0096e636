"""Progress of ``prepare`` on stderr: a live ``\\r`` line on a terminal, plain lines elsewhere.

On a terminal the line is redrawn at most twice a second; otherwise (a log file, a pipe, a
Slurm job) one line is printed every :data:`PLAIN_EVERY_S` seconds. Each line shows the phase,
documents, tokens, tokens per second and, when the total input size is known, the percentage
of input bytes read and the time left at the current rate.
"""

from __future__ import annotations

import sys
import time

TTY_EVERY_S = 0.5
PLAIN_EVERY_S = 10.0


def human(n: float) -> str:
    """``1234567`` -> ``1.23M``."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """``3725`` -> ``1h02m``; ``75`` -> ``1m15s``; ``4.2`` -> ``4s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def line(phase: str, docs: int, tokens: int, elapsed: float, done_bytes: int, total_bytes: int) -> str:
    """One line, e.g. ``tokenize: 1,200 docs, 3.40M tokens, 1.10M tok/s, 42% of 9.30MB, ETA 9s``."""
    parts = [f"{phase}: {docs:,} docs"]
    if tokens:
        parts.append(f"{human(tokens)} tokens, {human(tokens / max(elapsed, 1e-9))} tok/s")
    if total_bytes > 0:
        frac = min(done_bytes / total_bytes, 1.0)
        parts.append(f"{frac:.0%} of {human(total_bytes)}B")
        if 0 < frac < 1:
            parts.append(f"ETA {duration(elapsed * (1 - frac) / frac)}")
    return ", ".join(parts)


class Progress:
    """Call ``update`` often; it prints only when a line is due."""

    def __init__(self, phase: str, total_bytes: int = 0, stream=None):
        self.phase, self.total_bytes = phase, total_bytes
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.monotonic()
        self._last = self.start
        self._drawn = False

    def update(self, docs: int, tokens: int, done_bytes: int) -> None:
        now = time.monotonic()
        if now - self._last < (TTY_EVERY_S if self.tty else PLAIN_EVERY_S):
            return
        self._last = now
        text = line(self.phase, docs, tokens, now - self.start, done_bytes, self.total_bytes)
        if self.tty:
            self.stream.write(f"\r{text}\x1b[K")
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the live line (so that what follows starts on a fresh line)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start
