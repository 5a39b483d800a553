"""`blade_core.swiglu`: the SwiGLU activation recomputed in the backward gives the same losses and gradients
bit for bit, keeps one (B, T, I) tensor fewer per layer, and leaves the model as it was afterwards."""

from __future__ import annotations

import contextlib

import pytest
import torch

from blade_core.data import BatchStream
from blade_core.methods import blade
from blade_core.methods.blade import BladeConfig
from blade_core.modeling import enable_activation_checkpointing, new_llama
from blade_core.swiglu import recomputed_swiglu, swiglu_mlps
from blade_core.testing import tiny_task, tiny_tokenizer

CFG = {"batch_size": 4, "max_length": 64, "tau": 1.0}  # tau = 1: every token counts in L_fgt


def _losses_and_grads(task, cfg: BladeConfig, *, recompute: bool) -> tuple[list[torch.Tensor], ...]:
    """BLADE's outer losses and every trainable gradient of their sum, from the same rows each call."""
    model = task.model
    model.zero_grad(set_to_none=True)
    forget, retain = BatchStream(task.forget, 4, seed=0).next(), BatchStream(task.retain, 4, seed=1).next()
    with recomputed_swiglu(model) if recompute else contextlib.nullcontext():
        l_fgt = blade.forget_loss(model, forget, cfg)[0]
        l_ret = blade.retain_loss(model, retain, cfg)
        (l_fgt + l_ret).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    return [l_fgt.detach(), l_ret.detach()], grads


@pytest.mark.parametrize("use_lora", [True, False], ids=["lora", "full-parameter"])
def test_recomputing_the_activation_gives_the_same_losses_and_gradients_bit_for_bit(use_lora):
    cfg = BladeConfig(**CFG, use_lora=use_lora)
    task = tiny_task(cfg)
    if use_lora:  # a fresh adapter's B is zero, so only A's gradient would be checked: move it
        with torch.no_grad():
            for p in task.model.parameters():
                if p.requires_grad:
                    p.normal_(0.0, 0.05)
    else:
        for p in task.model.parameters():
            p.requires_grad_(True)
    kept, recomputed = (_losses_and_grads(task, cfg, recompute=flag) for flag in (False, True))
    assert len(kept[1]) == len(recomputed[1]) > 0
    for a, b in zip(kept[0] + kept[1], recomputed[0] + recomputed[1], strict=True):
        assert torch.equal(a, b)
    assert all(g.abs().sum() > 0 for g in recomputed[1][:4])  # the gradients checked are not all zero


def test_under_activation_checkpointing_too():
    """The worker turns both on under CUDA: the checkpointed layers run the recomputing MLP twice."""
    cfg = BladeConfig(**CFG)
    task = tiny_task(cfg)
    kept = _losses_and_grads(task, cfg, recompute=False)
    enable_activation_checkpointing(task.model)
    both = _losses_and_grads(task, cfg, recompute=True)
    for a, b in zip(kept[0] + kept[1], both[0] + both[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def _saved_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: BladeConfig) -> int:
    """Bytes autograd keeps for the backward of one retain loss, parameters aside (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = blade.retain_loss(model, batch, cfg)
    del loss
    return sum(kept.values())


def test_one_activation_fewer_per_layer_is_kept_for_the_backward():
    cfg = BladeConfig(**CFG)
    task = tiny_task(cfg)
    batch = BatchStream(task.retain, 4, seed=0).next()
    config = task.model.get_base_model().config
    b, t = batch["input_ids"].shape
    one_activation = b * t * config.intermediate_size * 4  # fp32
    kept = _saved_bytes(task.model, batch, cfg)
    with recomputed_swiglu(task.model) as n:
        recomputed = _saved_bytes(task.model, batch, cfg)
    assert n == config.num_hidden_layers
    assert kept - recomputed == n * one_activation


def test_the_model_is_as_it_was_afterwards_and_other_mlps_are_left_alone():
    tokenizer = tiny_tokenizer()
    model = new_llama(tokenizer, "test", seed=0)
    mlps = swiglu_mlps(model)
    with recomputed_swiglu(model) as n:
        assert n == len(mlps) == model.config.num_hidden_layers
        assert all("forward" in vars(m) for m in mlps)
    assert not any("forward" in vars(m) for m in mlps)
    with recomputed_swiglu(model):  # the block left nothing behind: it patches again
        pass
    model.config.hidden_act = "gelu"
    gelu = type(model)(model.config)  # the same class, a GELU MLP: not SwiGLU
    with recomputed_swiglu(gelu) as n:
        assert n == 0 and not any("forward" in vars(m) for m in gelu.modules())
