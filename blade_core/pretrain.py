"""The two-stage target: pretrain a base on a broad corpus, then fine-tune it on the world as TOFU does.

Real unlearning targets are pretrained models later fine-tuned on the data that must now be forgotten. So:
(a) `pretrain_base` trains a tokenizer and a Llama on `blade_core.synth.pretrain_corpus`: a population of
    other authors (whose names and titles are never a benchmark world's, see `synth.name_side`) and the shared
    universe's general facts, each relation in several phrasings, as QA pairs and as short biographies. It
    is built once per recipe and cached by a content hash (`ensure_base`).
(b) `finetune` trains that base on a TOFU-format dir's training rows (`training_rows`: every QA row but
    the holdout splits; with `exclude_split`, the gold model) for a fixed 5 epochs at a fine-tuning LR,
    loss on answer tokens only, AdamW with weight decay 0.01, one warm-up epoch then linear decay, as TOFU
    fine-tunes Llama-2-7B (Maini et al. 2024, their `config/finetune.yaml`: 5 epochs, lr 1e-5, effective batch
    32, weight decay 0.01, warm-up one epoch).
Departures: our bases are 0.8M-14M parameters, so the fine-tuning LR is far above TOFU's 1e-5 (a small model
at 1e-5 learns nothing in 5 epochs); it is chosen once per size by the target's memorisation of the world,
never on unlearning results. The batch is 8, not 32, so a ~870-row world gets TOFU's ~110 steps an epoch.
After 5 epochs the quick target knows its world only partly (forget10 answer Prob ~0.65), where a from-scratch
target trained to convergence memorises it (~0.97).

Run: `blade model build --data /tmp/world --out /tmp/target --pretrain` (`--quick` for the small base).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from blade_core.build_common import (
    BuildResult,
    Eos,
    cosine_lr,
    data_hash,
    device_name,
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
    training_rows,
    weighted_step,
)
from blade_core.data import format_qa
from blade_core.heartbeat import Heartbeat
from blade_core.modeling import SIZES, load_model, load_tokenizer, lora_fraction, new_llama, train_tokenizer
from blade_core.synth import CORPUS_VERSION, SYNTH_VERSION, pretrain_corpus

if TYPE_CHECKING:
    from blade_core.text_build import TextFinetune

PRETRAIN_VERSION = 1  # bump when the recipe code below changes what a base or a fine-tune produces
LORA_RANK = 8  # the rank the LoRA fraction is reported for (BLADE and OpenUnlearning's LoRA runs)


@dataclass(frozen=True)
class BaseRecipe:
    """Stage (a): pretraining a base on `pretrain_corpus(people, corpus_seed)`."""

    size: str  # key of blade_core.modeling.SIZES
    people: int  # corpus population (other authors than any world's)
    vocab_size: int = 8192  # requested BPE vocabulary (the corpus may saturate below it)
    epochs: int = 2
    lr: float = 1e-3  # peak AdamW LR, cosine decay to min_lr_ratio
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    batch_size: int = 32
    weight_decay: float = 0.1  # Llama-2's pretraining value (Touvron et al. 2023)
    corpus_seed: int = 0
    general_repeats: int = 3  # general facts recur in real corpora far more often than one person's biography


@dataclass(frozen=True)
class FinetuneRecipe:
    """Stage (b): TOFU's fine-tuning recipe (see the module docstring); only `lr` is ours."""

    epochs: int = 5  # TOFU: 5 epochs
    lr: float = 1e-3  # TOFU: 1e-5 for Llama-2-7B; ours per base size (module docstring, TWO_STAGE)
    # TOFU: effective batch 32 over 4,000 rows, 125 steps an epoch. Our 40-author world has ~870 rows, so
    # batch 8 keeps about that step count (~110); at 32 the quick target reached forget Prob 0.47, not 0.65.
    batch_size: int = 8
    warmup_epochs: float = 1.0  # TOFU: one warm-up epoch, then linear decay to 0
    weight_decay: float = 0.01  # TOFU: 0.01
    prompt_loss_weight: float = 0.0  # TOFU: loss on the answer tokens only


@dataclass(frozen=True)
class TwoStage:
    base: BaseRecipe
    finetune: FinetuneRecipe


