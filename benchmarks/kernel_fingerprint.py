"""Which of torch's CPU kernels give the same bits on this machine as on another.

A bench build is bit-reproducible only where every kernel it runs rounds the same way. This prints, for a
dozen ops at fixed inputs on one thread, a short hash of each result (and how many `sqrt` values miss the
correctly rounded one), so two machines, or one machine under other kernel settings, compare op by op:

    .venv/bin/python benchmarks/kernel_fingerprint.py
    ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2 .venv/bin/python benchmarks/kernel_fingerprint.py
    qemu-x86_64 -cpu EPYC-Milan .venv/bin/python benchmarks/kernel_fingerprint.py   # another CPU, emulated

Equal lines are necessary for two machines to build the same weights, not sufficient (the bench runs more
ops than these). `docs/results.md` ("Builds are bit-reproducible on one kind of CPU") has what it found.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from blade_core.build_common import cpu_identity, mkl_settings


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:10]


def adamw_after_cross_entropy(x: torch.Tensor) -> torch.Tensor:
    """Two AdamW steps of a linear layer under cross-entropy: a forward, a backward and an optimiser step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(x.shape[-1], 256)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    labels = torch.arange(x.shape[0] * x.shape[1]) % 256
    for _ in range(2):
        F.cross_entropy(layer(x).flatten(0, 1), labels).backward()
        opt.step()
        opt.zero_grad()
    return layer.weight


def fingerprint() -> dict[str, str]:
    # Inputs from numpy: torch.randn itself is vectorised, so its draws differ by instruction set.
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((4, 33, 96), dtype=np.float32))
    w = torch.from_numpy(rng.standard_normal((256, 96), dtype=np.float32))
    heads = x.reshape(4, 33, 3, 32).transpose(1, 2)
    ops: dict[str, Callable[[], torch.Tensor]] = {
        "linear": lambda: F.linear(x, w),
        "matmul_tn": lambda: x.flatten(0, 1).T @ x.flatten(0, 1),
        "bmm": lambda: torch.bmm(x, x.transpose(1, 2)),
        "softmax": lambda: F.softmax(x, -1),
        "log_softmax": lambda: F.log_softmax(x, -1),
        "exp": lambda: x.exp(),
        "sqrt": lambda: x.abs().sqrt(),
        "sum": lambda: x.sum(-1),
        "silu": lambda: F.silu(x),
        "sdpa": lambda: F.scaled_dot_product_attention(heads, heads, heads, is_causal=True),
        "adamw_ce": lambda: adamw_after_cross_entropy(x),
    }
    out = {name: digest(op()) for name, op in ops.items()}
    exact = torch.from_numpy(np.sqrt(x.abs().numpy().astype(np.float64)).astype(np.float32))
    out["sqrt_not_correctly_rounded"] = str(int((x.abs().sqrt() != exact).sum()))
    return out


def main() -> None:
    torch.set_num_threads(1)
    print(f"{cpu_identity()}; MKL settings {mkl_settings() or 'none'}; torch {torch.__version__}, 1 thread")
    for name, value in fingerprint().items():
        print(f"  {name:28s} {value}")


if __name__ == "__main__":
    main()
