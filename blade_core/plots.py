"""Training-dynamics plots of unlearning runs (matplotlib, Agg backend, PNG): L_fgt, L_ret and lambda per
step.

Input is `history.json` records (CONTRACT.md). T_trans, the step where a run turns from forgetting to
defending the retain constraint, is read from the records when the method wrote the key (`T_trans`/`t_trans`:
BLADE's detector, PDU's dual-update start; a key that stays null means the run never turned) and otherwise
found with BLADE's rule: the first step ending `run` consecutive steps whose residual (the post-recovery
`r_recovered` where recorded, else `r`) exceeds epsilon (`blade_core.dynamics.violated`).

    python -c "from blade_core.plots import plot_dynamics; help(plot_dynamics)"
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from blade_core.dynamics import violated

History = Sequence[Mapping[str, Any]]


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def transition_step(history: History, run: int = 3) -> int | None:
    """T_trans of a run's history, or None when it never turned (see the module docstring)."""
    recorded = False
    for record in history:
        for key in ("T_trans", "t_trans"):
            recorded = recorded or key in record
            if isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool):
                return int(record[key])
    if recorded:
        return None

    streak = 0
    for record in history:
        recovered = record.get("r_recovered")  # null when recovery did not run: then r is what the rule saw
        r = _num(record.get("r") if recovered is None else recovered)
        eps = _num(record.get("epsilon"))
        streak = streak + 1 if not (math.isnan(r) or math.isnan(eps)) and violated(r, eps) else 0
        if streak >= run:
            return int(record["step"])
    return None


def plot_dynamics(runs: Mapping[str, History], out: str | Path, title: str = "") -> Path:
    """One PNG with three panels (L_fgt, L_ret, lambda against step); one line per run, T_trans dashed.

    `runs` maps a label (e.g. 'blade seed 0') to its history records.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    panels = (("L_fgt", "forget loss L_fgt"), ("L_ret", "retain loss L_ret"), ("lambda", "multiplier lambda"))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, history) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        steps = [int(r["step"]) for r in history]
        t_trans = transition_step(history)
        for ax, (key, _) in zip(axes, panels, strict=True):
            ax.plot(steps, [_num(r.get(key)) for r in history], color=colour, lw=1.2, label=label)
            if t_trans is not None:
                ax.axvline(t_trans, color=colour, ls="--", lw=0.9, alpha=0.8)
        eps = [_num(r.get("epsilon")) for r in history]
        if any(not math.isnan(e) for e in eps):
            axes[1].plot(steps, eps, color=colour, ls=":", lw=0.9)
    for ax, (_, name) in zip(axes, panels, strict=True):
        ax.set_xlabel("step")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle((title + "  " if title else "") + "(dashed: T_trans; dotted: epsilon)", fontsize=10)
    return _save(fig, out)


def plot_curves(
    curves: Mapping[str, Sequence[tuple[float, float, float | None]]],
    out: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
) -> Path:
    """One PNG of y against x per label, with ± std error bars: `curves` maps a label (e.g. a method) to
    (x, mean, std) points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, points in curves.items():
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        errs = [p[2] or 0.0 for p in points]
        ax.errorbar(xs, ys, yerr=errs, marker="o", ms=4, lw=1.3, capsize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xticks(sorted({p[0] for points in curves.values() for p in points}))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, out)


def _save(fig: Any, out: str | Path) -> Path:
    """Lay out `fig`, write it to `out` as a PNG (creating its folder), close it; the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
