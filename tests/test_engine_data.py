"""Tokenisation, label masking, collation, errors naming rows, and the exactly resumable BatchStream."""

from __future__ import annotations

import json

import pytest
import torch

from blade_core.data import (
    BatchStream,
    collate,
    format_qa,
    format_question,
    load_tokenized,
    tokenize_rows,
)
from blade_core.testing import tiny_qa_rows, tiny_tokenizer, write_rows
from blade_service.contracts.records import DatasetError, read_records


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_format_qa_without_chat_template(tok):
    prompt, full = format_qa(tok, "Who is Ada?", "A baker.")
    assert prompt == format_question(tok, "Who is Ada?") == "Question: Who is Ada?\nAnswer:"
    assert full == "Question: Who is Ada?\nAnswer: A baker.</s>"


def test_format_qa_uses_the_chat_template_when_present(tok):
    tok.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
    try:
        prompt, full = format_qa(tok, "Q?", "A.")
        assert (
            prompt == format_question(tok, "Q?") == "<|user|>Q?\n<|assistant|>" and full == prompt + "A.</s>"
        )
    finally:
        tok.chat_template = None


def test_qa_labels_mask_the_prompt_and_end_with_eos(tok):
    rows = tiny_qa_rows(3, seed=0)
    data = tokenize_rows(rows, tok, max_length=128)
    assert data.kind == "qa" and len(data) == 3
    for ids, labels, row in zip(data.input_ids, data.labels, rows, strict=True):
        n_prompt = labels.count(-100)
        assert labels[:n_prompt] == [-100] * n_prompt and -100 not in labels[n_prompt:]
        assert tok.decode(ids[:n_prompt]) == format_qa(tok, row["question"], row["answer"])[0]
        assert labels[n_prompt:] == ids[n_prompt:] and ids[-1] == tok.eos_token_id
        assert row["answer"] in tok.decode(labels[n_prompt:])


def test_text_rows_are_chunked_with_all_tokens_as_labels(tok):
    text = " ".join(r["answer"] for r in tiny_qa_rows(8, seed=3))
    data = tokenize_rows([{"text": text}], tok, max_length=16)
    assert data.kind == "text" and len(data) > 2
    assert all(len(ids) <= 16 for ids in data.input_ids)
    assert data.input_ids == data.labels
    assert sum(len(ids) for ids in data.input_ids) == len(tok(text + tok.eos_token)["input_ids"])


def test_prompt_too_long_names_the_row(tok, tmp_path):
    rows = [*tiny_qa_rows(2, seed=0), {"question": "word " * 200, "answer": "x"}]
    path = write_rows(tmp_path / "f.jsonl", rows)
    with pytest.raises(DatasetError, match=r"f\.jsonl, line 3: field 'question'.*row 3.*max_length=32"):
        load_tokenized(path, tok, max_length=32)


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"", "empty"),
        (b'{"question": "q"}\n', "line 1: field 'answer': missing"),
        (b'{"question": "q", "answer": "a"}\n\xff\xfe\n', "not valid UTF-8"),
    ],
)
def test_bad_files_fail_loudly(tok, tmp_path, content, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=pattern):
        load_tokenized(path, tok, 64)


def test_json_array_and_txt_files_load(tok, tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(tiny_qa_rows(4, seed=0)))
    assert len(load_tokenized(tmp_path / "a.json", tok, 64)) == 4
    (tmp_path / "b.txt").write_text("First document here.\n\nSecond one.\n")
    assert load_tokenized(tmp_path / "b.txt", tok, 64).kind == "text"


def test_each_row_of_a_json_array_carries_the_line_it_starts_on(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(tiny_qa_rows(3, seed=0), indent=2))  # each object spans 11 lines
    rows, layout = read_records(path)
    assert layout == "json" and [r.line for r in rows] == [2, 13, 24]
    path.write_text(json.dumps(tiny_qa_rows(3, seed=0)) + "\n" + json.dumps(tiny_qa_rows(1, seed=1)) + "\n")
    rows, layout = read_records(path)  # an array per line: rows of line 1, then line 2
    assert layout == "json-lines-of-arrays" and [r.line for r in rows] == [1, 1, 1, 2]


def test_collate_right_pads(tok):
    batch = collate(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], pad_id=2
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 2, 2]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_batch_stream_covers_each_epoch_and_resumes_exactly(tok):
    data = tokenize_rows(tiny_qa_rows(10, seed=0), tok, 64)
    stream = BatchStream(data, batch_size=3, seed=5)
    first_epoch = [i for _ in range(3) for i in stream.next_indices()] + stream.next_indices()[:1]
    assert sorted(first_epoch) == list(range(10))
    state = stream.state_dict()
    expected = [stream.next() for _ in range(7)]
    other = BatchStream(data, batch_size=3, seed=0)
    other.load_state_dict(state)
    for want in expected:
        got = other.next()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert BatchStream(data, 3, seed=5).next_indices() != BatchStream(data, 3, seed=6).next_indices()
