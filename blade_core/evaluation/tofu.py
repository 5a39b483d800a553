"""TOFU-style evaluation of one forget split: OpenUnlearning's metrics on forget, retain, probes, holdout.

For split `forgetXX` of a TOFU-format directory (CONTRACT.md "Files") this reads
`forgetXX_perturbed.json` (forget), `retain_perturbed.json` (retain evaluation rows; TOFU's
`retain_perturbed`, the authors no forget split touches), `real_authors_perturbed.json`,
`world_facts_perturbed.json` (utility probes) and `holdoutXX.json` (authors never trained on, for MIA), then
computes, as OpenUnlearning's `configs/eval/tofu.yaml` does:

- forget: Prob, ROUGE-L recall, paraphrased / perturbed Prob, truth ratio (min(TR, 1/TR)), per-row truth
  ratios (for forget quality), extraction strength, exact memorisation;
- retain: Prob, ROUGE, truth ratio (max(0, 1-TR), correct = paraphrased answer), extraction strength, EM;
- real authors / world facts: Prob, normalised Prob, ROUGE, truth ratio (correct = the answer itself);
- MU (harmonic mean of the nine utility values), HM = hmean(MU, 1-Prob, 1-ROUGE) (BLADE paper);
- MIA AUC of forget vs holdout for LOSS, ZLib, Min-K%, Min-K%++ (k = 0.4) and GradNorm (p = 2; its score is
  OpenUnlearning's -||grad||, so its AUC falls towards 0, not 1, when the forget rows look seen);
- with a gold (retrained) reference: forget quality (KS p-value) and PrivLeak per attack; `privleak` is the
  Min-K% one, as OpenUnlearning's TOFU `privleak.yaml` uses `mia_min_k`.

ROUGE generations are OpenUnlearning's (`configs/generation/default.yaml` via every `*_ROUGE.yaml`): greedy,
at most `max_new_tokens` = 200 new tokens, cut only at eos (no stop strings). The one departure, for speed on
CPU, is opt-in: `max_rows` samples at most that many rows per set (seeded, the same rows for the model and its
gold reference). Without a gold reference, PrivLeak is taken against AUC 0.5 (OpenUnlearning's `ref_value`)
and forget quality is None. If `retain_perturbed.json` is missing, the retain complement `retainYY.json` is
used for Prob and ROUGE and the retain truth ratio is NaN (so MU is too).

    blade eval --model M --data DIR --split forget01 --json out.json
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blade_core.data import format_qa
from blade_core.evaluation import metrics as M
from blade_core.evaluation.generation import ROUGE_MAX_NEW_TOKENS, generate
from blade_core.evaluation.robustness import robustness_report
from blade_core.evaluation.scoring import RowScore, gradient_norms_qa, mean_nlls, score_qa
from blade_service.contracts.records import DatasetError, read_records, validate_rows

MIA_ATTACKS: tuple[str, ...] = ("loss", "zlib", "min_k", "min_k_plus_plus", "gradnorm")
PRIVLEAK_ATTACK = "min_k"  # OpenUnlearning configs/eval/tofu_metrics/privleak.yaml pre_compute: mia_min_k
DEFAULT_K = 0.4  # Min-K% / Min-K%++ fraction (OpenUnlearning mia_min_k.yaml, BLADE paper)
GRADNORM_P = 2  # p of the GradNorm attack's norm (OpenUnlearning configs/eval/tofu_metrics/mia_gradnorm.yaml)
DEFAULT_MAX_NEW_TOKENS = ROUGE_MAX_NEW_TOKENS  # OpenUnlearning configs/generation/default.yaml

Log = Callable[[str], None]


# ---------------------------------------------------------------------------------------------------------
# Files and rows
# ---------------------------------------------------------------------------------------------------------


def split_suffix(split: str) -> str:
    """'forget01' -> '01'."""
    if not split.startswith("forget") or not split[len("forget") :].isdigit():
        raise ValueError(f"split must look like forget01 / forget05 / forget10, got {split!r}")
    return split[len("forget") :]


def split_files(data_dir: str | Path, split: str) -> dict[str, Path | None]:
    """The files evaluate_split reads for `split`; None where a file is absent."""
    data_dir = Path(data_dir)
    suffix = split_suffix(split)

    def first(*names: str) -> Path | None:
        return next((data_dir / n for n in names if (data_dir / n).is_file()), None)

    return {
        "forget": first(f"{split}_perturbed.json", f"{split}.json"),
        "retain": first("retain_perturbed.json"),
        "retain_fallback": first(f"retain{100 - int(suffix):02d}.json"),
        "real_authors": first("real_authors_perturbed.json"),
        "world_facts": first("world_facts_perturbed.json"),
        "holdout": first(f"holdout{suffix}.json", f"holdout{suffix}_perturbed.json"),
    }


def load_rows(path: Path, fields: Sequence[str]) -> list[dict[str, Any]]:
    """Rows of a TOFU file, validated for `fields` (errors name file, line and field)."""
    rows, _layout = read_records(path)
    validate_rows(path, rows, fields)
    return [r.data for r in rows]


def sample_rows(rows: Sequence[dict[str, Any]], max_rows: int | None, seed: int = 0) -> list[dict[str, Any]]:
    """At most `max_rows` rows, a seeded sample kept in file order (all rows when max_rows is None)."""
    rows = list(rows)
    if max_rows is None or len(rows) <= max_rows:
        return rows
    keep = sorted(random.Random(seed).sample(range(len(rows)), max_rows))
    return [rows[i] for i in keep]


# ---------------------------------------------------------------------------------------------------------
# Per-set blocks
# ---------------------------------------------------------------------------------------------------------


def _answers_and_rouge(
    model,
    tokenizer,
    rows,
    *,
    batch_size: int,
    max_new_tokens: int,
    vocab_stats: bool = False,
    question_key: str = "question",
) -> tuple[list[RowScore], list[float], list[str]]:
    """Teacher-forced scores of the answers and ROUGE-L recall of greedy answers to `question_key`."""
    pairs = [(r[question_key], r["answer"]) for r in rows]
    scores = score_qa(model, tokenizer, pairs, batch_size=batch_size, vocab_stats=vocab_stats)
    prompts = [format_qa(tokenizer, q, a)[0] for q, a in pairs]
    gens = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    rouge = M.rouge_l_recall_values(gens, [r["answer"] for r in rows])
    return scores, rouge, gens


def _options_nll(
    model, tokenizer, rows, correct_key: str | None, batch_size: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Mean NLL of each row's `correct_key` answer (N,; empty when None) and of each of its perturbed
    answers (N lists), scored in one batched pass."""
    pairs = [(r["question"], r[correct_key]) for r in rows] if correct_key else []
    n_correct = len(pairs)
    counts = [len(r["perturbed_answer"]) for r in rows]
    pairs += [(r["question"], p) for r in rows for p in r["perturbed_answer"]]
    nll = mean_nlls(score_qa(model, tokenizer, pairs, batch_size=batch_size))
    correct, rest = nll[:n_correct], nll[n_correct:]
    wrong, at = [], 0
    for c in counts:
        wrong.append(rest[at : at + c])
        at += c
    return correct, wrong


