"""The one training loop the seven baselines share, and the pieces they all need.

Every baseline is "draw a forget batch and a retain batch, put a gradient in `.grad`, take an AdamW step";
only the gradient differs. So a method supplies a `step_fn(micro_batches) -> StepStats` that runs its forward
passes and backward passes, and `run_loop` owns the rest: optimiser and learning-rate schedule, batch
streams, gradient clipping, history records in the `history.json` shape (CONTRACT.md), progress bar, hooks,
cancellation, checkpoint/resume, the step cap and collapse detection (a non-finite loss stops the run with
status 'collapsed'). A method whose step keeps state across steps (PDU's multiplier) passes it as `state`, a
JSON-able dict the checkpoint carries.

Departures from OpenUnlearning's Hugging Face Trainer: steps are counted, not epochs (the bench caps every
method at the same number of steps), warm-up is a fraction of those steps (OpenUnlearning: 1 of 10 epochs),
and plain `torch.optim.AdamW` stands in for `paged_adamw_32bit` (the same update without paging).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from blade_core.checkpoint import config_fingerprint, has_checkpoint, load_checkpoint, save_checkpoint
from blade_core.data import BatchStream
from blade_core.methods.base import MethodConfig, RunResult, UnlearnTask

Batch = dict[str, torch.Tensor]


@dataclass
class BaselineConfig(MethodConfig):
    """Optimiser settings every baseline shares (OpenUnlearning TOFU unlearning defaults)."""

    use_lora: bool = False  # full-parameter fine-tuning, as the baselines were published
    # learning rate, full-parameter (OpenUnlearning configs/experiment/unlearn/tofu/default.yaml)
    lr: float = 1e-5
    # learning rate when use_lora (OpenUnlearning configs/experiment/unlearn/tofu/lora.yaml)
    lora_lr: float = 1e-4
    weight_decay: float = 0.01  # AdamW weight decay (OpenUnlearning TOFU unlearn default)
    # linear warm-up over this fraction of max_steps (OpenUnlearning: 1 of 10 epochs)
    warmup_frac: float = 0.1
    lr_decay: bool = True  # then linear decay to 0 (Hugging Face Trainer's default 'linear' schedule)
    max_grad_norm: float = 1.0  # gradient clipping (Hugging Face Trainer default)
    show_progress: bool = True  # tqdm bar over steps

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("lr", "lora_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{type(self).__name__}.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.warmup_frac < 1.0:
            raise ValueError(f"{type(self).__name__}.warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError(f"{type(self).__name__}: weight_decay and max_grad_norm must be >= 0")

    @property
    def effective_lr(self) -> float:
        return self.lora_lr if self.use_lora else self.lr


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


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {k: v.to(device) for k, v in batch.items()}


def forward(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Logits (B, T, V) of a batch; the labels stay out so the model computes no loss of its own."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "the model has no trainable parameters (with use_lora=False every weight should train)"
        )
    return params


class Reference:
    """The frozen starting model NPO, BLUR-NPO and RMU compare against.

    Full-parameter runs keep a deep copy taken before the first step; LoRA runs reuse the model itself with
    its adapters disabled (PEFT's `disable_adapter`), which is the base the adapter started from and costs no
    memory.
    """

    def __init__(self, model: torch.nn.Module, use_lora: bool):
        self._model = model
        self._copy: torch.nn.Module | None = None
        self._use_adapter_off = use_lora and hasattr(model, "disable_adapter")
        if not self._use_adapter_off:
            self._copy = copy.deepcopy(model).eval()
            for p in self._copy.parameters():
                p.requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        return self._copy if self._copy is not None else self._model

    @contextmanager
    def active(self) -> Iterator[torch.nn.Module]:
        """The reference model to call, under no_grad (and with the adapters off for LoRA runs)."""
        with torch.no_grad():
            if self._copy is not None:
                yield self._copy
            else:
                with self._model.disable_adapter():
                    yield self._model


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

    def hook(_module, _inputs, output):
        cache.append(output[0] if isinstance(output, tuple) else output)

    handle = module.register_forward_hook(hook)
    try:
        yield cache
    finally:
        handle.remove()


def lr_factor(step: int, max_steps: int, warmup_frac: float, decay: bool) -> float:
    """Multiplier of the base learning rate at optimiser step `step` (0-based): linear warm-up, then linear
    decay."""
    warmup = math.ceil(warmup_frac * max_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if not decay:
        return 1.0
    return max(0.0, (max_steps - step) / max(1, max_steps - warmup))


def run_loop(
    task: UnlearnTask,
    config: BaselineConfig,
    step_fn: StepFn,
    *,
    name: str,
    params: list[torch.nn.Parameter] | None = None,
    state: dict[str, Any] | None = None,
) -> RunResult:
    """Train for `config.max_steps` AdamW steps, each on `config.grad_accum` (forget, retain) micro-batches.

    `step_fn` leaves the step's gradient in `.grad` of `params` (default: every trainable parameter) and
    returns what it measured. Stops early when `task.hooks.should_stop()` says so ('cancelled') or a loss is
    not finite ('collapsed'); otherwise ends with status 'max_steps' (the baselines have no convergence test).
    With `hooks.checkpoint_dir`: saves every `config.checkpoint_every` steps, resumes from a checkpoint there.
    """
    model, hooks = task.model, task.hooks
    params = params if params is not None else trainable_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=config.effective_lr, weight_decay=config.weight_decay)
    forget_stream = BatchStream(task.forget, config.batch_size, seed=config.seed)
    retain_stream = BatchStream(task.retain, config.batch_size, seed=config.seed + 1)
    ckpt_objects = {
        "model": model,
        "optimizers": {"adamw": optimizer},
        "streams": {"forget": forget_stream, "retain": retain_stream},
    }
    state = state if state is not None else {}
    history: list[dict[str, Any]] = []
    elapsed_before = 0.0
    if has_checkpoint(hooks.checkpoint_dir):
        saved = load_checkpoint(hooks.checkpoint_dir, **ckpt_objects)
        if saved.get("config") != config_fingerprint(config):
            raise ValueError(
                f"{hooks.checkpoint_dir}: the checkpoint was written by a run with another config"
            )
        history, elapsed_before = saved["history"], saved["elapsed_s"]
        state.update(saved["method_state"])
    status, message = "max_steps", ""
    model.train()
    start = time.perf_counter() - elapsed_before
    bar = tqdm(
        range(len(history), config.max_steps),
        initial=len(history),
        total=config.max_steps,
        desc=name,
        unit="step",
        leave=False,
        disable=not config.show_progress,
    )
    for step in bar:
        if hooks.should_stop is not None and hooks.should_stop():
            status, message = "cancelled", f"cancelled before step {step + 1}"
            break
        lr = config.effective_lr * lr_factor(step, config.max_steps, config.warmup_frac, config.lr_decay)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        micro = [
            (to_device(forget_stream.next(), task.device), to_device(retain_stream.next(), task.device))
            for _ in range(config.grad_accum)
        ]
        stats = step_fn(micro)
        losses = [stats.L_fgt] + ([stats.L_ret] if stats.L_ret is not None else [])
        if not all(math.isfinite(v) for v in losses):
            status, message = (
                "collapsed",
                f"non-finite loss at step {step + 1}: L_fgt={stats.L_fgt}, L_ret={stats.L_ret}",
            )
            break
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
        due = done % config.checkpoint_every == 0 and done < config.max_steps
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
    return RunResult(history=history, status=status, message=message)


def weighted_step(
    objective: Callable[[Batch, Batch], tuple[torch.Tensor, torch.Tensor | None]],
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
