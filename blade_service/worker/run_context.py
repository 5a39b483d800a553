"""What one attempt at an unlearn request knows (`RunContext`), read from the database once, at its start."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from blade_service.persistence import jobs, policy
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import AdapterVersion, BaseModel, Dataset, RequestStatus
from blade_service.persistence.settings import Settings
from blade_service.persistence.storage import Storage, get_storage
from blade_service.worker.artifacts import active_stack
from blade_service.worker.errors import TaskFailure
from blade_service.worker.stacks import earlier_forgets


@dataclass
class RunContext:
    """What one attempt at a request knows; read from the database once, at the start."""

    settings: Settings
    storage: Storage
    owner: str
    request_id: str
    tenant_id: str
    base_model_id: str
    base_model_name: str
    base_source: str
    method: str
    params: dict[str, Any]
    status: RequestStatus
    attempt: int
    forget: dict[str, str]  # id, key, sha256
    retain: dict[str, str]
    metrics_before: dict[str, Any] | None
    checkpoint_key: str | None
    workdir: Path
    stack: list[dict[str, Any]] = field(default_factory=list)  # [{id, key, sha256, version}]
    # The base model's unlearning policy and canary dataset ({id, key, sha256} or None): worker/stacks.py
    policy: dict[str, Any] = field(default_factory=dict)
    canary: dict[str, str] | None = None
    base_revision: str | None = None  # the registered hub revision, named in adapter_config.json
    rebase: dict[str, Any] = field(default_factory=dict)  # a retrain's metadata.rebase (persistence/rebase)
    earlier: list[dict[str, Any]] = field(default_factory=list)  # a retrain's earlier forget sets
    # the request's probe_datasets (persistence.requests.PROBE_KINDS): kind -> {id, key, sha256}
    probes: dict[str, dict[str, str]] = field(default_factory=dict)

    def write(self, fn: Any, **kwargs: Any) -> Any:
        """Run one persistence.jobs function in its own short transaction, as the lease owner."""
        with session_scope(self.settings) as session:
            return fn(session, request_id=self.request_id, owner=self.owner, **kwargs)


def load_context(settings: Settings, *, owner: str, request_id: str, attempt: int) -> RunContext:
    """The context of attempt `attempt` at `request_id`; the stack is the one its first attempt measured."""
    storage = get_storage(settings)
    with session_scope(settings) as session:
        req = jobs.get_request(session, request_id=request_id)
        if req is None:
            raise TaskFailure("not_found", f"request {request_id} vanished")
        base: BaseModel = req.base_model
        ctx = RunContext(
            settings=settings,
            storage=storage,
            owner=owner,
            request_id=req.id,
            tenant_id=req.tenant_id,
            base_model_id=base.id,
            base_model_name=base.name,
            base_source=base.source,
            method=req.method,
            params=dict(req.params or {}),
            status=RequestStatus(req.status),
            attempt=attempt,
            forget={
                "id": req.forget_dataset.id,
                "key": req.forget_dataset.storage_key,
                "sha256": req.forget_dataset.sha256,
            },
            retain={
                "id": req.retain_dataset.id,
                "key": req.retain_dataset.storage_key,
                "sha256": req.retain_dataset.sha256,
            },
            metrics_before=dict(req.metrics_before) if req.metrics_before else None,
            checkpoint_key=req.checkpoint_key,
            workdir=settings.data_dir.resolve() / "work" / req.id,
            rebase=dict((req.meta or {}).get("rebase") or {}),
        )

        ctx.policy = policy.effective(base)
        ctx.base_revision = base.revision
        canary = session.get(Dataset, base.canary_dataset_id) if base.canary_dataset_id else None
        if canary is not None and getattr(canary, "purged_at", None) is None:
            ctx.canary = {"id": canary.id, "key": canary.storage_key, "sha256": canary.sha256}
        for kind, dataset_id in (ctx.params.get("probe_datasets") or {}).items():
            probe = session.get(Dataset, dataset_id)
            if probe is not None and getattr(probe, "purged_at", None) is None:
                ctx.probes[kind] = {"id": probe.id, "key": probe.storage_key, "sha256": probe.sha256}
        recorded = (ctx.metrics_before or {}).get("stack")
        if recorded is not None:
            # A resumed attempt trains on the stack the first attempt measured, whatever changed since.
            rows = session.scalars(select(AdapterVersion).where(AdapterVersion.id.in_(recorded))).all()
            by_id = {a.id: a for a in rows}
            stack = [by_id[i] for i in recorded if i in by_id]
        else:
            stack = active_stack(session, base_model_id=base.id)
            # A retrain (persistence/rebase.py) sits on the new stack: without the versions being retrained.
            batch = set(ctx.rebase.get("batch", []))
            stack = [a for a in stack if a.id not in batch]
        ctx.stack = [
            {"id": a.id, "key": a.storage_key, "sha256": a.sha256, "version": a.version} for a in stack
        ]
        if ctx.rebase:  # a retrain must keep the stack's earlier forget sets forgotten (the gate checks)
            ctx.earlier = earlier_forgets(session, [a["id"] for a in ctx.stack])
    return ctx
