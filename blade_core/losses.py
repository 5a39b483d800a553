"""Token losses of causal LMs, computed over chunks of positions so extra memory is O(chunk x V).

Every loss takes the model's logits (B, T, V) and labels/mask (B, T) *unshifted*: position t predicts token
t+1. The logits are flattened to a (B*T, V) view (no copy) and each position gets a weight: 1/n_counted where
the next token is counted, else 0 (the last position of each row always 0). The per-position loss and its
gradient are then computed by a custom autograd function chunk by chunk in fp32: the forward saves only the
logits (the model's own tensor) and the weights, and the backward writes each chunk's gradient straight into
the one (B*T, V) gradient buffer autograd needs anyway. So neither pass materialises an fp32 copy of the
logits (a plain `log_softmax(logits.float())` would, and would keep it alive for backward).

Departure from the paper: none in value; the chunking is purely a memory device (tested equal to the naive
computation in value and gradient, `tests/test_engine_losses.py`).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DEFAULT_CHUNK = 256  # positions per chunk: 256 x 128k vocab x 4 bytes = 128 MiB of fp32 scratch at most


def shift_weights(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask of counted *target* tokens -> (B*T,) per-position weights of the predicting positions,
    each 1/n (mean over counted tokens); position t is weighted by mask[t+1], the last position by 0."""
    weights = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    weights[:, :-1] = mask[:, 1:].to(torch.float32)
    return (weights / weights.sum().clamp(min=1.0)).reshape(-1)


def shift_targets(labels: torch.Tensor) -> torch.Tensor:
    """(B, T) labels -> (B*T,) target of each position (the next label; -100 at the end of each row)."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets.reshape(-1)


def _entropy_chunk(
    z: torch.Tensor, threshold: float, want_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Chunk (n, V) -> (loss (n,), dloss/dz (n, V) or None, H (n,)) of max(0, threshold - H(softmax z)).
    The gradient is None when not wanted, and when every row is in the deadzone (H >= threshold), where it
    is exactly zero.

    Two (n, V) buffers at most: log p, then p log p in place of it, then the gradient in place of that.
    """
    logp = F.log_softmax(z.float(), dim=-1)  # (n, V)
    p = logp.exp()
    plogp = logp.mul_(p)  # (n, V), reuses log p's buffer
    entropy = -plogp.sum(-1)  # (n,)
    loss = (threshold - entropy).clamp(min=0.0)
    active = entropy < threshold  # outside it, the deadzone: no gradient once H >= threshold
    if not want_grad or not bool(active.any()):
        return loss, None, entropy
    # d/dz_j [threshold - H] = p_j (log p_j + H) = p_j log p_j + p_j H
    grad = plogp.addcmul_(p, entropy[:, None]).mul_(active.float()[:, None])
    return loss, grad, entropy


