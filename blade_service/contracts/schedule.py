"""How many optimiser steps a baseline run takes: OpenUnlearning's schedule as pure arithmetic.

Torch-free, so the API states a baseline request's total before it runs (the forget set's row count is in its
dataset record) and the engine (`blade_core/methods/_loop.py`) runs exactly that many steps.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from blade_service.contracts.methods.baselines import BaselineConfig


@dataclass(frozen=True)
class Schedule:
    """How many optimiser steps a run takes and how many of them warm up, for a forget set of `n_forget`
    rows."""

    total_steps: int
    warmup_steps: int
    effective_batch: int  # forget rows per optimiser step (the last step of an epoch takes what is left)
    micro_batch: int  # rows per forward/backward pass
    n_forget: int
    source: str  # 'epochs' (the published default), 'schedule_steps' (a published fixed count) or 'max_steps'

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.n_forget / self.effective_batch)

    def micro_batch_sizes(self, step: int) -> list[int]:
        """Rows of each micro-batch of optimiser step `step` (0-based): full batches through the epoch, then
        the rows left, as a DataLoader over the forget set with gradient accumulation would deliver them."""
        done = (step % self.steps_per_epoch) * self.effective_batch
        rows = min(self.effective_batch, self.n_forget - done)
        return [min(self.micro_batch, rows - i) for i in range(0, rows, self.micro_batch)]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def schedule(config: BaselineConfig, n_forget: int) -> Schedule:
    """total = epochs * ceil(N / B) (or the method's fixed `schedule_steps`, or an explicit `max_steps`);
    warm-up = int(warmup_epochs * N // B) as OpenUnlearning computes it, shrunk in proportion under a cap."""
    batch = config.batch_size * config.grad_accum
    steps_per_epoch = math.ceil(n_forget / batch)
    if config.schedule_steps is not None:
        published, source = config.schedule_steps, "schedule_steps"
    else:
        published, source = max(1, math.ceil(config.epochs * steps_per_epoch)), "epochs"
    warmup = int(config.warmup_epochs * n_forget // batch)
    total = published
    if config.max_steps is not None:
        total, source = config.max_steps, "max_steps"
        warmup = warmup * total // published
    return Schedule(
        total_steps=total,
        warmup_steps=min(warmup, total - 1),
        effective_batch=batch,
        micro_batch=config.batch_size,
        n_forget=n_forget,
        source=source,
    )
