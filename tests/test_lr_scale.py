"""The engine's learning-rate rule (blade_core/lr_scale.py) and the forgot-nothing warning
(blade_core/forget_check.py): unit tests on hand-built values, then `blade unlearn` on the tiny world."""

from __future__ import annotations

import dataclasses
import json

import pytest

from blade_core.forget_check import UNCHANGED_PROB_DELTA, essentially_unchanged, unchanged_warning
from blade_core.lr_scale import (
    TOFU_FINETUNE_LR,
    apply_lr_rule,
    auto_lr_scale,
    resolve_learning_rates,
)
from blade_core.methods.blade import BladeConfig
from blade_core.methods.grad_diff import GradDiffConfig


def test_factor_is_the_build_lr_over_tofus_and_one_without_build_info(tmp_path):
    assert auto_lr_scale(tmp_path) == 1.0  # a model dir without build_info.json: published LRs
    assert auto_lr_scale("meta-llama/Llama-3.2-1B") == 1.0  # a hub id
    (tmp_path / "build_info.json").write_text(json.dumps({"recipe": {"lr": 4e-3}}))
    assert auto_lr_scale(tmp_path) == pytest.approx(4e-3 / TOFU_FINETUNE_LR)
    (tmp_path / "build_info.json").write_text(json.dumps({"recipe": {"lr": 4e-3, "finetune_lr": 2e-4}}))
    assert auto_lr_scale(tmp_path) == pytest.approx(2e-4 / TOFU_FINETUNE_LR)  # a two-stage build
    (tmp_path / "build_info.json").write_text("{not json")
    assert auto_lr_scale(tmp_path) == 1.0


def test_adam_rates_scale_by_the_factor():
    values, record = resolve_learning_rates(GradDiffConfig(), factor=400.0)
    assert values == pytest.approx(
        {"lr": GradDiffConfig().lr * 400, "lora_lr": GradDiffConfig().lora_lr * 400}
    )
    assert record["factor"] == 400.0 and record["explicit"] == []


def test_eta_in_keeps_the_published_value_explicit_values_win_and_the_multiplier_applies():
    # issue 9: eta_in = 1/lambda_max (0.34 on the quick validation target) collapsed utility; the published
    # SGD step is not an Adam LR and is not scaled by the factor.
    values, record = resolve_learning_rates(BladeConfig(), factor=400.0)
    assert values == pytest.approx({"eta_out": BladeConfig.eta_out * 400, "eta_in": BladeConfig.eta_in})
    assert record["sgd_rule"] == "published" and "retain_lambda_max" not in record

    values, record = resolve_learning_rates(
        BladeConfig(), factor=400.0, multiplier=2.0, explicit={"eta_out", "tau"}
    )
    assert values == pytest.approx({"eta_in": BladeConfig.eta_in * 2})  # eta_out was set by the caller
    assert record["explicit"] == ["eta_out"]

    values, _ = resolve_learning_rates(BladeConfig(), factor=1.0)  # a model we did not build
    assert values == pytest.approx({"eta_out": BladeConfig.eta_out, "eta_in": BladeConfig.eta_in})


def test_a_baselines_lora_rate_on_a_built_model_takes_its_methods_validated_multiple():
    from blade_core.lr_scale import LORA_LR_ON_BUILT_MODELS
    from blade_core.methods.simnpo import SimNPOConfig

    lora = dataclasses.replace(GradDiffConfig(), use_lora=True)
    values, record = resolve_learning_rates(lora, factor=400.0)
    assert values["lora_lr"] == pytest.approx(
        GradDiffConfig().lora_lr * 400 * LORA_LR_ON_BUILT_MODELS["grad_diff"]
    )
    assert values["lr"] == pytest.approx(GradDiffConfig().lr * 400)  # the full-parameter rate is unchanged
    assert record["lora_lr_on_built_model"] == LORA_LR_ON_BUILT_MODELS["grad_diff"]
    values, _ = resolve_learning_rates(
        dataclasses.replace(SimNPOConfig(), use_lora=True), factor=400.0, multiplier=2
    )
    assert values["lora_lr"] == pytest.approx(
        SimNPOConfig().lora_lr * 400 * LORA_LR_ON_BUILT_MODELS["simnpo"] * 2
    )
    # a full-parameter run, a model we did not build, an explicit rate: as before, and nothing recorded
    for config, factor, explicit in (
        (GradDiffConfig(), 400.0, ()),
        (lora, 1.0, ()),
        (lora, 400.0, ("lora_lr",)),
    ):
        values, record = resolve_learning_rates(config, factor=factor, explicit=explicit)
        assert values.get("lora_lr", GradDiffConfig().lora_lr * factor) == pytest.approx(
            GradDiffConfig().lora_lr * factor
        )
        assert "lora_lr_on_built_model" not in record
    assert set(LORA_LR_ON_BUILT_MODELS) == {
        "grad_ascent",
        "grad_diff",
        "npo",
        "simnpo",
        "rmu",
        "pdu",
        "blur_npo",
    }


