"""Hostile input never gets a 5xx: unstorable characters, out-of-range integers, empty and absurdly nested
documents get a 4xx naming the field (or the file and line), on the real PostgreSQL."""

from __future__ import annotations

import json
import re

import pytest

from tests.fixtures_services import headers, row_counts

pytestmark = pytest.mark.services

NUL, SURROGATE = "a\x00b", "a\ud800b"
TOO_BIG = 2**63  # one past BIGINT


def _error(resp, status: int = 422) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text)
    return resp.json()["error"]


def _raw_json(client, method: str, path: str, key: str, body: str, **extra: str):
    """Send `body` verbatim (so it can carry escapes such as \\ud800 that httpx would not encode)."""
    return client.request(
        method,
        path,
        content=body.encode(),
        headers=headers(key, **{"Content-Type": "application/json", **extra}),
    )


@pytest.mark.parametrize("bad", [NUL, SURROGATE], ids=["nul", "surrogate"])
def test_unstorable_characters_in_body_fields_are_422_naming_the_field(api_client, ready, bad, db_engine):
    key = ready.tenant.admin
    cases = [
        ("POST", "/unlearn-requests", ready.body(base_model=bad), "base_model"),
        ("POST", "/unlearn-requests", ready.body(forget_dataset=bad), "forget_dataset"),
        ("POST", "/unlearn-requests", ready.body(method=bad), "method"),
        ("POST", "/unlearn-requests", ready.body(metadata={"note": bad}), "metadata"),
        ("POST", "/unlearn-requests", ready.body(metadata={bad: 1}), "metadata"),
        ("POST", "/unlearn-requests", ready.body(params={"tau": [bad]}), "params"),
        ("POST", "/base-models", {"name": bad, "source": "/m"}, "name"),
        ("POST", "/base-models", {"name": "ok-name", "source": bad}, "source"),
        ("POST", "/base-models", {"name": "ok-name", "source": "/m", "description": bad}, "description"),
        ("POST", "/api-keys", {"name": bad, "scopes": ["read"]}, "name"),
        ("POST", "/api-keys", {"name": "k", "scopes": [bad]}, "scopes.0"),
        ("POST", "/api-keys", {"name": "k", "scopes": ["read"], "tenant": bad}, "tenant"),
        ("POST", "/adapters/ad_missing/disable", {"reason": bad}, "reason"),
        ("POST", "/adapters/ad_missing/enable", {"reason": bad}, "reason"),
        ("POST", "/unlearn-requests/req_missing/cancel", {"reason": bad}, "reason"),
        ("POST", f"/base-models/{ready.base_model}/generate", {"prompt": bad}, "prompt"),
        ("POST", f"/base-models/{ready.base_model}/generate", {"question": bad}, "question"),
    ]
    before = row_counts(db_engine)
    for method, path, body, field in cases:
        # json.dumps escapes NUL as \u0000 and a lone surrogate as \ud800: what a hostile client sends
        error = _error(_raw_json(api_client, method, path, key, json.dumps(body)))
        named = error["field"] == field or error["field"].startswith(field + ".")  # metadata.note: deeper
        assert named and error["field"] in error["message"], (path, field, error)
    assert row_counts(db_engine) == before


@pytest.mark.parametrize("bad", ["a%00b", "%00", "a%ED%A0%80b"], ids=["nul", "only-nul", "bad-utf8"])
def test_unstorable_path_ids_are_4xx(api_client, tenant, bad):
    for path in (
        f"/datasets/{bad}",
        f"/unlearn-requests/{bad}",
        f"/unlearn-requests/{bad}/events",
        f"/unlearn-requests/{bad}/metrics",
        f"/adapters/{bad}",
        f"/adapters/{bad}/download",
        f"/base-models/{bad}",
        f"/base-models/{bad}/adapters",
    ):
        resp = api_client.get(path, headers=headers(tenant.admin))
        assert resp.status_code in (404, 422), (path, resp.status_code, resp.text)
        if resp.status_code == 422:
            assert resp.json()["error"]["field"] in ("dataset_id", "request_id", "adapter_id", "name")
    error = _error(api_client.get("/datasets/a%00b", headers=headers(tenant.admin)))
    assert error["field"] == "dataset_id" and "NUL" in error["message"]


