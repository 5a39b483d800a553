"""Does this box reproduce a recorded bench? Compares the runs a bench has finished so far (its cached
`row.json` files, so it works while the bench is still running) with the rows and the selection of recorded
`results.json` files, metric by metric, to the last digit.

    .venv/bin/python benchmarks/reproduce_check.py --out out/full --selection .cache/bench/selection \\
        docs/results_data/default-forget05-5seeds-16rows.json \\
        docs/results_data/default-combined-2026-11-25.json

Prints one line per finished run: `same` when every metric equals a recorded value exactly, else the largest
absolute difference and the metric it is on; a run no recorded file holds is listed as `not recorded`.
Where several files record a run, the first named wins. Exits 1 when any recorded run differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

METRICS = ("MU", "Prob", "ROUGE", "HM", "forget_quality", "privleak", "steps")


def finished_rows(out: Path) -> list[dict[str, Any]]:
    """The rows of the runs under `out/runs/<method>/<split>/seed<k>/` that have finished."""
    return [json.loads(p.read_text())["row"] for p in sorted(out.glob("runs/*/*/seed*/row.json"))]


def finished_selection(root: Path) -> dict[tuple[str, float], float | None]:
    """(method, multiplier) -> validation HM of the selection runs cached under `root`."""
    found = {}
    for path in sorted(root.glob("*/runs/*/*/seed*/lr-x*/row.json")):
        multiplier = float(path.parent.name.removeprefix("lr-x"))
        found[(path.parts[-5], multiplier)] = json.loads(path.read_text())["row"].get("HM")
    return found


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return row["method"], row["split"], int(row["seed"])


def compare(got: dict[str, Any], want: dict[str, Any]) -> tuple[float, str]:
    """The largest |got - want| over the metrics, and which metric it is on ("" when all are equal)."""
    worst, where = 0.0, ""
    for name in METRICS:
        a, b = got.get(name), want.get(name)
        if a is None or b is None:
            if a != b:
                return float("inf"), name
            continue
        if abs(a - b) > worst:
            worst, where = abs(a - b), name
    return worst, where


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recorded", nargs="+", type=Path, help="results.json files to compare against")
    parser.add_argument("--out", type=Path, required=True, help="the running bench's --out")
    parser.add_argument("--selection", type=Path, help="the bench cache's selection dir")
    args = parser.parse_args(argv)

    recorded_rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    recorded_hm: dict[tuple[str, float], float | None] = {}
    for path in args.recorded:
        results = json.loads(path.read_text())
        for row in results["rows"]:
            if row.get("step") is None and row.get("scale") is None:  # single requests only
                recorded_rows.setdefault(_key(row), row)
        for method, hms in results.get("selection", {}).get("validation_hm", {}).items():
            for multiplier, hm in hms.items():
                recorded_hm.setdefault((method, float(multiplier)), hm)

    differ = same = 0
    if args.selection is not None:
        for (method, multiplier), hm in finished_selection(args.selection).items():
            want = recorded_hm.get((method, multiplier), "missing")
            verdict = "not recorded" if want == "missing" else "same" if hm == want else f"{hm} vs {want}"
            differ += verdict not in ("same", "not recorded")
            same += verdict == "same"
            print(f"selection {method} x{multiplier:g}: {verdict}")
    for row in finished_rows(args.out):
        want_row = recorded_rows.get(_key(row))
        if want_row is None:
            print(f"{' '.join(map(str, _key(row)))}: not recorded")
            continue
        worst, where = compare(row, want_row)
        verdict = "same" if not where else f"differs on {where} by {worst:.3g}"
        differ += verdict != "same"
        same += verdict == "same"
        print(f"{' '.join(map(str, _key(row)))}: {verdict}")
    print(f"{same} same, {differ} different")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
