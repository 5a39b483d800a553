"""The SwiGLU MLP, down(silu(gate(x)) * up(x)), with its activation recomputed in the backward.

Autograd keeps three (B, T, I) tensors between the two projections and the product: gate(x) for SiLU's
backward, and silu(gate(x)) and up(x) for the product's. The first and the last determine the middle, so
`recomputed_swiglu` keeps only those two and computes silu(gate(x)) again in the backward (as Liger-Kernel's
SwiGLU does): one (B, T, I) tensor fewer per layer for every training forward, the same values, and the same
gradients bit for bit (the backward runs the very ops autograd would have run).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# The Hugging Face MLPs whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)), and the
# activations that are SiLU (transformers' own class for "silu", or torch's).
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
SILU = frozenset({"SiLUActivation", "SiLU"})


class _SiluTimes(torch.autograd.Function):
    """silu(gate) * up, saving gate and up only."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            grads = torch.autograd.grad(F.silu(g) * u, (g, u), grad)
        return grads[0], grads[1]


def _forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward, with the product taken by `_SiluTimes` (`self`: a module of SWIGLU_MLPS)."""
    out: torch.Tensor = self.down_proj(_SiluTimes.apply(self.gate_proj(x), self.up_proj(x)))
    return out


def swiglu_mlps(model: nn.Module) -> list[nn.Module]:
    """The model's MLPs that are SwiGLU (a known class whose activation is SiLU)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__ in SWIGLU_MLPS and type(getattr(m, "act_fn", None)).__name__ in SILU
    ]


@contextlib.contextmanager
def recomputed_swiglu(model: nn.Module) -> Iterator[int]:
    """Within the block, every SwiGLU MLP of `model` recomputes its activation in the backward; yields how
    many MLPs that is (0: nothing to change). Their own forward is back afterwards."""
    mlps = swiglu_mlps(model)
    for m in mlps:
        m.forward = types.MethodType(_forward, m)  # an instance attribute shadows the class's forward
    try:
        yield len(mlps)
    finally:
        for m in mlps:
            del m.forward
