"""One (method, split, seed) run: the bench-wide config fields, the step cap, training through
`run_unlearning` with peak memory measured, reloading the result, evaluating it and making its results row."""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from blade_core.bench.measure import PeakMemory
from blade_core.bench.models import split_paths
from blade_core.bench.settings import BenchPlan, Log
from blade_core.bench.summary import _fmt
from blade_core.evaluation.tofu import evaluate_split, load_rows
from blade_core.heartbeat import Heartbeat
from blade_core.lora import load_with_stack
from blade_core.methods import get_method
from blade_core.methods._loop import schedule
from blade_core.methods.base import Hooks
from blade_core.modeling import pick_device
from blade_core.unlearn import build_config, config_fields, run_unlearning

if TYPE_CHECKING:
    from blade_service.contracts.methods.baselines import BaselineConfig


def method_overrides(method: str, plan: BenchPlan) -> dict[str, Any]:
    """The bench-wide config fields every method gets alike (max length; batch size when the settings fix
    one), plus any explicit per-method overrides of the plan. Learning rates are the engine's rule's."""
    config_class = get_method(method).config_class
    known = config_fields(config_class)
    fields: dict[str, Any] = {
        "max_length": plan.settings.max_length,
        "show_progress": False,  # run_unlearning's own step bar shows every method alike
    }
    if plan.settings.batch_size is not None:
        fields["batch_size"] = plan.settings.batch_size
    fields.update(plan.overrides.get(method, {}))
    return {k: v for k, v in fields.items() if k in known}


@dataclass
class Trained:
    """One training run of the bench: the engine's output and what the bench measured around it."""

    out: Any  # blade_core.unlearn.RunOutput
    run_s: float
    peak_mb: float


# The presets a method runs with on TOFU splits, where its authors' settings are not its defaults: BLADE's
# reference batch of 16 rows per outer step (4 x 4 accumulation; its defaults, the service's, take 4 x 1) and
# its cap T, 500 on forget10 and 250 elsewhere (the BLADE paper's table; its run script
# scripts/tofu_adaptive_3b_seeds.sh).
DRAWN = "drawn"  # the author sets `--sequential` and `--scale` draw (stream.py), a few authors each
SPLIT_PRESETS: dict[str, dict[str, str]] = {
    "blade": {"forget01": "tofu", "forget05": "tofu", "forget10": "tofu_forget10", DRAWN: "tofu"},
}


def split_preset(method: str, split: str) -> str | None:
    """The preset `method` runs with on `split` or on the `DRAWN` sets (None: its defaults)."""
    return SPLIT_PRESETS.get(method, {}).get(split)


def step_cap(plan: BenchPlan, method: str, forget: Path) -> int | None:
    """The common cap as an upper bound: min(settings.max_steps, the method's own step count on this forget
    set), so a cap never lengthens a baseline's published schedule (its `max_steps` replaces the schedule)."""
    cap = plan.settings.max_steps
    if cap is None:
        return None

    config = build_config(method, None, method_overrides(method, plan), None, 0)
    if hasattr(config, "epochs"):  # a baseline: its published schedule on this forget set
        n_forget = len(load_rows(forget, ("question", "answer")))
        baseline = cast("BaselineConfig", config)  # only the baselines' configs have `epochs`
        return min(cap, schedule(replace(baseline, max_steps=None), n_forget).total_steps)
    return min(cap, config.max_steps) if config.max_steps else cap  # BLADE: its own cap T


def train(
    plan: BenchPlan,
    method: str,
    seed: int,
    *,
    forget: Path,
    retain: Path,
    work: Path,
    model: Path | None = None,
    adapters: Sequence[Path] = (),
    multiplier: float | None = None,
    preset: str | None = None,
    log: Log | None = None,
    label: str = "",
) -> Trained:
    """One `run_unlearning` call (the runner `blade unlearn` and the worker use) on `model` (default the
    plan's target) plus frozen `adapters`, at the plan's LR factor times `multiplier` (default: the method's
    chosen one). Without progress bars, `log` gets a `Heartbeat` line for `label` every few minutes."""
    device = pick_device()
    overrides, cap = method_overrides(method, plan), step_cap(plan, method, forget)
    hooks = None
    if log is not None and not plan.progress:
        total = build_config(method, preset, overrides, cap, seed).max_steps  # a baseline's comes per step
        heartbeat = Heartbeat(log, label or f"{method} seed {seed}", total)
        hooks = Hooks(on_step=lambda record: heartbeat.beat(record["step"], record.get("total_steps")))
    with PeakMemory(device.type) as memory:
        started = time.perf_counter()
        out = run_unlearning(
            model=model or plan.target,
            forget=forget,
            retain=retain,
            out_dir=work,
            method=method,
            preset=preset,
            adapters=adapters,
            overrides=overrides,
            max_steps=cap,
            seed=seed,
            hooks=hooks,
            device=str(device),
            progress=plan.progress,
            lr_scale=plan.lr_scale,  # the target's factor, also for a continued full model without build info
            lr_multiplier=plan.multipliers.get(method, 1.0) if multiplier is None else multiplier,
        )
        run_s = time.perf_counter() - started
    peak = out.peak_mem_mb if out.peak_mem_mb is not None else memory.peak_mb
    return Trained(out=out, run_s=run_s, peak_mb=peak)


