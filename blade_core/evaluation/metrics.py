"""Unlearning metrics as pure functions of per-row statistics (no model, no torch).

Definitions follow OpenUnlearning (locuslab/open-unlearning) so figures are comparable with the literature;
each docstring names the file it mirrors. Inputs are what `blade_core.evaluation.scoring` returns per row:
mean answer-token NLLs, answer-token log-probs, argmax ids, and (for Min-K%++) the mean / variance of
log p over the vocabulary at each position. Conventions:

- A "row" is one question/answer pair (or one text); aggregates are plain means over rows.
- MIA scores are signed like a loss (higher = less likely a member), and AUC labels forget as 0 and holdout
  as 1, so AUC -> 1 when the forget rows look far more "seen" than the holdout rows (OpenUnlearning's
  `evals/metrics/mia/utils.py::mia_auc` convention; a retrained model sits near 0.5). The exception is
  GradNorm, signed as OpenUnlearning signs it (see `mia_gradnorm_score`).

Departures from OpenUnlearning are noted where they occur (see `truth_ratio_values` for the epsilon,
`model_utility` for zero handling). Run the hand-computed checks with `pytest tests/test_metrics.py`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

EPS = 1e-10  # OpenUnlearning's guard in truth ratio, normalised prob, forget quality and privleak


# ---------------------------------------------------------------------------------------------------------
# Probability
# ---------------------------------------------------------------------------------------------------------


def prob_from_nll(mean_nll: float | Sequence[float] | np.ndarray) -> np.ndarray:
    """Length-normalised answer probability exp(-mean token NLL), elementwise.

    OpenUnlearning `evals/metrics/utils.py::evaluate_probability`: per row, the summed cross-entropy over the
    answer tokens divided by their count, then `exp(-avg_loss)`.
    """
    return np.exp(-np.asarray(mean_nll, dtype=np.float64))


def mean_nll(token_logprobs: Sequence[float] | np.ndarray) -> float:
    """Mean negative log-likelihood of one row's scored tokens (NaN when the row has none)."""
    lp = np.asarray(token_logprobs, dtype=np.float64)
    return float(-lp.mean()) if lp.size else math.nan


def mean_prob(mean_nlls: Sequence[float] | np.ndarray) -> float:
    """Prob: the mean over rows of exp(-mean answer-token NLL).

    OpenUnlearning `memorization.py::probability`.

    Rows with no scored tokens (NaN) are skipped, as OpenUnlearning skips `None`.
    """
    p = prob_from_nll(mean_nlls)
    p = p[~np.isnan(p)]
    return float(p.mean()) if p.size else math.nan


def _rows(wrong_nll, n: int) -> list[np.ndarray]:
    """Perturbed-answer NLLs as one array per row (rows may hold different numbers of perturbed answers)."""
    rows = [np.asarray(r, dtype=np.float64).reshape(-1) for r in wrong_nll]
    if len(rows) != n:
        raise ValueError(f"{len(rows)} rows of perturbed answers for {n} rows of correct answers")
    if any(r.size == 0 for r in rows):
        raise ValueError("every row needs at least one perturbed answer")
    return rows


def normalised_prob_values(
    correct_nll: Sequence[float] | np.ndarray, wrong_nll: Sequence[Sequence[float] | np.ndarray] | np.ndarray
) -> np.ndarray:
    """Per-row answer probability normalised against the perturbed (wrong) options.

    OpenUnlearning `memorization.py::probability_w_options` (the probe sets' `*_Q_A_Prob_normalised`):
    `p_correct / (p_correct + sum_j p_wrong_j + 1e-10)`, every p being the length-normalised exp(-avg NLL).
    `correct_nll`: (N,) mean NLL of the true answer; `wrong_nll`: (N, M) mean NLL of each perturbed answer
    (M may vary by row).
    """
    correct = prob_from_nll(correct_nll)  # (N,)
    wrong = np.array([prob_from_nll(row).sum() for row in _rows(wrong_nll, len(correct))])  # (N,)
    return correct / (correct + wrong + EPS)


def normalised_prob(correct_nll, wrong_nll) -> float:
    """Mean of `normalised_prob_values` over rows."""
    return float(np.mean(normalised_prob_values(correct_nll, wrong_nll)))


# ---------------------------------------------------------------------------------------------------------
# Truth ratio and forget quality
# ---------------------------------------------------------------------------------------------------------


