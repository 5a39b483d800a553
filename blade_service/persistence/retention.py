"""The forget data does not outlive its request: dataset deletion and the automatic purge.

A forget dataset's bytes are purged from the artifact store once every request that names it as forget data
has ended and its retention has passed: `forget_retention_success_s` after a success (default 0: at once) and
`forget_retention_failure_s` after a failure or cancel (default 3 days, so it can be retried), per base model,
else the settings' defaults (`BLADE_FORGET_RETENTION_SUCCESS_S`, `BLADE_FORGET_RETENTION_FAILURE_S`); a
longer retention is the operator's explicit choice. The worker purges right after a request ends (its local
copies and checkpoints go with its scratch dir); the maintenance worker's periodic pass catches the rest (a
request cancelled while queued, a retention that ran out later). `DELETE /datasets/{id}` purges any dataset
of the tenant's at once, refused with 409 while a queued or running request uses it. A dataset nothing
names (no request as forget, retain or probe data, no base model as its canary) is purged
`unused_dataset_retention_s` after its upload (default 7 days; 0 keeps it): forget data uploaded for a request
that was never made has no request whose end would purge it. What remains of a purged dataset is its row:
name, sha256, row count, size, and `purged_at`; every purge is audited as `dataset.purge`.

    purge_due(session, storage, settings=settings)          # -> ids purged now
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Text, cast, exists, or_, select
from sqlalchemy.orm import Session

from blade_service.persistence import audit
from blade_service.persistence.errors import Conflict, NotFound
from blade_service.persistence.models import (
    TERMINAL_STATUSES,
    BaseModel,
    Dataset,
    RequestStatus,
    UnlearnRequest,
    utcnow,
)
from blade_service.persistence.settings import Settings
from blade_service.persistence.storage import Storage, StorageError


def retention_s(base_model: BaseModel, settings: Settings, *, status: RequestStatus) -> int:
    """How long the forget data of a request that ended in `status` is kept (seconds)."""
    if status == RequestStatus.SUCCEEDED:
        own = base_model.forget_retention_success_s
        return settings.forget_retention_success_s if own is None else own
    own = base_model.forget_retention_failure_s
    return settings.forget_retention_failure_s if own is None else own


def _named(dataset_id: object) -> list[ColumnElement[bool]]:
    """What names a dataset as a column can: a request's forget or retain data, a base model's canary."""
    return [
        exists().where(
            or_(
                UnlearnRequest.forget_dataset_id == dataset_id, UnlearnRequest.retain_dataset_id == dataset_id
            )
        ),
        exists().where(BaseModel.canary_dataset_id == dataset_id),
    ]


def _probe_ids(session: Session, *, dataset_id: str | None = None) -> set[str]:
    """The dataset ids requests name in `params.probe_datasets` (only `dataset_id`, when given): JSON, so
    read back rather than joined; the text match only narrows the rows read."""
    needle = dataset_id or "probe_datasets"
    found: set[str] = set()
    for params in session.scalars(
        select(UnlearnRequest.params).where(cast(UnlearnRequest.params, Text).contains(needle))
    ):
        probes = (params or {}).get("probe_datasets") or {}
        found.update(v for v in probes.values() if isinstance(v, str))
    return found if dataset_id is None else found & {dataset_id}


def unused_purge_due_at(session: Session, dataset: Dataset, *, settings: Settings) -> datetime | None:
    """When an unnamed dataset's bytes go (`unused_dataset_retention_s` after its upload); None once
    anything names it, or when unused datasets are kept."""
    if not settings.unused_dataset_retention_s:
        return None
    if session.scalar(select(or_(*_named(dataset.id)))) or _probe_ids(session, dataset_id=dataset.id):
        return None
    return dataset.created_at + timedelta(seconds=settings.unused_dataset_retention_s)


def _unused_candidates(session: Session, *, settings: Settings) -> list[str]:
    """Unpurged datasets older than the unused retention that no column names (probes are checked after)."""
    if not settings.unused_dataset_retention_s:
        return []
    cutoff = utcnow() - timedelta(seconds=settings.unused_dataset_retention_s)
    ids = session.scalars(
        select(Dataset.id)
        .where(Dataset.purged_at.is_(None), Dataset.created_at <= cutoff)
        .where(*(~named for named in _named(Dataset.id)))
        .order_by(Dataset.created_at)
    ).all()
    probes = _probe_ids(session) if ids else set()
    return [i for i in ids if i not in probes]


def _users(session: Session, dataset_id: str) -> list[UnlearnRequest]:
    return list(
        session.scalars(
            select(UnlearnRequest).where(
                or_(
                    UnlearnRequest.forget_dataset_id == dataset_id,
                    UnlearnRequest.retain_dataset_id == dataset_id,
                )
            )
        )
    )


def purge_due_at(session: Session, dataset: Dataset, *, settings: Settings) -> datetime | None:
    """When the forget dataset's bytes may go; None while a request needs it or none names it as forget."""
    users = _users(session, dataset.id)
    if any(RequestStatus(r.status) not in TERMINAL_STATUSES for r in users):
        return None
    ends = [
        (r.finished_at or r.updated_at)
        + timedelta(seconds=retention_s(r.base_model, settings, status=RequestStatus(r.status)))
        for r in users
        if r.forget_dataset_id == dataset.id
    ]
    return max(ends) if ends else None


