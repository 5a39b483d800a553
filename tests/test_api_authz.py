"""Object-level authorisation (OWASP API1) on a shared base model: tenant A never sees tenant B's adapters,
requests, datasets or certificates; the stack shows B's versions only as "exists"; the operator sees all."""

from __future__ import annotations

import uuid

import pytest

from tests.fixtures_services import Ready, TestTenant, headers, qa_rows, register_model, upload_dataset
from tests.test_api_adapters import succeed_with_adapter

pytestmark = pytest.mark.services

SECRET_FIELDS = ("id", "request_id", "sha256", "forget_sha256", "retain_sha256", "parent_stack", "method")


@pytest.fixture
def shared(api_client, api_app, make_key, tmp_path):
    """A shared base model with adapters v1 (tenant A), v2 (tenant B, trained on v1), v3 (A, on v1 and v2)."""
    a = TestTenant(f"ta-{uuid.uuid4().hex[:8]}", "")
    a.admin = make_key(a.name, ["admin"])
    b = TestTenant(f"tb-{uuid.uuid4().hex[:8]}", "")
    b.admin = make_key(b.name, ["admin"])
    model = register_model(api_client, a.admin, shared=True)

    def ready(t: TestTenant) -> Ready:
        forget = upload_dataset(api_client, t.admin, qa_rows(3, f"forget-{t.name}"))["id"]
        retain = upload_dataset(api_client, t.admin, qa_rows(3, "retain"))["id"]
        return Ready(t, model, forget, retain)

    ra, rb = ready(a), ready(b)
    ids = {
        "a1": succeed_with_adapter(api_client, api_app, ra, tmp_path),
        "b2": succeed_with_adapter(api_client, api_app, rb, tmp_path),
        "a3": succeed_with_adapter(api_client, api_app, ra, tmp_path),
    }
    return {"a": a, "b": b, "ra": ra, "rb": rb, "model": model, "ids": ids}


def _items(resp) -> list[dict]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["items"] if isinstance(body, dict) else body


def test_another_tenants_adapter_is_404_for_get_download_disable_enable(api_client, shared, make_key):
    b_reader = headers(make_key(shared["b"].name, ["read"]))
    b_admin = headers(shared["b"].admin)
    for adapter in (shared["ids"]["a1"], shared["ids"]["a3"]):
        for resp in (
            api_client.get(f"/adapters/{adapter}", headers=b_reader),
            api_client.get(f"/adapters/{adapter}/download", headers=b_reader),
            api_client.post(f"/adapters/{adapter}/disable", headers=b_admin, json={"reason": "x"}),
            api_client.post(f"/adapters/{adapter}/enable", headers=b_admin, json={"reason": "x"}),
        ):
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", resp.text
    own = api_client.get(f"/adapters/{shared['ids']['b2']}", headers=b_reader)
    assert own.status_code == 200 and own.json()["request_id"]
    assert api_client.get(f"/adapters/{shared['ids']['b2']}/download", headers=b_reader).status_code == 200


def test_the_stack_shows_other_tenants_versions_only_as_existing(api_client, shared):
    b = headers(shared["b"].admin)
    items = _items(api_client.get(f"/base-models/{shared['model']}/adapters", headers=b))
    assert [i["version"] for i in items] == [1, 2, 3]
    theirs = [i for i in items if i["version"] in (1, 3)]
    for item in theirs:
        assert set(item) == {"version", "state", "other_tenant"} and item["other_tenant"] is True
    mine = items[1]
    assert mine["id"] == shared["ids"]["b2"] and mine["forget_sha256"]
    assert mine["parent_stack"] == ["other-tenant:v1"]  # A's id never shows, even as B's parent
    text = str(items)
    for secret in (shared["ids"]["a1"], shared["ids"]["a3"]):
        assert secret not in text