def truth_ratio_values(
    correct_nll: Sequence[float] | np.ndarray, wrong_nll: Sequence[Sequence[float] | np.ndarray] | np.ndarray
) -> np.ndarray:
    """Per-row truth ratio TR = P_wrong / P_correct, both length-normalised.

    OpenUnlearning `memorization.py::truth_ratio`: the perturbed answers' mean NLLs are averaged first
    (`aggregate_to_1D`), so P_wrong = exp(-mean_j avgNLL_j) is the geometric mean of the perturbed answers'
    length-normalised probabilities; P_correct = exp(-avgNLL) of the paraphrased answer on forget / retain
    (`*_Q_A_PARA_Prob`) and of the answer itself on the probe sets (`*_Q_A_Prob`). TR = P_wrong / (P_correct
    + 1e-10). `correct_nll`: (N,), `wrong_nll`: (N, M), M may vary by row.
    """
    correct = prob_from_nll(correct_nll)  # (N,)
    wrong_avg = np.array([np.mean(row) for row in _rows(wrong_nll, len(correct))])  # (N,)
    return np.exp(-wrong_avg) / (correct + EPS)


def truth_ratio_forget(tr: Sequence[float] | np.ndarray) -> float:
    """Forget-set truth ratio: mean of min(TR, 1/TR); 1 when true and false answers are equally likely.

    OpenUnlearning `truth_ratio` with aggregator `closer_to_1_better`: `mean(minimum(tr, 1 / (tr + 1e-10)))`.
    """
    tr = np.asarray(tr, dtype=np.float64)
    return float(np.mean(np.minimum(tr, 1.0 / (tr + EPS))))


def truth_ratio_retain(tr: Sequence[float] | np.ndarray) -> float:
    """Retain / probe-set truth ratio: mean of max(0, 1 - TR); high when the true answer beats the false ones.

    OpenUnlearning `truth_ratio` with aggregator `true_better`.
    """
    tr = np.asarray(tr, dtype=np.float64)
    return float(np.mean(np.maximum(0.0, 1.0 - tr)))


def forget_quality(model_tr: Sequence[float] | np.ndarray, gold_tr: Sequence[float] | np.ndarray) -> float:
    """Forget quality: p-value of the two-sample KS test between the model's and the gold (retrained)
    model's per-row forget truth ratios. High (-> 1) means indistinguishable from retraining.

    OpenUnlearning `evals/metrics/utils.py::get_forget_quality`: `ks_2samp(1/(tr+1e-10), 1/(ref+1e-10))`.
    The KS statistic is invariant under the monotone map x -> 1/x, so this equals the test on TR itself.
    """
    from scipy.stats import ks_2samp

    m = np.asarray(model_tr, dtype=np.float64)
    g = np.asarray(gold_tr, dtype=np.float64)
    return float(ks_2samp(1.0 / (m + EPS), 1.0 / (g + EPS)).pvalue)


# ---------------------------------------------------------------------------------------------------------
# ROUGE
# ---------------------------------------------------------------------------------------------------------

_SCORER = None


def rouge_l_scorer() -> Any:
    """The process's one `rouge_score.RougeScorer(["rougeL"], use_stemmer=True)`, built on first use
    (importing rouge_score pulls in nltk and scipy). OpenUnlearning builds the same in
    `eval_text_similarity`; ROUGE-L recall and MUSE's F1 both read it."""
    global _SCORER
    if _SCORER is None:
        from rouge_score import rouge_scorer

        _SCORER = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return _SCORER


def rouge_l_recall_values(generations: Sequence[str], references: Sequence[str]) -> list[float]:
    """Per-row ROUGE-L recall of each generation against its reference answer.

    OpenUnlearning `evals/metrics/utils.py::eval_text_similarity`: `rouge_score.RougeScorer(["rouge1",
    "rougeL"], use_stemmer=True).score(ground_truth, generation)["rougeL"].recall` (reference first).
    """
    if len(generations) != len(references):
        raise ValueError(f"{len(generations)} generations for {len(references)} references")
    scorer = rouge_l_scorer()
    pairs = zip(generations, references, strict=True)
    return [float(scorer.score(ref, gen)["rougeL"].recall) for gen, ref in pairs]


