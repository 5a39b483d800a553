"""The forget data does not outlive its request (blade_service/persistence/retention.py) on the real
PostgreSQL: `DELETE /datasets/{id}` (409 while a queued or running request uses it), the automatic purge after
a success (default: at once) and after a failure (default: days later), per-model retention, what remains
(sha256, row count, the certificate), every purge audited, a purged dataset refused for a new request, and a
dataset nothing names purged days after its upload."""

from __future__ import annotations

from datetime import timedelta

import pytest

from blade_service.persistence import retention
from blade_service.persistence.models import Dataset, UnlearnRequest
from tests.fixtures_services import ADMIN_SECRET, headers, qa_rows, upload_dataset
from tests.test_certificates import run_to_success

pytestmark = pytest.mark.services


def _stored(api_app, dataset_id: str) -> bool:
    with api_app.state.session_factory() as session:
        return api_app.state.storage.exists(session.get(Dataset, dataset_id).storage_key)


def _audit(api_client, key: str, action: str) -> list[dict]:
    doc = api_client.get("/audit-log", headers=headers(key), params={"action": action}).json()
    return doc["items"] if isinstance(doc, dict) else doc


def _submit(api_client, ready) -> str:
    resp = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body())
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def test_delete_dataset_refused_while_used_then_purges_and_is_audited(api_client, api_app, ready, make_key):
    admin = headers(ready.tenant.admin)
    request_id = _submit(api_client, ready)
    for dataset_id in (ready.forget, ready.retain):
        resp = api_client.delete(f"/datasets/{dataset_id}", headers=admin)
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "dataset_in_use", resp.text
        assert request_id in resp.json()["error"]["message"]
    assert _stored(api_app, ready.forget)

    stranger = make_key("retention-stranger", ["admin"])
    assert api_client.delete(f"/datasets/{ready.forget}", headers=headers(stranger)).status_code == 404
    reader = make_key(ready.tenant.name, ["read"])
    assert api_client.delete(f"/datasets/{ready.forget}", headers=headers(reader)).status_code == 403

    resp = api_client.post(f"/unlearn-requests/{request_id}/cancel", headers=admin, json={"reason": "test"})
    assert resp.status_code in (200, 202), resp.text
    before = api_client.get(f"/datasets/{ready.forget}", headers=admin).json()
    resp = api_client.delete(f"/datasets/{ready.forget}", headers=admin)
    assert resp.status_code == 200, resp.text
    gone = resp.json()
    assert gone["purged_at"] and gone["sha256"] == before["sha256"] and gone["rows"] == before["rows"]
    assert not _stored(api_app, ready.forget)
    assert api_client.get(f"/datasets/{ready.forget}", headers=admin).json()["purged_at"] == gone["purged_at"]
    # A second delete changes nothing; the purge is audited once, with the hash and row count.
    assert api_client.delete(f"/datasets/{ready.forget}", headers=admin).status_code == 200
    entries = [
        e for e in _audit(api_client, ready.tenant.admin, "dataset.purge") if e["subject_id"] == ready.forget
    ]
    assert len(entries) == 1 and entries[0]["data"]["sha256"] == before["sha256"]

    resp = api_client.post("/unlearn-requests", headers=admin, json=ready.body())
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "dataset_purged", resp.text


def test_forget_data_is_purged_right_after_success(api_client, api_app, ready, service_settings):
    request_id = _submit(api_client, ready)
    run_to_success(api_app, request_id)
    assert _stored(api_app, ready.forget)
    cert = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(ready.tenant.admin))
    assert cert.status_code == 200

    with api_app.state.session_factory() as session:
        assert retention.purge_for_request(
            session, api_app.state.storage, request_id=request_id, settings=service_settings
        )
        session.commit()
    assert not _stored(api_app, ready.forget)
    assert _stored(api_app, ready.retain)  # only forget data goes by itself
    forget = api_client.get(f"/datasets/{ready.forget}", headers=headers(ready.tenant.admin)).json()
    assert forget["purged_at"] and len(forget["sha256"]) == 64 and forget["rows"] == 3
    # The certificate is unchanged and still names the data by hash.
    again = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(ready.tenant.admin))
    assert again.json() == cert.json() and again.json()["data"]["forget"]["sha256"] == forget["sha256"]
    entry = [
        e for e in _audit(api_client, ready.tenant.admin, "dataset.purge") if e["subject_id"] == ready.forget
    ]
    assert entry and entry[0]["actor"] == "system" and entry[0]["reason"] == "forget data retention ended"


