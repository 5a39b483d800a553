"""`blade bench --suite muse|knowundo`: the eight methods on a MUSE-style text world, MUSE's metrics.

The QA bench's protocol (`blade_core/bench/`) on text: one target model (`blade_core/text_build.py`,
pretrained base fine-tuned on forget + retain text) and its retrained model (retain only), every method
trained by `run_unlearning` from the target on the forget texts with the retain texts, BLADE with the suite's
preset (`muse` or `knowundo`: eta_out 3e-5, eps_mul 3.2, LoRA 16/32, T 250 / 150, patience 20) and every
baseline with its published schedule; learning rates by the engine's rule (`blade_core/lr_scale.py`) times a
per-method multiplier chosen on a validation world (its own seed, never reported) by the best HM. Each run is
scored with `blade_core.evaluation.muse`: VerbMem, KnowMem forget / retain, PrivLeak against the retrained
model's Min-K% AUC, HM = hmean(1 - KnowMem_f, 1 - VerbMem_f, KnowMem_r) and, for `knowundo`, the
KnowUndo-style HM = hmean(1 - forget ROUGE, retain ROUGE, general utility).

Departures: MUSE's corpora are replaced by `blade_core/text_world.py`'s (News for `muse`, Books for
`knowundo`; `--kind` picks another); KnowMem is asked zero-shot, because a model of a few M parameters answers
far worse after few-shot examples than without (MUSE's ICL files are written to the world dir and the service
uses them when a request names them); `--quick` skips the validation world (every multiplier 1), caps every
method at a common step count, evaluates at most 20 probes per set and runs one seed. `--sequential N`
(News) unlearns the forget set in N stacked requests, evaluating after each (the paper's sustainability test).

    blade bench --suite muse --quick --out out/bench-muse-quick
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from blade_core.bench.selection import beyond_edge, choose
from blade_core.build_common import dir_lock
from blade_core.evaluation.muse import min_k_auc, muse_eval
from blade_core.lora import load_with_stack
from blade_core.methods import METHOD_NAMES, get_method
from blade_core.modeling import pick_device
from blade_core.text_build import build_text_model
from blade_core.text_world import holds_text_world, read_world, write_text_world
from blade_core.unlearn import config_fields, run_unlearning

SUITES: dict[str, dict[str, str]] = {  # suite -> BLADE's preset and the default world kind
    "muse": {"preset": "muse", "kind": "news"},
    "knowundo": {"preset": "knowundo", "kind": "books"},
}
ROW_KEYS = ("method", "seed", "verbmem_f", "knowmem_f", "knowmem_r", "privleak", "HM", "steps", "time_s")


@dataclass(frozen=True)
class TextBenchSettings:
    """What a text bench holds fixed across methods; `quick` and `default` presets in PRESETS."""

    model_size: str = "quick"  # `blade_core.text_build` size of target and retrained models
    docs: int | None = None  # world size (text_world.DEFAULT_DOCS when None)
    max_steps: int | None = None  # None: each method's own schedule / BLADE's cap; an int: a common cap
    max_length: int = 256  # tokens per row, every method
    seeds: int = 3
    lr_grid: tuple[float, ...] = (0.25, 1.0, 4.0)  # multipliers tried on the validation world
    lr_grid_extend: int = (
        2  # points tried past either edge of lr_grid when the best sits on it (selection.py)
    )
    select: bool = True  # False: every multiplier 1 (no validation world)
    eval_max_rows: int | None = None  # probes per KnowMem set (None: all)
    world_seed: int = 0
    validation_seed: int = 1


PRESETS: dict[str, TextBenchSettings] = {
    "default": TextBenchSettings(),
    # Under 15 minutes on 2 CPU cores once the base is cached: no selection, one seed, a common step cap.
    "quick": TextBenchSettings(docs=30, max_steps=20, seeds=1, select=False, eval_max_rows=20),
}


@dataclass
class World:
    data: Path
    target: Path
    retrained: Path
    texts: dict[str, Any]
    auc_retrain: float


def prepare_world(cache: Path, kind: str, seed: int, settings: TextBenchSettings, log) -> World:
    """The text world of `seed`, its target and retrained models (cached), and the retrained model's AUC."""
    data = cache / f"{kind}-{settings.docs or 'd'}-seed{seed}"
    with dir_lock(data):  # benches on one cache: one writer, no torn reads
        if not holds_text_world(data, kind, settings.docs, seed):
            write_text_world(data, kind, settings.docs, seed)
    models = {}
    for name, retrained in (("target", False), ("retrained", True)):
        result = build_text_model(
            data,
            cache / f"{data.name}-{settings.model_size}-{name}",
            size=settings.model_size,
            retrained=retrained,
            cache_dir=cache / "build-cache",  # the QA bench's: one pretrained base for both
            progress=False,
            log=log,
        )
        models[name] = result.model_dir
    texts = read_world(data)
    model, tokenizer = load_with_stack(models["retrained"], (), pick_device())
    auc = min_k_auc(model, tokenizer, texts["forget"], texts["holdout"])
    return World(data, models["target"], models["retrained"], texts, auc)