def rouge_l_recall(generations: Sequence[str], references: Sequence[str]) -> float:
    """ROUGE: mean ROUGE-L recall over rows (OpenUnlearning `memorization.py::rouge`, `rougeL_recall`)."""
    values = rouge_l_recall_values(generations, references)
    return float(np.mean(values)) if values else math.nan


# ---------------------------------------------------------------------------------------------------------
# Memorisation (teacher-forced)
# ---------------------------------------------------------------------------------------------------------


def exact_memorization(pred_ids: Sequence[int] | np.ndarray, label_ids: Sequence[int] | np.ndarray) -> float:
    """EM of one row: fraction of answer tokens whose teacher-forced argmax prediction equals the label.

    OpenUnlearning `memorization.py::exact_memorization` (there the final EOS label is dropped before this;
    `tofu.evaluate_split` does the same). NaN for an empty row (OpenUnlearning: None).
    """
    p, y = np.asarray(pred_ids), np.asarray(label_ids)
    return float((p == y).mean()) if y.size else math.nan


def extraction_strength(pred_ids: Sequence[int] | np.ndarray, label_ids: Sequence[int] | np.ndarray) -> float:
    """ES of one row: 1 - k/n for the smallest k such that the teacher-forced predictions of the suffix
    y[k:] all match (Carlini et al., 2021), as implemented by OpenUnlearning
    `memorization.py::extraction_strength`.

    Mirrored quirk of that implementation: k only runs to n-1, so a row whose last token is also wrong
    scores 1/n rather than 0; an empty row scores 0.
    """
    p, y = np.asarray(pred_ids), np.asarray(label_ids)
    n = y.size
    if n == 0:
        return 0.0
    k = 0
    for k in range(n):
        if np.array_equal(p[k:], y[k:]):
            break
    return 1.0 - k / n


# ---------------------------------------------------------------------------------------------------------
# Membership inference (scores signed like a loss: higher = less likely a member)
# ---------------------------------------------------------------------------------------------------------


def mia_loss_score(token_logprobs: Sequence[float] | np.ndarray) -> float:
    """LOSS attack (Yeom et al., 2018): the row's mean answer-token NLL (OpenUnlearning `mia/loss.py`)."""
    return mean_nll(token_logprobs)


def mia_zlib_score(mean_nll_value: float, text: str) -> float:
    """ZLib attack (Carlini et al., 2021): mean NLL / zlib-compressed length in bytes of the target text.

    OpenUnlearning `mia/zlib.py`: `avg_loss / len(zlib.compress(text.encode("utf-8")))`, the text being the
    decoded answer tokens.
    """
    return float(mean_nll_value) / len(zlib.compress(text.encode("utf-8")))


def mia_min_k_score(token_logprobs: Sequence[float] | np.ndarray, k: float = 0.4) -> float:
    """Min-K% Prob (Shi et al., 2024): minus the mean of the lowest k-fraction of token log-probs.

    OpenUnlearning `mia/min_k.py`: `num_k = max(1, int(len * k))`, `-mean(sort(lp)[:num_k])`; 0 when empty.
    """
    lp = np.sort(np.asarray(token_logprobs, dtype=np.float64))
    if lp.size == 0:
        return 0.0
    num_k = max(1, int(len(lp) * k))
    return float(-lp[:num_k].mean())


def mia_min_k_plus_plus_score(
    token_logprobs: Sequence[float] | np.ndarray,
    mu: Sequence[float] | np.ndarray,
    sigma2: Sequence[float] | np.ndarray,
    k: float = 0.4,
) -> float:
    """Min-K%++ (Zhang et al., 2024): Min-K% over the standardised token log-probs (lp - mu) / sqrt(sigma2).

    `mu` = E_{z~p}[log p(z)] and `sigma2` = Var_{z~p}[log p(z)] of the full next-token distribution at each
    position. OpenUnlearning `mia/min_k_plus_plus.py` (sigma2 clamped at 1e-6); 0 when empty.
    """
    lp = np.asarray(token_logprobs, dtype=np.float64)
    if lp.size == 0:
        return 0.0
    var = np.maximum(np.asarray(sigma2, dtype=np.float64), 1e-6)
    z = (lp - np.asarray(mu, dtype=np.float64)) / np.sqrt(var)
    num_k = max(1, int(len(z) * k))
    return float(-np.sort(z)[:num_k].mean())