def _cross_entropy_chunk(
    z: torch.Tensor, target: torch.Tensor, want_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 chunk (n, V), targets (n,) -> (loss (n,), dloss/dz (n, V) or None) of -log softmax(z)[target]."""
    logp = F.log_softmax(z.float(), dim=-1)  # (n, V)
    safe = target.clamp(min=0)
    loss = -logp.gather(1, safe[:, None]).squeeze(1)
    valid = (target != IGNORE_INDEX).float()
    if not want_grad:
        return loss * valid, None
    grad = logp.exp_()
    grad[torch.arange(len(safe), device=z.device), safe] -= 1.0
    return loss * valid, grad.mul_(valid[:, None])


class _ChunkedTokenLoss(torch.autograd.Function):
    """sum_i w_i * loss_i(logits_i) over positions i, evaluated in chunks of positions (module docstring)."""

    @staticmethod
    def forward(  # logits2d (N, V), weights (N,)
        ctx: Any,
        logits2d: torch.Tensor,
        weights: torch.Tensor,
        targets: torch.Tensor,
        kind: str,
        param: float,
        chunk: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits2d.device)
        for start in range(0, logits2d.shape[0], chunk):
            sl = slice(start, start + chunk)
            with torch.no_grad():
                if kind == "entropy":
                    loss, _, _ = _entropy_chunk(logits2d[sl], param, want_grad=False)
                else:
                    loss, _ = _cross_entropy_chunk(logits2d[sl], targets[sl], want_grad=False)
            total += (loss * weights[sl]).sum()
        ctx.save_for_backward(logits2d, weights, targets)
        ctx.kind, ctx.param, ctx.chunk = kind, param, chunk
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits2d, weights, targets = ctx.saved_tensors
        grad = torch.empty_like(logits2d)  # (N, V) in the logits' dtype: the buffer autograd needs anyway
        for start in range(0, logits2d.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            if ctx.kind == "entropy":
                _, g, _ = _entropy_chunk(logits2d[sl], ctx.param)
            else:
                _, g = _cross_entropy_chunk(logits2d[sl], targets[sl])
            if g is None:  # every row in the deadzone
                grad[sl] = 0.0
            else:
                grad[sl] = g.mul_((weights[sl] * grad_out)[:, None])  # in place: no third (chunk, V) buffer
        return grad, None, None, None, None, None


def _flat(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.shape[-1])  # (B*T, V), a view for contiguous logits


def counted_mask(
    batch_labels: torch.Tensor, attention_mask: torch.Tensor, counted: Literal["all", "answer"] = "all"
) -> torch.Tensor:
    """(B, T) mask of the tokens a forget loss counts: every non-padding token, or answer tokens only."""
    return (batch_labels != IGNORE_INDEX) if counted == "answer" else attention_mask.bool()


def clamped_entropy_loss(
    logits: torch.Tensor, mask: torch.Tensor, tau: float, *, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """BLADE forget loss (paper Eq. 3): L_fgt = mean_{t counted} max(0, tau*log V - H(p_t)),
    H(p_t) = -sum_v p_t(v) log p_t(v) over the full vocabulary. Gradient is exactly zero once H >= tau*log V.

    logits (B, T, V); mask (B, T) marks counted target tokens (see `counted_mask`). Extra memory O(chunk x V).
    """
    threshold = tau * math.log(logits.shape[-1])
    weights = shift_weights(mask)
    targets = torch.empty(0, dtype=torch.long, device=logits.device)
    loss: torch.Tensor = _ChunkedTokenLoss.apply(_flat(logits), weights, targets, "entropy", threshold, chunk)
    return loss


def token_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Retain loss: L_ret = mean_{t: label_t != -100} -log p_{t-1}(label_t), next-token CE on labelled tokens.

    logits (B, T, V); labels (B, T) with -100 on prompt/padding. Extra memory O(chunk x V).
    """
    weights = shift_weights(labels != IGNORE_INDEX)
    loss: torch.Tensor = _ChunkedTokenLoss.apply(
        _flat(logits), weights, shift_targets(labels), "ce", 0.0, chunk
    )
    return loss


# ------------------------------------------------------------ fused with the LM head (no (B, T, V) logits)


class _FusedLinearTokenLoss(torch.autograd.Function):
    """sum_i w_i * loss_i(h_i W^T) over positions i, never holding more than one (chunk, V) block of logits.

    In the spirit of Liger-Kernel's fused linear losses: the forward computes each chunk's logits from the
    final hidden states, its loss and its logit gradient, and folds that gradient straight into dL/dh (N, d)
    and, when the head is trainable, dL/dW (V, d); backward only rescales them by the incoming gradient.
    Only the counted positions (w_i != 0) go through the head: every other position's loss and gradient are
    exactly 0, and a QA batch's retain CE counts its answers alone (~40 % of its positions in our worlds).
    Also returns the weighted sum of token entropies (for monitoring; no gradient).
    """

    @staticmethod
    def forward(  # hidden2d (N, d), head (V, d)
        ctx: Any,
        hidden2d: torch.Tensor,
        head: torch.Tensor,
        weights: torch.Tensor,
        targets: torch.Tensor,
        kind: str,
        param: float,
        chunk: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden2d.device)
        entropy_sum = torch.zeros((), dtype=torch.float32, device=hidden2d.device)
        grad_h = torch.zeros_like(hidden2d) if want_h else None
        grad_w = torch.zeros(head.shape, dtype=torch.float32, device=head.device) if want_w else None
        want_grad = want_h or want_w
        counted = torch.nonzero(weights, as_tuple=True)[0]  # the positions with a loss (not prompt, padding)
        losses = torch.zeros_like(weights)  # w_i * loss_i of every position (N,), 0 where not counted
        entropies = torch.zeros_like(weights) if kind == "entropy" else None  # w_i * H_i likewise
        for start in range(0, len(counted), chunk):
            rows = counted[start : start + chunk]
            w, h = weights[rows], hidden2d[rows]
            z = h @ head.T  # (n, V) in the model's dtype
            if entropies is not None:
                loss, g, entropy = _entropy_chunk(z, param, want_grad=want_grad)
                entropies[rows] = entropy * w
            else:
                loss, g = _cross_entropy_chunk(z, targets[rows], want_grad=want_grad)
            losses[rows] = loss * w
            if g is None:  # not wanted, or every row in the deadzone: grad_h keeps its zeros
                continue
            g = g.mul_(w[:, None])  # (n, V) fp32: dL/dz of this chunk
            if grad_h is not None:
                grad_h[rows] = (g.to(head.dtype) @ head).to(grad_h.dtype)  # (n, d)
            if grad_w is not None:
                grad_w += g.T @ h.float()  # (V, d)
        # Summed by chunks of positions, as `_ChunkedTokenLoss` sums: the same float additions in the same
        # order whichever positions are counted.
        for start in range(0, hidden2d.shape[0], chunk):
            total += losses[start : start + chunk].sum()
            if entropies is not None:
                entropy_sum += entropies[start : start + chunk].sum()
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.head_dtype = head.dtype
        ctx.mark_non_differentiable(entropy_sum)
        return total, entropy_sum

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor, _grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        grad_h = saved.pop(0) * grad_out if ctx.has[0] else None
        grad_w = (saved.pop(0) * grad_out).to(ctx.head_dtype) if ctx.has[1] else None
        return grad_h, grad_w, None, None, None, None, None


def _flat_hidden(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.reshape(-1, hidden.shape[-1])  # (B*T, d)


def fused_clamped_entropy_loss(
    hidden: torch.Tensor, head: torch.Tensor, mask: torch.Tensor, tau: float, *, chunk: int = DEFAULT_CHUNK
) -> tuple[torch.Tensor, float]:
    """`clamped_entropy_loss` of the logits h W^T, from the final hidden states, without the (B, T, V) logits.

    hidden (B, T, d) (after the final norm); head (V, d) the LM-head weight; mask (B, T) as `counted_mask`.
    Returns (L_fgt, mean counted H(p_t) / log V for monitoring). Extra memory O(chunk x V + B*T*d + V*d).
    """
    vocab = head.shape[0]
    targets = torch.empty(0, dtype=torch.long, device=hidden.device)
    loss, entropy = _FusedLinearTokenLoss.apply(
        _flat_hidden(hidden), head, shift_weights(mask), targets, "entropy", tau * math.log(vocab), chunk
    )
    return loss, float(entropy) / math.log(vocab)


def fused_token_cross_entropy(
    hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, *, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """`token_cross_entropy` of the logits h W^T from the final hidden states, without (B, T, V) logits."""
    weights = shift_weights(labels != IGNORE_INDEX)
    loss: torch.Tensor
    loss, _ = _FusedLinearTokenLoss.apply(
        _flat_hidden(hidden), head, weights, shift_targets(labels), "ce", 0.0, chunk
    )
    return loss


@torch.no_grad()
def mean_token_entropy(logits: torch.Tensor, mask: torch.Tensor, *, chunk: int = DEFAULT_CHUNK) -> float:
    """Mean over counted target tokens of H(p_t) / log V (1 = uniform), for monitoring; O(chunk x V)."""
    flat, weights = _flat(logits), shift_weights(mask)
    total = 0.0
    for start in range(0, flat.shape[0], chunk):
        _, _, entropy = _entropy_chunk(flat[start : start + chunk], 0.0, want_grad=False)
        total += float((entropy * weights[start : start + chunk]).sum())
    return total / math.log(logits.shape[-1])


# Naive references (full fp32 copies): used by the tests and the benchmark, never by training.


def clamped_entropy_loss_naive(logits: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """Reference of `clamped_entropy_loss` by plain autograd over the whole (B, T-1, V) tensor."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)  # (B, T-1)
    m = mask[:, 1:].float()
    per_token = (tau * math.log(logits.shape[-1]) - entropy).clamp(min=0.0)
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


def token_cross_entropy_naive(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference of `token_cross_entropy` with F.cross_entropy."""
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
    )
