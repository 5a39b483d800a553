"""Authentication, scopes and tenant isolation: another tenant's rows are a 404, never a 403."""

from __future__ import annotations

import uuid

import pytest

from tests.fixtures_services import headers, register_model, row_counts

pytestmark = pytest.mark.services


def test_requests_without_a_valid_key_are_401(api_client):
    for h in (
        {},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer blade_not_a_real_key"},
    ):
        resp = api_client.get("/unlearn-requests", headers=h)
        assert resp.status_code == 401 and resp.json()["error"]["code"] in (
            "missing_api_key",
            "invalid_api_key",
        )
        assert resp.headers["www-authenticate"] == "Bearer"


def test_scopes(api_client, tenant, make_key, ready):
    read = make_key(tenant.name, ["read"])
    submit = make_key(tenant.name, ["submit"])
    assert api_client.get("/unlearn-requests", headers=headers(read)).status_code == 200
    assert api_client.post("/unlearn-requests", headers=headers(read), json={}).status_code == 403
    assert api_client.get("/unlearn-requests", headers=headers(submit)).status_code == 403
    assert (
        api_client.post(
            "/base-models", headers=headers(submit), json={"name": "x", "source": "y"}
        ).status_code
        == 403
    )
    assert (
        api_client.post(
            "/api-keys", headers=headers(read), json={"name": "k", "scopes": ["admin"]}
        ).status_code
        == 403
    )
    me = api_client.get("/me", headers=headers(read)).json()
    assert me["tenant"] == tenant.name and me["scopes"] == ["read"] and me["prefix"] == read[:12]


def test_keys_are_stored_hashed_and_can_be_revoked(api_client, tenant, db_session):
    from sqlalchemy import select

    from blade_service.persistence.models import ApiKey

    created = api_client.post(
        "/api-keys", headers=headers(tenant.admin), json={"name": "ci", "scopes": ["read", "submit"]}
    ).json()
    secret = created["key"]
    stored = db_session.scalars(select(ApiKey).where(ApiKey.id == created["id"])).one()
    assert secret not in (stored.key_hash, stored.prefix) and len(stored.key_hash) == 64
    assert created["scopes"] == ["submit", "read"]
    assert api_client.get("/me", headers=headers(secret)).status_code == 200
    resp = api_client.post(f"/api-keys/{created['id']}/revoke", headers=headers(tenant.admin))
    assert resp.status_code == 200 and resp.json()["revoked_at"]
    assert api_client.get("/me", headers=headers(secret)).status_code == 401
    bad = api_client.post("/api-keys", headers=headers(tenant.admin), json={"name": "x", "scopes": ["root"]})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "scopes"


def test_only_the_default_tenant_makes_keys_for_others(api_client, tenant):
    resp = api_client.post(
        "/api-keys",
        headers=headers(tenant.admin),
        json={"name": "x", "scopes": ["read"], "tenant": "someone-else"},
    )
    assert resp.status_code == 403 and resp.json()["error"]["field"] == "tenant"


