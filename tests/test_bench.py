"""`blade bench` end to end on a very small world: 2 methods x 1 split x 1 seed, a few steps.

The shared tiny world (`tiny_world`, `tiny_gold`: 12 authors, quick-size target and forget10 gold) is the
validation world; a copy of it under another path is the reported ("test") world, so the test can prove the
selection never opens the test world's files. Runs the bench through the CLI and checks results.json against
CONTRACT.md (rows, `selection`, `test_world_seeds`), results.md's tables and the plot files; a second
invocation must reuse the cached runs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from numpy._core._multiarray_umath import __cpu_dispatch__

from blade_core import bench
from blade_core.bench import run as bench_run
from blade_core.bench.measure import machine, numpy_narrower_hint, numpy_simd
from blade_core.bench.selection import beyond_edge, choose
from blade_core.build_common import cpu_identity
from blade_service.cli.main import main

CONTRACT_ROW_KEYS = {
    "method",
    "split",
    "seed",
    "MU",
    "Prob",
    "ROUGE",
    "HM",
    "forget_quality",
    "privleak",
    "steps",
    "time_s",
    "peak_mem_mb",
}


@pytest.fixture(scope="module")
def small_world(tiny_world, tiny_gold, tmp_path_factory):
    """The test world: a copy (data, target, forget10 gold) of the shared 12-author world under another path;
    the shared world itself is the validation world."""
    root = tmp_path_factory.mktemp("test-world")
    copies = (("data", tiny_world.data_dir), ("target", tiny_world.model_dir), ("gold", tiny_gold.model_dir))
    for name, src in copies:
        shutil.copytree(src, root / name)
    return root / "data", root / "target", root / "gold"


@pytest.fixture(scope="module")
def validation_world(tiny_world):
    return tiny_world.data_dir, tiny_world.model_dir


class OpenedFiles:
    """Every path Python opens while `recording` (an audit hook; hooks cannot be removed, so it idles)."""

    def __init__(self) -> None:
        self.recording = False
        self.paths: list[Path] = []
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if self.recording and event == "open" and isinstance(args[0], (str, bytes, Path)):
            path = args[0].decode() if isinstance(args[0], bytes) else args[0]
            self.paths.append(Path(path).resolve())

    def under(self, root: Path) -> list[Path]:
        root = root.resolve()
        return [p for p in self.paths if p == root or root in p.parents]


def _bench(small_world, validation_world, out, *extra):
    data, target, gold = small_world
    v_data, v_target = validation_world
    return main(
        [
            "bench",
            "--data",
            str(data),
            "--target",
            str(target),
            "--gold",
            f"forget10={gold}",
            "--validation-data",
            str(v_data),
            "--validation-target",
            str(v_target),
            "--selection-split",
            "forget10",
            "--lr-grid",
            "0.5,2",
            "--lr-grid-extend",
            "1",
            "--methods",
            "grad_diff,pdu",
            "--splits",
            "forget10",
            "--seeds",
            "1",
            "--max-steps",
            "3",
            "--eval-max-rows",
            "6",
            "--quick",  # 32 generated tokens
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def one_process_bench(small_world, validation_world, tmp_path_factory):
    """The bench run once in this process on one torch thread (as `--jobs 2`'s children run), recording
    the files it opens until it first uses the test world: (out dir, opened files, that first use)."""
    opened = OpenedFiles()
    phases = {"test_world_opened": False}
    original = bench_run.reference_evals

    def reference_evals(plan, log):  # the bench's first use of the test world
        phases["test_world_opened"] = True
        opened.recording = False
        return original(plan, log)

    out = tmp_path_factory.mktemp("bench") / "one"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_run, "reference_evals", reference_evals)
        torch.set_num_threads(1)
        opened.recording = True
        try:
            assert _bench(small_world, validation_world, out) == 0
        finally:
            opened.recording = False
            torch.set_num_threads(threads)
    return out, opened, phases


def test_bench_selects_on_the_validation_world_then_reports_on_the_test_world(
    one_process_bench, small_world, validation_world
):
    out, opened, phases = one_process_bench
    assert phases["test_world_opened"]
    for root in small_world:
        assert opened.under(root) == [], f"the selection opened the test world's {root}"
    assert opened.under(validation_world[0]), "the selection did not read the validation world"

    results = json.loads((out / "results.json").read_text())
    selection = results["selection"]
    assert (
        selection["grid"] == [0.5, 2.0] and selection["world_seed"] == 0 and selection["split"] == "forget10"
    )
    assert set(selection["chosen"]) == {"grad_diff", "pdu"}
    expected_runs = []
    for method, chosen in selection["chosen"].items():
        hms = {float(m): hm for m, hm in selection["validation_hm"][method].items()}
        assert chosen == choose(hms)
        # a two-point grid's best is always on an edge (or both collapsed): --lr-grid-extend 1 tries one
        # step (x4) past it
        collapsed = {float(m) for m in selection["collapsed"].get(method, [])}
        on_grid = choose({m: hms[m] for m in (0.5, 2.0)})
        extra = [0.125] if {0.5, 2.0} <= collapsed else {0.5: [0.125], 2.0: [8.0]}.get(on_grid, [])
        assert sorted(hms) == sorted([0.5, 2.0, *extra])
        assert selection["extended"].get(method, []) == extra
        expected_runs += [f"lr-x{m:g}" for m in hms]
    assert results["test_world_seeds"] == [0]
    selection_runs = sorted(p.parent.name for p in (out / "selection" / "runs").rglob("row.json"))
    assert selection_runs == sorted(expected_runs)

    rows = results["rows"]
    assert [(r["method"], r["split"], r["seed"]) for r in rows] == [
        ("grad_diff", "forget10", 42),
        ("pdu", "forget10", 42),
    ]
    for row in rows:
        assert set(row) >= CONTRACT_ROW_KEYS
        assert row["lr_multiplier"] == selection["chosen"][row["method"]]
        assert row["steps"] == 3 and row["time_s"] > 0 and row["peak_mem_mb"] >= 0
        for key in ("MU", "Prob", "ROUGE", "HM", "forget_quality"):
            assert 0.0 <= row[key] <= 1.0, (key, row[key])
        assert -100.0 <= row["privleak"] <= 100.0 or math.isfinite(row["privleak"])
        mu, prob, rouge = row["MU"], row["Prob"], row["ROUGE"]
        expected = (
            0.0 if min(mu, 1 - prob, 1 - rouge) <= 0 else 3 / (1 / mu + 1 / (1 - prob) + 1 / (1 - rouge))
        )
        assert row["HM"] == pytest.approx(expected, abs=1e-6)
    assert {r["model"] for r in results["reference"]} == {"target", "gold"}
    gold_row = next(r for r in results["reference"] if r["model"] == "gold")
    assert gold_row["forget_quality"] == 1.0 and gold_row["privleak"] == 0.0
    assert results["settings"]["max_steps"] == 3 and results["machine"]["cores"] >= 1
    assert results["machine"]["cpu_identity"].endswith(torch.backends.cpu.get_cpu_capability())

    history_file = out / "runs" / "pdu" / "forget10" / "seed42" / "history.json"
    history = json.loads(history_file.read_text())
    assert [h["step"] for h in history] == [1, 2, 3] and all("lambda" in h for h in history)

    md = (out / "results.md").read_text()
    assert "| Method | forget10 MU | forget10 Prob | forget10 ROUGE | forget10 HM |" in md
    assert "| grad_diff |" in md and "| pdu |" in md and "Retrained (gold)" in md and " ± " in md
    assert "## Learning-rate multipliers chosen on the validation world" in md
    assert f"| pdu | x{selection['chosen']['pdu']:g} |" in md
    for name in ("dynamics_pdu_forget10.png", "dynamics_all_forget10.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in md

    # A second invocation (on the first one's thread count: it is in every run's fingerprint) reuses every
    # cached run, selection included: same rows, nothing trained again.
    written = history_file.stat().st_mtime_ns
    selection_row = next((out / "selection" / "runs").rglob("row.json"))
    selection_written = selection_row.stat().st_mtime_ns
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _bench(small_world, validation_world, out) == 0
    finally:
        torch.set_num_threads(threads)
    again = json.loads((out / "results.json").read_text())
    assert again["rows"] == rows and again["selection"] == selection
    assert history_file.stat().st_mtime_ns == written  # served from the cache, not trained again
    assert selection_row.stat().st_mtime_ns == selection_written


def test_the_selection_seed_count_stays_out_of_a_runs_fingerprint(small_world, tmp_path):
    """`--selection-seeds N` decides which validation runs a bench makes, not what seed 42's run computes, so
    a run cached under one count is reused under another; a setting that changes the arithmetic is not."""
    from blade_core.bench.cache import _fingerprint

    data, target, _ = small_world
    settings = bench.settings_for(True)
    plan = bench.BenchPlan(
        data_dir=data, target=target, golds={}, out_dir=tmp_path, methods=["npo"], splits=["forget05"],
        seeds=[42], settings=settings,
    )  # fmt: skip
    key = _fingerprint(plan, "npo")
    three = dataclasses.replace(plan, settings=dataclasses.replace(settings, selection_seeds=3))
    assert _fingerprint(three, "npo") == key
    shorter = dataclasses.replace(plan, settings=dataclasses.replace(settings, max_length=128))
    assert _fingerprint(shorter, "npo") != key


def test_a_run_knows_its_torch_thread_count(small_world, monkeypatch, tmp_path):
    """Floats depend on the thread count, so a run's fingerprint names it, and a lone run of a `--jobs 2`
    bench (made in the calling process) runs on the count a pool worker would have, not the caller's."""
    from dataclasses import dataclass

    from blade_core.bench.cache import _fingerprint
    from blade_core.bench.parallel import made

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    data, target, _ = small_world
    plan = bench.BenchPlan(
        data_dir=data, target=target, golds={}, out_dir=tmp_path, methods=["grad_diff"], splits=["forget10"],
        seeds=[42], settings=bench.settings_for(True), jobs=2,
    )  # fmt: skip
    assert plan.run_threads == 2 and _fingerprint(plan, "grad_diff")["threads"] == 2
    single = bench.BenchPlan(**{**plan.__dict__, "jobs": 1})
    assert _fingerprint(single, "grad_diff")["threads"] == torch.get_num_threads()

    @dataclass(frozen=True)
    class Spec:
        label: str = "one run"

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        seen = made([Spec()], lambda _: None, lambda _s, _log: torch.get_num_threads(), jobs=2, log=print,
                    desc="x", progress=False)  # fmt: skip
        assert seen == [2] and torch.get_num_threads() == 3  # the pool's count, then the caller's again
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("asked", "jobs", "expected"), [("1", 2, 1), ("3", 1, 3), ("1,1", 2, 1), ("x", 1, 5)]
)
def test_omp_num_threads_set_after_torch_started_is_what_the_runs_get(asked, jobs, expected, monkeypatch):
    """torch reads OMP_NUM_THREADS once, at import: a process that sets it later (as a test does) keeps its
    own count, and its `--jobs` children must still get the count asked for, or they do other arithmetic
    than a run made in this process on that count (a value that is not a count is ignored)."""
    from blade_core.bench.settings import worker_threads

    monkeypatch.setenv("OMP_NUM_THREADS", asked)
    before = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        assert worker_threads(jobs) == expected
    finally:
        torch.set_num_threads(before)


