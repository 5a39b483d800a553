"""BLADE's mechanisms asserted directly: ratchet, automatic epsilon, batch discipline, recovery, collapse
guard, cancellation, LR calibration and the convergence rule (on scripted loss sequences), and config
validation."""

from __future__ import annotations

import math

import pytest

from blade_core.data import BatchStream
from blade_core.dynamics import ConvergenceMonitor, LrCalibrator
from blade_core.methods import blade
from blade_core.methods.base import Hooks
from blade_core.methods.blade import PRESETS, BladeConfig, dual_update
from blade_core.testing import tiny_task
from blade_core.unlearn import build_config

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {"batch_size": 2, "max_length": 64, "eta_in": 1e-2, "eta_out": 1e-2}


# ------------------------------------------------------------------------------------------------ dual update


def test_ratchet_up_by_rho_r_down_by_alpha_rho_r_with_floor_and_cap():
    cfg = BladeConfig(rho=0.1, alpha=0.1, lambda_min=0.1)
    assert dual_update(1.0, 0.5, cfg) == pytest.approx(1.0 + 0.1 * 0.5)
    assert dual_update(1.0, -0.5, cfg) == pytest.approx(1.0 - 0.1 * 0.1 * 0.5)
    assert dual_update(1.0, 0.0, cfg) == 1.0
    assert dual_update(0.1, -5.0, cfg) == 0.1  # floor lambda_min
    assert dual_update(0.12, -5.0, cfg) == 0.1
    capped = BladeConfig(rho=0.1, lambda_max=1.02)
    assert dual_update(1.0, 0.5, capped) == 1.02
    # asymmetry: one violation of size r outweighs ten slack steps of size r
    lam = dual_update(1.0, 0.3, cfg)
    for _ in range(10):
        lam = dual_update(lam, -0.3, cfg)
    assert lam == pytest.approx(1.0)


# -------------------------------------------------------------------------------------------- loop structure


def _trace(monkeypatch):
    """Log every inner loop / outer step and every batch drawn from each stream, tagged with the phase."""
    events, phase = [], {"now": None}
    real_inner, real_outer, real_next = blade.inner_loop, blade.outer_step, BatchStream.next_indices

    def inner(*a, **k):
        phase["now"] = "inner"
        events.append(("inner",))
        return real_inner(*a, **k)

    def outer(*a, **k):
        phase["now"] = "outer"
        events.append(("outer",))
        return real_outer(*a, **k)

    def next_indices(self):
        picked = real_next(self)
        events.append(("draw", phase["now"], self.dataset.source, self.seed, tuple(picked)))
        return picked

    monkeypatch.setattr(blade, "inner_loop", inner)
    monkeypatch.setattr(blade, "outer_step", outer)
    monkeypatch.setattr(BatchStream, "next_indices", next_indices)
    return events


def test_epsilon_comes_from_the_first_inner_loop_which_is_step_ones(monkeypatch):
    events = _trace(monkeypatch)
    cfg = BladeConfig(max_steps=3, recovery_factor=0, calibrate_lr=False, eps_mul=0.85, **FAST)
    result = blade.train(tiny_task(cfg), cfg)
    h = result.history
    assert h[0]["epsilon"] == pytest.approx(0.85 * h[0]["inner_loss_mean"])
    assert all(rec["epsilon"] == h[0]["epsilon"] for rec in h)  # fixed after step 1
    loops = [e[0] for e in events if e[0] != "draw"]
    assert loops == ["inner", "outer"] * 3  # no extra loop before step 1; inner before outer every step
    # nothing drawn before the first inner loop
    assert next(e for e in events if e[0] == "draw")[1] == "inner"


def test_fixed_epsilon_is_used_as_given(monkeypatch):
    cfg = BladeConfig(max_steps=2, recovery_factor=0, epsilon=0.5, **FAST)
    h = blade.train(tiny_task(cfg), cfg).history
    assert [rec["epsilon"] for rec in h] == [0.5, 0.5]
    assert h[0]["r"] == pytest.approx(h[0]["L_ret"] - 0.5)


def test_outer_step_uses_a_fresh_retain_batch(monkeypatch):
    events = _trace(monkeypatch)
    cfg = BladeConfig(max_steps=3, recovery_factor=0, inner_steps=3, **FAST)
    task = tiny_task(cfg)
    blade.train(task, cfg)
    retain_seed = cfg.seed + 1
    steps, current = [], None
    for e in events:
        if e[0] == "inner":
            current = {"inner": [], "outer": [], "forget": 0}
            steps.append(current)
        elif e[0] == "draw" and e[3] == retain_seed:
            current[e[1]].append(set(e[4]))
        elif e[0] == "draw":
            assert e[1] == "outer"  # forget batches only in the outer step
            current["forget"] += 1
    assert len(steps) == 3
    for s in steps:
        assert len(s["inner"]) == cfg.inner_steps and len(s["outer"]) == 1 and s["forget"] == 1
        inner_rows = set().union(*s["inner"])
        assert not inner_rows & s["outer"][0]  # 24 retain rows, 8 drawn per step: all within one epoch


