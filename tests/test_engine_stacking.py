"""LoRA wiring: only the adapter trains, the base and the stacked adapters stay unchanged (byte-identical
files), the stack is active underneath the new adapter, and target discovery works beyond Llama."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from blade_core import lora
from blade_core.methods import blade
from blade_core.methods.blade import BladeConfig
from blade_core.modeling import load_model_and_tokenizer
from blade_core.testing import tiny_model, tiny_task, tiny_tokenizer
from blade_core.unlearn import run_unlearning

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"eta_in": "0.05", "eta_out": "0.01", "batch_size": "2", "max_length": "64"}


def _digest(directory) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()
    }


def test_default_targets_on_llama_and_discovery_elsewhere():
    assert lora.default_target_modules(tiny_model(tiny_tokenizer())) == list(lora.LLAMA_TARGETS)

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.ModuleDict({"fc_in": nn.Linear(4, 8), "fc_out": nn.Linear(8, 4)})
            self.lm_head = nn.Linear(4, 10)

    assert lora.default_target_modules(Toy()) == ["fc_in", "fc_out"]


def test_only_adapter_weights_train_and_base_weights_do_not_change():
    tok = tiny_tokenizer()
    model = tiny_model(tok)
    base_before = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = BladeConfig(max_steps=2, recovery_factor=0, eta_in=0.05, eta_out=0.01, batch_size=2, max_length=64)
    task = tiny_task(cfg, model=model, tokenizer=tok)
    trainable = [n for n, p in task.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and ".unlearn." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B on 7 projections in 2 layers
    lora_b_before = {n: p.detach().clone() for n, p in task.model.named_parameters() if "lora_B" in n}
    blade.train(task, cfg)
    changed = [
        n for n, p in task.model.named_parameters() if "lora_B" in n and not torch.equal(p, lora_b_before[n])
    ]
    assert changed
    base_after = task.model.unload().state_dict()
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_after[k], base_before[k]) for k in base_before)


def test_stacked_adapters_are_active_frozen_and_byte_identical(engine_world, tmp_path):
    common = {
        "model": engine_world.model,
        "forget": engine_world.forget,
        "retain": engine_world.retain,
        "max_steps": 2,
        "overrides": FAST,
    }
    first = run_unlearning(out_dir=tmp_path / "a1", **common).adapter_dir
    before = _digest(first)
    assert set(before) >= {"adapter_config.json", "adapter_model.safetensors", "history.json"}
    second = run_unlearning(out_dir=tmp_path / "a2", adapters=[first], seed=1, **common).adapter_dir
    assert _digest(first) == before  # the stack's files are only read

    # the stack sits underneath, active and frozen, when the next adapter is attached
    base, tok = load_model_and_tokenizer(engine_world.model, torch.device("cpu"))
    ids = tok("Question: Where was fAda Birch born?\nAnswer:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        plain = base(input_ids=ids).logits
    model = lora.attach_adapter(lora.load_stack(base, [first]), BladeConfig())
    assert list(model.base_model.active_adapters) == ["stack0", "unlearn"]
    assert all(".unlearn." in n for n, p in model.named_parameters() if p.requires_grad)
    with torch.no_grad():
        stacked = model(input_ids=ids).logits  # the new adapter starts at zero: base + stack0
    assert not torch.allclose(stacked, plain)

    # evaluation view: base + both adapters differs from base + the first alone
    one, _ = lora.load_with_stack(engine_world.model, [first], "cpu")
    both, _ = lora.load_with_stack(engine_world.model, [first, second], "cpu")
    with torch.no_grad():
        assert torch.allclose(one(input_ids=ids).logits, stacked, atol=1e-6)
        assert not torch.allclose(both(input_ids=ids).logits, stacked, atol=1e-4)
    assert _digest(first) == before


def test_missing_adapter_dir_is_a_clear_error(engine_world, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a PEFT adapter directory"):
        run_unlearning(
            model=engine_world.model,
            forget=engine_world.forget,
            retain=engine_world.retain,
            out_dir=tmp_path / "o",
            adapters=[tmp_path],
            max_steps=1,
        )
