"""GradAscent (Jang et al. 2023; Maini et al. 2024, TOFU): gradient ascent on the forget set's NLL, nothing
else.

    min_theta  L_GA = -NLL_theta(D_f)

Unbounded below, so the model eventually collapses; the published schedule (10 epochs, `_loop.py`) decides
how far it gets. Departures from OpenUnlearning: see `_loop.py`. Run it:
`blade unlearn --model M --forget F --retain R --out DIR --method grad_ascent`.
"""

from __future__ import annotations

import torch

from blade_core.baseline_losses import grad_ascent_loss
from blade_core.methods._loop import Batch, forward, run_loop, weighted_step
from blade_core.methods.base import Method, RunResult, UnlearnTask
from blade_service.contracts.methods.baselines import BASELINE_PRESETS, GradAscentConfig


def train(task: UnlearnTask, config: GradAscentConfig) -> RunResult:
    def objective(forget: Batch, retain: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return grad_ascent_loss(forward(task.model, forget), forget["labels"]), None

    return run_loop(task, config, weighted_step(objective, 1.0, 0.0), name="grad_ascent")


PRESETS = BASELINE_PRESETS  # 'lora': how the service trains it (OpenUnlearning's TOFU LoRA experiment)

METHOD = Method(
    name="grad_ascent",
    config_class=GradAscentConfig,
    train=train,
    summary="gradient ascent on the forget NLL (full-parameter)",
)
