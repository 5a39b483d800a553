"""API keys: the last admin key cannot be revoked, the bootstrap key comes back on start, revocation is
immediate."""

from __future__ import annotations

import logging

import pytest

from tests.fixtures_services import ADMIN_SECRET, headers

pytestmark = pytest.mark.services


def _me(client, key: str) -> dict:
    resp = client.get("/me", headers=headers(key))
    assert resp.status_code == 200, resp.text
    return resp.json()


def _revoke(client, by: str, key_id: str):
    return client.post(f"/api-keys/{key_id}/revoke", headers=headers(by))


def test_the_last_active_admin_key_cannot_be_revoked(api_client, tenant, make_key):
    first = _me(api_client, tenant.admin)
    resp = _revoke(api_client, tenant.admin, first["id"])
    assert resp.status_code == 409, resp.text
    error = resp.json()["error"]
    assert error["code"] == "last_admin_key" and "last active admin key" in error["message"]
    assert _me(api_client, tenant.admin)["revoked_at"] is None

    reader = make_key(tenant.name, ["read", "submit"])
    assert _revoke(api_client, tenant.admin, _me(api_client, reader)["id"]).status_code == 200

    second = make_key(tenant.name, ["admin"])
    assert _revoke(api_client, second, first["id"]).status_code == 200  # another admin remains
    assert api_client.get("/me", headers=headers(tenant.admin)).status_code == 401  # at once
    resp = _revoke(api_client, second, _me(api_client, second)["id"])
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "last_admin_key"


def test_revoked_bootstrap_key_is_reactivated_on_start(api_client, service_settings, caplog):
    from blade_service.api.main import create_app

    bootstrap = _me(api_client, ADMIN_SECRET)
    spare = api_client.post(
        "/api-keys", headers=headers(ADMIN_SECRET), json={"name": "spare admin", "scopes": ["admin"]}
    ).json()["key"]
    assert _revoke(api_client, spare, bootstrap["id"]).status_code == 200
    assert api_client.get("/me", headers=headers(ADMIN_SECRET)).status_code == 401

    with caplog.at_level(logging.WARNING, logger="blade.auth"):
        create_app(service_settings, migrate=False)  # a restart with BLADE_BOOTSTRAP_ADMIN_KEY set
    assert any("ACTIVE again" in r.getMessage() and bootstrap["id"] in r.getMessage() for r in caplog.records)
    again = _me(api_client, ADMIN_SECRET)
    assert again["id"] == bootstrap["id"] and again["revoked_at"] is None and again["scopes"] == ["admin"]
    audit = api_client.get(f"/audit-log?subject_id={bootstrap['id']}", headers=headers(ADMIN_SECRET)).json()
    audit = audit["items"] if isinstance(audit, dict) else audit  # a cursor page or a plain list
    assert [e["action"] for e in audit][:2] == ["api_key.reactivate", "api_key.revoke"]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="blade.auth"):
        create_app(service_settings, migrate=False)  # nothing to do when it is live
    assert not [r for r in caplog.records if "ACTIVE again" in r.getMessage()]
    assert _revoke(api_client, ADMIN_SECRET, _me(api_client, spare)["id"]).status_code == 200
