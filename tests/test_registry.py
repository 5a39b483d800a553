"""The adapter registry on PostgreSQL: version numbers, stacks, disable/enable/cascade, stale flags, audit."""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import select

from blade_service.persistence import audit, auth, base_models, datasets, registry, requests
from blade_service.persistence.errors import Invalid, NotFound
from blade_service.persistence.models import AdapterState, AdapterVersion, AuditEntry, RequestStatus
from blade_service.persistence.storage import LocalStorage
from tests.fixtures_services import jsonl, qa_rows

pytestmark = pytest.mark.services


class World:
    """A tenant with a base model and datasets, and a way to make succeeded requests with adapters."""

    def __init__(self, factory, storage):
        self.factory, self.storage = factory, storage
        with factory() as s, s.begin():
            self.tenant_id = auth.get_or_create_tenant(s, name=f"reg-{uuid.uuid4().hex[:8]}").id
            self.model = base_models.register(
                s, name=f"bm-{uuid.uuid4().hex[:8]}", source="/m", tenant_id=self.tenant_id, actor="test"
            ).name
            self.forget = datasets.create_dataset(
                s,
                storage,
                tenant_id=self.tenant_id,
                filename="f.jsonl",
                data=jsonl(qa_rows(2, "f")),
                actor="test",
            ).id
            self.retain = datasets.create_dataset(
                s,
                storage,
                tenant_id=self.tenant_id,
                filename="r.jsonl",
                data=jsonl(qa_rows(2, "r")),
                actor="test",
            ).id

    def request(self) -> str:
        with self.factory() as s, s.begin():
            req, _ = requests.create_request(
                s,
                tenant_id=self.tenant_id,
                base_model=self.model,
                forget_dataset=self.forget,
                retain_dataset=self.retain,
                actor="test",
            )
            return req.id

    def adapter(self, parent_stack: list[str] | None = None) -> str:
        request_id = self.request()
        with self.factory() as s, s.begin():
            adapter = registry.create_adapter_version(
                s,
                request=request_id,
                artifact_key=f"adapters/{request_id}",
                sha256="ab" * 32,
                parent_stack=parent_stack,
                actor="worker:w",
            )
            return adapter.id

    def stack(self) -> list[tuple[str, int, str, bool]]:
        with self.factory() as s:
            stack = registry.list_stack(s, self.model)
            stale = registry.stale_flags(stack)
            return [(a.id, a.version, a.state.value, stale[a.id]) for a in stack]

    def disable(self, adapter_id: str, cascade: bool = False, reason: str = "bad data"):
        with self.factory() as s, s.begin():
            return registry.disable(
                s,
                adapter_id=adapter_id,
                actor="key:admin",
                reason=reason,
                cascade=cascade,
                tenant_id=self.tenant_id,
            )

    def enable(self, adapter_id: str, reason: str = "restored"):
        with self.factory() as s, s.begin():
            return registry.enable(
                s, adapter_id=adapter_id, actor="key:admin", reason=reason, tenant_id=self.tenant_id
            )


@pytest.fixture
def world(api_app, tmp_path):
    return World(api_app.state.session_factory, LocalStorage(tmp_path / "artifacts"))


def test_versions_count_up_and_parent_stack_defaults_to_the_effective_stack(world):
    a1 = world.adapter()
    a2 = world.adapter()
    a3 = world.adapter()
    assert [(v, state, stale) for _, v, state, stale in world.stack()] == [
        (1, "active", False),
        (2, "active", False),
        (3, "active", False),
    ]
    with world.factory() as s:
        assert [a.id for a in registry.effective_stack(s, world.model)] == [a1, a2, a3]
        third = registry.get_adapter(s, adapter_id=a3, tenant_id=world.tenant_id)
        assert third.parent_stack == [a1, a2]
        assert third.forget_sha256 and third.retain_sha256 and third.method == "blade"


def test_one_adapter_per_request_even_when_completion_repeats(world):
    request_id = world.request()
    with world.factory() as s, s.begin():
        first = registry.create_adapter_version(
            s, request=request_id, artifact_key="adapters/x", sha256="0" * 64
        )
    with world.factory() as s, s.begin():
        again = registry.create_adapter_version(
            s, request=request_id, artifact_key="adapters/y", sha256="1" * 64
        )
    assert again.id == first.id and again.version == first.version and again.storage_key == "adapters/x"


def test_disable_flags_dependents_and_enable_restores(world):
    a1 = world.adapter()
    a2 = world.adapter()
    change = world.disable(a1)
    assert change.changed and [a.id for a in change.flagged] == [a2] and change.cascaded == []
    assert world.stack() == [(a1, 1, "disabled", False), (a2, 2, "active", True)]
    with world.factory() as s:
        assert [a.id for a in registry.effective_stack(s, world.model)] == [a2]
    # trained while a1 was out: its parent stack is [a2]
    a3 = world.adapter()
    change = world.enable(a1)
    assert change.changed and [a.id for a in change.flagged] == [a3]
    assert world.stack() == [(a1, 1, "active", False), (a2, 2, "active", False), (a3, 3, "active", True)]


def test_cascade_disables_everything_built_on_it(world):
    a1 = world.adapter()
    a2 = world.adapter()
    a3 = world.adapter()
    change = world.disable(a2, cascade=True, reason="poisoned retain set")
    assert [a.id for a in change.cascaded] == [a3] and [a.id for a in change.flagged] == [a3]
    assert [(i, st) for i, _, st, _ in world.stack()] == [(a1, "active"), (a2, "disabled"), (a3, "disabled")]
    with world.factory() as s:
        cascaded = registry.get_adapter(s, adapter_id=a3, tenant_id=None)
        assert (
            cascaded.state_reason.startswith(f"cascade from {a2}")
            and cascaded.state_changed_by == "key:admin"
        )


