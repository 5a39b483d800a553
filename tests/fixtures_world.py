"""A tiny synthetic world and the models that memorised it, built once and cached for every later test run.

`tiny_world`: a 12-author world (`blade data synth`) and a `quick`-size target model trained on it
(`blade model build`); `tiny_gold`: the gold model of the same world without `forget10`, built on first use.
Both live under `<repo>/.cache/test-worlds/<hash>/` (gitignored), where the hash covers the generator's and
the build's versions, recipe, model shape and prompt format; an unchanged setup reuses them.
A file lock lets concurrent pytest processes share one build.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "test-worlds"
TINY_AUTHORS = 12  # forget01 = forget05 = forget10 = 1 author (20 rows); holdout likewise
TINY_SEED = 0
TINY_SIZE = "quick"


@dataclass(frozen=True)
class TinyWorld:
    data_dir: Path  # a TOFU-format dir (see CONTRACT.md "Files")
    model_dir: Path  # a Hugging Face model dir (config.json, model.safetensors, tokenizer, build_info.json)
    exclude_split: str | None = None  # None: the target model; "forget10": the gold model
    info: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # build_info.json


def world_root(authors: int = TINY_AUTHORS, seed: int = TINY_SEED, size: str = TINY_SIZE) -> Path:
    """The cache folder of one world: keyed by the generator's and the build's versions, not their source, so
    editing unrelated lines keeps the cache (bump SYNTH_VERSION / BUILD_VERSION when output changes)."""
    from blade_core.build import RECIPES, recipe_fingerprint
    from blade_core.synth import SYNTH_VERSION

    key = json.dumps([authors, seed, SYNTH_VERSION, recipe_fingerprint(RECIPES[size])], sort_keys=True)
    return CACHE / hashlib.sha256(key.encode()).hexdigest()[:16]


def ensure_tiny_world(
    exclude_split: str | None = None,
    *,
    authors: int = TINY_AUTHORS,
    seed: int = TINY_SEED,
    size: str = TINY_SIZE,
) -> TinyWorld:
    """The cached world and its target (or, with `exclude_split`, gold) model; built on first call."""
    from blade_core.build import build_model
    from blade_core.build_common import dir_lock
    from blade_core.synth import write_world

    root = world_root(authors, seed, size)
    root.parent.mkdir(parents=True, exist_ok=True)
    data_dir = root / "data"
    model_dir = root / (f"gold-{exclude_split}" if exclude_split else "target")
    with dir_lock(root):
        if not (data_dir / "world.json").is_file():
            write_world(data_dir, authors=authors, seed=seed)  # world.json is written last
        # one thread: these models are too small to gain from two, and test machines are often shared
        result = build_model(
            data_dir, model_dir, exclude_split=exclude_split, seed=seed, size=size, progress=False, threads=1
        )
    return TinyWorld(data_dir, result.model_dir, exclude_split, result.info)


@pytest.fixture(scope="session")
def tiny_world() -> TinyWorld:
    """A 12-author synthetic world and a quick-size target model that has memorised it (cached on disk)."""
    return ensure_tiny_world()


@pytest.fixture(scope="session")
def tiny_gold(tiny_world: TinyWorld) -> TinyWorld:
    """The gold ("retrained") model of `tiny_world`: trained on everything but forget10 (cached on disk)."""
    return ensure_tiny_world("forget10")