TWO_STAGE: dict[str, TwoStage] = {
    "test": TwoStage(
        BaseRecipe("base-test", people=12, vocab_size=512, epochs=1, warmup_steps=5), FinetuneRecipe(lr=3e-3)
    ),
    # Fine-tuning LRs: quick measured on a 40-author world (5 epochs, batch 8; forget10 Prob/ROUGE-L):
    # 3e-3 at batch 32: 0.29/0.30, 1e-2 at 32: 0.47/0.36, 5e-3: 0.65/0.59, 1e-2: 0.65/0.55, 3e-2: 0.33/0.17.
    # default: not measured (its base takes ~10 CPU-minutes); 5e-3 scaled by width 96/448, as Adam LRs scale.
    "quick": TwoStage(
        BaseRecipe("base-quick", people=150, vocab_size=4096, epochs=3, lr=3e-3, warmup_steps=50),
        FinetuneRecipe(lr=5e-3),
    ),
    "default": TwoStage(BaseRecipe("base-default", people=300, epochs=2), FinetuneRecipe(lr=1e-3)),
    # large: not measured either; both LRs scaled from default's by width, 448/768.
    "large": TwoStage(BaseRecipe("base-large", people=300, epochs=2, lr=6e-4), FinetuneRecipe(lr=6e-4)),
}


# --- training (shared by both stages) ----------------------------------------------------------------------


