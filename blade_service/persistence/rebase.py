"""Rebase on rollback: re-run the requests whose adapters were trained on top of a version being disabled.

`POST /adapters/{id}/disable {"cascade": "retrain"}` disables the version, then `plan_retrains` queues one new
request per later active version trained on top of it, in version order, with the original request's data,
method, params and metadata plus `metadata.rebase = {replaces, replaces_version, batch, trigger}`. The worker
trains each one on the active stack *without the versions of the batch* (so the first retrain sits directly on
the new stack, and each next one on the retrains before it: `worker.run_context`), and once a retrain
succeeds it disables the version it replaces ("replaced by vN") and records `lineage.retrain_of`. Until then
the old version stays active, so the effective model never forgets less than before.

A version cannot be retrained when its forget data is gone (the retention policy purged it: forget data must
not outlive its purpose) or when it is a compacted version; the plan says why, that version keeps its stale
flag, and `retrain_one` lets the operator supply the same data again (same sha256) for that one version.
The retrains are trained without it underneath (it is in the batch too), so once it is retrained as well the
whole stack is consistent again; until then the versions above it are flagged as well.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from blade_service.persistence import audit, requests
from blade_service.persistence.errors import Conflict, Invalid
from blade_service.persistence.models import AdapterState, AdapterVersion, Dataset, UnlearnRequest


def not_retrainable(adapter: AdapterVersion) -> str | None:
    """Why `adapter` cannot be re-run with the data it was trained on (None: it can)."""
    req = adapter.request
    if req is None:
        return "a compacted version: disable it and retrain the versions it contains instead"
    for role, dataset in (("forget", req.forget_dataset), ("retain", req.retain_dataset)):
        if dataset.purged_at is not None:
            return (
                f"its {role} data ({dataset.id}) was purged at {dataset.purged_at.isoformat()}; upload the "
                f"same file again and POST /adapters/{adapter.id}/retrain with its dataset id"
            )
    return None


def _queue(
    session: Session,
    *,
    adapter: AdapterVersion,
    forget_dataset_id: str,
    batch: list[str],
    trigger: str,
    actor: str,
    actor_key_id: str | None,
) -> UnlearnRequest:
    original = adapter.request
    if original is None:  # a compacted version has no request: callers never queue one
        raise ValueError(f"adapter {adapter.id} was not made by a request: nothing to retrain")
    meta = dict(original.meta or {})
    meta["rebase"] = {
        "replaces": adapter.id,
        "replaces_version": adapter.version,
        "original_request": original.id,
        "batch": batch,
        "trigger": trigger,
    }
    request, _ = requests.create_request(
        session,
        tenant_id=original.tenant_id,
        base_model=adapter.base_model.name,
        forget_dataset=forget_dataset_id,
        retain_dataset=original.retain_dataset_id,
        method=original.method,
        params=dict(original.params or {}),
        metadata=meta,
        actor=actor,
        actor_key_id=actor_key_id,
    )
    return request


def plan_retrains(
    session: Session,
    *,
    disabled: AdapterVersion,
    dependents: list[AdapterVersion],
    actor: str,
    actor_key_id: str | None = None,
    tenant_id: str | None = None,
) -> list[dict[str, Any]]:
    """Queue a retrain for each dependent that can have one; per version: the request or why not."""
    ordered = sorted(dependents, key=lambda a: a.version)
    batch = [a.id for a in ordered]  # all of them: a version that cannot be retrained now may be later
    plan = []
    for adapter in ordered:
        why = not_retrainable(adapter)
        if why is not None:
            plan.append(
                {"adapter_id": adapter.id, "version": adapter.version, "request_id": None, "reason": why}
            )
            continue
        request = _queue(
            session,
            adapter=adapter,
            forget_dataset_id=_forget_dataset_of(adapter),
            batch=batch,
            trigger=disabled.id,
            actor=actor,
            actor_key_id=actor_key_id,
        )
        plan.append(
            {"adapter_id": adapter.id, "version": adapter.version, "request_id": request.id, "reason": None}
        )
    audit.append(
        session,
        action="adapter.rebase",
        subject_type="adapter",
        subject_id=disabled.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=tenant_id,
        data={"base_model": disabled.base_model.name, "version": disabled.version, "retrains": plan},
    )
    return plan


def retrain_one(
    session: Session,
    *,
    adapter: AdapterVersion,
    forget_dataset_id: str | None,
    actor: str,
    actor_key_id: str | None = None,
) -> UnlearnRequest:
    """Re-run one active version on the current stack; `forget_dataset_id` supplies its forget data again
    (it must have the sha256 the version was trained on)."""
    if adapter.request is None:
        raise Conflict(
            f"adapter {adapter.id} is a compacted version: nothing to retrain", code="not_retrainable"
        )
    if adapter.state != AdapterState.ACTIVE:
        raise Conflict(f"adapter {adapter.id} is disabled: enable it or leave it out", code="not_active")
    forget_id = forget_dataset_id or adapter.request.forget_dataset_id
    dataset = session.get(Dataset, forget_id)
    if dataset is None or dataset.tenant_id != adapter.request.tenant_id:
        raise Invalid(
            f"forget_dataset: no dataset {forget_id!r} of the request's tenant", field="forget_dataset"
        )
    if dataset.sha256 != adapter.forget_sha256:
        raise Invalid(
            f"forget_dataset: {forget_id} has sha256 {dataset.sha256}, but v{adapter.version} was trained on "
            f"{adapter.forget_sha256}: supply the same file",
            field="forget_dataset",
        )
    if dataset.purged_at is not None:
        raise Invalid(f"forget_dataset: {forget_id} was purged; upload it again", field="forget_dataset")
    return _queue(
        session,
        adapter=adapter,
        forget_dataset_id=dataset.id,
        batch=[adapter.id],
        trigger=adapter.id,
        actor=actor,
        actor_key_id=actor_key_id,
    )


def _forget_dataset_of(adapter: AdapterVersion) -> str:
    """The forget dataset of the request that made `adapter` (one `not_retrainable` found retrainable)."""
    if adapter.request is None:
        raise ValueError(f"adapter {adapter.id} was not made by a request: nothing to retrain")
    return adapter.request.forget_dataset_id
