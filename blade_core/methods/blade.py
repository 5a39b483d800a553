"""BLADE: Bilevel Low-rank Augmented-Lagrangian Erasure (arXiv, "BLADE ... for LLM Unlearning").

    blade unlearn --model M --forget forget.json --retain retain.json --out adapter/ [--preset tofu]

Per outer step t (one visible loop in `train`):
  1. `inner_loop`: K plain-SGD steps (lr eta_in) on the retain CE, each clipped to norm 1 (the lower level);
  2. `outer_step`: on a forget batch and a *fresh* retain batch, r = L_ret - epsilon and
     L_outer = L_fgt + lambda*r + rho/2*max(0, r)^2, one Adam step (lr eta_out), clipped to norm 1;
  3. `dual_update`: asymmetric ratchet of lambda with the r of step 2 (measured before the Adam step);
  4. `recover`: while L_ret > 2*epsilon, up to 3K extra inner steps, re-measuring L_ret without gradient;
     r_recovered = L_ret_recovered - epsilon (None when recovery did not run);
  5. collapse guard (L_ret > 10 -> stop, failure), then LR calibration, phase transition T_trans and the
     convergence stop (`blade_core.dynamics`), all fed the post-recovery residual (r_recovered, else r);
     `stop_needs_retain_met` (opt-in, not the reference) makes the stop also wait for r <= 0.
epsilon is automatic: the first inner loop (which stands in for step 1's) gives epsilon = eps_mul * mean loss.
history.json keeps both residuals: `r` (what the dual update used) and `r_recovered`.

Where this departs from the paper, it follows the authors' reference implementation (`lora_bial_adaptive` in
their OpenUnlearning fork): the clamped entropy counts every non-padding token by default (`forget_tokens`),
the dual update is asymmetric with a floor, adaptive recovery and the calibration/convergence rules are the
reference's. Batches as the reference: every inner SGD step and the outer step accumulate `grad_accum`
micro-batches of `batch_size` rows (TOFU: 4 x 4 = 16 rows), the augmented term applied per micro-batch; the
recovery re-measurement uses one micro-batch. On CUDA (`stacked_forward`) a step's micro-batches go through
one forward, each loss still taken per micro-batch: the reference's update in fewer kernel launches.

`BladeConfig` and the presets of the paper's table live in the torch-free
`blade_service/contracts/methods/blade.py`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from blade_core.checkpoint import (
    config_fingerprint,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from blade_core.data import BatchStream, stack_batches, unstack
from blade_core.dynamics import ConvergenceMonitor, LrCalibrator
from blade_core.head import final_hidden, split_head
from blade_core.losses import (
    clamped_entropy_loss,
    counted_mask,
    fused_clamped_entropy_loss,
    fused_token_cross_entropy,
    mean_token_entropy,
    token_cross_entropy,
)
from blade_core.methods.base import Method, RunResult, RunStatus, UnlearnTask
from blade_service.contracts.methods.blade import PRESETS as PRESETS  # re-exported: `presets_of`, the tests
from blade_service.contracts.methods.blade import BladeConfig

# ------------------------------------------------------------------------------------------ the bilevel loop


def _to(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits: torch.Tensor = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits  # (B, T, V)


def _features(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(last hidden states, head weight) where the model splits at its head (`blade_core.head`), else
    (logits, None): what the loss functions below take."""
    split = split_head(model)
    if split is None:
        return _logits(model, batch), None
    decoder, head = split
    return final_hidden(decoder, batch), head


def _clamped_entropy(
    features: torch.Tensor, head: torch.Tensor | None, mask: torch.Tensor, cfg: BladeConfig
) -> tuple[torch.Tensor, float]:
    if head is None:
        l_fgt = clamped_entropy_loss(features, mask, cfg.tau, chunk=cfg.loss_chunk)
        return l_fgt, mean_token_entropy(features.detach(), mask, chunk=cfg.loss_chunk)
    return fused_clamped_entropy_loss(features, head, mask, cfg.tau, chunk=cfg.loss_chunk)