def _get_routes_with(spec: dict, predicate) -> list[tuple[str, str]]:
    """(path, query parameter name) of every GET operation without path parameters, by the predicate."""
    found = []
    for path, item in spec["paths"].items():
        op = item.get("get")
        if not op or "{" in path:
            continue
        for param in op.get("parameters", []):
            if param["in"] == "query" and predicate(param.get("schema", {})):
                found.append((path, param["name"]))
    return found


def _types(schema: dict) -> set[str]:
    options = schema.get("anyOf", [schema])
    return {o.get("type") for o in options}


def test_every_string_query_parameter_refuses_nul(api_client, admin_key):
    spec = api_client.get("/openapi.json").json()
    strings = _get_routes_with(spec, lambda s: "string" in _types(s) and "enum" not in s)
    assert ("/audit-log", "action") in strings
    for path, name in strings:
        error = _error(api_client.get(path, params={name: NUL}, headers=headers(admin_key)))
        assert error["field"] == name and "NUL" in error["message"], (path, name, error)


def test_integer_query_parameters_beyond_int64_are_422(api_client, admin_key):
    spec = api_client.get("/openapi.json").json()
    integers = _get_routes_with(spec, lambda s: "integer" in _types(s))
    assert ("/audit-log", "before_id") in integers
    for path, name in integers:
        for value in (TOO_BIG, -(2**63) - 1, 10**30):
            error = _error(api_client.get(path, params={name: str(value)}, headers=headers(admin_key)))
            assert error["field"] == name, (path, name, value, error)
    # the issue's own examples, where those parameters exist
    for path, name in (("/datasets", "offset"), ("/audit-log", "before_id")):
        if (path, name) in integers:
            _error(api_client.get(f"{path}?{name}=9223372036854775808", headers=headers(admin_key)))
    ok = api_client.get(f"/audit-log?before_id={2**63 - 1}", headers=headers(admin_key))
    assert ok.status_code == 200, ok.text


def test_events_after_step_beyond_int64_is_422(api_client, ready):
    key = ready.tenant.admin
    request_id = api_client.post("/unlearn-requests", headers=headers(key), json=ready.body()).json()["id"]
    error = _error(
        api_client.get(f"/unlearn-requests/{request_id}/events?after_step={TOO_BIG}", headers=headers(key))
    )
    assert error["field"] == "after_step"


def _upload(client, key: str, filename: str, content: bytes):
    return client.post(
        "/datasets", headers=headers(key), files={"file": (filename, content, "application/json")}
    )


def test_empty_array_upload_is_422_naming_the_file(api_client, tenant):
    error = _error(_upload(api_client, tenant.admin, "empty.json", b"[]"))
    assert "empty.json" in error["message"] and "no rows" in error["message"]
    error = _error(_upload(api_client, tenant.admin, "empty.jsonl", b"[]\n[]\n"))
    assert "empty.jsonl" in error["message"]


@pytest.mark.parametrize(
    ("filename", "content", "line"),
    [
        ("deep.json", b"[" * 100_000 + b"]" * 100_000, 1),
        ("deep-lines.json", b"[\n" + b"[" * 100_000 + b"]" * 100_001, 2),
        ("deep.jsonl", b'{"question": "q", "answer": "a"}\n' + b"[" * 100_000 + b"]" * 100_000, 2),
        ("deep-object.jsonl", b'{"question": "q", "answer": "a"}\n' + b'{"x":' * 50_000, 2),
    ],
)
def test_pathologically_nested_json_is_422_naming_file_and_line(api_client, tenant, filename, content, line):
    error = _error(_upload(api_client, tenant.admin, filename, content))
    assert error["code"] == "invalid_dataset", error
    assert f"{filename}, line {line}:" in error["message"] and "nested too deeply" in error["message"]


def test_forged_cursors_carrying_unstorable_values_are_422(api_client, admin_key):
    import base64

    def cursor(values: list) -> str:
        return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")

    spec = api_client.get("/openapi.json").json()
    lists = [path for path, name in _get_routes_with(spec, lambda s: True) if name == "cursor"]
    assert "/audit-log" in lists and "/datasets" in lists
    forged = [[NUL], [TOO_BIG], ["2026-01-01T00:00:00+00:00", NUL], [TOO_BIG, NUL], [-(2**63) - 1]]
    for path in lists:
        for values in forged:
            resp = api_client.get(path, params={"cursor": cursor(values)}, headers=headers(admin_key))
            assert _error(resp)["field"] == "cursor", (path, values)


