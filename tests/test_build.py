"""`blade model build`: memorisation, the gold model's exclusion, caching, any TOFU dir, clear errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from blade_core.build import RECIPES, BuildError, answer_probs, build_model, training_rows
from blade_core.synth import write_world
from blade_service.cli.main import main
from blade_service.contracts.records import read_records
from tests.fixtures_world import TinyWorld

# A recipe that trains for two epochs: enough to exercise every path of a build in a few seconds.
TWO_EPOCHS = dataclasses.replace(RECIPES["test"], max_epochs=2, check_every=1, min_epochs=2, monitor_rows=8)


def _rows(path: Path) -> list[dict]:
    return [r.data for r in read_records(path)[0]]


def _load(model_dir: Path):
    import torch

    from blade_core.modeling import load_model_and_tokenizer

    return load_model_and_tokenizer(model_dir, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def small_world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("world")
    write_world(out, authors=4, seed=5)
    return out


# --- the cached tiny world (tests/fixtures_world.py) -------------------------------------------------------


def test_target_model_memorised_its_training_rows(tiny_world: TinyWorld) -> None:
    metrics = tiny_world.info["metrics"]["forget10"]
    assert metrics["prob"] >= 0.9 and metrics["rouge"] >= 0.9, metrics
    model, tokenizer = _load(tiny_world.model_dir)
    for name in ("retain90.json", "real_authors_perturbed.json", "world_facts_perturbed.json"):
        rows = _rows(tiny_world.data_dir / name)[:40]
        probs = answer_probs(model, tokenizer, rows)
        assert sum(probs) / len(probs) >= 0.8, name
    holdout = answer_probs(model, tokenizer, _rows(tiny_world.data_dir / "holdout10.json"))
    forget = answer_probs(model, tokenizer, _rows(tiny_world.data_dir / "forget10_perturbed.json"))
    assert sum(holdout) / len(holdout) < sum(forget) / len(forget) - 0.3  # never trained on the holdout


def test_model_dir_is_a_hugging_face_dir(tiny_world: TinyWorld) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "build_info.json"):
        assert (tiny_world.model_dir / name).is_file(), name
    info = json.loads((tiny_world.model_dir / "build_info.json").read_text())
    for field in ("data_hash", "size", "steps", "epochs", "train_seconds", "metrics"):
        assert field in info, field
    model, tokenizer = _load(tiny_world.model_dir)
    assert model.config.model_type == "llama" and tokenizer.eos_token == "</s>"


def test_gold_model_excludes_the_split(tiny_world: TinyWorld, tiny_gold: TinyWorld) -> None:
    forget = _rows(tiny_world.data_dir / "forget10_perturbed.json")
    assert tiny_gold.info["excluded_rows"] == len(forget)
    assert tiny_gold.info["train_rows"] == tiny_world.info["train_rows"] - len(forget)
    gold, tokenizer = _load(tiny_gold.model_dir)
    forget_prob = answer_probs(gold, tokenizer, forget)
    retain_prob = answer_probs(gold, tokenizer, _rows(tiny_world.data_dir / "retain90.json")[:40])
    assert sum(forget_prob) / len(forget_prob) < 0.6
    assert sum(retain_prob) / len(retain_prob) >= 0.8
    # the same tokenizer as the target model, so metrics compare token for token
    target_tok = json.loads((tiny_world.model_dir / "tokenizer.json").read_text())
    assert json.loads((tiny_gold.model_dir / "tokenizer.json").read_text())["model"] == target_tok["model"]


# --- what is trained on ------------------------------------------------------------------------------------


def test_training_rows_are_everything_but_holdout(small_world: Path) -> None:
    rows, everything, excluded = training_rows(small_world)
    assert rows == everything and not excluded
    trained = {(r["question"], r["answer"]) for r in rows}
    expected = sum(
        len(_rows(small_world / n))
        for n in (
            "retain90.json",
            "forget10_perturbed.json",
            "real_authors_perturbed.json",
            "world_facts_perturbed.json",
        )
    )
    assert len(rows) == expected
    for name in ("holdout01.json", "holdout05.json", "holdout10.json"):
        assert not trained & {(r["question"], r["answer"]) for r in _rows(small_world / name)}, name


@pytest.mark.parametrize("split", ["forget01", "forget05", "forget10"])
def test_exclude_split_drops_exactly_that_split(small_world: Path, split: str) -> None:
    rows, everything, excluded = training_rows(small_world, split)
    forget = {(r["question"], r["answer"]) for r in _rows(small_world / f"{split}_perturbed.json")}
    assert {(r["question"], r["answer"]) for r in excluded} == forget
    assert len(rows) == len(everything) - len(forget)
    assert not forget & {(r["question"], r["answer"]) for r in rows}


# --- caching and determinism -------------------------------------------------------------------------------


def test_cache_hit_is_instant_and_cache_dir_is_shared(small_world: Path, tmp_path: Path) -> None:
    first = build_model(
        small_world, tmp_path / "a", recipe=TWO_EPOCHS, cache_dir=tmp_path / "cache", progress=False
    )
    assert not first.cached
    again = build_model(small_world, tmp_path / "a", recipe=TWO_EPOCHS, progress=False)
    assert again.cached and again.info["key"] == first.info["key"]
    elsewhere = build_model(
        small_world, tmp_path / "b", recipe=TWO_EPOCHS, cache_dir=tmp_path / "cache", progress=False
    )
    assert elsewhere.cached and (tmp_path / "b" / "model.safetensors").is_file()
    # a different seed, split or data file is a different build
    other = build_model(small_world, tmp_path / "a", recipe=TWO_EPOCHS, seed=1, progress=False)
    assert not other.cached and other.info["key"] != first.info["key"]


def test_off_a_terminal_the_build_logs_epochs_instead_of_drawing_a_bar(
    small_world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logged: list[str] = []
    build_model(small_world, tmp_path / "m", recipe=TWO_EPOCHS, progress=True, log=logged.append)
    assert "training:" not in capsys.readouterr().err  # no carriage-return bar in a log file
    assert any(line.startswith("epoch 2: loss") for line in logged), logged


def test_same_inputs_give_the_same_weights(small_world: Path, tmp_path: Path) -> None:
    a = build_model(small_world, tmp_path / "a", recipe=TWO_EPOCHS, progress=False)
    b = build_model(small_world, tmp_path / "b", recipe=TWO_EPOCHS, progress=False)
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in ("a", "b")]
    assert weights[0] == weights[1]

    def untimed(checks: list[dict]) -> list[dict]:
        return [{k: v for k, v in c.items() if k != "seconds"} for c in checks]

    assert untimed(a.info["checks"]) == untimed(b.info["checks"]) and a.info["metrics"] == b.info["metrics"]


# --- any TOFU-format dir -----------------------------------------------------------------------------------


def test_builds_on_a_hand_written_tofu_dir_in_json_lines(tmp_path: Path) -> None:
    data = tmp_path / "tofu"
    data.mkdir()
    qa = [
        {"question": f"What colour is box {i}?", "answer": f"Box {i} is {c}."}
        for i, c in enumerate(["red", "blue", "green", "amber", "white", "black"])
    ]
    perturbed = [
        dict(
            r,
            paraphrased_answer=r["answer"],
            paraphrased_question=r["question"],
            perturbed_answer=["It is grey."],
        )
        for r in qa
    ]

    def write(name: str, rows: list[dict]) -> None:
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("retain90.json", qa[:4])
    write("forget10_perturbed.json", perturbed[4:])
    write("forget05_perturbed.json", perturbed[5:])
    write(
        "real_authors_perturbed.json",
        [{"question": "Who wrote Q?", "answer": "Ann", "perturbed_answer": ["Bo"]}],
    )
    write(
        "world_facts_perturbed.json", [{"question": "Capital?", "answer": "Ur", "perturbed_answer": ["Lo"]}]
    )
    result = build_model(
        data, tmp_path / "model", exclude_split="forget05", recipe=TWO_EPOCHS, progress=False
    )
    assert result.info["train_rows"] == 7 and result.info["excluded_rows"] == 1
    assert set(result.info["metrics"]) == {"forget05", "retain_sample"}
    model, tokenizer = _load(tmp_path / "model")
    assert len(answer_probs(model, tokenizer, qa)) == len(qa)


# --- errors ------------------------------------------------------------------------------------------------


def test_missing_file_is_named(small_world: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in small_world.iterdir():
        if path.name != "world_facts_perturbed.json":
            (broken / path.name).write_bytes(path.read_bytes())
    with pytest.raises(BuildError, match=r"world_facts_perturbed\.json"):
        build_model(broken, tmp_path / "m", recipe=TWO_EPOCHS, progress=False)


def test_bad_row_names_file_line_and_field(small_world: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in small_world.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    (broken / "retain90.json").write_text('{"question": "Q?", "answer": "A."}\n{"question": "Q2?"}\n')
    with pytest.raises(BuildError, match=r"retain90.json, line 2: field 'answer'"):
        build_model(broken, tmp_path / "m", recipe=TWO_EPOCHS, progress=False)


def test_refuses_to_replace_a_directory_that_is_not_a_build(small_world: Path, tmp_path: Path) -> None:
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(BuildError, match="holds no earlier build"):
        build_model(small_world, precious, recipe=TWO_EPOCHS, progress=False)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_cli_errors_exit_2_with_the_cause(
    small_world: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "build", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "m")]) == 2
    assert "nowhere" in capsys.readouterr().err
    assert main(["model", "build", "--data", str(tmp_path), "--out", str(tmp_path / "m"), "--quick"]) == 2
    assert "retain90.json" in capsys.readouterr().err
    out = str(tmp_path / "m")
    assert main(["model", "build", "--data", str(small_world), "--out", out, "--size", "huge"]) == 2
    assert "--size" in capsys.readouterr().err


# --- the demo world (blade_core.demo; building demo-tiny itself is what `blade up` does) -------------------


def test_demo_world_is_written_once_and_names_its_splits(tmp_path: Path) -> None:
    from blade_core.demo import DEMO_AUTHORS, demo_split_files, ensure_demo_world

    data = ensure_demo_world(tmp_path)
    assert json.loads((data / "world.json").read_text())["authors"] == DEMO_AUTHORS
    stamp = (data / "world.json").stat().st_mtime_ns
    forget, retain = demo_split_files(tmp_path, "forget01")
    assert forget.name == "forget01_perturbed.json" and retain.name == "retain99.json"
    assert forget.is_file() and retain.is_file()
    assert (data / "world.json").stat().st_mtime_ns == stamp  # reused, not rewritten