def _cross_entropy(
    features: torch.Tensor, head: torch.Tensor | None, labels: torch.Tensor, cfg: BladeConfig
) -> torch.Tensor:
    if head is None:
        return token_cross_entropy(features, labels, chunk=cfg.loss_chunk)
    return fused_token_cross_entropy(features, head, labels, chunk=cfg.loss_chunk)


def retain_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: BladeConfig) -> torch.Tensor:
    """L_ret = token CE on answer tokens (QA) or all tokens (text); labels already encode which.

    Fused with the LM head where the model allows it (`blade_core.head`): no (B, T, V) logits."""
    features, head = _features(model, batch)
    return _cross_entropy(features, head, batch["labels"], cfg)


def forget_loss(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: BladeConfig
) -> tuple[torch.Tensor, float]:
    """(L_fgt, mean counted H(p_t)/log V): the clamped entropy (paper Eq. 3) on the tokens `forget_tokens`
    counts, fused with the LM head where the model allows it."""
    mask = counted_mask(batch["labels"], batch["attention_mask"], cfg.forget_tokens)
    features, head = _features(model, batch)
    return _clamped_entropy(features, head, mask, cfg)


def in_deadzone(l_fgt: torch.Tensor) -> bool:
    """L_fgt = mean_t max(0, tau*log V - H(p_t)) (Eq. 3) is exactly 0 iff every counted token has H(p_t) >=
    tau*log V, where each token's gradient is exactly 0 too: the backward through the model would only add
    zeros to the gradient. Most steps of a run are there once the forget set is forgotten (74-81 % of the
    250 steps in each history of docs/results_data/validation-blade-16x1-vs-4x4/)."""
    return l_fgt.item() == 0.0


def stacked_losses(
    model: torch.nn.Module,
    forget: list[dict[str, torch.Tensor]],
    retain: list[dict[str, torch.Tensor]],
    cfg: BladeConfig,
) -> tuple[list[tuple[torch.Tensor, float]], list[torch.Tensor]]:
    """Each forget batch's `forget_loss` and each retain batch's `retain_loss`, from one forward over all of
    them stacked.

    Each loss reads its own rows at its own width, so the values and gradients are those of one forward per
    batch (to float rounding); every batch's activations are alive at once."""
    batches = forget + retain
    features, head = _features(model, stack_batches(batches))
    parts = unstack(features, batches)
    forget_parts, retain_parts = parts[: len(forget)], parts[len(forget) :]
    forget_losses = [
        _clamped_entropy(part, head, counted_mask(b["labels"], b["attention_mask"], cfg.forget_tokens), cfg)
        for part, b in zip(forget_parts, forget, strict=True)
    ]
    retain_losses = [
        _cross_entropy(part, head, b["labels"], cfg) for part, b in zip(retain_parts, retain, strict=True)
    ]
    return forget_losses, retain_losses


# The most padded positions `auto` stacks into one forward on CUDA: 8 micro-batches of 4 x 512 tokens. At
# 4 x 512 an H100 ran BLADE's step on an 871M-parameter model at 4% MFU, waiting on launches (performance.md).
# Bigger steps (long rows under a raised max_length) keep a GPU busy anyway; stacking them would only hold
# more activations at once. At the default max_length, 256, every preset's steps fit.
AUTO_STACK_MAX_TOKENS = 16_384


def stacks_forward(cfg: BladeConfig, device: torch.device, batches: list[dict[str, torch.Tensor]]) -> bool:
    """Whether a step runs its micro-batches `batches` through one forward: `stacked_forward`, where "auto"
    means on CUDA and within AUTO_STACK_MAX_TOKENS padded positions.

    At these sizes a GPU waits on kernel launches, and one forward over the outer step's forget and retain
    batches took x0.49-0.76 the time of two on an H100 and an H200; a CPU waits on arithmetic, and stacking
    saved it 3-7% of a step at four times the memory (docs/performance.md)."""
    if cfg.stacked_forward != "auto":
        return cfg.stacked_forward == "on"
    rows = sum(b["input_ids"].shape[0] for b in batches)
    width = max(b["input_ids"].shape[1] for b in batches)
    return device.type == "cuda" and rows * width <= AUTO_STACK_MAX_TOKENS


