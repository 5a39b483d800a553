"""The one training loop the seven baselines share, and the pieces they all need.

Every baseline is "draw a forget batch and a retain batch, put a gradient in `.grad`, take an AdamW step";
only the gradient differs. So a method supplies a `step_fn(micro_batches) -> StepStats` that runs its forward
passes and backward passes, and `run_loop` owns the rest: optimiser and learning-rate schedule, batch
streams, gradient clipping, history records in the `history.json` shape (CONTRACT.md), progress bar, hooks,
cancellation, checkpoint/resume, the step count and collapse detection (a non-finite loss stops the run with
status 'collapsed'). A method whose step keeps state across steps (PDU's multiplier) passes it as `state`, a
JSON-able dict the checkpoint carries.

The schedule is OpenUnlearning's TOFU unlearning recipe (`configs/experiment/unlearn/tofu/default.yaml` over
`configs/trainer/finetune.yaml`, run by the Hugging Face Trainer): 10 epochs over the forget set at an
effective batch of 32 (8 rows x 4 accumulation), so `10 * ceil(N_forget / 32)` optimiser steps; a linear
warm-up of `int(1 epoch * N_forget // 32)` steps (`load_trainer_args` in `src/trainer/__init__.py`) from 0,
then linear decay to 0 (the Trainer's default `linear` schedule); AdamW, weight decay 0.01, gradient clipping
at 1. A method with a published fixed step count (RMU: 80) sets `schedule_steps`; an explicit `max_steps` is a
common cap that replaces either (the warm-up shrinks in proportion). The service trains every baseline as a
LoRA adapter with OpenUnlearning's TOFU LoRA experiment settings (`LORA_PRESET`). The configs
(`BaselineConfig` and each baseline's) live in the torch-free `blade_service/contracts/methods/baselines.py`.

Steps follow epochs as a PyTorch DataLoader does: the last step of each epoch takes the rows that are left
(40 forget rows: 32, then 8), so 10 epochs see each forget row exactly 10 times; each record's
`forget_rows_seen` counts them. Departure: plain `torch.optim.AdamW` stands in for `paged_adamw_32bit` (the
same update without paging).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from tqdm.auto import tqdm

from blade_core.checkpoint import (
    config_fingerprint,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from blade_core.data import BatchStream
from blade_core.methods.base import RunResult, RunStatus, UnlearnTask
from blade_service.contracts.methods.baselines import (
    LORA_PRESET as LORA_PRESET,  # re-exported: the tests read it here
)
from blade_service.contracts.methods.baselines import BaselineConfig
from blade_service.contracts.schedule import (
    schedule,  # re-exported: the methods, bench and worker read it here
)

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import LoraModel

Batch = dict[str, torch.Tensor]


@dataclass
class StepStats:
    """What one optimiser step measured; `extra` lands in the history record as is."""

    L_fgt: float
    L_ret: float | None = None
    lam: float | None = None  # the retain multiplier after this step (PDU); None where there is none
    epsilon: float | None = None  # the retain-loss bound (PDU); None where there is none
    r: float | None = None  # the constraint residual L_ret - epsilon the dual update used (PDU)
    extra: dict[str, Any] = field(default_factory=dict)


StepFn = Callable[[Sequence[tuple[Batch, Batch]]], StepStats]
# (forget batch, retain batch) -> (L_fgt, L_ret or None for forget-only methods), as loss tensors
Objective = Callable[[Batch, Batch], tuple[torch.Tensor, torch.Tensor | None]]


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


def forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Logits (B, T, V) of a batch; the labels stay out so the model computes no loss of its own."""
    logits: torch.Tensor = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "the model has no trainable parameters (with use_lora=False every weight should train)"
        )
    return params


