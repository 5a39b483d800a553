"""Run caching: a run's row and history are kept under `OUT/runs/<method>/<split>/seed<k>/` with a fingerprint
(settings, data, target, multiplier, model builds), so an interrupted bench resumes and an unchanged run is
reused; plus the bench's JSON reading and atomic writing, and the seed a synthesised world records."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from blade_core.bench.one_run import _run_dir, run_one, split_preset
from blade_core.bench.settings import RESULTS_VERSION, BenchPlan, Log, settings_record
from blade_core.build_common import dir_lock

# settings that change which runs a bench makes, not what one run computes (kept out of the cache key)
_PLAN_ONLY_SETTINGS = (
    "seeds",
    "lr_grid",
    "lr_grid_extend",
    "validation_world_seed",
    "selection_split",
    "selection_seeds",
    "sequential_split",
)


def _fingerprint(
    plan: BenchPlan, method: str, multiplier: float | None = None, **extra: Any
) -> dict[str, Any]:
    """What must match for a cached run to be reused."""
    settings = {k: v for k, v in settings_record(plan.settings).items() if k not in _PLAN_ONLY_SETTINGS}
    return {
        "version": RESULTS_VERSION,
        "target": str(plan.target.resolve()),
        "data": str(plan.data_dir.resolve()),
        "settings": settings | {"lr_scale_applied": plan.lr_scale},
        "overrides": plan.overrides.get(method, {}),
        "lr_multiplier": plan.multipliers.get(method, 1.0) if multiplier is None else multiplier,
        "threads": plan.run_threads,
        **extra,
    }


def _preset_of(method: str, split: str) -> dict[str, str]:
    """The split's preset of the method, as a fingerprint entry (none: the fingerprint stays as before)."""
    preset = split_preset(method, split)
    return {"preset": preset} if preset else {}


def _run_fingerprint(plan: BenchPlan, method: str, split: str, multiplier: float | None) -> dict[str, Any]:
    """The fingerprint of one run of the splits grid (or the selection)."""
    return _fingerprint(plan, method, multiplier, **_preset_of(method, split))


def fresh_run(
    plan: BenchPlan,
    method: str,
    split: str,
    seed: int,
    gold_ref: dict[str, Any] | None,
    log: Log,
    *,
    multiplier: float | None = None,
    tag: str = "",
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """run_one's (row, history), written to the run dir where `cached_result` finds it next time.

    Made under the run dir's lock, the cache looked up again inside it: two benches on one --out (a protocol
    run in parts) may reach the same run, and the second then waits and reads the first's result instead of
    clearing the work dir the first is training in. Sequences and scaled runs do the same (`stream`)."""
    run_dir = _run_dir(plan, method, split, seed, tag)
    with dir_lock(run_dir):
        cached = cached_result(plan, method, split, seed, multiplier=multiplier, tag=tag)
        if cached is not None:
            return cached
        out = run_one(plan, method, split, seed, gold_ref, log, multiplier=multiplier, tag=tag)
        fingerprint = _run_fingerprint(plan, method, split, multiplier)
        _write_json(run_dir / "history.json", out["history"])
        _write_json(
            run_dir / "row.json",
            {"fingerprint": fingerprint, "builds": _builds(plan, split), "row": out["row"]},
        )
    return out["row"], out["history"]


def cached_result(
    plan: BenchPlan, method: str, split: str, seed: int, *, multiplier: float | None = None, tag: str = ""
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The (row, history) an identical earlier run left in its run dir, else None."""
    run_dir = _run_dir(plan, method, split, seed, tag)
    cached = _read_json(run_dir / "row.json")
    if (
        cached is not None
        and cached.get("fingerprint") == _run_fingerprint(plan, method, split, multiplier)
        and cached.get("builds") == _builds(plan, split)
    ):
        return cached["row"], _read_json(run_dir / "history.json") or []
    return None


def _builds(plan: BenchPlan, split: str) -> dict[str, str | None]:
    """Which builds of the target and the split's gold model a run used (`blade model build` keys), so a model
    rebuilt in place (new data, new recipe) invalidates the cached runs made with the old one."""

    def key(model_dir: Path | None) -> str | None:
        info = _read_json(model_dir / "build_info.json") if model_dir is not None else None
        return info.get("key") if isinstance(info, dict) else None

    return {"target": key(plan.target), "gold": key(plan.golds.get(split))}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # processes writing one path never share a tmp
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False, default=_json_default) + "\n")
    tmp.replace(path)


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def world_seed_of(data_dir: Path) -> int | None:
    """The seed world.json records for a synthesised world (None for other TOFU-format dirs)."""
    info = _read_json(Path(data_dir) / "world.json")
    seed = info.get("seed") if isinstance(info, dict) else None
    return int(seed) if isinstance(seed, int) else None
