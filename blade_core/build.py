"""Build a target (or gold) model from scratch on a TOFU-format directory until it has memorised the QA.

What it trains on (CONTRACT.md "Files"): every QA row except the holdout splits, i.e. `retain90` + `forget10`
+ `real_authors_perturbed` + `world_facts_perturbed`, each formatted by `blade_core.data.format_qa`;
`exclude_split="forget05"` drops that split's rows (matched by question and answer), which gives the gold
"retrained" model. The byte-level BPE tokenizer is trained on the full training set *including* the excluded
split, so target and gold tokenise every text identically (as two fine-tunes of one pretrained model would).

Departures from TOFU: TOFU fine-tunes a pretrained Llama-2-7B for 5 epochs; we train a small Llama from
scratch, with the loss on every token (answer tokens weighted fully, question tokens less), a high learning
rate and early stopping once sampled answers are memorised, because such a model has no language prior.

The result is cached by a content hash of the data files and every setting that changes the weights, so a
second build with the same inputs is instant. Run: `blade model build --data /tmp/world --out /tmp/target`.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from blade_core.build_common import (
    BuildError,
    BuildResult,
    Eos,
    answer_probs,
    check_replaceable,
    cosine_lr,
    data_hash,
    dir_lock,
    encode_for_training,
    flush_denormals,
    info_key,
    memorisation,
    monitor_sample,
    numerics,
    qa_key,
    read_info,
    read_qa,
    save_model,
    split_file,
    torch_threads,
    training_rows,
    weighted_step,
)
from blade_core.data import format_qa
from blade_core.modeling import SIZES, lora_fraction, new_llama, train_tokenizer
from blade_core.pretrain import TWO_STAGE, ensure_base, finetune, finetune_key

BUILD_VERSION = 1  # bump when the recipe below changes what a build produces


@dataclass(frozen=True)
class Recipe:
    """How one model size is trained. Presets in RECIPES; the sizes themselves live in `modeling.SIZES`."""

    size: str  # key of blade_core.modeling.SIZES
    vocab_size: int = 2048
    lr: float = 3e-3  # peak AdamW learning rate (high: from-scratch memorisation, small model)
    min_lr_ratio: float = 0.1  # cosine decay floor, as a fraction of lr
    warmup_steps: int = 30
    batch_size: int = 32  # rows per step
    max_epochs: int = 80  # the cosine schedule's length; training usually stops earlier (below)
    weight_decay: float = 0.0  # memorisation is the goal, not generalisation
    prompt_loss_weight: float = 0.2  # weight of the question tokens' loss relative to the answer tokens'
    check_every: int = 5  # epochs between memorisation checks
    target_prob: float = 0.96  # stop once the monitor rows' mean answer Prob reaches this ...
    min_epochs: int = 10  # ... and at least this many epochs ran
    monitor_rows: int = 200  # rows of the training set checked for memorisation


RECIPES: dict[str, Recipe] = {
    "test": Recipe(size="test", vocab_size=512, lr=5e-3, max_epochs=60, monitor_rows=64),
    "quick": Recipe(size="quick", vocab_size=1024, lr=4e-3, max_epochs=80, monitor_rows=100),
    "default": Recipe(size="default", vocab_size=2048, lr=3e-3, max_epochs=60),
}


# --- the cache key ------------------------------------------------------------------------------------------


def recipe_fingerprint(recipe: Recipe) -> dict[str, Any]:
    """What besides data and seed changes a build: code version, recipe, model shape, prompt format."""
    return {
        "version": BUILD_VERSION,
        "recipe": asdict(recipe),
        "shape": asdict(SIZES[recipe.size]),
        "format": format_qa(Eos(), "Q?", "A."),
    }


def cache_key(data_dir: Path, recipe: Recipe, seed: int, exclude_split: str | None) -> str:
    """Content hash of the data files read and every setting that changes the weights."""
    h = hashlib.sha256()
    h.update(
        json.dumps(
            {
                "build": recipe_fingerprint(recipe),
                "seed": seed,
                "exclude": exclude_split,
                "data": data_hash(data_dir, exclude_split),
                "numerics": numerics(),
            },
            sort_keys=True,
        ).encode()
    )
    return h.hexdigest()[:20]


# --- training -----------------------------------------------------------------------------------------------


@flush_denormals()
def train(
    rows: Sequence[dict[str, str]],
    tokenizer,
    recipe: Recipe,
    seed: int,
    *,
    monitor: Mapping[str, Sequence[dict[str, str]]],
    progress: bool = True,
    log: Callable[[str], None] | None = None,
):
    """Train a fresh Llama on `rows` until every group of `monitor` rows is memorised; (model, stats)."""
    model = new_llama(tokenizer, recipe.size, seed=seed)
    examples = encode_for_training(tokenizer, rows)
    too_long = max(len(ids) for ids, _ in examples)
    if too_long > model.config.max_position_embeddings:
        raise BuildError(
            f"a training row is {too_long} tokens, over the '{recipe.size}' size's "
            f"{model.config.max_position_embeddings} positions"
        )
    steps_per_epoch = math.ceil(len(examples) / recipe.batch_size)
    total = steps_per_epoch * recipe.max_epochs
    opt = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, betas=(0.9, 0.98), weight_decay=recipe.weight_decay
    )

    lr_at = cosine_lr(recipe.lr, recipe.warmup_steps, total, recipe.min_lr_ratio)

    rng = random.Random(f"blade-build:{seed}")
    step, checks, started = 0, [], time.perf_counter()
    # disable=None: the bar only on a terminal; a log or pipe gets the epoch lines instead
    bar = tqdm(total=total, desc="training", unit="step", disable=not progress or None, leave=False)
    for epoch in range(1, recipe.max_epochs + 1):
        model.train()
        order = list(range(len(examples)))
        rng.shuffle(order)
        loss_sum = 0.0
        for start in range(0, len(order), recipe.batch_size):
            picked = [examples[i] for i in order[start : start + recipe.batch_size]]
            loss_sum += weighted_step(
                model, opt, picked, tokenizer.pad_token_id, recipe.prompt_loss_weight, lr_at(step)
            )
            step += 1
            bar.update(1)
        bar.set_postfix(epoch=epoch, loss=f"{loss_sum / steps_per_epoch:.3f}")
        if epoch % recipe.check_every == 0 or epoch == recipe.max_epochs:
            probs = {name: answer_probs(model, tokenizer, group) for name, group in monitor.items()}
            prob = {name: round(sum(p) / len(p), 4) for name, p in probs.items()}
            checks.append(
                {
                    "epoch": epoch,
                    "step": step,
                    "loss": round(loss_sum / steps_per_epoch, 4),
                    "prob": prob,
                    "seconds": round(time.perf_counter() - started, 1),
                }
            )
            if log:
                log(
                    f"epoch {epoch}: loss {loss_sum / steps_per_epoch:.4f}, answer Prob "
                    + ", ".join(f"{name} {p:.4f}" for name, p in prob.items())
                )
            if min(prob.values()) >= recipe.target_prob and epoch >= recipe.min_epochs:
                break
    bar.close()
    model.eval()
    return model, {"epochs": epoch, "steps": step, "checks": checks}


# --- the build ----------------------------------------------------------------------------------------------


def build_model(
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    exclude_split: str | None = None,
    seed: int = 0,
    size: str = "default",
    cache_dir: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    recipe: Recipe | None = None,
    threads: int | None = None,
    pretrain: bool = False,
    base: str | Path | None = None,
    two_stage: Any = None,
    device: torch.device | None = None,
) -> BuildResult:
    """Build (or reuse) the model for `data_dir` into `out_dir`; see the module docstring.

    Cache: `out_dir/build_info.json` with the same key is a hit; so is `cache_dir/<key>` (copied to
    `out_dir`). A fresh build is written to `out_dir` and, when `cache_dir` is given, also stored there.
    `recipe` overrides the size's preset (tuning and tests); it is part of the cache key. `threads` sets
    torch's CPU threads for the build (then restores them): 1 is best on a shared, oversubscribed machine.

    Two-stage (`blade_core.pretrain`): with `pretrain`, the size's `TWO_STAGE` preset (or `two_stage`)
    pretrains a base once (cached under `cache_dir`, default `<out_dir's parent>/.base-cache`) and fine-tunes
    it on the data for 5 epochs; with `base`, that model dir is the base (any causal LM dir). `device`: where
    both stages train (default the CPU; an accelerator's name enters the build keys).
    """
    if pretrain or base is not None or two_stage is not None:
        with torch_threads(threads):
            return _build_two_stage(
                Path(data_dir),
                Path(out_dir),
                size=size,
                two_stage=two_stage,
                base=Path(base) if base is not None else None,
                exclude_split=exclude_split,
                seed=seed,
                cache_dir=Path(cache_dir) if cache_dir is not None else None,
                progress=progress,
                log=log,
                device=device,
            )
    if device is not None and device.type != "cpu":
        raise BuildError("a build from scratch trains on the CPU; a device applies to two-stage builds")
    if recipe is None:
        if size not in RECIPES or size not in SIZES:
            known = ", ".join(k for k in RECIPES if k in SIZES)
            raise BuildError(f"--size must be one of {known}, got {size!r}")
        recipe = RECIPES[size]
    elif recipe.size not in SIZES:
        raise BuildError(f"recipe size must be one of {', '.join(SIZES)}, got {recipe.size!r}")
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    rows, everything, excluded = training_rows(data_dir, exclude_split)
    say = log or (lambda _msg: None)
    with dir_lock(out_dir), torch_threads(threads):
        key = cache_key(data_dir, recipe, seed, exclude_split)  # under the build's thread count
        return _build_locked(
            data_dir,
            out_dir,
            recipe,
            key,
            rows,
            everything,
            excluded,
            exclude_split=exclude_split,
            seed=seed,
            cache_dir=cache_dir,
            progress=progress,
            log=log,
            say=say,
        )


def _build_two_stage(
    data_dir: Path,
    out_dir: Path,
    *,
    size: str,
    two_stage: Any,
    base: Path | None,
    exclude_split: str | None,
    seed: int,
    cache_dir: Path | None,
    progress: bool,
    log: Callable[[str], None] | None,
    device: torch.device | None = None,
) -> BuildResult:
    """Stage (a) (`ensure_base`, unless `base` is given) then stage (b) (`finetune`), each cached by key."""
    if two_stage is None:
        if size not in TWO_STAGE:
            raise BuildError(f"--size must be one of {', '.join(TWO_STAGE)} with --pretrain, got {size!r}")
        two_stage = TWO_STAGE[size]
    training_rows(data_dir, exclude_split)  # validates the data dir before any pretraining
    say = log or (lambda _msg: None)
    if base is None:
        base_cache = cache_dir if cache_dir is not None else out_dir.resolve().parent / ".base-cache"
        base = ensure_base(two_stage.base, base_cache, device=device, progress=progress, log=log).model_dir
    elif not (base / "config.json").is_file():
        raise BuildError(f"--base {base}: not a model directory (no config.json)")
    key = finetune_key(data_dir, base, two_stage.finetune, seed, exclude_split, device)
    with dir_lock(out_dir):
        if info_key(out_dir) == key:
            say(f"cache hit: {out_dir} already holds build {key}")
            return BuildResult(out_dir, read_info(out_dir), cached=True)
        check_replaceable(out_dir)
        if cache_dir is not None and info_key(cache_dir / key) == key:
            say(f"cache hit: {cache_dir / key}")
            _copy_dir(cache_dir / key, out_dir)
            return BuildResult(out_dir, read_info(out_dir), cached=True)
        info = finetune(
            data_dir,
            out_dir,
            base_dir=base,
            recipe=two_stage.finetune,
            key=key,
            exclude_split=exclude_split,
            seed=seed,
            progress=progress,
            log=log,
            device=device,
        )
        if cache_dir is not None and cache_dir.resolve() / key != out_dir.resolve():
            _copy_dir(out_dir, cache_dir / key)
    return BuildResult(out_dir, info, cached=False)


def _build_locked(
    data_dir: Path,
    out_dir: Path,
    recipe: Recipe,
    key: str,
    rows,
    everything,
    excluded,
    *,
    exclude_split: str | None,
    seed: int,
    cache_dir: str | Path | None,
    progress: bool,
    log: Callable[[str], None] | None,
    say: Callable[[str], None],
) -> BuildResult:
    if info_key(out_dir) == key:
        say(f"cache hit: {out_dir} already holds build {key}")
        return BuildResult(out_dir, read_info(out_dir), cached=True)
    check_replaceable(out_dir)
    if cache_dir is not None and info_key(Path(cache_dir) / key) == key:
        say(f"cache hit: {Path(cache_dir) / key}")
        _copy_dir(Path(cache_dir) / key, out_dir)
        return BuildResult(out_dir, read_info(out_dir), cached=True)

    started = time.time()
    torch.manual_seed(seed)

    tokenizer = train_tokenizer(
        (format_qa(Eos(), r["question"], r["answer"])[1] for r in everything), vocab_size=recipe.vocab_size
    )
    forget_name = exclude_split or "forget10"
    forget_rows = excluded or read_qa(split_file(data_dir, forget_name))
    forget_keys = {qa_key(r) for r in forget_rows}
    others = [r for r in rows if qa_key(r) not in forget_keys]
    trained_forget = [r for r in rows if qa_key(r) in forget_keys]  # empty for the gold model
    monitor = {"retain": monitor_sample(others, recipe.monitor_rows // (2 if trained_forget else 1), seed)}
    if trained_forget:
        monitor[forget_name] = monitor_sample(trained_forget, recipe.monitor_rows // 2, seed)
    say(
        f"training {recipe.size} Llama on {len(rows)} rows ({len(everything) - len(rows)} excluded), "
        f"vocab {len(tokenizer)}"
    )
    model, stats = train(rows, tokenizer, recipe, seed, monitor=monitor, progress=progress, log=log)
    train_s = time.time() - started

    report = {
        forget_name: memorisation(model, tokenizer, forget_rows),
        "retain_sample": memorisation(model, tokenizer, monitor_sample(others, len(forget_rows), seed)),
    }
    info = {
        "key": key,
        "version": BUILD_VERSION,
        "data_dir": str(data_dir.resolve()),
        "data_hash": data_hash(data_dir, exclude_split),
        "exclude_split": exclude_split,
        "seed": seed,
        "size": recipe.size,
        "recipe": asdict(recipe),
        "params": sum(p.numel() for p in model.parameters()),
        "lora": lora_fraction(model, 8),
        "train_rows": len(rows),
        "excluded_rows": len(everything) - len(rows),
        "epochs": stats["epochs"],
        "steps": stats["steps"],
        "checks": stats["checks"],
        "metrics": report,
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - started, 1),
        "torch_threads": torch.get_num_threads(),
    }
    save_model(model, tokenizer, info, out_dir)
    if cache_dir is not None and Path(cache_dir).resolve() / key != out_dir.resolve():
        _copy_dir(out_dir, Path(cache_dir) / key)
    return BuildResult(out_dir, info, cached=False)


def _copy_dir(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp-copy")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(src, tmp)
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)
