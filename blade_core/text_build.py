"""Target and retrained models for a text world (`blade_core.text_world`): pretrain, then fine-tune on text.

MUSE's targets are Llama-2-7B fine-tuned on the forget + retain corpora (its retrained model on the retain
corpus only). Ours: (a) the cached base of `blade_core.pretrain` (the same two-stage base as the QA world,
pretrained on the shared universe), (b) fine-tuned with a plain next-token loss on every token of the forget
and retain texts (`retrained=True`: retain only), AdamW with a linear warm-up/decay, long enough that the
forget texts are reproduced verbatim (MUSE's targets are tuned to memorise their corpora too). `fit` and the
model-dir layout are `blade_core.pretrain` / `build_common`'s. Departure: `replay` rows of the base's
general-knowledge QA (`synth.pretrain_corpus`'s `general_qa`) are mixed into the fine-tuning set, because a
model of a few M parameters fine-tuned for many epochs on a small corpus forgets what it knew (general-utility
KnowMem fell from 0.31 to 0.004 without it on the quick size; 0.45 with 64 rows), which a 7B model
fine-tuned on MUSE's corpora does not. Cached by a content hash of the text files, the recipe, the base and
the flags.

Run: `blade model build --data /tmp/news --out /tmp/news-target [--retrained] --quick`.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blade_core.build_common import (
    BuildError,
    BuildResult,
    check_replaceable,
    dir_lock,
    info_key,
    numerics,
    read_info,
    save_model,
)
from blade_core.pretrain import TWO_STAGE, ensure_base, fit_finetune, model_digest
from blade_core.synth import pretrain_corpus
from blade_core.text_world import is_text_world, read_world

TEXT_BUILD_VERSION = 1


@dataclass(frozen=True)
class TextFinetune:
    """Stage (b) on text. MUSE fine-tunes its targets for several epochs on the corpora; ours is sized so
    that a from-scratch-pretrained model of a few M parameters memorises its texts (chosen once, never on
    unlearning results)."""

    epochs: int = 12
    lr: float = 3e-3  # as the QA world's fine-tune (`pretrain.TWO_STAGE`), sized to the base
    batch_size: int = 8
    warmup_epochs: float = 1.0
    weight_decay: float = 0.01  # TOFU / MUSE fine-tuning value
    replay: int = 64  # general-knowledge rows of the base's corpus mixed in (see the module docstring)


TEXT_FINETUNE: dict[str, TextFinetune] = {
    "test": TextFinetune(epochs=8, lr=5e-3, replay=32),  # plumbing only: the test base memorises nothing
    "quick": TextFinetune(epochs=30, lr=2e-3, replay=64),
    "default": TextFinetune(epochs=10, lr=5e-4),
}


def _replay(rows: int, seed: int) -> list[str]:
    """`rows` of the base corpus's general-knowledge QA in `format_qa`'s text layout (no eos: added later)."""
    general = pretrain_corpus(0, 0)["general_qa"]
    picked = random.Random(f"blade-text-replay:{seed}").sample(general, min(rows, len(general)))
    return [f"Question: {r['question']}\nAnswer: {r['answer']}" for r in picked]


def text_key(data_dir: Path, base_dir: Path, recipe: TextFinetune, seed: int, retrained: bool) -> str:
    h = hashlib.sha256()
    for name in ("forget.jsonl", "retain.jsonl"):
        h.update((data_dir / name).read_bytes())
    spec = {
        "version": TEXT_BUILD_VERSION,
        "base": model_digest(base_dir),
        "recipe": asdict(recipe),
        "seed": seed,
        "retrained": retrained,
        "data": h.hexdigest(),
        "numerics": numerics(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def build_text_model(
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    size: str = "quick",
    retrained: bool = False,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    recipe: TextFinetune | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
):
    """Build (or reuse) the target (or, with `retrained`, the retain-only model) of a text world."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    if not is_text_world(data_dir):
        raise BuildError(f"{data_dir}: not a text world (run `blade data synth --kind books|news`)")
    if size not in TWO_STAGE or size not in TEXT_FINETUNE:
        raise BuildError(f"--size must be one of {', '.join(TEXT_FINETUNE)}, got {size!r}")
    recipe = recipe or TEXT_FINETUNE[size]
    say = log or (lambda _m: None)
    base_cache = Path(cache_dir) if cache_dir is not None else out_dir.resolve().parent / ".base-cache"
    base_dir = ensure_base(TWO_STAGE[size].base, base_cache, progress=progress, log=log).model_dir
    key = text_key(data_dir, base_dir, recipe, seed, retrained)
    with dir_lock(out_dir):
        if info_key(out_dir) == key:
            say(f"cache hit: {out_dir} already holds text build {key}")
            return BuildResult(out_dir, read_info(out_dir), cached=True)
        check_replaceable(out_dir)
        started = time.time()
        world = read_world(data_dir)
        texts = world["retain"] + ([] if retrained else world["forget"]) + _replay(recipe.replay, seed)
        tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        limit = model.config.max_position_embeddings
        examples = [(tokenizer(t + tokenizer.eos_token)["input_ids"][:limit], 1) for t in texts]
        torch.manual_seed(seed)
        stats = fit_finetune(
            model,
            examples,
            recipe,
            pad_id=tokenizer.pad_token_id,
            prompt_weight=1.0,
            seed=seed,
            desc="fine-tuning on text",
            progress=progress,
            log=log,
        )
        info: dict[str, Any] = {
            "key": key,
            "stage": "text-finetune",
            "kind": world["kind"],
            "retrained": retrained,
            "size": size,
            "base": str(base_dir),
            "recipe": asdict(recipe),
            "seed": seed,
            "texts": len(texts),
            "tokens": sum(len(ids) for ids, _ in examples),
            **stats,
            "train_seconds": round(time.time() - started, 1),
        }
        save_model(model, tokenizer, info, out_dir)
        if cache_dir is not None:
            say(f"built {out_dir} ({key})")
        return BuildResult(out_dir, info, cached=False)
