"""Progress bar with ETA on stderr, updated as batches of scenarios start and finish.

On a terminal one line is redrawn in place; otherwise (with --progress) lines are written at
most every few seconds, plus the last one. `close` prints a summary. The first batch of each
program shape (and the first cluster scenario of each group) includes its compilation, so
early ETAs are pessimistic.
"""

from __future__ import annotations

import math
import time
from typing import TextIO

BAR_WIDTH = 24
LINE_INTERVAL_S = 5.0  # between progress lines when stderr is not a terminal


class SweepProgress:
    def __init__(self, stream: TextIO | None, total: int, *, tty: bool = False, prefix: str = "blis-jax sweep"):
        self.stream, self.total, self.tty, self.prefix = stream, total, tty, prefix
        self.done = 0
        self.batches = 0
        self.devices = 1
        self.note = ""
        self.start = time.monotonic()
        self.last_line = -math.inf
        self.printed = False

    def batch(self, index: int, planned: int, lanes: int, devices: int = 1) -> None:
        """A batch of `lanes` scenarios starts (number `index` of `planned` so far)."""
        self.batches, self.devices = index, devices
        where = f" on {devices} devices" if devices > 1 else ""
        self.note = f"batch {index}/{planned} ({lanes} scenarios{where})"
        self._write(last=False)

    def cluster(self, index: int, planned: int, what: str) -> None:
        """Cluster scenario `index` of `planned` starts (they run one at a time, after the
        batches of single-instance scenarios); counted as one batch."""
        self.batches += 1
        self.note = f"cluster {index}/{planned} ({what})"
        self._write(last=False)

    def finished(self, count: float) -> None:
        """`count` more scenarios are done (a fraction for some instances of a cluster)."""
        self.done += count
        self._write(last=self._done >= self.total)

    @property
    def _done(self) -> int:
        """Whole scenarios done (fractions are summed in floating point)."""
        return int(self.done + 1e-6)

    def _write(self, last: bool) -> None:
        now = time.monotonic()
        if self.stream is None or (not self.tty and not last and now - self.last_line < LINE_INTERVAL_S):
            return
        self.last_line = now
        elapsed = now - self.start
        frac = self.done / self.total if self.total else 1.0
        filled = round(frac * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        eta = f"ETA {_duration(elapsed / self.done * (self.total - self.done))}" if self.done else "ETA ?"
        line = (f"{self.prefix}: [{bar}] {self._done}/{self.total} scenarios, elapsed {_duration(elapsed)}, "
                f"{eta}" + (f"; {self.note}" if self.note and not last else ""))
        self.stream.write(f"\r{line}\x1b[K" if self.tty else line + "\n")
        self.stream.flush()
        self.printed = True

    def close(self) -> None:
        """A summary line: scenarios, wall time, rate, batches and devices."""
        if self.stream is None:
            return
        if self.tty and self.printed:
            self.stream.write("\n")
        elapsed = time.monotonic() - self.start
        rate = f" ({self._done / elapsed:.2f} scenarios/s)" if elapsed > 0 else ""
        where = f" on {self.devices} devices" if self.devices > 1 else ""
        self.stream.write(f"{self.prefix}: {self._done}/{self.total} scenarios in {_duration(elapsed)}{rate}, "
                          f"{self.batches} batch{'es' if self.batches != 1 else ''}{where}\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m"