def mia_gradnorm_score(grad_norm: float) -> float:
    """GradNorm attack score: -(mean over weight tensors of ||d loss / d W||_p) of one row.

    OpenUnlearning `evals/metrics/mia/gradnorm.py::compute_score` (arXiv 2402.17012). Its sign is the
    opposite of the loss-like scores above: a seen row has a small gradient and so the *higher* score, and
    `mia_auc` (forget 0, holdout 1) tends to 0, not 1, on a model that still knows the forget rows. Kept as
    OpenUnlearning reports it.
    """
    return -float(grad_norm)


def mia_auc(forget_scores: Sequence[float], holdout_scores: Sequence[float]) -> float:
    """AUC-ROC of forget (label 0) vs holdout (label 1) on loss-signed scores (scikit-learn).

    OpenUnlearning `mia/utils.py::mia_auc`: 1 when the forget rows look much more "seen" than the holdout
    rows, ~0.5 for a model that never saw either. NaN when either side is empty.
    """
    from sklearn.metrics import roc_auc_score

    if len(forget_scores) == 0 or len(holdout_scores) == 0:
        return math.nan
    scores = np.asarray(list(forget_scores) + list(holdout_scores), dtype=np.float64)
    labels = np.array([0] * len(forget_scores) + [1] * len(holdout_scores))
    return float(roc_auc_score(labels, scores))


def privleak(auc: float, gold_auc: float = 0.5) -> float:
    """PrivLeak (MUSE, Shi et al., 2024): relative gap (%) between the model's and the gold model's MIA AUC.

    OpenUnlearning `evals/metrics/privacy.py::privleak` converts its AUC to MUSE's convention first:
    `((1 - auc) - (1 - ref)) / ((1 - ref) + 1e-10) * 100`. Near 0 is ideal; strongly negative means the
    forget set is still recognisable (under-unlearning), positive means over-unlearning. `ref` defaults to
    OpenUnlearning's `ref_value` 0.5 when no gold model is available.
    """
    score, ref = 1.0 - auc, 1.0 - gold_auc
    return float((score - ref) / (ref + EPS) * 100.0)


# ---------------------------------------------------------------------------------------------------------
# Aggregates
# ---------------------------------------------------------------------------------------------------------

MU_COMPONENTS: tuple[str, ...] = (
    "retain_Q_A_Prob",
    "retain_Q_A_ROUGE",
    "retain_Truth_Ratio",
    "ra_Q_A_Prob_normalised",
    "ra_Q_A_ROUGE",
    "ra_Truth_Ratio",
    "wf_Q_A_Prob_normalised",
    "wf_Q_A_ROUGE",
    "wf_Truth_Ratio",
)  # OpenUnlearning configs/eval/tofu_metrics/model_utility.yaml (`hm_aggregate` pre_compute)


def harmonic_mean(values: Sequence[float]) -> float:
    """Harmonic mean (scipy.stats.hmean); 0 when any value is 0, NaN when any is NaN or negative.

    scipy's hmean rejects zeros in some versions; a zero component means zero utility, as the limit gives.
    """
    from scipy.stats import hmean

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or np.isnan(v).any() or (v < 0).any():
        return math.nan
    if (v == 0).any():
        return 0.0
    return float(hmean(v))


def model_utility(components: Sequence[float] | dict[str, float]) -> float:
    """MU: harmonic mean of the nine retain / real-authors / world-facts values.

    OpenUnlearning `evals/metrics/utility.py::hm_aggregate` over `MU_COMPONENTS`: retain Prob, ROUGE, truth
    ratio; real-authors normalised Prob, ROUGE, truth ratio; world-facts normalised Prob, ROUGE, truth ratio.
    A dict must carry exactly those keys.
    """
    if isinstance(components, dict):
        missing = [k for k in MU_COMPONENTS if k not in components]
        if missing:
            raise ValueError(f"model_utility: missing components {missing}")
        values = [components[k] for k in MU_COMPONENTS]
    else:
        values = list(components)
        if len(values) != len(MU_COMPONENTS):
            raise ValueError(f"model_utility needs {len(MU_COMPONENTS)} values, got {len(values)}")
    return harmonic_mean(values)


def hm_score(mu: float, prob: float, rouge: float) -> float:
    """HM = hmean(MU, 1 - Prob, 1 - ROUGE) (BLADE paper, Table 1): utility kept and forget knowledge gone,
    Prob and ROUGE being the forget split's."""
    return harmonic_mean([mu, 1.0 - prob, 1.0 - rouge])
