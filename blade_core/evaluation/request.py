"""Per-request metrics for the service: what one unlearning request did to its own forget and retain data.

`request_metrics` is called on the stack before and after a request (`GET /unlearn-requests/{id}/metrics`).
It measures, on at most `max_rows` rows of each dataset (a seeded sample, so before and after see the same
rows):

- forget and retain **Prob**: exp(-mean NLL) per row, averaged (OpenUnlearning's Prob). QA rows score the
  answer (+ eos) given the `format_qa` prompt; text rows score every token after the first (+ eos).
- forget and retain **ROUGE-L recall** of greedy generations: QA rows answer the question (OpenUnlearning's
  TOFU settings: at most 200 new tokens, cut only at eos); text rows continue the first half of the text's
  tokens and are compared with the second half (at most `max_new_tokens`).
- **MIA AUC** with the LOSS score (mean NLL), forget labelled 0 against a reference population labelled 1,
  OpenUnlearning's convention: 1 = the forget rows look far more "seen" than the reference, ~0.5 = not at
  all. The reference is `holdout_rows` (data the model never saw) when given; otherwise the request's retain
  rows. Forget vs retain compares two *trained* populations, so there ~0.5 means "forget looks like data the
  model still knows", and a value well below 0.5 means the forget rows now look less familiar than the
  retain rows; the `mia.reference` field says which reference was used.
- for **text** forget rows, the MUSE metrics (`blade_core.evaluation.muse`) under `muse`: **VerbMem** (ROUGE-L
  F1 of the greedy 128-token continuation of each sampled forget text's first 32 tokens) always, and
  **KnowMem** on the forget / retain QA probes when the request names `probe_datasets` (its `icl` rows as
  the few-shot examples); `muse.source` says which ("probes", or "forget-slice": VerbMem alone, on the same
  seeded slice of the forget text as the other metrics).

    python -c "from blade_core.evaluation.request import request_metrics; help(request_metrics)"
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from blade_core.data import format_qa
from blade_core.evaluation import metrics as M
from blade_core.evaluation import muse
from blade_core.evaluation.generation import ROUGE_MAX_NEW_TOKENS, generate, generate_from_ids
from blade_core.evaluation.scoring import (
    RowScore,
    encode_qa_rows,
    encode_text_rows,
    max_positions,
    mean_nlls,
    pad_id_of,
    score_examples,
)
from blade_core.evaluation.tofu import json_ready, sample_rows

DEFAULT_MAX_ROWS = 32  # rows per dataset: keeps a before/after pair to seconds on CPU for the tiny models


def row_kind(rows: Sequence[dict[str, Any]]) -> str:
    """'qa' when rows carry question/answer, 'text' when they carry text."""
    if not rows:
        raise ValueError("no rows")
    first = rows[0]
    if "question" in first and "answer" in first:
        return "qa"
    if "text" in first:
        return "text"
    raise ValueError(f"rows must carry question+answer or text; the first has {sorted(first)}")


def _score(model, tokenizer, rows, kind: str, batch_size: int) -> list[RowScore]:
    if kind == "qa":
        examples = encode_qa_rows(tokenizer, [(r["question"], r["answer"]) for r in rows])
    else:
        examples = encode_text_rows(tokenizer, [r["text"] for r in rows])
    return score_examples(model, examples, pad_id=pad_id_of(tokenizer), batch_size=batch_size)


def _rouge(model, tokenizer, rows, kind: str, batch_size: int, max_new_tokens: int) -> float:
    if kind == "qa":
        prompts = [format_qa(tokenizer, r["question"], r["answer"])[0] for r in rows]
        gens = generate(
            model,
            tokenizer,
            prompts,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
        )
        return M.rouge_l_recall(gens, [r["answer"] for r in rows])
    limit = max_positions(model) - 1
    heads, refs, budgets = [], [], []
    for r in rows:
        ids = tokenizer(r["text"], add_special_tokens=True)["input_ids"][:limit]
        half = max(1, len(ids) // 2)
        tail = ids[half : half + max_new_tokens]
        heads.append(ids[:half])
        refs.append(tokenizer.decode(tail, skip_special_tokens=True))
        budgets.append(max(1, len(tail)))
    gens = generate_from_ids(model, tokenizer, heads, max_new_tokens=max(budgets), batch_size=batch_size)
    # a continuation longer than its reference cannot raise recall, so one budget for all rows is fair
    pairs = [(g, ref) for g, ref in zip(gens, refs, strict=True) if ref.strip()]
    return M.rouge_l_recall([g for g, _ in pairs], [ref for _, ref in pairs]) if pairs else float("nan")


def dataset_metrics(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    batch_size: int = 16,
    max_new_tokens: int = ROUGE_MAX_NEW_TOKENS,
) -> tuple[dict[str, Any], list[RowScore]]:
    """Prob and ROUGE-L of one dataset's rows (QA or text), and the per-row scores."""
    kind = row_kind(rows)
    scores = _score(model, tokenizer, rows, kind, batch_size)
    out = {
        "Prob": M.mean_prob(mean_nlls(scores)),
        "ROUGE": _rouge(model, tokenizer, rows, kind, batch_size, max_new_tokens),
        "n": len(rows),
        "kind": kind,
    }
    return out, scores


