"""GradDiff (Liu et al. 2022; Maini et al. 2024, TOFU): gradient ascent on the forget set, descent on the
retain set.

    min_theta  gamma * (-NLL_theta(D_f)) + alpha * NLL_theta(D_r)

Departures from OpenUnlearning: see `_loop.py`. Run it:
`blade unlearn --model M --forget F --retain R --out DIR --method grad_diff`.
"""

from __future__ import annotations

import torch

from blade_core.baseline_losses import grad_ascent_loss, token_mean_nll
from blade_core.methods._loop import Batch, forward, run_loop, weighted_step
from blade_core.methods.base import Method, RunResult, UnlearnTask
from blade_service.contracts.methods.baselines import BASELINE_PRESETS, GradDiffConfig


def train(task: UnlearnTask, config: GradDiffConfig) -> RunResult:
    def objective(forget: Batch, retain: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        l_fgt = grad_ascent_loss(forward(task.model, forget), forget["labels"])
        l_ret = token_mean_nll(forward(task.model, retain), retain["labels"])
        return l_fgt, l_ret

    return run_loop(task, config, weighted_step(objective, config.gamma, config.alpha), name="grad_diff")


PRESETS = BASELINE_PRESETS  # 'lora': how the service trains it (OpenUnlearning's TOFU LoRA experiment)

METHOD = Method(
    name="grad_diff",
    config_class=GradDiffConfig,
    train=train,
    summary="gradient ascent on forget + descent on retain (full-parameter)",
)