def test_lambda_in_history_is_after_the_update_with_the_measured_r():
    cfg = BladeConfig(max_steps=3, recovery_factor=0, calibrate_lr=False, **FAST)
    h = blade.train(tiny_task(cfg), cfg).history
    lam = cfg.lambda0
    for rec in h:
        lam = dual_update(lam, rec["r"], cfg)
        assert rec["lambda"] == pytest.approx(lam)
        assert rec["r"] == pytest.approx(rec["L_ret"] - rec["epsilon"])


# ------------------------------------------------------------------------------------------------ recovery


@pytest.mark.parametrize(
    ("l_ret", "measured", "spent", "last"),
    [
        (1.9, [], 0, None),  # below 2*epsilon: no recovery
        (2.0, [], 0, None),  # not strictly above
        (2.5, [1.0], 3, 1.0),  # one inner loop brings it back
        (2.5, [3.0, 2.2, 1.5], 9, 1.5),  # three loops
        (2.5, [9.0, 9.0, 9.0, 9.0, 9.0], 9, 9.0),  # stops at 3K extra steps
    ],
)
def test_recovery_runs_only_above_two_epsilon_and_stops_at_3k(monkeypatch, l_ret, measured, spent, last):
    calls = []
    scripted = iter(measured)
    monkeypatch.setattr(blade, "inner_loop", lambda *a, **k: calls.append(1) or [0.0] * 3)
    monkeypatch.setattr(blade, "measure_retain", lambda *a, **k: next(scripted))
    cfg = BladeConfig(inner_steps=3)
    got = blade.recover(None, None, None, l_ret, 1.0, cfg, None)
    assert got == (spent, last)
    assert len(calls) * cfg.inner_steps == spent


def test_collapse_guard_stops_and_reports_failure():
    cfg = BladeConfig(max_steps=5, collapse_loss=1e-3, recovery_factor=0, **FAST)
    result = blade.train(tiny_task(cfg), cfg)
    assert result.status == "collapsed" and len(result.history) == 1
    assert "collapsed at step 1" in result.message


def test_hooks_progress_and_cancellation():
    seen = []
    hooks = Hooks(on_step=seen.append, should_stop=lambda: len(seen) >= 2)
    cfg = BladeConfig(max_steps=6, recovery_factor=0, **FAST)
    result = blade.train(tiny_task(cfg, hooks=hooks), cfg)
    assert result.status == "cancelled" and [r["step"] for r in seen] == [1, 2]
    assert result.history == seen
    for key in (
        "step",
        "L_fgt",
        "L_ret",
        "r",
        "lambda",
        "lr",
        "epsilon",
        "inner_loss_mean",
        "recovery_steps",
        "lfgt_ema",
        "vel_ema",
        "t_trans",
        "converged",
        "dt",
    ):
        assert key in seen[0]


# -------------------------------------------------------------------------------------------- LR calibration


def _calibrate(total: int, losses: list[float], r: list[float] | None = None, eps: float = 1.0):
    cal, mon = LrCalibrator(total), ConvergenceMonitor()
    out = []
    for t, loss in enumerate(losses, start=1):
        mon.update(t, loss, (r or [0.0] * len(losses))[t - 1], eps)
        out.append(cal.update(t, mon.ema, mon.first, (r or [0.0] * len(losses))[t - 1], eps))
    return cal, out


def test_calibration_happens_once_at_max_5_or_tenth_of_t():
    assert LrCalibrator(20).at_step == 5 and LrCalibrator(250).at_step == 25
    cal, out = _calibrate(20, [10.0] * 12)  # flat loss: observed pace 0 -> maximum speed-up
    assert out[:4] == [None] * 4 and out[4] == 3.0 and out[5:] == [None] * 7
    assert cal.done and cal.scale == 3.0


def test_calibration_slows_down_a_run_that_forgets_too_fast():
    _, out = _calibrate(300, [10.0 * 0.5**t for t in range(30)])  # halves every step; target: every 100 steps
    assert out[29] == 0.3  # clipped at the lower bound


def test_calibration_scale_is_target_over_observed():
    total, at = 60, 6
    target = math.log(2) / (total / 3)
    observed = target / 2  # the EMA falls at half the target pace -> x2
    cal = LrCalibrator(total)
    ema_at = 10.0 * math.exp(-observed * at)
    assert cal.update(at, ema_at, 10.0, r=0.0, epsilon=1.0) == pytest.approx(2.0)


def test_calibration_skips_changes_within_8_percent():
    total, at = 60, 6
    target = math.log(2) / (total / 3)
    cal = LrCalibrator(total)
    assert cal.update(at, 10.0 * math.exp(-target * 1.05 * at), 10.0, r=0.0, epsilon=1.0) is None
    assert cal.done and cal.scale is None