Rows = Sequence[dict[str, Any]]


def request_metrics(
    model: torch.nn.Module,
    tokenizer: Any,
    forget_rows: Rows,
    retain_rows: Rows,
    holdout_rows: Rows | None = None,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    batch_size: int = 16,
    max_new_tokens: int = ROUGE_MAX_NEW_TOKENS,
    seed: int = 0,
    probes: dict[str, Rows] | None = None,
) -> dict[str, Any]:
    """Forget / retain Prob and ROUGE-L and a LOSS MIA AUC of `model` on a request's data (JSON-ready).

    {"forget": {"Prob", "ROUGE", "n", "kind"}, "retain": {...},
     "mia": {"auc", "score": "loss", "reference": "holdout" | "retain", "n_forget", "n_reference"},
     "settings": {...}, "time_s"}
    """
    started = time.perf_counter()
    forget = sample_rows(forget_rows, max_rows, seed)
    retain = sample_rows(retain_rows, max_rows, seed)
    kw = {"batch_size": batch_size, "max_new_tokens": max_new_tokens}
    forget_out, forget_scores = dataset_metrics(model, tokenizer, forget, **kw)
    retain_out, retain_scores = dataset_metrics(model, tokenizer, retain, **kw)

    if holdout_rows:
        holdout = sample_rows(holdout_rows, max_rows, seed)
        reference, ref_scores = "holdout", _score(model, tokenizer, holdout, row_kind(holdout), batch_size)
    else:
        reference, ref_scores = "retain", retain_scores
    auc = M.mia_auc(
        [M.mia_loss_score(s.token_logprobs) for s in forget_scores if s.n],
        [M.mia_loss_score(s.token_logprobs) for s in ref_scores if s.n],
    )
    result: dict[str, Any] = {
        "forget": forget_out,
        "retain": retain_out,
        "mia": {
            "auc": auc,
            "score": "loss",
            "reference": reference,
            "n_forget": len(forget_scores),
            "n_reference": len(ref_scores),
        },
        "settings": {"max_rows": max_rows, "max_new_tokens": max_new_tokens, "seed": seed},
    }
    if forget_out["kind"] == "text":
        result["muse"] = muse_metrics(model, tokenizer, forget, probes or {}, max_rows, batch_size, seed)
    result["time_s"] = time.perf_counter() - started
    return json_ready(result)


def muse_metrics(
    model: torch.nn.Module,
    tokenizer: Any,
    forget: Rows,
    probes: dict[str, Rows],
    max_rows: int,
    batch_size: int,
    seed: int,
) -> dict[str, Any]:
    """VerbMem on the sampled forget texts; KnowMem_forget / KnowMem_retain on the probe sets given."""
    texts = [r["text"] for r in forget]
    out: dict[str, Any] = {"VerbMem": muse.verbmem(model, tokenizer, texts, batch_size=batch_size)["value"]}
    icl = list(probes.get("icl") or [])
    for name, key in (("KnowMem_forget", "forget_qa"), ("KnowMem_retain", "retain_qa")):
        if probes.get(key):
            qa = sample_rows(probes[key], max_rows, seed)
            out[name] = muse.knowmem(model, tokenizer, qa, icl=icl, batch_size=batch_size)["value"]
    out["source"] = "probes" if len(out) > 1 else "forget-slice"
    return out
