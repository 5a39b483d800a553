"""Tokenised forget/retain data: prompt formatting, label masking, padding and a resumable batch sampler.

QA rows become `prompt + answer + eos` with the prompt's labels masked (-100), so losses read answer tokens
only; text rows are split into `max_length`-token windows and every token is a label. `BatchStream` is the one
sampler all methods draw from: seeded, infinite, reshuffled each epoch, and exactly resumable from its
`state_dict()` (it keeps only `(epoch, position)`; each epoch's order is a pure function of `(seed, epoch)`).

    python -c "from blade_core.testing import *; t = tiny_tokenizer(); print(format_qa(t, 'Who?', 'Ann.'))"
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blade_service.contracts.records import (
    DatasetError,
    DatasetKind,
    Row,
    detect_kind,
    read_records,
    validate_rows,
)

IGNORE_INDEX = -100  # label of prompt and padding positions (PyTorch cross-entropy convention)


@dataclass
class TokenizedDataset:
    """Token ids and labels per example; labels are -100 on prompt tokens (QA) and equal the ids for text."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    kind: DatasetKind
    pad_id: int = 0
    source: str = "<rows>"
    row_of_example: list[int] = field(
        default_factory=list
    )  # 0-based source row of each example (text windows)

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.labels):
            raise ValueError(
                f"{self.source}: {len(self.input_ids)} input rows but {len(self.labels)} label rows"
            )
        if not self.row_of_example:
            self.row_of_example = list(range(len(self.input_ids)))

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"input_ids": self.input_ids[index], "labels": self.labels[index]}

    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.input_ids)


def _uses_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_question(tokenizer: Any, question: str) -> str:
    """The prompt a QA row's answer follows: the chat template's user turn + generation prompt when the
    tokenizer has one, else `Question: {q}\\nAnswer:`."""
    if _uses_template(tokenizer):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    return f"Question: {question}\nAnswer:"


def format_qa(tokenizer: Any, question: str, answer: str) -> tuple[str, str]:
    """(prompt, full text): `format_question`'s prompt; the full text is the prompt, the answer (after a
    space without a chat template) and the eos token."""
    prompt, eos = format_question(tokenizer, question), tokenizer.eos_token or ""
    if _uses_template(tokenizer):
        return prompt, prompt + answer + eos
    return prompt, f"{prompt} {answer}{eos}"


