"""MUSE-style (and KnowUndo-style) text-unlearning metrics: VerbMem, KnowMem, PrivLeak and their HMs.

Definitions follow OpenUnlearning's MUSE suite (`configs/eval/muse.yaml`, `configs/eval/muse_metrics/*`,
handlers `rouge` in `src/evals/metrics/memorization.py` and `privleak` in `privacy.py`) and the MUSE
reference code (swj0419/muse_bench `eval.py`, `metrics/{verbmem,knowmem,privleak}.py`):

- **VerbMem**: ROUGE-L F1 (`rouge_type: rougeL_f1`, `rouge_score` with the stemmer, as OpenUnlearning's
  `eval_text_similarity`) of the greedy continuation (`max_new_tokens: 128`) of each forget text's prefix
  against the true continuation. MUSE ships `prompt`/`gt` pairs; we cut each text after its first
  `VERBMEM_PREFIX_TOKENS` tokens and keep the next 128 as `gt` (MUSE's `verbmem.py` also cuts the reference
  to `max_new_tokens` tokens).
- **KnowMem**: ROUGE-L F1 of the greedy answers (`max_new_tokens: 32`, cut at MUSE's stop strings) to QA
  probes about the forget / retain corpus, each question preceded by the few-shot (ICL) examples in MUSE's
  `knowmem.py` layout `Question: {q}\\nAnswer: {a}\\n\\n`. Departure: the query ends `Answer:` without
  MUSE's trailing space: our byte-level BPE learned answers as ` word` tokens (Llama's SentencePiece absorbs
  the space, a byte-level tokenizer does not).
- **PrivLeak**: Min-K% (k = 0.4, `forget_holdout_Min-40%`) AUC of forget vs holdout texts, relative to the
  retrained model's: `(AUC - AUC_retrain) / AUC_retrain * 100` in MUSE's AUC convention. Computed with
  `metrics.privleak` (OpenUnlearning's conversion of its own AUC convention, which is the same number).
- **HM** (BLADE paper, MUSE table): hmean(1 - KnowMem_forget, 1 - VerbMem_forget, KnowMem_retain).
- **KnowUndo HM**: hmean(1 - forget ROUGE, retain ROUGE, general utility). KnowUndo measures general
  utility with MMLU; a model trained from scratch on a fictitious world knows no MMLU, so the general-utility
  term here is KnowMem on a general-knowledge probe set of the same world (facts every document shares,
  never in a forget split) - a documented departure.

Scores are in [0, 1] (MUSE reports x100). Hand-computed checks: `pytest tests/test_muse_metrics.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from blade_core.evaluation import metrics as M
from blade_core.evaluation.generation import generate, generate_from_ids
from blade_core.evaluation.scoring import score_texts

VERBMEM_PREFIX_TOKENS = 32  # MUSE paper, VerbMem: the first l = 32 tokens of a forget excerpt as the prompt
VERBMEM_MAX_NEW_TOKENS = 128  # OpenUnlearning forget_verbmem_ROUGE.yaml generation_args; MUSE eval.py
KNOWMEM_MAX_NEW_TOKENS = 32  # OpenUnlearning *_knowmem_ROUGE.yaml generation_args; MUSE eval.py
KNOWMEM_STOP: tuple[str, ...] = ("\n\n", "\nQuestion", "Question:")  # MUSE knowmem.py stop sequences
MIN_K = 0.4  # MUSE privleak key `forget_holdout_Min-40%`; OpenUnlearning mia_min_k.yaml k: 0.4

# ---------------------------------------------------------------------------------------------------------
# Pure functions (no model)
# ---------------------------------------------------------------------------------------------------------


def rouge_l_f1_values(generations: Sequence[str], references: Sequence[str]) -> list[float]:
    """Per-row ROUGE-L F1 = 2PR / (P + R) over the longest common subsequence of stemmed tokens.

    OpenUnlearning `eval_text_similarity` (`rougeL_f1`): `RougeScorer(["rougeL"], use_stemmer=True)
    .score(reference, generation)["rougeL"].fmeasure`.
    """
    if len(generations) != len(references):
        raise ValueError(f"{len(generations)} generations for {len(references)} references")
    scorer = M.rouge_l_scorer()
    pairs = zip(generations, references, strict=True)
    return [float(scorer.score(ref, gen)["rougeL"].fmeasure) for gen, ref in pairs]


def mean_or_nan(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def knowmem_prompt(question: str, icl: Sequence[tuple[str, str]] = ()) -> str:
    """MUSE `knowmem.py`: the ICL pairs as `Question: {q}\\nAnswer: {a}\\n\\n`, then `Question: {q}\\nAnswer:`
    (no trailing space: see the module docstring)."""
    shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in icl)
    return f"{shots}Question: {question}\nAnswer:"


def split_prefix(
    ids: Sequence[int],
    prefix_tokens: int = VERBMEM_PREFIX_TOKENS,
    max_new_tokens: int = VERBMEM_MAX_NEW_TOKENS,
) -> tuple[list[int], list[int]] | None:
    """(prompt ids, true continuation ids) of one text's token ids: the first `prefix_tokens`, then at most
    `max_new_tokens` more; None when the text has no token after the prefix."""
    head, tail = list(ids[:prefix_tokens]), list(ids[prefix_tokens : prefix_tokens + max_new_tokens])
    return (head, tail) if tail else None


def privleak(auc: float, auc_retrain: float) -> float:
    """PrivLeak (%) = (AUC - AUC_retrain) / AUC_retrain * 100 in MUSE's convention (AUC_muse = 1 - AUC here).

    Our `mia_auc` labels forget 0 and holdout 1 (OpenUnlearning), so AUC_muse = 1 - auc; this is
    `metrics.privleak(auc, auc_retrain)`. ~0 is ideal; negative = the forget texts are still recognised.
    """
    return M.privleak(auc, auc_retrain)


def muse_hm(knowmem_forget: float, verbmem_forget: float, knowmem_retain: float) -> float:
    """HM = hmean(1 - KnowMem_forget, 1 - VerbMem_forget, KnowMem_retain) (BLADE paper, MUSE results)."""
    return M.harmonic_mean([1.0 - knowmem_forget, 1.0 - verbmem_forget, knowmem_retain])


def knowundo_hm(forget_rouge: float, retain_rouge: float, general_utility: float) -> float:
    """KnowUndo-style HM = hmean(1 - forget ROUGE, retain ROUGE, general utility) (BLADE paper, KnowUndo)."""
    return M.harmonic_mean([1.0 - forget_rouge, retain_rouge, general_utility])


# ---------------------------------------------------------------------------------------------------------
# Model-facing metrics
# ---------------------------------------------------------------------------------------------------------


def verbmem(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    prefix_tokens: int = VERBMEM_PREFIX_TOKENS,
    max_new_tokens: int = VERBMEM_MAX_NEW_TOKENS,
    batch_size: int = 16,
) -> dict[str, Any]:
    """VerbMem: mean ROUGE-L F1 of the greedy continuation of each text's prefix vs its true continuation.

    {"value", "values", "n"}; texts shorter than the prefix (no continuation) are skipped.
    """
    heads, refs = [], []
    for text in texts:
        cut = split_prefix(
            tokenizer(str(text), add_special_tokens=True)["input_ids"], prefix_tokens, max_new_tokens
        )
        if cut is None:
            continue
        heads.append(cut[0])
        refs.append(tokenizer.decode(cut[1], skip_special_tokens=True))
    gens = generate_from_ids(model, tokenizer, heads, max_new_tokens=max_new_tokens, batch_size=batch_size)
    values = rouge_l_f1_values(gens, refs)
    return {"value": mean_or_nan(values), "values": values, "n": len(values)}


def knowmem(
    model: Any,
    tokenizer: Any,
    qa: Sequence[dict[str, str]],
    *,
    icl: Sequence[dict[str, str]] = (),
    max_new_tokens: int = KNOWMEM_MAX_NEW_TOKENS,
    batch_size: int = 16,
) -> dict[str, Any]:
    """KnowMem: mean ROUGE-L F1 of greedy few-shot answers (cut at MUSE's stop strings) vs the true answers.

    {"value", "values", "n"}.
    """
    shots = [(r["question"], r["answer"]) for r in icl]
    prompts = [knowmem_prompt(r["question"], shots) for r in qa]
    gens = generate(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size, stop=KNOWMEM_STOP
    )
    values = rouge_l_f1_values(gens, [r["answer"] for r in qa])
    return {"value": mean_or_nan(values), "values": values, "n": len(values)}


def min_k_auc(
    model: Any,
    tokenizer: Any,
    forget_texts: Sequence[str],
    holdout_texts: Sequence[str],
    *,
    k: float = MIN_K,
    batch_size: int = 16,
) -> float:
    """AUC of Min-K% (k = 0.4) scores, forget (label 0) vs holdout (label 1), as `metrics.mia_auc`."""

    def scores(texts: Sequence[str]) -> list[float]:
        rows = score_texts(model, tokenizer, list(texts), batch_size=batch_size)
        return [M.mia_min_k_score(r.token_logprobs, k) for r in rows if r.n]

    return M.mia_auc(scores(forget_texts), scores(holdout_texts))


def muse_eval(
    model: Any,
    tokenizer: Any,
    *,
    forget_texts: Sequence[str],
    forget_qa: Sequence[dict[str, str]] = (),
    retain_qa: Sequence[dict[str, str]] = (),
    icl: Sequence[dict[str, str]] = (),
    holdout_texts: Sequence[str] = (),
    auc_retrain: float | None = None,
    general_qa: Sequence[dict[str, str]] = (),
    batch_size: int = 16,
) -> dict[str, Any]:
    """The MUSE suite on one model (JSON-ready): verbmem_f, knowmem_f, knowmem_r, auc, privleak, HM; plus the
    KnowUndo-style HM when `general_qa` is given. Metrics whose inputs are empty are left out."""
    out: dict[str, Any] = {
        "verbmem_f": verbmem(model, tokenizer, forget_texts, batch_size=batch_size)["value"]
    }
    if forget_qa:
        out["knowmem_f"] = knowmem(model, tokenizer, forget_qa, icl=icl, batch_size=batch_size)["value"]
    if retain_qa:
        out["knowmem_r"] = knowmem(model, tokenizer, retain_qa, icl=icl, batch_size=batch_size)["value"]
    if holdout_texts:
        out["auc"] = min_k_auc(model, tokenizer, forget_texts, holdout_texts, batch_size=batch_size)
        if auc_retrain is not None:
            out["privleak"] = privleak(out["auc"], auc_retrain)
    if "knowmem_f" in out and "knowmem_r" in out:
        out["HM"] = muse_hm(out["knowmem_f"], out["verbmem_f"], out["knowmem_r"])
    if general_qa:
        out["general"] = knowmem(model, tokenizer, general_qa, icl=icl, batch_size=batch_size)["value"]
        if "knowmem_f" in out and "knowmem_r" in out:
            out["HM_knowundo"] = knowundo_hm(out["knowmem_f"], out["knowmem_r"], out["general"])
    return out
