"""The engine's token losses against naive references on hand-built tensors; the entropy deadzone."""

from __future__ import annotations

import math

import pytest
import torch

from blade_core.losses import (
    clamped_entropy_loss,
    clamped_entropy_loss_naive,
    counted_mask,
    mean_token_entropy,
    token_cross_entropy,
    token_cross_entropy_naive,
)


def _batch(seed: int = 0, b: int = 3, t: int = 9, v: int = 37, scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * scale
    attention = torch.ones(b, t, dtype=torch.long)
    attention[1, 6:] = 0  # padding at the end of row 1
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[:, :3] = -100  # prompt
    labels[attention == 0] = -100
    return logits, attention, labels


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
@pytest.mark.parametrize("tau", [0.3, 0.7, 0.95])
@pytest.mark.parametrize("counted", ["all", "answer"])
def test_clamped_entropy_chunked_equals_naive_in_value_and_gradient(chunk, tau, counted):
    logits, attention, labels = _batch()
    mask = counted_mask(labels, attention, counted)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    chunked = clamped_entropy_loss(a, mask, tau, chunk=chunk)
    naive = clamped_entropy_loss_naive(b, mask, tau)
    chunked.backward()
    naive.backward()
    assert chunked.item() == pytest.approx(naive.item(), rel=1e-6, abs=1e-7)
    assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5)
    assert a.grad.abs().sum() > 0  # some positions are below the target


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_cross_entropy_chunked_equals_naive_in_value_and_gradient(chunk):
    logits, _, labels = _batch(seed=1)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    token_cross_entropy(a, labels, chunk=chunk).backward()
    token_cross_entropy_naive(b, labels).backward()
    assert token_cross_entropy(logits, labels).item() == pytest.approx(
        token_cross_entropy_naive(logits, labels).item(), rel=1e-6
    )
    assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5)


def test_deadzone_gives_exactly_zero_gradient():
    v = 50
    logits = torch.zeros(1, 5, v)  # uniform: H = log V >= tau log V
    logits[0, 1] = torch.linspace(-1, 1, v)  # still near-uniform: H > 0.7 log V
    logits[0, 2, 0] = 30.0  # confident: H ~ 0, inside the active region
    logits.requires_grad_()
    mask = torch.ones(1, 5, dtype=torch.long)
    loss = clamped_entropy_loss(logits, mask, tau=0.7, chunk=2)
    loss.backward()
    grad = logits.grad[0]
    assert torch.equal(grad[0], torch.zeros(v)) and torch.equal(grad[1], torch.zeros(v))
    assert torch.equal(grad[3], torch.zeros(v))  # uniform again
    assert torch.equal(grad[4], torch.zeros(v))  # last position predicts nothing
    assert grad[2].abs().sum() > 0
    # value: only position 2 counts, out of 4 counted targets
    p = torch.softmax(logits[0, 2].detach(), -1)
    h2 = -(p * p.log()).sum().item()
    assert loss.item() == pytest.approx((0.7 * math.log(v) - h2) / 4, rel=1e-5)


def test_fully_uniform_batch_has_zero_loss_and_zero_gradient():
    logits = torch.zeros(2, 6, 64, requires_grad=True)
    loss = clamped_entropy_loss(logits, torch.ones(2, 6), tau=0.7)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0


def test_counted_tokens_all_vs_answer():
    _, attention, labels = _batch()
    assert torch.equal(counted_mask(labels, attention, "all"), attention.bool())
    assert torch.equal(counted_mask(labels, attention, "answer"), labels != -100)


def test_bf16_logits_get_bf16_gradient_and_fp32_value():
    logits, attention, _labels = _batch(seed=2)
    x = logits.to(torch.bfloat16).requires_grad_()
    loss = clamped_entropy_loss(x, attention, 0.7)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    ref = clamped_entropy_loss_naive(x.detach().float(), attention, 0.7)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_mean_token_entropy_is_normalised():
    uniform = torch.zeros(1, 4, 30)
    assert mean_token_entropy(uniform, torch.ones(1, 4)) == pytest.approx(1.0, rel=1e-6)
    peaked = torch.zeros(1, 4, 30)
    peaked[..., 0] = 50.0
    assert mean_token_entropy(peaked, torch.ones(1, 4)) < 1e-6
