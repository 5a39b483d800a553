"""Pure loss functions of the seven baselines (GradAscent, GradDiff, NPO, SimNPO, RMU, PDU, BLUR-NPO).

Every function takes tensors and hyperparameters and returns a tensor; none touches a model, so each is
checked against a naive reference in `tests/test_baselines.py`. Conventions (those of Hugging Face causal
LMs): `logits` (B, T, V) are the model outputs for `input_ids` (B, T); `labels` (B, T) equal the input ids on
answer tokens and -100 elsewhere (prompt and padding), and position t's logits predict token t+1.
The method files in `blade_core/methods/` run the models and call these.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed answer-token NLL per sequence and the number of answer tokens: ((B,), (B,)).

    NLL_i = -sum_t log p_theta(y_{i,t+1} | y_{i,<=t}) over the t whose next label is not -100.
    """
    shift_logits = logits[:, :-1, :].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    mask = shift_labels != IGNORE_INDEX  # (B, T-1)
    token_nll = F.cross_entropy(
        shift_logits.transpose(1, 2), shift_labels.masked_fill(~mask, 0), reduction="none"
    )  # (B, T-1)
    return (token_nll * mask).sum(dim=1), mask.sum(dim=1)


def token_mean_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean NLL over every answer token of the batch (what `model(..., labels=labels).loss` returns); scalar.

    This is the retain loss of GradDiff/NPO/SimNPO/PDU/BLUR-NPO and minus the GradAscent forget loss.
    """
    nll, count = sequence_nll(logits, labels)  # (B,), (B,)
    return nll.sum() / count.sum().clamp(min=1)


def grad_ascent_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GradAscent forget loss: L = -NLL(forget) (Jang et al. 2023; OpenUnlearning `GradAscent`); scalar."""
    return -token_mean_nll(logits, labels)


def npo_loss(nll: torch.Tensor, ref_nll: torch.Tensor, beta: float = 0.1) -> torch.Tensor:
    """NPO forget loss (Zhang et al. 2024, Eq. 3); scalar from per-sequence NLLs (B,) of the model and
    reference.

        L_NPO = -(2/beta) E[ log sigma( -beta log( pi_theta(y|x) / pi_ref(y|x) ) ) ]
              = -(2/beta) E[ log sigma( beta (NLL_theta - NLL_ref) ) ]

    with NLL summed over the answer tokens. As beta -> 0 it tends to GradAscent on the sequence NLL.
    """
    return -F.logsigmoid(beta * (nll - ref_nll)).mean() * 2.0 / beta


def simnpo_loss(
    nll: torch.Tensor, lengths: torch.Tensor, beta: float = 4.5, delta: float = 0.0
) -> torch.Tensor:
    """SimNPO forget loss (Fan et al. 2024, Eq. 4): reference-free NPO on the length-normalised NLL; scalar.

        L_SimNPO = -(2/beta) E[ log sigma( -(beta/|y|) log pi_theta(y|x) - delta ) ]
                 = -(2/beta) E[ log sigma( beta (NLL_theta/|y| - delta) ) ]

    `nll` (B,) summed answer-token NLL, `lengths` (B,) answer-token counts; `delta` is the reward margin
    (called gamma in the SimNPO paper, delta in OpenUnlearning), written as OpenUnlearning computes it.
    """
    normalised = nll / lengths.clamp(min=1) - delta  # (B,)
    return -F.logsigmoid(beta * normalised).mean() * 2.0 / beta


def logit_margin_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PDU forget loss (Entesari et al. 2025, "Constrained Entropic Unlearning", logit-margin flattening);
    scalar.

        L_margin = mean_t ( max_v z_{t,v} - mean_v z_{t,v} )^2

    which is zero exactly when every logit is equal, i.e. the next-token distribution is uniform. Averaged
    over the positions that predict answer tokens (the reference implementation averages over every position
    of the padded batch; we leave prompt and padding out so the loss is about the answers being forgotten).
    """
    shift_logits = logits[:, :-1, :].float()  # (B, T-1, V)
    mask = labels[:, 1:] != IGNORE_INDEX  # (B, T-1)
    margin = shift_logits.max(dim=-1).values - shift_logits.mean(dim=-1)  # (B, T-1)
    return (margin.pow(2) * mask).sum() / mask.sum().clamp(min=1)


def masked_activation_mse(hidden: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """RMU activation loss (Li et al. 2024, WMDP, Eq. 1-2, as in OpenUnlearning `RMU`); scalar.

        L = mean_i [ sum_t m_{i,t} mean_d (h_{i,t,d} - target_{i,t,d})^2 / sum_t m_{i,t} ]

    `hidden` (B, T, D), `target` (B, T, D) or broadcastable (1, 1, D), `mask` (B, T) selects the answer
    tokens. Forget: target = c * u (the steering vector); retain: target = the frozen model's hidden states.
    """
    per_token = (hidden.float() - target.float()).pow(2).mean(dim=-1)  # (B, T)
    mask = mask.to(per_token.dtype)
    per_row = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
    return per_row.mean()


def rmu_layer_index(num_layers: int, reference_layer: int = 7, reference_depth: int = 16) -> int:
    """The RMU layer scaled to depth: OpenUnlearning steers layer 7 of Llama-3.2-1B's 16 (7/16 of the
    depth)."""
    return min(num_layers - 1, max(0, round(reference_layer / reference_depth * num_layers)))


def rmu_control_vector(
    dim: int, steering_coeff: float = 2.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Fixed random control vector c * u/|u| with u ~ U[0, 1)^D (WMDP reference code); shape (1, 1, D)."""
    u = torch.rand(1, 1, dim, generator=generator)
    return u / u.norm() * steering_coeff


def pdu_dual_update(lam: float, retain_loss: float, epsilon: float, step_size: float) -> float:
    """PDU's symmetric dual ascent on the retain multiplier: lambda <- max(0, lambda + eta (L_ret - epsilon)).

    The multiplier grows while the retain constraint L_ret <= epsilon is violated and shrinks, by the same
    rule, while it holds with slack (Entesari et al. 2025, Alg. 1).
    """
    return max(0.0, lam + step_size * (retain_loss - epsilon))


def blur_combine(
    grad_forget: list[torch.Tensor], grad_retain: list[torch.Tensor], gamma: float = 1.0, eps: float = 1e-12
) -> tuple[list[torch.Tensor], float]:
    """BLUR update direction (Reisizadeh et al. 2025, Alg. 1, "forget lower"): retain gradient projected off
    the forget gradient, plus gamma times the forget gradient.

        d = g_r + xi g_f,   xi = gamma - <g_r, g_f> / ||g_f||^2
          = (g_r - proj_{g_f} g_r) + gamma g_f

    The lower-level (forget) objective keeps priority: to first order the retain part of the step does not
    change the forget loss. Inner products run over all parameters at once. Returns (d per parameter, xi).
    """
    dot = sum((r.double() * f.double()).sum() for r, f in zip(grad_retain, grad_forget, strict=True))
    norm_f = sum(f.double().pow(2).sum() for f in grad_forget)
    xi = gamma - float(dot) / max(float(norm_f), eps)
    if not math.isfinite(xi):
        xi = gamma
    return [r + xi * f for r, f in zip(grad_retain, grad_forget, strict=True)], xi