def evaluate(model, tokenizer, world: World, settings: TextBenchSettings, suite: str) -> dict[str, Any]:
    """MUSE's metrics (and KnowUndo's HM for that suite) of one model on the world."""

    def cap(rows: list[dict[str, str]]) -> list[dict[str, str]]:
        n = settings.eval_max_rows
        return rows if n is None or len(rows) <= n else random.Random(0).sample(rows, n)

    t = world.texts
    return muse_eval(
        model,
        tokenizer,
        forget_texts=t["forget"],
        forget_qa=cap(t["forget_qa"]),
        retain_qa=cap(t["retain_qa"]),
        holdout_texts=t["holdout"],
        auc_retrain=world.auc_retrain,
        general_qa=cap(t["general_qa"]) if suite == "knowundo" else (),
    )


def run_method(
    method: str,
    world: World,
    settings: TextBenchSettings,
    suite: str,
    seed: int,
    work: Path,
    *,
    multiplier: float = 1.0,
    forget: Path | None = None,
    adapters: list[Path] | None = None,
) -> tuple[dict[str, Any], Any]:
    """Train one method (BLADE with the suite's preset) and score it; (row, run output)."""
    known = config_fields(get_method(method).config_class)
    overrides = {
        k: v for k, v in {"max_length": settings.max_length, "show_progress": False}.items() if k in known
    }
    started = time.perf_counter()
    out = run_unlearning(
        model=world.target,
        forget=forget or world.data / "forget.jsonl",
        retain=world.data / "retain.jsonl",
        out_dir=work,
        method=method,
        preset=SUITES[suite]["preset"] if method == "blade" else None,
        adapters=adapters or [],
        overrides=overrides,
        max_steps=settings.max_steps,
        seed=seed,
        device=str(pick_device()),
        lr_multiplier=multiplier,
    )
    elapsed = time.perf_counter() - started
    if out.full_model:
        model, tokenizer = load_with_stack(out.adapter_dir, (), pick_device())
    else:
        model, tokenizer = load_with_stack(world.target, [*(adapters or []), out.adapter_dir], pick_device())
    metrics = evaluate(model, tokenizer, world, settings, suite)
    row = {"method": method, "seed": seed, **metrics, "steps": len(out.history), "time_s": round(elapsed, 1)}
    row["status"] = str(out.status)
    return row, out


def _score(row: dict[str, Any], suite: str) -> float:
    value = row.get("HM_knowundo" if suite == "knowundo" else "HM")
    return -1.0 if value is None or value != value else float(value)


def collapsed(row: dict[str, Any], suite: str) -> bool:
    """The run left the model no utility (so HM is 0 whatever it forgot): retain KnowMem 0, or for
    `knowundo` also general utility 0; the selection's collapse rule (`selection.beyond_edge(collapsed=)`)."""
    keys = ("knowmem_r", "general") if suite == "knowundo" else ("knowmem_r",)
    return any(isinstance(row.get(k), (int, float)) and row[k] <= 0.0 for k in keys)


