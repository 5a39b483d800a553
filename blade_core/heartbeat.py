"""A progress line every few minutes where no progress bar is drawn (`blade bench --no-progress`, a log file).

A BLADE run of the default bench trains for 15-25 minutes on one core and the base model pretrains for longer;
without a bar their log said nothing until they ended. `Heartbeat` logs at most one line per `every_s`:

    blade forget05 seed 42: step 120 of 250 after 7m30s, 8m08s more at this pace

For a method with a convergence stop the total is its cap, so the time left is an upper bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

EVERY_S = 300.0  # at most one line per run every five minutes: a 25-minute run logs four


def duration(seconds: float) -> str:
    """'45s', '7m30s' or '2h05m'."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class Heartbeat:
    """`beat(step)` after each step of at most `total` (None: unknown): logs `label`'s step, the time since
    it was made and, with a total, the time the remaining steps take at the pace so far."""

    log: Callable[[str], None]
    label: str
    total: int | None = None
    every_s: float | None = None  # None: EVERY_S, read when the heartbeat is made
    clock: Callable[[], float] = time.monotonic
    started: float = field(init=False)
    _every: float = field(init=False)
    _last: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self._last = self.clock()
        self._every = EVERY_S if self.every_s is None else self.every_s

    def beat(self, step: int, total: int | None = None) -> None:
        """`total`, when given, replaces the one given at construction (a baseline's comes with its steps)."""
        if total:
            self.total = total
        now = self.clock()
        if now - self._last < self._every or step <= 0:
            return
        self._last = now
        elapsed = now - self.started
        line = f"{self.label}: step {step}"
        if self.total:
            line += f" of {self.total} after {duration(elapsed)}"
            left = self.total - step
            if left > 0:
                line += f", {duration(elapsed / step * left)} more at this pace"
        else:
            line += f" after {duration(elapsed)}"
        self.log(line)
