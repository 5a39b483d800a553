"""The status GET's database cost, counted (never timed): cached keys, one statement, no pre-ping, a retry on
a dead connection; and a revoked key refused at once even while it was cached."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from sqlalchemy import event, select, update

from blade_service.persistence.auth import hash_key
from blade_service.persistence.models import ApiKey, RequestStatus, TrainingEvent, UnlearnRequest, utcnow
from tests.fixtures_services import headers

pytestmark = pytest.mark.services


@contextmanager
def statements(engine) -> Iterator[list[str]]:
    """Every SQL statement `engine` sends while the block runs."""
    seen: list[str] = []

    def record(_conn, _cursor, statement, *_args) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def _submit(client, ready) -> dict:
    resp = client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body())
    assert resp.status_code == 202, resp.text
    return resp.json()


def test_status_get_is_one_statement_with_a_cached_key(api_client, api_app, db_engine, ready):
    first = _submit(api_client, ready)
    second = _submit(api_client, ready)
    path = f"/unlearn-requests/{second['id']}"
    with statements(db_engine) as cold:
        assert api_client.get(path, headers=headers(ready.tenant.admin)).status_code == 200
    with statements(db_engine) as warm:
        resp = api_client.get(path, headers=headers(ready.tenant.admin))
    assert resp.status_code == 200
    body = resp.json()
    assert (
        body["queue_position"] == 1 and body["base_model"] == ready.base_model and body["adapter_id"] is None
    )
    assert body == second  # the same document the POST answered (serialised without the response model)
    assert len(warm) == 1, warm  # the request, its base model, adapter and queue position together
    assert len(cold) <= 3, cold  # at most: the key lookup, its last_used_at touch, the request
    assert not db_engine.pool._pre_ping  # no per-checkout round trip

    # Running: one more statement, the latest steps' times for the rate.
    with api_app.state.session_factory() as s, s.begin():
        s.execute(
            update(UnlearnRequest)
            .where(UnlearnRequest.id == first["id"])
            .values(status=RequestStatus.RUNNING, step=2)
        )
        s.add_all(
            TrainingEvent(request_id=first["id"], step=i, record={"step": i}, created_at=utcnow())
            for i in (1, 2)
        )
    with statements(db_engine) as running:
        resp = api_client.get(f"/unlearn-requests/{first['id']}", headers=headers(ready.tenant.admin))
    assert resp.status_code == 200 and resp.json()["status"] == "running"
    assert len(running) == 2, running
    assert api_client.get(path, headers=headers(ready.tenant.admin)).json()["queue_position"] == 1


def test_submit_is_one_transaction_of_few_statements(api_client, db_engine, ready, enqueued):
    _submit(api_client, ready)  # the key is cached
    with statements(db_engine) as seen:
        resp = api_client.post(
            "/unlearn-requests",
            headers=headers(ready.tenant.admin, **{"Idempotency-Key": "speed-1"}),
            json=ready.body(),
        )
    assert resp.status_code == 202, resp.text
    assert resp.json()["queue_position"] == 1 and resp.json()["adapter_id"] is None
    assert resp.json()["id"] not in enqueued()  # the API publishes nothing: a worker's relay does
    # The base model and datasets (locked), the Idempotency-Key's owner and then the audit chain's lock; the
    # request with its number and position, and its audit entry linked to the head: two round trips in all.
    assert len(seen) == 2, seen
    claim, insert = seen
    outer, inner = claim.split("FROM (", 1)  # the chain's lock is taken over the rows already locked
    assert "pg_advisory_xact_lock" in outer and "FOR NO KEY UPDATE" in inner, claim
    assert re.findall(r"INSERT INTO (\w+)", insert) == ["unlearn_requests", "audit_entries"], insert


def test_a_revoked_key_is_refused_at_once_even_when_cached(api_client, api_app, tenant, make_key, db_engine):
    reader = make_key(tenant.name, ["read"])
    me = api_client.get("/me", headers=headers(reader))
    assert me.status_code == 200
    assert api_app.state.key_cache.get(hash_key(reader)) is not None  # served from memory now
    with statements(db_engine) as seen:
        assert api_client.get("/me", headers=headers(reader)).status_code == 200
    assert seen == []

    revoked = api_client.post(f"/api-keys/{me.json()['id']}/revoke", headers=headers(tenant.admin))
    assert revoked.status_code == 200, revoked.text
    assert api_app.state.key_cache.get(hash_key(reader)) is None
    resp = api_client.get("/me", headers=headers(reader))
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert api_client.get("/me", headers=headers(reader)).status_code == 401


def test_a_racing_lookup_cannot_cache_a_key_being_revoked(api_app, api_client, tenant, make_key):
    from sqlalchemy import select

    from blade_service.persistence.models import ApiKey

    reader = make_key(tenant.name, ["read"])
    cache = api_app.state.key_cache
    with api_app.state.session_factory() as s:
        stale = s.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(reader))).one()  # read before
        assert stale.tenant.name == tenant.name
    cache.drop(stale.id)  # the revoking transaction's hook ran
    cache.put(stale)  # the racing lookup finishes with what it read before the revocation committed
    assert cache.get(hash_key(reader)) is None


def test_a_dead_connection_is_retried_not_pinged(api_client, api_app, db_engine, ready):
    created = _submit(api_client, ready)
    path = f"/unlearn-requests/{created['id']}"
    assert api_client.get(path, headers=headers(ready.tenant.admin)).status_code == 200
    url = db_engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:  # a server restart, as the pooled connections see it
        killed = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()[0]
    assert killed >= 1
    resp = api_client.get(path, headers=headers(ready.tenant.admin))
    assert resp.status_code == 200, resp.text
    assert resp.json()["id"] == created["id"]


def test_metrics_totals_fold_history_once_and_count_each_row_once(api_client, api_app, ready):
    """`HistoryTotals` (what /metrics and the dashboard count finished requests from): rows older than the lag
    are folded in once, newer ones re-read; later reads neither lose nor double-count a row."""
    from datetime import timedelta

    from blade_service.api.observability.history import HISTORY_LAG, HistoryTotals

    ids = [_submit(api_client, ready)["id"] for _ in range(3)]
    now = utcnow()
    finished = {ids[0]: now - timedelta(days=30), ids[1]: now - HISTORY_LAG / 2, ids[2]: None}
    with api_app.state.session_factory() as s, s.begin():
        for rid, at in finished.items():
            if at is not None:
                s.execute(
                    update(UnlearnRequest)
                    .where(UnlearnRequest.id == rid)
                    .values(
                        status=RequestStatus.SUCCEEDED, started_at=at - timedelta(seconds=90), finished_at=at
                    )
                )
    with api_app.state.session_factory() as s:
        admin_hash = hash_key(ready.tenant.admin)
        tenant = s.scalars(select(ApiKey.tenant_id).where(ApiKey.key_hash == admin_hash)).one()

    def mine(totals: HistoryTotals, at) -> float:
        with api_app.state.session_factory() as s:
            rows = totals.read(s, at)
        return rows.get((tenant, "blade", "succeeded"), [0])[0]

    totals = HistoryTotals()
    assert mine(totals, now) == 2  # one folded (a month old), one re-read (within the lag)
    assert totals.through == now - HISTORY_LAG
    assert mine(totals, now) == 2  # nothing counted twice
    later = now + HISTORY_LAG  # the recent one is folded now
    assert mine(totals, later) == 2 and mine(totals, later) == 2
    assert mine(HistoryTotals(), later) == 2  # a fresh process agrees


def test_the_server_freezes_what_start_up_built_out_of_the_collector(service_settings):
    import gc

    from fastapi.testclient import TestClient

    from blade_service.api.main import create_app

    with TestClient(create_app(service_settings)):  # what tests build: nothing frozen
        assert gc.get_freeze_count() == 0
    try:
        with TestClient(create_app(service_settings, freeze_gc=True)) as client:
            assert gc.get_freeze_count() > 10_000  # imports, app, mappers: kept out of every collection
            assert client.get("/healthz").status_code == 200
    finally:
        gc.unfreeze()
