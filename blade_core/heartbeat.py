"""A progress line every few minutes where no progress bar is drawn (`blade bench --no-progress`, a log file).

A BLADE run of the default bench trains for 15-25 minutes on one core and the base model pretrains for longer;
without a bar their log said nothing until they ended. `Heartbeat` logs at most one line per `every_s`:

    blade forget05 seed 42: step 120 of 250 after 7.5 min, 8.1 min more at this pace

For a method with a convergence stop the total is its cap, so the time left is an upper bound.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

EVERY_S = 300.0  # at most one line per run every five minutes: a 25-minute run logs four


def duration(seconds: float) -> str:
    """'45 s', '7.5 min' or '2.1 h' (also the CLI's, `blade_service/cli/display.py`)."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def progress_line(label: str, step: int, total: int | None, elapsed_s: float) -> str:
    """'label: step i of N after T, R more at this pace' (no total: 'label: step i after T')."""
    if not total:
        return f"{label}: step {step} after {duration(elapsed_s)}"
    line = f"{label}: step {step} of {total} after {duration(elapsed_s)}"
    if total > step:
        line += f", {duration(elapsed_s / step * (total - step))} more at this pace"
    return line


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
        self.log(progress_line(self.label, step, self.total, now - self.started))