def test_selection_picks_the_best_validation_hm_and_breaks_ties_towards_the_rule():
    assert choose({0.25: 0.1, 1.0: 0.3, 4.0: 0.5}) == 4.0
    assert choose({0.25: 0.5, 1.0: 0.5, 4.0: 0.2}) == 1.0
    assert choose({0.5: 0.4, 2.0: 0.4}) in (0.5, 2.0)
    assert choose({0.25: None, 1.0: float("nan")}) == 1.0
    assert bench.seed_list(5) == [42, 123, 456, 789, 1024] and bench.seed_list(1) == [42]
    assert bench.PRESETS["default"].seeds == 5 and len(bench.PRESETS["default"].lr_grid) == 5


def test_the_edge_rule_extends_the_grid_only_past_an_edge_that_holds_the_best():
    grid = (0.25, 0.5, 1.0, 2.0, 4.0)
    assert beyond_edge({0.25: 0.1, 0.5: 0.3, 1.0: 0.5, 2.0: 0.4, 4.0: 0.0}, grid, 2) is None
    assert beyond_edge({0.25: 0.1, 0.5: 0.2, 1.0: 0.3, 2.0: 0.3, 4.0: 0.4}, grid, 2) == 8.0
    assert beyond_edge({0.25: 0.5, 0.5: 0.3, 1.0: 0.0, 2.0: 0.0, 4.0: 0.0}, grid, 2) == 0.125
    # past the edge: again while the best stays on the new edge, at most `limit` points per side
    assert beyond_edge({0.125: 0.6, 0.25: 0.5, 0.5: 0.3, 1.0: 0.0}, grid, 2) == 0.0625
    assert beyond_edge({0.0625: 0.7, 0.125: 0.6, 0.25: 0.5, 0.5: 0.3}, grid, 2) is None
    assert beyond_edge({0.125: 0.4, 0.25: 0.5, 0.5: 0.3, 1.0: 0.0}, grid, 2) is None  # bracketed now
    assert beyond_edge({0.25: 0.5, 0.5: 0.3}, grid, 0) is None
    assert beyond_edge({0.25: None, 4.0: None}, grid, 2) is None  # nothing finite: the rule's value, 1


