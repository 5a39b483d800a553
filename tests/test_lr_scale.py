"""The common learning-rate factor for models built from scratch (blade_core/lr_scale.py), in the bench and
in the worker."""

from __future__ import annotations

import json

import pytest

from blade_core.lr_scale import TOFU_FINETUNE_LR, auto_lr_scale, scaled_learning_rates
from blade_core.methods.blade import BladeConfig
from blade_core.methods.grad_diff import GradDiffConfig


def test_scale_is_the_build_lr_over_tofus_and_one_without_build_info(tmp_path):
    assert auto_lr_scale(tmp_path) == 1.0  # a model dir without build_info.json: published LRs
    assert auto_lr_scale("meta-llama/Llama-3.2-1B") == 1.0  # a hub id
    (tmp_path / "build_info.json").write_text(json.dumps({"recipe": {"lr": 4e-3}}))
    assert auto_lr_scale(tmp_path) == pytest.approx(4e-3 / TOFU_FINETUNE_LR)
    (tmp_path / "build_info.json").write_text("{not json")
    assert auto_lr_scale(tmp_path) == 1.0


def test_every_learning_rate_of_a_method_scales_alike():
    assert scaled_learning_rates("blade", 1.0) == {}
    blade = scaled_learning_rates("blade", 400.0)
    assert blade == pytest.approx({"eta_in": BladeConfig.eta_in * 400, "eta_out": BladeConfig.eta_out * 400})
    grad_diff = scaled_learning_rates("grad_diff", 400.0)
    assert grad_diff == pytest.approx(
        {"lr": GradDiffConfig.lr * 400, "lora_lr": GradDiffConfig.lora_lr * 400}
    )


def test_the_worker_keeps_learning_rates_the_request_sets(tmp_path):
    from worker.tasks import _scaled_learning_rates

    (tmp_path / "build_info.json").write_text(json.dumps({"recipe": {"lr": 4e-3}}))
    got = _scaled_learning_rates("blade", str(tmp_path), {"eta_out": 1e-3, "max_steps": 10})
    assert got == pytest.approx({"eta_in": BladeConfig.eta_in * 400})
    assert _scaled_learning_rates("blade", "meta-llama/Llama-3.2-1B", {}) == {}
