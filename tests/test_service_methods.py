"""Every method through the worker's training path, in process: the preset and checks the worker applies
(`worker.training.service_config_preset`) and the runner it calls (`run_unlearning`), each request stacked on
the adapters before it as the service stacks them. Each must write a PEFT adapter that plain `peft` loads on
the base model; all eight then load together as one stack. And the worker's error classification: a training
failure is never a missing base model, which the engine reports with its own exception type.
"""

from __future__ import annotations

import json

import pytest

from blade_core.methods import METHOD_NAMES, service_preset
from blade_core.testing import write_rows
from blade_service.contracts.errors import BaseModelUnavailable
from tests.fixtures_worker import forget_rows, retain_rows

COMMON = {"max_steps": 2, "max_length": 64, "batch_size": 2, "show_progress": False}
PARAMS = {
    "blade": {"max_steps": 2, "max_length": 64, "batch_size": 2, "early_stop": False, "inner_steps": 1},
    **{m: {**COMMON, "grad_accum": 1} for m in METHOD_NAMES if m != "blade"},
}


def test_every_method_trains_a_lora_adapter_that_stacks(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from blade_core.lora import check_adapter_dir, load_with_stack
    from blade_core.unlearn import run_unlearning
    from blade_service.worker.training import service_config_preset as _service_config_preset

    forget = write_rows(tmp_path / "forget.jsonl", forget_rows())
    retain = write_rows(tmp_path / "retain.jsonl", retain_rows())
    stack = []
    for method in METHOD_NAMES:
        overrides = dict(PARAMS[method])
        preset = _service_config_preset(method, overrides)
        assert preset == service_preset(method) == (None if method == "blade" else "lora")
        out = run_unlearning(
            model=tiny_model_dir,
            forget=forget,
            retain=retain,
            out_dir=tmp_path / method,
            method=method,
            preset=preset,
            adapters=stack,
            overrides=overrides,
            device="cpu",
        )
        assert out.ok and not out.full_model and len(out.history) == 2, (method, out.status, out.message)
        stack.append(check_adapter_dir(out.adapter_dir))
        config = json.loads((out.adapter_dir / "adapter_config.json").read_text())
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), out.adapter_dir
        )
        assert any("lora_" in n for n, _ in model.named_parameters()), method
        run = json.loads((out.adapter_dir / "run.json").read_text())
        if method == "blade":
            continue
        assert (config["r"], config["lora_alpha"]) == (128, 128)  # OpenUnlearning's LoRA model configs
        assert run["optimizer_steps"] == 2 and run["forget_rows_seen"] == 4  # 2 steps x 2 rows
        assert run["config"]["use_lora"] is True and run["config"]["epochs"] == 5.0
        if method == "rmu":
            assert sorted(config["target_modules"]) == [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    model, _ = load_with_stack(tiny_model_dir, stack, "cpu")  # the worker's loader: all eight, all active
    assert len(model.peft_config) == len(METHOD_NAMES)


def test_the_service_refuses_a_full_parameter_run():
    from blade_service.worker.errors import TaskFailure
    from blade_service.worker.training import service_config_preset as _service_config_preset

    with pytest.raises(TaskFailure) as info:
        _service_config_preset("grad_diff", {"use_lora": False})
    assert info.value.code == "invalid_request" and "use_lora" in info.value.message
    with pytest.raises(TaskFailure) as info:
        _service_config_preset("npo", {"beta": 0})
    assert info.value.code == "invalid_request" and "beta" in info.value.message


def test_a_training_failure_is_never_called_a_missing_base_model(tmp_path):
    from blade_service.worker.errors import classify as _classify

    adapter_missing = FileNotFoundError(
        f"{tmp_path}/adapter: not a PEFT adapter directory (missing adapter_config.json)"
    )
    assert _classify(adapter_missing)[0] == "internal_error"
    assert _classify(OSError("config.json: disk quota exceeded"))[0] == "internal_error"
    assert _classify(BaseModelUnavailable("/models/x: no config.json"))[0] == "base_model_unavailable"


def test_loading_a_model_that_is_not_there_raises_base_model_unavailable(tmp_path, tiny_model_dir):
    from blade_core.modeling import load_model, load_tokenizer

    with pytest.raises(BaseModelUnavailable, match=r"no config\.json"):
        load_model(tmp_path)  # a directory without a model in it
    with pytest.raises(BaseModelUnavailable, match="no such directory"):
        load_model(tmp_path / "no" / "such" / "dir")
    (tmp_path / "weights-only").mkdir()
    (tmp_path / "weights-only" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(BaseModelUnavailable, match="could not be loaded"):
        load_model(tmp_path / "weights-only")  # a config but no safetensors weights
    with pytest.raises(BaseModelUnavailable, match="tokenizer"):
        load_tokenizer(tmp_path / "weights-only")


def test_a_baseline_draws_no_bar_of_its_own_under_the_runner(tiny_model_dir, tmp_path, capsys):
    """The worker runs with progress=False: its log (JSON lines) gets no tqdm bar from a baseline's loop."""
    from blade_core.unlearn import run_unlearning

    forget = write_rows(tmp_path / "forget.jsonl", forget_rows())
    retain = write_rows(tmp_path / "retain.jsonl", retain_rows())
    overrides = {"max_steps": 2, "max_length": 64, "batch_size": 2, "grad_accum": 1}
    out = run_unlearning(
        model=str(tiny_model_dir), forget=forget, retain=retain, out_dir=tmp_path / "npo", method="npo",
        preset="lora", overrides=overrides, progress=False,
    )  # fmt: skip
    assert out.status == "max_steps" and len(out.history) == 2
    assert "npo:" not in capsys.readouterr().err
