"""Did a run forget anything? Forget Prob before and after, and the warning every entry point shows.

`run_unlearning` measures the forget set's Prob (OpenUnlearning's: exp(-mean answer NLL) per row, averaged) on
the model before training and again after it, records both in run.json (`forget_prob`) and, when the change is
below `UNCHANGED_PROB_DELTA`, adds `unchanged_warning(...)` to the run's warnings: `blade unlearn` prints it,
the worker logs it and stores it with the adapter version, the bench puts it in its rows and results.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blade_core.evaluation import metrics as M
from blade_core.evaluation.request import _score, row_kind
from blade_core.evaluation.scoring import mean_nlls
from blade_core.evaluation.tofu import sample_rows
from blade_service.contracts.records import load_dataset_rows

# |Prob after - Prob before| below this is "essentially unchanged": the demo request moves it by ~0.99, a run
# at learning rates far too low for its model (the reason this check exists) by less than 0.005.
UNCHANGED_PROB_DELTA = 0.02
PROBE_ROWS = 32  # forget rows scored before and after (a seeded sample; all of them when fewer)
# Forget Prob below this before a run: the model already fails the set (the demo request ends near 0.001), so
# an unchanged Prob means nothing was left to forget, not a learning rate too low.
ALREADY_FORGOTTEN_PROB = 0.05


def essentially_unchanged(before: float | None, after: float | None) -> bool:
    """|after - before| < UNCHANGED_PROB_DELTA (False when either is unknown)."""
    if before is None or after is None:
        return False
    return abs(after - before) < UNCHANGED_PROB_DELTA


def unchanged_warning(
    before: float | None, after: float | None, lr_rule: dict[str, Any] | None = None
) -> str:
    """The warning text for a run whose forget Prob did not move ('' when it did)."""
    if not essentially_unchanged(before, after):
        return ""
    assert before is not None and after is not None  # essentially_unchanged needs both
    if before < ALREADY_FORGOTTEN_PROB:
        return (
            f"forget Prob essentially unchanged ({before:.3f} -> {after:.3f}): it was already below "
            f"{ALREADY_FORGOTTEN_PROB} before this run, so the model did not know this forget set to begin "
            "with (already forgotten by an earlier version, or never learned)."
        )
    rule = lr_rule or {}
    rates = ", ".join(f"{k}={v:.3g}" for k, v in sorted((rule.get("learning_rates") or {}).items()))
    return (
        f"forget Prob essentially unchanged ({before:.3f} -> {after:.3f}, |delta| < {UNCHANGED_PROB_DELTA}): "
        f"this run forgot nothing. Learning rates used: {rates or 'the method defaults'} "
        f"(LR factor {rule.get('factor', 1.0):g}); a model trained from scratch needs its build_info.json "
        "next to its weights for the engine's LR rule, or larger learning rates (--set eta_out=..., lr=...)."
    )


def probe_rows(path: str | Path, max_rows: int = PROBE_ROWS, seed: int = 0) -> list[dict[str, Any]]:
    """A seeded sample of the forget file's rows (every format `load_dataset_rows` reads)."""
    return list(sample_rows(load_dataset_rows(Path(path))[0], max_rows, seed))


def forget_prob(model: Any, tokenizer: Any, rows: Sequence[dict[str, Any]], batch_size: int = 16) -> float:
    """Mean over rows of exp(-mean NLL) of each row's answer given its question (text rows: every token)."""
    return float(M.mean_prob(mean_nlls(_score(model, tokenizer, rows, row_kind(rows), batch_size))))
