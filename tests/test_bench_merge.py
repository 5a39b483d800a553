"""`blade bench --seed-list` and `blade bench-merge`: a protocol run in parts (other seeds on another box,
other methods in another invocation) joined into one table, and never joined where the parts differ."""

from __future__ import annotations

import copy
import json
import statistics
from typing import Any

import pytest

from blade_core.bench.merge import MergeError, merge_results
from blade_service.cli.main import main
from tests.fixtures_world import ensure_tiny_world

CPU = "AuthenticAMD family 25 model 17, AVX512"


def _results(method: str, multiplier: float, seeds: list[int], hm: dict[int, float]) -> dict[str, Any]:
    """A stacked-requests results.json of one method (two requests per seed) as `blade bench` writes it."""
    rows = [
        {"method": method, "split": "forget10", "seed": s, "MU": 0.3, "Prob": 0.01, "ROUGE": 0.2,
         "HM": hm[s], "HM_all": hm[s] + step / 10, "time_s": 5.0, "step": step, "lr_multiplier": multiplier}
        for s in seeds for step in (1, 2)
    ]  # fmt: skip
    return {
        "rows": rows,
        "reference": [],
        "summary": [],
        "selection": {
            "world_seed": 1000,
            "grid": [multiplier],
            "chosen": {method: multiplier},
            "validation_hm": {method: {f"{multiplier:g}": 0.5 + multiplier / 100}},
            "split": "forget05",
            "seeds": [42],
            "rule": "argmax validation HM; up to 0 per side",
        },
        "test_world_seeds": [0],
        "settings": {
            "authors": 40,
            "model_size": "default",
            "max_steps": None,
            "seeds": seeds,
            "methods": [method],
            "splits": ["forget01", "forget05", "forget10"],
            "lr_grid": [multiplier],
            "lr_grid_extend": 0,
            "sequential": 4,
            "scales": [],
            "lr_scale_applied": 100.0,
        },
        "data_dir": ".cache/bench/world-a40-s0",
        "target": ".cache/bench/models/world-a40-s0-default-s0/target",
        "golds": {},
        "command": f"blade bench --methods {method}",
        "machine": {"cpu_identity": CPU},
        "wall_s": 100.0,
    }


def test_seeds_run_apart_join_into_one_mean_and_std():
    first = _results("blade", 1.0, [42, 123], {42: 0.5, 123: 0.6})
    rest = _results("blade", 1.0, [456], {456: 0.7})
    rest["machine"] = {"cpu_identity": "AuthenticAMD family 26 model 2, AVX512"}  # proved by the score
    merged = merge_results([first, rest], ["a", "b"])

    assert merged["settings"]["seeds"] == [42, 123, 456]
    assert [(r["seed"], r["step"]) for r in merged["rows"]] == [
        (s, t) for s in (42, 123, 456) for t in (1, 2)
    ]
    last = next(e for e in merged["summary_step"] if e["step"] == 2)
    values = [0.7, 0.8, 0.9]
    assert last["n"] == 3
    assert last["HM_all"]["mean"] == pytest.approx(statistics.mean(values))
    assert last["HM_all"]["std"] == pytest.approx(statistics.stdev(values))  # over seeds: the sample std
    assert [s["path"] for s in merged["sources"]] == ["a", "b"]
    assert merged["wall_s"] == 200.0

    again = merge_results([merged, _results("blade", 1.0, [789], {789: 0.4})], ["ab", "c"])
    assert [s["path"] for s in again["sources"]] == ["a", "b", "c"]  # an earlier merge's own sources
    assert again["settings"]["seeds"] == [42, 123, 456, 789]


def test_methods_run_apart_keep_each_multiplier_and_validation_score():
    merged = merge_results(
        [_results("blade", 1.0, [42], {42: 0.5}), _results("grad_diff", 0.25, [42], {42: 0.4})], ["a", "b"]
    )
    assert merged["settings"]["methods"] == ["blade", "grad_diff"]
    assert merged["selection"]["chosen"] == {"blade": 1.0, "grad_diff": 0.25}
    assert merged["selection"]["validation_hm"] == {"blade": {"1": 0.51}, "grad_diff": {"0.25": 0.5025}}
    assert merged["selection"]["grid"] == [0.25, 1.0]
    assert {e["method"] for e in merged["summary_step"]} == {"blade", "grad_diff"}


