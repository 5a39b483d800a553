"""Checkpoint/resume: a run killed mid-way and resumed from its checkpoint ends with the same adapter weights
and the same history as an uninterrupted one."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from blade_core.checkpoint import (
    CheckpointMismatch,
    checkpoint_path,
    config_fingerprint,
    config_mismatch,
    has_checkpoint,
)
from blade_core.methods.base import Hooks
from blade_core.methods.blade import BladeConfig
from blade_core.unlearn import run_unlearning

pytestmark = pytest.mark.usefixtures("one_thread")

# Past step 5 so the LR calibration and recovery are inside the resumed part.
SETTINGS = {"eta_out": 3e-3, "eta_in": 0.05, "batch_size": 2, "max_length": 64, "checkpoint_every": 3}
T = 8


class Killed(Exception):
    pass


def _run(world, out_dir, hooks, grad_accum=1):
    return run_unlearning(
        model=world.model,
        forget=world.forget,
        retain=world.retain,
        out_dir=out_dir,
        overrides={**SETTINGS, "grad_accum": grad_accum},
        max_steps=T,
        hooks=hooks,
    )


def _comparable(history):
    return [{k: v for k, v in rec.items() if k != "dt"} for rec in history]


@pytest.mark.parametrize("grad_accum", [1, 2])  # 2: inner and outer steps accumulate micro-batches
def test_resume_equals_uninterrupted(engine_world, tmp_path, grad_accum):
    full = _run(engine_world, tmp_path / "full", Hooks(), grad_accum)

    def crash_at_5(record):
        if record["step"] == 5:
            raise Killed  # like a SIGKILL after step 5: the last checkpoint is step 3's

    ckpt = tmp_path / "ckpt"
    with pytest.raises(Killed):
        _run(engine_world, tmp_path / "resumed", Hooks(on_step=crash_at_5, checkpoint_dir=ckpt), grad_accum)
    assert has_checkpoint(ckpt)

    seen = []
    resumed = _run(
        engine_world,
        tmp_path / "resumed",
        Hooks(on_step=lambda r: seen.append(r["step"]), checkpoint_dir=ckpt),
        grad_accum,
    )
    assert seen == [4, 5, 6, 7, 8]  # continued after step 3
    assert resumed.status == full.status
    got, want = _comparable(resumed.history), _comparable(full.history)
    assert [r["step"] for r in got] == list(range(1, T + 1))
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(b[key], float):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
            else:
                assert a[key] == b[key], (a["step"], key)
    assert any(r["lr_scale"] for r in want)  # the calibration happened after the checkpoint
    w_full = load_file(str(full.adapter_dir / "adapter_model.safetensors"))
    w_res = load_file(str(resumed.adapter_dir / "adapter_model.safetensors"))
    assert w_full.keys() == w_res.keys()
    assert all(torch.allclose(w_full[k], w_res[k], rtol=1e-5, atol=1e-7) for k in w_full)


def test_resume_refuses_a_checkpoint_of_another_config(engine_world, tmp_path):
    ckpt = tmp_path / "ckpt"
    run_unlearning(
        model=engine_world.model,
        forget=engine_world.forget,
        retain=engine_world.retain,
        out_dir=tmp_path / "a",
        overrides=SETTINGS,
        max_steps=4,
        hooks=Hooks(checkpoint_dir=ckpt),
    )
    assert has_checkpoint(ckpt)
    with pytest.raises(CheckpointMismatch, match=r"cannot continue this run \(tau: 0\.7 -> 0\.5\)"):
        run_unlearning(
            model=engine_world.model,
            forget=engine_world.forget,
            retain=engine_world.retain,
            out_dir=tmp_path / "b",
            overrides={**SETTINGS, "tau": 0.5},
            max_steps=4,
            hooks=Hooks(checkpoint_dir=ckpt),
        )


def test_resume_with_tuple_fields_in_the_config(engine_world, tmp_path):
    ckpt, settings = tmp_path / "ckpt", {**SETTINGS, "lora_target_modules": "q_proj,v_proj"}
    kwargs = {
        "model": engine_world.model,
        "forget": engine_world.forget,
        "retain": engine_world.retain,
        "overrides": settings,
        "max_steps": 4,
    }
    run_unlearning(out_dir=tmp_path / "a", hooks=Hooks(checkpoint_dir=ckpt), **kwargs)
    seen = []
    out = run_unlearning(
        out_dir=tmp_path / "b", hooks=Hooks(checkpoint_dir=ckpt, on_step=seen.append), **kwargs
    )
    assert [r["step"] for r in seen] == [4] and len(out.history) == 4


def _checkpoint_without(ckpt, field):
    """Rewrite the checkpoint as a build that did not have `field` yet would have written it."""
    payload = torch.load(checkpoint_path(ckpt), weights_only=True)
    del payload["state"]["config"][field]
    torch.save(payload, checkpoint_path(ckpt))


def test_resume_across_an_upgrade_that_added_a_config_field(engine_world, tmp_path):
    ckpt = tmp_path / "ckpt"
    kwargs = {
        "model": engine_world.model,
        "forget": engine_world.forget,
        "retain": engine_world.retain,
        "max_steps": 4,
    }
    run_unlearning(out_dir=tmp_path / "a", overrides=SETTINGS, hooks=Hooks(checkpoint_dir=ckpt), **kwargs)
    _checkpoint_without(ckpt, "stop_needs_retain_met")
    added_later = r"stop_needs_retain_met: \(not a setting then; its default\) -> True"
    with pytest.raises(CheckpointMismatch, match=added_later):
        run_unlearning(
            out_dir=tmp_path / "b",
            overrides={**SETTINGS, "stop_needs_retain_met": True},
            hooks=Hooks(checkpoint_dir=ckpt),
            **kwargs,
        )
    seen = []
    out = run_unlearning(
        out_dir=tmp_path / "c",
        overrides=SETTINGS,
        hooks=Hooks(checkpoint_dir=ckpt, on_step=seen.append),
        **kwargs,
    )
    assert [r["step"] for r in seen] == [4] and len(out.history) == 4


@dataclass
class _Config:
    lr: float = 1e-3
    modules: tuple[str, ...] = ("q", "v")
    checkpoint_every: int = 10


def test_config_mismatch_names_each_field():
    now = _Config()
    assert config_mismatch({"lr": 1e-3, "modules": ["q", "v"]}, now) == []
    assert config_mismatch({"lr": 1e-3}, now) == []  # `modules` added later, at its default
    assert config_mismatch({"lr": 1e-3}, _Config(modules=("q",))) == [
        "modules: (not a setting then; its default) -> ['q']"
    ]
    assert config_mismatch({"lr": 2e-3, "modules": ["q", "v"], "beta": 0.9}, now) == [
        "beta: 0.9 -> (no longer a setting)",
        "lr: 0.002 -> 0.001",
    ]
    assert config_mismatch(None, now) == ["(the checkpoint records no config)"]
    # how often it saves, whether it draws a bar: nothing computed, whatever an older checkpoint saved
    assert config_mismatch({"lr": 1e-3, "modules": ["q", "v"], "show_progress": True}, now) == []
    assert config_mismatch({"lr": 1e-3, "modules": ["q", "v"]}, _Config(checkpoint_every=5)) == []
    # how BLADE computes the same update: a request paused on one device resumes on another
    unstacked = config_fingerprint(BladeConfig(stacked_forward="off"))
    assert config_mismatch(unstacked, BladeConfig(stacked_forward="on")) == []