def test_a_saved_rule_is_reused_by_a_resumed_run(tmp_path):
    saved = {
        "factor": 400.0,
        "multiplier": 1.0,
        "sgd_rule": "1/lambda_max",  # an earlier rule's record: the resumed run keeps its values
        "learning_rates": {"eta_in": 0.5, "eta_out": 0.02},
        "explicit": [],
    }
    (tmp_path / "lr_rule.json").write_text(json.dumps(saved))
    again, record = apply_lr_rule(BladeConfig(), model="hub/id", lr_scale=400.0, state_dir=tmp_path)
    assert again.eta_in == pytest.approx(0.5) and record == saved
    other, _ = apply_lr_rule(
        BladeConfig(), model="hub/id", lr_scale=400.0, multiplier=2.0, state_dir=tmp_path
    )
    assert other.eta_in == pytest.approx(BladeConfig.eta_in * 2)  # a different rule is resolved anew
    assert json.loads((tmp_path / "lr_rule.json").read_text())["multiplier"] == 2.0  # and saved


def test_essentially_unchanged_is_a_delta_below_the_threshold():
    assert essentially_unchanged(0.97, 0.97 - UNCHANGED_PROB_DELTA / 2)
    assert essentially_unchanged(0.50, 0.51)
    assert not essentially_unchanged(0.97, 0.97 - 2 * UNCHANGED_PROB_DELTA)
    assert not essentially_unchanged(0.97, 0.0) and not essentially_unchanged(None, 0.5)
    assert unchanged_warning(0.97, 0.10) == ""
    text = unchanged_warning(0.97, 0.965, {"factor": 1.0, "learning_rates": {"eta_out": 5e-5}})
    assert "forget Prob essentially unchanged (0.970 -> 0.965" in text and "eta_out=5e-05" in text
    # Nothing left to forget: an unchanged Prob near zero is not a learning rate too low.
    done = unchanged_warning(0.0004, 0.0003, {"factor": 400.0, "learning_rates": {"eta_out": 2e-2}})
    assert "already below" in done and "learning rate" not in done and "--set" not in done


def _unlearn(world, out, *extra):
    from blade_service.cli.main import main

    return main(
        [
            "unlearn",
            "--model",
            str(world.model_dir),
            "--forget",
            str(world.data_dir / "forget10_perturbed.json"),
            "--retain",
            str(world.data_dir / "retain90.json"),
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


def test_blade_unlearn_applies_the_rule_and_warns_when_nothing_was_forgotten(tiny_world, tmp_path, capsys):
    # The rule: a model we built gets eta_out x its factor and the published eta_in, recorded in run.json.
    # (The reference's batch, 4 x 4: at 4 x 1 this tiny world's retain loss can collapse within a few steps.)
    assert _unlearn(tiny_world, tmp_path / "a", "--max-steps", "12", "--preset", "tofu") == 0
    run = json.loads((tmp_path / "a" / "run.json").read_text())
    rule = run["lr_rule"]
    assert rule["factor"] == pytest.approx(auto_lr_scale(tiny_world.model_dir)) and rule["factor"] > 1
    assert rule["sgd_rule"] == "published"
    assert run["config"]["eta_in"] == pytest.approx(BladeConfig.eta_in)
    assert run["config"]["eta_out"] == pytest.approx(BladeConfig.eta_out * rule["factor"])
    assert run["forget_prob"]["after"] < run["forget_prob"]["before"] - UNCHANGED_PROB_DELTA
    assert run["warnings"] == [] and "warning" not in capsys.readouterr().err

    # The published rates set explicitly on this model: nothing is forgotten, and the CLI says so.
    assert (
        _unlearn(
            tiny_world, tmp_path / "b", "--max-steps", "2", "--set", "eta_out=1e-9", "--set", "eta_in=1e-9"
        )
        == 0
    )
    run = json.loads((tmp_path / "b" / "run.json").read_text())
    assert run["forget_prob"]["essentially_unchanged"] and len(run["warnings"]) == 1
    assert "blade unlearn: warning: forget Prob essentially unchanged" in capsys.readouterr().err

    from blade_service.worker.training import (
        run_notes as _run_notes,  # what the worker stores with the adapter version
    )

    notes = _run_notes(tmp_path / "b")
    assert notes["lr_rule"]["explicit"] == ["eta_in", "eta_out"] and notes["warnings"] == run["warnings"]
    # With their values: after a collapse the worker, not the request, sets eta_out (worker/training.py).
    assert notes["lr_rule"]["explicit_values"] == {"eta_in": 1e-9, "eta_out": 1e-9}