def test_a_merge_can_keep_only_the_seeds_every_method_ran():
    """Methods run at different seeds are compared like for like: `only_seeds` drops the other seeds' runs
    from the rows, the summary and the settings; a seed no input ran is refused."""
    blade = _results("blade", 1.0, [42, 456], {42: 0.5, 456: 0.6})
    grad_diff = _results("grad_diff", 0.25, [42, 123, 456], {42: 0.4, 123: 0.9, 456: 0.3})
    merged = merge_results([blade, grad_diff], ["a", "b"], only_seeds=[456, 42])

    assert merged["settings"]["seeds"] == [42, 456]
    assert {r["seed"] for r in merged["rows"]} == {42, 456} and len(merged["rows"]) == 8
    last = next(e for e in merged["summary_step"] if e["step"] == 2 and e["method"] == "grad_diff")
    assert last["n"] == 2 and last["HM_all"]["mean"] == pytest.approx(statistics.mean([0.6, 0.5]))

    with pytest.raises(MergeError, match="seed 789: no input ran it"):
        merge_results([blade, grad_diff], ["a", "b"], only_seeds=[42, 789])


def _split_results(split: str, gold: str) -> dict[str, Any]:
    """A grid results.json (one split, two seeds) as an invocation with `--splits SPLIT` writes it."""
    result = _results("grad_diff", 0.25, [42, 123], {42: 0.5, 123: 0.6})
    result["rows"] = [{k: v for k, v in r.items() if k not in ("step", "HM_all")} | {"split": split}
                      for r in result["rows"] if r["step"] == 1]  # fmt: skip
    result["settings"] |= {"sequential": None, "splits": [split]}
    result["golds"] = {split: gold}
    result["reference"] = [{"model": "target", "split": split, "HM": 0.26}]
    return result


def test_splits_run_apart_join_with_their_golds():
    merged = merge_results(
        [_split_results("forget10", "golds/f10"), _split_results("forget05", "golds/f05")], ["a", "b"]
    )
    assert merged["settings"]["splits"] == ["forget05", "forget10"]
    assert merged["golds"] == {"forget05": "golds/f05", "forget10": "golds/f10"}
    assert {(r["model"], r["split"]) for r in merged["reference"]} == {
        ("target", "forget05"),
        ("target", "forget10"),
    }
    assert {(e["split"], e["n"]) for e in merged["summary"]} == {("forget05", 2), ("forget10", 2)}
    assert "summary_step" not in merged

    with pytest.raises(MergeError, match="the gold model of forget05"):
        merge_results(
            [_split_results("forget05", "golds/f05"), _split_results("forget05", "elsewhere/f05")], ["a", "b"]
        )


def test_parts_that_cannot_share_a_table_are_refused():
    base = _results("blade", 1.0, [42], {42: 0.5})

    with pytest.raises(MergeError, match="both hold the run"):
        merge_results([base, copy.deepcopy(base)], ["a", "b"])

    other_build = _results("blade", 1.0, [123], {123: 0.5})
    other_build["selection"]["validation_hm"]["blade"]["1"] = 0.5099999
    with pytest.raises(MergeError, match="built differently"):
        merge_results([base, other_build], ["a", "b"])

    unproved = _results("grad_diff", 0.25, [42], {42: 0.4})
    unproved["machine"] = {"cpu_identity": "GenuineIntel family 6 model 207, AVX512"}
    with pytest.raises(MergeError, match="share no validation score"):
        merge_results([base, unproved], ["a", "b"])

    other_multiplier = _results("blade", 2.0, [123], {123: 0.5})
    with pytest.raises(MergeError, match="the multiplier chosen for blade"):
        merge_results([base, other_multiplier], ["a", "b"])

    other_settings = _results("blade", 1.0, [123], {123: 0.5})
    other_settings["settings"]["max_steps"] = 30
    with pytest.raises(MergeError, match=r"b: settings\.max_steps is 30, a has None"):
        merge_results([base, other_settings], ["a", "b"])

    with pytest.raises(MergeError, match="two or more"):
        merge_results([base], ["a"])


def test_a_re_run_replaces_whole_runs_only_when_asked():
    """`replace`: each run held twice comes whole from the later input, which must hold the same requests;
    the replacements are recorded and carried through a later merge."""
    table = _results("npo", 0.5, [42, 789, 1024], {42: 0.5, 789: 0.6, 1024: 0.7})
    rerun = _results("npo", 0.5, [789], {789: 0.65})
    with pytest.raises(MergeError, match=r"both hold the run \('npo', 'forget10', 1, None, 789\)"):
        merge_results([table, rerun], ["table", "rerun"])

    merged = merge_results([table, rerun], ["table", "rerun"], replace=True)
    assert sorted((r["seed"], r["step"], r["HM"]) for r in merged["rows"]) == [
        (42, 1, 0.5), (42, 2, 0.5), (789, 1, 0.65), (789, 2, 0.65), (1024, 1, 0.7), (1024, 2, 0.7)
    ]  # fmt: skip
    assert merged["replaced"] == [
        {"method": "npo", "split": "forget10", "seed": 789, "was": "table", "by": "rerun"}
    ]
    last = next(e for e in merged["summary_step"] if e["step"] == 2)
    assert last["HM_all"]["mean"] == pytest.approx(statistics.mean([0.7, 0.85, 0.9]))

    again = merge_results([merged, _results("blade", 1.0, [42], {42: 0.5})], ["merged", "blade"])
    assert again["replaced"] == merged["replaced"]

    partial = copy.deepcopy(rerun)
    partial["rows"] = [r for r in partial["rows"] if r["step"] == 1]
    with pytest.raises(MergeError, match=r"with requests \[1\], table holds requests \[1, 2\]"):
        merge_results([table, partial], ["table", "partial"], replace=True)


