"""The demo base model `demo-tiny` that `blade up` registers: a small synthetic world and a model of it.

Built once on first start (with a progress bar) and cached under `cache_dir`; later starts reuse it instantly
(`blade_core.build` caches by content hash). The world stays next to the model, so a demo request can forget,
say, the `forget01` split and keep `retain99`:

    from blade_core.demo import demo_split_files, ensure_demo_model
    model = ensure_demo_model(Path("var/cache/demo"))
    forget, retain = demo_split_files(Path("var/cache/demo"), "forget01")
"""

from __future__ import annotations

import json
from pathlib import Path

from blade_core.synth import SYNTH_VERSION, write_world

DEMO_MODEL_NAME = "demo-tiny"
DEMO_AUTHORS = 20  # forget01 = forget05 = 1 author, forget10 = 2 authors (20 QA rows each)
DEMO_SEED = 0
DEMO_SIZE = "quick"


def demo_data_dir(cache_dir: str | Path) -> Path:
    """Where the demo world's TOFU-format files live (written by `ensure_demo_world`)."""
    return Path(cache_dir) / "data"


def demo_model_dir(cache_dir: str | Path) -> Path:
    return Path(cache_dir) / DEMO_MODEL_NAME


def ensure_demo_world(cache_dir: str | Path) -> Path:
    """The demo world's data dir, synthesised on first call (deterministic: same files every time)."""
    data_dir = demo_data_dir(cache_dir)
    try:  # world.json is written last, so a matching one means a complete, current world
        meta = json.loads((data_dir / "world.json").read_text())
    except (OSError, ValueError):
        meta = {}
    wanted = (DEMO_AUTHORS, DEMO_SEED, SYNTH_VERSION)
    if (meta.get("authors"), meta.get("seed"), meta.get("version")) != wanted:
        write_world(data_dir, authors=DEMO_AUTHORS, seed=DEMO_SEED)
    return data_dir


def ensure_demo_model(cache_dir: str | Path, progress: bool = True) -> Path:
    """The `demo-tiny` model dir (a Hugging Face dir), built on first call and reused after."""
    from blade_core.build import build_model  # lazy: `blade up` reads the demo paths without loading torch

    data_dir = ensure_demo_world(cache_dir)
    log = (lambda message: print(f"[demo-tiny] {message}", flush=True)) if progress else None
    result = build_model(
        data_dir,
        demo_model_dir(cache_dir),
        seed=DEMO_SEED,
        size=DEMO_SIZE,
        progress=progress,
        log=log,
        threads=1,  # a model this small trains fastest on one thread, and never oversubscribes a busy CPU
    )
    return result.model_dir


def demo_split_files(cache_dir: str | Path, split: str = "forget01") -> tuple[Path, Path]:
    """(forget file, retain file) of one of the demo world's splits, e.g. forget01 -> retain99."""
    data_dir = ensure_demo_world(cache_dir)
    percent = int(split.removeprefix("forget"))
    return data_dir / f"{split}_perturbed.json", data_dir / f"retain{100 - percent}.json"
