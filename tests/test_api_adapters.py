"""Adapters over HTTP: the stack, download, disable/enable/cascade (admin only), audit of every change."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

import pytest
from sqlalchemy import update

from blade_service.persistence import registry
from blade_service.persistence.models import RequestStatus, UnlearnRequest
from tests.fixtures_services import headers, row_counts

pytestmark = pytest.mark.services


def succeed_with_adapter(api_client, api_app, ready, tmp_path) -> str:
    """Submit a request and complete it as a worker would: archive stored, adapter version, succeeded."""
    request_id = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()
    ).json()["id"]
    adapter_dir = tmp_path / request_id
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text(f'{{"r": 8, "request": "{request_id}"}}')
    (adapter_dir / "adapter_model.safetensors").write_bytes(hashlib.sha256(request_id.encode()).digest() * 64)
    stored = api_app.state.storage.put_dir(f"adapters/{ready.base_model}/{request_id}.tar.gz", adapter_dir)
    with api_app.state.session_factory() as s, s.begin():
        adapter = registry.create_adapter_version(
            s,
            request=request_id,
            artifact_key=stored.key,
            sha256=stored.sha256,
            size_bytes=stored.size,
            actor="worker:w1",
        )
        s.execute(
            update(UnlearnRequest)
            .where(UnlearnRequest.id == request_id)
            .values(status=RequestStatus.SUCCEEDED)
        )
        return adapter.id


def stack(api_client, ready, key=None):
    resp = api_client.get(
        f"/base-models/{ready.base_model}/adapters", headers=headers(key or ready.tenant.admin)
    )
    assert resp.status_code == 200, resp.text
    return [(a["version"], a["state"], a["trained_on_stale"]) for a in resp.json()["items"]]


def test_stack_disable_enable_cascade(api_client, api_app, ready, tmp_path):
    h = headers(ready.tenant.admin)
    v1 = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    v2 = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    assert stack(api_client, ready) == [(1, "active", False), (2, "active", False)]
    request = api_client.get(f"/adapters/{v2}", headers=h).json()
    assert request["parent_stack"] == [v1] and request["version"] == 2
    got = api_client.get(f"/unlearn-requests/{request['request_id']}", headers=h).json()
    assert got["adapter_id"] == v2 and got["status"] == "succeeded" and got["progress"]["fraction"] == 1.0

    resp = api_client.post(f"/adapters/{v1}/disable", headers=h, json={"reason": "forget set was wrong"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["changed"] and body["adapter"]["state"] == "disabled" and body["cascaded"] == []
    assert [a["id"] for a in body["flagged"]] == [v2] and body["flagged"][0]["trained_on_stale"]
    assert body["adapter"]["state_reason"] == "forget set was wrong"
    assert stack(api_client, ready) == [(1, "disabled", False), (2, "active", True)]

    resp = api_client.post(f"/adapters/{v1}/enable", headers=h, json={"reason": "restored after review"})
    assert resp.status_code == 200 and resp.json()["adapter"]["state"] == "active"
    assert stack(api_client, ready) == [(1, "active", False), (2, "active", False)]

    resp = api_client.post(f"/adapters/{v1}/disable", headers=h, json={"reason": "for real", "cascade": True})
    assert resp.json()["cascaded"] == [v2]
    assert stack(api_client, ready) == [(1, "disabled", False), (2, "disabled", True)]

    actions = [
        (e["action"], e["subject_id"], e["reason"])
        for e in api_client.get("/audit-log?limit=5", headers=h).json()["items"][:4]
    ]
    assert actions == [
        ("adapter.disable", v2, f"cascade from {v1} (v1): for real"),
        ("adapter.disable", v1, "for real"),
        ("adapter.enable", v1, "restored after review"),
        ("adapter.disable", v1, "forget set was wrong"),
    ]
    verdict = api_client.get("/audit-log/verify", headers=h).json()
    assert verdict["intact"] is True, json.dumps(verdict)


def test_download_streams_the_stored_archive(api_client, api_app, ready, tmp_path):
    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    meta = api_client.get(f"/adapters/{adapter_id}", headers=headers(ready.tenant.admin)).json()
    resp = api_client.get(f"/adapters/{adapter_id}/download", headers=headers(ready.tenant.admin))
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/gzip"
    assert hashlib.sha256(resp.content).hexdigest() == meta["sha256"] == resp.headers["x-content-sha256"]
    with tarfile.open(fileobj=io.BytesIO(resp.content), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_rollback_needs_admin_and_a_reason(api_client, api_app, ready, tmp_path, make_key, db_engine):
    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    submitter = make_key(ready.tenant.name, ["submit", "read"])
    before = row_counts(db_engine)
    resp = api_client.post(
        f"/adapters/{adapter_id}/disable", headers=headers(submitter), json={"reason": "x"}
    )
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "insufficient_scope"
    resp = api_client.post(f"/adapters/{adapter_id}/disable", headers=headers(ready.tenant.admin), json={})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "reason"
    resp = api_client.post(
        f"/adapters/{adapter_id}/disable", headers=headers(ready.tenant.admin), json={"reason": ""}
    )
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "reason"
    assert row_counts(db_engine) == before
    assert stack(api_client, ready, submitter) == [(1, "active", False)]


def test_missing_adapter_is_404(api_client, tenant):
    h = headers(tenant.admin)
    assert api_client.get("/adapters/ad_nope", headers=h).status_code == 404
    assert api_client.get("/adapters/ad_nope/download", headers=h).status_code == 404
    assert api_client.post("/adapters/ad_nope/disable", headers=h, json={"reason": "x"}).status_code == 404
    assert api_client.get("/base-models/nope/adapters", headers=h).status_code == 404


def test_on_a_shared_model_only_the_maker_and_the_operator_roll_back(
    api_client, api_app, ready, tmp_path, make_key, admin_key
):
    import uuid

    from tests.fixtures_services import register_model

    ready.base_model = register_model(api_client, ready.tenant.admin, shared=True)
    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    stranger = headers(make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"]))
    assert api_client.get(f"/adapters/{adapter_id}", headers=stranger).status_code == 404  # not even seen
    resp = api_client.post(f"/adapters/{adapter_id}/disable", headers=stranger, json={"reason": "not mine"})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
    for key in (headers(ready.tenant.admin), headers(admin_key)):
        resp = api_client.post(f"/adapters/{adapter_id}/disable", headers=key, json={"reason": "mine"})
        assert resp.status_code == 200


def test_the_operator_retrains_any_tenants_version_as_it_disables_and_enables_it(
    api_client, api_app, ready, tmp_path, admin_key, make_key
):
    import uuid

    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    stranger = headers(make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"]))
    body = {"reason": "the operator re-runs it"}
    assert api_client.post(f"/adapters/{adapter_id}/retrain", headers=stranger, json=body).status_code == 404
    resp = api_client.post(f"/adapters/{adapter_id}/retrain", headers=headers(admin_key), json=body)
    assert resp.status_code == 202, resp.text
    assert resp.json()["status"] == "queued" and resp.json()["base_model"] == ready.base_model
