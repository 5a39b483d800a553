"""Engine benchmark (not a test): cost of a BLADE outer step vs a full-parameter GradDiff step on the same
model (time, tokens/s, memory, and each protocol to its end: BLADE to its convergence stop vs GradDiff's 10
epochs), peak memory of the chunked vs the naive clamped entropy at vocabulary 128k, sequence 1024, batch 1,
the clamped entropy fused with the LM head (no (B, T, V) logits) vs the logits path at that size, and BLADE's
outer losses in two forward/backward passes (as `outer_step` runs them) vs one pass over both batches stacked,
and with `--compile`, those losses and their gradients compiled against eager.

    .venv/bin/python benchmarks/engine.py                # defaults below; --help for sizes
    .venv/bin/python benchmarks/engine.py --device cuda  # CUDA peak allocated memory instead of RSS
    ... --compile reduce-overhead                        # every decoder layer under torch.compile

Every measurement runs in a fresh subprocess. On the CPU, peak memory is the process's peak RSS (ru_maxrss)
minus its RSS once the model and data are built, so gradients, optimiser state and activations count: the
memory training needs beyond the weights; on CUDA it is `max_memory_allocated` minus the allocation at that
point. glibc keeps freed blocks below its (self-raising) mmap threshold in the heap, so a CPU process's peak
RSS can sit far above what its live tensors ever held: `--malloc-mmap-threshold 131072` fixes the threshold in
each measurement (`mallopt`), so freed activations go back to the system and RSS follows live memory, at a
cost in time (every large allocation is a fresh mapping). Time per step is the mean over the measured steps
after one warm-up step. A BLADE outer step here is
K inner SGD steps + the outer Adam step + the dual update (adaptive recovery, which can add up to 3K inner
steps, is off so both methods do a fixed amount of work), measured twice: at tau = 1, where every forget token
counts (a run's first steps), and at the default tau, where the untrained model's entropy is past the clamp
and no forget micro-batch is back-propagated (most of a run's later steps: `blade.in_deadzone`). The GradDiff
step is the OpenUnlearning one: -CE(forget) + CE(retain), AdamW on every weight.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from blade_core.methods.blade import BladeConfig

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------------------------ measuring


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Meter:
    """Peak extra memory (MiB) and wall time of the work between start() and stop()."""

    def __init__(self, device: torch.device):
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            self.base = _rss_mb()
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**20
        else:
            peak = _peak_rss_mb()
        return {
            "seconds": time.perf_counter() - self.t0,
            "peak_extra_mb": peak - self.base,
            "base_mb": self.base,
        }


PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")  # torch's matrix-product kernels


def _factors(name: str, shapes: list[list[int]]) -> tuple[list[int], list[int]]:
    """The two factors' shapes of a matrix product from its recorded inputs (addmm's and baddbmm's first
    input is the term added)."""
    a, b = shapes[1:3] if name in ("aten::addmm", "aten::baddbmm") else shapes[:2]
    return a, b


def _product_flops(a: list[int], b: list[int]) -> int:
    """2*M*K*N of (M, K) x (K, N), times the batch of a batched product."""
    return 2 * a[-2] * a[-1] * b[-1] * (a[0] if len(a) == 3 else 1)


def core_matmul_rate(n: int = 1024, reps: int = 10) -> float:
    """FLOP/s of one fp32 n x n x n matrix product on this process's threads: what the core reaches on a
    product large enough to hide memory traffic, the yardstick for a step's own products."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def profile_step(step: Callable[[], None], low_rank: int | None) -> dict[str, Any]:
    """Where one step's CPU time goes, by torch's profiler (self time of each op): matrix products (those with
    a dimension of `low_rank`, the LoRA adapters', apart), at what FLOP/s against `core_matmul_rate`;
    attention's kernel; the optimiser's step; everything else (elementwise work, copies, autograd), with its
    largest ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    parts = dict.fromkeys(("products", "low_rank_products", "attention", "optimizer", "other"), 0.0)
    flops, other_ops = 0, {}
    for event in prof.events():
        self_us = event.self_cpu_time_total
        if event.name in PRODUCTS:
            a, b = _factors(event.name, event.input_shapes)
            flops += _product_flops(a, b)
            parts["low_rank_products" if low_rank in (*a, *b) else "products"] += self_us
            continue
        parent, in_optimizer = event.cpu_parent, event.name.startswith("Optimizer.step#")
        while parent is not None and not in_optimizer:
            in_optimizer, parent = parent.name.startswith("Optimizer.step#"), parent.cpu_parent
        if in_optimizer:
            parts["optimizer"] += self_us
        elif "scaled_dot_product" in event.name:
            parts["attention"] += self_us
        else:
            parts["other"] += self_us
            other_ops[event.name] = other_ops.get(event.name, 0.0) + self_us
    total = sum(parts.values())
    product_us = parts["products"] + parts["low_rank_products"]
    top = sorted(other_ops.items(), key=lambda kv: -kv[1])[:4]
    return {
        "self_cpu_s": total / 1e6,
        "shares": {name: us / total for name, us in parts.items()},
        "product_flops_per_s": flops / (product_us / 1e6),
        "core_matmul_flops_per_s": core_matmul_rate(),
        "top_other": {name: us / total for name, us in top},
    }


# ------------------------------------------------------------------------------------------------ workloads


def _model_and_data(args: argparse.Namespace, device: torch.device, *, compiled: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    from blade_core.modeling import enable_activation_checkpointing

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        intermediate_size=args.hidden * 8 // 3,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
    if device.type == "cuda" and not args.no_checkpointing:
        enable_activation_checkpointing(model)
    if args.compile and compiled:  # lazily, at the first forward (after BLADE's LoRA is attached)
        _compile_layers(model.model.layers, args.compile)  # the warm-up step pays for it
    n_rows = args.batch * 8
    ids = torch.randint(3, args.vocab, (n_rows, args.seq))
    rows = [ids[i].tolist() for i in range(n_rows)]
    labels = [[-100] * (args.seq // 2) + r[args.seq // 2 :] for r in rows]  # prompt = first half
    return model, rows, labels


def _compile_layers(layers: torch.nn.ModuleList, mode: str) -> None:
    for layer in layers:
        layer.compile(mode=mode)


# Dense bf16 peak of the accelerators we may be lent (NVIDIA's data sheets, without sparsity), for MFU.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def forward_flops_per_token(model: PreTrainedModel, seq: int) -> float:
    """Model FLOPs of one token's forward pass, PaLM's accounting (Chowdhery et al. 2022, app. B):
    2 * N_matmul + 4 * L * T * d, where N_matmul counts every linear weight (the LM head included, the
    embedding lookup not) and the second term is attention's QK^T and AV at context T. A backward pass costs
    2x forward when every weight trains and 1x when the base is frozen (LoRA: only input gradients; the
    adapters' own FLOPs are negligible). Recomputation under gradient checkpointing is not counted (MFU, not
    hardware FLOPs utilisation)."""
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 2 * n_matmul + 4 * model.config.num_hidden_layers * seq * model.config.hidden_size


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def _dataset(rows, labels):
    from blade_core.data import TokenizedDataset

    return TokenizedDataset(input_ids=rows, labels=labels, kind="qa", pad_id=0, source="<bench>")


def _timed(
    step,
    args: argparse.Namespace,
    device: torch.device,
    trainable: int,
    tokens_per_step: int,
    flops_per_token: float,
    low_rank: int | None = None,
) -> dict[str, Any]:
    """Memory from before the first step (so gradients and optimiser state count); time after one warm-up
    step; tokens/s counts every token a forward and backward pass went through; model FLOPs/s is tokens/s
    times `flops_per_token` (forward + backward), and MFU that over the device's dense bf16 peak. With
    `--profile`, one more step under torch's profiler (`profile_step`; `low_rank` the adapters' rank)."""
    meter = Meter(device)
    meter.start()
    step()  # warm-up: allocates gradients and the optimiser state
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    result = meter.stop()
    result["seconds"] = time.perf_counter() - t0
    result["cpu_seconds"] = time.process_time() - c0  # robust to other load on a shared CPU machine
    result["trainable_params"] = trainable
    result["tokens_per_step"] = tokens_per_step
    result["tokens_per_s"] = tokens_per_step * args.steps / result["seconds"]
    result["model_tflops_per_s"] = result["tokens_per_s"] * flops_per_token / 1e12
    peak = peak_flops(device)
    if peak is not None:
        result["mfu"] = result["model_tflops_per_s"] * 1e12 / peak
    if args.profile:
        result["profile"] = profile_step(step, low_rank)
    return result


def _blade_work(args: argparse.Namespace, device: torch.device, tau: float | None) -> dict[str, float]:
    """BLADE's step at `tau` (None: the default). `deadzone_steps` counts the measured steps whose forget
    micro-batches were all past the clamp (L_fgt = 0): `outer_step` back-propagates none of them. Tokens/s
    and model FLOPs count the step's rows as forward and backward either way, so compare seconds."""
    from blade_core import lora
    from blade_core.data import BatchStream
    from blade_core.methods import blade
    from blade_core.swiglu import recomputed_swiglu

    model, rows, labels = _model_and_data(args, device)
    flops = 2 * forward_flops_per_token(model, args.seq)  # frozen base: forward + input gradients
    cfg = blade.BladeConfig(
        batch_size=args.batch,
        grad_accum=args.grad_accum,
        max_length=args.seq,
        recovery_factor=0,
        stacked_forward=args.stacked_forward,
        **({} if tau is None else {"tau": tau}),
    )
    model = lora.attach_adapter(model, cfg)
    model.train()
    params = lora.trainable_parameters(model)
    inner_opt = torch.optim.SGD(params, lr=cfg.eta_in)
    outer_opt = torch.optim.Adam(params, lr=cfg.eta_out)
    forget = BatchStream(_dataset(rows, labels), args.batch, seed=0)
    retain = BatchStream(_dataset(rows, labels), args.batch, seed=1)
    lam, eps, deadzone = cfg.lambda0, None, []

    def step() -> None:
        nonlocal lam, eps
        inner = blade.inner_loop(model, retain, inner_opt, cfg, device)
        eps = eps if eps is not None else cfg.eps_mul * sum(inner) / len(inner)
        out = blade.outer_step(model, forget, retain, outer_opt, lam, eps, cfg, device)
        lam = blade.dual_update(lam, out["r"], cfg)
        deadzone.append(out["L_fgt"] == 0.0)

    rows_per_step = (cfg.inner_steps + 2) * cfg.grad_accum * args.batch  # K inner + forget + retain
    with recomputed_swiglu(model) if args.recompute_swiglu else contextlib.nullcontext():  # as the worker
        trainable = sum(p.numel() for p in params)
        result = _timed(step, args, device, trainable, rows_per_step * args.seq, flops, low_rank=cfg.lora_r)
    result["deadzone_steps"] = sum(deadzone[1 : 1 + args.steps])  # not the warm-up step nor a profiled one
    return result


