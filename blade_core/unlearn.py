"""The one runner behind `blade unlearn`, the Celery worker and the benchmark.

    run_unlearning(model="dir/or/hub-id", forget="forget.json", retain="retain.json", out_dir=Path("out"))

It builds the method's typed config (defaults <- preset <- overrides <- max_steps/seed), loads the base model
and the frozen adapter stack, attaches the trainable LoRA adapter (or trains all weights when the config says
`use_lora=False`), tokenises the data, hands an `UnlearnTask` to the method's loop, then writes the PEFT
adapter dir (or a full model dir), `history.json` and `run.json`. With `hooks.checkpoint_dir` set, the loop
saves checkpoints there and a second call with the same arguments resumes from the latest one.

Precision: bf16 weights + gradient checkpointing on CUDA, fp32 on the CPU (where runs are deterministic).
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from tqdm.auto import tqdm

from blade_core import forget_check, lora
from blade_core import lr_scale as lr_rule
from blade_core.data import load_tokenized
from blade_core.methods import get_method
from blade_core.methods.base import Hooks, MethodConfig, RunStatus, UnlearnTask
from blade_core.modeling import enable_activation_checkpointing, load_model_and_tokenizer, pick_device
from blade_core.swiglu import recomputed_swiglu
from blade_service.contracts.methods import PRESETS, BaselineConfig
from blade_service.contracts.params import make_config

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


@dataclass
class RunOutput:
    adapter_dir: Path  # the PEFT adapter dir, or the full model dir when the config had use_lora=False
    history: list[dict[str, Any]]
    status: RunStatus
    message: str  # how the method ended (converged, cap, collapse, cancelled)
    config: dict[str, Any]
    saved: str = ""  # what was written where
    full_model: bool = False
    elapsed_s: float = 0.0
    peak_mem_mb: float | None = None  # CUDA peak allocated memory, when on CUDA
    extra: dict[str, Any] = field(default_factory=dict)
    lr_rule: dict[str, Any] = field(default_factory=dict)  # blade_core/lr_scale.py: factor, values used
    forget_prob: dict[str, Any] = field(default_factory=dict)  # before, after, essentially_unchanged
    warnings: list[str] = field(default_factory=list)  # e.g. forget_check.unchanged_warning

    @property
    def ok(self) -> bool:
        return self.status in ("converged", "max_steps")


# ---------------------------------------------------------------------------------------------- configuration


def presets_of(method: str) -> dict[str, dict[str, Any]]:
    """The named presets of a method (`contracts.methods.PRESETS`; empty when it has none)."""
    get_method(method)  # validates the name
    return dict(PRESETS[method])


def config_fields(config_class: type[MethodConfig]) -> dict[str, Any]:
    """Field name -> resolved type annotation of a method config dataclass."""
    hints = typing.get_type_hints(config_class)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_class)}


def build_config(
    method: str = "blade",
    preset: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    max_steps: int | None = None,
    seed: int | None = None,
) -> MethodConfig:
    """The method's typed config: defaults <- preset <- overrides <- max_steps/seed, validated by the same
    contract the API uses (`contracts.params.make_config`; `--set` strings are read as the field's type).

    Unknown keys and bad values raise ParamError (a ValueError) naming the field and the value.
    """
    config_class = get_method(method).config_class
    return make_config(
        method, preset=preset, overrides=overrides, max_steps=max_steps, seed=seed, config_class=config_class
    )


def config_to_dict(config: MethodConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


# ---------------------------------------------------------------------------------------------- the run


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# Off a terminal (a log, a pipe) progress is a line every this many steps instead of a redrawn bar.
PROGRESS_LINE_EVERY = 25


def _progress_hooks(hooks: Hooks, total: int) -> tuple[Hooks, Any]:
    """Wrap `hooks` so every step also advances a tqdm bar showing step/T, lambda, L_fgt, L_ret: on a
    terminal; elsewhere the same figures as a line every `PROGRESS_LINE_EVERY` steps."""
    bar = tqdm(total=total, desc="unlearn", unit="step", dynamic_ncols=True, disable=None)
    user = hooks.on_step

    def on_step(record: dict[str, Any]) -> None:
        if record.get("total_steps"):  # a baseline's step count follows from its schedule and the data
            bar.total = record["total_steps"]
        post = {k: f"{record[k]:.4f}" for k in ("lambda", "L_fgt", "L_ret") if record.get(k) is not None}
        if bar.disable:
            if record["step"] % PROGRESS_LINE_EVERY == 0:
                figures = " ".join(f"{k} {v}" for k, v in post.items())
                print(f"unlearn: step {record['step']}/{bar.total} {figures}", file=sys.stderr, flush=True)
        else:
            bar.n = record["step"]
            bar.set_postfix(post, refresh=False)
            bar.refresh()
        if user is not None:
            user(record)

    return dataclasses.replace(hooks, on_step=on_step), bar


def run_unlearning(
    *,
    model: str | Path,
    forget: str | Path,
    retain: str | Path,
    out_dir: Path,
    method: str = "blade",
    preset: str | None = None,
    adapters: Sequence[Path] = (),
    overrides: Mapping[str, Any] | None = None,
    max_steps: int | None = None,
    seed: int = 0,
    hooks: Hooks | None = None,
    device: str | None = None,
    progress: bool = False,
    lr_scale: float | None = None,
    lr_multiplier: float = 1.0,
) -> RunOutput:
    """Train one unlearning adapter on `model` + frozen `adapters`; write it, `history.json`, `run.json` to
    out_dir. Learning rates not in `overrides` follow blade_core/lr_scale.py's rule (factor `lr_scale`, by
    default the model's own; times `lr_multiplier`); forget Prob is measured before and after."""
    config = build_config(method, preset, overrides, max_steps, seed)
    if isinstance(config, BaselineConfig) and config.show_progress:  # `progress` draws the one bar, for all
        config = dataclasses.replace(config, show_progress=False)
    adapters = [lora.check_adapter_dir(a) for a in adapters]
    dev = pick_device(device)
    started = time.time()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    base, tokenizer = load_model_and_tokenizer(model, dev)
    forget_data = load_tokenized(forget, tokenizer, config.max_length)
    retain_data = load_tokenized(retain, tokenizer, config.max_length)

    seed_everything(config.seed)  # before the adapter's random init
    net = lora.load_stack(base, adapters)
    if config.use_lora:
        net = lora.attach_adapter(net, config)
    else:
        if adapters:
            net = cast("PeftModel", net).merge_and_unload()  # full fine-tuning trains the merged weights
        for p in net.parameters():
            p.requires_grad = True
    config, rule = lr_rule.apply_lr_rule(
        config,
        model=model,
        lr_scale=lr_scale,
        multiplier=lr_multiplier,
        explicit=(overrides or {}).keys(),
        state_dir=hooks.checkpoint_dir if hooks else None,
    )
    probe = forget_check.probe_rows(forget)
    prob_before = forget_check.forget_prob(net, tokenizer, probe)
    if dev.type == "cuda" and getattr(config, "gradient_checkpointing", True):
        enable_activation_checkpointing(cast("PreTrainedModel", net))  # a PeftModel forwards to its base
    net.train()

    hooks = hooks or Hooks()
    bar = None
    if progress:
        hooks, bar = _progress_hooks(hooks, config.max_steps)
    task = UnlearnTask(
        model=net, tokenizer=tokenizer, forget=forget_data, retain=retain_data, device=dev, hooks=hooks
    )
    try:
        with recomputed_swiglu(net):  # one (B, T, I) activation fewer per layer, the same gradients
            result = get_method(method).train(task, config)
    finally:
        if bar is not None:
            bar.close()

    prob_after = forget_check.forget_prob(net, tokenizer, probe)
    cancelled = result.status == "cancelled"
    warning = "" if cancelled else forget_check.unchanged_warning(prob_before, prob_after, rule)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if config.use_lora:
        lora.save_adapter(net, out_dir)
        saved = f"PEFT adapter written to {out_dir}"
    else:
        cast("PreTrainedModel", net).save_pretrained(str(out_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir))
        saved = f"use_lora=False: a full model dir (not an adapter) written to {out_dir}"
    (out_dir / "history.json").write_text(json.dumps(result.history, indent=1))
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None
    output = RunOutput(
        adapter_dir=out_dir,
        history=result.history,
        status=result.status,
        message=result.message,
        saved=saved,
        config=config_to_dict(config),
        full_model=not config.use_lora,
        elapsed_s=time.time() - started,
        peak_mem_mb=peak,
        extra=dict(result.summary),
        lr_rule=rule,
        forget_prob={
            "before": prob_before,
            "after": prob_after,
            "essentially_unchanged": forget_check.essentially_unchanged(prob_before, prob_after),
            "rows": len(probe),
        },
        warnings=[warning] if warning else [],
    )
    run_info = {
        "method": method,
        "preset": preset,
        "base_model": str(model),
        "stack": [str(a) for a in adapters],
        "forget": str(forget),
        "retain": str(retain),
        "status": output.status,
        "message": result.message,
        "steps": len(result.history),
        **result.summary,  # e.g. the baselines' optimizer_steps, forget_rows_seen and schedule
        "elapsed_s": round(output.elapsed_s, 3),
        "peak_mem_mb": peak,
        "device": str(dev),
        "full_model": output.full_model,
        "config": output.config,
        "lr_rule": output.lr_rule,
        "forget_prob": output.forget_prob,
        "warnings": output.warnings,
    }
    (out_dir / "run.json").write_text(json.dumps(run_info, indent=1))
    return output
