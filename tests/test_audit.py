"""The audit log: hash-chained, append-only in the database, tampering detected with the first bad entry."""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker

from blade_service.persistence import audit, audit_heads
from blade_service.persistence.db import make_engine, upgrade_to_head
from blade_service.persistence.models import GENESIS_HASH, AuditEntry


def _factory(url: str):
    upgrade_to_head(url)
    engine = make_engine(url)
    return engine, sessionmaker(engine, expire_on_commit=False)


def _append_some(factory, n: int = 5) -> list[int]:
    ids = []
    for i in range(n):
        with factory() as session, session.begin():
            entry = audit.append(
                session,
                action="thing.change",
                subject_type="thing",
                subject_id=f"t{i}",
                actor="system",
                tenant_id="ten_1",
                reason=f"because {i}",
                data={"i": i, "nested": {"x": [1, 2.5, "é"]}},
            )
            ids.append(entry.id)
    return ids


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    if request.param == "sqlite":
        engine, factory = _factory(f"sqlite:///{tmp_path / 'audit.db'}")
        yield engine, factory
        engine.dispose()
    else:
        url = request.getfixturevalue("fresh_pg_url")
        engine, factory = _factory(url)
        yield engine, factory
        engine.dispose()


def test_chain_links_each_entry_to_the_one_before(db):
    _, factory = db
    with factory() as session:
        assert audit.verify_chain(session).intact and audit.head(session) == (None, GENESIS_HASH)
    ids = _append_some(factory)
    with factory() as session:
        entries = session.query(AuditEntry).order_by(AuditEntry.id).all()
        assert [e.id for e in entries] == ids
        assert entries[0].prev_hash == GENESIS_HASH
        assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(entries))
        status = audit.verify_chain(session)
        assert status.intact and status.checked == 5 and status.head_hash == entries[-1].hash
        assert audit.head(session) == (entries[-1].id, entries[-1].hash)
        assert entries[2].data == {"i": 2, "nested": {"x": [1, 2.5, "é"]}}


def test_database_refuses_update_and_delete(db):
    engine, factory = db
    ids = _append_some(factory, 2)
    for statement in (
        f"UPDATE audit_entries SET reason = 'x' WHERE id = {ids[0]}",
        f"DELETE FROM audit_entries WHERE id = {ids[1]}",
    ):
        with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(text(statement))