def test_failed_request_keeps_forget_data_for_days_and_models_can_keep_it_longer(
    api_client, api_app, ready, service_settings
):
    from blade_service.persistence import jobs

    request_id = _submit(api_client, ready)
    with api_app.state.session_factory() as session, session.begin():
        jobs.claim_request(session, request_id=request_id, owner="w", lease_seconds=60)
    with api_app.state.session_factory() as session, session.begin():
        jobs.mark_failed(session, request_id=request_id, owner="w", code="boom", message="test failure")

    def purge() -> list[str]:
        with api_app.state.session_factory() as session, session.begin():
            return retention.purge_due(session, api_app.state.storage, settings=service_settings)

    assert ready.forget not in purge() and _stored(api_app, ready.forget)  # kept for a retry

    # The operator's explicit choice for this model: keep forget data 30 days after a failure.
    resp = api_client.put(
        f"/base-models/{ready.base_model}/retention",
        headers=headers(ready.tenant.admin),
        json={"success_s": None, "failure_s": 30 * 24 * 3600},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["effective_failure_s"] == 30 * 24 * 3600 and resp.json()["effective_success_s"] == 0

    def age(days: int) -> None:
        with api_app.state.session_factory() as session, session.begin():
            request = session.get(UnlearnRequest, request_id)
            request.finished_at = request.finished_at - timedelta(days=days)

    age(4)  # past the default 3 days, within the model's 30
    assert ready.forget not in purge() and _stored(api_app, ready.forget)
    age(30)
    assert ready.forget in purge() and not _stored(api_app, ready.forget)
    assert _stored(api_app, ready.retain)


def test_retention_validation_and_shared_models(api_client, ready, make_key):
    admin = headers(ready.tenant.admin)
    resp = api_client.put(
        f"/base-models/{ready.base_model}/retention", headers=admin, json={"success_s": -1, "failure_s": None}
    )
    assert resp.status_code == 422
    reader = make_key(ready.tenant.name, ["read"])
    resp = api_client.get(f"/base-models/{ready.base_model}/retention", headers=headers(reader))
    assert resp.status_code == 200 and resp.json()["success_s"] is None
    resp = api_client.put(
        f"/base-models/{ready.base_model}/retention",
        headers=headers(reader),
        json={"success_s": 60, "failure_s": 60},
    )
    assert resp.status_code == 403


def test_a_dataset_nothing_names_is_purged_days_after_its_upload(
    api_client, api_app, ready, service_settings
):
    """Forget data uploaded for a request that was never made has no request whose end purges it: it goes
    `unused_dataset_retention_s` after its upload. Whatever a request (forget, retain, probe) or a base
    model's canary names stays."""
    admin = headers(ready.tenant.admin)
    unused = upload_dataset(api_client, ready.tenant.admin, qa_rows(2, "never-used"))["id"]
    probe = upload_dataset(api_client, ready.tenant.admin, qa_rows(2, "probe"))["id"]
    canary = upload_dataset(api_client, ready.tenant.admin, qa_rows(2, "canary"))["id"]
    resp = api_client.post(
        "/unlearn-requests", headers=admin, json=ready.body(probe_datasets={"retain_qa": probe})
    )
    assert resp.status_code == 202, resp.text
    tenant = api_client.get("/me", headers=admin).json()["tenant"]
    body = {
        "name": f"canary-{unused[-8:]}",
        "source": "/models/x",
        "tenant": tenant,
        "canary_dataset": canary,
    }
    resp = api_client.post("/base-models", headers=headers(ADMIN_SECRET), json=body)
    assert resp.status_code == 201, resp.text
    everything = (unused, probe, canary, ready.forget, ready.retain)

    def purge(settings=service_settings) -> list[str]:
        with api_app.state.session_factory() as session, session.begin():
            purged = retention.purge_due(session, api_app.state.storage, settings=settings)
        return [i for i in purged if i in everything]

    def age(days: int) -> None:
        with api_app.state.session_factory() as session, session.begin():
            for dataset_id in everything:
                dataset = session.get(Dataset, dataset_id)
                dataset.created_at = dataset.created_at - timedelta(days=days)

    age(6)  # within the default 7 days
    assert purge() == [] and _stored(api_app, unused)
    age(2)
    keep = service_settings.model_copy(update={"unused_dataset_retention_s": 0})
    assert purge(keep) == [] and _stored(api_app, unused)  # 0 keeps them
    assert purge() == [unused] and not _stored(api_app, unused)
    assert all(_stored(api_app, i) for i in everything if i != unused)
    gone = api_client.get(f"/datasets/{unused}", headers=admin).json()
    assert gone["purged_at"] and gone["rows"] == 2
    assert gone["purge_reason"] == "unused: nothing named it within 7 days of its upload"
    entry = [e for e in _audit(api_client, ready.tenant.admin, "dataset.purge") if e["subject_id"] == unused]
    assert len(entry) == 1 and entry[0]["actor"] == "system"
    assert entry[0]["reason"] == "unused: nothing named it within 7 days of its upload"
    resp = api_client.post("/unlearn-requests", headers=admin, json=ready.body(forget_dataset=unused))
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "dataset_purged", resp.text