def test_calibration_halves_after_any_violation():
    r = [0.0, 1.5, 0.0, 0.0, 0.0, 0.0]  # r > epsilon (1.0) at step 2
    _, out = _calibrate(30, [10.0] * 6, r=r)
    assert out[4] == 0.5
    _, out = _calibrate(30, [10.0] * 6, r=[0.5] * 6)  # r > 0 but not > epsilon: no violation
    assert out[4] == 3.0


# ------------------------------------------------------------------------------------------------ convergence


def _run_monitor(losses, r, eps=1.0, patience=8):
    mon = ConvergenceMonitor(patience=patience)
    for t, (loss, rt) in enumerate(zip(losses, r, strict=True), start=1):
        if mon.update(t, loss, rt, eps):
            return mon, t
    return mon, None


def test_phase_transition_needs_three_violations_in_a_row():
    r = [0, 2, 2, 0, 2, 2, 2, 0, 0]
    mon, _ = _run_monitor([5.0] * len(r), r)
    assert mon.t_trans == 7


def test_convergence_after_transition_drop_and_plateau():
    losses = [10.0 * math.exp(-0.2 * t) for t in range(30)] + [0.02] * 60
    r = [0.0] * 10 + [2.0] * 3 + [0.0] * 77  # T_trans = 13
    mon, stop = _run_monitor(losses, r)
    assert mon.t_trans == 13
    assert stop is not None and stop >= 1.6 * 13
    assert mon.ema <= 0.5 * mon.first and mon.quiet_steps >= 8


def test_no_convergence_without_a_transition_or_without_enough_drop():
    losses = [10.0 * math.exp(-0.2 * t) for t in range(30)] + [0.02] * 60
    assert _run_monitor(losses, [0.0] * 90)[1] is None  # T_trans never known
    flat = [10.0] * 90
    assert _run_monitor(flat, [0.0] * 10 + [2.0] * 80)[1] is None  # EMA never fell by half


def test_convergence_waits_for_1_6_t_trans_and_patience():
    losses = [10.0] + [0.01] * 99  # collapses at once, quiet from the start
    r = [0.0] * 30 + [2.0] * 70  # T_trans = 33
    mon, stop = _run_monitor(losses, r)
    assert mon.t_trans == 33 and stop == math.ceil(1.6 * 33)
    _, stop20 = _run_monitor([10.0] + [10.0 * 0.9**t for t in range(1, 100)], [2.0] * 100, patience=20)
    _, stop8 = _run_monitor([10.0] + [10.0 * 0.9**t for t in range(1, 100)], [2.0] * 100, patience=8)
    assert stop8 is not None and stop20 is not None and stop20 > stop8


def test_monitor_state_round_trips():
    mon, _ = _run_monitor([5.0, 4.0, 3.0], [2.0] * 3)
    other = ConvergenceMonitor()
    other.load_state_dict(mon.state_dict())
    assert other == mon


# ------------------------------------------------------------------------------------------------ config


def test_build_config_layers_preset_overrides_and_coerces_strings():
    cfg = build_config(
        "blade",
        "muse",
        {"tau": "0.6", "lambda_max": "none", "lora_target_modules": "q_proj,v_proj", "calibrate_lr": "false"},
        max_steps=40,
        seed=3,
    )
    assert isinstance(cfg, BladeConfig)
    assert (cfg.eta_out, cfg.eps_mul, cfg.lora_r, cfg.lora_alpha, cfg.patience) == (3e-5, 3.2, 16, 32, 20)
    assert cfg.tau == 0.6 and cfg.lambda_max is None and cfg.calibrate_lr is False
    assert cfg.lora_target_modules == ("q_proj", "v_proj") and cfg.max_steps == 40 and cfg.seed == 3
    assert build_config("blade", "knowundo").max_steps == 150
    assert build_config("blade", "tofu_forget10").max_steps == 500
    assert set(PRESETS) >= {"tofu", "muse", "knowundo"}


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"overrides": {"taux": 0.5}}, r"unknown parameter 'taux'.*0\.5"),
        ({"overrides": {"tau": "hot"}}, r"BladeConfig\.tau.*'hot'"),
        ({"overrides": {"tau": 1.5}}, r"BladeConfig\.tau.*1\.5"),
        ({"overrides": {"inner_steps": 0}}, r"BladeConfig\.inner_steps.*0"),
        ({"overrides": {"forget_tokens": "some"}}, r"BladeConfig\.forget_tokens.*'some'"),
        ({"overrides": {"lambda0": 0.01}}, r"lambda0.*0\.01"),
        ({"preset": "tofuu"}, r"unknown preset 'tofuu'.*tofu"),
        ({"max_steps": 0}, r"max_steps.*0"),
    ],
)
def test_build_config_errors_name_the_field_and_value(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_config("blade", **kwargs)