class Reference:
    """The frozen starting model NPO, BLUR-NPO and RMU compare against.

    Full-parameter runs keep a deep copy taken before the first step. LoRA runs reuse the model itself at
    no memory cost: with only the trainable adapter, PEFT's `disable_adapter`; on top of a stack of earlier
    adapters (the service), only the stacked ones active, in eval mode (no LoRA dropout), which is the model
    the new adapter started from.
    """

    def __init__(self, model: torch.nn.Module, use_lora: bool):
        self._model = model
        self._copy: torch.nn.Module | None = None
        self._stack: list[str] = []
        self._lora_params: list[tuple[str, torch.nn.Parameter]] = []
        if use_lora and hasattr(model, "disable_adapter"):
            self._lora_params = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
            trainable = {n for n, p in self._lora_params if p.requires_grad}
            self._stack = [
                name
                for name in cast("PeftModel", model).peft_config
                if not any(f".{name}." in n or n.endswith(f".{name}") for n in trainable)
            ]
        else:
            self._copy = copy.deepcopy(model).eval()
            for p in self._copy.parameters():
                p.requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self._copy if self._copy is not None else self._model

    @contextmanager
    def active(self) -> Iterator[torch.nn.Module]:
        """The reference model to call, under no_grad."""
        with torch.no_grad():
            if self._copy is not None:
                yield self._copy
            elif not self._stack:
                with cast("PeftModel", self._model).disable_adapter():
                    yield self._model
            else:
                model, flags = (
                    cast("PeftModel", self._model),
                    [(p, p.requires_grad) for _, p in self._lora_params],
                )
                everything, training = list(model.peft_config), model.training
                tuner = cast("LoraModel", model.base_model)  # its set_adapter takes several names
                tuner.set_adapter(self._stack)  # peft also flips requires_grad: restored below
                model.eval()
                try:
                    yield model
                finally:
                    tuner.set_adapter(everything)
                    model.train(training)
                    for p, flag in flags:
                        p.requires_grad_(flag)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The transformer block list (`model.layers` in Llama), found by name so PEFT wrapping does not
    matter."""
    found = [
        m
        for name, m in model.named_modules()
        if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)
    ]
    if not found:
        raise ValueError(
            f"{type(model).__name__}: no decoder layer list (a ModuleList named '...layers') found"
        )
    return max(found, key=len)


@contextmanager
def capture_output(module: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects the hidden states (B, T, D) `module` outputs during the `with` block (a forward hook)."""
    cache: list[torch.Tensor] = []

    def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        cache.append(output[0] if isinstance(output, tuple) else output)

    handle = module.register_forward_hook(hook)
    try:
        yield cache
    finally:
        handle.remove()


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay: bool = True) -> float:
    """Multiplier of the base learning rate at optimiser step `step` (0-based), Hugging Face's
    `get_linear_schedule_with_warmup`: step / W during the W warm-up steps (so the first step runs at 0), then
    (T - step) / (T - W) down to the last step."""
    if step < warmup_steps:
        return step / warmup_steps
    if not decay:
        return 1.0
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def run_loop(
    task: UnlearnTask,
    config: BaselineConfig,
    step_fn: StepFn,
    *,
    name: str,
    params: list[torch.nn.Parameter] | None = None,
    state: dict[str, Any] | None = None,
) -> RunResult:
    """Train for the `schedule` of `config` on this forget set: AdamW steps, each on `config.grad_accum`
    (forget, retain) micro-batches.

    `step_fn` leaves the step's gradient in `.grad` of `params` (default: every trainable parameter) and
    returns what it measured. Stops early when `task.hooks.should_stop()` says so ('cancelled') or a loss is
    not finite ('collapsed'); otherwise ends with status 'max_steps' (the baselines have no convergence test).
    With `hooks.checkpoint_dir`: saves every `config.checkpoint_every` steps, resumes from a checkpoint there.
    """
    model, hooks = task.model, task.hooks
    plan = schedule(config, len(task.forget))
    params = params if params is not None else trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=config.effective_lr, weight_decay=config.weight_decay)
    forget_stream = BatchStream(task.forget, config.batch_size, seed=config.seed)
    retain_stream = BatchStream(task.retain, config.batch_size, seed=config.seed + 1)
    ckpt_objects: dict[str, Any] = {
        "model": model,
        "optimizers": {"adamw": optimizer},
        "streams": {"forget": forget_stream, "retain": retain_stream},
    }
    state = state if state is not None else {}
    history: list[dict[str, Any]] = []
    elapsed_before = 0.0
    if hooks.checkpoint_dir is not None and has_checkpoint(hooks.checkpoint_dir):
        saved = load_checkpoint(hooks.checkpoint_dir, **ckpt_objects, config=config)
        history, elapsed_before = saved["history"], saved["elapsed_s"]
        state.update(saved["method_state"])
    status: RunStatus = "max_steps"
    message = ""
    rows_seen = int(history[-1].get("forget_rows_seen", 0)) if history else 0
    model.train()
    start = time.perf_counter() - elapsed_before
    bar = tqdm(
        range(len(history), plan.total_steps),
        initial=len(history),
        total=plan.total_steps,
        desc=name,
        unit="step",
        leave=False,
        disable=not config.show_progress,
    )
    for step in bar:
        if hooks.should_stop is not None and hooks.should_stop():
            status, message = "cancelled", f"cancelled before step {step + 1}"
            break
        lr = config.effective_lr * lr_factor(step, plan.total_steps, plan.warmup_steps, config.lr_decay)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        micro = []
        for rows in plan.micro_batch_sizes(step):  # a forget row and a retain row each (OpenUnlearning)
            forget_stream.batch_size = retain_stream.batch_size = rows
            micro.append(
                (to_device(forget_stream.next(), task.device), to_device(retain_stream.next(), task.device))
            )
        stats = step_fn(micro)
        losses = [stats.L_fgt] + ([stats.L_ret] if stats.L_ret is not None else [])
        if not all(math.isfinite(v) for v in losses):
            status, message = (
                "collapsed",
                f"non-finite loss at step {step + 1}: L_fgt={stats.L_fgt}, L_ret={stats.L_ret}",
            )
            break
        rows_seen += sum(plan.micro_batch_sizes(step))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm or float("inf"))
        optimizer.step()
        record = {
            "step": step + 1,
            "L_fgt": stats.L_fgt,
            "L_ret": stats.L_ret,
            "r": stats.r,
            "lambda": stats.lam,
            "lr": lr,
            "epsilon": stats.epsilon,
            "converged": False,
            "grad_norm": float(grad_norm),
            "total_steps": plan.total_steps,
            "forget_rows_seen": rows_seen,
            "time_s": round(time.perf_counter() - start, 4),
            **stats.extra,
        }
        history.append(record)
        if hooks.on_step is not None:
            hooks.on_step(record)
        bar.set_postfix(
            L_fgt=f"{stats.L_fgt:.3f}", L_ret="-" if stats.L_ret is None else f"{stats.L_ret:.3f}"
        )
        done = step + 1
        due = done % config.checkpoint_every == 0 and done < plan.total_steps
        if hooks.checkpoint_dir is not None and due:
            save_checkpoint(
                hooks.checkpoint_dir,
                **ckpt_objects,
                state={
                    "config": config_fingerprint(config),
                    "history": history,
                    "elapsed_s": time.perf_counter() - start,
                    "method_state": dict(state),
                },
            )
    bar.close()
    model.eval()
    summary = {
        "optimizer_steps": len(history),
        "forget_rows_seen": rows_seen,
        "epochs_seen": round(rows_seen / max(1, plan.n_forget), 3),
        "schedule": plan.as_dict(),
    }
    return RunResult(history=history, status=status, message=message, summary=summary)


def weighted_step(
    objective: Objective,
    forget_weight: float,
    retain_weight: float,
) -> StepFn:
    """The step of every 'forget_weight * L_fgt + retain_weight * L_ret' method (OpenUnlearning's gamma,
    alpha).

    `objective(forget_batch, retain_batch)` returns the two loss tensors (L_ret None for forget-only methods);
    micro-batch gradients are averaged.
    """

    def step(micro: Sequence[tuple[Batch, Batch]]) -> StepStats:
        n = len(micro)
        fgt, ret = 0.0, 0.0
        has_retain = False
        for forget_batch, retain_batch in micro:
            l_fgt, l_ret = objective(forget_batch, retain_batch)
            total = forget_weight * l_fgt
            if l_ret is not None:
                total = total + retain_weight * l_ret
                ret += float(l_ret.detach()) / n
                has_retain = True
            (total / n).backward()
            fgt += float(l_fgt.detach()) / n
        return StepStats(L_fgt=fgt, L_ret=ret if has_retain else None)

    return step
