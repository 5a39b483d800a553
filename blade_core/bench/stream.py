"""Stacked requests and larger forget sets: `blade bench --sequential N` and `blade bench --scale 1,2,4`.

Both draw author sets from one forget split of the test world (`BenchSettings.sequential_split`, default
forget10), whose rows come in author blocks of `rows_per_author` (world.json; TOFU's 20). Every request's
retain set is that split's retain complement, which holds none of the drawn authors.

- **sequential**: the split's authors cut into N disjoint groups, forgotten one request after another. LoRA
  methods stack exactly as the service stacks: request k trains a new adapter through `run_unlearning` with
  the adapters of requests 1..k-1 frozen and active underneath (`adapters=`, `blade_core/lora.py`); full-
  parameter methods continue from request k-1's weights. After each request: utility (MU), the current
  group's Prob/ROUGE/HM, every earlier group's Prob/ROUGE (do they stay forgotten?), and HM over all groups
  forgotten so far (`HM_all`).
- **scale**: the forget set is the first `s x base` authors of the split (base = authors // max scale), every
  other setting fixed; each scale is an independent request on the target.

Learning rates are each method's multiplier chosen on the validation world (`blade_core/bench/selection.py`).
No gold model exists for these forget sets, so forget quality is not reported and PrivLeak is relative to
AUC 0.5. Rows carry `step` or `scale`; results.md gets a table per method and a plot of HM against step/scale.

    blade bench --synthetic --quick --sequential 2 --scale 1,2 --out out/bench-stream
"""

from __future__ import annotations

import filecmp
import shutil
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blade_core.bench.cache import _builds, _fingerprint, _preset_of, _read_json, _write_json
from blade_core.bench.models import retain_split, split_paths
from blade_core.bench.one_run import DRAWN, evaluate, load_trained, make_row, split_preset, train
from blade_core.bench.parallel import made
from blade_core.bench.settings import BenchPlan, Log
from blade_core.bench.summary import _fmt, mean_std
from blade_core.build_common import dir_lock
from blade_core.evaluation.metrics import hm_score
from blade_core.evaluation.tofu import forget_block, load_rows, sample_rows
from blade_core.plots import plot_curves

DEFAULT_ROWS_PER_AUTHOR = 20  # TOFU: 20 QA pairs per author
STREAM_KEYS: tuple[str, ...] = (
    "MU",
    "Prob",
    "ROUGE",
    "HM",
    "Prob_earlier",
    "ROUGE_earlier",
    "HM_all",
    "time_s",
)


def author_blocks(data_dir: Path, split: str) -> list[list[dict[str, Any]]]:
    """The split's forget rows cut into one block per author (world.json's rows_per_author, else 20)."""
    forget, _ = split_paths(data_dir, split)
    rows = load_rows(forget, ("question", "answer"))
    info = _read_json(data_dir / "world.json") or {}
    per = int(info.get("rows_per_author") or DEFAULT_ROWS_PER_AUTHOR)
    if len(rows) % per:
        raise ValueError(f"{forget}: {len(rows)} rows are not whole blocks of {per} rows per author")
    return [rows[i : i + per] for i in range(0, len(rows), per)]


def sequential_groups(blocks: list[list[dict[str, Any]]], n: int, split: str) -> list[list[dict[str, Any]]]:
    """N disjoint author groups, as even as possible (earlier groups take the remainder)."""
    if not 1 <= n <= len(blocks):
        raise ValueError(
            f"--sequential {n}: {split} of this world has {len(blocks)} authors; N must be 1..{len(blocks)} "
            "(a larger world: --authors)"
        )
    size, extra = divmod(len(blocks), n)
    groups, start = [], 0
    for k in range(n):
        end = start + size + (1 if k < extra else 0)
        groups.append([row for block in blocks[start:end] for row in block])
        start = end
    return groups