def purge_dataset(
    session: Session,
    storage: Storage,
    *,
    dataset: Dataset,
    actor: str,
    reason: str,
    actor_key_id: str | None = None,
) -> bool:
    """Delete the dataset's bytes, mark the row purged and audit it; False when it was already purged."""
    if dataset.purged_at is not None:
        return False
    storage.delete(dataset.storage_key)
    dataset.purged_at = utcnow()
    dataset.purge_reason = reason
    audit.append(
        session,
        action="dataset.purge",
        subject_type="dataset",
        subject_id=dataset.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=dataset.tenant_id,
        reason=reason,
        data={"sha256": dataset.sha256, "rows": dataset.rows, "size_bytes": dataset.size_bytes},
    )
    return True


def delete_dataset(
    session: Session,
    storage: Storage,
    *,
    tenant_id: str,
    dataset_id: str,
    actor: str,
    actor_key_id: str | None = None,
) -> Dataset:
    """`DELETE /datasets/{id}`: purge the tenant's dataset now (Conflict while a request still uses it)."""
    dataset = session.get(Dataset, dataset_id, with_for_update=True, populate_existing=True)
    if dataset is None or dataset.tenant_id != tenant_id:
        raise NotFound(f"no dataset {dataset_id!r}")
    busy = [r.id for r in _users(session, dataset_id) if RequestStatus(r.status) not in TERMINAL_STATUSES]
    if busy:
        raise Conflict(
            f"dataset {dataset_id} is used by unfinished request(s) {', '.join(busy)}; "
            "cancel them or wait until they end",
            code="dataset_in_use",
        )
    purge_dataset(
        session, storage, dataset=dataset, actor=actor, actor_key_id=actor_key_id, reason="deleted by request"
    )
    return dataset


def _purge_if_due(session: Session, storage: Storage, dataset: Dataset, *, settings: Settings) -> bool:
    due = purge_due_at(session, dataset, settings=settings)
    if due is None or due > utcnow():
        return False
    return purge_dataset(
        session, storage, dataset=dataset, actor="system", reason="forget data retention ended"
    )


def _purge_if_unused(session: Session, storage: Storage, dataset: Dataset, *, settings: Settings) -> bool:
    """Under the dataset's row lock: a submission naming it holds FOR SHARE, so it has committed (and is
    seen here) or waits and then finds the dataset purged."""
    due = unused_purge_due_at(session, dataset, settings=settings)
    if due is None or due > utcnow():
        return False
    days = settings.unused_dataset_retention_s / 86400
    return purge_dataset(
        session,
        storage,
        dataset=dataset,
        actor="system",
        reason=f"unused: nothing named it within {days:g} days of its upload",
    )


def purge_for_request(session: Session, storage: Storage, *, request_id: str, settings: Settings) -> bool:
    """Right after a request ends: purge its forget dataset if its retention is already over."""
    request = session.get(UnlearnRequest, request_id)
    if request is None:
        return False
    dataset = session.get(Dataset, request.forget_dataset_id, with_for_update=True, populate_existing=True)
    return dataset is not None and _purge_if_due(session, storage, dataset, settings=settings)


def purge_due(session: Session, storage: Storage, *, settings: Settings) -> list[str]:
    """The periodic pass: purge every forget dataset whose retention is over and every unused dataset past
    its own; the ids purged.

    A dataset whose bytes cannot be deleted now (the store is away) is left for the next pass.
    """
    forget: Iterable[str] = session.scalars(
        select(Dataset.id)
        .where(Dataset.purged_at.is_(None))
        .where(Dataset.id.in_(select(UnlearnRequest.forget_dataset_id)))
        .order_by(Dataset.created_at)
    ).all()
    passes = [(_purge_if_due, forget), (_purge_if_unused, _unused_candidates(session, settings=settings))]
    purged = []
    for purge_if, candidates in passes:
        for candidate in candidates:
            try:
                with session.begin_nested():
                    dataset = session.get(Dataset, candidate, with_for_update=True, populate_existing=True)
                    if dataset is not None and purge_if(session, storage, dataset, settings=settings):
                        purged.append(dataset.id)
            except StorageError:
                continue
    return purged


def retention_of(base_model: BaseModel, settings: Settings) -> dict[str, int | None]:
    """The model's own retention (None: the default) and the effective one, in seconds."""
    return {
        "success_s": base_model.forget_retention_success_s,
        "failure_s": base_model.forget_retention_failure_s,
        "effective_success_s": retention_s(base_model, settings, status=RequestStatus.SUCCEEDED),
        "effective_failure_s": retention_s(base_model, settings, status=RequestStatus.FAILED),
    }


def set_retention(
    session: Session,
    *,
    base_model: BaseModel,
    success_s: int | None,
    failure_s: int | None,
    actor: str,
    actor_key_id: str | None = None,
) -> BaseModel:
    """Set how long this model's forget data outlives its requests (None: back to the default); audited."""
    before = {
        "success_s": base_model.forget_retention_success_s,
        "failure_s": base_model.forget_retention_failure_s,
    }
    base_model.forget_retention_success_s = success_s
    base_model.forget_retention_failure_s = failure_s
    audit.append(
        session,
        action="base_model.retention",
        subject_type="base_model",
        subject_id=base_model.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=base_model.tenant_id,
        data={"before": before, "after": {"success_s": success_s, "failure_s": failure_s}},
    )
    return base_model
