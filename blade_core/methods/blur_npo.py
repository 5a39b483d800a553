"""BLUR-NPO (Reisizadeh et al. 2025, "BLUR: A Bi-Level Optimization Approach for LLM Unlearning"), NPO forget
loss.

Forgetting is the lower level and keeps priority; the retain gradient is projected off the forget gradient:

    g_f = grad L_NPO(D_f),  g_r = grad NLL(D_r)
    d   = g_r + xi g_f,     xi = gamma - <g_r, g_f> / ||g_f||^2     (BLUR Alg. 1, "forget lower")

and d goes to AdamW. The NPO reference is the frozen starting model (as in `npo.py`). Departures from the
reference code: the NPO term is the sequence-level NPO loss (the BLUR repository's MUSE script compares raw
logits); the schedule is `_loop.py`'s. Run it:
`blade unlearn --model M --forget F --retain R --out DIR --method blur_npo`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blade_core.baseline_losses import blur_combine
from blade_core.methods._loop import (
    Batch,
    Reference,
    StepStats,
    run_loop,
    trainable_parameters,
)
from blade_core.methods.base import Method, RunResult, UnlearnTask
from blade_core.methods.npo import npo_objective
from blade_service.contracts.methods.baselines import BASELINE_PRESETS, BLURNPOConfig


def _grads(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]


def train(task: UnlearnTask, config: BLURNPOConfig) -> RunResult:
    params = trainable_parameters(task.model)
    objective = npo_objective(task, Reference(task.model, config.use_lora), config.beta)

    def step(micro: Sequence[tuple[Batch, Batch]]) -> StepStats:
        n = len(micro)
        g_f = [torch.zeros_like(p) for p in params]
        g_r = [torch.zeros_like(p) for p in params]
        fgt = ret = 0.0
        for forget, retain in micro:
            l_fgt, l_ret = objective(forget, retain)
            for acc, g in zip(g_f, _grads(l_fgt / n, params), strict=True):
                acc.add_(g)
            for acc, g in zip(g_r, _grads(l_ret / n, params), strict=True):
                acc.add_(g)
            fgt += float(l_fgt.detach()) / n
            ret += float(l_ret.detach()) / n
        direction, xi = blur_combine(g_f, g_r, config.gamma)
        for p, d in zip(params, direction, strict=True):
            p.grad = d
        return StepStats(L_fgt=fgt, L_ret=ret, extra={"xi": xi})

    return run_loop(task, config, step, name="blur_npo", params=params)


PRESETS = BASELINE_PRESETS  # 'lora': how the service trains it (OpenUnlearning's TOFU LoRA experiment)

METHOD = Method(
    name="blur_npo",
    config_class=BLURNPOConfig,
    train=train,
    summary="NPO forget loss with the retain gradient projected off the forget gradient (full-parameter)",
)