def inner_loop(
    model: torch.nn.Module,
    retain: BatchStream,
    opt: torch.optim.Optimizer,
    cfg: BladeConfig,
    device: torch.device,
) -> list[float]:
    """K steps of theta <- theta - eta_in * clip(grad L_ret(theta; B_k), 1), B_k being `grad_accum` retain
    micro-batches (the gradient of their mean loss); returns each step's mean L_ret before the step."""
    params = [p for g in opt.param_groups for p in g["params"]]
    losses = []
    for _ in range(cfg.inner_steps):
        opt.zero_grad(set_to_none=True)
        batches = [_to(retain.next(), device) for _ in range(cfg.grad_accum)]
        if stacks_forward(cfg, device, batches):
            micro = stacked_losses(model, [], batches, cfg)[1]
            (torch.stack(micro).sum() / cfg.grad_accum).backward()
        else:
            micro = []
            for batch in batches:
                loss = retain_loss(model, batch, cfg)
                (loss / cfg.grad_accum).backward()
                micro.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
        opt.step()
        losses.append(sum(loss.item() for loss in micro) / cfg.grad_accum)
    return losses


def augmented_term(r: torch.Tensor, lam: float, cfg: BladeConfig) -> torch.Tensor:
    """lambda*r + rho/2*max(0, r)^2: the retain constraint's part of L_outer."""
    return lam * r + cfg.rho / 2 * torch.clamp(r, min=0.0) ** 2


def outer_step(
    model: torch.nn.Module,
    forget: BatchStream,
    retain: BatchStream,
    opt: torch.optim.Optimizer,
    lam: float,
    epsilon: float,
    cfg: BladeConfig,
    device: torch.device,
) -> dict[str, float]:
    """One Adam step on L_outer = L_fgt + lambda*r + rho/2*max(0, r)^2, r = L_ret - epsilon (a fresh batch).

    Over `grad_accum` micro-batches the augmented term is taken per micro-batch. Unstacked, the forget and
    retain parts are back-propagated one after the other (the objective is a sum), so only one graph is alive
    at a time, and a forget part in the clamp's deadzone (`in_deadzone`) is not back-propagated at all;
    stacked (`stacks_forward`), every part comes from one forward over all the micro-batches.
    """
    params = [p for g in opt.param_groups for p in g["params"]]
    opt.zero_grad(set_to_none=True)
    forget_batches = [_to(forget.next(), device) for _ in range(cfg.grad_accum)]
    retain_batches = [_to(retain.next(), device) for _ in range(cfg.grad_accum)]
    terms: list[tuple[torch.Tensor, float, torch.Tensor]] = []  # (L_fgt, H_fgt, L_ret) of each micro-batch
    if stacks_forward(cfg, device, forget_batches + retain_batches):
        fgt, ret = stacked_losses(model, forget_batches, retain_batches, cfg)
        terms = [(l_fgt, h_fgt, l_ret) for (l_fgt, h_fgt), l_ret in zip(fgt, ret, strict=True)]
        l_outer = [l_fgt + augmented_term(l_ret - epsilon, lam, cfg) for l_fgt, _, l_ret in terms]
        (torch.stack(l_outer).sum() / cfg.grad_accum).backward()
    else:
        for forget_batch, retain_batch in zip(forget_batches, retain_batches, strict=True):
            l_fgt, h_fgt = forget_loss(model, forget_batch, cfg)
            if in_deadzone(l_fgt):
                l_fgt = l_fgt.detach()  # its graph goes now, before the retain forward builds one
            else:
                (l_fgt / cfg.grad_accum).backward()
            l_ret = retain_loss(model, retain_batch, cfg)
            (augmented_term(l_ret - epsilon, lam, cfg) / cfg.grad_accum).backward()
            terms.append((l_fgt.detach(), h_fgt, l_ret.detach()))
    torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)
    opt.step()
    out = {
        "L_fgt": sum(l_fgt.item() for l_fgt, _, _ in terms) / cfg.grad_accum,
        "L_ret": sum(l_ret.item() for _, _, l_ret in terms) / cfg.grad_accum,
        "H_fgt": sum(h_fgt for _, h_fgt, _ in terms) / cfg.grad_accum,
    }
    out["r"] = out["L_ret"] - epsilon
    return out


