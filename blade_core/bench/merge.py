"""`blade bench-merge`: one results.json from bench invocations of one protocol that each ran part of it
(other methods at other multipliers, other seeds: `--seed-list`, or another box of the same build).

Inputs are joined only where their rows are comparable: the same test world, target and settings (apart
from which methods, seeds and grid points an invocation ran), the same multiplier wherever two chose one for
the same method, no (method, split or request, seed) twice, and the same model build. A build is proved by
a validation score that two inputs share to the last digit (each build rounds differently: docs/results.md,
"Builds are bit-reproducible on one kind of CPU"); without one, the inputs must name the same CPU.

With `replace`, a run present twice is taken whole (every request or scale of it) from the later input, which
must hold the same requests or scales: a re-run of some seeds under a corrected setup replaces the rows it
re-ran, and `replaced` records each such run and where its old and new rows came from."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from blade_core.bench.cache import _write_json
from blade_core.bench.report import render_markdown
from blade_core.bench.settings import PAPER_SEEDS, SPLITS
from blade_core.bench.stream import plot_stream, summarise_stream
from blade_core.bench.summary import summarise

# settings an invocation may choose on its own: which runs it made, not how a run was made
_PER_INVOCATION = ("methods", "splits", "seeds", "lr_grid", "lr_grid_extend")
# selection fields that are per method (joined) rather than per selection (must agree); its `grid` and
# `rule` (which names `lr_grid_extend`) are per invocation
_PER_METHOD = ("chosen", "validation_hm", "validation_hm_by_seed", "collapsed", "extended")
_PER_SELECTION_RUN = ("grid", "rule")


class MergeError(ValueError):
    """Two inputs that cannot share one table; the message names both and what differs."""


# what merging reads from each input (older files lack `machine.cpu_identity` and `command`: both optional)
_REQUIRED = ("rows", "reference", "selection", "test_world_seeds", "settings", "data_dir", "target", "golds")


def load_results(path: Path) -> dict[str, Any]:
    """A bench's results.json, or a MergeError naming the file and what is wrong with it."""
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise MergeError(f"{path}: no such file (give a results.json or a bench's --out directory)") from None
    except json.JSONDecodeError as exc:
        raise MergeError(f"{path}: line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    missing = [k for k in _REQUIRED if k not in result] if isinstance(result, dict) else list(_REQUIRED)
    if missing:
        raise MergeError(f"{path}: not a bench results.json (no {', '.join(missing)})")
    return result


def _row_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["method"], row["split"], row.get("step"), row.get("scale"), row["seed"])


def _run_key(row: dict[str, Any]) -> tuple[Any, ...]:
    """One run: a method's split (or stacked sequence) at one seed, whatever its requests or scales."""
    return (row["method"], row["split"], row["seed"])


def _parts(rows: Sequence[dict[str, Any]]) -> str:
    """A run's requests or scales, for comparing and naming them."""
    steps = sorted(r["step"] for r in rows if r.get("step") is not None)
    scales = sorted(r["scale"] for r in rows if r.get("scale") is not None)
    named = [*([f"requests {steps}"] if steps else []), *([f"scales {scales}"] if scales else [])]
    return " ".join(named) or "one row"