def work_blade(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """At the default tau: the bench's untrained model's entropy sits near log V, past the clamp, as a run's
    forget tokens are once they are forgotten (most of its steps: `blade.in_deadzone`)."""
    return _blade_work(args, device, tau=None)


def work_blade_every_token(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """At tau = 1 the threshold is log V, above every token's entropy: every forget token counts and every
    forget micro-batch is back-propagated, as in a run's first steps."""
    return _blade_work(args, device, tau=1.0)


def work_grad_diff(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    from blade_core.data import BatchStream
    from blade_core.losses import token_cross_entropy
    from blade_core.swiglu import recomputed_swiglu

    model, rows, labels = _model_and_data(args, device)
    flops = 3 * forward_flops_per_token(model, args.seq)  # every weight trains: forward + 2x backward
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    forget = BatchStream(_dataset(rows, labels), args.batch, seed=0)
    retain = BatchStream(_dataset(rows, labels), args.batch, seed=1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for stream, sign in ((forget, -1.0), (retain, 1.0)):
            b = {k: v.to(device) for k, v in stream.next().items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            (sign * token_cross_entropy(logits, b["labels"])).backward()
            del logits
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    trainable = sum(p.numel() for p in model.parameters())
    with recomputed_swiglu(model) if args.grad_diff_recompute_swiglu else contextlib.nullcontext():
        return _timed(step, args, device, trainable, 2 * args.batch * args.seq, flops)


def _outer_config(args: argparse.Namespace) -> BladeConfig:
    """BLADE's config for the outer losses' comparisons, at tau = 1: an untrained model's entropy sits near
    log V, above the default tau's threshold, where the clamp zeroes L_fgt and its gradient; at tau = 1 every
    token counts, so the comparisons cover the forget loss's gradient too."""
    from blade_core.methods.blade import BladeConfig

    return BladeConfig(batch_size=args.batch, max_length=args.seq, tau=1.0)


def _batch(
    rows: list[list[int]], labels: list[list[int]], first: int, n: int, length: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Rows first..first+n, cut to `length` tokens, as a collated batch (no padding: the rows are full)."""
    ids = torch.tensor([r[:length] for r in rows[first : first + n]], device=device)
    lab = torch.tensor([r[:length] for r in labels[first : first + n]], device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": lab}


def _outer_work(args: argparse.Namespace, device: torch.device, *, one_pass: bool) -> dict[str, Any]:
    """The gradient of BLADE's outer objective's two losses, L_fgt on `batch` forget rows of `seq` tokens and
    L_ret on `batch` retain rows of `retain_seq` tokens: two forward/backward passes or one over both batches
    stacked (the retain rows padded to the longer length), as `outer_step` runs them (`stacked_forward`)."""
    from blade_core import lora
    from blade_core.methods import blade

    model, rows, labels = _model_and_data(args, device)
    flops = 2 * forward_flops_per_token(model, args.seq)
    cfg = _outer_config(args)
    model = lora.attach_adapter(model, cfg)
    model.train()
    params = lora.trainable_parameters(model)
    b, t_f, t_r = args.batch, args.seq, args.retain_seq or args.seq

    forget, retain = _batch(rows, labels, 0, b, t_f, device), _batch(rows, labels, b, b, t_r, device)
    total = {"loss": 0.0}

    def step() -> None:
        for p in params:
            p.grad = None
        if one_pass:
            [(l_fgt, _)], [l_ret] = blade.stacked_losses(model, [forget], [retain], cfg)
            (l_fgt + l_ret).backward()
        else:  # one graph at a time
            l_fgt = blade.forget_loss(model, forget, cfg)[0]
            l_fgt.backward()
            l_ret = blade.retain_loss(model, retain, cfg)
            l_ret.backward()
        total["loss"] = l_fgt.item() + l_ret.item()

    trainable = sum(p.numel() for p in params)
    tokens = b * (t_f + t_r)
    result: dict[str, Any] = _timed(step, args, device, trainable, tokens, flops, low_rank=cfg.lora_r)
    result["loss"] = total["loss"]
    result["grad_norms"] = [p.grad.double().norm().item() for p in params if p.grad is not None]
    return result


def work_compile_check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """BLADE's outer losses (L_fgt, L_ret) and LoRA gradients with every decoder layer compiled (`--compile`)
    against eager, on the same weights and rows: each relative gap, at the first compiled call (compilation)
    and the second (under reduce-overhead on CUDA, a replay of the recorded graphs)."""
    from blade_core import lora
    from blade_core.methods import blade

    model, rows, labels = _model_and_data(args, device, compiled=False)  # compiled below, after eager
    cfg = _outer_config(args)
    layers = model.model.layers
    model = lora.attach_adapter(model, cfg)
    model.train()
    params = lora.trainable_parameters(model)
    b, t = args.batch, args.seq
    forget, retain = _batch(rows, labels, 0, b, t, device), _batch(rows, labels, b, b, t, device)

    def losses_and_grads() -> tuple[list[float], list[torch.Tensor]]:
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier graph outputs may be reused
        for p in params:
            p.grad = None
        l_fgt = blade.forget_loss(model, forget, cfg)[0]
        l_ret = blade.retain_loss(model, retain, cfg)
        (l_fgt + l_ret).backward()
        return [l_fgt.item(), l_ret.item()], [p.grad.detach().double().clone() for p in params]

    def gaps(eager: tuple[list[float], list[torch.Tensor]], other: tuple[list[float], list[torch.Tensor]]):
        (losses_e, grads_e), (losses_o, grads_o) = eager, other
        return {
            "loss_gaps": [abs(o - e) / max(abs(e), 1e-12) for e, o in zip(losses_e, losses_o, strict=True)],
            "grad_gap": max(
                ((o - e).norm() / e.norm().clamp_min(1e-12)).item()
                for e, o in zip(grads_e, grads_o, strict=True)
            ),
        }

    eager = losses_and_grads()
    again = losses_and_grads()
    _compile_layers(layers, args.compile)  # with their LoRA layers, as `--compile` compiles them
    t0 = time.perf_counter()
    first = losses_and_grads()
    compile_s = time.perf_counter() - t0
    second = losses_and_grads()
    return {
        "losses": eager[0],
        "eager_again": gaps(eager, again),
        "compiled_first": gaps(eager, first),
        "compiled_second": gaps(eager, second),
        "first_call_s": compile_s,
    }


def work_outer_two_passes(args, device):
    return _outer_work(args, device, one_pass=False)


def work_outer_one_pass(args, device):
    return _outer_work(args, device, one_pass=True)


def _entropy_inputs(args: argparse.Namespace, device: torch.device):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.entropy_dtype == "bf16" else torch.float32
    logits = (
        (torch.randn(1, args.entropy_seq, args.entropy_vocab, device=device) * 3).to(dtype).requires_grad_()
    )
    mask = torch.ones(1, args.entropy_seq, device=device)
    return logits, mask


def _entropy_work(args, device, fn) -> dict[str, float]:
    logits, mask = _entropy_inputs(args, device)
    meter = Meter(device)
    meter.start()
    loss = fn(logits, mask)
    loss.backward()
    result = meter.stop()
    result["loss"] = loss.item()
    result["logits_mb"] = logits.numel() * logits.element_size() / 2**20
    return result


def work_entropy_chunked(args, device):
    from blade_core.losses import clamped_entropy_loss

    return _entropy_work(args, device, lambda z, m: clamped_entropy_loss(z, m, 0.7, chunk=args.chunk))


def work_entropy_naive(args, device):
    from blade_core.losses import clamped_entropy_loss_naive

    return _entropy_work(args, device, lambda z, m: clamped_entropy_loss_naive(z, m, 0.7))


def _head_inputs(args: argparse.Namespace, device: torch.device):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.entropy_dtype == "bf16" else torch.float32
    hidden = torch.randn(1, args.entropy_seq, args.head_hidden, device=device, dtype=dtype).requires_grad_()
    head = torch.randn(args.entropy_vocab, args.head_hidden, device=device, dtype=dtype)
    head.mul_(4.0 / args.head_hidden**0.5)  # in place (no second copy in the RSS peak); logits of std ~4
    return hidden, head, torch.ones(1, args.entropy_seq, device=device)


def _head_work(args, device, fn) -> dict[str, float]:
    """Clamped entropy of the logits h W^T (frozen head, as under LoRA), forward + backward to the hidden
    states: what one forget micro-batch costs at the LM head."""
    hidden, head, mask = _head_inputs(args, device)
    meter = Meter(device)
    meter.start()
    loss = fn(hidden, head, mask)
    loss.backward()
    result = meter.stop()
    result["loss"] = loss.item()
    result["logits_mb"] = args.entropy_seq * args.entropy_vocab * hidden.element_size() / 2**20
    return result


def work_head_logits(args, device):
    from blade_core.losses import clamped_entropy_loss

    return _head_work(args, device, lambda h, w, m: clamped_entropy_loss(h @ w.T, m, 0.7, chunk=args.chunk))


def work_head_fused(args, device):
    from blade_core.losses import fused_clamped_entropy_loss

    return _head_work(
        args, device, lambda h, w, m: fused_clamped_entropy_loss(h, w, m, 0.7, chunk=args.chunk)[0]
    )


STEP_WORKS = ("blade_every_token", "blade", "grad_diff")  # BLADE at tau = 1, at its default tau; GradDiff

WORKS = {
    "blade": work_blade,
    "blade_every_token": work_blade_every_token,
    "head_logits": work_head_logits,
    "head_fused": work_head_fused,
    "grad_diff": work_grad_diff,
    "entropy_chunked": work_entropy_chunked,
    "entropy_naive": work_entropy_naive,
    "outer_two_passes": work_outer_two_passes,
    "outer_one_pass": work_outer_one_pass,
    "compile_check": work_compile_check,
}


# ------------------------------------------------------------------------------------------------ driver


def protocol_costs(
    args: argparse.Namespace, every: dict, deadzone: dict, grad_diff: dict
) -> dict[str, float]:
    """Wall time to the end of each method's own protocol, the paper's accounting: BLADE to its convergence
    stop (`--blade-steps`, `--deadzone-share` of them past the clamp, the rest with every forget token
    counting) vs GradDiff's 10 epochs at effective batch 32 (OpenUnlearning), where one GradDiff optimiser
    step is 32 / batch of the measured micro-steps."""
    share = args.deadzone_share
    step_s = (share * deadzone["seconds"] + (1 - share) * every["seconds"]) / args.steps
    blade_s = args.blade_steps * step_s
    grad_diff_steps = 10 * -(-args.forget_rows // 32)
    grad_diff_s = grad_diff_steps * (32 / args.batch) * grad_diff["seconds"] / args.steps
    return {
        "blade_s": blade_s,
        "deadzone_share": share,
        "grad_diff_steps": grad_diff_steps,
        "grad_diff_s": grad_diff_s,
        "ratio": blade_s / grad_diff_s,
        "ratio_every_token": args.blade_steps * every["seconds"] / args.steps / grad_diff_s,
    }


def _profile_line(prof: dict[str, Any]) -> str:
    shares, rate = prof["shares"], prof["product_flops_per_s"]
    top = ", ".join(f"{name.removeprefix('aten::')} {100 * x:.1f}%" for name, x in prof["top_other"].items())
    return (
        f"matrix products {100 * (shares['products'] + shares['low_rank_products']):.0f}% "
        f"(the adapters' low-rank ones {100 * shares['low_rank_products']:.0f}%) "
        f"at {rate / 1e9:.0f} GFLOP/s, "
        f"x{rate / prof['core_matmul_flops_per_s']:.2f} of a 1024^3 product's rate; "
        f"attention {100 * shares['attention']:.0f}%; optimiser {100 * shares['optimizer']:.0f}%; "
        f"the rest {100 * shares['other']:.0f}% ({top})"
    )


def _gaps_line(gaps: dict[str, Any]) -> str:
    (fgt, ret), grad = gaps["loss_gaps"], gaps["grad_gap"]
    return f"L_fgt {fgt:.1e}, L_ret {ret:.1e}, gradients {grad:.1e}"


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def fix_mmap_threshold(threshold: int) -> None:
    """glibc: serve blocks of `threshold` bytes and more by mmap, returned to the system when freed. Setting
    it turns off glibc's dynamic threshold, which rises to the largest block freed so far and so keeps freed
    activations in the heap."""
    if not ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold):
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {threshold}) failed (not glibc?)")


def _measure(name: str, argv: list[str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--work", name, *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure_one(
    name: str,
    argv: list[str],
    figures: dict[str, dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
    save: Callable[[], None],
) -> dict[str, Any]:
    """Measure one workload, print its `line`, keep it in `figures` and `save`."""
    figures[name] = _measure(name, argv)
    save()
    print(f"  {name:<17} {line(figures[name])}")
    return figures[name]


def _measure_pair(
    names: tuple[str, str],
    argv: list[str],
    figures: dict[str, dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
    save: Callable[[], None],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure two workloads one after the other, print a `line` for each, keep both in `figures` and
    `save` after each."""
    first, second = (_measure_one(name, argv, figures, line, save) for name in names)
    return first, second


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on the CPU (default 1: on a shared machine more threads spin and skew time)",
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--retain-seq",
        type=int,
        default=None,
        help="retain rows' length in the outer-step comparison (default --seq)",
    )
    p.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    p.add_argument("--entropy-vocab", type=int, default=128_256)
    p.add_argument("--entropy-seq", type=int, default=1024)
    p.add_argument("--entropy-dtype", choices=("bf16", "fp32"), default="fp32")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--grad-accum", type=int, default=4, help="BLADE micro-batches per step (reference: 4)")
    p.add_argument("--head-hidden", type=int, default=2048, help="hidden size for the LM-head comparison")
    p.add_argument("--forget-rows", type=int, default=40, help="forget rows (TOFU forget01: 40)")
    p.add_argument(
        "--blade-steps",
        type=int,
        default=80,
        help="BLADE outer steps to its convergence stop (read it off the bench's history.json)",
    )
    p.add_argument(
        "--deadzone-share",
        type=float,
        default=0.53,
        help="share of those steps whose forget rows are all past the clamp (L_fgt = 0): 0.47-0.60 of the "
        "first 80 steps of each history in docs/results_data/validation-blade-16x1-vs-4x4/",
    )
    p.add_argument(
        "--compile",
        choices=("default", "reduce-overhead", "max-autotune"),
        help="torch.compile every decoder layer in this mode (reduce-overhead: CUDA graphs on a GPU)",
    )
    p.add_argument(
        "--no-checkpointing",
        action="store_true",
        help="CUDA without activation checkpointing (GradDiff's backward fails under CUDA graphs with it)",
    )
    p.add_argument(
        "--recompute-swiglu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BLADE: recompute SwiGLU activations in the backward, as the worker does (blade_core.swiglu)",
    )
    p.add_argument(
        "--grad-diff-recompute-swiglu",
        action="store_true",
        help="GradDiff with BLADE's SwiGLU recomputation too (default: as OpenUnlearning runs it)",
    )
    p.add_argument(
        "--stacked-forward",
        choices=("auto", "on", "off"),
        default="auto",
        help="BLADE's steps: one forward over a step's micro-batches, or one each (auto: stacked on CUDA)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="CPU: profile one more step of each method and print where its time goes (torch's profiler)",
    )
    p.add_argument("--skip-steps", action="store_true", help="only the entropy comparison")
    p.add_argument("--skip-entropy", action="store_true", help="only the step comparison")
    p.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        metavar="BYTES",
        help="CPU: fix glibc's mmap threshold in each measurement, so peak RSS follows live memory",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--work", choices=sorted(WORKS), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.profile and device.type != "cpu":
        raise SystemExit("--profile reads CPU time; on CUDA the profiler's CPU side times kernel launches")
    if args.work:
        if device.type == "cpu":
            torch.set_num_threads(args.threads)
            if args.malloc_mmap_threshold:
                fix_mmap_threshold(args.malloc_mmap_threshold)
        print(json.dumps(WORKS[args.work](args, device)))
        return 0

    passthrough = [a for a in argv if a not in ("--skip-steps", "--skip-entropy")]
    figures: dict[str, dict[str, Any]] = {}
    threads = args.threads if device.type == "cpu" else torch.get_num_threads()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = peak_flops(device)
    print(
        f"device {device} ({name}"
        + (f"; dense bf16 peak {peak / 1e12:.0f} TFLOP/s" if peak else "")
        + f"), torch {torch.__version__}, {threads} threads, load average {os.getloadavg()[0]:.1f}"
        + (
            f"; glibc mmap threshold fixed at {args.malloc_mmap_threshold} bytes (RSS follows live memory)"
            if args.malloc_mmap_threshold and device.type == "cpu"
            else ""
        )
    )
    figures["device"] = {
        "name": name,
        "torch": torch.__version__,
        "peak_bf16_flops": peak,
        "malloc_mmap_threshold": args.malloc_mmap_threshold,
    }

    def save() -> None:  # after each measurement, so a run stopped at a time limit keeps what it measured
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))

    if not args.skip_steps:
        from blade_core.methods.blade import BladeConfig, stacks_forward

        checkpointing = "off" if args.no_checkpointing else "on"
        outer_batches = [{"input_ids": torch.empty(args.batch, args.seq)}] * (2 * args.grad_accum)
        stacked = stacks_forward(BladeConfig(stacked_forward=args.stacked_forward), device, outer_batches)
        print(
            f"model: Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
            f"batch {args.batch} x seq {args.seq}; {args.steps} measured steps each"
            + (f"; activation checkpointing {checkpointing}" if device.type == "cuda" else "")
            + (f"; decoder layers compiled ({args.compile})" if args.compile else "")
            + f"; BLADE's micro-batches {'stacked in one forward a step' if stacked else 'one forward each'}"
            + f", SwiGLU activations {'recomputed' if args.recompute_swiglu else 'kept'}"
            + (" (GradDiff's too)" if args.grad_diff_recompute_swiglu else "")
        )

        def step_line(r: dict[str, Any]) -> str:
            return (
                f"{r['seconds'] / args.steps:7.2f} s/step (CPU time {r['cpu_seconds'] / args.steps:7.2f} s)  "
                f"{r['tokens_per_s']:9.0f} tokens/s   peak extra {r['peak_extra_mb']:8.1f} MiB   "
                f"trainable {r['trainable_params'] / 1e6:.2f} M   {r['model_tflops_per_s']:.3f} model TFLOP/s"
                + (f" (MFU {100 * r['mfu']:.1f}%)" if "mfu" in r else "")
                + (f"   {r['deadzone_steps']}/{args.steps} past the clamp" if "deadzone_steps" in r else "")
            )

        every, b, g = (_measure_one(n, passthrough, figures, step_line, save) for n in STEP_WORKS)
        if args.profile:
            print("  where one step's CPU time goes (self time by torch's profiler, one more step each):")
            for label, r in (("BLADE, every token", every), ("BLADE, past clamp", b), ("GradDiff", g)):
                print(f"    {label:<19} {_profile_line(r['profile'])}")
        for label, r in (("every forget token counting", every), ("past the clamp", b)):
            print(
                f"  BLADE ({label}) / GradDiff: time per step x{r['seconds'] / g['seconds']:.2f} "
                f"(CPU time x{r['cpu_seconds'] / g['cpu_seconds']:.2f}), "
                f"tokens/s x{r['tokens_per_s'] / g['tokens_per_s']:.2f}, "
                f"peak extra memory x{r['peak_extra_mb'] / g['peak_extra_mb']:.2f}"
            )
        figures["protocol"] = p = protocol_costs(args, every, b, g)
        save()
        print(
            f"  each protocol to its end on {args.forget_rows} forget rows: BLADE {args.blade_steps} steps, "
            f"{100 * args.deadzone_share:.0f}% of them past the clamp, {p['blade_s']:.1f} s vs GradDiff 10 "
            f"epochs at batch 32 ({p['grad_diff_steps']} steps) {p['grad_diff_s']:.1f} s: x{p['ratio']:.2f} "
            f"(x{p['ratio_every_token']:.2f} with every step back-propagating its forget rows)"
        )
        print(
            f"BLADE's outer losses, forget {args.batch} x {args.seq} and retain {args.batch} x "
            f"{args.retain_seq or args.seq} tokens, forward + backward:"
        )
        two, one = _measure_pair(
            ("outer_two_passes", "outer_one_pass"),
            passthrough,
            figures,
            lambda r: (
                f"{r['seconds'] / args.steps:7.3f} s/step (CPU time {r['cpu_seconds'] / args.steps:7.3f} s) "
                f"  peak extra {r['peak_extra_mb']:8.1f} MiB   loss {r['loss']:.6f}"
            ),
            save,
        )
        pairs = zip(two["grad_norms"], one["grad_norms"], strict=True)
        gap = max(abs(x - y) / max(abs(x), 1e-12) for x, y in pairs)
        print(
            f"  one pass / two passes: time x{one['seconds'] / two['seconds']:.2f} "
            f"(CPU time x{one['cpu_seconds'] / two['cpu_seconds']:.2f}), peak extra memory "
            f"x{one['peak_extra_mb'] / max(two['peak_extra_mb'], 1e-9):.2f}; "
            f"per-parameter gradient norms agree to {gap:.1e} (relative)"
        )
    if args.compile and not args.skip_steps:
        figures["compile_check"] = c = _measure("compile_check", passthrough)
        save()
        print(
            f"decoder layers compiled ({args.compile}) vs eager, one outer step's losses and LoRA gradients, "
            "relative gaps:"
        )
        print(f"  eager, run again:       {_gaps_line(c['eager_again'])}")
        print(f"  compiled, first call:   {_gaps_line(c['compiled_first'])} ({c['first_call_s']:.1f} s)")
        print(f"  compiled, second call:  {_gaps_line(c['compiled_second'])}")
    if not args.skip_entropy:
        print(
            f"clamped entropy, batch 1 x seq {args.entropy_seq} x vocab {args.entropy_vocab} "
            f"({args.entropy_dtype} logits), forward + backward, chunk {args.chunk}:"
        )
        for name in ("entropy_chunked", "entropy_naive"):
            figures[name] = r = _measure(name, passthrough)
            r["beyond_grad_mb"] = r["peak_extra_mb"] - r["logits_mb"]
            save()
            print(
                f"  {name:<16} peak extra {r['peak_extra_mb']:8.1f} MiB, of which beyond the "
                f"(B,T,V) gradient every method returns: {r['beyond_grad_mb']:8.1f} MiB   "
                f"{r['seconds']:6.2f} s   "
                f"(logits {r['logits_mb']:.0f} MiB, loss {r['loss']:.4f})"
            )
        c, n = figures["entropy_chunked"], figures["entropy_naive"]
        print(
            "  naive / chunked: peak extra memory "
            f"x{n['peak_extra_mb'] / max(c['peak_extra_mb'], 1e-9):.1f}, "
            f"beyond the gradient x{n['beyond_grad_mb'] / max(c['beyond_grad_mb'], 1e-9):.1f}; "
            f"time x{n['seconds'] / c['seconds']:.2f}"
        )
    if not args.skip_entropy:
        print(
            f"LM head fused with the clamped entropy: hidden (1, {args.entropy_seq}, {args.head_hidden}), "
            f"head ({args.entropy_vocab}, {args.head_hidden}), forward + backward to the hidden states:"
        )
        for name in ("head_logits", "head_fused"):
            figures[name] = r = _measure(name, passthrough)
            save()
            print(
                f"  {name:<12} peak extra {r['peak_extra_mb']:8.1f} MiB   {r['seconds']:6.2f} s   "
                f"(the logits alone would be {r['logits_mb']:.0f} MiB; loss {r['loss']:.4f})"
            )
        lg, fu = figures["head_logits"], figures["head_fused"]
        print(
            "  logits / fused: peak extra memory "
            f"x{lg['peak_extra_mb'] / max(fu['peak_extra_mb'], 1e-9):.1f}, "
            f"time x{lg['seconds'] / fu['seconds']:.2f}"
        )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
