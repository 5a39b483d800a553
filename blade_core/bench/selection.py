"""Learning rates chosen without touching the reported world: one selection rule, on a validation world.

The engine's LR rule (`blade_core/lr_scale.py`) gives every method a starting point. On a separate world with
its own seed (synthesised and cached like the test world, never reported), every method runs once per
multiplier of the same grid (`BenchSettings.lr_grid`, log-spaced around the rule's value 1.0), on the same
split (`selection_split`), at the same seeds (the first `selection_seeds` of the bench's; one by default)
and with the same schedule it will run on the test world; each method keeps the multiplier with the highest
HM there, averaged over those seeds (ties: the one nearest the rule's value). A method whose best HM sits
on the grid's outermost point would be judged on a grid that did not bracket it, so it also tries the next
point one grid step further out, and again while the best stays on the new edge, up to
`BenchSettings.lr_grid_extend` points per side: the same rule for every method, which spends the extra runs
only where the grid fell short. A method whose model utility collapsed (MU 0, so HM 0, at every seed) at
every point tried has no best to follow; every such point was too hot, so it steps down past the low edge
the same way (`beyond_edge(collapsed=...)`). Only then does the bench open the test world. The selection
needs no gold model (HM does not use one).

A multiplier chosen for one request need not suit a stack of them (four adapters each trained at it move the
model further than one). With `--sequential N --select-on sequence` the same grid and rule score each
multiplier by HM over every forget set after N stacked requests on the validation world's author groups
(`stream.run_sequence`), instead of by HM after one request.

    blade bench --synthetic --quick --out out/bench-quick   # results.json "selection"
    blade bench --synthetic --quick --sequential 4 --authors 40 --select-on sequence --out out/bench-seq
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

from blade_core.bench.cache import world_seed_of
from blade_core.bench.parallel import RunSpec, run_all
from blade_core.bench.settings import BenchPlan, Log, seed_list
from blade_core.bench.stream import SequenceSpec, author_blocks, run_sequences, sequential_groups


def multiplier_tag(multiplier: float) -> str:
    """The run-dir name of one grid point, e.g. 'lr-x0.25'."""
    return f"lr-x{multiplier:g}"


def choose(hm_by_multiplier: Mapping[float, float | None]) -> float:
    """argmax HM over the grid; ties go to the multiplier nearest 1 on a log scale; no finite HM: 1.0."""
    finite = {
        m: hm for m, hm in hm_by_multiplier.items() if isinstance(hm, (int, float)) and math.isfinite(hm)
    }
    if not finite:
        return 1.0
    best = max(finite.values())
    return min((m for m, hm in finite.items() if hm >= best - 1e-12), key=lambda m: abs(math.log(m)))


def beyond_edge(
    hms: Mapping[float, float | None],
    grid: Sequence[float],
    limit: int,
    *,
    collapsed: Collection[float] = (),
) -> float | None:
    """The next multiplier past the grid's edge when the best validation HM so far sits on the outermost
    point tried: the edge point divided (low side) or multiplied (high side) by the grid's step there, at
    most `limit` points past either end of `grid`; None when the best is inside (or the limit is reached).
    When every point tried is in `collapsed` (model utility 0 there) the low side counts as the best's."""
    if limit < 1 or len(grid) < 2:
        return None
    points, tried = sorted(grid), sorted(hms)
    best = tried[0] if tried and set(tried) <= set(collapsed) else choose(hms)
    past_low, past_high = sum(m < points[0] for m in tried), sum(m > points[-1] for m in tried)
    if best == tried[0] and best <= points[0] and past_low < limit:
        return best / (points[1] / points[0])
    if best == tried[-1] and best >= points[-1] and past_high < limit:
        return best * (points[-1] / points[-2])
    return None


def validation_plan(plan: BenchPlan) -> BenchPlan:
    """The plan of the selection runs: the validation world's data and target, under its `runs_dir` (default
    OUT/selection/)."""
    assert plan.validation is not None
    if plan.validation.data_dir.resolve() == plan.data_dir.resolve():
        raise ValueError(f"the validation world must differ from the reported one ({plan.data_dir})")
    return replace(
        plan,
        data_dir=plan.validation.data_dir,
        target=plan.validation.target,
        golds={},
        out_dir=plan.validation.runs_dir or plan.out_dir / "selection",
        splits=[plan.settings.selection_split],
        seeds=seed_list(plan.settings.selection_seeds),
        validation=None,
        multipliers={},
        sequential=None,
        scales=[],
    )


def _collapsed(row: Mapping[str, Any]) -> bool:
    """The run left the model no utility: MU measured and 0 (HM is 0 whatever it forgot)."""
    mu = row.get("MU")
    return isinstance(mu, (int, float)) and mu <= 0.0


Score = tuple[float | None, bool]  # (HM, collapsed) of one run or sequence


def over_seeds(scores: Sequence[Score]) -> Score:
    """One grid point over the selection's seeds: (mean HM, collapsed at every seed). HM is None when a seed
    has none (the point cannot be compared with the others)."""
    hms = [float(hm) for hm, _ in scores if isinstance(hm, (int, float)) and math.isfinite(hm)]
    if not scores or len(hms) < len(scores):
        return None, False
    return sum(hms) / len(hms), all(dead for _, dead in scores)


def _by_point(scores: list[Score], seeds: int) -> list[list[Score]]:
    """Scores made point by point, `seeds` each in seed order, grouped per point."""
    return [scores[i : i + seeds] for i in range(0, len(scores), seeds)]


