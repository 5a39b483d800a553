"""The audit log: hash-chained, append-only in the database, tampering detected with the first bad entry."""

from __future__ import annotations

import itertools
import threading

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import sessionmaker

from persistence import audit
from persistence.db import make_engine, upgrade_to_head
from persistence.models import GENESIS_HASH, AuditEntry


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
            conn.execute(text("DROP TRIGGER audit_entries_no_update"))
            conn.execute(text("DROP TRIGGER audit_entries_no_delete"))
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