def test_rollback_reports_and_cascades_only_what_the_tenant_may_see(api_client, shared):
    a = headers(shared["a"].admin)
    resp = api_client.post(
        f"/adapters/{shared['ids']['a1']}/disable", headers=a, json={"reason": "wrong", "cascade": True}
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["cascaded"] == [shared["ids"]["a3"]]  # B's v2 is not A's to disable
    flagged = {f["version"]: f for f in body["flagged"]}
    assert set(flagged[2]) == {"version", "state", "other_tenant"} and flagged[2]["state"] == "active"
    assert shared["ids"]["b2"] not in str(body)


def test_the_operator_sees_every_tenants_adapters(api_client, shared, admin_key):
    op = headers(admin_key)
    items = _items(api_client.get(f"/base-models/{shared['model']}/adapters", headers=op))
    assert [i["id"] for i in items] == [shared["ids"][k] for k in ("a1", "b2", "a3")]
    for adapter in shared["ids"].values():
        assert api_client.get(f"/adapters/{adapter}", headers=op).status_code == 200
        assert api_client.get(f"/adapters/{adapter}/download", headers=op).status_code == 200


def test_other_tenants_requests_and_datasets_stay_hidden_on_a_shared_model(api_client, shared, make_key):
    b = headers(make_key(shared["b"].name, ["read"]))
    a_request = api_client.get(f"/adapters/{shared['ids']['a1']}", headers=headers(shared["a"].admin)).json()
    request_id = a_request["request_id"]
    for path in (
        f"/unlearn-requests/{request_id}",
        f"/unlearn-requests/{request_id}/events",
        f"/unlearn-requests/{request_id}/metrics",
        f"/datasets/{shared['ra'].forget}",
    ):
        assert api_client.get(path, headers=b).status_code == 404, path
    listed = _items(api_client.get(f"/unlearn-requests?base_model={shared['model']}", headers=b))
    assert request_id not in {r["id"] for r in listed} and len(listed) == 1
    assert shared["ra"].forget not in {d["id"] for d in _items(api_client.get("/datasets", headers=b))}
    audit = _items(api_client.get("/audit-log?limit=1000", headers=b))
    assert not {e["subject_id"] for e in audit} & set(shared["ids"].values()) - {shared["ids"]["b2"]}


def test_the_dashboard_stack_shows_other_tenants_versions_only_as_existing(api_client, shared):
    from tests.test_dashboard_pages import signed_in

    a_admin = headers(shared["a"].admin)
    a_request = api_client.get(f"/adapters/{shared['ids']['a1']}", headers=a_admin).json()
    client = signed_in(api_client, shared["b"].admin)
    try:
        page = client.get(f"/dashboard/models/{shared['model']}")
    finally:
        client.cookies.clear()
    assert page.status_code == 200
    assert shared["ids"]["b2"] in page.text and "Version 1" in page.text and "Version 3" in page.text
    for secret in (
        shared["ids"]["a1"],
        shared["ids"]["a3"],
        a_request["request_id"][:16],
        a_request["sha256"][:16],
    ):
        assert secret not in page.text
    assert page.text.count("another tenant&#39;s version") + page.text.count("another tenant's version") == 2


def test_generate_names_only_the_tenants_own_adapters_in_its_stack(api_app, shared):
    from blade_service.api.adapter_views import stack_refs
    from blade_service.persistence import registry

    with api_app.state.session_factory() as session:
        active = registry.effective_stack(session, shared["model"])
        b_tenant = active[1].request.tenant_id
        assert stack_refs(active, tenant_id=b_tenant) == [
            "other-tenant:v1",
            shared["ids"]["b2"],
            "other-tenant:v3",
        ]
        assert stack_refs(active, tenant_id=None) == [shared["ids"][k] for k in ("a1", "b2", "a3")]


def _minimal_body(spec: dict, op: dict) -> dict | None:
    """A body with every required field set to a plain valid value, from the operation's schema."""
    content = op.get("requestBody", {}).get("content", {}).get("application/json")
    if content is None:
        return None
    schema = content["schema"]
    schema = next((s for s in schema.get("anyOf", [schema]) if "$ref" in s), schema)
    if "$ref" not in schema:
        return {}
    model = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    plain = {"string": "x", "integer": 1, "number": 1.0, "boolean": False, "array": [], "object": {}}
    body = {}
    for name in model.get("required", []):
        prop = model["properties"][name]
        kind = prop.get("type") or next(
            (o.get("type") for o in prop.get("anyOf", []) if o.get("type")), "string"
        )
        body[name] = prop.get("enum", [plain[kind]])[0]
    return body


def test_every_route_with_an_object_id_is_404_for_another_tenant(
    api_client, api_app, shared, make_key, tmp_path
):
    """Tenant B (admin) against each of tenant A's objects, on every route of the document that names one."""
    a = shared["a"]
    private = Ready(a, register_model(api_client, a.admin), shared["ra"].forget, shared["ra"].retain)
    private_adapter = succeed_with_adapter(api_client, api_app, private, tmp_path)
    a_key_id = api_client.get("/me", headers=headers(make_key(a.name, ["read"]))).json()["id"]
    request_id = api_client.get(f"/adapters/{private_adapter}", headers=headers(a.admin)).json()["request_id"]
    theirs = {
        "dataset_id": shared["ra"].forget,
        "request_id": request_id,
        "adapter_id": shared["ids"]["a1"],
        "name": private.base_model,
        "key_id": a_key_id,
    }
    spec = api_client.get("/openapi.json").json()
    b = headers(shared["b"].admin)
    checked = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            names = [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]
            if not names or not all(n in theirs for n in names):
                continue  # e.g. /stack-operations/{operation_id}: no tenant object of A's to aim at
            url = path.format(**theirs)
            resp = api_client.request(method.upper(), url, headers=b, json=_minimal_body(spec, op))
            assert resp.status_code == 404, (method, url, resp.status_code, resp.text)
            leaked = [
                v for v in theirs.values() if v not in url and v in resp.text
            ]  # echoing the id asked is fine
            assert not leaked, (method, url, resp.text)
            checked.append(f"{method} {path}")
    assert len(checked) >= 15, checked
    # A's own key still sees them: the 404s above are about who asks
    assert api_client.get(f"/adapters/{private_adapter}", headers=headers(a.admin)).status_code == 200


def test_only_the_operator_exports_a_shared_models_stack(api_client, shared, admin_key):
    """The export of a shared model holds every tenant's adapter weights (and names them)."""
    for tenant in ("a", "b"):
        resp = api_client.get(f"/base-models/{shared['model']}/export", headers=headers(shared[tenant].admin))
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "shared_model_export", resp.text
        assert not set(shared["ids"].values()) & set(resp.text.split('"'))
    operator = api_client.get(f"/base-models/{shared['model']}/export", headers=headers(admin_key))
    assert operator.status_code != 403  # no worker here: it waits for one (504), it is not refused


def test_a_tenants_audit_rows_name_no_other_tenants_adapter(api_client, shared):
    """A's rows (v3 created on B's v2; the disable of v1 that flags v2) say `other-tenant:v2`."""
    a = headers(shared["a"].admin)
    resp = api_client.post(f"/adapters/{shared['ids']['a1']}/disable", headers=a, json={"reason": "r"})
    assert resp.status_code == 200, resp.text
    rows = _items(api_client.get("/audit-log?limit=1000", headers=a))
    assert shared["ids"]["b2"] not in str(rows)
    created = next(
        r for r in rows if r["action"] == "adapter.create" and r["subject_id"] == shared["ids"]["a3"]
    )
    assert created["data"]["parent_stack"] == [shared["ids"]["a1"], "other-tenant:v2"]
    disabled = next(r for r in rows if r["action"] == "adapter.disable")
    assert "other-tenant:v2" in disabled["data"]["flagged"]


def test_a_certificate_names_only_its_tenants_adapters(api_client, shared):
    b = headers(shared["b"].admin)
    request_id = api_client.get(f"/adapters/{shared['ids']['b2']}", headers=b).json()["request_id"]
    resp = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=b)
    assert resp.status_code == 200, resp.text
    cert = resp.json()
    text = str(cert)
    for secret in (shared["ids"]["a1"], shared["ids"]["a3"]):
        assert secret not in text
    model = cert["model"]
    assert model["adapter"]["trained_on"] == [{"id": "other-tenant:v1", "version": 1, "state": "active"}]
    expected = ["other-tenant:v1", shared["ids"]["b2"], "other-tenant:v3"]
    assert [part["id"] for part in model["stack"]] == expected