def test_a_stacked_run_in_two_invocations_merges_on_the_command_line(tmp_path, capsys):
    """`--seed-list 123` runs only that seed; `blade bench-merge` joins it to a `--seeds 1` run (seed 42)
    into one results.json, results.md and plot; unreadable inputs are named with their line."""
    world = ensure_tiny_world(authors=20, size="test")
    common = [
        "bench", "--data", str(world.data_dir), "--target", str(world.model_dir), "--methods", "grad_diff",
        "--sequential", "2", "--max-steps", "2", "--eval-max-rows", "4", "--quick", "--no-progress",
    ]  # fmt: skip
    assert main([*common, "--seeds", "1", "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--seed-list", "123", "--out", str(tmp_path / "b")]) == 0
    part = json.loads((tmp_path / "b" / "results.json").read_text())
    assert {r["seed"] for r in part["rows"]} == {123} and part["settings"]["seeds"] == [123]

    capsys.readouterr()
    assert main([*common, "--seeds", "1", "--seed-list", "123", "--out", str(tmp_path / "c")]) == 2
    assert "give one" in capsys.readouterr().err
    assert main([*common, "--seed-list", "42,x", "--out", str(tmp_path / "c")]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err
    assert main([*common, "--seed-list", "42,42", "--out", str(tmp_path / "c")]) == 2
    assert "distinct" in capsys.readouterr().err

    out = tmp_path / "merged"
    assert (
        main(["bench-merge", str(tmp_path / "a"), str(tmp_path / "b" / "results.json"), "--out", str(out)])
        == 0
    )
    merged = json.loads((out / "results.json").read_text())
    assert merged["settings"]["seeds"] == [42, 123]
    assert sorted((r["seed"], r["step"]) for r in merged["rows"]) == [(42, 1), (42, 2), (123, 1), (123, 2)]
    assert all(e["n"] == 2 for e in merged["summary_step"])
    report = (out / "results.md").read_text()
    assert (out / "hm_step.png").read_bytes()[:4] == b"\x89PNG" and "](hm_step.png)" in report
    # the report names what it joined instead of one invocation's command, and each kind of CPU behind it
    assert "Joined by `blade bench-merge` from 2 invocations" in report and "Command:" not in report
    assert report.count("CPU kind ") == 1 and f"CPU kind {part['machine']['cpu_identity']}" in report

    broken = tmp_path / "broken.json"
    broken.write_text('{"rows": [\n  1,\n')
    capsys.readouterr()
    assert main(["bench-merge", str(tmp_path / "a"), str(broken), "--out", str(out)]) == 2
    assert f"{broken}: line 3 column 1" in capsys.readouterr().err
    assert main(["bench-merge", str(tmp_path / "a"), str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err

    # seed 123 again (here the same run; in use, a re-run under a corrected setup) replaces its rows
    twice = ["bench-merge", str(out), str(tmp_path / "b"), "--out", str(tmp_path / "replaced")]
    assert main(twice) == 2
    assert "both hold the run" in capsys.readouterr().err
    assert main([*twice, "--replace"]) == 0
    assert "4 runs of 1 methods, seeds 42, 123; 1 runs replaced" in capsys.readouterr().err
    replaced = json.loads((tmp_path / "replaced" / "results.json").read_text())
    by = str(tmp_path / "b" / "results.json")
    assert [(r["seed"], r["by"]) for r in replaced["replaced"]] == [(123, by)]
    assert (
        "replacing an earlier input's rows (results.json `replaced`): grad_diff seed 123"
        in (tmp_path / "replaced" / "results.md").read_text()
    )
    # a later merge carries the earlier replacement on and counts only its own apart
    again = ["bench-merge", str(tmp_path / "replaced"), str(tmp_path / "b"), "--replace"]
    assert main([*again, "--out", str(tmp_path / "again")]) == 0
    assert "seeds 42, 123; 1 runs replaced (1 more carried from the inputs)" in capsys.readouterr().err
    carried = json.loads((tmp_path / "again" / "results.json").read_text())["replaced"]
    assert [(r["seed"], r["by"]) for r in carried] == [(123, by), (123, by)]
