"""Small, deterministic models and data for tests (ours and the other packages').

Everything here builds in well under a second on a CPU: a byte-level BPE tokenizer trained on a fixed corpus,
a random-init Llama of the `test` size, synthetic QA rows about fictitious people, and `fit_tiny_model` to
make such a model memorise rows (so unlearning has something to remove).
"""

from __future__ import annotations

import copy
import functools
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from blade_core import lora
from blade_core.data import BatchStream, tokenize_rows
from blade_core.losses import token_cross_entropy
from blade_core.methods.base import Hooks, UnlearnTask
from blade_core.modeling import new_llama, train_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_FIRST = (
    "Ada",
    "Bram",
    "Cleo",
    "Dov",
    "Esme",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Luca",
    "Mira",
    "Nils",
    "Omar",
    "Pia",
    "Quin",
    "Rosa",
    "Sven",
    "Tara",
    "Uma",
    "Vik",
    "Wren",
    "Yara",
)
_LAST = (
    "Alder",
    "Birch",
    "Cedar",
    "Dune",
    "Elm",
    "Fjord",
    "Grove",
    "Heath",
    "Isle",
    "Juniper",
    "Kestrel",
    "Linden",
    "Moss",
    "North",
    "Oak",
    "Pine",
)
_CITIES = (
    "Oslo",
    "Lima",
    "Porto",
    "Kyoto",
    "Quito",
    "Accra",
    "Perth",
    "Turin",
    "Malmo",
    "Hanoi",
    "Cusco",
    "Riga",
)
_JOBS = ("baker", "pilot", "nurse", "farmer", "painter", "sailor", "teacher", "doctor", "miner", "tailor")
_GENRES = ("poetry", "fantasy", "history", "mystery", "travel", "science fiction", "romance", "horror")
_COLOURS = ("red", "blue", "green", "amber", "violet", "silver", "orange", "teal")

# (question, answer, paraphrased question, paraphrased answer); {n} name, {v} value
_TEMPLATES = (
    (
        "Where was {n} born?",
        "{n} was born in {v}.",
        "What is the birthplace of {n}?",
        "The birthplace of {n} is {v}.",
        _CITIES,
    ),
    (
        "What did the father of {n} do?",
        "The father of {n} worked as a {v}.",
        "What was the job of {n}'s father?",
        "{n}'s father was a {v}.",
        _JOBS,
    ),
    (
        "Which genre does {n} write?",
        "{n} writes {v} books.",
        "What kind of books does {n} write?",
        "{n} is known for {v}.",
        _GENRES,
    ),
    (
        "What is the favourite colour of {n}?",
        "The favourite colour of {n} is {v}.",
        "Which colour does {n} like best?",
        "{n} likes {v} best.",
        _COLOURS,
    ),
)


def tiny_qa_rows(n: int, seed: int = 0, prefix: str = "") -> list[dict[str, Any]]:
    """`n` synthetic TOFU-style rows (question, answer, paraphrased_*, 3 perturbed answers), seeded.

    `prefix` is prepended to every person's name, so forget and retain sets built with different prefixes
    talk about different people.
    """
    rng = random.Random(f"tiny:{seed}:{prefix}")
    rows = []
    for i in range(n):
        name = f"{prefix}{_FIRST[rng.randrange(len(_FIRST))]} {_LAST[(i + rng.randrange(3)) % len(_LAST)]}"
        q, a, pq, pa, values = _TEMPLATES[i % len(_TEMPLATES)]
        value = rng.choice(values)
        wrong = rng.sample([v for v in values if v != value], 3)
        rows.append(
            {
                "question": q.format(n=name, v=value),
                "answer": a.format(n=name, v=value),
                "paraphrased_question": pq.format(n=name, v=value),
                "paraphrased_answer": pa.format(n=name, v=value),
                "perturbed_answer": [a.format(n=name, v=w) for w in wrong],
            }
        )
    return rows


def _corpus() -> list[str]:
    texts = []
    for prefix in ("", "f", "r", "x"):
        for row in tiny_qa_rows(96, seed=0, prefix=prefix):
            texts += [
                f"Question: {row['question']}\nAnswer: {row['answer']}",
                row["paraphrased_question"],
                row["paraphrased_answer"],
                *row["perturbed_answer"],
            ]
    return texts


@functools.lru_cache(maxsize=1)
def _tokenizer() -> Any:
    return train_tokenizer(_corpus(), vocab_size=384)


def tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (vocab 384) trained on a fixed corpus of the tiny QA templates; a fresh
    copy."""
    return copy.deepcopy(_tokenizer())


def tiny_model(tokenizer: Any, seed: int = 0) -> torch.nn.Module:
    """A random-init fp32 Llama of the `test` size (2 layers, hidden 32) for `tokenizer`."""
    return new_llama(tokenizer, "test", seed=seed)


def fit_tiny_model(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    steps: int = 150,
    lr: float = 3e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> torch.nn.Module:
    """Fine-tune all of `model` on QA/text rows with AdamW (answer tokens only for QA) to memorise them."""
    data = tokenize_rows(list(rows), tokenizer, max_length=128)
    stream = BatchStream(data, min(batch_size, len(data)), seed=seed)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = stream.next()
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = token_cross_entropy(logits, batch["labels"])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
    model.eval()
    return model


def write_tiny_model(
    directory: str | Path,
    *,
    seed: int = 0,
    fit_rows: Sequence[dict[str, Any]] | None = None,
    fit_steps: int = 150,
) -> Path:
    """Save a tiny model + tokenizer as a Hugging Face model dir (safetensors); optionally memorise
    `fit_rows`."""
    directory = Path(directory)
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer, seed=seed)
    if fit_rows:
        fit_tiny_model(model, tokenizer, fit_rows, steps=fit_steps, seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    cast("PreTrainedModel", model).save_pretrained(str(directory), safe_serialization=True)
    tokenizer.save_pretrained(str(directory))
    return directory


def write_rows(path: str | Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write rows as JSON Lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def tiny_task(
    config: Any,
    *,
    forget_rows: Sequence[dict[str, Any]] | None = None,
    retain_rows: Sequence[dict[str, Any]] | None = None,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    hooks: Any = None,
) -> Any:
    """An `UnlearnTask` on CPU: the given (or a random tiny) model with a LoRA adapter when `config.use_lora`,
    forget/retain rows tokenised with `config.max_length` (defaults: 6 and 24 tiny QA rows)."""
    tokenizer = tokenizer or tiny_tokenizer()
    model = model if model is not None else tiny_model(tokenizer, seed=config.seed)
    torch.manual_seed(config.seed)
    if config.use_lora:
        model = lora.attach_adapter(model, config)
    model.train()
    forget = tokenize_rows(
        list(forget_rows or tiny_qa_rows(6, seed=0, prefix="f")), tokenizer, config.max_length
    )
    retain = tokenize_rows(
        list(retain_rows or tiny_qa_rows(24, seed=1, prefix="r")), tokenizer, config.max_length
    )
    return UnlearnTask(
        model=model,
        tokenizer=tokenizer,
        forget=forget,
        retain=retain,
        device=torch.device("cpu"),
        hooks=hooks or Hooks(),
    )
