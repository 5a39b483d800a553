"""`requests.submit_request` on SQLite and PostgreSQL, called directly: numbering and queue positions,
replays, the errors of the step-by-step checks, a concurrent retry with the same Idempotency-Key, and the
audit entry whose hash PostgreSQL computes (it must be the one `audit.compute_hash` gives)."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import bindparam, select, text
from sqlalchemy.orm import Session, sessionmaker

from blade_service.persistence import audit, auth, base_models, datasets, requests
from blade_service.persistence.db import make_engine, upgrade_to_head
from blade_service.persistence.errors import Conflict, Invalid
from blade_service.persistence.models import AuditEntry, UnlearnRequest
from blade_service.persistence.storage import LocalStorage
from tests.fixtures_services import jsonl, qa_rows
from tests.fixtures_worker import wait_until

pytestmark = pytest.mark.services


class World:
    """A tenant with a base model and two datasets on one database."""

    def __init__(self, factory: sessionmaker[Session], storage: LocalStorage):
        self.factory = factory
        with factory() as s, s.begin():
            self.tenant_id = auth.get_or_create_tenant(s, name=f"sub-{uuid.uuid4().hex[:8]}").id
            self.model = base_models.register(
                s, name=f"bm-{uuid.uuid4().hex[:8]}", source="/m", tenant_id=self.tenant_id, actor="test"
            ).name
            self.forget, self.retain = (
                datasets.create_dataset(
                    s,
                    storage,
                    tenant_id=self.tenant_id,
                    filename=f"{name}.jsonl",
                    data=jsonl(qa_rows(2, name)),
                    actor="test",
                ).id
                for name in ("f", "r")
            )

    def submit_kwargs(self, **overrides: Any) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "tenant_id": self.tenant_id,
            "base_model": self.model,
            "forget_dataset": self.forget,
            "retain_dataset": self.retain,
            "actor": "test",
            "params": {"max_steps": 3},
        }
        return kwargs | overrides

    def submit(self, session: Session, **overrides: Any) -> tuple[Any, bool, int | None]:
        return requests.submit_request(session, **self.submit_kwargs(**overrides))


def _world(url: str, tmp_path: Path) -> Iterator[World]:
    upgrade_to_head(url)
    engine = make_engine(url)
    yield World(sessionmaker(engine, expire_on_commit=False), LocalStorage(tmp_path / "artifacts"))
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def world(request, tmp_path) -> Iterator[World]:
    url = (
        f"sqlite:///{tmp_path / 'submit.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("fresh_pg_url")
    )
    yield from _world(url, tmp_path)


@pytest.fixture
def pg_world(fresh_pg_url, tmp_path) -> Iterator[World]:
    """PostgreSQL only: SQLite serialises writers, so two submissions can never race there."""
    yield from _world(fresh_pg_url, tmp_path)


def test_requests_are_numbered_in_order_with_their_queue_positions(world):
    seen = []
    for _ in range(3):
        with world.factory() as s, s.begin():
            request, created, position = world.submit(s)
            seen.append((request.queue_seq, position, created, request.base_model_name, request.adapter_id))
    assert seen == [(i + 1, i, True, world.model, None) for i in range(3)]
    with world.factory() as s:
        assert audit.verify_chain(s).intact


def test_the_request_returned_is_the_row_stored_column_for_column(world):
    """The INSERT returns only what the database decides; the view returned is built from what it bound,
    so it must equal the stored row in every field (a new column with a model default would not), and so
    must the entity `create_request` reads back."""
    fields = [f.name for f in dataclasses.fields(requests.RequestView)]
    with world.factory() as s, s.begin():
        made, _, _ = world.submit(s, idempotency_key="k-row", metadata={"ticket": "T-1"})
        assert isinstance(made, requests.RequestView)
        entity, created = requests.create_request(
            s, **world.submit_kwargs(idempotency_key="k-entity", metadata={"ticket": "T-1"})
        )
        assert created and isinstance(entity, UnlearnRequest)
        columns = [a.key for a in UnlearnRequest.__mapper__.column_attrs]
        read_back = {key: getattr(entity, key) for key in columns}
    with world.factory() as s:
        stored = s.get(UnlearnRequest, made.id)
        assert stored is not None
        assert dataclasses.asdict(made) == {
            name: getattr(stored, name) for name in fields if name not in ("base_model_name", "adapter_id")
        } | {"base_model_name": world.model, "adapter_id": None}
        stored_entity = s.get(UnlearnRequest, entity.id)
        assert read_back == {key: getattr(stored_entity, key) for key in columns}
    assert made.meta == {"ticket": "T-1"} and made.queue_seq == 1 and read_back["queue_seq"] == 2


def test_the_next_queue_number_is_read_from_the_end_of_the_index_before_any_analyze(pg_world):
    """A new database has no statistics until autovacuum's first ANALYZE; the next number must still come
    from the end of the (base_model_id, queue_seq) index, not from a scan of every request of the base
    model (which max() planned there, its cost growing with the queue). A queue of 300 spans several pages:
    at 3 requests the old single-column index on base_model_id lost to the unique one, at 300 it won, and the
    plan read and sorted the whole queue (migration 0007 drops it)."""
    for _ in range(300):
        with pg_world.factory() as s, s.begin():
            world_request, _, _ = pg_world.submit(s)
    table = UnlearnRequest.__table__
    with pg_world.factory() as s:
        assert s.scalar(text("SELECT reltuples FROM pg_class WHERE relname = 'unlearn_requests'")) < 0
        model_id = s.scalar(select(UnlearnRequest.base_model_id).where(UnlearnRequest.id == world_request.id))
        nxt = select(requests._next_queue_seq(table, bindparam("m", model_id)))
        sql = nxt.compile(dialect=s.get_bind().dialect, compile_kwargs={"literal_binds": True})
        plan = s.scalar(text(f"EXPLAIN (FORMAT JSON) {sql}"))[0]["Plan"]
        assert s.scalar(nxt) == 301

    def scans(node: dict[str, Any]) -> list[tuple[str, str | None, str | None]]:
        found = [(node["Node Type"], node.get("Index Name"), node.get("Scan Direction"))]
        return found + [scan for child in node.get("Plans", []) for scan in scans(child)]

    kind, index, direction = scans(plan)[-1]
    assert kind in ("Index Only Scan", "Index Scan"), scans(plan)
    assert (index, direction) == ("uq_unlearn_requests_base_model_id_queue_seq", "Backward"), scans(plan)


def test_a_repeated_idempotency_key_returns_the_original_and_a_changed_body_conflicts(world):
    with world.factory() as s, s.begin():
        first, created, _ = world.submit(s, idempotency_key="k-1")
    assert created
    with world.factory() as s, s.begin():
        again, created, position = world.submit(s, idempotency_key="k-1")
    assert (again.id, created, position) == (first.id, False, None)
    with world.factory() as s, s.begin(), pytest.raises(Conflict) as caught:
        world.submit(s, idempotency_key="k-1", params={"max_steps": 4})
    assert caught.value.code == "idempotency_key_reused"
    # A replay is answered before the body is checked again: even one naming a missing dataset.
    with world.factory() as s, s.begin():
        assert world.submit(s, idempotency_key="k-1")[0].id == first.id


@pytest.mark.parametrize(
    ("overrides", "field", "code"),
    [
        ({"base_model": "no-such-model"}, "base_model", "unknown_base_model"),
        ({"forget_dataset": "ds_missing"}, "forget_dataset", "unknown_dataset"),
        ({"retain_dataset": "ds_missing"}, "retain_dataset", "unknown_dataset"),
        ({"retain_dataset": None}, "retain_dataset", "invalid"),
        ({"method": "nope"}, "method", "unknown_method"),
    ],
)
def test_what_is_missing_is_named_and_nothing_is_stored(world, overrides, field, code):
    with world.factory() as s, pytest.raises(Invalid) as caught:
        world.submit(s, **overrides)
    assert (caught.value.field, caught.value.code) == (field, code)
    with world.factory() as s, s.begin():
        request, created, position = world.submit(s)
    assert (request.queue_seq, created, position) == (1, True, 0)


def test_the_audit_entry_hash_is_the_chain_formula(world):
    with world.factory() as s, s.begin():
        request, _, _ = world.submit(s, metadata={"note": "é ü 漢 \U0001f600"})
    with world.factory() as s:
        entry = s.scalars(select(AuditEntry).where(AuditEntry.subject_id == request.id)).one()
        assert entry.hash == audit.compute_hash(entry.prev_hash, audit.entry_payload(entry))
        before = s.scalars(select(AuditEntry.hash).where(AuditEntry.id < entry.id).order_by(AuditEntry.id))
        assert entry.prev_hash == list(before)[-1]  # the dataset uploads were logged first


def test_a_concurrent_retry_with_the_same_key_waits_and_returns_the_original(pg_world):
    world = pg_world
    first = world.factory()
    original, created, _ = world.submit(first, idempotency_key="race")  # holds the base model's lock
    assert created
    answer: dict[str, Any] = {}

    def retry() -> None:
        with world.factory() as s, s.begin():
            request, answer["created"], _ = world.submit(s, idempotency_key="race")
            answer["id"] = request.id

    thread = threading.Thread(target=retry)
    thread.start()

    def retry_waits() -> bool:  # for the first submission's transaction
        with world.factory() as watcher:  # a new transaction each time: the view is read once per one
            return bool(
                watcher.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                )
            )

    wait_until(retry_waits, timeout=30, what="the retry to wait for the lock")
    first.commit()
    first.close()
    thread.join()
    assert answer == {"id": original.id, "created": False}
    with world.factory() as s, s.begin():
        later, created, position = world.submit(s)
    assert (later.queue_seq, created, position) == (2, True, 1)


def test_the_entry_is_appended_by_the_insert_with_its_queue_number(world):
    with world.factory() as s, s.begin():
        world.submit(s)
        request, _, _ = world.submit(s, params={"max_steps": 4})
    with world.factory() as s:
        entry = s.scalars(select(AuditEntry).where(AuditEntry.subject_id == request.id)).one()
        assert entry.data["queue_seq"] == request.queue_seq == 2
        assert (entry.data["params"]["max_steps"], entry.data["base_model"]) == (4, world.model)
        assert entry.hash == audit.compute_hash(entry.prev_hash, audit.entry_payload(entry))
        assert audit.verify_chain(s).intact


def test_an_entry_the_insert_cannot_splice_is_appended_on_its_own(pg_world, monkeypatch):
    """A webhook event, or data that holds the splice's marker, goes through `audit.append` after the INSERT,
    under the lock the claim took."""
    marker = "\x00slot\x00"
    assert audit.spliced_params(**_entry(), data={"x": 1}, slot="n") is not None
    assert audit.spliced_params(**_entry(), data={"x": marker}, slot="n") is None
    assert audit.spliced_params(**_entry("adapter.create"), data={"x": 1}, slot="n") is None
    monkeypatch.setattr(audit, "spliced_params", lambda **_: None)
    with pg_world.factory() as s, s.begin():
        request, _, _ = pg_world.submit(s)
    with pg_world.factory() as s:
        entry = s.scalars(select(AuditEntry).where(AuditEntry.subject_id == request.id)).one()
        assert entry.data["queue_seq"] == request.queue_seq
        assert audit.verify_chain(s).intact


def _entry(action: str = "unlearn_request.create") -> dict[str, Any]:
    return {
        "action": action,
        "subject_type": "unlearn_request",
        "subject_id": "req_x",
        "actor": "test",
        "actor_key_id": None,
        "tenant_id": None,
    }


def test_concurrent_submissions_and_other_appends_keep_one_chain(pg_world):
    """Each submission appends its entry in the INSERT's statement, whose snapshot is taken once the claim
    holds the chain's lock: racing submissions (two base models) and plain appends leave one intact chain,
    numbered per base model without gaps."""
    with pg_world.factory() as s, s.begin():
        other = base_models.register(
            s, name=f"bm-{uuid.uuid4().hex[:8]}", source="/m", tenant_id=pg_world.tenant_id, actor="test"
        ).name
    errors: list[BaseException] = []
    start = threading.Barrier(9)

    def submit(model: str) -> None:
        try:
            start.wait()
            for _ in range(5):
                with pg_world.factory() as s, s.begin():
                    pg_world.submit(s, base_model=model)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def append() -> None:
        try:
            start.wait()
            for i in range(10):
                with pg_world.factory() as s, s.begin():
                    audit.append(s, action="test.append", subject_type="test", subject_id=str(i), actor="t")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(m,)) for m in [pg_world.model, other] * 4]
    threads.append(threading.Thread(target=append))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with pg_world.factory() as s:
        assert audit.verify_chain(s).intact
        entries = s.scalars(select(AuditEntry).where(AuditEntry.action == "unlearn_request.create")).all()
        for model in (pg_world.model, other):
            seqs = sorted(e.data["queue_seq"] for e in entries if e.data["base_model"] == model)
            assert seqs == list(range(1, 21))
