"""The fused LM-head losses equal the logits-based ones in value and gradient (hidden states and head)."""

from __future__ import annotations

import pytest
import torch

from blade_core.losses import (
    IGNORE_INDEX,
    clamped_entropy_loss,
    counted_mask,
    fused_clamped_entropy_loss,
    fused_token_cross_entropy,
    mean_token_entropy,
    token_cross_entropy,
)

B, T, D, V = 3, 7, 5, 11


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    head = torch.randn(V, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2] = IGNORE_INDEX  # prompt tokens
    labels[2, 5:] = IGNORE_INDEX  # padding
    attention = torch.ones(B, T, dtype=torch.long)
    attention[2, 5:] = 0
    return hidden, head, labels, attention


def _grads(loss_fn, hidden, head):
    h = hidden.clone().requires_grad_(True)
    w = head.clone().requires_grad_(True)
    loss = loss_fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_fused_cross_entropy_matches_logits_version(chunk):
    hidden, head, labels, _ = _inputs()
    ref = _grads(lambda h, w: token_cross_entropy(h @ w.T, labels, chunk=chunk), hidden, head)
    got = _grads(lambda h, w: fused_token_cross_entropy(h, w, labels, chunk=chunk), hidden, head)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("tau", [0.7, 0.9])
def test_fused_clamped_entropy_matches_logits_version(chunk, tau):
    hidden, head, labels, attention = _inputs(1)
    mask = counted_mask(labels, attention, "all")
    ref = _grads(lambda h, w: clamped_entropy_loss(h @ w.T, mask, tau, chunk=chunk), hidden, head)
    got = _grads(lambda h, w: fused_clamped_entropy_loss(h, w, mask, tau, chunk=chunk)[0], hidden, head)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(a, b)
    logp = torch.log_softmax(hidden @ head.T, dim=-1)
    active = -(logp.exp() * logp).sum(-1) < tau * torch.log(torch.tensor(float(V)))  # (B, T)
    counted = mask[:, 1:].bool()  # position t predicts token t+1
    assert bool(active[:, :-1][counted].any()) and bool((~active[:, :-1][counted]).any())  # both regimes
    _, entropy = fused_clamped_entropy_loss(hidden, head, mask, tau, chunk=chunk)
    assert entropy == pytest.approx(mean_token_entropy(hidden @ head.T, mask, chunk=chunk))


def test_fused_loss_with_a_frozen_head_gives_no_head_gradient():
    hidden, head, labels, _ = _inputs(2)
    h = hidden.clone().requires_grad_(True)
    loss = fused_token_cross_entropy(h, head, labels)  # head does not require grad (LoRA: lm_head frozen)
    loss.backward()
    assert h.grad is not None and h.grad.abs().sum() > 0 and head.grad is None


def test_fused_entropy_is_zero_gradient_in_the_deadzone():
    hidden, head, labels, attention = _inputs(3)
    mask = counted_mask(labels, attention, "all")
    h = (hidden * 0.0).requires_grad_(True)  # uniform predictions: H = log V >= tau*log V
    loss, entropy = fused_clamped_entropy_loss(h, head, mask, 0.9)
    loss.backward()
    assert float(loss.detach()) == 0.0 and entropy == pytest.approx(1.0) and float(h.grad.abs().sum()) == 0.0


def _head_products(loss_fn, hidden, head) -> list[tuple[list[int], list[int]]]:
    """The shapes of every matrix product the loss's forward and backward make (torch's profiler)."""
    h = hidden.clone().requires_grad_(True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        loss_fn(h, head).backward()
    return [(e.input_shapes[0], e.input_shapes[1]) for e in prof.events() if e.name == "aten::mm"]


def test_only_counted_positions_go_through_the_head():
    hidden, head, labels, _ = _inputs(4)
    counted = int((labels[:, 1:] != IGNORE_INDEX).sum())  # position t predicts label t+1
    assert counted < B * T - B  # prompt and padding positions exist
    products = _head_products(lambda h, w: fused_token_cross_entropy(h, w, labels, chunk=64), hidden, head)
    logits = [a for a, b in products if b == [D, V]]  # h W^T
    grads = [a for a, b in products if b == [V, D]]  # dL/dz W
    assert logits == [[counted, D]] and grads == [[counted, V]]
