"""Compaction: a stack of LoRA adapters as one adapter, exactly (concatenated factors) or SVD-truncated.

peft sums the deltas of the active adapters, so a stack of n adapters on one linear layer adds

    ΔW = Σ_i s_i B_i A_i,        s_i = alpha_i / r_i  (alpha_i / sqrt(r_i) with rsLoRA),

with A_i (r_i, in) and B_i (out, r_i). Stacking the factors gives one adapter with the same delta:

    A = [A_1; …; A_n]  (R, in),   B = [s_1 B_1, …, s_n B_n]  (out, R),   R = Σ r_i,   alpha = R  (s = 1),

exact in real arithmetic (floating point only reorders the sum). Layers some adapters leave out get zero
rows/columns, so every layer has rank R (one `r` in adapter_config.json, which vLLM and LoRAX want).
`truncate_svd` then keeps the top `rank` singular directions of B A (Eckart-Young: the best rank-k
approximation in Frobenius norm) and reports the relative error it made, per layer.

`verify_equivalent` is the gate a compacted adapter passes before it replaces the stack it came from:
greedy generations identical and logits within `LOGIT_ATOL` on a canary set of prompts.

    python -c "from blade_core.compaction import compact_adapters; help(compact_adapters)"
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from blade_core import lora
from blade_core.evaluation.generation import generate, prompt_ids
from blade_core.evaluation.scoring import model_device
from blade_core.modeling import load_model, load_tokenizer, pick_device

# Largest |logit difference| a compacted adapter may show against its stack (fp32). Concatenation only
# reorders a float sum (observed ~1e-6 on the tiny models); 1e-3 leaves room for bigger models and stays far
# below the logit gaps that decide a greedy token. A truncated adapter is checked against the same bound.
LOGIT_ATOL = 1e-3
CANARY_MAX_NEW_TOKENS = 24  # greedy tokens compared per canary prompt

_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"
# adapter_config.json fields a plain LoRA may carry; anything that changes the forward beyond B A is refused
_UNSUPPORTED = ("use_dora", "lora_bias", "modules_to_save", "layer_replication")


@dataclass
class LoraFactors:
    """One adapter in memory: per layer (the weight-key prefix) its A (r, in), B (out, r) and scale s."""

    layers: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    config: dict[str, Any]


@dataclass
class CompactionReport:
    rank: int  # r of the written adapter
    exact_rank: int  # Σ r_i: the rank of the exact concatenation
    truncated: bool
    max_rel_error: float  # max over layers of ‖ΔW − ΔW_k‖_F / ‖ΔW‖_F (0 when exact)
    mean_rel_error: float
    layers: int
    sources: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "exact_rank": self.exact_rank,
            "truncated": self.truncated,
            "max_rel_error": self.max_rel_error,
            "mean_rel_error": self.mean_rel_error,
            "layers": self.layers,
        }


def lora_scale(config: dict[str, Any], layer: str) -> float:
    """s = alpha / r, or alpha / sqrt(r) with rsLoRA; `rank_pattern` / `alpha_pattern` override per layer."""
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    for pattern, value in (config.get("rank_pattern") or {}).items():
        if layer.endswith(pattern) or f".{pattern}." in f"{layer}.":
            r = int(value)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if layer.endswith(pattern) or f".{pattern}." in f"{layer}.":
            alpha = float(value)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_factors(adapter_dir: str | Path) -> LoraFactors:
    """The LoRA factors of a PEFT adapter dir (adapter_config.json + adapter_model.safetensors), in fp32."""
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter_dir}: peft_type {config.get('peft_type')!r}; only LORA adapters compact")
    for name in _UNSUPPORTED:
        if config.get(name):
            raise ValueError(f"{adapter_dir}: adapter_config.json sets {name}; only plain LoRA compacts")
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    layers = {}
    for key, a in weights.items():
        if not key.endswith(_LORA_A):
            continue
        layer = key[: -len(_LORA_A)]
        b = weights.get(layer + _LORA_B)
        if b is None:
            raise ValueError(f"{adapter_dir}: {key} has no matching lora_B")
        layers[layer] = (a.float(), b.float(), lora_scale(config, layer))
    if not layers:
        raise ValueError(f"{adapter_dir}: no LoRA weights in adapter_model.safetensors")
    return LoraFactors(layers=layers, config=config)


def concat_lora(
    factors: Sequence[tuple[torch.Tensor, torch.Tensor, float]], rank: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) with B A = Σ s_i B_i A_i: A = [A_1; …; A_n] (R, in), B = [s_1 B_1, …, s_n B_n] (out, R).

    `rank` ≥ R pads with zero rows of A and zero columns of B (the product is unchanged).
    """
    a = torch.cat([a_i for a_i, _, _ in factors], dim=0)  # (R, in)
    b = torch.cat([s_i * b_i for _, b_i, s_i in factors], dim=1)  # (out, R)
    if rank is not None and rank > a.shape[0]:
        pad = rank - a.shape[0]
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])], dim=0)
        b = torch.cat([b, b.new_zeros(b.shape[0], pad)], dim=1)
    return a, b