def _batches(lengths: Sequence[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of row indices; rows of similar length share a batch (less padding)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool = batch_size * 16
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batches.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


@flush_denormals()
def fit(
    model,
    examples: Sequence[tuple[list[int], int]],
    *,
    pad_id: int,
    epochs: int,
    batch_size: int,
    lr_at: Callable[[int], float],
    weight_decay: float,
    prompt_weight: float,
    seed: int,
    desc: str,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """AdamW on the weighted next-token loss of `examples` ((ids, prompt length) rows) for `epochs` epochs.

    loss = sum_t w_t * NLL_t / sum_t w_t, w_t = 1 on answer targets and `prompt_weight` on prompt targets
    (`build_common.weighted_step`); gradients clipped to norm 1. Returns {'steps', 'epoch_loss': [...]}.
    """
    rng = random.Random(f"blade-fit:{seed}")
    lengths = [len(ids) for ids, _ in examples]
    steps_per_epoch = math.ceil(len(examples) / batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), betas=(0.9, 0.95), weight_decay=weight_decay)
    model.train()
    step, epoch_loss = 0, []
    # disable=None: the bar only on a terminal; a log or pipe gets the epoch lines (and heartbeat) instead
    bar = tqdm(
        total=steps_per_epoch * epochs, desc=desc, unit="step", disable=not progress or None, leave=False
    )
    heartbeat = Heartbeat(log, desc, steps_per_epoch * epochs) if log and bar.disable else None
    for epoch in range(1, epochs + 1):
        total = 0.0
        for picked in _batches(lengths, batch_size, rng):
            rows = [examples[i] for i in picked]
            total += weighted_step(model, opt, rows, pad_id, prompt_weight, lr_at(step))
            step += 1
            bar.update(1)
            if heartbeat:
                heartbeat.beat(step)
        epoch_loss.append(round(total / steps_per_epoch, 4))
        bar.set_postfix(epoch=epoch, loss=f"{epoch_loss[-1]:.3f}")
        if log:
            log(f"{desc} epoch {epoch}/{epochs}: loss {epoch_loss[-1]:.4f}")
    bar.close()
    model.eval()
    return {"steps": step, "epoch_loss": epoch_loss}


def _linear(peak: float, warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up to `peak` over `warmup` steps, then linear decay to 0 at `total` (HF's default)."""

    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / max(1, warmup)
        return peak * max(0.0, (total - step) / max(1, total - warmup))

    return lr_at


def fit_finetune(
    model,
    examples: Sequence[tuple[list[int], int]],
    recipe: FinetuneRecipe | TextFinetune,
    *,
    pad_id: int,
    prompt_weight: float,
    seed: int,
    desc: str,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """`fit` with a fine-tuning recipe and TOFU's schedule:
    `_linear` warm-up over `recipe.warmup_epochs` epochs to `recipe.lr`, then decay to 0 at the last step."""
    steps_per_epoch = math.ceil(len(examples) / recipe.batch_size)
    return fit(
        model,
        examples,
        pad_id=pad_id,
        epochs=recipe.epochs,
        batch_size=recipe.batch_size,
        lr_at=_linear(
            recipe.lr, round(recipe.warmup_epochs * steps_per_epoch), steps_per_epoch * recipe.epochs
        ),
        weight_decay=recipe.weight_decay,
        prompt_weight=prompt_weight,
        seed=seed,
        desc=desc,
        progress=progress,
        log=log,
    )


# --- stage (a): the base -----------------------------------------------------------------------------------


def base_key(recipe: BaseRecipe, seed: int = 0, device: torch.device | None = None) -> str:
    """Content hash of what changes a base: the corpus texts, recipe, model shape, prompt format, seed,
    and the numerics of the machine and device that train it."""
    texts = hashlib.sha256("\0".join(corpus_texts(recipe, "</s>")).encode()).hexdigest()
    spec = {
        "version": PRETRAIN_VERSION,
        "corpus": [CORPUS_VERSION, SYNTH_VERSION, texts],
        "recipe": asdict(recipe),
        "shape": asdict(SIZES[recipe.size]),
        "format": format_qa(Eos(), "Q?", "A."),
        "seed": seed,
        "numerics": numerics(device),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def corpus_texts(recipe: BaseRecipe, eos: str) -> list[str]:
    """The corpus as training texts: QA pairs in `format_qa`'s layout, biographies and facts as plain text."""
    corpus = pretrain_corpus(recipe.people, recipe.corpus_seed)

    def qa(rows: list[dict[str, str]]) -> list[str]:
        return [format_qa(Eos(), r["question"], r["answer"])[1].replace(Eos.eos_token, eos) for r in rows]

    general = qa(corpus["general_qa"]) + [text + eos for text in corpus["general_text"]]
    return qa(corpus["qa"]) + [text + eos for text in corpus["text"]] + general * recipe.general_repeats


def pretrain_base(
    recipe: BaseRecipe,
    out_dir: str | Path,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
):
    """Build (or reuse, by `base_key`) the base of `recipe` in `out_dir`; returns a `BuildResult`.
    `device`: where it trains, in fp32 (default the CPU)."""
    out_dir = Path(out_dir)
    key = base_key(recipe, seed, device)
    say = log or (lambda _m: None)
    with dir_lock(out_dir):
        if info_key(out_dir) == key:
            say(f"cache hit: base {out_dir} ({key})")
            return BuildResult(out_dir, read_info(out_dir), cached=True)
        started = time.time()
        torch.manual_seed(seed)
        texts = corpus_texts(recipe, "</s>")
        tokenizer = train_tokenizer(texts, vocab_size=recipe.vocab_size)
        examples = [(tokenizer(t)["input_ids"], 1) for t in texts]  # plain LM loss on every token
        model: torch.nn.Module = new_llama(tokenizer, recipe.size, seed=seed)
        model.to(device or torch.device("cpu"))
        steps = math.ceil(len(examples) / recipe.batch_size) * recipe.epochs
        tokens = sum(len(ids) for ids, _ in examples)
        say(
            f"pretraining base {recipe.size} ({sum(p.numel() for p in model.parameters()):,} params, vocab "
            f"{len(tokenizer)}) on {len(texts)} texts / {tokens:,} tokens of {recipe.people} people, "
            f"{recipe.epochs} epochs"
        )
        stats = fit(
            model,
            examples,
            pad_id=tokenizer.pad_token_id,
            epochs=recipe.epochs,
            batch_size=recipe.batch_size,
            lr_at=cosine_lr(recipe.lr, recipe.warmup_steps, steps, recipe.min_lr_ratio),
            weight_decay=recipe.weight_decay,
            prompt_weight=1.0,
            seed=seed,
            desc="pretraining",
            progress=progress,
            log=log,
        )
        info = {
            "key": key,
            "stage": "base",
            "version": PRETRAIN_VERSION,
            "size": recipe.size,
            "recipe": asdict(recipe),
            "seed": seed,
            "vocab": len(tokenizer),
            "corpus_texts": len(texts),
            "corpus_tokens": tokens,
            "lora": lora_fraction(model, LORA_RANK),
            **stats,
            "train_seconds": round(time.time() - started, 1),
            "torch_threads": torch.get_num_threads(),
            "device": device_name(device or torch.device("cpu")),
        }
        save_model(model, tokenizer, info, out_dir)
        return BuildResult(out_dir, info, cached=False)


def ensure_base(
    recipe: BaseRecipe,
    cache_dir: str | Path,
    *,
    seed: int = 0,
    device: torch.device | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
):
    """The cached base of `recipe` under `cache_dir/base-<size>-<key>`, pretrained on first use."""
    return pretrain_base(
        recipe,
        Path(cache_dir) / f"{recipe.size}-{base_key(recipe, seed, device)}",
        seed=seed,
        device=device,
        progress=progress,
        log=log,
    )


# --- stage (b): fine-tuning on the world -------------------------------------------------------------------


def model_digest(model_dir: Path) -> str:
    """A base's identity for cache keys: its build key when we built it, else the weights' sha256."""
    info = model_dir / "build_info.json"
    try:
        key = json.loads(info.read_text()).get("key")
        if key:
            return str(key)
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.read_bytes())
    return h.hexdigest()


def finetune_key(
    data_dir: Path,
    base_dir: Path,
    recipe: FinetuneRecipe,
    seed: int,
    exclude: str | None,
    device: torch.device | None = None,
) -> str:
    spec = {
        "version": PRETRAIN_VERSION,
        "stage": "finetune",
        "base": model_digest(base_dir),
        "recipe": asdict(recipe),
        "seed": seed,
        "exclude": exclude,
        "data": data_hash(data_dir, exclude),
        "numerics": numerics(device),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]


def finetune(
    data_dir: Path,
    out_dir: Path,
    *,
    base_dir: Path,
    recipe: FinetuneRecipe,
    key: str,
    exclude_split: str | None,
    seed: int,
    progress: bool,
    log: Callable[[str], None] | None,
    device: torch.device | None = None,
) -> dict[str, Any]:
    """Fine-tune the base in `base_dir` on the dir's training rows (on `device`, in fp32; default the
    CPU); saves to `out_dir`, returns build_info."""
    device = device or torch.device("cpu")
    started = time.time()
    say = log or (lambda _m: None)
    rows, everything, excluded = training_rows(data_dir, exclude_split)
    tokenizer = load_tokenizer(base_dir)
    torch.manual_seed(seed)
    if not progress:  # transformers draws a "Loading weights" bar per load, into a log file as well
        hf_logging.disable_progress_bar()
    model = load_model(base_dir, device=device, dtype=torch.float32)
    examples = encode_for_training(tokenizer, rows)
    say(
        f"fine-tuning {base_dir.name} on {len(rows)} rows ({len(everything) - len(rows)} excluded), "
        f"{recipe.epochs} epochs"
    )
    stats = fit_finetune(
        model,
        examples,
        recipe,
        pad_id=tokenizer.pad_token_id,
        prompt_weight=recipe.prompt_loss_weight,
        seed=seed,
        desc="fine-tuning",
        progress=progress,
        log=log,
    )
    train_s = time.time() - started
    forget_name = exclude_split or "forget10"
    forget_rows = excluded or read_qa(split_file(data_dir, forget_name))
    forget_keys = {qa_key(r) for r in forget_rows}
    others = [r for r in rows if qa_key(r) not in forget_keys]
    base_info = (
        json.loads((base_dir / "build_info.json").read_text())
        if (base_dir / "build_info.json").is_file()
        else {}
    )
    info = {
        "key": key,
        "stage": "finetune",
        "version": PRETRAIN_VERSION,
        "data_dir": str(data_dir.resolve()),
        "data_hash": data_hash(data_dir, exclude_split),
        "exclude_split": exclude_split,
        "seed": seed,
        "size": base_info.get("size", base_dir.name),
        # `recipe.lr` is the model's last training LR: what `blade_core.lr_scale` reads
        "recipe": asdict(recipe) | {"finetune_lr": recipe.lr},
        "base": {
            "dir": str(base_dir.resolve()),
            "key": model_digest(base_dir),
            "recipe": base_info.get("recipe"),
        },
        "params": sum(p.numel() for p in model.parameters()),
        "lora": lora_fraction(model, LORA_RANK),
        "train_rows": len(rows),
        "excluded_rows": len(everything) - len(rows),
        "epochs": recipe.epochs,
        **stats,
        "metrics": {
            forget_name: memorisation(model, tokenizer, forget_rows),
            "retain_sample": memorisation(model, tokenizer, monitor_sample(others, len(forget_rows), seed)),
        },
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "device": device_name(device),
    }
    save_model(model, tokenizer, info, out_dir)
    return info