def select_multipliers(cache, out, kind, suite, settings, methods, log) -> dict[str, Any]:
    """Per method, the LR multiplier with the best HM on the validation world (never the reported one), by
    the QA bench's rule (`selection.choose`, `selection.beyond_edge`, its collapse rule included)."""
    if not settings.select:
        return {"chosen": dict.fromkeys(methods, 1.0), "validation_hm": {}, "grid": [1.0]}
    world = prepare_world(cache, kind, settings.validation_seed, settings, log)
    chosen: dict[str, float] = {}
    scores: dict[str, dict[float, float]] = {}
    dead: dict[str, set[float]] = {}
    for method in methods:
        scores[method], dead[method] = {}, set()
        todo: list[float] = list(settings.lr_grid)
        while todo:
            for m in todo:
                row, _ = run_method(
                    method, world, settings, suite, 0, out / "selection" / method / f"x{m:g}", multiplier=m
                )
                scores[method][m] = _score(row, suite)
                if collapsed(row, suite):
                    dead[method].add(m)
                log(f"[select] {method} x{m:g}: HM {scores[method][m]:.3f}")
            beyond = beyond_edge(
                scores[method], settings.lr_grid, settings.lr_grid_extend, collapsed=dead[method]
            )
            todo = [beyond] if beyond is not None else []
        chosen[method] = choose(scores[method])
    return {
        "chosen": chosen,
        "validation_hm": scores,
        "grid": list(settings.lr_grid),
        "extended": {m: sorted(set(by) - set(settings.lr_grid)) for m, by in scores.items()},
        "collapsed": {m: sorted(by) for m, by in dead.items() if by},
        "world_seed": settings.validation_seed,
    }


def run_sequential(
    world, settings, suite, methods, chosen, steps: int, out: Path, log
) -> list[dict[str, Any]]:
    """The forget texts in `steps` equal parts, each unlearned on top of the previous adapters."""
    texts = world.texts["forget"]
    if steps > len(texts):
        raise ValueError(f"--sequential {steps}: the forget set has only {len(texts)} texts")
    parts = [texts[i::steps] for i in range(steps)]
    rows = []
    for method in methods:
        adapters: list[Path] = []
        for k, part in enumerate(parts, start=1):
            path = out / "sequential" / method / f"forget{k}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
            work = out / "sequential" / method / f"step{k}"
            row, run = run_method(
                method,
                world,
                settings,
                suite,
                0,
                work,
                multiplier=chosen.get(method, 1.0),
                forget=path,
                adapters=adapters,
            )
            row["step"] = k
            rows.append(row)
            log(f"[sequential] {method} step {k}: HM {row.get('HM')}")
            if run.full_model:
                break  # a full-parameter baseline cannot stack: its later steps would start from the target
            adapters.append(run.adapter_dir)
    return rows