def _join_rows(
    results: Sequence[dict[str, Any]], names: Sequence[str], *, replace: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every input's rows, each run from one input; with `replace`, the last input holding it. Returns the
    rows and the replacements made."""
    runs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    origin: dict[tuple[Any, ...], str] = {}
    replaced: list[dict[str, Any]] = []
    for result, name in zip(results, names, strict=True):
        mine: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for row in result["rows"]:
            mine.setdefault(_run_key(row), []).append(row)
        for run, rows in mine.items():
            if run in runs and not replace:
                held = {_row_key(r) for r in runs[run]}
                if twice := next((_row_key(r) for r in rows if _row_key(r) in held), None):
                    raise MergeError(f"{name} and {origin[run]} both hold the run {twice}")
                runs[run] = [*runs[run], *rows]
                continue
            if run in runs:
                old, new = _parts(runs[run]), _parts(rows)
                if old != new:
                    raise MergeError(
                        f"{name} re-ran {run} with {new}, {origin[run]} holds {old}: a replacement must hold "
                        "the same requests or scales"
                    )
                method, split, seed = run
                was = origin[run]
                replaced.append({"method": method, "split": split, "seed": seed, "was": was, "by": name})
            runs[run], origin[run] = rows, name
    return [row for rows in runs.values() for row in rows], replaced


def _check_same(name: str, first: Any, other: Any, a: str, b: str) -> None:
    if first != other:
        raise MergeError(f"{b}: {name} is {other!r}, {a} has {first!r}; runs of another protocol")


def _check_build(results: Sequence[dict[str, Any]], names: Sequence[str]) -> None:
    """Every input against the first: a shared validation score equal to the last digit, else the same CPU."""
    first, a = results[0], names[0]
    scores = first["selection"].get("validation_hm", {})
    for other, b in zip(results[1:], names[1:], strict=True):
        shared = [
            (m, x, v)
            for m, by_x in other["selection"].get("validation_hm", {}).items()
            for x, v in by_x.items()
            if x in scores.get(m, {})
        ]
        for method, x, value in shared:
            if (theirs := scores[method][x]) != value:
                raise MergeError(
                    f"{b}: {method} x{x} scored {value!r} on the validation world, {a} {theirs!r}: "
                    "the models were built differently (another CPU kind or thread count)"
                )
        cpu = first.get("machine", {}).get("cpu_identity")
        other_cpu = other.get("machine", {}).get("cpu_identity")
        if not shared and (cpu is None or cpu != other_cpu):
            raise MergeError(
                f"{b} ({other_cpu}) and {a} ({cpu}) share no validation score that would show the same "
                "build; run one shared method and multiplier in both"
            )


def _merge_selection(results: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """The selections joined: per-method fields side by side, the grids' union, every other field equal."""
    merged: dict[str, Any] = {k: {} for k in _PER_METHOD}
    for key, value in results[0]["selection"].items():
        if key not in (*_PER_METHOD, *_PER_SELECTION_RUN):
            merged[key] = value
    grid: set[float] = set()
    rules: list[str] = []
    for result, name in zip(results, names, strict=True):
        selection = result["selection"]
        for key, value in selection.items():
            if key not in (*_PER_METHOD, *_PER_SELECTION_RUN):
                _check_same(f"selection.{key}", merged.get(key), value, names[0], name)
        grid |= set(selection.get("grid", []))
        rules += [selection["rule"]] if "rule" in selection else []
        for method, multiplier in selection.get("chosen", {}).items():
            chosen = merged["chosen"].setdefault(method, multiplier)
            _check_same(f"the multiplier chosen for {method}", chosen, multiplier, names[0], name)
        for key in _PER_METHOD[1:]:
            for method, value in selection.get(key, {}).items():
                if isinstance(value, dict):  # by multiplier
                    merged[key].setdefault(method, {}).update(value)
                else:  # `collapsed`: a list of multipliers
                    merged[key][method] = sorted({*merged[key].get(method, []), *value})
    merged["grid"] = sorted(grid)
    if rules:
        merged["rule"] = " / ".join(dict.fromkeys(rules))
    return merged


def _seed_order(seed: int) -> tuple[int, int]:
    return (PAPER_SEEDS.index(seed), seed) if seed in PAPER_SEEDS else (len(PAPER_SEEDS), seed)


def _sources(result: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The invocations behind one input: its own, or those of an earlier merge (whose `sources` may be bare
    commands)."""
    if "sources" in result:
        return [s if isinstance(s, dict) else {"command": s} for s in result["sources"]]
    keys = ("command", "machine", "wall_s")
    return [{"path": name} | {k: result[k] for k in keys if k in result}]


def _wall_s(result: dict[str, Any]) -> float:
    """An input's wall time; an earlier hand merge recorded one per invocation."""
    wall = result.get("wall_s", 0.0)
    return float(sum(wall.values()) if isinstance(wall, dict) else wall)


def merge_results(
    results: Sequence[dict[str, Any]],
    names: Sequence[str],
    *,
    only_seeds: Sequence[int] | None = None,
    replace: bool = False,
) -> dict[str, Any]:
    """One results.json from several (`names` say where each came from, for messages and `sources`);
    `only_seeds` keeps those seeds' runs alone, so methods run at different seeds compare like for like;
    `replace` takes a run present twice from the later input (module docstring)."""
    if len(results) < 2:
        raise MergeError("bench-merge joins two or more results.json")
    first, a = results[0], names[0]
    golds = dict(first["golds"])
    for other, b in zip(results[1:], names[1:], strict=True):
        for key in ("test_world_seeds", "data_dir", "target"):
            _check_same(key, first.get(key), other.get(key), a, b)
        for key in sorted((first["settings"].keys() | other["settings"].keys()) - set(_PER_INVOCATION)):
            _check_same(f"settings.{key}", first["settings"].get(key), other["settings"].get(key), a, b)
        for split, gold in other["golds"].items():  # each invocation built the golds of its own splits
            _check_same(f"the gold model of {split}", golds.setdefault(split, gold), gold, a, b)
    _check_build(results, names)
    selection = _merge_selection(results, names)

    rows, replaced = _join_rows(results, names, replace=replace)
    methods = list(dict.fromkeys(m for r in results for m in r["settings"]["methods"]))
    splits = [sp for sp in SPLITS if any(sp in r["settings"]["splits"] for r in results)]
    seeds = sorted({s for r in results for s in r["settings"]["seeds"]}, key=_seed_order)
    if only_seeds is not None:
        if missing := [s for s in only_seeds if s not in seeds]:
            raise MergeError(f"seed {missing[0]}: no input ran it (they ran {', '.join(map(str, seeds))})")
        seeds = sorted(only_seeds, key=_seed_order)
        rows = [row for row in rows if row["seed"] in seeds]
    ordered = sorted(
        rows,
        key=lambda r: (methods.index(r["method"]), r["split"], _seed_order(r["seed"]), r.get("step") or 0),
    )
    reference = list({(r["model"], r["split"]): r for res in results for r in res["reference"]}.values())
    stream = bool(first["settings"].get("sequential") or first["settings"].get("scales"))
    merged: dict[str, Any] = {
        "rows": ordered,
        "reference": reference,
        "summary": [] if stream else summarise(ordered),
        "selection": selection,
        "test_world_seeds": first["test_world_seeds"],
        "settings": first["settings"]
        | {
            "methods": methods,
            "splits": splits,
            "seeds": seeds,
            "lr_grid": selection["grid"],
            "lr_grid_extend": max(r["settings"].get("lr_grid_extend", 0) for r in results),
        },
        "data_dir": first["data_dir"],
        "target": first["target"],
        "golds": golds,
        "machine": first.get("machine", {}),
        "wall_s": round(sum(_wall_s(r) for r in results), 1),
        "sources": [source for r, name in zip(results, names, strict=True) for source in _sources(r, name)],
    }
    if replaced := [*(e for r in results for e in r.get("replaced", [])), *replaced]:
        merged["replaced"] = replaced
    if stream:
        for key in ("step", "scale"):
            merged[f"summary_{key}"] = summarise_stream(ordered, key)
    return merged


def write_merged(out_dir: Path, merged: dict[str, Any]) -> list[Path]:
    """results.json, results.md and, for stacked or scaled runs, their HM plots; the files written. The
    grid's training-dynamics plots need each run's history, which a results.json does not hold."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [p for key in ("step", "scale") if (p := plot_stream(out_dir, merged, key)) is not None]
    _write_json(out_dir / "results.json", merged)
    (out_dir / "results.md").write_text(render_markdown(merged, plots))
    return [out_dir / "results.json", out_dir / "results.md", *plots]
