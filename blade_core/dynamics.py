"""Training-dynamics rules of BLADE as small pure state objects: LR calibration and the convergence stop.

They see only scalars (step, L_fgt, r, epsilon), so tests drive them with scripted loss sequences, and their
whole state is a dataclass (`state_dict()` / `load_state_dict()` for checkpoints).

Thresholds follow the BLADE reference implementation. Note its constraint-violation test is `r > epsilon`
(r = L_ret - epsilon, so L_ret > 2*epsilon), not `r > 0`; we keep it (see `violated`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


def violated(r: float, epsilon: float) -> bool:
    """The reference's 'constraint clearly violated' test used by calibration and T_trans: r > epsilon."""
    return r > epsilon


class _State:
    def state_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            if f.name in state:
                setattr(self, f.name, state[f.name])


@dataclass
class LrCalibrator(_State):
    """One-shot rescaling of the outer LR at step t_cal = max(5, 0.1*T).

    observed pace = -ln(max(ema_t / L_fgt_1, 0.01)) / t;  target pace = ln 2 / (T/3)  (halve every T/3 steps);
    scale = clip(target / observed, 0.3, 3.0), or 0.5 if r > epsilon happened at any step so far;
    a scale within 8% of 1 is skipped.
    """

    total_steps: int
    min_scale: float = 0.3
    max_scale: float = 3.0
    violation_scale: float = 0.5
    skip_within: float = 0.08
    seen_violation: bool = False
    done: bool = False
    scale: float | None = None  # the factor applied (None: not yet calibrated or skipped)

    @property
    def at_step(self) -> int:
        return max(5, int(0.1 * self.total_steps))

    def update(self, step: int, lfgt_ema: float, lfgt_first: float, r: float, epsilon: float) -> float | None:
        """Feed one outer step; returns the LR factor to apply now, or None."""
        self.seen_violation = self.seen_violation or violated(r, epsilon)
        if self.done or step < self.at_step:
            return None
        self.done = True
        if self.seen_violation:
            scale = self.violation_scale
        else:
            observed = -math.log(max(lfgt_ema / lfgt_first, 0.01)) / step if lfgt_first > 0 else 0.0
            target = math.log(2.0) / (self.total_steps / 3.0)
            scale = (
                self.max_scale
                if observed <= 0
                else min(self.max_scale, max(self.min_scale, target / observed))
            )
        if abs(scale - 1.0) < self.skip_within:
            return None
        self.scale = scale
        return scale


@dataclass
class ConvergenceMonitor(_State):
    """Early stop before the cap T.

    ema_t = (1-b) ema_{t-1} + b L_fgt_t;  vel_t = (1-b) vel_{t-1} + b (ema_t - ema_{t-1});  b = 0.15;
    T_trans = first step ending 3 consecutive steps with r > epsilon;
    stop when T_trans is known, t >= 1.6 T_trans, ema_t <= 0.5 L_fgt_1, and for `patience` consecutive steps
    |vel_t| < 1% of max|vel| or ema_t < 2% of L_fgt_1.
    """

    beta: float = 0.15
    patience: int = 8
    trans_run: int = 3
    trans_factor: float = 1.6
    drop_needed: float = 0.5
    flat_velocity: float = 0.01
    low_loss: float = 0.02
    first: float | None = None
    ema: float | None = None
    vel: float = 0.0
    vel_peak: float = 0.0
    violation_run: int = 0
    t_trans: int | None = None
    quiet_steps: int = 0
    converged: bool = False

    def update(self, step: int, l_fgt: float, r: float, epsilon: float) -> bool:
        """Feed one outer step; True once the stop rule holds."""
        if self.first is None or self.ema is None:
            self.first, self.ema = l_fgt, l_fgt
        else:
            previous = self.ema
            self.ema = (1 - self.beta) * self.ema + self.beta * l_fgt
            self.vel = (1 - self.beta) * self.vel + self.beta * (self.ema - previous)
        self.vel_peak = max(self.vel_peak, abs(self.vel))
        self.violation_run = self.violation_run + 1 if violated(r, epsilon) else 0
        if self.t_trans is None and self.violation_run >= self.trans_run:
            self.t_trans = step
        quiet = abs(self.vel) < self.flat_velocity * self.vel_peak or self.ema < self.low_loss * self.first
        self.quiet_steps = self.quiet_steps + 1 if quiet else 0
        self.converged = (
            self.t_trans is not None
            and step >= self.trans_factor * self.t_trans
            and self.ema <= (1 - self.drop_needed) * self.first
            and self.quiet_steps >= self.patience
        )
        return self.converged
