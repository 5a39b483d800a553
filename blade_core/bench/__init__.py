"""`blade bench`: methods x splits x seeds on one harness, one target model and equal data.

First, learning rates are chosen without touching the reported world (`blade_core/bench/selection.py`): on a
separate validation world (its own seed, never reported) every method runs over the same grid of multipliers
of the engine's LR rule (`blade_core/lr_scale.py`), and each keeps the multiplier with the best HM there.
Then, for every (method, split, seed) on the test world: load the target model fresh, tokenise that split's
forget set and its retain complement, train through `run_unlearning` with the method's own published schedule
and its chosen multiplier, then evaluate with `evaluate_split` against the gold (retrained) model's reference
for that split (computed once per split and cached). Per run it records MU, Prob, ROUGE, HM, forget quality,
PrivLeak, steps, wall time and peak memory; it writes `results.json` (CONTRACT.md), `results.md` (shaped like
the BLADE paper's Table 1, mean ± std over seeds) and PNG plots of the training dynamics. `--sequential N`
and `--scale 1,2,4` run the stacked-requests and larger-forget-set experiments instead (stream.py).

Runs are cached under `OUT/runs/<method>/<split>/seed<k>/` (row + history; selection runs under
`OUT/selection/`, or, for a synthesised world, `CACHE/selection/<world>/` so that every bench on that world
shares them), so an interrupted bench resumes where it stopped and re-rendering the tables is free.

Where things live: `settings.py` (settings, presets, the plan), `models.py` (worlds, target and gold models),
`selection.py` (learning rates on the validation world), `one_run.py` (one run: train, reload, evaluate, its
row), `measure.py` (peak memory, the machine), `cache.py` (cached runs, JSON files), `run.py` (`run_bench`,
the loop), `summary.py` (mean ± std over seeds), `report.py` (results.md and the plots), `stream.py`
(`--sequential`, `--scale`), `text.py` (`--suite muse|knowundo`).

    blade bench --synthetic --quick --out out/bench-quick
"""

from __future__ import annotations

from blade_core.bench.models import model_set_name, prepare_models, prepare_synthetic
from blade_core.bench.report import render_markdown
from blade_core.bench.run import reference_evals, run_bench
from blade_core.bench.settings import (
    PRESETS,
    SPLITS,
    BenchPlan,
    BenchSettings,
    ValidationWorld,
    parse_list,
    seed_list,
    settings_for,
    settings_record,
)
from blade_core.bench.summary import summarise
from blade_core.methods import METHOD_NAMES

__all__ = [
    "METHOD_NAMES",
    "PRESETS",
    "SPLITS",
    "BenchPlan",
    "BenchSettings",
    "ValidationWorld",
    "model_set_name",
    "parse_list",
    "prepare_models",
    "prepare_synthetic",
    "reference_evals",
    "render_markdown",
    "run_bench",
    "seed_list",
    "settings_for",
    "settings_record",
    "summarise",
]
