"""Text worlds (`blade data synth --kind books|news`), their target / retrained build, and the text bench on
tiny sizes: determinism, splits, entanglement, probes grounded in the documents, caching, the bench's rows."""

from __future__ import annotations

import json
import re

import pytest

from blade_core.text_world import generate, holds_text_world, read_world, write_text_world
from blade_service.cli.main import main


def test_news_world_is_deterministic_and_entangled(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    counts = write_text_world(a, "news", 30, seed=3)
    write_text_world(b, "news", 30, seed=3)
    for name in counts:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert counts["forget.jsonl"] == 3 and counts["holdout.jsonl"] == 3 and counts["retain.jsonl"] == 24
    world = read_world(a)
    assert not set(world["forget"]) & set(world["retain"]) and not set(world["holdout"]) & set(
        world["retain"]
    )

    def people(texts):
        return {m.group(1) for t in texts for m in re.finditer(r"\. ([A-Z]\w+ [A-Z]\w+), a ", t)}

    # one person pool for all articles: someone in the forget set also appears in retained articles
    assert people(world["forget"]) & people(world["retain"])
    # every forget probe's answer is stated in a forget article
    for qa in world["forget_qa"]:
        assert any(qa["answer"] in t for t in world["forget"]), qa
    assert len(world["icl_qa"]) == 3 and not any(q in world["retain_qa"] for q in world["icl_qa"])
    assert (
        write_text_world(tmp_path / "c", "news", 30, seed=4)
        and (tmp_path / "c" / "forget.jsonl").read_bytes() != (a / "forget.jsonl").read_bytes()
    )


def test_a_text_world_is_held_only_complete_and_as_asked(tmp_path):
    """The text bench rewrites a cached world only when it is not the one asked for: another kind, size, seed
    or generator version, or a write that stopped before world.json (written last)."""
    out = tmp_path / "w"
    assert not holds_text_world(out, "news", 30, seed=3)
    write_text_world(out, "news", 30, seed=3)
    assert holds_text_world(out, "news", 30, seed=3)
    assert not holds_text_world(out, "news", 30, seed=4) and not holds_text_world(out, "books", 30, seed=3)
    info = json.loads((out / "world.json").read_text())
    (out / "world.json").write_text(json.dumps(info | {"version": info["version"] - 1}))
    assert not holds_text_world(out, "news", 30, seed=3)
    (out / "world.json").write_text("{")  # torn
    assert not holds_text_world(out, "news", 30, seed=3)


def test_books_world_forgets_the_first_work():
    world = generate("books", 3, seed=0)
    title = world["forget"][0].text.split(", chapter")[0]
    assert all(d.text.startswith(f"{title}, chapter") for d in world["forget"])
    assert not any(d.text.startswith(f"{title},") for d in world["retain"] + world["holdout"])
    with pytest.raises(ValueError, match="at least 3 works"):
        generate("books", 2)
    with pytest.raises(ValueError, match="kind must be one of"):
        generate("poems")


def test_cli_synth_and_build_text(tmp_path, capsys, one_thread):
    data, out = tmp_path / "news", tmp_path / "target"
    assert main(["data", "synth", "--kind", "news", "--docs", "10", "--out", str(data)]) == 0
    assert json.loads((data / "world.json").read_text())["kind"] == "news"
    assert main(["data", "synth", "--kind", "news", "--docs", "3", "--out", str(tmp_path / "x")]) == 2
    assert "at least 10 articles" in capsys.readouterr().err

    args = [
        "model",
        "build",
        "--data",
        str(data),
        "--size",
        "test",
        "--no-progress",
        "--cache-dir",
        str(tmp_path),
    ]
    assert main([*args, "--out", str(out)]) == 0
    info = json.loads((out / "build_info.json").read_text())
    assert info["stage"] == "text-finetune" and info["retrained"] is False and info["texts"] == 9 + 32
    assert main([*args, "--out", str(out)]) == 0
    assert "cached" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "retrained"), "--retrained"]) == 0
    retrained = json.loads((tmp_path / "retrained" / "build_info.json").read_text())
    assert retrained["retrained"] is True and retrained["texts"] == 8 + 32 and retrained["key"] != info["key"]

    # `blade eval` measures TOFU QA splits, and says where a text world's metrics come from instead
    assert main(["eval", "--model", str(out), "--data", str(data), "--json", str(tmp_path / "e.json")]) == 2
    assert "MUSE-style text world" in capsys.readouterr().err


def test_text_bench_rows(tmp_path, one_thread):
    from blade_core.bench.text import run_text_bench

    results = run_text_bench(
        suite="knowundo",
        out=tmp_path / "out",
        cache=tmp_path / "cache",
        quick=True,
        methods=["blade", "grad_ascent"],
        kind="news",
        sequential=2,
        log=lambda _m: None,
        model_size="test",
        docs=20,
        max_steps=2,
        eval_max_rows=3,
    )
    assert [r["method"] for r in results["rows"]] == ["blade", "grad_ascent"]
    assert [r["method"] for r in results["reference"]] == ["target", "retrained"]
    for row in results["rows"]:
        assert row["steps"] == 2
        for key in ("verbmem_f", "knowmem_f", "knowmem_r", "HM", "general", "HM_knowundo", "privleak"):
            assert key in row, (key, row)
    assert [(r["method"], r["step"]) for r in results["sequential"]][:2] == [("blade", 1), ("blade", 2)]
    assert (tmp_path / "out" / "results.json").is_file()
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| blade |" in md and "HM_KnowUndo" in md


def test_text_selection_counts_a_run_without_retain_knowledge_as_collapsed():
    from blade_core.bench.text import collapsed

    assert collapsed({"knowmem_r": 0.0, "HM": 0.0}, "muse")
    assert not collapsed({"knowmem_r": 0.2, "general": 0.0}, "muse")  # MUSE's HM has no general utility
    assert collapsed({"knowmem_r": 0.2, "general": 0.0}, "knowundo")
    assert not collapsed({"knowmem_r": 0.2, "general": 0.1}, "knowundo")
    assert not collapsed({"HM": None}, "muse")  # nothing measured: no verdict