def _without_triggers(engine, statement: str) -> None:
    """Tamper as someone with DDL rights would: drop the guard, then change a row."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("ALTER TABLE audit_entries DISABLE TRIGGER audit_entries_append_only"))
        else:
            conn.execute(text("DROP TRIGGER IF EXISTS audit_entries_no_update"))
            conn.execute(text("DROP TRIGGER IF EXISTS audit_entries_no_delete"))
        conn.execute(text(statement))


@pytest.mark.parametrize(
    ("tamper", "bad"),
    [
        ("UPDATE audit_entries SET reason = 'nothing to see' WHERE id = {id2}", 2),
        ("UPDATE audit_entries SET data = '{{\"i\": 99}}' WHERE id = {id2}", 2),
        ("UPDATE audit_entries SET actor = 'key:someone-else' WHERE id = {id4}", 4),
        ("DELETE FROM audit_entries WHERE id = {id2}", 3),
    ],
)
def test_tampering_is_detected_at_the_first_bad_entry(db, tamper, bad):
    engine, factory = db
    ids = _append_some(factory)
    _without_triggers(engine, tamper.format(id2=ids[2], id4=ids[4]))
    with factory() as session:
        status = audit.verify_chain(session)
    assert not status.intact
    assert status.first_bad_id == ids[bad]
    assert status.head_id == ids[bad - 1] if bad != 3 else status.head_id == ids[1]
    assert status.problem


def test_concurrent_appends_never_fork_the_chain(fresh_pg_url):
    engine, factory = _factory(fresh_pg_url)
    errors = []

    def work(n: int) -> None:
        try:
            for i in range(10):
                with factory() as session, session.begin():
                    audit.append(session, action="x", subject_type="t", subject_id=f"{n}-{i}", actor="system")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with factory() as session:
        status = audit.verify_chain(session)
    assert status.intact and status.checked == 60
    engine.dispose()


def _append_for(factory, tenants: list[str]) -> list[int]:
    ids = []
    for i, tenant in enumerate(tenants):
        with factory() as session, session.begin():
            ids.append(
                audit.append(
                    session,
                    action="x.y",
                    subject_type="t",
                    subject_id=f"s{i}",
                    actor="system",
                    tenant_id=tenant,
                ).id
            )
    return ids


def test_tenant_verify_checks_only_that_tenants_entries_and_names_no_other(db):
    engine, factory = db
    ids = _append_for(factory, ["A", "B", "A", "B", "B", "A"])
    with factory() as session:
        status = audit.verify_tenant(session, tenant_id="A")
        assert status.intact and status.checked == 3 and status.head_id == ids[5]
    _without_triggers(engine, f"UPDATE audit_entries SET reason = 'x' WHERE id = {ids[3]}")  # B's entry
    with factory() as session:
        assert audit.verify_tenant(session, tenant_id="A").intact  # nothing of A's changed
        b = audit.verify_tenant(session, tenant_id="B")
        assert not b.intact and b.first_bad_id == ids[3]
        assert audit.verify_chain(session).first_bad_id == ids[3]
    _without_triggers(engine, f"DELETE FROM audit_entries WHERE id = {ids[1]}")  # B's, between two of A's
    with factory() as session:
        a = audit.verify_tenant(session, tenant_id="A")
        assert not a.intact and a.first_bad_id == ids[0]  # A's own entry, whose successor vanished
        assert str(ids[1]) not in a.problem and "B" not in a.problem


def test_tenant_verify_sees_its_own_entry_rewritten_with_a_fresh_hash(db):
    engine, factory = db
    ids = _append_for(factory, ["B", "A", "B"])
    with factory() as session:
        entry = session.get(AuditEntry, ids[1])
        entry.reason = "rewritten"
        new_hash = audit.compute_hash(entry.prev_hash, audit.entry_payload(entry))
        session.rollback()
    _without_triggers(
        engine, f"UPDATE audit_entries SET reason = 'rewritten', hash = '{new_hash}' WHERE id = {ids[1]}"
    )
    with factory() as session:
        status = audit.verify_tenant(session, tenant_id="A")
    assert not status.intact and status.first_bad_id == ids[1] and "after it" in status.problem


@pytest.fixture
def audit_api(fresh_pg_url, tmp_path):
    """The API on a database of its own (these tests tamper with it), with a bootstrap admin key."""
    from fastapi.testclient import TestClient

    from blade_service.api.main import create_app
    from blade_service.persistence.settings import Settings

    settings = Settings(
        data_dir=tmp_path,
        database_url=fresh_pg_url,
        storage_root=tmp_path / "artifacts",
        bootstrap_admin_key="blade_audit_test_admin",
    )
    app = create_app(settings)
    with TestClient(app) as client:
        yield client, app, "blade_audit_test_admin"
    app.state.session_factory.kw["bind"].dispose()


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _tenant_key(client, admin: str, tenant: str) -> str:
    resp = client.post(
        "/api-keys", headers=_h(admin), json={"name": "k", "scopes": ["admin"], "tenant": tenant}
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["key"]


def test_verify_over_http_is_scoped_to_the_tenant(audit_api):
    client, app, admin = audit_api
    a, b = _tenant_key(client, admin, "alpha"), _tenant_key(client, admin, "beta")
    for key in (a, b, a):
        client.post("/api-keys", headers=_h(key), json={"name": "more", "scopes": ["read"]})
    engine = app.state.session_factory.kw["bind"]
    with engine.connect() as conn:
        beta_id = conn.execute(
            text(
                "SELECT e.id FROM audit_entries e JOIN tenants t ON t.id = e.tenant_id "
                "WHERE t.name = 'beta' ORDER BY e.id DESC LIMIT 1"
            )
        ).scalar_one()
        alpha_rows = conn.execute(
            text(
                "SELECT count(*) FROM audit_entries e JOIN tenants t ON t.id = e.tenant_id "
                "WHERE t.name = 'alpha'"
            )
        ).scalar_one()
    mine = client.get("/audit-log/verify", headers=_h(a)).json()
    assert mine["intact"] and mine["scope"] == "tenant" and mine["checked"] == alpha_rows
    assert mine["signed_head"]["head_id"] >= beta_id  # the whole log's head, signed

    _without_triggers(engine, f"UPDATE audit_entries SET reason = 'forged' WHERE id = {beta_id}")
    mine = client.get("/audit-log/verify", headers=_h(a)).json()
    assert mine["intact"] and mine["first_bad_id"] is None and mine["problem"] is None
    theirs = client.get("/audit-log/verify", headers=_h(b)).json()
    assert not theirs["intact"] and theirs["first_bad_id"] == beta_id
    whole = client.get("/audit-log/verify", headers=_h(admin)).json()
    assert whole["scope"] == "chain" and not whole["intact"] and whole["first_bad_id"] == beta_id


def test_removing_the_newest_entries_is_detected_by_the_signed_heads(audit_api, tmp_path):
    client, app, admin = audit_api
    tenant = _tenant_key(client, admin, "gamma")
    first = client.get("/audit-log/verify", headers=_h(admin)).json()
    assert first["intact"] and first["signed_head"]["head_id"]
    signed_id = first["signed_head"]["head_id"]
    for i in range(3):
        client.post("/api-keys", headers=_h(tenant), json={"name": f"k{i}", "scopes": ["read"]})
    again = client.get("/audit-log/verify", headers=_h(admin)).json()
    assert (
        again["intact"] and again["signed_heads_checked"] == 1 and again["signed_head"]["head_id"] > signed_id
    )
    newest = again["signed_head"]["head_id"]
    heads = sorted((tmp_path / "artifacts" / "audit-heads").iterdir())
    assert len(heads) == 2 and f"{newest:020d}" in heads[-1].name

    engine = app.state.session_factory.kw["bind"]
    _without_triggers(engine, f"DELETE FROM audit_entries WHERE id > {signed_id}")  # cut the newest off
    with app.state.session_factory() as session:
        assert audit.verify_chain(session).intact  # the shorter chain alone looks fine
    whole = client.get("/audit-log/verify", headers=_h(admin)).json()
    assert not whole["intact"] and whole["first_bad_id"] == newest and "removed" in whole["problem"]
    assert whole["signed_head"] is None  # a truncated chain's head is never signed
    theirs = client.get("/audit-log/verify", headers=_h(tenant))
    assert theirs.status_code == 200, theirs.text
    body = theirs.json()
    assert not body["intact"] and body["first_bad_id"] is None and f"entry {newest}" not in body["problem"]


def test_a_forged_signed_head_is_refused(audit_api, tmp_path):
    import json

    client, _, admin = audit_api
    signed = client.get("/audit-log/verify", headers=_h(admin)).json()["signed_head"]
    path = next((tmp_path / "artifacts" / "audit-heads").iterdir())
    forged = {**signed, "signed_at": "2020-01-01T00:00:00+00:00"}
    path.write_text(json.dumps(forged))
    status = client.get("/audit-log/verify", headers=_h(admin)).json()
    assert not status["intact"] and "no valid signature" in status["problem"]


def test_the_reconciler_signs_the_head_periodically(fresh_pg_url, tmp_path):
    from blade_service.persistence.settings import Settings
    from blade_service.persistence.storage import get_storage
    from blade_service.worker.reconcile_task import _sign_audit_head

    settings = Settings(data_dir=tmp_path, database_url=fresh_pg_url, storage_root=tmp_path / "artifacts")
    engine, factory = _factory(fresh_pg_url)
    assert _sign_audit_head(settings) is None  # an empty log has no head
    ids = _append_some(factory, 3)
    assert _sign_audit_head(settings) == ids[-1]
    assert get_storage(settings).list_keys("audit-heads") == [
        audit_heads.head_key(ids[-1], _hash(factory, ids[-1]))
    ]
    engine.dispose()


def test_a_signed_head_is_stored_only_when_its_transaction_commits(db, tmp_path):
    """The head's key is published in the caller's transaction; a head stored before that commits would name
    a key (or an entry) that a rollback can take back, and every later verify would fail on it."""
    from blade_service.persistence.settings import Settings
    from blade_service.persistence.storage import LocalStorage

    _, factory = db
    ids = _append_some(factory, 2)
    storage, settings = LocalStorage(tmp_path / "store"), Settings(data_dir=tmp_path)
    with factory() as session:
        session.begin()
        assert audit_heads.current_signed_head(session, storage, settings)["head_id"] == ids[-1]
        assert storage.list_keys("audit-heads") == []  # not before the commit ...
        session.rollback()
    assert storage.list_keys("audit-heads") == []  # ... nor after a rollback
    with factory() as session, session.begin():
        audit_heads.current_signed_head(session, storage, settings)
        with contextlib.suppress(RuntimeError), session.begin_nested():
            raise RuntimeError  # a savepoint rolled back inside the transaction keeps the head queued
    assert storage.list_keys("audit-heads") == [audit_heads.head_key(ids[-1], _hash(factory, ids[-1]))]
    with factory() as session:
        check = audit_heads.check_signed_heads(session, storage, reveal_ids=True)
    assert check.checked == 1 and check.problem is None


def _hash(factory, entry_id: int) -> str:
    with factory() as session:
        return session.get(AuditEntry, entry_id).hash


def _list_keys_checks(store) -> None:
    for key in ("audit-heads/00000000000000000002-b.json", "audit-heads/00000000000000000001-a.json"):
        store.put_bytes(key, b"{}")
    store.put_bytes("audit-heads-other/x.json", b"{}")  # a sibling with the same start is not listed
    assert store.list_keys("audit-heads") == [
        "audit-heads/00000000000000000001-a.json",
        "audit-heads/00000000000000000002-b.json",
    ]
    assert store.list_keys("nothing-here") == []


def test_storage_lists_the_signed_heads_local(tmp_path):
    from blade_service.persistence.storage import LocalStorage

    _list_keys_checks(LocalStorage(tmp_path / "store"))


def test_storage_lists_the_signed_heads_s3(monkeypatch):
    import boto3
    import moto

    from blade_service.persistence.storage import S3Storage

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="artifacts")
        _list_keys_checks(S3Storage("artifacts", prefix="blade"))


def test_the_reconciler_exports_whether_the_chain_verifies(fresh_pg_url, tmp_path):
    """`blade_audit_chain_ok` (alerts.yml pages on 0): 1 for an intact chain, 0 once an entry is altered."""
    from prometheus_client import REGISTRY

    import blade_service.worker.reconcile_task as tasks
    from blade_service.persistence.settings import Settings

    settings = Settings(
        data_dir=tmp_path,
        database_url=fresh_pg_url,
        storage_root=tmp_path / "artifacts",
        audit_check_interval_s=0,
    )
    engine, factory = _factory(fresh_pg_url)
    ids = _append_some(factory, 3)
    tasks._sign_audit_head(settings)
    assert tasks._check_audit_chain(settings) is True
    assert REGISTRY.get_sample_value("blade_audit_chain_ok") == 1.0
    _without_triggers(engine, f"UPDATE audit_entries SET reason = 'rewritten' WHERE id = {ids[1]}")
    assert tasks._check_audit_chain(settings) is False
    assert REGISTRY.get_sample_value("blade_audit_chain_ok") == 0.0
    rate_limited = settings.model_copy(update={"audit_check_interval_s": 3600})
    assert tasks._check_audit_chain(rate_limited) is None  # not due again yet
    engine.dispose()


def test_a_refused_certificate_signs_nothing(audit_api, tmp_path):
    """The first certificate asked of a fresh service is for a request still queued: the 409 must not leave
    a signed head behind whose key's publication was rolled back (every later verify would fail on it)."""
    from tests.fixtures_services import qa_rows, register_model, upload_dataset

    client, _, admin = audit_api
    tenant = _tenant_key(client, admin, "delta")
    body = {
        "base_model": register_model(client, tenant, operator=admin),
        "forget_dataset": upload_dataset(client, tenant, qa_rows(2, "f"))["id"],
        "retain_dataset": upload_dataset(client, tenant, qa_rows(2, "r"))["id"],
    }
    submitted = client.post("/unlearn-requests", headers=_h(tenant), json=body)
    assert submitted.status_code == 202, submitted.text
    early = client.get(f"/unlearn-requests/{submitted.json()['id']}/certificate", headers=_h(tenant))
    assert early.status_code == 409 and early.json()["error"]["code"] == "not_succeeded"
    assert not (tmp_path / "artifacts" / "audit-heads").exists()
    verdict = client.get("/audit-log/verify", headers=_h(admin)).json()
    assert verdict["intact"] and verdict["signed_heads_checked"] == 0, verdict
    assert client.get("/audit-log/verify", headers=_h(admin)).json()["signed_heads_checked"] == 1