def test_a_compaction_on_a_shared_model_is_a_tenants_when_everything_in_it_is(
    api_client, api_app, shared, admin_key
):
    """A compaction has no request of its own: its owner saw it as another tenant's (no id, no enable)."""
    from sqlalchemy import select

    from blade_service.persistence import registry
    from blade_service.persistence.models import BaseModel

    ids = shared["ids"]
    assert (
        api_client.post(
            f"/adapters/{ids['b2']}/disable", headers=headers(admin_key), json={"reason": "out of the way"}
        ).status_code
        == 200
    )
    with api_app.state.session_factory() as s, s.begin():
        model = s.scalars(select(BaseModel).where(BaseModel.name == shared["model"])).one()
        mine = registry.create_compacted_version(
            s, base_model_id=model.id, sources=[ids["a1"], ids["a3"]], artifact_key="k", sha256="cd" * 32,
            size_bytes=1, lineage={"rank": 8}, actor="key:admin", reason="compact",
        ).id  # fmt: skip
    a, b = headers(shared["a"].admin), headers(shared["b"].admin)
    assert api_client.get(f"/adapters/{mine}", headers=a).json()["kind"] == "compaction"
    assert api_client.get(f"/adapters/{mine}", headers=b).status_code == 404
    assert api_client.get(f"/adapters/{ids['a1']}", headers=a).json()["superseded_by"] == mine
    with api_app.state.session_factory() as s, s.begin():  # and one holding B's version is nobody's but B's
        model = s.scalars(select(BaseModel).where(BaseModel.name == shared["model"])).one()
        registry.disable(s, adapter_id=mine, actor="key:admin", reason="undo", operator=True)
        for adapter_id in (ids["a1"], ids["b2"], ids["a3"]):
            registry.enable(s, adapter_id=adapter_id, actor="key:admin", reason="back", operator=True)
        mixed = registry.create_compacted_version(
            s, base_model_id=model.id, sources=[ids["a1"], ids["b2"], ids["a3"]], artifact_key="k2",
            sha256="ef" * 32, size_bytes=1, lineage={"rank": 8}, actor="key:admin", reason="compact",
        ).id  # fmt: skip
    assert api_client.get(f"/adapters/{mixed}", headers=a).status_code == 404
    assert api_client.get(f"/adapters/{mixed}", headers=b).status_code == 404
    assert api_client.get(f"/adapters/{mixed}", headers=headers(admin_key)).status_code == 200


def test_a_compaction_of_a_shared_model_is_the_operators_to_read(api_client, shared, admin_key):
    """Its record lists every tenant's versions it replaces and the canary it was checked on: a tenant
    holding its id gets a 404, as for any other tenant's object."""
    resp = api_client.post(
        f"/base-models/{shared['model']}/compact", headers=headers(admin_key), json={"reason": "tidy"}
    )
    assert resp.status_code == 202, resp.text
    op = resp.json()["id"]
    model_id = api_client.get(f"/base-models/{shared['model']}", headers=headers(admin_key)).json()["id"]
    a1 = api_client.get(f"/adapters/{shared['ids']['a1']}", headers=headers(shared["a"].admin)).json()
    assert (
        resp.json()["base_model_id"] == a1["base_model_id"] == model_id
    )  # names are per tenant: ids say which
    assert api_client.get(f"/stack-operations/{op}", headers=headers(admin_key)).status_code == 200
    for tenant in (shared["a"], shared["b"]):
        assert api_client.get(f"/stack-operations/{op}", headers=headers(tenant.admin)).status_code == 404