def test_a_method_that_collapsed_at_every_point_steps_down_past_the_low_edge():
    grid = (0.25, 1.0, 4.0)
    dead = {0.25: 0.0, 1.0: 0.0, 4.0: 0.0}
    assert beyond_edge(dead, grid, 2) is None  # HM 0 everywhere: no edge holds a best
    assert beyond_edge(dead, grid, 2, collapsed=dead) == 0.0625
    assert beyond_edge(dead | {0.0625: 0.0}, grid, 2, collapsed={*dead, 0.0625}) == 0.015625
    assert (
        beyond_edge(dead | {0.0625: 0.0, 0.015625: 0.0}, grid, 2, collapsed={*dead, 0.0625, 0.015625}) is None
    )
    # the first point that keeps some utility ends the descent unless it is, in turn, the best on the edge
    assert beyond_edge(dead | {0.0625: 0.3}, grid, 2, collapsed=set(dead)) == 0.015625
    assert beyond_edge({0.25: 0.4, 1.0: 0.0, 4.0: 0.0}, grid, 2, collapsed={1.0, 4.0}) == 0.0625
    assert beyond_edge({0.25: 0.1, 1.0: 0.4, 4.0: 0.0}, grid, 2, collapsed={4.0}) is None


def test_selection_over_several_seeds_scores_each_multiplier_by_its_mean_hm(tmp_path, monkeypatch):
    """--selection-seeds N: every grid point runs at the first N seeds on the validation world and is scored
    by their mean HM; a point collapsed only when every seed lost all utility; results.json keeps each
    seed's HM."""
    from dataclasses import replace

    from blade_core.bench import selection
    from blade_core.bench.settings import PRESETS, BenchPlan, ValidationWorld

    assert selection.over_seeds([(0.2, False), (0.4, True)]) == (pytest.approx(0.3), False)
    assert selection.over_seeds([(0.0, True), (0.0, True)]) == (0.0, True)
    assert selection.over_seeds([(0.5, False), (None, False)]) == (None, False)
    # seed 42 alone prefers x1; the mean over 42, 123 and 456 prefers x0.5
    hm = {(0.5, 42): 0.40, (0.5, 123): 0.50, (0.5, 456): 0.45, (1.0, 42): 0.42, (1.0, 123): 0.30,
          (1.0, 456): 0.0, (2.0, 42): 0.0, (2.0, 123): 0.0, (2.0, 456): 0.0}  # fmt: skip
    ran: list[tuple[str, float, int]] = []

    def scripted(specs, **_kwargs):
        ran.extend((s.method, s.multiplier, s.seed) for s in specs)
        return [({"HM": hm[s.multiplier, s.seed], "MU": hm[s.multiplier, s.seed]}, None) for s in specs]

    monkeypatch.setattr(selection, "run_all", scripted)
    settings = replace(PRESETS["quick"], lr_scale=1.0, lr_grid=(0.5, 1.0, 2.0), lr_grid_extend=0)
    plan = BenchPlan(
        data_dir=tmp_path / "test",
        target=tmp_path,
        golds={},
        out_dir=tmp_path / "out",
        methods=["npo"],
        splits=["forget05"],
        seeds=[42],
        settings=settings,
        validation=ValidationWorld(tmp_path / "validation", tmp_path, world_seed=1000),
    )
    one = selection.select_multipliers(plan, log=lambda _msg: None)
    assert one["chosen"] == {"npo": 1.0} and one["seeds"] == [42]
    ran.clear()
    three = selection.select_multipliers(
        replace(plan, settings=replace(settings, selection_seeds=3)), log=lambda _msg: None
    )
    assert sorted(ran) == sorted(("npo", m, s) for m in (0.5, 1.0, 2.0) for s in (42, 123, 456))
    assert three["chosen"] == {"npo": 0.5} and three["seeds"] == [42, 123, 456]
    assert three["validation_hm"]["npo"] == {"0.5": pytest.approx(0.45), "1": pytest.approx(0.24), "2": 0.0}
    assert three["validation_hm_by_seed"]["npo"]["1"] == [0.42, 0.30, 0.0]
    assert three["collapsed"] == {"npo": [2.0]}  # x1 lost everything at seed 456 only: not collapsed
    assert "mean HM over seeds 42, 123, 456" in three["score"]