def test_tenant_isolation(api_client, ready, make_key, db_engine):
    mine = headers(ready.tenant.admin)
    request_id = api_client.post("/unlearn-requests", headers=mine, json=ready.body()).json()["id"]
    other = headers(make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"]))
    before = row_counts(db_engine)
    for path in (
        f"/datasets/{ready.forget}",
        f"/unlearn-requests/{request_id}",
        f"/unlearn-requests/{request_id}/events",
        f"/unlearn-requests/{request_id}/metrics",
        f"/base-models/{ready.base_model}",
        f"/base-models/{ready.base_model}/adapters",
    ):
        resp = api_client.get(path, headers=other)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", path
    assert api_client.post(f"/unlearn-requests/{request_id}/cancel", headers=other).status_code == 404
    assert api_client.get("/unlearn-requests", headers=other).json()["items"] == []
    assert api_client.get("/datasets", headers=other).json()["items"] == []
    models = api_client.get("/base-models", headers=other).json()["items"]
    assert ready.base_model not in [m["name"] for m in models]
    theirs = {e["subject_id"] for e in api_client.get("/audit-log?limit=1000", headers=other).json()["items"]}
    assert not theirs & {request_id, ready.forget, ready.retain}
    assert row_counts(db_engine) == before
    assert api_client.get(f"/unlearn-requests/{request_id}", headers=mine).json()["status"] == "queued"


def test_the_operator_sees_every_tenants_audit_entries(api_client, ready, admin_key):
    mine = headers(ready.tenant.admin)
    request_id = api_client.post("/unlearn-requests", headers=mine, json=ready.body()).json()["id"]
    for key in (mine, headers(admin_key)):
        seen = api_client.get(f"/audit-log?subject_id={request_id}", headers=key).json()["items"]
        assert [e["action"] for e in seen] == ["unlearn_request.create"]


def test_shared_base_models_are_visible_to_everyone(api_client, tenant, make_key, admin_key):
    name = register_model(api_client, tenant.admin, shared=True)
    other = headers(make_key(f"t-{uuid.uuid4().hex[:8]}", ["read"]))
    got = api_client.get(f"/base-models/{name}", headers=other)
    assert got.status_code == 200 and got.json()["shared"] is True
    again = api_client.post(
        "/base-models", headers=headers(admin_key), json={"name": name, "source": "/y", "tenant": tenant.name}
    )
    assert again.status_code == 409 and again.json()["error"]["code"] == "base_model_exists"
    bad = api_client.post("/base-models", headers=headers(admin_key), json={"name": "../etc", "source": "/y"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "name"


def test_base_model_names_are_per_tenant(api_client, tenant, make_key, admin_key):
    """Two tenants may each hold a private model of one name: neither is told the other's exists, each
    name resolves to the caller's own, and a name stays unique among what one tenant sees."""
    other = make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"])
    name = register_model(api_client, tenant.admin)
    assert register_model(api_client, other, name) == name  # no 409 that would reveal the first
    mine, theirs = (
        api_client.get(f"/base-models/{name}", headers=headers(k)).json() for k in (tenant.admin, other)
    )
    assert mine["id"] != theirs["id"] and not mine["shared"] and not theirs["shared"]
    listed = api_client.get("/base-models", headers=headers(other)).json()["items"]
    assert [m["id"] for m in listed if m["name"] == name] == [theirs["id"]]

    def register(body: dict) -> dict:
        resp = api_client.post("/base-models", headers=headers(admin_key), json={"source": "/m", **body})
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "base_model_exists", resp.text
        return resp.json()["error"]

    assert "of this tenant" in register({"name": name, "tenant": tenant.name})["message"]
    # A shared name must be free everywhere (every tenant would see it beside its own); only the operator
    # registers shared models, so only the operator hears that some tenant holds the name.
    assert "another tenant" in register({"name": name, "shared": True})["message"]
    shared = register_model(api_client, tenant.admin, shared=True)
    assert "a shared model" in register({"name": shared, "tenant": tenant.name})["message"]


def test_the_operator_names_the_tenant_whose_model_it_means(api_client, tenant, make_key, admin_key):
    """`?tenant=` on the `/base-models/{name}` routes: the operator reaches a tenant's private model (it
    could register one, then not show it); anyone else naming a tenant but its own is refused before any
    lookup, so an unknown tenant reads the same as a real one."""
    name = register_model(api_client, tenant.admin)
    op, mine = headers(admin_key), headers(tenant.admin)
    mine_id = api_client.get(f"/base-models/{name}", headers=mine).json()["id"]
    assert api_client.get(f"/base-models/{name}", headers=op).status_code == 404  # not the operator's own
    for path in ("", "/adapters", "/retention"):
        resp = api_client.get(f"/base-models/{name}{path}", headers=op, params={"tenant": tenant.name})
        assert resp.status_code == 200, (path, resp.text)
    assert (
        api_client.get(f"/base-models/{name}", headers=op, params={"tenant": tenant.name}).json()["id"]
        == mine_id
    )
    assert (
        api_client.get(f"/base-models/{name}", headers=mine, params={"tenant": tenant.name}).status_code
        == 200
    )
    for who in (tenant.name.upper(), "no-such-tenant", "default"):
        resp = api_client.get(f"/base-models/{name}", headers=mine, params={"tenant": who})
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "cross_tenant", (who, resp.text)
    resp = api_client.get(f"/base-models/{name}", headers=op, params={"tenant": "no-such-tenant"})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "tenant"
    # The list too: the operator lists a tenant's models (and the shared ones); a tenant lists only its own.
    listed = {
        m["name"]
        for m in api_client.get("/base-models", headers=op, params={"tenant": tenant.name}).json()["items"]
    }
    assert name in listed and name not in {
        m["name"] for m in api_client.get("/base-models", headers=op).json()["items"]
    }
    resp = api_client.get("/base-models", headers=mine, params={"tenant": "default"})
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "cross_tenant"
    # The operator's change is audited under the model's tenant, which sees it.
    resp = api_client.put(
        f"/base-models/{name}/policy",
        headers=op,
        params={"tenant": tenant.name},
        json={"policy": {"min_retain_prob_ratio": 0.7}, "reason": "stricter for this tenant"},
    )
    assert resp.status_code == 200, resp.text
    seen = api_client.get("/audit-log", headers=mine, params={"subject_id": mine_id}).json()["items"]
    assert [e["reason"] for e in seen if e["action"] == "base_model.policy"] == ["stricter for this tenant"]


def test_only_the_operator_registers_sources_on_the_workers_or_for_another_tenant(
    api_client, tenant, admin_key, make_key, tmp_path
):
    """A directory on the workers or a storage key names files any tenant could otherwise load (another
    tenant's model, /etc): a tenant admin registers hub ids only, and the operator registers the rest for
    it. Nothing is registered by a refused call."""
    mine = headers(tenant.admin)
    for source in ("/models/x", "../../etc", str(tmp_path), "~/models"):
        resp = api_client.post(
            "/base-models", headers=mine, json={"name": f"bm-{uuid.uuid4().hex[:8]}", "source": source}
        )
        assert resp.status_code == 403, (source, resp.text)
        assert resp.json()["error"] | {"message": ""} == {
            "code": "source_not_allowed",
            "field": "source",
            "message": "",
        }
    other = f"t-{uuid.uuid4().hex[:8]}"
    make_key(other, ["read"])
    resp = api_client.post(
        "/base-models", headers=mine, json={"name": "bm-x", "source": "org/model", "tenant": other}
    )
    assert resp.status_code == 403 and resp.json()["error"]["field"] == "tenant"
    # Nor a shared model: it would appear in every tenant's list and take its name there (and a 409 for a
    # name some tenant holds privately would tell them so).
    name = f"bm-{uuid.uuid4().hex[:8]}"
    resp = api_client.post(
        "/base-models", headers=mine, json={"name": name, "source": "org/m", "shared": True}
    )
    assert resp.status_code == 403 and resp.json()["error"]["field"] == "shared", resp.text
    assert (
        api_client.get(f"/base-models/{name}", headers=headers(make_key(other, ["read"]))).status_code == 404
    )

    def own() -> list[str]:  # the tenant's own models (other tests' shared ones are visible too)
        items = api_client.get("/base-models", headers=mine).json()["items"]
        return [m["name"] for m in items if not m["shared"]]

    assert own() == []

    name = f"bm-{uuid.uuid4().hex[:8]}"
    for body, field in (
        ({"tenant": "no-such-tenant"}, "tenant"),
        ({"tenant": tenant.name, "shared": True}, "tenant"),
    ):
        resp = api_client.post(
            "/base-models", headers=headers(admin_key), json={"name": name, "source": "/models/x", **body}
        )
        assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text
    resp = api_client.post(
        "/base-models",
        headers=headers(admin_key),
        json={"name": name, "source": "/models/x", "tenant": tenant.name},
    )
    assert resp.status_code == 201 and resp.json()["shared"] is False
    assert own() == [name]
    assert (
        api_client.get(f"/base-models/{name}", headers=headers(make_key(other, ["read"]))).status_code == 404
    )
    entry = api_client.get(f"/audit-log?subject_id={resp.json()['id']}", headers=mine).json()["items"]
    assert [e["action"] for e in entry] == ["base_model.register"]  # the tenant sees its model's registration


def test_a_new_tenant_cannot_be_named_like_another(api_client, admin_key):
    """Look-alikes of the operator's tenant would read as it in an audit log."""
    for name in ("DEFAULT", "default ", "ｄｅｆａｕｌｔ", "default\u200b", "a/b", ""):
        resp = api_client.post(
            "/api-keys", headers=headers(admin_key), json={"name": "k", "scopes": ["read"], "tenant": name}
        )
        if name == "":  # an empty tenant means the caller's own
            assert resp.status_code == 201 and resp.json()["tenant"] == "default"
            continue
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "tenant", (name, resp.text)