def test_disable_twice_changes_nothing_and_writes_no_audit(world):
    a1 = world.adapter()
    world.disable(a1)
    with world.factory() as s:
        before = s.scalar(select(AuditEntry.id).order_by(AuditEntry.id.desc()).limit(1))
    change = world.disable(a1)
    assert not change.changed
    with world.factory() as s:
        assert s.scalar(select(AuditEntry.id).order_by(AuditEntry.id.desc()).limit(1)) == before
        assert registry.get_adapter(s, adapter_id=a1, tenant_id=None).state == AdapterState.DISABLED


def test_every_change_is_audited_with_actor_and_reason(world):
    a1 = world.adapter()
    world.disable(a1, reason="GDPR art. 17 follow-up")
    world.enable(a1, reason="false alarm")
    with world.factory() as s:
        entries = audit.list_entries(s, tenant_id=world.tenant_id, subject_id=a1)
        assert [(e.action, e.actor, e.reason) for e in reversed(entries)] == [
            ("adapter.create", "worker:w", None),
            ("adapter.disable", "key:admin", "GDPR art. 17 follow-up"),
            ("adapter.enable", "key:admin", "false alarm"),
        ]
        assert audit.verify_chain(s).intact


def test_reason_is_required_and_other_tenants_cannot_touch_it(world):
    a1 = world.adapter()
    with pytest.raises(Invalid), world.factory() as s:
        registry.disable(s, adapter_id=a1, actor="key:admin", reason="  ", tenant_id=world.tenant_id)
    with world.factory() as s, s.begin():
        other = auth.get_or_create_tenant(s, name=f"other-{uuid.uuid4().hex[:8]}").id
    with pytest.raises(NotFound), world.factory() as s:
        registry.disable(s, adapter_id=a1, actor="key:x", reason="mine now", tenant_id=other)


def test_concurrent_completions_get_distinct_consecutive_versions(world):
    request_ids = [world.request() for _ in range(8)]
    errors = []

    def complete(request_id: str) -> None:
        try:
            with world.factory() as s, s.begin():
                registry.create_adapter_version(
                    s,
                    request=request_id,
                    artifact_key=f"adapters/{request_id}",
                    sha256="cd" * 32,
                    parent_stack=[],
                )
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=complete, args=(r,)) for r in request_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [v for _, v, _, _ in world.stack()] == list(range(1, 9))


def test_worker_view_of_a_request(world):
    request_id = world.request()
    with world.factory() as s:
        item = requests.load_work_item(s, request_id=request_id)
    assert (
        item.status == RequestStatus.QUEUED and item.method == "blade" and item.base_model_name == world.model
    )
    assert item.forget.storage_key.startswith(f"datasets/{world.tenant_id}/") and item.forget.kind == "qa"
    assert world.storage.exists(item.retain.storage_key) and item.queue_seq >= 1
    with pytest.raises(NotFound), world.factory() as s:
        requests.load_work_item(s, request_id="req_missing")


def test_a_name_two_tenants_hold_names_no_single_model(world):
    """Names are per tenant, so the worker's tasks name a base model by id; a bare name finds a model only
    while one model has it."""
    from blade_service.worker.artifacts import task_base_model

    with world.factory() as s, s.begin():
        other = auth.get_or_create_tenant(s, name=f"reg-{uuid.uuid4().hex[:8]}").id
        mine = base_models.get_visible(s, name=world.model, tenant_id=world.tenant_id)
        assert task_base_model(s, base_model_id=None, base_model=world.model) is mine  # one model: found
        theirs = base_models.register(s, name=world.model, source="/theirs", tenant_id=other, actor="test")
        assert base_models.get_visible(s, name=world.model, tenant_id=other) is theirs
        assert base_models.get_visible(s, name=world.model, tenant_id=world.tenant_id) is mine
        assert task_base_model(s, base_model_id=theirs.id, base_model=world.model) is theirs
        assert task_base_model(s, base_model_id=None, base_model=world.model) is None
        with pytest.raises(NotFound, match="ambiguous"):
            registry.list_stack(s, world.model)


def test_a_compaction_is_not_stale_once_its_own_versions_are_restored_below_it():
    """Restoring the versions a compaction replaced (disable it, enable them) puts them below it: they are
    what it carries, not a stack it was trained without. Another version enabled below it still counts."""

    def version(vid: str, state: AdapterState, parents: list[str], contains: list[str] | None = None):
        kind = registry.COMPACTION_KIND if contains else "adapter"
        lineage = {"contains": contains} if contains else None
        return AdapterVersion(id=vid, state=state, kind=kind, parent_stack=parents, lineage=lineage)

    active, disabled = AdapterState.ACTIVE, AdapterState.DISABLED
    restored = [
        version("v1", active, []),
        version("v2", active, ["v1"]),
        version("v3", disabled, [], contains=["v1", "v2"]),
        version("v4", active, ["v3"]),  # trained on the compaction: v1 and v2 stand for it
    ]
    assert registry.stale_flags(restored) == {"v1": False, "v2": False, "v3": False, "v4": False}
    extra = [version("v0", active, []), *restored]  # a version the compaction never saw, enabled below it
    assert registry.stale_flags(extra)["v3"] is True