def test_parallel_runs_make_the_sequential_runs(
    one_process_bench, small_world, validation_world, tmp_path, monkeypatch, capsys
):
    """--jobs 2 spreads the selection and the test grid over two spawned processes and gets the rows one
    process gets, in the same order (both on one torch thread, so the arithmetic is the same)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children's thread count
    capsys.readouterr()
    assert _bench(small_world, validation_world, tmp_path / "two", "--jobs", "2") == 0
    err = capsys.readouterr().err
    assert "4 runs on 2 processes" in err and "2 runs on 2 processes" in err  # selection grid, test grid
    # first of all, the CPU kind: it decides which build of the models a box makes (docs/results.md)
    assert err.startswith("on ") and f"CPU kind {cpu_identity()}:" in err.splitlines()[0]
    assert f"numpy SIMD {' '.join(numpy_simd()) or 'baseline only'}:" in err.splitlines()[0]
    one = json.loads((one_process_bench[0] / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["selection"]["validation_hm"] == one["selection"]["validation_hm"]
    assert two["selection"]["chosen"] == one["selection"]["chosen"]
    same = (*sorted(CONTRACT_ROW_KEYS - {"time_s", "peak_mem_mb"}), "status", "lr_multiplier")
    assert [[r[k] for k in same] for r in two["rows"]] == [[r[k] for k in same] for r in one["rows"]]


def test_bench_rejects_unknown_methods_and_splits(small_world, tmp_path, capsys):
    data, target, _ = small_world
    assert (
        main(
            [
                "bench",
                "--data",
                str(data),
                "--target",
                str(target),
                "--methods",
                "nope",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "unknown method nope" in capsys.readouterr().err
    assert main(["bench", "--synthetic", "--splits", "forget42", "--out", str(tmp_path)]) == 2
    assert "unknown split forget42" in capsys.readouterr().err


def test_a_method_field_set_on_the_command_line_reaches_every_run_of_it(
    one_process_bench, small_world, validation_world, tmp_path
):
    """`--set grad_diff.batch_size=2`: the selection run and the test run both train on 2-row micro-batches
    (fewer forget rows per step than the same runs without it), and results.json and each run's cache
    fingerprint record the field, so a run cached without it is never reused. Its runs are stored apart
    (`runs/grad_diff-set-<digest>/`): on an --out a bench without it used, that bench's runs stay as
    they were."""
    out = tmp_path / "set"
    shutil.copytree(one_process_bench[0], out)
    default = out / "runs" / "grad_diff" / "forget10" / "seed42"
    before = {p: p.read_bytes() for p in default.glob("**/*.json")}
    assert default / "row.json" in before
    argv = (
        "--methods",
        "grad_diff",
        "--lr-grid",
        "1",
        "--lr-grid-extend",
        "0",
        "--set",
        "grad_diff.batch_size=2",
    )
    assert _bench(small_world, validation_world, out, *argv) == 0
    assert json.loads((out / "results.json").read_text())["settings"]["overrides"] == {
        "grad_diff": {"batch_size": 2}
    }
    runs = sorted(out.glob("**/runs/grad_diff-set-*/forget10/seed42/**/row.json"))
    assert len(runs) == 2  # the selection's and the test's
    assert {p: p.read_bytes() for p in default.glob("**/*.json")} == before
    rows_seen = json.loads((default / "history.json").read_text())[-1]["forget_rows_seen"]
    for row in runs:
        assert json.loads(row.read_text())["fingerprint"]["overrides"] == {"batch_size": 2}
        history = json.loads((row.parent / "history.json").read_text())
        assert history[-1]["forget_rows_seen"] < rows_seen


def test_bench_refuses_a_set_it_cannot_apply(tmp_path, capsys):
    for item, message in (
        ("blade.tau", "expected METHOD.FIELD=VALUE"),
        ("npo.beta=0.1", "'npo' is not one of this bench's methods"),
        ("blade.nope=1", "unknown parameter 'nope' for method 'blade'"),
        ("blade.tau=1.5", "BladeConfig.tau"),
    ):
        argv = ["bench", "--synthetic", "--methods", "blade", "--set", item, "--out", str(tmp_path)]
        assert main(argv) == 2, item
        assert message in capsys.readouterr().err, item
    assert not any(tmp_path.iterdir())


def test_bench_refuses_a_build_device_it_cannot_use(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as here and in CI, also on a GPU box
    assert main(["bench", "--synthetic", "--build-device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--build-device cuda: torch sees no CUDA device" in capsys.readouterr().err
    assert main(["bench", "--synthetic", "--build-device", "tpu0", "--out", str(tmp_path)]) == 2
    assert "--build-device 'tpu0'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_numpy_simd_names_the_targets_numpy_dispatches_to_and_obeys_its_switch():
    """The evaluation's last digits follow numpy's SIMD targets (docs/results.md); a box can turn the wider
    ones off with NPY_DISABLE_CPU_FEATURES, and the record must then say so."""
    found = numpy_simd()
    assert set(found) <= set(__cpu_dispatch__)
    assert machine()["numpy_simd"] == found
    code = "from blade_core.bench.measure import numpy_simd; print(' '.join(numpy_simd()))"
    child = subprocess.run(
        [sys.executable, "-c", code],
        env=os.environ | {"NPY_DISABLE_CPU_FEATURES": " ".join(found[1:])},  # all but the narrowest
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.split() == found[:1]


def test_a_box_told_to_run_torch_on_avx2_hears_when_numpy_still_runs_avx512():
    """The 2026-11-29 trap: ATEN_CPU_CAPABILITY=avx2 alone gave an AVX2 box's models but not its metrics."""
    zen4 = ["X86_V3", "X86_V4", "AVX512_ICL"]
    hint = numpy_narrower_hint("AuthenticAMD family 25 model 17, AVX2", zen4)
    assert hint is not None and 'NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_ICL"' in hint
    assert numpy_narrower_hint("AuthenticAMD family 25 model 17, AVX2", ["X86_V3"]) is None  # both narrowed
    assert numpy_narrower_hint("AuthenticAMD family 25 model 17, AVX512", zen4) is None  # both wide
    assert numpy_narrower_hint("AuthenticAMD family 25 model 1, AVX2", ["X86_V3"]) is None  # an AVX2 CPU