def _memorisation(scores: Sequence[RowScore]) -> dict[str, float]:
    """Mean extraction strength and exact memorisation, eos prediction dropped as OpenUnlearning does."""
    cut = [s.without_last() for s in scores]
    es = [M.extraction_strength(s.argmax_ids, s.target_ids) for s in cut]
    em = [M.exact_memorization(s.argmax_ids, s.target_ids) for s in cut]
    return {"extraction_strength": float(np.mean(es)), "exact_memorization": float(np.nanmean(em))}


def forget_block(model, tokenizer, rows, *, batch_size: int, max_new_tokens: int) -> tuple[dict, dict]:
    """Forget-set metrics and the per-row values (answer scores with vocab stats, truth ratios)."""
    scores, rouge, gens = _answers_and_rouge(
        model, tokenizer, rows, batch_size=batch_size, max_new_tokens=max_new_tokens, vocab_stats=True
    )
    para_key = "paraphrased_answer" if all("paraphrased_answer" in r for r in rows) else "answer"
    out: dict[str, Any] = {"Prob": M.mean_prob(mean_nlls(scores)), "ROUGE": float(np.mean(rouge))}
    if all(r.get("perturbed_answer") for r in rows):
        para, wrong = _options_nll(model, tokenizer, rows, para_key, batch_size)
        tr = M.truth_ratio_values(para, wrong)
        out.update(
            {
                "Prob_para": M.mean_prob(para),
                "Prob_pert": float(np.mean([M.prob_from_nll(w).mean() for w in wrong])),
                "truth_ratio": M.truth_ratio_forget(tr),
            }
        )
    else:
        tr = np.array([])
        out.update({"Prob_para": math.nan, "Prob_pert": math.nan, "truth_ratio": math.nan})
    out.update(_memorisation(scores))
    return out, {"scores": scores, "truth_ratios": tr, "rouge": rouge, "generations": gens}


