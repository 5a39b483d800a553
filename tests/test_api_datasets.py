"""`POST /datasets`: validated uploads; every bad one is a 4xx naming the problem and stores nothing."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.fixtures_services import headers, jsonl, qa_rows, row_counts, stored_files, upload_dataset

pytestmark = pytest.mark.services


def test_upload_jsonl_json_and_text(api_client, tenant):
    data = jsonl(qa_rows(4))
    body = upload_dataset(api_client, tenant.admin, content=data, filename="forget.jsonl")
    assert body["rows"] == 4 and body["format"] == "jsonl" and body["kind"] == "qa"
    assert body["sha256"] == hashlib.sha256(data).hexdigest() and body["id"].startswith("ds_")
    as_array = upload_dataset(
        api_client, tenant.admin, content=json.dumps(qa_rows(2)).encode(), filename="retain.json"
    )
    assert as_array["format"] == "json" and as_array["rows"] == 2
    text = upload_dataset(
        api_client, tenant.admin, content=b"First doc.\n\nSecond doc.\n", filename="notes.txt"
    )
    assert text["kind"] == "text" and text["rows"] == 2 and text["format"] == "txt"
    got = api_client.get(f"/datasets/{body['id']}", headers=headers(tenant.admin)).json()
    assert got["sha256"] == body["sha256"] and got["name"] == "forget.jsonl"
    listed = api_client.get("/datasets", headers=headers(tenant.admin)).json()["items"]
    assert {d["id"] for d in listed} == {body["id"], as_array["id"], text["id"]}


BAD_UPLOADS = [
    # (file name, content, status, code, words the message must contain)
    (  # a spreadsheet export: the error says what a dataset may be
        "people.csv",
        b"question,answer\nq,a\n",
        422,
        "invalid_dataset",
        ["people.csv", "line 1", "invalid JSON", "JSON Lines (.jsonl)"],
    ),
    (
        "bad.jsonl",
        b'{"question": "q", "answer": "a"}\n{"question": "q2", "answer": \n',
        422,
        "invalid_dataset",
        ["bad.jsonl", "line 2", "invalid JSON"],
    ),
    (
        "bad.jsonl",
        b'{"question": "q", "answer": "a"}\n{"question": "q2"}\n',
        422,
        "invalid_dataset",
        ["bad.jsonl", "line 2", "answer", "missing"],
    ),
    ("bad.jsonl", b'{"question": "q", "answer": ""}\n', 422, "invalid_dataset", ["line 1", "answer"]),
    (
        "bad.json",
        b'[{"question": "q", "answer": "a"}, 5]',
        422,
        "invalid_dataset",
        ["bad.json", "JSON object"],
    ),
    (  # a pretty-printed array: the error names the line the bad row starts on, not the array's first
        "bad.json",
        b'[\n  {"question": "q", "answer": "a"},\n  {"question": "q2"}\n]\n',
        422,
        "invalid_dataset",
        ["bad.json, line 3", "answer", "missing"],
    ),
    (
        "bad.json",
        b'[{"question": "q", "answer": "a"},\n {"question": "q2", "answer": }]',
        422,
        "invalid_dataset",
        ["bad.json, line 2", "invalid JSON", "column 31"],
    ),
    (  # every bad row is named, ten of them, and the rest counted
        "bad.jsonl",
        b'{"question": "q", "answer": "a"}\n' + b'{"question": "q"}\n' * 12,
        422,
        "invalid_dataset",
        ["bad.jsonl, line 2: field 'answer': missing", "; line 11: field 'answer'", "; and 2 more"],
    ),
    ("bad.jsonl", b"\xff\xfe\x00garbage", 422, "invalid_dataset", ["UTF-8"]),
    ("empty.jsonl", b"", 422, "invalid_dataset", ["empty"]),
    ("blank.jsonl", b"\n\n  \n", 422, "invalid_dataset", ["empty"]),
    ("big.jsonl", jsonl(qa_rows(1))[:-1] + b" " * (300 * 1024) + b"\n", 413, "too_large", ["limit"]),
]


@pytest.mark.parametrize(("filename", "content", "status", "code", "words"), BAD_UPLOADS)
def test_bad_uploads_are_refused_and_nothing_is_stored(
    api_client, tenant, db_engine, service_settings, filename, content, status, code, words
):
    before, files = row_counts(db_engine), stored_files(service_settings.resolved_storage_root())
    resp = api_client.post("/datasets", headers=headers(tenant.admin), files={"file": (filename, content)})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code
    for word in words:
        assert word in error["message"], error["message"]
    assert row_counts(db_engine) == before
    assert stored_files(service_settings.resolved_storage_root()) == files


def test_missing_file_field_names_it(api_client, tenant, db_engine):
    before = row_counts(db_engine)
    resp = api_client.post("/datasets", headers=headers(tenant.admin), files={"other": ("x.jsonl", b"{}")})
    assert resp.status_code == 422
    assert resp.json()["error"]["field"] == "file"
    assert row_counts(db_engine) == before


def test_oversized_body_is_refused_before_it_is_read(api_client, tenant, service_settings, db_engine):
    before = row_counts(db_engine)
    too_big = b"x" * (service_settings.max_upload_bytes + 2 * 1024 * 1024)
    resp = api_client.post("/datasets", headers=headers(tenant.admin), files={"file": ("big.jsonl", too_big)})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_large"
    assert row_counts(db_engine) == before


def test_file_names_cannot_steer_storage(api_client, tenant, service_settings):
    body = upload_dataset(
        api_client, tenant.admin, content=jsonl(qa_rows(1)), filename="../../../etc/passwd.jsonl"
    )
    assert body["name"] == "passwd.jsonl"
    root = service_settings.resolved_storage_root()
    assert all(p.resolve().is_relative_to(root) for p in root.rglob("*"))


def test_upload_needs_submit_scope(api_client, tenant, make_key, db_engine):
    read_only = make_key(tenant.name, ["read"])
    before = row_counts(db_engine)
    resp = api_client.post(
        "/datasets", headers=headers(read_only), files={"file": ("a.jsonl", jsonl(qa_rows(1)))}
    )
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "insufficient_scope"
    resp = api_client.post("/datasets", files={"file": ("a.jsonl", jsonl(qa_rows(1)))})
    assert resp.status_code == 401
    assert row_counts(db_engine) == before


def test_oversized_chunked_body_is_refused_while_streaming(api_client, tenant, service_settings, db_engine):
    import uuid

    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()

    def body():  # no Content-Length: the limit must hold while the body streams in
        yield head
        for _ in range((service_settings.max_upload_bytes + 2 * 1024 * 1024) // 65536 + 1):
            yield b"x" * 65536
        yield f"\r\n--{boundary}--\r\n".encode()

    before = row_counts(db_engine)
    resp = api_client.post(
        "/datasets",
        headers=headers(tenant.admin, **{"Content-Type": f"multipart/form-data; boundary={boundary}"}),
        content=body(),
    )
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "too_large"
    assert row_counts(db_engine) == before
