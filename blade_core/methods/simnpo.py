"""SimNPO (Fan et al. 2024, "Simplicity Prevails"): reference-free, length-normalised NPO, plus the retain
NLL.

    min_theta  gamma * -(2/beta) E_{D_f}[log sigma(beta (NLL_theta/|y| - delta))] + alpha * NLL_theta(D_r)

Departures from OpenUnlearning: see `_loop.py`. Run it:
`blade unlearn --model M --forget F --retain R --out DIR --method simnpo`.
"""

from __future__ import annotations

import torch

from blade_core.baseline_losses import sequence_nll, simnpo_loss, token_mean_nll
from blade_core.methods._loop import Batch, forward, run_loop, weighted_step
from blade_core.methods.base import Method, RunResult, UnlearnTask
from blade_service.contracts.methods.baselines import BASELINE_PRESETS, SimNPOConfig


def train(task: UnlearnTask, config: SimNPOConfig) -> RunResult:
    def objective(forget: Batch, retain: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        nll, lengths = sequence_nll(forward(task.model, forget), forget["labels"])  # (B,), (B,)
        l_ret = token_mean_nll(forward(task.model, retain), retain["labels"])
        return simnpo_loss(nll, lengths, config.beta, config.delta), l_ret

    return run_loop(task, config, weighted_step(objective, config.gamma, config.alpha), name="simnpo")


PRESETS = BASELINE_PRESETS  # 'lora': how the service trains it (OpenUnlearning's TOFU LoRA experiment)

METHOD = Method(
    name="simnpo",
    config_class=SimNPOConfig,
    train=train,
    summary="reference-free length-normalised NPO + retain NLL (full-parameter)",
)