def test_idempotency_key_header_with_nul_is_422(api_client, ready, db_engine):
    before = row_counts(db_engine)
    resp = api_client.post(
        "/unlearn-requests",
        headers=headers(ready.tenant.admin, **{"Idempotency-Key": "retry\x00-1"}),
        json=ready.body(),
    )
    error = _error(resp)
    assert error["field"] == "Idempotency-Key" and "NUL" in error["message"]
    assert row_counts(db_engine) == before


def test_every_string_field_of_every_json_body_refuses_nul(api_client, admin_key, db_engine):
    """The app-wide body check covers every operation, including ones whose schemas use plain `str`."""
    from tests.test_api_authz import _minimal_body

    spec = api_client.get("/openapi.json").json()
    before = row_counts(db_engine)
    checked = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            body = _minimal_body(spec, op)
            if body is None:
                continue
            ref = op["requestBody"]["content"]["application/json"]["schema"]
            ref = next((s for s in ref.get("anyOf", [ref]) if "$ref" in s), ref)
            model = spec["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]
            for name, prop in model.get("properties", {}).items():
                kinds = {o.get("type") for o in prop.get("anyOf", [prop])}
                if "string" not in kinds or "enum" in prop or "format" in prop:
                    continue
                url = re.sub(r"\{[^}]+\}", "x", path)
                resp = api_client.request(
                    method.upper(), url, headers=headers(admin_key), json={**body, name: NUL}
                )
                error = _error(resp)
                assert error["field"] == name and "NUL" in error["message"], (method, path, name, error)
                checked.append(f"{method} {path} {name}")
    assert len(checked) >= 15, checked
    assert row_counts(db_engine) == before


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_in_a_json_body_are_422_naming_the_field(api_client, ready, number, db_engine):
    body = json.dumps(ready.body(metadata={"note": "__N__"})).replace('"__N__"', number)
    before = row_counts(db_engine)
    error = _error(_raw_json(api_client, "POST", "/unlearn-requests", ready.tenant.admin, body))
    assert error["field"] == "metadata.note" and "finite" in error["message"], error
    assert row_counts(db_engine) == before


HUGE = 10**400  # a valid JSON number that float() cannot hold (OverflowError)


def test_integers_beyond_a_float_are_422_naming_the_field(api_client, ready, admin_key, db_engine):
    tenant, operator = ready.tenant.admin, admin_key  # a model directory is the operator's to register
    cases = [
        (tenant, "POST", "/unlearn-requests", ready.body(params={"max_steps": HUGE}), "params.max_steps"),
        (tenant, "POST", "/unlearn-requests", ready.body(params={"tau": -HUGE}), "params.tau"),
        (
            operator,
            "POST",
            "/base-models",
            {"name": "bm-huge", "source": "/m", "policy": {"max_forget_prob": HUGE}},
            "policy.max_forget_prob",
        ),
        (
            tenant,
            "PUT",
            f"/base-models/{ready.base_model}/policy",
            {"reason": "r", "policy": {"min_retain_prob_ratio": HUGE}},
            "policy.min_retain_prob_ratio",
        ),
    ]
    before = row_counts(db_engine)
    for key, method, path, body, field in cases:
        error = _error(api_client.request(method, path, headers=headers(key), json=body))
        assert error["field"] == field and len(error["message"]) < 500, (path, error)
    assert row_counts(db_engine) == before


@pytest.mark.parametrize("content_type", ["application/JSON", "Application/Json; charset=UTF-8", None])
def test_the_body_check_reads_every_body_fastapi_reads_as_json(api_client, ready, content_type, db_engine):
    """FastAPI parses `application/JSON` (any case) and a body without Content-Type as JSON, so the check
    must too: fields typed plain `str` or `dict` would otherwise reach the database with a lone surrogate."""
    cases = [
        (
            "POST",
            "/base-models",
            {"name": "bm-s", "source": "/m", "canary_dataset": SURROGATE},
            "canary_dataset",
        ),
        (
            "PUT",
            f"/base-models/{ready.base_model}/policy",
            {"reason": "r", "canary_dataset": SURROGATE},
            "canary_dataset",
        ),
        (
            "PUT",
            f"/base-models/{ready.base_model}/policy",
            {"reason": "r", "policy": {SURROGATE: 1}},
            "policy",
        ),
    ]
    extra = {"Content-Type": content_type} if content_type else {}
    before = row_counts(db_engine)
    for method, path, body, field in cases:
        request = api_client.build_request(
            method, path, content=json.dumps(body).encode(), headers=headers(ready.tenant.admin, **extra)
        )
        assert request.headers.get("Content-Type") == content_type
        resp = api_client.send(request)
        assert resp.status_code < 500, (content_type, path, resp.status_code, resp.text)
        if resp.status_code == 422:  # FastAPI (strict) may refuse an untyped body before reading it
            assert resp.json()["error"]["field"].startswith(field), (path, resp.text)
    assert row_counts(db_engine) == before


def test_an_error_quoting_a_lone_surrogate_is_sent_escaped(api_client, ready):
    """A 422 that quotes the refused input (an unknown policy rule) holds a lone surrogate: the error
    body is ASCII JSON with the escape, not a 500 from encoding it."""
    from blade_service.persistence import policy
    from blade_service.persistence.errors import Invalid

    with pytest.raises(Invalid) as caught:
        policy.parse({SURROGATE: 1})
    from blade_service.api.main import error_response

    response = error_response(422, "invalid", caught.value.message, caught.value.field)
    assert json.loads(response.body)["error"]["message"] == caught.value.message
    assert response.body.isascii()


@pytest.mark.parametrize(
    "values",
    [
        ["2026-01-01T00:00:00", "x"],  # no time zone
        ["2026-01-01", "x"],  # a date
        ["0001-01-01T00:00:00+01:00", "x"],  # before year 1 in UTC
        ["9999-12-31T23:59:59-01:00", "x"],  # after year 9999 in UTC
    ],
    ids=["naive", "date", "underflow", "overflow"],
)
def test_forged_cursor_times_are_422(api_client, admin_key, values):
    import base64

    cursor = base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")
    for path in ("/api-keys", "/webhooks", "/datasets", "/unlearn-requests", "/audit-log", "/base-models"):
        resp = api_client.get(path, params={"cursor": cursor}, headers=headers(admin_key))
        assert resp.status_code in (200, 422), (path, values, resp.status_code, resp.text)
        if resp.status_code == 422:
            assert resp.json()["error"]["field"] == "cursor"


@pytest.mark.parametrize(
    ("filename", "content", "line"),
    [
        (
            "big.jsonl",
            b'{"question": "q", "answer": "a"}\n{"question": "q", "answer": "a", "x": '
            + b"9" * 5000
            + b"}\n",
            2,
        ),
        (
            "big.json",
            b'[\n{"question": "q", "answer": "a"},\n{"question": "q", "answer": "a", "x": '
            + b"9" * 5000
            + b"}\n]",
            3,
        ),
    ],
)
def test_an_integer_of_thousands_of_digits_in_an_upload_is_422_naming_file_and_line(
    api_client, tenant, filename, content, line
):
    error = _error(_upload(api_client, tenant.admin, filename, content))
    assert error["code"] == "invalid_dataset", error
    assert f"{filename}, line {line}:" in error["message"] and "digits" in error["message"], error


def test_a_lone_surrogate_in_a_row_is_422_naming_file_line_and_field(api_client, tenant):
    content = b'{"question": "q", "answer": "a"}\n{"question": "q\\ud800", "answer": "a"}\n'
    error = _error(_upload(api_client, tenant.admin, "s.jsonl", content))
    assert "s.jsonl, line 2: field 'question':" in error["message"] and "surrogate" in error["message"]


def test_a_name_with_a_trailing_newline_is_refused(api_client, admin_key):
    error = _error(
        api_client.post("/base-models", headers=headers(admin_key), json={"name": "bm-nl\n", "source": "/m"})
    )
    assert error["field"] == "name", error


def test_json_nested_deeper_than_the_limit_is_422_and_nothing_is_stored(api_client, ready, db_engine):
    """300 levels of `metadata` fit its 16 KB, but could not be serialised back: the request was stored and
    every later read of it, and of its tenant's request list, was a 500."""
    from blade_service.api.input_guard import MAX_JSON_DEPTH

    before = row_counts(db_engine)
    deep = "[" * 300 + "]" * 300
    body = json.dumps(ready.body(metadata={"x": "__D__"})).replace('"__D__"', deep)
    error = _error(_raw_json(api_client, "POST", "/unlearn-requests", ready.tenant.admin, body))
    assert error["field"].startswith("metadata.x") and f"deeper than {MAX_JSON_DEPTH}" in error["message"]
    assert row_counts(db_engine) == before
    ok = json.dumps(ready.body(metadata={"x": "__D__"})).replace('"__D__"', "[" * 20 + "]" * 20)
    assert _raw_json(api_client, "POST", "/unlearn-requests", ready.tenant.admin, ok).status_code == 202
    assert api_client.get("/unlearn-requests", headers=headers(ready.tenant.admin)).status_code == 200


def test_a_json_body_over_its_limit_is_413_and_a_422_names_at_most_twenty_faults(api_client, admin_key):
    from blade_service.api.main import MAX_DETAILS, MAX_JSON_BODY_BYTES

    huge = json.dumps({f"k{i}": 1 for i in range(MAX_JSON_BODY_BYTES // 8)})
    assert len(huge) > MAX_JSON_BODY_BYTES
    resp = _raw_json(api_client, "POST", "/api-keys", admin_key, huge)
    assert _error(resp, 413)["code"] == "too_large"
    many = {"name": "k", "scopes": ["read"], **{f"extra{i}": 1 for i in range(100)}}
    resp = api_client.post("/api-keys", headers=headers(admin_key), json=many)
    body = resp.json()["error"]
    assert resp.status_code == 422 and len(body["details"]) == MAX_DETAILS
    assert body["more_details"] == 100 - MAX_DETAILS, body


def test_past_the_bound_on_calls_waiting_for_a_worker_the_next_is_429_at_once(api_client, ready):
    """No worker answers here: were the bound's slots free, the call would wait `generate_timeout_s`."""
    from blade_service.api import worker_waits

    held = 0
    try:
        while worker_waits._slots.acquire(blocking=False):  # what MAX_WAITING waiting calls hold
            held += 1
        assert held == worker_waits.MAX_WAITING
        for path, kwargs in (
            (f"/base-models/{ready.base_model}/generate", {"json": {"prompt": "hi"}}),
            (f"/base-models/{ready.base_model}/export", {}),
        ):
            method = "POST" if kwargs else "GET"
            resp = api_client.request(method, path, headers=headers(ready.tenant.admin), **kwargs)
            assert resp.status_code == 429 and resp.headers["Retry-After"] == str(worker_waits.RETRY_AFTER_S)
            assert resp.json()["error"]["code"] == "too_many_waiting", resp.text
    finally:
        for _ in range(held):
            worker_waits._slots.release()


def test_validation_messages_name_the_field_in_words(api_client, ready):
    """A string's length in characters (pydantic says "items" for a constrained annotated str), one line for
    a union's members under the field's own name (not "cascade.bool"), and a body that is not JSON is the
    body's fault."""
    admin = headers(ready.tenant.admin)
    resp = api_client.post(f"/base-models/{ready.base_model}/generate", headers=admin, json={"prompt": ""})
    error = resp.json()["error"]
    assert resp.status_code == 422 and error["field"] == "prompt"
    assert error["message"] == "prompt: must be at least 1 character long, not 0"
    resp = api_client.post("/adapters/ad_x/disable", headers=admin, json={"reason": "r", "cascade": "bogus"})
    error = resp.json()["error"]
    assert resp.status_code == 422 and error["field"] == "cascade" and len(error["details"]) == 1
    assert "valid boolean" in error["message"] and "'retrain'" in error["message"]
    resp = api_client.post(
        "/unlearn-requests", headers={**admin, "Content-Type": "application/json"}, content=b"x"
    )
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "body"