def test_a_build_device_enters_the_record_only_when_it_is_not_the_cpu():
    """Runs made before the setting existed recorded none: a CPU bench's record and model names stay as
    they were, so its cached runs and results.json still match (bench-merge), while models built on an
    accelerator get their own names."""
    quick = bench.PRESETS["quick"]
    assert "build_device" not in bench.settings_record(quick)
    on_gpu = dataclasses.replace(quick, build_device="cuda:0")
    assert bench.settings_record(on_gpu)["build_device"] == "cuda:0"
    world = Path("world-a20-s0")
    assert bench.model_set_name(world, quick) == "world-a20-s0-quick-s0"
    assert bench.model_set_name(world, on_gpu) == "world-a20-s0-quick-s0-cuda0"


def test_markdown_marks_the_best_hm_and_handles_missing_values():
    rows = [
        {
            "method": m,
            "split": "forget10",
            "seed": s,
            "MU": 0.5,
            "Prob": p,
            "ROUGE": 0.5,
            "HM": hm,
            "forget_quality": None,
            "privleak": 1.0,
            "steps": 3,
            "time_s": 1.0,
            "peak_mem_mb": 10.0,
            "status": "max_steps",
        }
        for m, p, hm in (("npo", 0.2, 0.4), ("blade", 0.1, 0.6))
        for s in (0, 1)
    ]
    rows[0]["warnings"] = ["forget Prob essentially unchanged (0.970 -> 0.965, |delta| < 0.02): ..."]
    results = {
        "rows": rows,
        "summary": bench.summarise(rows),
        "reference": [],
        "settings": {
            "methods": ["npo", "blade"],
            "splits": ["forget10"],
            "seeds": [0, 1],
            "max_steps": 3,
            "batch_size": 4,
            "max_length": 256,
            "eval_max_rows": None,
            "eval_max_new_tokens": 64,
        },
        "command": "blade bench",
        "machine": {"summary": "test"},
        "wall_s": 1.0,
    }
    md = bench.render_markdown(results)
    assert "| blade | 0.50 ± 0.00 | 0.10 ± 0.00 | 0.50 ± 0.00 | **0.60 ± 0.00** |" in md
    assert "| npo | 0.50 ± 0.00 | 0.20 ± 0.00 | 0.50 ± 0.00 | 0.40 ± 0.00 |" in md
    assert "- forget10: blade 0.600 ± 0.000, npo 0.400 ± 0.000" in md
    assert "n/a" in md  # forget quality was missing
    assert "**Warning**: forget Prob essentially unchanged (|delta| < 0.02) in: npo forget10 seed 0." in md


