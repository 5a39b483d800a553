"""Does this box reproduce a recorded bench? Compares what a bench has finished so far (its cached `row.json`
files and the target's and gold's evaluations, so it works while the bench is still running) with the rows,
reference rows and selection of recorded `results.json` files, metric by metric, to the last digit.

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


def finished_reference(out: Path) -> list[dict[str, Any]]:
    """The target's and golds' rows the bench has evaluated (`out/reference/<split>.json`)."""
    return [row for p in sorted(out.glob("reference/*.json")) for row in json.loads(p.read_text())["rows"]]


def finished_selection(root: Path) -> dict[tuple[str, float], float | None]:
    """(method, multiplier) -> validation HM of the selection runs cached under `root`."""
    found = {}
    for path in sorted(root.glob("*/runs/*/*/seed*/lr-x*/row.json")):
        multiplier = float(path.parent.name.removeprefix("lr-x"))
        found[(path.parts[-5], multiplier)] = json.loads(path.read_text())["row"].get("HM")
    return found


def _key(row: dict[str, Any]) -> tuple[str, str, int]:
    return row["method"], row["split"], int(row["seed"])


def verdict(got: dict[str, Any], want: dict[str, Any] | None) -> str:
    """ "same", "not recorded", or the largest |got - want| over the metrics and which metric it is on."""
    if want is None:
        return "not recorded"
    worst, where = 0.0, ""
    for name in METRICS:
        a, b = got.get(name), want.get(name)
        if a is None or b is None:
            if a != b:
                return f"differs on {name}: {a} vs {b}"
            continue
        if abs(a - b) > worst:
            worst, where = abs(a - b), name
    return f"differs on {where} by {worst:.3g}" if where else "same"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recorded", nargs="+", type=Path, help="results.json files to compare against")
    parser.add_argument("--out", type=Path, required=True, help="the running bench's --out")
    parser.add_argument("--selection", type=Path, help="the bench cache's selection dir")
    args = parser.parse_args(argv)

    recorded: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path in args.recorded:
        results = json.loads(path.read_text())
        for row in results["rows"]:
            if row.get("step") is None and row.get("scale") is None:  # single requests only
                recorded.setdefault(_key(row), row)
        for row in results.get("reference", []):
            recorded.setdefault((row["model"], row["split"]), row)
        for method, hms in results.get("selection", {}).get("validation_hm", {}).items():
            for multiplier, hm in hms.items():
                recorded.setdefault(("selection", method, f"x{float(multiplier):g}"), {"HM": hm})

    found: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((row["model"], row["split"]), row) for row in finished_reference(args.out)
    ]
    if args.selection is not None:
        found += [
            (("selection", method, f"x{multiplier:g}"), {"HM": hm})
            for (method, multiplier), hm in finished_selection(args.selection).items()
        ]
    found += [(_key(row), row) for row in finished_rows(args.out)]
    counts = {"same": 0, "different": 0}
    for key, row in found:
        said = verdict(row, recorded.get(key))
        if said != "not recorded":
            counts["same" if said == "same" else "different"] += 1
        print(f"{' '.join(map(str, key))}: {said}")
    print(f"{counts['same']} same, {counts['different']} different")
    return 1 if counts["different"] else 0


if __name__ == "__main__":
    sys.exit(main())
