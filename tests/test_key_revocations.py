"""A key revoked by another API process leaves this process's key cache at once (LISTEN/NOTIFY), and the cache
is off whenever the listener is not listening."""

from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from blade_service.persistence import key_revocations
from blade_service.persistence.auth import KeyCache, hash_key
from blade_service.persistence.models import ApiKey, utcnow
from tests.fixtures_services import headers
from tests.fixtures_worker import wait_until

pytestmark = pytest.mark.services


def test_a_key_revoked_by_another_process_leaves_the_cache(api_client, api_app, tenant, make_key, db_engine):
    cache = api_app.state.key_cache
    cache.ttl_s = 3600.0  # without the notice, the key would stay cached for an hour
    reader = make_key(tenant.name, ["read"])
    assert api_client.get("/me", headers=headers(reader)).status_code == 200
    assert cache.get(hash_key(reader)) is not None
    # What another API process's revoke_key commits: the row and the notice, none of this process's hooks.
    with Session(db_engine) as session, session.begin():
        key = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(reader))).one()
        key.revoked_at = utcnow()
        key_revocations.notify_revoked(session, key.id)
    wait_until(lambda: cache.get(hash_key(reader)) is None, timeout=10, what="the notice to drop the key")
    resp = api_client.get("/me", headers=headers(reader))
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_without_a_listener_the_cache_is_off():
    cache = KeyCache(ttl_s=3600.0)
    seen: list[bool] = []
    listener = key_revocations.RevocationListener(
        "postgresql://postgres@127.0.0.1:1/none",  # nothing listens there: the listener never connects
        on_revoked=cache.drop,
        set_enabled=lambda on: (seen.append(on), cache.set_enabled(on)),
    ).start()
    try:
        assert seen[0] is False and not cache.enabled and not listener.listening.is_set()
    finally:
        listener.stop()
    assert True not in seen
