"""`run_bench`, the bench's loop: select learning rates on the validation world, evaluate the target and
gold models once per split, run (or resume) every (method, split, seed) of the test grid, or the sequential /
scaled experiments, then write results.json, results.md and the plots."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from blade_core.bench.cache import _builds, _read_json, _write_json, world_seed_of
from blade_core.bench.measure import machine
from blade_core.bench.models import _load
from blade_core.bench.one_run import evaluate
from blade_core.bench.parallel import RunSpec, close_pool, run_all
from blade_core.bench.report import render_markdown, write_plots
from blade_core.bench.selection import select_multipliers
from blade_core.bench.settings import ROW_KEYS, BenchPlan, Log, settings_record
from blade_core.bench.stream import plot_stream, run_streams, summarise_stream
from blade_core.bench.summary import summarise
from blade_core.evaluation.tofu import gold_reference
from blade_core.modeling import pick_device
from blade_core.tofu_reference import comparison_row


def reference_evals(plan: BenchPlan, log: Log) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per split: the gold reference (cached) and the target and gold models' own rows (the table's first
    lines)."""
    s = plan.settings
    refs: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    device = pick_device()
    for split in plan.splits:
        path = plan.out_dir / "reference" / f"{split}.json"
        cached = _read_json(path)
        key = {
            "target": str(plan.target.resolve()),
            "gold": str(plan.golds[split].resolve()) if split in plan.golds else None,
            "settings": settings_record(s),
            "builds": _builds(plan, split),
        }
        if cached is None or cached.get("key") != key:
            entry: dict[str, Any] = {"key": key, "rows": []}
            gold_metrics = None
            if split in plan.golds:
                log(f"evaluating the gold model of {split}")
                model, tokenizer = _load(plan.golds[split], device)
                gold_metrics = evaluate(plan, model, tokenizer, split, None)
                entry["gold_reference"] = gold_reference(gold_metrics)
            log(f"evaluating the target model on {split}")
            model, tokenizer = _load(plan.target, device)
            target_metrics = evaluate(plan, model, tokenizer, split, entry.get("gold_reference"))
            if gold_metrics is not None:
                # The gold model against its own reference: forget quality 1 and PrivLeak 0 by construction.
                gold_metrics = {**gold_metrics, "forget_quality": 1.0, "privleak": 0.0}
            for name, metrics in (("target", target_metrics), ("gold", gold_metrics)):
                if metrics is not None:
                    entry["rows"].append(
                        {
                            "model": name,
                            "split": split,
                            **{
                                k: metrics.get(k)
                                for k in ("MU", "Prob", "ROUGE", "HM", "forget_quality", "privleak")
                            },
                            "tofu": comparison_row(name, split, metrics),  # beside TOFU's published figures
                        }
                    )
            _write_json(path, entry)
            cached = entry
        refs[split] = cached.get("gold_reference")
        rows.extend(cached["rows"])
    return refs, rows


def run_bench(plan: BenchPlan, log: Log = print) -> dict[str, Any]:
    """Select learning rates on the validation world, then run (or resume) the test grid (or the sequential
    / scaled experiments); write results.json, results.md and the plots; returns results.json."""
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model load would drown the run's bars
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    say = (lambda msg: tqdm.write(msg)) if plan.progress else log
    try:
        return _run_bench(plan, log, say, started)
    finally:
        close_pool()  # --jobs: the worker processes


def _run_bench(plan: BenchPlan, log: Log, say: Log, started: float) -> dict[str, Any]:
    selection = select_multipliers(plan, say)  # before anything reads the test world
    plan.multipliers = {m: float(v) for m, v in selection["chosen"].items()}
    rows, histories = [], {}
    reference_rows: list[dict[str, Any]] = []
    stream = bool(plan.sequential or plan.scales)
    if stream:
        rows = run_streams(plan, say)
    else:
        refs, reference_rows = reference_evals(plan, log)
        specs = [
            RunSpec(plan, m, sp, sd, gold_ref=refs.get(sp))
            for sp in plan.splits
            for sd in plan.seeds
            for m in plan.methods
        ]
        for spec, (row, history) in zip(
            specs, run_all(specs, jobs=plan.jobs, log=say, desc="bench", progress=plan.progress), strict=True
        ):
            rows.append(row)
            histories[(spec.method, spec.split, spec.seed)] = history
    extra_keys = (
        "status",
        "lr_multiplier",
        "step",
        "scale",
        "Prob_earlier",
        "ROUGE_earlier",
        "HM_all",
        "warnings",
    )
    results = {
        "rows": [
            {k: row.get(k) for k in ROW_KEYS}
            | {k: row[k] for k in extra_keys if row.get(k) not in (None, [])}
            for row in rows
        ],
        "reference": reference_rows,
        "summary": [] if stream else summarise(rows),
        "selection": selection,
        "test_world_seeds": [seed] if (seed := world_seed_of(plan.data_dir)) is not None else [],
        "settings": settings_record(plan.settings)
        | {"methods": plan.methods, "splits": plan.splits, "seeds": plan.seeds, "overrides": plan.overrides}
        | {"lr_scale_applied": plan.lr_scale, "sequential": plan.sequential, "scales": plan.scales},
        "data_dir": str(plan.data_dir),
        "target": str(plan.target),
        "golds": {k: str(v) for k, v in plan.golds.items()},
        "command": plan.command,
        "machine": machine(),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    plots: list[Path] = []
    if stream:
        for key in ("step", "scale"):
            results[f"summary_{key}"] = summarise_stream(rows, key)
        plots = [p for key in ("step", "scale") if (p := plot_stream(plan.out_dir, results, key)) is not None]
    _write_json(plan.out_dir / "results.json", results)
    if not stream:
        plots = write_plots(plan.out_dir, histories, plan.splits)
    (plan.out_dir / "results.md").write_text(render_markdown(results, plots))
    log(f"wrote {plan.out_dir / 'results.json'}, {plan.out_dir / 'results.md'} and {len(plots)} plots")
    return results