def load_trained(plan: BenchPlan, trained: Trained, base: Path | None = None, stack: Sequence[Path] = ()):
    """(model, tokenizer) of a run's result: its full model dir, or `base` + `stack` + its adapter."""
    out = trained.out
    if out.full_model:
        return load_with_stack(out.adapter_dir, (), pick_device())
    return load_with_stack(base or plan.target, [*stack, out.adapter_dir], pick_device())


def evaluate(
    plan: BenchPlan,
    model,
    tokenizer,
    split: str,
    gold_ref: dict[str, Any] | None,
    data_dir: Path | None = None,
) -> dict[str, Any]:
    """`evaluate_split` with the bench's evaluation settings."""
    s = plan.settings
    return evaluate_split(
        model,
        tokenizer,
        data_dir or plan.data_dir,
        split,
        gold=gold_ref,
        batch_size=s.eval_batch_size,
        max_rows=s.eval_max_rows,
        max_new_tokens=s.eval_max_new_tokens,
        seed=0,
    )


EVAL_DETAIL_KEYS = (
    "forget",
    "retain",
    "real_authors",
    "world_facts",
    "MU_components",
    "mia",
    "privleak_by_attack",
    "n",
    "time_s",
)


def make_row(method: str, split: str, seed: int, trained: Trained, metrics: dict[str, Any]) -> dict[str, Any]:
    """A results row (CONTRACT.md) of one run and its evaluation."""
    out = trained.out
    return {
        "method": method,
        "split": split,
        "seed": seed,
        "MU": metrics["MU"],
        "Prob": metrics["Prob"],
        "ROUGE": metrics["ROUGE"],
        "HM": metrics["HM"],
        "forget_quality": metrics["forget_quality"],
        "privleak": metrics["privleak"],
        "steps": len(out.history),
        "time_s": round(trained.run_s, 2),
        "peak_mem_mb": round(trained.peak_mb, 1),
        "status": out.status,
        "message": out.message,
        "lr_multiplier": out.lr_rule.get("multiplier"),
        "lr_rule": out.lr_rule,
        "warnings": out.warnings,
        "config": out.config,
        "eval": {k: metrics.get(k) for k in EVAL_DETAIL_KEYS},
    }


def run_one(
    plan: BenchPlan,
    method: str,
    split: str,
    seed: int,
    gold_ref: dict[str, Any] | None,
    log: Log,
    *,
    multiplier: float | None = None,
    tag: str = "",
) -> dict[str, Any]:
    """Unlearn with one method on one split and one seed, reload the result, evaluate it, and return its
    results row and history."""
    forget_path, retain_path = split_paths(plan.data_dir, split)
    work = _run_dir(plan, method, split, seed, tag) / "model"
    trained = train(
        plan,
        method,
        seed,
        forget=forget_path,
        retain=retain_path,
        work=work,
        multiplier=multiplier,
        preset=split_preset(method, split),
        log=log,
        label=f"{method} {split} seed {seed}{f' {tag}' if tag else ''}",
    )
    model, tokenizer = load_trained(plan, trained)
    metrics = evaluate(plan, model, tokenizer, split, gold_ref)
    del model
    shutil.rmtree(work, ignore_errors=True)  # weights are not kept: the row and history are the result
    row = make_row(method, split, seed, trained, metrics)
    log(
        f"{method:>11} {split} seed {seed} LR x{row['lr_multiplier']:g}: {row['status']} after "
        f"{row['steps']} steps in {trained.run_s:.1f}s; MU {_fmt(row['MU'])} Prob {_fmt(row['Prob'])} "
        f"ROUGE {_fmt(row['ROUGE'])} HM {_fmt(row['HM'])} FQ {_fmt(row['forget_quality'], 3)} "
        f"PrivLeak {_fmt(row['privleak'], 1)}"
    )
    for warning in row["warnings"]:
        log(f"{method:>11} {split} seed {seed}: warning: {warning}")
    return {"row": row, "history": trained.out.history}


def _run_dir(plan: BenchPlan, method: str, split: str, seed: int, tag: str = "") -> Path:
    path = plan.out_dir / "runs" / plan.runs_name(method) / split / f"seed{seed}"
    return path / tag if tag else path
