"""NPO (Zhang et al. 2024, "Negative Preference Optimization"), with the retain NLL term (NPO+RT,
OpenUnlearning `NPO`).

    min_theta  gamma * -(2/beta) E_{D_f}[log sigma(beta (NLL_theta - NLL_ref))] + alpha * NLL_theta(D_r)

The reference is the frozen starting model: a deep copy for full-parameter runs, the base with adapters off
for LoRA runs. Departures from OpenUnlearning: see `_loop.py`. Run it:
`blade unlearn --model M --forget F --retain R --out DIR --method npo`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blade_core.baseline_losses import npo_loss, sequence_nll, token_mean_nll
from blade_core.methods._loop import (
    Batch,
    Reference,
    forward,
    run_loop,
    weighted_step,
)
from blade_core.methods.base import Method, RunResult, UnlearnTask
from blade_service.contracts.methods.baselines import BASELINE_PRESETS, NPOConfig


def npo_objective(
    task: UnlearnTask, reference: Reference, beta: float
) -> Callable[[Batch, Batch], tuple[torch.Tensor, torch.Tensor]]:
    """(L_NPO on the forget batch, retain NLL): shared with BLUR-NPO."""

    def objective(forget: Batch, retain: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        nll, _ = sequence_nll(forward(task.model, forget), forget["labels"])  # (B,)
        with reference.active() as ref:
            ref_nll, _ = sequence_nll(forward(ref, forget), forget["labels"])  # (B,)
        l_ret = token_mean_nll(forward(task.model, retain), retain["labels"])
        return npo_loss(nll, ref_nll, beta), l_ret

    return objective


def train(task: UnlearnTask, config: NPOConfig) -> RunResult:
    reference = Reference(task.model, config.use_lora)
    step = weighted_step(npo_objective(task, reference, config.beta), config.gamma, config.alpha)
    return run_loop(task, config, step, name="npo")


PRESETS = BASELINE_PRESETS  # 'lora': how the service trains it (OpenUnlearning's TOFU LoRA experiment)

METHOD = Method(
    name="npo",
    config_class=NPOConfig,
    train=train,
    summary="negative preference optimisation + retain NLL (full-parameter, frozen reference)",
)
