"""Training-dynamics rules of BLADE as small pure state objects: LR calibration and the convergence stop.

They see only scalars (step, L_fgt, r, epsilon), so tests drive them with scripted loss sequences, and their
whole state is a dataclass (`state_dict()` / `load_state_dict()` for checkpoints).

Thresholds and step arithmetic follow the BLADE reference implementation (`lora_bial_adaptive` in the
authors' OpenUnlearning fork). Its constraint-violation test is `r > epsilon` (r = L_ret - epsilon, so
L_ret > 2*epsilon), not `r > 0`; we keep it (see `violated`). The r fed here is the residual after adaptive
recovery when recovery ran (the reference re-measures r inside its recovery loop). Steps are passed 1-based
(t = 1 is the first outer step); the reference counts from 0, so its step s is our s + 1 and the rules below
convert where the arithmetic depends on it (`elapsed = t - 1`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


def violated(r: float, epsilon: float) -> bool:
    """The reference's 'constraint clearly violated' test used by calibration and T_trans: r > epsilon."""
    return r > epsilon


@dataclass
class _State:
    """Base of the rule dataclasses (no fields of its own): checkpointing by their fields."""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


@dataclass
class LrCalibrator(_State):
    """One-shot rescaling of the outer LR once c = max(5, int(0.1*T)) steps have passed since the first.

    At step t = c + 1 (the reference's 0-based step c), with e = t - 1 = c:
    observed pace = -ln(max(ema_t / L_fgt_1, 0.01)) / e;  target pace = ln 2 / (T/3)  (halve every T/3 steps);
    scale = clip(target / observed, 0.3, 3.0), or 0.5 if r > epsilon happened at any step before t;
    a scale within 8% of 1 (inclusive) is skipped.
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
    def elapsed_needed(self) -> int:
        """c = max(5, int(0.1*T)): steps after the first before calibrating (the reference's cal_step)."""
        return max(5, int(0.1 * self.total_steps))

    @property
    def at_step(self) -> int:
        """The 1-based outer step at which the calibration applies."""
        return self.elapsed_needed + 1

    def update(self, step: int, lfgt_ema: float, lfgt_first: float, r: float, epsilon: float) -> float | None:
        """Feed one outer step (1-based) and its post-recovery r; the LR factor to apply now, or None."""
        if self.done:
            return None
        if step < self.at_step:
            self.seen_violation = self.seen_violation or violated(r, epsilon)
            return None
        self.done = True
        elapsed = step - 1
        if self.seen_violation:
            scale = self.violation_scale
        else:
            observed = -math.log(max(lfgt_ema / lfgt_first, 0.01)) / elapsed if lfgt_first > 0 else 0.0
            target = math.log(2.0) / (self.total_steps / 3.0)
            scale = (
                self.max_scale
                if observed <= 0
                else min(self.max_scale, max(self.min_scale, target / observed))
            )
        if abs(scale - 1.0) <= self.skip_within:  # the reference applies only a change > 8%
            return None
        self.scale = scale
        return scale


@dataclass
class ConvergenceMonitor(_State):
    """Early stop before the cap T.

    ema_t = (1-b) ema_{t-1} + b L_fgt_t;  vel_t = (1-b) vel_{t-1} + b (ema_t - ema_{t-1});  b = 0.15;
    T_trans = the first step of the first run of 3 consecutive steps with r > epsilon (r after recovery);
    prerequisites: T_trans known, t - 1 >= int(1.6 (T_trans - 1)) (the reference's 0-based t >= 1.6 T_trans),
    max|vel| > 0 and ema_t <= 0.5 L_fgt_1;
    quiet: |vel_t| < 1% of max|vel| or ema_t < 2% of L_fgt_1;
    patience (as the reference): on a step whose prerequisites hold, a quiet step counts one and a loud step
    resets the count; a step whose prerequisites fail leaves the count as it is. Stop when count >= patience.
    With `needs_retain_met` (not in the reference; off by default) a step is quiet only if also r <= 0, so the
    stop waits until retain repair has held for the whole patience window.
    """

    beta: float = 0.15
    patience: int = 8
    trans_run: int = 3
    trans_factor: float = 1.6
    drop_needed: float = 0.5
    flat_velocity: float = 0.01
    low_loss: float = 0.02
    needs_retain_met: bool = False
    first: float | None = None
    ema: float | None = None
    vel: float = 0.0
    vel_peak: float = 0.0
    min_peak: float = 1e-8  # the reference's "peak velocity was actually observed"
    violation_run: int = 0
    t_trans: int | None = None
    quiet_steps: int = 0
    converged: bool = False

    @property
    def min_stop_step(self) -> int | None:
        """First 1-based step at which the stop may fire (None until T_trans is known)."""
        if self.t_trans is None:
            return None
        return int(self.trans_factor * (self.t_trans - 1)) + 1

    def ready(self, step: int) -> bool:
        """The stop rule's prerequisites at `step`: only then does patience count."""
        min_stop = self.min_stop_step
        return (
            min_stop is not None
            and step >= min_stop
            and self.vel_peak >= self.min_peak
            and self.ema is not None
            and self.first is not None
            and self.ema <= (1 - self.drop_needed) * self.first
        )

    def update(self, step: int, l_fgt: float, r: float, epsilon: float) -> bool:
        """Feed one outer step (1-based) with its post-recovery r; True once the stop rule holds."""
        if self.first is None or self.ema is None:
            self.first, self.ema = l_fgt, l_fgt
        else:
            previous = self.ema
            self.ema = (1 - self.beta) * self.ema + self.beta * l_fgt
            self.vel = (1 - self.beta) * self.vel + self.beta * (self.ema - previous)
        self.vel_peak = max(self.vel_peak, abs(self.vel))
        self.violation_run = self.violation_run + 1 if violated(r, epsilon) else 0
        if self.t_trans is None and self.violation_run >= self.trans_run:
            self.t_trans = step - (self.trans_run - 1)
        if self.ready(step):
            flat = abs(self.vel) < self.flat_velocity * self.vel_peak
            quiet = (flat or self.ema < self.low_loss * self.first) and (r <= 0 or not self.needs_retain_met)
            self.quiet_steps = self.quiet_steps + 1 if quiet else 0
        self.converged = self.quiet_steps >= self.patience
        return self.converged