def retain_block(model, tokenizer, rows, *, batch_size: int, max_new_tokens: int) -> dict:
    """Retain-set metrics; truth ratio against the paraphrased answer (TOFU retain_perturbed)."""
    scores, rouge, _ = _answers_and_rouge(
        model, tokenizer, rows, batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    out = {"Prob": M.mean_prob(mean_nlls(scores)), "ROUGE": float(np.mean(rouge)), "truth_ratio": math.nan}
    if all(r.get("perturbed_answer") for r in rows):
        para_key = "paraphrased_answer" if all("paraphrased_answer" in r for r in rows) else "answer"
        para, wrong = _options_nll(model, tokenizer, rows, para_key, batch_size)
        out["truth_ratio"] = M.truth_ratio_retain(M.truth_ratio_values(para, wrong))
    out.update(_memorisation(scores))
    return out


def probe_block(model, tokenizer, rows, *, batch_size: int, max_new_tokens: int) -> dict:
    """Real-authors / world-facts probe metrics: Prob, normalised Prob, ROUGE, truth ratio (vs the answer)."""
    scores, rouge, _ = _answers_and_rouge(
        model, tokenizer, rows, batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    correct = mean_nlls(scores)  # the true answer is the "correct" option on the probe sets
    _, wrong = _options_nll(model, tokenizer, rows, None, batch_size)
    return {
        "Prob": M.mean_prob(mean_nlls(scores)),
        "Prob_normalised": M.normalised_prob(correct, wrong),
        "ROUGE": float(np.mean(rouge)),
        "truth_ratio": M.truth_ratio_retain(M.truth_ratio_values(correct, wrong)),
    }


def _answer_scores(model, tokenizer, rows, batch_size: int) -> list[RowScore]:
    """Answer scores with the vocabulary statistics Min-K%++ needs."""
    pairs = [(r["question"], r["answer"]) for r in rows]
    return score_qa(model, tokenizer, pairs, batch_size=batch_size, vocab_stats=True)


def mia_scores(scores: Sequence[RowScore], tokenizer, k: float = DEFAULT_K) -> dict[str, list[float]]:
    """Per-row loss-signed scores of each attack. LOSS and ZLib use every answer token (eos included, as
    OpenUnlearning's `evaluate_probability`); Min-K% and Min-K%++ drop the eos prediction (its
    `tokenwise_logprobs`). ZLib compresses the decoded answer tokens."""
    out: dict[str, list[float]] = {a: [] for a in MIA_ATTACKS}
    for s in scores:
        cut = s.without_last()
        text = tokenizer.decode(s.target_ids.tolist(), skip_special_tokens=True)
        out["loss"].append(M.mia_loss_score(s.token_logprobs))
        out["zlib"].append(M.mia_zlib_score(s.mean_nll, text))
        out["min_k"].append(M.mia_min_k_score(cut.token_logprobs, k))
        if cut.vocab_mu is not None and cut.vocab_sigma2 is not None:  # scored with vocab_stats: both set
            out["min_k_plus_plus"].append(
                M.mia_min_k_plus_plus_score(cut.token_logprobs, cut.vocab_mu, cut.vocab_sigma2, k)
            )
    return out


def gradnorm_scores(model, tokenizer, rows, p: float = GRADNORM_P) -> list[float]:
    """Per-row GradNorm attack scores of the answers (OpenUnlearning `mia_gradnorm`)."""
    pairs = [(r["question"], r["answer"]) for r in rows]
    return [M.mia_gradnorm_score(g) for g in gradient_norms_qa(model, tokenizer, pairs, p=p)]


def mia_block(
    forget_scores: Sequence[RowScore],
    holdout_scores: Sequence[RowScore],
    tokenizer,
    k: float = DEFAULT_K,
    gradnorm: tuple[Sequence[float], Sequence[float]] | None = None,
) -> dict[str, float]:
    """AUC of forget vs holdout for each attack; `gradnorm` = (forget, holdout) GradNorm scores, or None
    (its AUC is then NaN)."""
    f, h = mia_scores(forget_scores, tokenizer, k), mia_scores(holdout_scores, tokenizer, k)
    if gradnorm is not None:
        f["gradnorm"], h["gradnorm"] = list(gradnorm[0]), list(gradnorm[1])
    return {a: M.mia_auc(f[a], h[a]) for a in MIA_ATTACKS}


# ---------------------------------------------------------------------------------------------------------
# Gold reference
# ---------------------------------------------------------------------------------------------------------


def gold_reference(result: dict[str, Any]) -> dict[str, Any]:
    """What forget quality and PrivLeak need from the gold model's evaluation of the same split."""
    return {
        "split": result.get("split"),
        "forget_truth_ratios": list(result["forget_truth_ratios"]),
        "mia_auc": dict(result["mia"]),
    }


def as_gold(gold: dict[str, Any] | str | Path | None) -> dict[str, Any] | None:
    """A gold reference from None, a reference dict, a full evaluate_split result, or a JSON file of one."""
    if gold is None:
        return None
    reference: dict[str, Any]
    if isinstance(gold, (str, Path)):
        path = Path(gold)
        try:
            reference = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read the gold reference ({exc})") from None
    else:
        reference = gold
    if "gold_reference" in reference:
        reference = reference["gold_reference"]
    missing = [k for k in ("forget_truth_ratios", "mia_auc") if k not in reference]
    if missing:
        raise ValueError(
            f"gold reference lacks {', '.join(missing)} (pass the `blade eval` JSON of the gold model)"
        )
    return reference


def reference_for_gold(
    model,
    tokenizer,
    data_dir: str | Path,
    split: str,
    *,
    batch_size: int = 16,
    max_rows: int | None = None,
    k: float = DEFAULT_K,
    seed: int = 0,
) -> dict[str, Any]:
    """The gold reference of a (retrained) model on `split`: forget truth ratios and MIA AUCs only
    (no generation), on the same sampled rows evaluate_split uses."""
    files = split_files(data_dir, split)
    if files["forget"] is None:
        raise FileNotFoundError(f"{data_dir}: no {split}_perturbed.json")
    forget = sample_rows(
        load_rows(files["forget"], ("question", "answer", "paraphrased_answer", "perturbed_answer")),
        max_rows,
        seed,
    )
    para, wrong = _options_nll(model, tokenizer, forget, "paraphrased_answer", batch_size)
    mia = {a: math.nan for a in MIA_ATTACKS}
    if files["holdout"] is not None:
        holdout = sample_rows(load_rows(files["holdout"], ("question", "answer")), max_rows, seed)
        mia = mia_block(
            _answer_scores(model, tokenizer, forget, batch_size),
            _answer_scores(model, tokenizer, holdout, batch_size),
            tokenizer,
            k,
            gradnorm=(gradnorm_scores(model, tokenizer, forget), gradnorm_scores(model, tokenizer, holdout)),
        )
    return json_ready(
        {"split": split, "forget_truth_ratios": M.truth_ratio_values(para, wrong).tolist(), "mia_auc": mia}
    )


# ---------------------------------------------------------------------------------------------------------
# The split
# ---------------------------------------------------------------------------------------------------------


def evaluate_split(
    model: torch.nn.Module,
    tokenizer: Any,
    data_dir: str | Path,
    split: str,
    gold: dict[str, Any] | str | Path | None = None,
    *,
    batch_size: int = 16,
    robustness: bool = False,
    max_rows: int | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    k: float = DEFAULT_K,
    seed: int = 0,
    log: Log | None = None,
) -> dict[str, Any]:
    """The full metric set of `model` on one forget split, its retain rows, the probes and the holdout.

    `gold`: the gold (retrained) model's reference (see `as_gold`); enables forget quality and a gold-based
    PrivLeak. `max_rows` caps every set (seeded sample). `robustness` adds the jailbreak, paraphrase and
    relearning probes of `blade_core.evaluation.robustness` (whose relearning attack trains a model copy).
    Returns a JSON-ready dict (NaN -> None); headline keys: MU, Prob, ROUGE, HM, forget_quality, privleak.
    """
    log = log or (lambda _msg: None)
    started = time.perf_counter()
    files = split_files(data_dir, split)
    if files["forget"] is None:
        hint = ""
        if (Path(data_dir) / "forget.jsonl").is_file() and (Path(data_dir) / "world.json").is_file():
            hint = (
                " (this is a MUSE-style text world: its metrics come from a service request with preset muse "
                "and probe_datasets, or from `blade bench --suite muse`)"
            )
        raise FileNotFoundError(f"{data_dir}: no {split}_perturbed.json (or {split}.json){hint}")
    gold_ref = as_gold(gold)
    kw = {"batch_size": batch_size, "max_new_tokens": max_new_tokens}
    result: dict[str, Any] = {"split": split, "n": {}}

    forget = sample_rows(load_rows(files["forget"], ("question", "answer")), max_rows, seed)
    log(f"forget: {len(forget)} rows")
    result["forget"], per_row = forget_block(model, tokenizer, forget, **kw)
    result["n"]["forget"] = len(forget)
    result["forget_truth_ratios"] = per_row["truth_ratios"].tolist()

    retain_path = files["retain"] or files["retain_fallback"]
    if retain_path is not None:
        retain = sample_rows(load_rows(retain_path, ("question", "answer")), max_rows, seed)
        log(f"retain: {len(retain)} rows ({retain_path.name})")
        result["retain"] = retain_block(model, tokenizer, retain, **kw)
        result["n"]["retain"] = len(retain)
    for name in ("real_authors", "world_facts"):
        probe_path = files[name]
        if probe_path is not None:
            rows = load_rows(probe_path, ("question", "answer", "perturbed_answer"))
            rows = sample_rows(rows, max_rows, seed)
            log(f"{name}: {len(rows)} rows")
            result[name] = probe_block(model, tokenizer, rows, **kw)
            result["n"][name] = len(rows)

    mu_parts = utility_components(result)
    result["MU_components"] = mu_parts
    result["MU"] = M.model_utility(mu_parts)
    result["Prob"], result["ROUGE"] = result["forget"]["Prob"], result["forget"]["ROUGE"]
    result["HM"] = M.hm_score(result["MU"], result["Prob"], result["ROUGE"])

    result["mia"] = {a: math.nan for a in MIA_ATTACKS}
    if files["holdout"] is not None:
        holdout = sample_rows(load_rows(files["holdout"], ("question", "answer")), max_rows, seed)
        log(f"holdout: {len(holdout)} rows (MIA)")
        holdout_scores = _answer_scores(model, tokenizer, holdout, batch_size)
        gradnorm = (gradnorm_scores(model, tokenizer, forget), gradnorm_scores(model, tokenizer, holdout))
        result["mia"] = mia_block(per_row["scores"], holdout_scores, tokenizer, k, gradnorm=gradnorm)
        result["n"]["holdout"] = len(holdout)
        result["holdout_split"] = files["holdout"].stem

    gold_auc = gold_ref["mia_auc"] if gold_ref else {}
    result["privleak_by_attack"] = {
        a: M.privleak(auc, _finite(gold_auc.get(a), 0.5)) for a, auc in result["mia"].items()
    }
    result["privleak"] = result["privleak_by_attack"][PRIVLEAK_ATTACK]
    result["privleak_reference"] = "gold" if gold_ref else "auc=0.5 (no gold; OpenUnlearning ref_value)"
    result["forget_quality"] = None
    if gold_ref and len(result["forget_truth_ratios"]) and len(gold_ref["forget_truth_ratios"]):
        result["forget_quality"] = M.forget_quality(
            result["forget_truth_ratios"], gold_ref["forget_truth_ratios"]
        )
    result["gold_reference"] = gold_reference(result)

    if robustness:
        log("robustness probes (jailbreak templates, paraphrased questions, relearning attack)")
        result["robustness"] = robustness_report(
            model, tokenizer, forget, batch_size=batch_size, max_new_tokens=max_new_tokens, seed=seed
        )
    result["settings"] = {
        "max_rows": max_rows,
        "max_new_tokens": max_new_tokens,
        "k": k,
        "gradnorm_p": GRADNORM_P,
        "seed": seed,
        "batch_size": batch_size,
    }
    result["time_s"] = time.perf_counter() - started
    return json_ready(result)


def utility_components(result: dict[str, Any]) -> dict[str, float]:
    """The nine MU values under OpenUnlearning's names (NaN where a set is missing)."""

    def get(block: str, key: str) -> float:
        return float(result.get(block, {}).get(key, math.nan))

    return {
        "retain_Q_A_Prob": get("retain", "Prob"),
        "retain_Q_A_ROUGE": get("retain", "ROUGE"),
        "retain_Truth_Ratio": get("retain", "truth_ratio"),
        "ra_Q_A_Prob_normalised": get("real_authors", "Prob_normalised"),
        "ra_Q_A_ROUGE": get("real_authors", "ROUGE"),
        "ra_Truth_Ratio": get("real_authors", "truth_ratio"),
        "wf_Q_A_Prob_normalised": get("world_facts", "Prob_normalised"),
        "wf_Q_A_ROUGE": get("world_facts", "ROUGE"),
        "wf_Truth_Ratio": get("world_facts", "truth_ratio"),
    }


def _finite(value: Any, default: float) -> float:
    return float(value) if value is not None and math.isfinite(float(value)) else default


def json_ready(value: Any) -> Any:
    """JSON-ready: numpy scalars to Python, NaN / inf to None, recursively."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, np.ndarray):
        return [json_ready(v) for v in value.tolist()]
    if isinstance(value, (np.floating, float)):
        return float(value) if math.isfinite(float(value)) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


__all__ = [
    "DatasetError",
    "as_gold",
    "evaluate_split",
    "gold_reference",
    "json_ready",
    "reference_for_gold",
    "split_files",
]
