"""Cursor pages on every list: `{items, has_more, next_cursor}`, a boundary that stays put while rows are
added in front of it, `offset` still working, and a bad cursor a 422 naming `cursor`."""

from __future__ import annotations

import pytest

from blade_service.api.pagination import decode_cursor, encode_cursor
from blade_service.persistence.errors import Invalid
from tests.fixtures_services import headers, qa_rows, register_model, upload_dataset
from tests.test_api_adapters import succeed_with_adapter

pytestmark = pytest.mark.services


def walk(api_client, key: str, path: str, limit: int, **params) -> tuple[list[dict], list[bool]]:
    """Every item of a list by following next_cursor; the has_more flag of each page."""
    items, flags, cursor = [], [], None
    while True:
        query = {"limit": limit, **params, **({"cursor": cursor} if cursor else {})}
        resp = api_client.get(path, params=query, headers=headers(key))
        assert resp.status_code == 200, resp.text
        page = resp.json()
        assert set(page) == {"items", "has_more", "next_cursor"}
        items += page["items"]
        flags.append(page["has_more"])
        assert (page["next_cursor"] is not None) == page["has_more"]
        if not page["has_more"]:
            return items, flags
        cursor = page["next_cursor"]


def test_datasets_page_by_cursor_and_by_offset(api_client, tenant):
    made = [upload_dataset(api_client, tenant.admin, qa_rows(1, f"p{i}"))["id"] for i in range(5)]
    items, flags = walk(api_client, tenant.admin, "/datasets", 2)
    assert [d["id"] for d in items] == made[::-1]  # newest first, each once
    assert flags == [True, True, False]
    by_offset = api_client.get("/datasets?limit=2&offset=3", headers=headers(tenant.admin)).json()
    assert [d["id"] for d in by_offset["items"]] == made[::-1][3:5] and by_offset["has_more"] is False


def test_a_cursor_boundary_survives_new_rows_in_front(api_client, ready):
    h = headers(ready.tenant.admin)
    made = [api_client.post("/unlearn-requests", headers=h, json=ready.body()).json()["id"] for _ in range(4)]
    first = api_client.get("/unlearn-requests?limit=2", headers=h).json()
    assert [r["id"] for r in first["items"]] == [made[3], made[2]]
    newer = api_client.post("/unlearn-requests", headers=h, json=ready.body()).json()["id"]
    rest = api_client.get("/unlearn-requests", params={"limit": 2, "cursor": first["next_cursor"]}, headers=h)
    assert [r["id"] for r in rest.json()["items"]] == [made[1], made[0]]  # no repeat of made[2]
    assert rest.json()["has_more"] is False
    everything, _ = walk(api_client, ready.tenant.admin, "/unlearn-requests", 3)
    assert [r["id"] for r in everything] == [newer, *made[::-1]]
    queued, _ = walk(api_client, ready.tenant.admin, "/unlearn-requests", 2, base_model=ready.base_model)
    assert [r["queue_position"] for r in queued] == [4, 3, 2, 1, 0]


def test_audit_log_and_keys_and_models_pages(api_client, tenant, make_key):
    for i in range(3):
        make_key(tenant.name, ["read"], name=f"k{i}")
        register_model(api_client, tenant.admin, f"{tenant.name}-m{i}")
    keys, flags = walk(api_client, tenant.admin, "/api-keys", 2)
    assert len(keys) == 4 and len({k["id"] for k in keys}) == 4 and flags == [True, False]
    assert [k["created_at"] for k in keys] == sorted(k["created_at"] for k in keys)
    models, _ = walk(api_client, tenant.admin, "/base-models", 1)
    mine = [m["name"] for m in models if m["name"].startswith(tenant.name)]
    assert mine == [f"{tenant.name}-m{i}" for i in range(3)]
    entries, _ = walk(api_client, tenant.admin, "/audit-log", 2)
    ids = [e["id"] for e in entries]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == len(ids) >= 6


def test_adapter_stack_pages_in_version_order(api_client, api_app, ready, tmp_path):
    made = [succeed_with_adapter(api_client, api_app, ready, tmp_path) for _ in range(3)]
    stack, flags = walk(api_client, ready.tenant.admin, f"/base-models/{ready.base_model}/adapters", 2)
    assert [a["id"] for a in stack] == made and [a["version"] for a in stack] == [1, 2, 3]
    assert flags == [True, False]


@pytest.mark.parametrize(
    "path", ["/unlearn-requests", "/datasets", "/audit-log", "/base-models", "/api-keys"]
)
@pytest.mark.parametrize("cursor", ["not-a-cursor", encode_cursor(["x", "y", "z"]), encode_cursor([1.5])])
def test_a_bad_cursor_is_a_422_naming_it(api_client, tenant, path, cursor):
    resp = api_client.get(path, params={"cursor": cursor}, headers=headers(tenant.admin))
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["field"] == "cursor" and resp.json()["error"]["code"] == "invalid_cursor"


def test_cursor_round_trip():
    from datetime import UTC, datetime

    at = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    assert decode_cursor(encode_cursor([at, "req_1"]), "iso,str") == [at, "req_1"]
    assert decode_cursor(encode_cursor([7]), "int") == [7]
    assert decode_cursor(None, "int") is None
    with pytest.raises(Invalid):
        decode_cursor(encode_cursor([True]), "int")


def test_a_list_that_pages_by_cursor_only_refuses_an_offset(api_client, ready):
    """The audit log, a request's events and a webhook's deliveries ignored `offset` and served the first page
    again: now a 422 naming it, which says what to pass instead."""
    admin = headers(ready.tenant.admin)
    rid = api_client.post("/unlearn-requests", headers=admin, json=ready.body()).json()["id"]
    hook = api_client.post("/webhooks", headers=admin, json={"url": "https://hooks.example.com/x"}).json()[
        "id"
    ]
    for path in ("/audit-log", f"/unlearn-requests/{rid}/events", f"/webhooks/{hook}/deliveries"):
        resp = api_client.get(path, headers=admin, params={"offset": 5})
        error = resp.json()["error"]
        assert resp.status_code == 422 and error["field"] == "offset" and "next_cursor" in error["message"], (
            path
        )
        assert api_client.get(path, headers=admin).status_code == 200, path