def test_blade_runs_the_reference_batch_and_forget10_under_its_own_cap_of_500(tmp_path, monkeypatch):
    """The authors run BLADE at 4 x 4 rows per outer step, with T = 500 on forget10 and 250 elsewhere: the
    bench passes BLADE's TOFU presets to the runner (and keys the run cache by them), on every split and on
    the drawn author sets; the baselines keep their defaults."""
    from blade_core.bench import cache, one_run
    from blade_core.unlearn import build_config

    assert build_config("blade", one_run.split_preset("blade", "forget10")).max_steps == 500
    for split in ("forget01", "forget05", "forget10", one_run.DRAWN):
        config = build_config("blade", one_run.split_preset("blade", split))
        assert (config.batch_size, config.grad_accum) == (4, 4)  # 16 rows, as the reference
        assert config.max_steps == (500 if split == "forget10" else 250)
        assert one_run.split_preset("npo", split) is None
    (tmp_path / "forget10_perturbed.json").write_text("[]")
    (tmp_path / "retain90.json").write_text("[]")
    plan = _plan_without_models(tmp_path, methods=["blade", "npo"], split="forget10")
    presets: dict[str, str | None] = {}

    def runner(**kwargs):
        presets[kwargs["method"]] = kwargs["preset"]
        raise RuntimeError("stop before training")

    monkeypatch.setattr(one_run, "run_unlearning", runner)
    for method in ("blade", "npo"):
        with pytest.raises(RuntimeError, match="stop before training"):
            one_run.run_one(plan, method, "forget10", 42, None, lambda _msg: None)
    assert presets == {"blade": "tofu_forget10", "npo": None}
    assert cache._preset_of("blade", "forget10") == {"preset": "tofu_forget10"}
    assert cache._preset_of("blade", "forget05") == {"preset": "tofu"}
    assert cache._preset_of("npo", "forget05") == {}


