"""Results aggregation: mean and standard deviation over seeds of every numeric row field, per (method,
split) (results.json "summary"), and `_fmt`, one number as the tables and log lines print it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from blade_core.bench.settings import ROW_KEYS


def _fmt(value: Any, digits: int = 2) -> str:
    if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _values(rows: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [
        float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))
    ]


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarise(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation over seeds of every numeric row field, per (method, split)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["method"], row["split"]), []).append(row)
    out = []
    for (method, split), group in groups.items():
        entry: dict[str, Any] = {
            "method": method,
            "split": split,
            "n": len(group),
            "statuses": sorted({str(r.get("status")) for r in group}),
        }
        for key in ROW_KEYS[3:]:
            mean, std = mean_std(_values(group, key))
            entry[key] = {"mean": mean, "std": std}
        out.append(entry)
    return out
