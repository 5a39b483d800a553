"""BLADE's mechanisms asserted directly: ratchet, automatic epsilon, batch discipline, recovery, collapse
guard, cancellation, LR calibration and the convergence rule (on scripted loss sequences), and config
validation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from blade_core.data import BatchStream
from blade_core.dynamics import ConvergenceMonitor, LrCalibrator
from blade_core.methods import blade
from blade_core.methods.base import Hooks
from blade_core.methods.blade import PRESETS, BladeConfig, dual_update
from blade_core.modeling import enable_activation_checkpointing
from blade_core.testing import tiny_task
from blade_core.unlearn import build_config

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = {
    "batch_size": 2,
    "grad_accum": 1,
    "max_length": 64,
    "eta_in": 1e-2,
    "eta_out": 1e-2,
}  # one micro-batch a step


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


def _scripted_train(monkeypatch, recovered: float | None, steps: int = 12, **overrides):
    """`train` with scripted losses: epsilon = 1 (inner losses 1.0, eps_mul 1), every outer step measures
    L_ret = 3 (r = 2 > epsilon, so recovery triggers) and L_fgt falling; recovery re-measures `recovered`."""
    monkeypatch.setattr(blade, "inner_loop", lambda *a, **k: [1.0, 1.0, 1.0])
    fgt = iter([10.0 * 0.8**t for t in range(steps)])

    def outer(*a, **k):
        return {"L_fgt": next(fgt), "L_ret": 3.0, "H_fgt": 0.0, "r": 2.0}

    monkeypatch.setattr(blade, "outer_step", outer)
    monkeypatch.setattr(
        blade, "recover", lambda *a, **k: (3, recovered) if recovered is not None else (0, None)
    )
    cfg = BladeConfig(max_steps=steps, eps_mul=1.0, early_stop=False, **{**FAST, **overrides})
    return cfg, blade.train(tiny_task(cfg), cfg).history


def test_recovery_that_always_succeeds_never_sets_t_trans(monkeypatch):
    cfg, h = _scripted_train(monkeypatch, recovered=1.5)  # r_recovered = 0.5 <= epsilon
    assert all(rec["t_trans"] is None for rec in h)
    assert all(rec["r"] == pytest.approx(2.0) and rec["r_recovered"] == pytest.approx(0.5) for rec in h)
    assert all(rec["lr_scale"] != 0.5 for rec in h)  # no violation seen by the calibration either
    lam = cfg.lambda0
    for rec in h:  # the dual update keeps the r measured before the Adam step
        lam = dual_update(lam, 2.0, cfg)
        assert rec["lambda"] == pytest.approx(lam)


def test_recovery_that_fails_sets_t_trans_and_halves_the_lr(monkeypatch):
    _, h = _scripted_train(monkeypatch, recovered=2.5)  # r_recovered = 1.5 > epsilon on every step
    assert [rec["t_trans"] for rec in h[:2]] == [None, None] and h[2]["t_trans"] == 1
    assert h[5]["lr_scale"] == 0.5 and h[6]["lr"] == pytest.approx(h[5]["lr"] * 0.5)


def test_without_recovery_the_outer_r_feeds_the_rules(monkeypatch):
    _, h = _scripted_train(monkeypatch, recovered=None)
    assert all(rec["r_recovered"] is None and rec["L_ret_recovered"] is None for rec in h)
    assert h[2]["t_trans"] == 1


def test_inner_sgd_step_accumulates_grad_accum_micro_batches(monkeypatch):
    cfg = BladeConfig(inner_steps=2, **{**FAST, "grad_accum": 3})
    task = tiny_task(cfg)
    params = [p for p in task.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg.eta_in)
    retain = BatchStream(task.retain, cfg.batch_size, seed=1)
    events = []
    real_loss, real_step = blade.retain_loss, opt.step
    monkeypatch.setattr(blade, "retain_loss", lambda *a, **k: events.append("loss") or real_loss(*a, **k))
    monkeypatch.setattr(opt, "step", lambda *a, **k: events.append("step") or real_step(*a, **k))
    losses = blade.inner_loop(task.model, retain, opt, cfg, task.device)
    assert events == ["loss", "loss", "loss", "step"] * 2
    assert len(losses) == 2 and retain.position == 2 * 3 * cfg.batch_size


@pytest.fixture
def stacked_widths(monkeypatch):
    """The widths of the batches each stacked forward took, in order."""
    widths, real_stack = [], blade.stack_batches

    def stack(batches):
        widths.append([b["input_ids"].shape[1] for b in batches])
        return real_stack(batches)

    monkeypatch.setattr(blade, "stack_batches", stack)
    return widths


def _text_rows(n: int, prefix: str) -> list[dict[str, str]]:
    """MUSE-style text rows of differing lengths (a text world's loss counts every token)."""
    return [
        {"text": f"{prefix} {i} " + "the archive holds letters and maps " * (1 + i % 4)} for i in range(n)
    ]


def _one_step_each_way(step, cfg_of, **rows):
    """`step(task, cfg, params)` unstacked, then stacked, each on a fresh tiny task: (its out, its grads)."""
    runs = {}
    for mode in ("off", "on"):
        cfg = cfg_of(mode)
        task = tiny_task(cfg, **rows)
        params = [p for p in task.model.parameters() if p.requires_grad]
        runs[mode] = step(task, cfg, params), [p.grad.clone() for p in params]
    (off, off_grads), (on, on_grads) = runs["off"], runs["on"]
    assert any(g.abs().sum() > 0 for g in off_grads)
    for a, b in zip(on_grads, off_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    return on, off


@pytest.mark.parametrize(
    "fused, text", [(True, False), (False, False), (True, True)], ids=["fused-head", "logits", "text-rows"]
)
def test_stacked_outer_step_gives_the_unstacked_update(monkeypatch, stacked_widths, fused, text):
    """One forward over every micro-batch (each padded to the widest) changes how L_outer is computed, not
    its value or gradient, with the augmented term still per micro-batch; epsilon is set low so that r > 0
    and the quadratic term counts too."""
    if not fused:
        monkeypatch.setattr(blade, "split_head", lambda model: None)
    rows = {"forget_rows": _text_rows(6, "f"), "retain_rows": _text_rows(24, "r")} if text else {}

    def step(task, cfg, params):
        opt = torch.optim.Adam(params, lr=cfg.eta_out)
        forget = BatchStream(task.forget, cfg.batch_size, seed=cfg.seed)
        retain = BatchStream(task.retain, cfg.batch_size, seed=cfg.seed + 1)
        out = blade.outer_step(task.model, forget, retain, opt, 1.5, 0.05, cfg, task.device)
        assert (forget.position, retain.position) == (6, 6)  # each 3 micro-batches of 2 rows
        return out

    on, off = _one_step_each_way(
        step, lambda mode: BladeConfig(stacked_forward=mode, rho=5.0, **{**FAST, "grad_accum": 3}), **rows
    )
    assert len(stacked_widths) == 1 and len(stacked_widths[0]) == 6  # 3 forget + 3 retain micro-batches
    assert len(set(stacked_widths[0])) > 1  # padding was exercised
    assert off["r"] > 0 and set(on) == set(off)
    for key in off:
        assert on[key] == pytest.approx(off[key], rel=1e-5), key


def test_stacked_inner_loop_gives_the_unstacked_steps(stacked_widths):
    def step(task, cfg, params):
        opt = torch.optim.SGD(params, lr=cfg.eta_in)
        retain = BatchStream(task.retain, cfg.batch_size, seed=1)
        return blade.inner_loop(task.model, retain, opt, cfg, task.device)

    on, off = _one_step_each_way(
        step, lambda mode: BladeConfig(inner_steps=2, stacked_forward=mode, **{**FAST, "grad_accum": 3})
    )
    assert [len(w) for w in stacked_widths] == [3, 3]  # one forward per inner step
    assert any(len(set(w)) > 1 for w in stacked_widths)
    assert on == pytest.approx(off, rel=1e-5)


def test_stacked_training_follows_the_unstacked_run():
    """Whole steps (inner loop, outer step, recovery, dual update): the histories agree while float rounding
    has not yet grown; the loop amplifies it over many steps, as it would any other rounding change."""
    histories = {}
    for mode in ("off", "on"):
        cfg = BladeConfig(max_steps=3, calibrate_lr=False, stacked_forward=mode, **{**FAST, "grad_accum": 2})
        histories[mode] = blade.train(tiny_task(cfg), cfg).history
    for on, off in zip(histories["on"], histories["off"], strict=True):
        for key in ("L_fgt", "L_ret", "lambda", "inner_loss_mean", "recovery_steps"):
            assert on[key] == pytest.approx(off[key], rel=1e-4), (on["step"], key)


@pytest.mark.parametrize("tau, back_propagated", [(1e-6, 0), (1.0, 3)], ids=["deadzone", "every-token"])
def test_a_forget_batch_in_the_deadzone_is_not_back_propagated_and_the_update_is_the_same(
    monkeypatch, tau, back_propagated
):
    """At tau ~ 0 every token's entropy is past the clamp (L_fgt = 0, no gradient); at tau = 1 every token
    counts. Either way the outer step's update is bit for bit the one that back-propagates every forget
    micro-batch."""
    real_forget_loss, passes = blade.forget_loss, []

    def forget_loss(model, batch, cfg):
        l_fgt, h_fgt = real_forget_loss(model, batch, cfg)
        l_fgt.register_hook(lambda grad: passes.append(grad))
        return l_fgt, h_fgt

    monkeypatch.setattr(blade, "forget_loss", forget_loss)
    runs = {}
    for skips in (True, False):
        if not skips:
            monkeypatch.setattr(blade, "in_deadzone", lambda l_fgt: False)
        cfg = BladeConfig(tau=tau, stacked_forward="off", **{**FAST, "grad_accum": 3})
        task = tiny_task(cfg)
        params = [p for p in task.model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=cfg.eta_out)
        forget = BatchStream(task.forget, cfg.batch_size, seed=cfg.seed)
        retain = BatchStream(task.retain, cfg.batch_size, seed=cfg.seed + 1)
        before = [p.detach().clone() for p in params]
        passes.clear()
        out = blade.outer_step(task.model, forget, retain, opt, 1.5, 0.05, cfg, task.device)
        after = [p.detach().clone() for p in params]
        assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # the step moved
        runs[skips] = out, len(passes), after
    (out, counted, weights), (reference, _, reference_weights) = runs[True], runs[False]
    assert counted == back_propagated and (out["L_fgt"] == 0) == (back_propagated == 0)
    assert out == reference
    assert all(torch.equal(a, b) for a, b in zip(weights, reference_weights, strict=True))


def test_stacked_forward_auto_stacks_on_cuda_up_to_its_token_budget():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def step(rows: int, width: int, micro_batches: int = 8):
        return [{"input_ids": torch.zeros(rows, width, dtype=torch.long)}] * micro_batches

    tofu = step(4, 256)  # the outer step at the reference's 4 x 4 and the default max_length: 8,192 positions
    assert blade.stacks_forward(BladeConfig(), cuda, tofu)
    assert not blade.stacks_forward(BladeConfig(), cpu, tofu)
    assert blade.stacks_forward(BladeConfig(), cuda, step(4, blade.AUTO_STACK_MAX_TOKENS // 32))
    assert not blade.stacks_forward(BladeConfig(), cuda, step(4, blade.AUTO_STACK_MAX_TOKENS // 32 + 1))
    assert blade.stacks_forward(BladeConfig(stacked_forward="on"), cpu, step(4, 4096))
    assert not blade.stacks_forward(BladeConfig(stacked_forward="off"), cuda, tofu)


def test_outer_and_inner_batches_are_the_reference_16_rows_in_every_preset_and_without_one():
    default = build_config("blade", None)  # what the service and `blade unlearn` train without a preset
    assert (default.batch_size, default.grad_accum) == (4, 4)
    for name, preset in PRESETS.items():
        cfg = build_config("blade", name)
        assert cfg.batch_size * cfg.grad_accum == 16, name
        assert preset["grad_accum"] > 1


def test_collapse_guard_stops_and_reports_failure():
    cfg = BladeConfig(max_steps=5, collapse_loss=1e-3, recovery_factor=0, **FAST)
    result = blade.train(tiny_task(cfg), cfg)
    assert result.status == "collapsed" and len(result.history) == 1
    assert "collapsed at step 1" in result.message
    assert (
        f"eta_out (it was {cfg.eta_out:g})" in result.message
        and f"rho (it was {cfg.rho:g})" in result.message
    )


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
        "L_ret_recovered",
        "r_recovered",
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


def test_calibration_happens_once_after_max_5_or_tenth_of_t_steps():
    # the reference calibrates at its 0-based step max(5, int(0.1 T)), our 1-based step one later
    assert LrCalibrator(20).at_step == 6 and LrCalibrator(250).at_step == 26
    cal, out = _calibrate(20, [10.0] * 12)  # flat loss: observed pace 0 -> maximum speed-up
    assert out[:5] == [None] * 5 and out[5] == 3.0 and out[6:] == [None] * 6
    assert cal.done and cal.scale == 3.0


def test_calibration_slows_down_a_run_that_forgets_too_fast():
    _, out = _calibrate(300, [10.0 * 0.5**t for t in range(32)])  # halves every step; target: every 100 steps
    assert out[30] == 0.3  # clipped at the lower bound (step 31 = 30 steps after the first)


def test_calibration_scale_is_target_over_observed_per_step_since_the_first():
    total, n_steps = 60, 6  # c = max(5, int(6.0)) = 6: calibrates at step 7, 6 steps after the first
    target = math.log(2) / (total / 3)
    observed = target / 2  # the EMA falls at half the target pace -> x2
    cal = LrCalibrator(total)
    assert cal.at_step == n_steps + 1
    ema_at = 10.0 * math.exp(-observed * n_steps)
    assert cal.update(n_steps + 1, ema_at, 10.0, r=0.0, epsilon=1.0) == pytest.approx(2.0)


def test_calibration_skips_changes_within_8_percent():
    total, n_steps = 60, 6
    target = math.log(2) / (total / 3)
    cal = LrCalibrator(total)
    assert (
        cal.update(n_steps + 1, 10.0 * math.exp(-target * 1.05 * n_steps), 10.0, r=0.0, epsilon=1.0) is None
    )
    assert cal.done and cal.scale is None


def test_calibration_halves_after_a_violation_before_the_calibration_step():
    r = [0.0, 1.5, 0.0, 0.0, 0.0, 0.0]  # r > epsilon (1.0) at step 2
    _, out = _calibrate(30, [10.0] * 6, r=r)
    assert out[5] == 0.5
    _, out = _calibrate(30, [10.0] * 6, r=[0.5] * 6)  # r > 0 but not > epsilon: no violation
    assert out[5] == 3.0
    # as the reference, the calibration step's own r does not count (its 0-based test is step < cal_step)
    _, out = _calibrate(30, [10.0] * 6, r=[0.0] * 5 + [1.5])
    assert out[5] == 3.0


# ------------------------------------------------------------------------------------------------ convergence


def _run_monitor(losses, r, eps=1.0, patience=8, needs_retain_met=False):
    mon = ConvergenceMonitor(patience=patience, needs_retain_met=needs_retain_met)
    for t, (loss, rt) in enumerate(zip(losses, r, strict=True), start=1):
        if mon.update(t, loss, rt, eps):
            return mon, t
    return mon, None


def test_phase_transition_needs_three_violations_in_a_row():
    r = [0, 2, 2, 0, 2, 2, 2, 0, 0]
    mon, _ = _run_monitor([5.0] * len(r), r)
    assert mon.t_trans == 5  # the first step of the run (the reference's step - 2)


def test_convergence_after_transition_drop_and_plateau():
    losses = [10.0 * math.exp(-0.2 * t) for t in range(30)] + [0.02] * 60
    r = [0.0] * 10 + [2.0] * 3 + [0.0] * 77  # violations at steps 11-13: T_trans = 11
    mon, stop = _run_monitor(losses, r)
    assert mon.t_trans == 11 and mon.min_stop_step == int(1.6 * 10) + 1
    assert stop is not None and stop >= mon.min_stop_step + 7
    assert mon.ema <= 0.5 * mon.first and mon.quiet_steps >= 8


def test_no_convergence_without_a_transition_or_without_enough_drop():
    losses = [10.0 * math.exp(-0.2 * t) for t in range(30)] + [0.02] * 60
    assert _run_monitor(losses, [0.0] * 90)[1] is None  # T_trans never known
    flat = [10.0] * 90
    assert _run_monitor(flat, [0.0] * 10 + [2.0] * 80)[1] is None  # EMA never fell by half


def test_convergence_waits_for_1_6_t_trans_and_patience():
    losses = [10.0] + [0.01] * 99  # collapses at once, quiet from the start
    r = [0.0] * 30 + [2.0] * 70  # T_trans = 31, the reference's 0-based 30: stop allowed from 0-based 48
    mon, stop = _run_monitor(losses, r)
    assert mon.t_trans == 31 and mon.min_stop_step == 49
    assert stop == 49 + 8 - 1  # patience counts from the first step whose prerequisites hold
    _, stop20 = _run_monitor([10.0] + [10.0 * 0.9**t for t in range(1, 100)], [2.0] * 100, patience=20)
    _, stop8 = _run_monitor([10.0] + [10.0 * 0.9**t for t in range(1, 100)], [2.0] * 100, patience=8)
    assert stop8 is not None and stop20 is not None and stop20 > stop8


def test_patience_counts_only_once_the_prerequisites_hold():
    # the EMA is below 2% of L_fgt_1 (quiet) from step 26 on, but T_trans is only 31: nothing counts before
    # the minimum stop step int(1.6 * 30) + 1 = 49
    losses = [10.0] + [0.01] * 79
    r = [0.0] * 30 + [2.0] * 50
    mon = ConvergenceMonitor(patience=5)
    counts, quiet_before = [], []
    for t, (loss, rt) in enumerate(zip(losses, r, strict=True), start=1):
        mon.update(t, loss, rt, 1.0)
        counts.append(mon.quiet_steps)
        quiet_before.append(mon.ema < 0.02 * mon.first)
        if mon.converged:
            break
    assert mon.t_trans == 31 and mon.min_stop_step == 49
    assert all(quiet_before[25:48]) and counts[:48] == [0] * 48
    assert counts[48:] == [1, 2, 3, 4, 5] and t == 49 + 5 - 1


def test_patience_is_frozen_not_reset_while_the_prerequisites_lapse():
    mon = ConvergenceMonitor(patience=4, t_trans=1, first=10.0, ema=1.0, vel=-1e-6, vel_peak=1.0)
    mon.update(2, 1.0, 0.0, 1.0)  # ready and quiet
    mon.update(3, 1.0, 0.0, 1.0)
    assert mon.quiet_steps == 2
    mon.update(4, 100.0, 0.0, 1.0)  # the EMA jumps above half of L_fgt_1: prerequisites fail
    assert mon.ema > 5.0 and mon.quiet_steps == 2 and not mon.converged
    # once ready again, a loud step resets the count as the reference does
    ready = ConvergenceMonitor(patience=4, t_trans=1, first=10.0, ema=1.0, vel=0.0, vel_peak=1.0)
    ready.quiet_steps = 2
    ready.update(2, 0.0, 0.0, 1.0)  # the EMA falls fast: |vel| far above 1% of the peak, ema >= 2% of first
    assert ready.quiet_steps == 0


def test_opt_in_stop_waits_for_retain_repair_over_the_whole_patience_window():
    # a seed-789-like run: forget loss near 0 early, T_trans at step 5, r hovering around 0 after it
    losses = [10.0] + [0.01] * 99
    r = [0.0] * 4 + [2.0] * 3 + [0.1, -0.05] * 15 + [-0.02] * 63
    reference, stop_ref = _run_monitor(losses, r)
    assert reference.t_trans == 5 and stop_ref == 33  # the reference stops while r > 0 on half its window
    assert sum(rt > 0 for rt in r[stop_ref - 8 : stop_ref]) == 4
    strict, t = _run_monitor(losses, r, needs_retain_met=True)
    # each r > 0 step reset the count: it stops on the 8th step of the run of r <= 0 that starts at step 37
    assert strict.converged and t == 37 + 7 and all(rt <= 0 for rt in r[t - 8 : t])


def test_no_patience_without_an_observed_peak_velocity():
    mon = ConvergenceMonitor(patience=2, t_trans=1, first=10.0, ema=0.1, vel=0.0, vel_peak=0.0)
    for t in range(2, 6):
        mon.update(t, 0.1, 0.0, 1.0)  # flat EMA: velocity stays 0
    assert mon.quiet_steps == 0 and not mon.converged


def test_monitor_state_round_trips():
    mon, _ = _run_monitor([5.0, 4.0, 3.0], [2.0] * 3)
    other = ConvergenceMonitor()
    other.load_state_dict(mon.state_dict())
    assert other == mon


def test_plotted_t_trans_is_the_runs_own_detector():
    """A BLADE history records t_trans: null throughout means the run never turned, even where the
    pre-recovery r crossed epsilon (recovery succeeded); only histories without the key are re-derived, from
    r_recovered where it exists."""
    from blade_core.plots import transition_step

    rescued = [{"step": t, "r": 1.0, "r_recovered": 0.1, "epsilon": 0.5, "t_trans": None} for t in range(6)]
    assert transition_step(rescued) is None
    assert transition_step([{**rec, "t_trans": 4} for rec in rescued]) == 4
    legacy = [{key: v for key, v in rec.items() if key != "t_trans"} for rec in rescued]
    assert transition_step(legacy) is None  # r_recovered stayed under epsilon
    unrecovered = [{**rec, "r_recovered": None} for rec in legacy]
    assert transition_step(unrecovered) == 2  # no recovery ran: r itself, three in a row ending at step 2


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


# ------------------------------------------------------------------------------------------ checkpointing


def test_activation_checkpointing_keeps_the_gradient_and_warns_nothing():
    """What the worker turns on under CUDA, here on the CPU: a LoRA model with checkpointed layers gets the
    same adapter gradient as without, through transformers' current API (no deprecation warning)."""

    def adapter_grads(checkpointed: bool) -> list[torch.Tensor]:
        task = tiny_task(BladeConfig(**FAST))
        if checkpointed:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a FutureWarning (the pre-v6 name) fails the test
                enable_activation_checkpointing(task.model)
            assert task.model.config.use_cache is False
            assert task.model.base_model.model.model.gradient_checkpointing
        batch = BatchStream(task.retain, 4, seed=0).next()
        task.model(**batch).loss.backward()
        return [p.grad.clone() for p in task.model.parameters() if p.requires_grad]

    plain, checkpointed = adapter_grads(False), adapter_grads(True)
    assert len(plain) == len(checkpointed) > 0
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