def dual_update(lam: float, r: float, cfg: BladeConfig) -> float:
    """lambda += rho*r if r > 0 else alpha*rho*r; then lambda = max(lambda_min, lambda), optionally capped."""
    lam = lam + cfg.rho * r if r > 0 else lam + cfg.alpha * cfg.rho * r
    lam = max(cfg.lambda_min, lam)
    return min(cfg.lambda_max, lam) if cfg.lambda_max is not None else lam


@torch.no_grad()
def measure_retain(
    model: torch.nn.Module, retain: BatchStream, cfg: BladeConfig, device: torch.device
) -> float:
    """L_ret on a new retain batch, without gradient."""
    return retain_loss(model, _to(retain.next(), device), cfg).item()


def recover(
    model: torch.nn.Module,
    retain: BatchStream,
    opt: torch.optim.Optimizer,
    l_ret: float,
    epsilon: float,
    cfg: BladeConfig,
    device: torch.device,
) -> tuple[int, float | None]:
    """While L_ret > 2*epsilon and extra < 3K: another inner loop, then re-measure L_ret on a new batch.

    Returns (extra inner steps spent, last re-measured L_ret or None when recovery did not run).
    """
    budget = cfg.recovery_factor * cfg.inner_steps
    spent, measured = 0, None
    while l_ret > cfg.recovery_threshold * epsilon and spent < budget:
        inner_loop(model, retain, opt, cfg, device)
        spent += cfg.inner_steps
        l_ret = measured = measure_retain(model, retain, cfg, device)
    return spent, measured


@dataclass
class LoopState:
    """Everything besides weights, optimisers and streams that a checkpoint must carry."""

    step: int
    lam: float
    epsilon: float | None
    calibrator: LrCalibrator
    monitor: ConvergenceMonitor
    history: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "lam": self.lam,
            "epsilon": self.epsilon,
            "history": self.history,
            "calibrator": self.calibrator.state_dict(),
            "monitor": self.monitor.state_dict(),
        }

    def load(self, state: dict[str, Any]) -> None:
        self.step, self.lam, self.epsilon = state["step"], state["lam"], state["epsilon"]
        self.history = list(state["history"])
        self.calibrator.load_state_dict(state["calibrator"])
        self.monitor.load_state_dict(state["monitor"])