def scaled_sets(blocks: list[list[dict[str, Any]]], scales: Sequence[int], split: str) -> dict[int, list]:
    """scale -> the first scale x base authors' rows, base = authors // max(scales)."""
    base = len(blocks) // max(scales)
    if base < 1 or min(scales) < 1:
        raise ValueError(
            f"--scale {','.join(map(str, scales))}: {split} of this world has {len(blocks)} authors, "
            f"fewer than the largest scale {max(scales)} (a larger world: --authors)"
        )
    return {s: [row for block in blocks[: s * base] for row in block] for s in scales}


def forget_dir(plan: BenchPlan, name: str, rows: list[dict[str, Any]]) -> Path:
    """A TOFU-format dir whose `sequential_split` forget file holds `rows`; every other file the test
    world's (so evaluate_split measures utility, the probes and the holdout as usual). A file that already
    holds what it should is not written again: sequences running side by side share these dirs, which
    `run_sequences` prepares before any starts, so they only read them."""
    split = plan.settings.sequential_split
    out = plan.out_dir / "stream-data" / name
    out.mkdir(parents=True, exist_ok=True)
    for src in plan.data_dir.glob("*.json"):
        if src.name == "world.json" or src.name.startswith("forget"):
            continue
        dst = out / src.name
        if not (dst.is_file() and filecmp.cmp(src, dst, shallow=False)):
            shutil.copyfile(src, dst)
    forget = out / f"{split}_perturbed.json"
    if _read_json(forget) != rows:
        _write_json(forget, rows)
    return out


def group_dirs(plan: BenchPlan, groups: Sequence[list[dict[str, Any]]]) -> list[Path]:
    """`forget_dir` of each request of an N-request sequence."""
    return [forget_dir(plan, f"seq{len(groups)}-g{k + 1}", g) for k, g in enumerate(groups)]


def _earlier_metrics(plan: BenchPlan, model, tokenizer, groups: Sequence[list[dict[str, Any]]]) -> list[dict]:
    """Prob and ROUGE of each earlier group (a seeded sample of at most eval_max_rows rows each)."""
    s = plan.settings
    out = []
    for rows in groups:
        block, _ = forget_block(
            model,
            tokenizer,
            sample_rows(rows, s.eval_max_rows, 0),
            batch_size=s.eval_batch_size,
            max_new_tokens=s.eval_max_new_tokens,
        )
        out.append({"Prob": block["Prob"], "ROUGE": block["ROUGE"], "n": len(rows)})
    return out