def test_a_synthesised_validation_world_keeps_its_selection_runs_in_the_cache(
    small_world, validation_world, tmp_path, monkeypatch
):
    """--synthetic: the selection runs live beside the world in --cache, so a bench with another --out reuses
    them, one directory per model size (`--quick` selects on its own target); --data keeps them under
    OUT/selection/."""
    from blade_core.bench.selection import validation_plan

    data, target, _ = small_world
    v_data, v_target = validation_world

    def prepared(cache, settings, splits, log, progress, world_seed=None):
        return (v_data, v_target, {}) if world_seed == settings.validation_world_seed else (data, target, {})

    plans: list[bench.BenchPlan] = []
    monkeypatch.setattr(bench, "prepare_synthetic", prepared)
    monkeypatch.setattr(bench, "run_bench", lambda plan, log: plans.append(plan))
    for out, preset in (("a", ["--quick"]), ("b", ["--quick"]), ("c", [])):
        argv = ["bench", "--synthetic", *preset, "--splits", "forget10", "--methods", "grad_diff"]
        assert main([*argv, "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / out)]) == 0
    quick, default = (
        tmp_path / "cache" / "selection" / f"{v_data.name}-{size}-s0" for size in ("quick", "default")
    )
    assert [validation_plan(p).out_dir for p in plans] == [quick, quick, default]
    assert all(p.validation is not None and p.validation.data_dir == v_data for p in plans)
    direct = bench.BenchPlan(**(vars(plans[0]) | {"validation": bench.ValidationWorld(v_data, v_target)}))
    assert validation_plan(direct).out_dir == tmp_path / "a" / "selection"


@pytest.mark.parametrize("kind", ["run", "sequence"])
def test_two_benches_on_one_out_make_a_run_once(kind, tmp_path, monkeypatch):
    """A protocol run in parts on one box may start the same run (or sequence of stacked requests) in two
    invocations sharing --out. The second waits for the first's lock and reads its cached result, instead of
    clearing the work dir the first is training in and training again."""
    import threading

    from blade_core.bench import cache, stream

    plan = _plan_without_models(tmp_path, methods=["npo"], split="forget05")
    groups = [[{"question": "q", "answer": "a"}]]
    made: list[str] = []
    answers: dict[str, object] = {}

    def bench(name: str) -> None:
        if kind == "run":
            answers[name] = cache.fresh_run(plan, "npo", "forget05", 42, None, lambda _msg: None)
        else:
            answers[name] = stream.run_sequence(plan, "npo", 42, groups, lambda _msg: None)

    second = threading.Thread(target=bench, args=("second",))

    def trained_once() -> None:
        made.append(threading.current_thread().name)
        if len(made) == 1:  # the second bench reaches the same work while the first trains it
            second.start()
            second.join(timeout=1.0)  # unlocked, it would train it meanwhile

    def run_one(*_args, **_kwargs):
        trained_once()
        return {"row": {"method": "npo", "HM": 0.5}, "history": [{"step": 1}]}

    def stacked_afresh(plan, method, seed, groups, _log):
        trained_once()
        rows = [{"method": method, "step": 1, "HM_all": 0.5}]
        cache._write_json(
            stream._sequence_root(plan, method, seed) / "rows.json",
            stream._sequence_stamp(plan, method, groups) | {"rows": rows},
        )
        return rows

    monkeypatch.setattr(cache, "run_one", run_one)
    monkeypatch.setattr(stream, "_stacked_afresh", stacked_afresh)
    bench("first")
    second.join()
    assert made == [threading.main_thread().name]
    expected = {
        "run": ({"method": "npo", "HM": 0.5}, [{"step": 1}]),
        "sequence": [{"method": "npo", "step": 1, "HM_all": 0.5}],
    }[kind]
    assert answers["first"] == answers["second"] == expected


def test_two_benches_on_one_cache_synthesise_the_world_once(tmp_path, monkeypatch):
    """Benches started together on one cache all find the world missing. Unlocked, each would rewrite its
    files (world.json first removed) while the first is already hashing and training on them."""
    import threading

    from blade_core.bench import models
    from blade_core.synth import write_world

    data_dir = tmp_path / "world-a4-s3"
    writers: list[str] = []

    def slow_write(out, authors, seed):
        writers.append(threading.current_thread().name)
        threading.Event().wait(0.3)  # long enough for the other bench to arrive meanwhile
        return write_world(out, authors=authors, seed=seed)

    monkeypatch.setattr(models, "write_world", slow_write)
    benches = [
        threading.Thread(target=models.synthesised_world, args=(data_dir, 4, 3, lambda _msg: None))
        for _ in range(2)
    ]
    for b in benches:
        b.start()
    for b in benches:
        b.join()
    assert len(writers) == 1 and (data_dir / "world.json").is_file()


def _plan_without_models(tmp_path: Path, *, methods: list[str], split: str) -> bench.BenchPlan:
    """A default-preset plan over `tmp_path` for tests that stop before any model is loaded (seed 42; the LR
    rule's factor fixed at 1, since there is no target build to read it from)."""
    from dataclasses import replace

    from blade_core.bench.settings import PRESETS

    return bench.BenchPlan(
        data_dir=tmp_path,
        target=tmp_path,
        golds={},
        out_dir=tmp_path / "out",
        methods=methods,
        splits=[split],
        seeds=[42],
        settings=replace(PRESETS["default"], lr_scale=1.0),
    )
