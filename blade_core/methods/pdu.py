"""PDU (Entesari et al. 2025, "Constrained Entropic Unlearning: A Primal-Dual Framework for LLMs").

Forgetting flattens the next-token distribution on the forget answers; retention is a constraint, not a
weight:

    min_theta  L_margin(D_f)   s.t.  NLL_theta(D_r) <= epsilon
    Lagrangian: gamma * L_margin + lambda * (NLL_theta(D_r) - epsilon)
    primal: one AdamW step on theta;  dual: lambda <- max(0, lambda + eta (NLL_theta(D_r) - epsilon))

The dual update is symmetric (lambda falls as readily as it rises) and starts after a warm-up:
OpenUnlearning's TOFU recipe waits 5 of its 10 epochs, here `dual_warmup_frac` of the run's steps. The step
where the dual updates start is the run's T_trans (recorded as `phase` in the history). Departures: the
margin loss averages over answer positions only (see `logit_margin_loss`); see `_loop.py` for the schedule.
Run it: `blade unlearn --model M --forget F --retain R --out DIR --method pdu`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from blade_core.baseline_losses import logit_margin_loss, pdu_dual_update, token_mean_nll
from blade_core.methods._loop import (
    Batch,
    StepStats,
    forward,
    run_loop,
    schedule,
)
from blade_core.methods.base import Method, RunResult, UnlearnTask
from blade_service.contracts.methods.baselines import BASELINE_PRESETS, PDUConfig


def train(task: UnlearnTask, config: PDUConfig) -> RunResult:
    warmup_steps = math.ceil(config.dual_warmup_frac * schedule(config, len(task.forget)).total_steps)
    state = {"lam": config.lambda_init, "step": 0}

    def step(micro: Sequence[tuple[Batch, Batch]]) -> StepStats:
        n, lam = len(micro), state["lam"]
        fgt = ret = 0.0
        for forget, retain in micro:
            l_fgt = logit_margin_loss(forward(task.model, forget), forget["labels"])
            l_ret = token_mean_nll(forward(task.model, retain), retain["labels"])
            ((config.gamma * l_fgt + lam * (l_ret - config.epsilon)) / n).backward()
            fgt += float(l_fgt.detach()) / n
            ret += float(l_ret.detach()) / n
        state["step"] += 1
        dual = state["step"] > warmup_steps
        if dual:
            state["lam"] = pdu_dual_update(lam, ret, config.epsilon, config.dual_step_size)
        return StepStats(
            L_fgt=fgt,
            L_ret=ret,
            lam=state["lam"],
            epsilon=config.epsilon,
            r=ret - config.epsilon,
            extra={"phase": "dual" if dual else "warmup", "T_trans": warmup_steps + 1},
        )

    return run_loop(task, config, step, name="pdu", state=state)


PRESETS = BASELINE_PRESETS  # 'lora': how the service trains it (OpenUnlearning's TOFU LoRA experiment)

METHOD = Method(
    name="pdu",
    config_class=PDUConfig,
    train=train,
    summary="logit-margin flattening under a retain-loss constraint, primal-dual (full-parameter)",
)
