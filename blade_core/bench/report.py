"""results.md and its plots: Table 1 (MU, Prob, ROUGE, HM as mean ± std per split), forget quality, PrivLeak,
time and memory, the learning-rate selection, the best HM per split, and the training-dynamics PNGs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blade_core.bench.settings import DYNAMICS_METHODS
from blade_core.bench.stream import render_stream
from blade_core.bench.summary import _fmt
from blade_core.plots import plot_dynamics
from blade_core.tofu_reference import comparison_row, render_comparison


def _pm(cell: dict[str, Any] | None, digits: int = 2) -> str:
    if not cell or cell.get("mean") is None:
        return "n/a"
    return f"{cell['mean']:.{digits}f} ± {cell['std']:.{digits}f}"


def _fq(cell: dict[str, Any] | None) -> str:
    if not cell or cell.get("mean") is None:
        return "n/a"
    fmt = ".2e" if cell["mean"] < 0.01 else ".3f"
    return f"{cell['mean']:{fmt}} ± {cell['std']:{fmt}}"


def _provenance(results: dict[str, Any]) -> list[str]:
    """The command and machine behind a results.json; for a `blade bench-merge` of several invocations, how
    many it joined and each kind of CPU they ran on (every command is in `sources`)."""
    if "sources" not in results:
        return [f"Command: `{results.get('command', '')}`  ", f"Machine: {results['machine']['summary']}  "]
    sources = results["sources"]  # records: `merge._sources` turned an older merge's bare commands into them
    machines = [results["machine"], *(s["machine"] for s in sources if "machine" in s)]
    kinds = dict.fromkeys(f"{m.get('summary', '?')}, CPU kind {m.get('cpu_identity', '?')}" for m in machines)
    lines = [
        f"Joined by `blade bench-merge` from {len(sources)} invocations (commands: results.json `sources`)  ",
        f"Machines: {'; '.join(kinds)}  ",
    ]
    if replaced := results.get("replaced"):
        runs = ", ".join(f"{r['method']} seed {r['seed']}" for r in replaced)
        lines.append(f"Re-run, replacing an earlier input's rows (results.json `replaced`): {runs}  ")
    return lines


def render_markdown(results: dict[str, Any], plots: Sequence[Path] = ()) -> str:
    """results.md: Table 1 (MU, Prob, ROUGE, HM as mean ± std per split), then forget quality, PrivLeak, time
    and memory per split, the best HM per split, and the plots."""
    summary = {(e["method"], e["split"]): e for e in results["summary"]}
    splits = results["settings"]["splits"]
    methods = results["settings"]["methods"]
    seeds = results["settings"]["seeds"]
    reference = {(r["model"], r["split"]): r for r in results.get("reference", [])}
    lines = ["# Benchmark results", ""]
    s = results["settings"]
    steps = (
        f"every method capped at {s['max_steps']} steps (a cap: never more than its own schedule)"
        if s.get("max_steps")
        else "every method on its published schedule (baselines: 10 epochs at batch 32; BLADE: to its "
        "convergence stop under its cap)"
    )
    batch = f"batch {s['batch_size']}" if s.get("batch_size") else "each method's published batch"
    test_seeds = results.get("test_world_seeds") or ["n/a"]
    shape = f"{len(methods)} methods x {len(splits)} splits x {len(seeds)} seeds"
    if s.get("sequential") or s.get("scales"):
        shape = (
            f"{len(methods)} methods x {len(seeds)} seeds on {s.get('sequential_split')}'s authors: "
            + " and ".join(
                ([f"{s['sequential']} sequential requests"] if s.get("sequential") else [])
                + ([f"forget-set scales {', '.join(map(str, s['scales']))}"] if s.get("scales") else [])
            )
        )
    lines += [
        f"{shape} (seeds {', '.join(map(str, seeds))}), "
        f"mean ± std over seeds; {steps}; {batch}, max length {s['max_length']}; "
        f"evaluation on at most {s['eval_max_rows'] or 'all'} rows per set, "
        f"{s['eval_max_new_tokens']} generated tokens. Test world seed: {', '.join(map(str, test_seeds))}.",
        "",
        *_provenance(results),
        f"Wall time: {results['wall_s'] / 60:.1f} min",
        "",
    ]
    lines += render_selection(results.get("selection"), s.get("lr_scale_applied"))
    if s.get("sequential") or s.get("scales"):
        by_name = {p.stem: p for p in plots}
        for key in ("step", "scale"):
            lines += render_stream(results, key, by_name.get(f"hm_{key}"))
        return "\n".join(lines + _forgot_nothing(results)) + "\n"

    lines += [
        "## Table 1: utility (MU, higher is better), forget Prob and ROUGE (lower is better), "
        "HM = hmean(MU, 1-Prob, 1-ROUGE) (higher is better)",
        "",
    ]
    header = (
        "| Method | " + " | ".join(f"{sp} {m}" for sp in splits for m in ("MU", "Prob", "ROUGE", "HM")) + " |"
    )
    lines += [header, "|" + "---|" * (1 + 4 * len(splits))]
    for name, label in (("target", "Target (before unlearning)"), ("gold", "Retrained (gold)")):
        if any((name, sp) in reference for sp in splits):
            cells = []
            for sp in splits:
                r = reference.get((name, sp), {})
                cells += [_fmt(r.get(k)) for k in ("MU", "Prob", "ROUGE", "HM")]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    best = {
        sp: max(methods, key=lambda m: (summary.get((m, sp), {}).get("HM") or {}).get("mean") or -1)
        for sp in splits
    }
    for method in methods:
        cells = []
        for sp in splits:
            e = summary.get((method, sp), {})
            for key in ("MU", "Prob", "ROUGE", "HM"):
                text = _pm(e.get(key))
                cells.append(f"**{text}**" if key == "HM" and best[sp] == method and text != "n/a" else text)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    if reference:
        lines += ["", "## The target and gold models beside TOFU's published Llama targets", ""]
        lines.append(
            render_comparison(r.get("tofu") or comparison_row(*key, r) for key, r in reference.items())
        )
    lines += [
        "",
        "## Forget quality (KS p-value vs the gold model, higher is better), PrivLeak (Min-K%, "
        "relative to the gold model, closer to 0 is better), training time and peak memory",
        "",
    ]
    header = (
        "| Method | "
        + " | ".join(f"{sp} {m}" for sp in splits for m in ("FQ", "PrivLeak", "time s", "steps", "mem MB"))
        + " |"
    )
    lines += [header, "|" + "---|" * (1 + 5 * len(splits))]
    for method in methods:
        cells = []
        for sp in splits:
            e = summary.get((method, sp), {})
            cells += [
                _fq(e.get("forget_quality")),
                _pm(e.get("privleak"), 1),
                _pm(e.get("time_s"), 1),
                _pm(e.get("steps"), 0),
                _pm(e.get("peak_mem_mb"), 0),
            ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "## Best HM per split", ""]
    for sp in splits:
        hm = {m: summary.get((m, sp), {}).get("HM") or {} for m in methods}
        ranked = sorted(
            ((c["mean"], c.get("std") or 0.0, m) for m, c in hm.items() if c.get("mean") is not None)
        )
        lines.append(f"- {sp}: " + ", ".join(f"{m} {v:.3f} ± {sd:.3f}" for v, sd, m in ranked[::-1]))
    statuses = [
        f"{e['method']} {e['split']}: {', '.join(e['statuses'])}"
        for e in results["summary"]
        if set(e["statuses"]) - {"max_steps", "converged"}
    ]
    if statuses:
        lines += ["", "Runs that ended otherwise than max_steps/converged: " + "; ".join(statuses)]
    lines += _forgot_nothing(results)
    if plots:
        lines += ["", "## Training dynamics", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _forgot_nothing(results: dict[str, Any]) -> list[str]:
    """results.md lines naming the runs whose forget Prob was essentially unchanged (forget_check.py)."""
    runs = [
        f"{r['method']} {r['split']} seed {r['seed']}" + (f" step {r['step']}" if r.get("step") else "")
        for r in results["rows"]
        if r.get("warnings")
    ]
    if not runs:
        return []
    return [
        "",
        "**Warning**: forget Prob essentially unchanged (|delta| < 0.02) in: " + "; ".join(runs) + ".",
    ]


def render_selection(selection: dict[str, Any] | None, factor: float | None) -> list[str]:
    """results.md's learning-rate section: the rule, the grid, each method's validation HM and choice."""
    rule = (
        f"Learning rates: the engine's rule (blade_core/lr_scale.py): Adam LRs = published x "
        f"{_fmt(factor, 0)} (the target's training LR over TOFU's 1e-5), BLADE's inner SGD LR the published "
        "2e-4 (not an Adam LR: unscaled); then each method's multiplier below."
    )
    if not selection:
        return [rule, ""]
    if selection.get("skipped"):
        return [rule, "", f"No selection: {selection['skipped']}.", ""]
    # the grid, plus any point the edge rule tried for some method ("" in the others' cells)
    tried = {float(m) for hms in selection["validation_hm"].values() for m in hms}
    grid = [f"{m:g}" for m in sorted(tried | {float(m) for m in selection["grid"]})]
    lines = [
        rule,
        "",
        "## Learning-rate multipliers chosen on the validation world",
        "",
        f"Validation world seed {selection['world_seed']} (never reported), split {selection.get('split')}, "
        f"{_selection_seeds(selection)}; the same grid and rule for every method; "
        f"{selection.get('rule', '')}.",
        "",
        "| Method | chosen | " + " | ".join(f"HM at x{g}" for g in grid) + " |",
        "|" + "---|" * (2 + len(grid)),
    ]
    for method, chosen in selection["chosen"].items():
        hms = selection["validation_hm"].get(method, {})
        cells = [
            "" if g not in hms else f"**{_fmt(hms[g], 3)}**" if float(g) == chosen else _fmt(hms[g], 3)
            for g in grid
        ]
        lines.append(f"| {method} | x{chosen:g} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _selection_seeds(selection: dict[str, Any]) -> str:
    """'seed 42', or 'seeds 42, 123, 456 (HM: their mean)' for a selection over several (older results.json
    files name one `seed`)."""
    seeds = selection.get("seeds") or [selection.get("seed")]
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {', '.join(map(str, seeds))} (HM: their mean)"


def write_plots(
    out_dir: Path, histories: dict[tuple[str, str, int], list[dict[str, Any]]], splits: Sequence[str]
) -> list[Path]:
    """dynamics_<method>_<split>.png for BLADE and PDU (every seed), and an all-methods loss overview per
    split."""
    paths = []
    for method in DYNAMICS_METHODS:
        for split in splits:
            runs = {
                f"{method} seed {seed}": h
                for (m, sp, seed), h in sorted(histories.items())
                if m == method and sp == split and h
            }
            if runs:
                paths.append(
                    plot_dynamics(
                        runs, out_dir / f"dynamics_{method}_{split}.png", title=f"{method} on {split}"
                    )
                )
    for split in splits:
        runs = {
            m: h
            for (m, sp, seed), h in sorted(histories.items())
            if sp == split and seed == min(sd for (_, sp2, sd) in histories if sp2 == split) and h
        }
        if runs:
            paths.append(
                plot_dynamics(
                    runs, out_dir / f"dynamics_all_{split}.png", title=f"all methods on {split} (first seed)"
                )
            )
    return paths