def _with_earlier(row: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """The row plus earlier groups' figures and HM over every group so far (row-weighted means)."""
    n_now = row["eval"]["n"].get("forget") or 1
    sets = [*earlier, {"Prob": row["Prob"], "ROUGE": row["ROUGE"], "n": n_now}]
    total = sum(e["n"] for e in sets)
    prob_all = sum(e["Prob"] * e["n"] for e in sets) / total
    rouge_all = sum(e["ROUGE"] * e["n"] for e in sets) / total
    return row | {
        "earlier": earlier,
        "Prob_earlier": statistics.fmean(e["Prob"] for e in earlier) if earlier else None,
        "ROUGE_earlier": statistics.fmean(e["ROUGE"] for e in earlier) if earlier else None,
        "Prob_all": prob_all,
        "ROUGE_all": rouge_all,
        "HM_all": hm_score(row["MU"], prob_all, rouge_all),
    }


def _sequence_root(plan: BenchPlan, method: str, seed: int) -> Path:
    return plan.out_dir / "sequential" / plan.runs_name(method) / f"seed{seed}"


def _sequence_stamp(plan: BenchPlan, method: str, groups: list[list]) -> dict[str, Any]:
    """What a stored sequence (or one request of it) must carry to be reused: its fingerprint and builds."""
    keys: dict[str, Any] = {"sequential": len(groups), **_preset_of(method, DRAWN)}
    return {
        "fingerprint": _fingerprint(plan, method, **keys),
        "builds": _builds(plan, plan.settings.sequential_split),
    }


def _stamped(stored: dict[str, Any], stamp: dict[str, Any]) -> bool:
    return all(stored.get(key) == value for key, value in stamp.items())


def cached_sequence(
    plan: BenchPlan, method: str, seed: int, groups: list[list]
) -> list[dict[str, Any]] | None:
    """The rows `run_sequence` stored for these arguments, or None."""
    cached = _read_json(_sequence_root(plan, method, seed) / "rows.json") or {}
    return list(cached["rows"]) if _stamped(cached, _sequence_stamp(plan, method, groups)) else None


def run_sequence(
    plan: BenchPlan, method: str, seed: int, groups: list[list], log: Log
) -> list[dict[str, Any]]:
    """N stacked requests of one method and seed; one row per step (cached as a whole sequence, and request
    by request so an interrupted sequence continues after its last finished request; another bench on the
    same --out making it meanwhile is waited for: `cache.fresh_run`)."""
    with dir_lock(_sequence_root(plan, method, seed)):
        cached = cached_sequence(plan, method, seed, groups)
        return cached if cached is not None else _stacked_afresh(plan, method, seed, groups, log)


def _finished_requests(
    root: Path, stamp: dict[str, Any], n: int
) -> tuple[list[dict[str, Any]], list[Path], Path | None]:
    """What an interrupted `_stacked_afresh` left to continue from: the rows of requests 1..j, each stored
    with this sequence's `stamp` (fingerprint and builds), and what request j+1 trains on (the adapters of
    1..j, or request j's full model). Nothing ([], [], None) when that is no longer on disk."""
    rows: list[dict[str, Any]] = []
    outputs: list[Path] = []
    for k in range(1, n + 1):
        stored = _read_json(root / f"step{k}" / "row.json") or {}
        if not _stamped(stored, stamp):
            break
        rows.append(stored["row"])
        outputs.append(root / f"step{k}" / "model")
    if not rows:
        return [], [], None
    full = (_read_json(outputs[-1] / "run.json") or {}).get("full_model")
    needed = outputs[-1:] if full else outputs  # a full model's predecessors are deleted as it is saved
    if full is None or not all((d / "run.json").is_file() for d in needed):
        return [], [], None
    return (rows, [], outputs[-1]) if full else (rows, outputs, None)


def _stacked_afresh(
    plan: BenchPlan, method: str, seed: int, groups: list[list], log: Log
) -> list[dict[str, Any]]:
    """`run_sequence`'s requests, made one after another (from the first one an interrupted invocation did
    not finish) and cached."""
    split = plan.settings.sequential_split
    root = _sequence_root(plan, method, seed)
    stamp = _sequence_stamp(plan, method, groups)
    _, retain = split_paths(plan.data_dir, split)
    dirs = group_dirs(plan, groups)
    rows, stack, model_dir = _finished_requests(root, stamp, len(dirs))
    if rows:
        log(f"{method} seed {seed}: continuing an interrupted sequence after request {len(rows)}/{len(dirs)}")
    for k, group_dir in enumerate(dirs[len(rows) :], start=len(rows) + 1):
        work = root / f"step{k}"
        shutil.rmtree(work, ignore_errors=True)
        trained = train(
            plan,
            method,
            seed,
            forget=group_dir / f"{split}_perturbed.json",
            retain=retain,
            work=work / "model",
            model=model_dir,
            adapters=stack,
            preset=split_preset(method, DRAWN),
            log=log,
            label=f"{method} seed {seed} LR x{plan.multipliers.get(method, 1.0):g} request {k}/{len(dirs)}",
        )
        model, tokenizer = load_trained(plan, trained, base=model_dir, stack=stack)
        metrics = evaluate(plan, model, tokenizer, split, None, data_dir=group_dir)
        earlier = _earlier_metrics(plan, model, tokenizer, groups[: k - 1])
        del model
        row = _with_earlier(make_row(method, split, seed, trained, metrics), earlier) | {"step": k}
        rows.append(row)
        _write_json(work / "history.json", trained.out.history)
        shutil.copyfile(trained.out.adapter_dir / "run.json", work / "run.json")  # outlives a full model dir
        _write_json(work / "row.json", stamp | {"row": row})  # before the predecessor's model goes, below
        log(
            f"{method:>11} sequential step {k}/{len(groups)} seed {seed} LR x{row['lr_multiplier']:g}: "
            f"MU {_fmt(row['MU'])} "
            f"Prob {_fmt(row['Prob'])} earlier Prob {_fmt(row['Prob_earlier'])} HM {_fmt(row['HM'])} "
            f"HM_all {_fmt(row['HM_all'])}"
        )
        if trained.out.full_model:  # the next request continues from these weights
            if model_dir is not None:
                shutil.rmtree(model_dir, ignore_errors=True)
            model_dir = trained.out.adapter_dir
        else:  # the next request trains on top of this adapter, frozen and active
            stack = [*stack, trained.out.adapter_dir]
    _write_json(root / "rows.json", stamp | {"rows": rows})
    if model_dir is not None:
        shutil.rmtree(model_dir, ignore_errors=True)
    return rows


@dataclass(frozen=True)
class SequenceSpec:
    """One method's stacked requests at one seed: `run_sequence`'s arguments."""

    plan: BenchPlan
    method: str
    seed: int
    groups: list[list[dict[str, Any]]]  # each request's forget rows, in order

    @property
    def label(self) -> str:
        x = self.plan.multipliers.get(self.method, 1.0)
        return f"{self.method} x{x:g}, {len(self.groups)} requests, seed {self.seed}"


def run_sequences(
    specs: Sequence[SequenceSpec], *, jobs: int, log: Log, desc: str, progress: bool
) -> list[list[dict[str, Any]]]:
    """Each spec's rows, in the order of `specs`, made (or reused) by up to `jobs` processes (parallel.py):
    one sequence's requests in order in one process, sequences side by side. Their shared data dirs are
    written here first, so no two processes write one."""
    for plan, groups in {(id(s.plan), id(s.groups)): (s.plan, s.groups) for s in specs}.values():
        group_dirs(plan, groups)
    return made(specs, _cached, _made_afresh, jobs=jobs, log=log, desc=desc, progress=progress)


def _cached(spec: SequenceSpec) -> list[dict[str, Any]] | None:
    return cached_sequence(spec.plan, spec.method, spec.seed, spec.groups)


def _made_afresh(spec: SequenceSpec, log: Log) -> list[dict[str, Any]]:
    return run_sequence(spec.plan, spec.method, spec.seed, spec.groups, log)


def run_scale(plan: BenchPlan, method: str, seed: int, scale: int, rows: list, log: Log) -> dict[str, Any]:
    """One request on the target with the scale's forget set (cached; locked as `cache.fresh_run`)."""
    root = plan.out_dir / "scale" / plan.runs_name(method) / f"seed{seed}" / f"x{scale}"
    with dir_lock(root):
        split = plan.settings.sequential_split
        keys: dict[str, Any] = {"scale": scale, "scales": sorted(plan.scales), **_preset_of(method, DRAWN)}
        fingerprint = _fingerprint(plan, method, **keys)
        cached = _read_json(root / "row.json")
        builds = _builds(plan, split)
        if cached and cached.get("fingerprint") == fingerprint and cached.get("builds") == builds:
            return cached["row"]
        data = forget_dir(plan, f"scale{max(plan.scales)}-x{scale}", rows)
        _, retain = split_paths(plan.data_dir, split)
        trained = train(
            plan,
            method,
            seed,
            forget=data / f"{split}_perturbed.json",
            retain=retain,
            work=root / "model",
            preset=split_preset(method, DRAWN),
            log=log,
            label=f"{method} seed {seed} scale x{scale}",
        )
        model, tokenizer = load_trained(plan, trained)
        metrics = evaluate(plan, model, tokenizer, split, None, data_dir=data)
        del model
        shutil.rmtree(root / "model", ignore_errors=True)
        row = make_row(method, split, seed, trained, metrics) | {"scale": scale, "HM_all": metrics["HM"]}
        _write_json(root / "history.json", trained.out.history)
        _write_json(root / "row.json", {"fingerprint": fingerprint, "builds": builds, "row": row})
        log(
            f"{method:>11} scale x{scale} seed {seed}: MU {_fmt(row['MU'])} Prob {_fmt(row['Prob'])} "
            f"HM {_fmt(row['HM'])}"
        )
        return row


def run_streams(plan: BenchPlan, log: Log) -> list[dict[str, Any]]:
    """Every method and seed through the sequential and/or scaled experiments; their rows."""
    split = plan.settings.sequential_split
    retain_split(split)  # validates the name
    blocks = author_blocks(plan.data_dir, split)
    rows: list[dict[str, Any]] = []
    if plan.sequential:
        groups = sequential_groups(blocks, plan.sequential, split)
        specs = [SequenceSpec(plan, method, seed, groups) for seed in plan.seeds for method in plan.methods]
        for sequence in run_sequences(
            specs, jobs=plan.jobs, log=log, desc="sequential", progress=plan.progress
        ):
            rows += sequence
    if plan.scales:
        sets = scaled_sets(blocks, plan.scales, split)
        for seed in plan.seeds:
            for method in plan.methods:
                rows += [run_scale(plan, method, seed, s, sets[s], log) for s in sorted(plan.scales)]
    return rows


# --- tables and plots ---------------------------------------------------------------------------------------


def summarise_stream(rows: Sequence[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Mean and std over seeds of STREAM_KEYS per (method, step) or (method, scale)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get(key) is not None:
            groups.setdefault((row["method"], int(row[key])), []).append(row)
    out = []
    for (method, value), group in groups.items():
        entry: dict[str, Any] = {"method": method, key: value, "n": len(group)}
        for k in STREAM_KEYS:
            mean, std = mean_std([float(r[k]) for r in group if isinstance(r.get(k), (int, float))])
            entry[k] = {"mean": mean, "std": std}
        out.append(entry)
    return out


def _pm(cell: dict[str, Any] | None) -> str:
    if not cell or cell.get("mean") is None:
        return "n/a"
    return f"{cell['mean']:.2f} ± {cell['std']:.2f}"


def render_stream(results: dict[str, Any], key: str, plot: Path | None) -> list[str]:
    """results.md lines of one experiment ('step' or 'scale'): a table per method, then the HM plot."""
    summary = [e for e in results.get(f"summary_{key}", [])]
    if not summary:
        return []
    title = (
        "Sequential requests: after request k, utility, the current forget set, the earlier ones, HM over all"
        if key == "step"
        else "Forget-set scale: the forget set multiplied (more authors), everything else fixed"
    )
    lines = ["", f"## {title}", ""]
    columns = ("MU", "Prob", "ROUGE", "HM") + (
        ("Prob_earlier", "ROUGE_earlier", "HM_all") if key == "step" else ()
    )
    for method in results["settings"]["methods"]:
        entries = sorted((e for e in summary if e["method"] == method), key=lambda e: e[key])
        if not entries:
            continue
        lines += [
            f"### {method}",
            "",
            f"| {key} | " + " | ".join(columns) + " |",
            "|" + "---|" * (1 + len(columns)),
        ]
        lines += [f"| {e[key]} | " + " | ".join(_pm(e[c]) for c in columns) + " |" for e in entries]
        lines.append("")
    if plot is not None:
        lines.append(f"![{plot.stem}]({plot.name})")
    return lines


def plot_stream(out_dir: Path, results: dict[str, Any], key: str) -> Path | None:
    """hm_<key>.png: HM (mean ± std over seeds) against step or scale, one line per method."""
    summary = results.get(f"summary_{key}", [])
    if not summary:
        return None
    metric = "HM_all" if key == "step" else "HM"
    curves = {}
    for method in results["settings"]["methods"]:
        entries = sorted((e for e in summary if e["method"] == method), key=lambda e: e[key])
        points = [
            (e[key], e[metric]["mean"], e[metric]["std"]) for e in entries if e[metric]["mean"] is not None
        ]
        if points:
            curves[method] = points
    label = "request (step)" if key == "step" else "forget-set scale"
    ylabel = "HM over every forget set so far" if key == "step" else "HM"
    return plot_curves(
        curves, out_dir / f"hm_{key}.png", xlabel=label, ylabel=ylabel, title=f"HM against {label}"
    )
