"""Where BLADE's convergence stop fires on a finished run's `history.json`, under the reference's rule and
under the opt-in one that also needs r <= 0 over its patience window (`stop_needs_retain_met`).

    .venv/bin/python benchmarks/stop_replay.py out/bench/runs/blade/forget05/seed*/history.json

The stop only ends a run, so a run is the same under either rule up to the step where the first of them fires:
replaying the monitor over one history says where a run under the other rule would have stopped (up to the
step this one ran to). Each history is fed as `train` feeds the monitor: the post-recovery residual when
recovery ran, else r.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from blade_core.dynamics import ConvergenceMonitor  # noqa: E402


def stop_step(history: list[dict[str, Any]], *, needs_retain_met: bool, patience: int = 8) -> int | None:
    """The first step at which the stop rule holds on `history`, or None if it never does."""
    monitor = ConvergenceMonitor(patience=patience, needs_retain_met=needs_retain_met)
    for record in history:
        r = record["r_recovered"] if record["r_recovered"] is not None else record["r"]
        if monitor.update(record["step"], record["L_fgt"], r, record["epsilon"]):
            return int(record["step"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("histories", nargs="+", type=Path)
    parser.add_argument("--patience", type=int, default=8, help="the run's patience (reference: 8)")
    args = parser.parse_args(argv)
    print(f"{'history':70} {'steps':>5} {'T_trans':>7} {'reference stop':>14} {'r <= 0 stop':>11}")
    for path in args.histories:
        history = json.loads(path.read_text())
        t_trans = next((rec["t_trans"] for rec in reversed(history) if rec["t_trans"] is not None), None)
        stops = [stop_step(history, needs_retain_met=s, patience=args.patience) for s in (False, True)]
        cells = ["-" if s is None else str(s) for s in stops]
        print(f"{path!s:70} {len(history):5d} {t_trans or '-':>7} {cells[0]:>14} {cells[1]:>11}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
