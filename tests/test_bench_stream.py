"""`blade bench --sequential N` and `--scale 1,2` on a 20-author tiny world (forget10 = 2 authors).

BLADE (a LoRA method) must stack: request 2 trains on top of request 1's adapter, frozen and active, through
the engine (`run.json` `stack`); GradDiff (full-parameter) must continue from request 1's weights. Rows carry
`step` / `scale` and the earlier forget sets' figures; results.md has a table per method and the HM plots.
"""

from __future__ import annotations

import json

import pytest

from blade_core.bench.stream import author_blocks, scaled_sets, sequential_groups
from blade_service.cli.main import main
from tests.fixtures_engine import step_lines_without_clock
from tests.fixtures_world import ensure_tiny_world


@pytest.fixture(scope="module")
def world20():
    """A 20-author world (forget10: 2 authors of 20 rows) and its test-size target, cached on disk (the
    smallest model: these tests check the sequencing, not how well a method forgets)."""
    return ensure_tiny_world(authors=20, size="test")


def test_author_groups_are_disjoint_and_scales_grow_by_whole_authors(world20):
    blocks = author_blocks(world20.data_dir, "forget10")
    assert [len(b) for b in blocks] == [20, 20]
    groups = sequential_groups(blocks, 2, "forget10")
    assert groups[0] == blocks[0] and groups[1] == blocks[1]
    assert not {r["question"] for r in groups[0]} & {r["question"] for r in groups[1]}
    sets = scaled_sets(blocks, [1, 2], "forget10")
    assert sets[1] == blocks[0] and sets[2] == blocks[0] + blocks[1]
    with pytest.raises(ValueError, match="has 2 authors"):
        sequential_groups(blocks, 3, "forget10")
    with pytest.raises(ValueError, match="fewer than the largest scale 4"):
        scaled_sets(blocks, [1, 4], "forget10")