def truncate_svd(a: torch.Tensor, b: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Best rank-`rank` factors of ΔW = B A (out, in) and the relative error ‖ΔW − ΔW_k‖_F / ‖ΔW‖_F.

    Works on the factors, never on the (out, in) matrix: B = Q_B R_B, Aᵀ = Q_A R_A, R_B R_Aᵀ = U S Vᵀ, so
    ΔW = (Q_B U) S (Q_A V)ᵀ; keep the top k: B_k = Q_B U_k √S_k, A_k = √S_k V_kᵀ Q_Aᵀ. Fewer than `rank`
    directions are zero-padded, so the result always has rank dimension `rank`.
    """
    q_b, r_b = torch.linalg.qr(b.double())  # (out, R), (R, R)
    q_a, r_a = torch.linalg.qr(a.double().T)  # (in, R), (R, R)
    u, s, vh = torch.linalg.svd(r_b @ r_a.T)  # (R, R), (R,), (R, R)
    k = min(rank, s.shape[0])
    total = float((s**2).sum())
    error = math.sqrt(float((s[k:] ** 2).sum()) / total) if total > 0 else 0.0
    root = s[:k].sqrt()
    b_k = (q_b @ u[:, :k]) * root  # (out, k)
    a_k = root[:, None] * (vh[:k] @ q_a.T)  # (k, in)
    if k < rank:
        a_k = torch.cat([a_k, a_k.new_zeros(rank - k, a_k.shape[1])], dim=0)
        b_k = torch.cat([b_k, b_k.new_zeros(b_k.shape[0], rank - k)], dim=1)
    return a_k.to(a.dtype), b_k.to(b.dtype), error


def _target_names(layers: Sequence[str]) -> list[str]:
    return sorted({layer.rsplit(".", 1)[-1] for layer in layers})


def compacted_config(
    template: dict[str, Any], *, rank: int, targets: Sequence[str], base_model: str | None
) -> dict[str, Any]:
    """adapter_config.json of the compacted adapter: plain LoRA, r = alpha = rank (scale 1), no dropout."""
    config = {
        k: v
        for k, v in template.items()
        if k not in ("rank_pattern", "alpha_pattern", "revision", "auto_mapping")
    }
    config.update(
        peft_type="LORA",
        r=rank,
        lora_alpha=rank,
        use_rslora=False,
        lora_dropout=0.0,
        bias="none",
        target_modules=list(targets),
        rank_pattern={},
        alpha_pattern={},
        inference_mode=True,
        base_model_name_or_path=base_model,
    )
    return config


def compact_adapters(
    adapter_dirs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    rank: int | None = None,
    base_model: str | None = None,
) -> CompactionReport:
    """Write one PEFT adapter to `out_dir` equivalent to the stack `adapter_dirs` (applied together).

    `rank` None (or ≥ Σ r_i): the exact concatenation; smaller: SVD-truncated per layer, error reported.
    `base_model` goes to adapter_config.json's base_model_name_or_path.
    """
    if not adapter_dirs:
        raise ValueError("compaction needs at least one adapter")
    if rank is not None and rank < 1:
        raise ValueError(f"rank: must be a positive integer, got {rank}")
    stack = [read_factors(d) for d in adapter_dirs]
    layers = sorted({layer for f in stack for layer in f.layers})
    per_layer = {layer: [f.layers[layer] for f in stack if layer in f.layers] for layer in layers}
    exact_rank = max(sum(a.shape[0] for a, _, _ in parts) for parts in per_layer.values())
    target = exact_rank if rank is None else min(rank, exact_rank)
    truncated = target < exact_rank

    tensors, errors = {}, []
    for layer, parts in per_layer.items():
        a, b = concat_lora(parts, rank=exact_rank)
        if truncated:
            a, b, err = truncate_svd(a, b, target)
            errors.append(err)
        tensors[layer + _LORA_A] = a.contiguous()
        tensors[layer + _LORA_B] = b.contiguous()

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = compacted_config(
        stack[-1].config, rank=target, targets=_target_names(layers), base_model=base_model
    )
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return CompactionReport(
        rank=target,
        exact_rank=exact_rank,
        truncated=truncated,
        max_rel_error=max(errors, default=0.0),
        mean_rel_error=sum(errors) / len(errors) if errors else 0.0,
        layers=len(layers),
        sources=[str(d) for d in adapter_dirs],
    )


# --- verification: the compacted adapter against the stack it replaces ------------------------------------


@dataclass
class Equivalence:
    ok: bool
    generations_identical: bool
    max_logit_diff: float
    tolerance: float
    prompts: int
    mismatches: list[dict[str, str]] = field(default_factory=list)  # prompt, stack, candidate (at most 3)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "generations_identical": self.generations_identical,
            "max_logit_diff": self.max_logit_diff,
            "tolerance": self.tolerance,
            "prompts": self.prompts,
            "mismatches": self.mismatches,
        }


def _outputs(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int
) -> tuple[list[str], list[torch.Tensor]]:
    """Greedy continuations and the logits over each prompt (one prompt per forward, no padding)."""
    texts = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=1)
    device, logits = model_device(model), []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=device)
            logits.append(model(input_ids=ids).logits.float().cpu())  # (1, T, V)
    return texts, logits


def verify_equivalent(
    base_ref: str | Path,
    stack_dirs: Sequence[str | Path],
    candidate_dirs: Sequence[str | Path],
    prompts: Sequence[str],
    *,
    device: str | torch.device | None = None,
    tolerance: float = LOGIT_ATOL,
    max_new_tokens: int = CANARY_MAX_NEW_TOKENS,
    dtype: torch.dtype | None = torch.float32,
) -> Equivalence:
    """Base + `stack_dirs` against base + `candidate_dirs` on `prompts`: identical greedy generations and
    max |Δlogit| ≤ `tolerance`. Compared in fp32 by default (bf16 rounding would only add noise)."""
    if not prompts:
        raise ValueError("verification needs at least one canary prompt")
    dev = pick_device(device)
    tokenizer = load_tokenizer(base_ref)
    results = []
    for dirs in (stack_dirs, candidate_dirs):
        model = lora.load_stack(load_model(base_ref, dev, dtype), dirs)
        model.eval()
        results.append(_outputs(model, tokenizer, prompts, max_new_tokens))
        del model
    (texts_s, logits_s), (texts_c, logits_c) = results
    diff = max(float((x - y).abs().max()) for x, y in zip(logits_s, logits_c, strict=True))
    mismatches = [
        {"prompt": p, "stack": s, "candidate": c}
        for p, s, c in zip(prompts, texts_s, texts_c, strict=True)
        if s != c
    ]
    same = not mismatches
    return Equivalence(
        ok=same and diff <= tolerance,
        generations_identical=same,
        max_logit_diff=diff,
        tolerance=tolerance,
        prompts=len(prompts),
        mismatches=mismatches[:3],
    )
