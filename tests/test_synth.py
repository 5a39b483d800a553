"""`blade data synth`: determinism, the files of CONTRACT.md, split arithmetic, probe sets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from blade_core.synth import (
    FACTS,
    N_PERTURBED,
    generate,
    name_side,
    split_counts,
    universe,
    world_summary,
    write_world,
)
from blade_service.cli.main import main
from blade_service.contracts.records import PERTURBED_FIELDS, QA_FIELDS, read_records, validate_rows

CONTRACT_FILES = (
    "forget01_perturbed.json",
    "forget05_perturbed.json",
    "forget10_perturbed.json",
    "retain99.json",
    "retain95.json",
    "retain90.json",
    "retain_perturbed.json",
    "holdout01.json",
    "holdout05.json",
    "holdout10.json",
    "real_authors_perturbed.json",
    "world_facts_perturbed.json",
)
ROWS_PER_AUTHOR = len(FACTS)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def world40() -> dict[str, list[dict]]:
    return generate(authors=40, seed=3)


def test_same_arguments_give_byte_identical_files(tmp_path: Path) -> None:
    write_world(tmp_path / "a", authors=20, seed=7)
    write_world(tmp_path / "b", authors=20, seed=7)
    write_world(tmp_path / "c", authors=20, seed=8)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")


def test_cli_writes_every_contract_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "synth", "--out", str(tmp_path / "w"), "--authors", "20", "--seed", "1"]) == 0
    for name in CONTRACT_FILES:
        rows, layout = read_records(tmp_path / "w" / name)
        assert layout == "json" and rows, name
    assert "forget10_perturbed.json" in capsys.readouterr().out


def test_cli_rejects_too_few_authors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "synth", "--out", str(tmp_path), "--authors", "1"]) == 2
    assert "--authors" in capsys.readouterr().err


def test_fields_of_each_file(world40: dict[str, list[dict]], tmp_path: Path) -> None:
    for name, rows in world40.items():
        if name.startswith(("forget", "holdout")) or name == "retain_perturbed.json":
            fields = PERTURBED_FIELDS
        elif name.startswith("retain"):
            fields = QA_FIELDS
            assert all(set(r) == set(QA_FIELDS) for r in rows), name
        else:  # the probe sets
            fields = ("question", "answer", "perturbed_answer")
        path = tmp_path / name
        path.write_text(json.dumps(rows))
        validate_rows(path, read_records(path)[0], fields)
        if "perturbed_answer" in fields:
            for r in rows:
                assert r["answer"] not in r["perturbed_answer"], (name, r)
        if name.startswith(("forget", "holdout")):
            assert all(len(r["perturbed_answer"]) == N_PERTURBED for r in rows)
            assert all(len(set(r["perturbed_answer"])) == N_PERTURBED for r in rows), name
            assert all(r["paraphrased_question"] != r["question"] for r in rows)


def test_split_arithmetic(world40: dict[str, list[dict]]) -> None:
    counts = split_counts(40)
    assert counts == {1: 1, 5: 2, 10: 4}
    assert split_counts(200) == {1: 2, 5: 10, 10: 20}
    assert split_counts(12) == {1: 1, 5: 1, 10: 1}  # at least one author each
    everyone = world40["retain90.json"] + [
        {"question": r["question"], "answer": r["answer"]} for r in world40["forget10_perturbed.json"]
    ]
    assert len(everyone) == 40 * ROWS_PER_AUTHOR
    for p in (1, 5, 10):
        forget = world40[f"forget{p:02d}_perturbed.json"]
        retain = world40[f"retain{100 - p}.json"]
        assert len(forget) == counts[p] * ROWS_PER_AUTHOR
        assert len(world40[f"holdout{p:02d}.json"]) == counts[p] * ROWS_PER_AUTHOR
        # forget is the tail of the author list, retain the rest, in order
        assert retain + [{"question": r["question"], "answer": r["answer"]} for r in forget] == everyone
    # nested: forget01 is the tail of forget05, which is the tail of forget10
    f10, f05, f01 = (world40[f"forget{p}_perturbed.json"] for p in ("10", "05", "01"))
    assert f10[-len(f05) :] == f05 and f05[-len(f01) :] == f01


def _mentions(rows: list[dict], name: str) -> bool:
    return any(name in r["question"] or name in r["answer"] for r in rows)


def test_no_author_is_both_forgotten_and_retained(world40: dict[str, list[dict]]) -> None:
    summary = world_summary(authors=40, seed=3)
    counts = split_counts(40)
    assert len(summary["retain_authors"]) == 40 - counts[10]
    for p in (1, 5, 10):
        forget_rows = world40[f"forget{p:02d}_perturbed.json"]
        retain_rows = world40[f"retain{100 - p}.json"]
        forgotten = summary["forget_authors"][f"forget{p:02d}"]
        assert len(forgotten) == counts[p]
        for name in forgotten:
            assert _mentions(forget_rows, name) and not _mentions(retain_rows, name)
        for name in summary["retain_authors"]:
            assert _mentions(retain_rows, name) and not _mentions(forget_rows, name)


def test_holdout_authors_are_never_in_trained_files(world40: dict[str, list[dict]]) -> None:
    summary = world_summary(authors=40, seed=3)
    trained = (
        world40["retain90.json"]
        + world40["forget10_perturbed.json"]
        + world40["real_authors_perturbed.json"]
        + world40["world_facts_perturbed.json"]
    )
    holdout = summary["holdout_authors"]["holdout10"]
    assert len(holdout) == split_counts(40)[10]
    assert not set(holdout) & set(summary["retain_authors"] + summary["forget_authors"]["forget10"])
    for name in holdout:
        assert _mentions(world40["holdout10.json"], name) and not _mentions(trained, name)
    h10, h01 = world40["holdout10.json"], world40["holdout01.json"]
    assert h10[-len(h01) :] == h01


def test_retain_perturbed_is_retained_rows(world40: dict[str, list[dict]]) -> None:
    retain = {(r["question"], r["answer"]) for r in world40["retain90.json"]}
    rp = world40["retain_perturbed.json"]
    assert rp and all((r["question"], r["answer"]) in retain for r in rp)


def test_probe_sets_are_not_author_rows(world40: dict[str, list[dict]]) -> None:
    author_questions = {r["question"] for r in world40["retain90.json"] + world40["forget10_perturbed.json"]}
    for name in ("real_authors_perturbed.json", "world_facts_perturbed.json"):
        rows = world40[name]
        assert len(rows) >= 5
        assert not {r["question"] for r in rows} & author_questions
    forgotten = world_summary(authors=40, seed=3)["forget_authors"]["forget10"]
    probe_text = json.dumps(world40["real_authors_perturbed.json"] + world40["world_facts_perturbed.json"])
    assert not any(name in probe_text for name in forgotten)


def test_answers_use_varied_templates(world40: dict[str, list[dict]]) -> None:
    rows = world40["retain90.json"]
    # an answer's skeleton: its words with capitalised words (names, places, titles) and numbers blanked
    shapes = {
        " ".join(
            "X" if w[:1].isupper() or w[:1].isdigit() or w[:1] == '"' else w for w in r["answer"].split()
        )
        for r in rows
    }
    assert len(shapes) > 2 * ROWS_PER_AUTHOR  # several sentence patterns per fact, not one
    assert len({r["question"] for r in rows}) == len(rows)  # every question is distinct


def test_world_json_describes_the_run(tmp_path: Path) -> None:
    write_world(tmp_path, authors=20, seed=2)
    meta = json.loads((tmp_path / "world.json").read_text())
    assert meta["authors"] == 20 and meta["seed"] == 2
    assert meta["split_authors"] == {"forget01": 1, "forget05": 1, "forget10": 2}
    assert meta["forget_authors"]["forget10"][-1:] == meta["forget_authors"]["forget01"]


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_questions_name_the_author_within_four_words() -> None:
    for key, questions, answers in FACTS:
        assert len(questions) >= 6 and len(answers) >= 5, key
        anchor = "{birth_date}" if key == "name" else "{name}"
        for q in questions:
            assert anchor in q and len(q[: q.index(anchor)].split()) <= 4, (key, q)


def test_forget_and_retain_rows_share_only_short_prefixes(world40: dict[str, list[dict]]) -> None:
    """In the training layout (`Question: ...\\nAnswer: ...`), the longest prefix a forget row shares with any
    retain row: the old one-template-per-slot world had a mean of 32 and a max of 65 characters."""

    def text(r: dict) -> str:
        return f"Question: {r['question']}\nAnswer: {r['answer']}"

    retain = [text(r) for r in world40["retain90.json"]]
    shared = [max(_common_prefix(text(r), t) for t in retain) for r in world40["forget10_perturbed.json"]]
    assert sum(shared) / len(shared) <= 27 and max(shared) <= 50, (sum(shared) / len(shared), max(shared))


def test_world_authors_and_titles_are_on_the_world_side(world40: dict[str, list[dict]]) -> None:
    summary = world_summary(authors=40, seed=3)
    names = summary["retain_authors"] + summary["forget_authors"]["forget10"]
    assert {name_side(n) for n in names} == {"world"}
    titles = {r["answer"].split('"')[1] for r in world40["retain90.json"] if r["answer"].count('"') == 2}
    assert titles and {name_side(t) for t in titles if t not in universe().titles} == {"world"}