def run_text_bench(
    *,
    suite: str,
    out: Path,
    cache: Path,
    quick: bool,
    methods: list[str] | None = None,
    kind: str | None = None,
    sequential: int = 0,
    log=print,
    **changes: Any,
) -> dict[str, Any]:
    """The suite's bench; writes results.json, results.md and hm.png into `out` and returns the results."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {', '.join(SUITES)}, got {suite!r}")
    settings = replace(
        PRESETS["quick" if quick else "default"], **{k: v for k, v in changes.items() if v is not None}
    )
    kind = kind or SUITES[suite]["kind"]
    methods = methods or list(METHOD_NAMES)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    selection = select_multipliers(cache, out, kind, suite, settings, methods, log)
    world = prepare_world(cache, kind, settings.world_seed, settings, log)
    reference = []
    for name, model_dir in (("target", world.target), ("retrained", world.retrained)):
        model, tokenizer = load_with_stack(model_dir, (), pick_device())
        reference.append({"method": name, **evaluate(model, tokenizer, world, settings, suite)})
    rows = []
    for seed in range(settings.seeds):
        for method in methods:
            work = out / "runs" / method / f"seed{seed}"
            multiplier = selection["chosen"].get(method, 1.0)
            row, _ = run_method(method, world, settings, suite, seed, work, multiplier=multiplier)
            rows.append(row)
            log(f"[{suite}] {method} seed {seed}: HM {row.get('HM')}, {row['time_s']} s")
    seq_rows = (
        run_sequential(world, settings, suite, methods, selection["chosen"], sequential, out, log)
        if sequential
        else []
    )
    results = {
        "suite": suite,
        "kind": kind,
        "settings": asdict(settings),
        "selection": selection,
        "auc_retrain": world.auc_retrain,
        "reference": reference,
        "rows": rows,
        "sequential": seq_rows,
        "time_s": round(time.perf_counter() - started, 1),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    plot = write_plot(results, out / "hm.png")
    (out / "results.md").write_text(render_markdown(results, plot))
    return results


def _f(value: Any, digits: int = 3) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def render_markdown(results: dict[str, Any], plot: Path | None = None) -> str:
    """A MUSE-shaped table: VerbMem, KnowMem forget / retain, PrivLeak, HM per method (mean over seeds)."""
    suite = results["suite"]
    extra = suite == "knowundo"
    head = "| method | VerbMem_f ↓ | KnowMem_f ↓ | KnowMem_r ↑ | PrivLeak (→0) | HM ↑ |"
    head += " general ↑ | HM_KnowUndo ↑ |" if extra else ""
    lines = [f"### {suite} suite ({results['kind']} world)", "", head, "|" + "---|" * (head.count("|") - 1)]
    by_method: dict[str, list[dict[str, Any]]] = {}
    for row in results["reference"] + results["rows"]:
        by_method.setdefault(row["method"], []).append(row)

    def mean(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None and r[key] == r[key]]
        return sum(values) / len(values) if values else None

    for method, rows in by_method.items():
        cells = [mean(rows, k) for k in ("verbmem_f", "knowmem_f", "knowmem_r")]
        line = (
            f"| {method} | "
            + " | ".join(_f(c) for c in cells)
            + f" | {_f(mean(rows, 'privleak'), 1)} | {_f(mean(rows, 'HM'))} |"
        )
        if extra:
            line += f" {_f(mean(rows, 'general'))} | {_f(mean(rows, 'HM_knowundo'))} |"
        lines.append(line)
    if results["sequential"]:
        lines += [
            "",
            "Sequential (each step unlearns the next part of the forget set on top of the previous ones):",
            "",
        ]
        lines += ["| method | step | VerbMem_f | KnowMem_f | KnowMem_r | HM |", "|---|---|---|---|---|---|"]
        for r in results["sequential"]:
            row = " | ".join(_f(r.get(k)) for k in ("verbmem_f", "knowmem_f", "knowmem_r", "HM"))
            lines.append(f"| {r['method']} | {r['step']} | {row} |")
    if plot is not None:
        lines += ["", f"![HM per method]({plot.name})"]
    lines += [
        "",
        f"Settings: {json.dumps(results['settings'])}; "
        f"multipliers {json.dumps(results['selection']['chosen'])}; "
        f"retrained AUC {results['auc_retrain']:.3f}; {results['time_s']} s in all.",
    ]
    return "\n".join(lines) + "\n"


def write_plot(results: dict[str, Any], path: Path) -> Path | None:
    """Bars of each method's HM (and VerbMem / KnowMem), PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = results["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    keys = ("verbmem_f", "knowmem_f", "knowmem_r", "HM")
    fig, ax = plt.subplots(figsize=(9, 3.5))
    width = 0.2
    for i, key in enumerate(keys):
        values = []
        for m in methods:
            vs = [r[key] for r in rows if r["method"] == m and r.get(key) is not None and r[key] == r[key]]
            values.append(sum(vs) / len(vs) if vs else 0.0)
        ax.bar([j + i * width for j in range(len(methods))], values, width, label=key)
    ax.set_xticks([j + 1.5 * width for j in range(len(methods))], methods, rotation=20)
    ax.set_ylim(0, 1)
    ax.legend(ncol=4, fontsize=8)
    ax.set_title(f"{results['suite']} suite ({results['kind']} world)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