def encode_qa(tokenizer: Any, question: str, answer: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one QA pair; labels are -100 over the prompt.

    The prompt and the rest are tokenised separately and concatenated, so the prompt/answer boundary is exact
    whatever the tokenizer merges. Chat templates already carry their special tokens, so none are added then.
    """
    prompt, full = format_qa(tokenizer, question, answer)
    add_special = not _uses_template(tokenizer)
    prompt_ids = tokenizer(prompt, add_special_tokens=add_special)["input_ids"]
    answer_ids = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
    return prompt_ids + answer_ids, [IGNORE_INDEX] * len(prompt_ids) + list(answer_ids)


def encode_text(tokenizer: Any, text: str, max_length: int) -> list[list[int]]:
    """Token windows of at most `max_length` ids covering `text` + eos, in order."""
    ids = tokenizer(text + (tokenizer.eos_token or ""), add_special_tokens=True)["input_ids"]
    return [ids[start : start + max_length] for start in range(0, len(ids), max_length)]


def tokenize_rows(
    rows: Sequence[dict[str, Any] | Row],
    tokenizer: Any,
    max_length: int,
    *,
    source: str = "<rows>",
    kind: DatasetKind | None = None,
) -> TokenizedDataset:
    """Tokenise QA rows (question/answer) or text rows (text) into a TokenizedDataset.

    QA: answers are truncated to fit `max_length`; a row whose prompt alone leaves no room for one answer
    token raises DatasetError naming the row. Text: chunked into `max_length` windows (windows of one token,
    which carry no next-token target, are dropped).
    """
    if not rows:
        raise DatasetError(source, "no rows found")
    items = [r if isinstance(r, Row) else Row(dict(r), i + 1) for i, r in enumerate(rows)]
    kind = kind or detect_kind(items)
    input_ids: list[list[int]] = []
    labels: list[list[int]] = []
    row_of: list[int] = []
    for index, row in enumerate(items):
        if kind == "qa":
            ids, labs = encode_qa(tokenizer, str(row.data["question"]), str(row.data["answer"]))
            prompt_len = sum(1 for x in labs if x == IGNORE_INDEX)
            if prompt_len >= max_length:
                raise DatasetError(
                    source,
                    f"row {index + 1}: the prompt alone is {prompt_len} tokens, which leaves "
                    f"no room for the answer within max_length={max_length}",
                    line=row.line,
                    field="question",
                )
            input_ids.append(ids[:max_length])
            labels.append(labs[:max_length])
            row_of.append(index)
        else:
            for window in encode_text(tokenizer, str(row.data["text"]), max_length):
                if len(window) < 2:
                    continue
                input_ids.append(window)
                labels.append(list(window))
                row_of.append(index)
    if not input_ids:
        raise DatasetError(
            source, "no usable examples after tokenisation (every text is shorter than 2 tokens)"
        )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return TokenizedDataset(
        input_ids, labels, kind, pad_id=int(pad_id or 0), source=source, row_of_example=row_of
    )


def load_tokenized(path: str | Path, tokenizer: Any, max_length: int) -> TokenizedDataset:
    """Read, validate (contracts.records) and tokenise one forget/retain file."""
    rows, _layout = read_records(path)
    kind = detect_kind(rows)
    validate_rows(path, rows, ("question", "answer") if kind == "qa" else ("text",))
    return tokenize_rows(rows, tokenizer, max_length, source=str(path), kind=kind)


def collate(examples: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids (B, T), attention_mask (B, T), labels (B, T) with -100 on padding."""
    width = max(len(e["input_ids"]) for e in examples)
    batch = len(examples)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        input_ids[i, :n] = torch.tensor(e["input_ids"], dtype=torch.long)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e["labels"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def stack_batches(batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`collate` batches as one, in order: each right-padded to the widest.

    Every real token keeps its position and sees only its own row's earlier tokens, so a causal model gives
    each row the same outputs as in its own batch; `unstack` cuts them back out."""
    width = max(b["input_ids"].shape[1] for b in batches)
    fill = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX}  # pad ids are masked: any id does

    def widened(x: torch.Tensor, key: str) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=fill[key])

    return {key: torch.cat([widened(b[key], key) for b in batches]) for key in fill}


def unstack(stacked: torch.Tensor, batches: Sequence[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    """Each batch's rows of `stacked` (B_total, T, ...) at that batch's own width (views, no copies)."""
    parts, row = [], 0
    for b in batches:
        rows, width = b["input_ids"].shape
        parts.append(stacked[row : row + rows, :width])
        row += rows
    return parts


class BatchStream:
    """Infinite seeded sampler: each epoch is a fresh permutation of the dataset; batches cross epoch borders.

    The order of epoch e is `random.Random(f"{seed}:{e}")`'s shuffle, so `(epoch, position)` is the whole
    state and resuming from `state_dict()` yields exactly the batches an uninterrupted stream would.
    """

    def __init__(self, dataset: TokenizedDataset, batch_size: int, seed: int = 0):
        if len(dataset) == 0:
            raise ValueError(f"{dataset.source}: empty dataset")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.position = 0, 0
        self.last_indices: list[int] = []  # example indices of the latest batch (tests and diagnostics)
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self) -> list[int]:
        picked: list[int] = []
        while len(picked) < self.batch_size:
            if self.position >= len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            picked.append(self._order[self.position])
            self.position += 1
        self.last_indices = picked
        return picked

    def next(self) -> dict[str, torch.Tensor]:
        """The next batch as tensors (see `collate`)."""
        return collate([self.dataset[i] for i in self.next_indices()], self.dataset.pad_id)

    __next__ = next

    def __iter__(self) -> BatchStream:
        return self

    def state_dict(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.batch_size = int(state["seed"]), int(state["batch_size"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
