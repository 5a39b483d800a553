"""The data and models a bench runs on: a TOFU-format dir's forget/retain files, the synthesised world, and
the target and gold models built for it (`blade model build`, cached by content hash)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from blade_core.bench.settings import BenchSettings, Log
from blade_core.build import build_model
from blade_core.build_common import dir_lock
from blade_core.lora import load_with_stack
from blade_core.synth import write_world


def retain_split(split: str) -> str:
    """'forget05' -> 'retain95' (TOFU's complement naming)."""
    if not (split.startswith("forget") and split[6:].isdigit()):
        raise ValueError(f"split must look like forgetXX (e.g. forget05), got {split!r}")
    return f"retain{100 - int(split[6:]):02d}"


def split_paths(data_dir: Path, split: str) -> tuple[Path, Path]:
    """(forget file, retain file) of `split` in a TOFU-format dir."""
    forget = next(
        (p for p in (data_dir / f"{split}_perturbed.json", data_dir / f"{split}.json") if p.is_file()), None
    )
    retain = data_dir / f"{retain_split(split)}.json"
    if forget is None:
        raise FileNotFoundError(f"{data_dir}: no {split}_perturbed.json")
    if not retain.is_file():
        raise FileNotFoundError(f"{data_dir}: no {retain.name} (the retain complement of {split})")
    return forget, retain


def model_set_name(data_dir: Path, settings: BenchSettings) -> str:
    """The name of the models one preset builds from a world (the target and its golds), e.g.
    `world-a40-s0-default-s0`: what is cached per world and model size."""
    device = "" if settings.build_device == "cpu" else f"-{settings.build_device.replace(':', '')}"
    return f"{data_dir.name}-{settings.model_size}-s{settings.build_seed}{device}"


def prepare_models(
    data_dir: Path,
    root: Path,
    settings: BenchSettings,
    splits: Sequence[str],
    *,
    build_target: bool = True,
    log: Log = print,
    progress: bool = True,
) -> tuple[Path, Path | None, dict[str, Path]]:
    """Build (or reuse: `blade model build` caches by content hash) the target and one gold model per
    split."""
    models = root / "models" / model_set_name(data_dir, settings)
    cache = root / "build-cache"

    def build(name: str, exclude: str | None) -> Path:
        started = time.perf_counter()
        result = build_model(
            data_dir,
            models / name,
            exclude_split=exclude,
            seed=settings.build_seed,
            size=settings.model_size,
            cache_dir=cache,
            pretrain=settings.pretrained,
            device=torch.device(settings.build_device),
            progress=progress,
            log=log,
        )
        how = "cached" if result.cached else "built"
        metrics = json.dumps(result.info.get("metrics", {}))
        log(f"model {name}: {how} in {time.perf_counter() - started:.0f}s; memorisation {metrics}")
        return result.model_dir

    target = build("target", None) if build_target else None
    golds = {split: build(f"gold-{split}", split) for split in splits}
    return data_dir, target, golds


def prepare_synthetic(
    root: Path,
    settings: BenchSettings,
    splits: Sequence[str],
    log: Log = print,
    progress: bool = True,
    world_seed: int | None = None,
) -> tuple[Path, Path, dict[str, Path]]:
    """Synthesise the world (`blade data synth`) under `root`, then build its target and gold models.

    `world_seed`: the world's seed (default settings.world_seed; the validation world passes its own)."""
    seed = settings.world_seed if world_seed is None else world_seed
    data_dir = synthesised_world(root / f"world-a{settings.authors}-s{seed}", settings.authors, seed, log)
    data_dir, target, golds = prepare_models(data_dir, root, settings, splits, log=log, progress=progress)
    assert target is not None
    return data_dir, target, golds


def synthesised_world(data_dir: Path, authors: int, seed: int, log: Log = print) -> Path:
    """`data_dir`, synthesised there unless a complete world (its world.json) is already there. Benches that
    share the cache wait for each other here: a second writer would rewrite files the first is reading."""
    with dir_lock(data_dir):
        if not (data_dir / "world.json").is_file():
            log(f"synthesising a world of {authors} authors into {data_dir}")
            write_world(data_dir, authors=authors, seed=seed)
    return data_dir


def _load(model_dir: Path, device):
    return load_with_stack(model_dir, (), device)
