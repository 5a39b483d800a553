"""The OpenAPI document passes a validator, names its operations stably, declares the bearer scheme and cursor
pages; /docs and /redoc load only assets the API serves itself."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from openapi_spec_validator import validate

from blade_service.api.main import create_app
from blade_service.persistence.settings import Settings

PUBLIC_PATHS = {"/healthz", "/readyz", "/certificate-keys"}  # answer without an API key


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> TestClient:
    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("openapi")))
    return TestClient(app)


@pytest.fixture(scope="module")
def doc(client) -> dict:
    resp = client.get("/openapi.json")
    assert resp.status_code == 200
    return resp.json()


def operations(doc: dict):
    for path, item in doc["paths"].items():
        for method, op in item.items():
            yield path, method, op


def test_document_passes_the_openapi_validator(doc):
    validate(doc)  # raises OpenAPIValidationError naming the offending part


def test_operation_ids_are_the_handlers_names(doc):
    ids = [op["operationId"] for _, _, op in operations(doc)]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for path, method, op in operations(doc):
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", op["operationId"]), (method, path, op["operationId"])
        assert not op["operationId"].endswith(f"_{method}"), (method, path)  # no FastAPI auto-ids
    by_route = {(method, path): op["operationId"] for path, method, op in operations(doc)}
    assert by_route[("get", "/unlearn-requests")] == "list_requests"
    assert by_route[("get", "/adapters/{adapter_id}/download")] == "download_adapter"
    assert by_route[("post", "/unlearn-requests/{request_id}/cancel")] == "cancel_request"


def test_bearer_scheme_on_every_operation_that_takes_a_key(doc, client):
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": doc["components"]["securitySchemes"]["bearerAuth"]["description"],
    }
    for path, method, op in operations(doc):
        if path in PUBLIC_PATHS:
            continue
        assert op.get("security") == [{"bearerAuth": []}], (method, path)
    # The scheme only documents the header: a missing key still gets the API's own 401 body.
    resp = client.get("/unlearn-requests")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "missing_api_key"


def _resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


LISTS = [
    "/unlearn-requests",
    "/unlearn-requests/{request_id}/events",
    "/datasets",
    "/base-models",
    "/base-models/{name}/adapters",
    "/audit-log",
    "/api-keys",
    "/webhooks",
    "/webhooks/{webhook_id}/deliveries",
]


@pytest.mark.parametrize("path", LISTS)
def test_every_list_is_a_cursor_page(doc, path):
    op = doc["paths"][path]["get"]
    params = {p["name"] for p in op["parameters"]}
    assert {"cursor", "limit"} <= params, params
    schema = _resolve(doc, op["responses"]["200"]["content"]["application/json"]["schema"])
    assert {"items", "has_more", "next_cursor"} <= set(schema["properties"]), schema
    assert schema["properties"]["items"]["type"] == "array"


def test_no_operation_answers_a_bare_array(doc):
    """A list added later is a page too (a generated client pages them all one way)."""
    bare = []
    for path, method, op in operations(doc):
        for status, response in op.get("responses", {}).items():
            schema = response.get("content", {}).get("application/json", {}).get("schema", {})
            if _resolve(doc, schema).get("type") == "array":
                bare.append((method, path, status))
    assert not bare, bare


def test_request_schema_carries_progress_and_queue_position(doc):
    out = doc["components"]["schemas"]["UnlearnRequestOut"]["properties"]
    assert "queue_position" in out
    progress = _resolve(doc, out["progress"])["properties"]
    assert {"step", "total_steps", "fraction", "steps_per_s", "eta_seconds", "eta"} <= set(progress)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_local_assets(client, page):
    resp = client.get(page)
    html = resp.text
    if page == "/redoc":  # its bundle's footer fetches a logo from Redocly's CDN: images only from here
        assert resp.headers["Content-Security-Policy"] == "img-src 'self' data:"
    sources = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: ?'([^']+)'", html)
    assert sources, html
    assert not [s for s in sources if re.match(r"(https?:)?//", s)], sources
    scripts = [s for s in sources if s.endswith((".js", ".css"))]
    assert scripts
    for asset in scripts:
        resp = client.get(asset)
        assert resp.status_code == 200 and len(resp.content) > 10_000, asset