def _scores(vplan: BenchPlan, todo: list[tuple[str, float]], log: Log) -> list[list[Score]]:
    """(HM, collapsed) per seed of one request per (method, multiplier) on the validation split."""
    split, seeds = vplan.splits[0], vplan.seeds
    specs = [
        RunSpec(vplan, method, split, seed, multiplier=m, tag=multiplier_tag(m))
        for method, m in todo
        for seed in seeds
    ]
    done = run_all(specs, jobs=vplan.jobs, log=log, desc="selection", progress=vplan.progress)
    return _by_point([(row.get("HM"), _collapsed(row)) for row, _ in done], len(seeds))


def _sequence_scores(vplan: BenchPlan, todo: list[tuple[str, float]], n: int, log: Log) -> list[list[Score]]:
    """(HM, collapsed) per seed over every forget set after `n` stacked requests (`stream.run_sequence`) per
    (method, multiplier), on the validation world's author groups; each multiplier's sequences under their
    own directory."""
    split, seeds = vplan.settings.sequential_split, vplan.seeds
    groups = sequential_groups(author_blocks(vplan.data_dir, split), n, split)
    specs = [
        SequenceSpec(
            replace(
                vplan, out_dir=vplan.out_dir / f"sequence{n}" / multiplier_tag(m), multipliers={method: m}
            ),
            method,
            seed,
            groups,
        )
        for method, m in todo
        for seed in seeds
    ]
    done = run_sequences(specs, jobs=vplan.jobs, log=log, desc="selection", progress=vplan.progress)
    return _by_point([(rows[-1].get("HM_all"), _collapsed(rows[-1])) for rows in done], len(seeds))


def select_multipliers(plan: BenchPlan, log: Log = print) -> dict[str, Any]:
    """Run the grid on the validation world and return results.json's `selection` block."""
    grid = [float(m) for m in plan.settings.lr_grid]
    if plan.validation is None:
        return {
            "world_seed": None,
            "grid": [1.0],
            "chosen": {m: 1.0 for m in plan.methods},
            "validation_hm": {},
            "skipped": "no validation world (--data without --validation-data): the LR rule's values",
        }
    vplan = validation_plan(plan)
    on_sequence = plan.select_on == "sequence"
    if on_sequence and not plan.sequential:
        raise ValueError("selecting on stacked requests needs --sequential N")
    split = plan.settings.sequential_split if on_sequence else vplan.splits[0]
    seeds = vplan.seeds
    what = f"HM_all after {plan.sequential} stacked requests" if on_sequence else "HM"
    if len(seeds) > 1:
        what = f"mean {what} over seeds {', '.join(map(str, seeds))}"
    log(
        f"selecting learning-rate multipliers {grid} by {what} on the validation world {vplan.data_dir} "
        f"({split}, seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}; runs cached under "
        f"{vplan.out_dir})"
    )
    hms: dict[str, dict[float, float | None]] = {method: {} for method in plan.methods}
    by_seed: dict[str, dict[float, list[float | None]]] = {method: {} for method in plan.methods}
    collapsed: dict[str, set[float]] = {method: set() for method in plan.methods}
    todo = [(method, m) for method in plan.methods for m in grid]
    limit = plan.settings.lr_grid_extend
    while todo:
        scores = (
            _sequence_scores(vplan, todo, plan.sequential or 0, log)
            if on_sequence
            else _scores(vplan, todo, log)
        )
        for (method, m), per_seed in zip(todo, scores, strict=True):
            by_seed[method][m] = [hm for hm, _ in per_seed]
            hm, dead = over_seeds(per_seed)
            hms[method][m] = hm
            if dead:
                collapsed[method].add(m)
        # each round moves every method whose best sits on an edge (or that collapsed everywhere so far)
        # one grid step further out
        todo = [
            (method, x)
            for method in plan.methods
            if (x := beyond_edge(hms[method], grid, limit, collapsed=collapsed[method])) is not None
        ]
        if todo:
            log(
                "best validation HM on the grid's edge (or MU 0 at every point); trying "
                + ", ".join(f"{a} x{m:g}" for a, m in todo)
            )
    chosen = {method: choose(hms[method]) for method in plan.methods}
    log("chosen LR multipliers: " + ", ".join(f"{m} x{v:g}" for m, v in chosen.items()))
    return {
        "world_seed": plan.validation.world_seed
        if plan.validation.world_seed is not None
        else world_seed_of(plan.validation.data_dir),
        "grid": grid,
        "chosen": chosen,
        "validation_hm": {m: {f"{k:g}": v for k, v in sorted(by.items())} for m, by in hms.items()},
        "extended": {
            m: [v for v in sorted(by) if v not in grid] for m, by in hms.items() if set(by) - set(grid)
        },
        "collapsed": {m: sorted(by) for m, by in collapsed.items() if by},
        "split": split,
        "seed": seeds[0],
        "seeds": seeds,
        "validation_hm_by_seed": {
            m: {f"{k:g}": v for k, v in sorted(by.items())} for m, by in by_seed.items()
        },
        "on": "sequence" if on_sequence else "request",
        "score": what,
        "rule": f"argmax validation {what}; ties to the multiplier nearest 1 (the LR rule's value); a best "
        f"on the grid's edge tries the next grid step past it, up to {limit} per side; MU 0 at every point "
        "tried steps down past the low edge the same way",
        "lr_factor": vplan.lr_scale,  # the validation target's own factor
        "data_dir": str(plan.validation.data_dir),
        "target": str(plan.validation.target),
    }