def test_sequential_requests_stack_and_scaled_forget_sets(world20, tmp_path, capsys, monkeypatch):
    step_lines_without_clock(monkeypatch)  # --no-progress: a line per step, 'label: i/N'
    out = tmp_path / "bench"
    args = [
        "bench",
        "--data",
        str(world20.data_dir),
        "--target",
        str(world20.model_dir),
        "--methods",
        "grad_diff,blade",
        "--seeds",
        "1",
        "--max-steps",
        "3",
        "--eval-max-rows",
        "6",
        "--quick",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main([*args, "--sequential", "2", "--scale", "1,2"]) == 0
    logged = capsys.readouterr().err  # the bench's log
    assert "blade sequential step 2/2 seed 42 LR x1: MU " in logged, logged[-3000:]
    progress = logged.splitlines()
    for label in ("blade seed 42 LR x1 request 2/2", "grad_diff seed 42 scale x2"):
        assert f"{label}: 3/3" in progress, logged[-3000:]
    results = json.loads((out / "results.json").read_text())
    seq = [r for r in results["rows"] if "step" in r]
    assert [(r["method"], r["step"]) for r in seq] == [
        ("grad_diff", 1),
        ("grad_diff", 2),
        ("blade", 1),
        ("blade", 2),
    ]
    for row in seq:
        assert 0 <= row["HM_all"] <= 1 and row["steps"] == 3
        assert (row.get("Prob_earlier") is None) == (row["step"] == 1)
    assert results["selection"]["chosen"] == {
        "grad_diff": 1.0,
        "blade": 1.0,
    }  # --data without a validation world

    blade1 = out / "sequential" / "blade" / "seed42" / "step1" / "model"
    blade2 = json.loads((out / "sequential" / "blade" / "seed42" / "step2" / "run.json").read_text())
    assert blade2["stack"] == [str(blade1)] and blade2["base_model"] == str(world20.model_dir)
    gd2 = json.loads((out / "sequential" / "grad_diff" / "seed42" / "step2" / "run.json").read_text())
    assert gd2["stack"] == [] and gd2["base_model"].endswith("grad_diff/seed42/step1/model")
    assert gd2["lr_rule"]["factor"] == blade2["lr_rule"]["factor"] > 1  # the target's factor at every step

    scaled = [r for r in results["rows"] if "scale" in r]
    assert sorted((r["method"], r["scale"]) for r in scaled) == [
        ("blade", 1),
        ("blade", 2),
        ("grad_diff", 1),
        ("grad_diff", 2),
    ]
    sizes = {
        s: len(json.loads((out / "stream-data" / f"scale2-x{s}" / "forget10_perturbed.json").read_text()))
        for s in (1, 2)
    }
    assert sizes == {1: 20, 2: 40}

    md = (out / "results.md").read_text()
    assert "## Sequential requests" in md and "## Forget-set scale" in md
    assert "### blade" in md and "| step | MU | Prob | ROUGE | HM | Prob_earlier" in md and "| scale |" in md
    for name in ("hm_step.png", "hm_scale.png"):
        png = out / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({name})" in md

    capsys.readouterr()
    assert main([*args, "--sequential", "3"]) == 2  # more requests than forget10 has authors
    assert "--sequential 3: forget10 of this world has 2 authors" in capsys.readouterr().err


def test_hm_over_every_forget_set_weights_sets_by_their_rows():
    from blade_core.bench.stream import _with_earlier
    from blade_core.evaluation.metrics import hm_score

    row = {"MU": 0.6, "Prob": 0.1, "ROUGE": 0.2, "eval": {"n": {"forget": 20}}}
    earlier = [{"Prob": 0.4, "ROUGE": 0.5, "n": 40}]
    out = _with_earlier(row, earlier)
    prob_all, rouge_all = (0.4 * 40 + 0.1 * 20) / 60, (0.5 * 40 + 0.2 * 20) / 60
    assert out["Prob_all"] == pytest.approx(prob_all) and out["ROUGE_all"] == pytest.approx(rouge_all)
    assert out["HM_all"] == pytest.approx(hm_score(0.6, prob_all, rouge_all))
    assert out["Prob_earlier"] == 0.4 and out["ROUGE_earlier"] == 0.5
    first = _with_earlier(row, [])
    assert first["Prob_earlier"] is None and first["HM_all"] == pytest.approx(hm_score(0.6, 0.1, 0.2))


def test_selection_on_stacked_requests_scores_hm_over_every_forget_set(
    world20, tmp_path, monkeypatch, capsys
):
    """--select-on sequence: every (method, multiplier) of the grid runs the N stacked requests on the
    validation world's author groups at each selection seed (side by side with --jobs 2), is scored by its
    last HM_all averaged over the seeds, and the test world's sequences run at the multiplier chosen."""
    import shutil

    from blade_core.bench.selection import choose

    validation = tmp_path / "validation"  # the same world under another path: a separate world to the bench
    shutil.copytree(world20.data_dir, validation / "data")
    shutil.copytree(world20.model_dir, validation / "target")
    out = tmp_path / "bench"
    args = [
        "bench", "--data", str(world20.data_dir), "--target", str(world20.model_dir),
        "--validation-data", str(validation / "data"), "--validation-target", str(validation / "target"),
        "--methods", "blade", "--seeds", "1", "--max-steps", "2", "--eval-max-rows", "4",
        "--lr-grid", "0.5,2", "--lr-grid-extend", "0", "--quick", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    capsys.readouterr()
    assert main([*args, "--select-on", "sequence"]) == 2
    assert "--select-on sequence goes with --sequential N" in capsys.readouterr().err

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    selecting = ["--sequential", "2", "--select-on", "sequence", "--selection-seeds", "2", "--jobs", "2"]
    assert main([*args, *selecting]) == 0
    assert "4 runs on 2 processes" in capsys.readouterr().err  # the grid's sequences at 2 seeds, side by side
    results = json.loads((out / "results.json").read_text())
    selection = results["selection"]
    assert selection["on"] == "sequence"
    assert selection["score"] == "mean HM_all after 2 stacked requests over seeds 42, 123"
    assert selection["split"] == "forget10" and selection["grid"] == [0.5, 2.0]
    assert selection["seeds"] == [42, 123]
    scored = {}
    for tag in ("0.5", "2"):
        last = []
        for seed in (42, 123):
            stored = out / "selection" / "sequence2" / f"lr-x{tag}" / "sequential" / "blade" / f"seed{seed}"
            rows = json.loads((stored / "rows.json").read_text())["rows"]
            assert [r["step"] for r in rows] == [1, 2] and all(r["lr_multiplier"] == float(tag) for r in rows)
            last.append(rows[-1]["HM_all"])
        assert selection["validation_hm_by_seed"]["blade"][tag] == last
        assert selection["validation_hm"]["blade"][tag] == pytest.approx(sum(last) / 2)
        scored[float(tag)] = sum(last) / 2
    assert selection["chosen"]["blade"] == choose(scored)
    tested = [r for r in results["rows"] if "step" in r]
    assert [(r["method"], r["step"]) for r in tested] == [("blade", 1), ("blade", 2)]
    assert all(r["lr_multiplier"] == selection["chosen"][r["method"]] for r in tested)
    for run_json in (out / "selection").rglob("run.json"):  # the grid's requests saw the validation world
        run = json.loads(run_json.read_text())
        assert run["base_model"] == str(validation / "target")  # adapters stack on the validation target
        assert run["retain"].startswith(str(validation / "data")), run["retain"]


def test_stream_data_dirs_are_written_once_and_rewritten_when_they_differ(world20, tmp_path):
    """Sequences running side by side share the drawn groups' data dirs: `run_sequences` writes them before
    any starts, and a dir that already holds its rows is left as it is (no process rewrites a file another
    reads); one holding other rows is rewritten."""
    from blade_core import bench
    from blade_core.bench.stream import group_dirs

    plan = bench.BenchPlan(
        data_dir=world20.data_dir, target=world20.model_dir, golds={}, out_dir=tmp_path, methods=["blade"],
        splits=["forget10"], seeds=[42], settings=bench.settings_for(True),
    )  # fmt: skip
    groups = sequential_groups(author_blocks(world20.data_dir, "forget10"), 2, "forget10")
    dirs = group_dirs(plan, groups)
    stamps = {p: p.stat().st_mtime_ns for d in dirs for p in d.iterdir()}
    assert group_dirs(plan, groups) == dirs
    assert {p: p.stat().st_mtime_ns for d in dirs for p in d.iterdir()} == stamps  # nothing written again
    assert json.loads((dirs[1] / "forget10_perturbed.json").read_text()) == groups[1]
    assert not list(tmp_path.rglob("*.tmp"))
    group_dirs(plan, [groups[1], groups[0]])
    assert json.loads((dirs[0] / "forget10_perturbed.json").read_text()) == groups[1]


class _Killed(BaseException):
    """A kill mid-request: nothing in the bench catches it, as nothing survives a SIGKILL."""


def test_an_interrupted_sequence_continues_after_its_last_finished_request(world20, tmp_path, monkeypatch):
    """A bench killed during request 2 of a stack trains only request 2 when run again: GradDiff (full
    parameters) continues from request 1's saved weights, BLADE stacks on request 1's saved adapter, and every
    row equals an uninterrupted run's."""
    from blade_core.bench import stream

    args = [
        "bench", "--data", str(world20.data_dir), "--target", str(world20.model_dir),
        "--methods", "grad_diff,blade", "--seeds", "1", "--max-steps", "1", "--eval-max-rows", "4",
        "--quick", "--sequential", "2", "--no-progress",
    ]  # fmt: skip
    real_train = stream.train
    trained: list[str] = []
    kill: list[str] = []  # labels to die in, once each

    def train(*a, **kw):
        trained.append(kw["label"])
        if kw["label"] in kill:
            kill.remove(kw["label"])
            raise _Killed
        return real_train(*a, **kw)

    monkeypatch.setattr(stream, "train", train)
    out = tmp_path / "killed"
    kill += ["grad_diff seed 42 LR x1 request 2/2", "blade seed 42 LR x1 request 2/2"]
    with pytest.raises(_Killed):
        main([*args, "--out", str(out)])
    with pytest.raises(_Killed):  # GradDiff resumes and finishes; BLADE dies in its request 2
        main([*args, "--out", str(out)])
    assert main([*args, "--out", str(out)]) == 0
    assert trained == [
        "grad_diff seed 42 LR x1 request 1/2",
        "grad_diff seed 42 LR x1 request 2/2",  # killed
        "grad_diff seed 42 LR x1 request 2/2",
        "blade seed 42 LR x1 request 1/2",
        "blade seed 42 LR x1 request 2/2",  # killed
        "blade seed 42 LR x1 request 2/2",
    ]
    seq = out / "sequential"
    gd2 = json.loads((seq / "grad_diff" / "seed42" / "step2" / "run.json").read_text())
    assert gd2["base_model"] == str(seq / "grad_diff" / "seed42" / "step1" / "model")
    blade2 = json.loads((seq / "blade" / "seed42" / "step2" / "run.json").read_text())
    assert blade2["stack"] == [str(seq / "blade" / "seed42" / "step1" / "model")]
    assert not (seq / "grad_diff" / "seed42" / "step2" / "model").exists()  # the last full model is cleared

    trained.clear()
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert len(trained) == 4

    def rows(bench_dir):  # less what was measured of the process: its time and peak memory
        results = json.loads((bench_dir / "results.json").read_text())
        return [{k: v for k, v in r.items() if k not in ("time_s", "peak_mem_mb")} for r in results["rows"]]

    assert rows(out) == rows(tmp_path / "whole")