def _set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def train(task: UnlearnTask, cfg: BladeConfig) -> RunResult:
    """The BLADE bilevel loop (module docstring); returns the per-step history and how the run ended."""
    model, device, hooks = task.model, task.device, task.hooks
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("BLADE: the model has no trainable parameters (attach an adapter first)")
    inner_opt = torch.optim.SGD(params, lr=cfg.eta_in, momentum=0.0)
    outer_opt = torch.optim.Adam(params, lr=cfg.eta_out)
    forget = BatchStream(task.forget, cfg.batch_size, seed=cfg.seed)
    retain = BatchStream(task.retain, cfg.batch_size, seed=cfg.seed + 1)
    state = LoopState(
        step=0,
        lam=cfg.lambda0,
        epsilon=cfg.epsilon,
        calibrator=LrCalibrator(cfg.max_steps),
        monitor=ConvergenceMonitor(
            beta=cfg.ema_beta, patience=cfg.patience, needs_retain_met=cfg.stop_needs_retain_met
        ),
        history=[],
    )
    ckpt_objects: dict[str, Any] = {
        "model": model,
        "optimizers": {"inner": inner_opt, "outer": outer_opt},
        "streams": {"forget": forget, "retain": retain},
    }
    config_key = config_fingerprint(cfg)
    if hooks.checkpoint_dir is not None and has_checkpoint(hooks.checkpoint_dir):
        saved = load_checkpoint(hooks.checkpoint_dir, **ckpt_objects, config=cfg)
        state.load(saved["loop"])

    status: RunStatus = "max_steps"
    message = ""
    while state.step < cfg.max_steps:
        if hooks.should_stop is not None and hooks.should_stop():
            status, message = "cancelled", f"cancelled after step {state.step}."
            break
        t, started = state.step + 1, time.perf_counter()
        lr = outer_opt.param_groups[0]["lr"]

        inner = inner_loop(model, retain, inner_opt, cfg, device)  # (1) lower level
        if state.epsilon is None:  # automatic epsilon: this first inner loop stands in for step 1's
            state.epsilon = cfg.eps_mul * sum(inner) / len(inner)
        out = outer_step(model, forget, retain, outer_opt, state.lam, state.epsilon, cfg, device)  # (2)
        state.lam = dual_update(state.lam, out["r"], cfg)  # (3) with the r measured before the Adam step
        # (4) adaptive recovery, starting from the outer step's L_ret
        extra, l_ret_after = recover(model, retain, inner_opt, out["L_ret"], state.epsilon, cfg, device)
        r_recovered = l_ret_after - state.epsilon if l_ret_after is not None else None
        r_now = r_recovered if r_recovered is not None else out["r"]  # what the reference's rules see

        converged = state.monitor.update(t, out["L_fgt"], r_now, state.epsilon)
        ema, first = state.monitor.ema, state.monitor.first
        assert ema is not None and first is not None  # the monitor's first update sets both
        scale = state.calibrator.update(t, ema, first, r_now, state.epsilon)
        if cfg.calibrate_lr and scale is not None:
            _set_lr(outer_opt, lr * scale)
        record = {
            "step": t,
            "L_fgt": out["L_fgt"],
            "L_ret": out["L_ret"],
            "r": out["r"],
            "lambda": state.lam,
            "lr": lr,
            "epsilon": state.epsilon,
            "inner_loss_mean": sum(inner) / len(inner),
            "recovery_steps": extra,
            "L_ret_recovered": l_ret_after,
            "r_recovered": r_recovered,
            "H_fgt": out["H_fgt"],
            "lfgt_ema": state.monitor.ema,
            "vel_ema": state.monitor.vel,
            "t_trans": state.monitor.t_trans,
            "converged": converged,
            "lr_scale": scale if cfg.calibrate_lr else None,
            "dt": time.perf_counter() - started,
        }
        state.history.append(record)
        state.step = t
        if hooks.on_step is not None:
            hooks.on_step(record)

        final_ret = l_ret_after if l_ret_after is not None else out["L_ret"]
        collapsed = not (final_ret <= cfg.collapse_loss and math.isfinite(out["L_fgt"]))  # NaN counts too
        if collapsed:  # (5) collapse guard
            status = "collapsed"
            message = (
                f"collapsed at step {t}: retain loss {final_ret:.3f} > {cfg.collapse_loss} "
                f"(epsilon {state.epsilon:.3f}); lower eta_out (it was {cfg.eta_out:g}) or raise rho "
                f"(it was {cfg.rho:g})."
            )
            break
        if hooks.checkpoint_dir is not None and t % cfg.checkpoint_every == 0 and t < cfg.max_steps:
            save_checkpoint(
                hooks.checkpoint_dir, **ckpt_objects, state={"config": config_key, "loop": state.to_dict()}
            )
        if cfg.early_stop and converged:
            status, message = "converged", f"converged at step {t} (T_trans {state.monitor.t_trans})."
            break
    if status == "max_steps":
        message = f"reached the step cap T={cfg.max_steps} without meeting the convergence rule."
    return RunResult(history=state.history, status=status, message=message)


METHOD = Method(
    name="blade",
    config_class=BladeConfig,
    train=train,
    summary="Bilevel LoRA unlearning: clamped-entropy forget loss, augmented-Lagrangian retain constraint",
)
