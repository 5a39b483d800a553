"""The worker's side of a request's life: claiming it under a lease, progress, and the state transitions.

Plain functions over a session with keyword-only arguments; the caller owns the transaction (short sessions:
`with session_scope() as s: claim_request(s, ...)`). No torch, no Celery.

Who runs a request is decided here, in the database, so a redelivered or duplicated task message is harmless:
- `claim_request` takes the request's lease (owner + expiry) with one conditional UPDATE, only when the
  request is not terminal, nobody else holds a live lease, and it is the oldest non-terminal request of its
  base model (`queue_seq` order): requests of one base model run strictly one at a time, in submission order.
- every later write checks the lease (`LeaseLost` when another worker took over after ours expired);
- `renew_lease` is the heartbeat; it also tells the worker whether a cancel was asked for.
- `reconcile_candidates` lists what the reconciler must re-enqueue: heads of their base model's queue that are
  queued but were never (or too long ago) published, and running requests whose lease expired.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, Delete, Update, and_, delete, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from blade_service.persistence import audit
from blade_service.persistence.models import (
    ALLOWED_TRANSITIONS,
    TERMINAL_STATUSES,
    BaseModel,
    RequestStatus,
    TrainingEvent,
    UnlearnRequest,
    WorkerHeartbeat,
    utcnow,
)

ACTIVE_STATUSES = (
    RequestStatus.QUEUED,
    RequestStatus.RUNNING,
    RequestStatus.EVALUATING,
    RequestStatus.CANCELLING,
)
RUNNABLE_STATUSES = (RequestStatus.QUEUED, RequestStatus.RUNNING, RequestStatus.EVALUATING)


class LeaseLost(RuntimeError):
    """Another worker holds this request now (ours expired); stop without writing anything else."""


class InvalidTransition(RuntimeError):
    pass


class ClaimOutcome(enum.StrEnum):
    CLAIMED = "claimed"  # ours: run it
    TERMINAL = "terminal"  # already finished (a duplicate or late redelivery): nothing to do
    BUSY = "busy"  # another worker holds a live lease
    WAITING = "waiting"  # an older request of the same base model is not finished yet
    CANCELLED = "cancelled"  # a cancel arrived before it started: now cancelled
    EXHAUSTED = "exhausted"  # delivered too many times (crash loop): now failed
    MISSING = "missing"  # no such request


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    request_id: str
    status: RequestStatus | None = None  # the status after the claim
    attempt: int = 0
    resumed: bool = False  # an earlier attempt ran (a redelivery after a crash)
    blocked_by: str | None = None  # WAITING: the request ahead of it

    @property
    def claimed(self) -> bool:
        return self.outcome is ClaimOutcome.CLAIMED


@dataclass(frozen=True)
class LeaseState:
    owned: bool
    cancel_requested: bool
    status: RequestStatus | None


# --- helpers ------------------------------------------------------------------------------------------------


def _write(session: Session, statement: Update | Delete) -> CursorResult[Any]:
    """Run an UPDATE or DELETE; its result has `rowcount` (SQLAlchemy types `execute` as a plain Result)."""
    return cast("CursorResult[Any]", session.execute(statement))


def _audit(
    session: Session,
    *,
    request: UnlearnRequest,
    actor: str,
    action: str,
    data: dict[str, Any] | None = None,
    reason: str | None = None,
) -> None:
    """Append an audit entry for a request's state change (through the API package's hash chain)."""
    audit.append(
        session,
        tenant_id=request.tenant_id,
        actor=actor,
        action=action,
        subject_type="unlearn_request",
        subject_id=request.id,
        reason=reason,
        data=data or {},
    )


def _transition(request: UnlearnRequest, new: RequestStatus) -> None:
    old = RequestStatus(request.status)
    if new not in ALLOWED_TRANSITIONS[old]:
        raise InvalidTransition(f"request {request.id}: {old.value} -> {new.value} is not allowed")
    request.status = new


def lock_owned(session: Session, *, request_id: str, owner: str, lock: bool = True) -> UnlearnRequest:
    """The request, if `owner` holds its lease (LeaseLost otherwise)."""
    stmt = (
        select(UnlearnRequest)
        .where(UnlearnRequest.id == request_id)
        .execution_options(populate_existing=True)
    )
    if lock:  # only this table's row (its eager-loaded relationships are outer joins)
        stmt = stmt.with_for_update(of=UnlearnRequest)
    request = session.scalars(stmt).one_or_none()
    if request is None or request.lease_owner != owner:
        raise LeaseLost(
            f"request {request_id}: lease held by {getattr(request, 'lease_owner', None)!r}, not {owner!r}"
        )
    return request


def _cancel_requested(request: UnlearnRequest) -> bool:
    return request.status == RequestStatus.CANCELLING or request.cancel_requested_at is not None


def get_request(session: Session, *, request_id: str) -> UnlearnRequest | None:
    """The request row (fresh from the database)."""
    stmt = (
        select(UnlearnRequest)
        .where(UnlearnRequest.id == request_id)
        .execution_options(populate_existing=True)
    )
    return session.scalars(stmt).one_or_none()


def blocking_request(session: Session, *, request: UnlearnRequest) -> str | None:
    """The oldest unfinished request of the same base model submitted before `request`, if any."""
    stmt = (
        select(UnlearnRequest.id)
        .where(
            UnlearnRequest.base_model_id == request.base_model_id,
            UnlearnRequest.queue_seq < request.queue_seq,
            UnlearnRequest.status.in_(ACTIVE_STATUSES),
        )
        .order_by(UnlearnRequest.queue_seq)
        .limit(1)
    )
    return session.scalars(stmt).first()


# --- claiming and the lease --------------------------------------------------------------------------------


def claim_request(
    session: Session, *, request_id: str, owner: str, lease_seconds: int, max_attempts: int = 5
) -> Claim:
    """Take the request's lease if it may run now (see the module docstring); one short transaction."""
    request = get_request(session, request_id=request_id)
    if request is None:
        return Claim(ClaimOutcome.MISSING, request_id)
    status = RequestStatus(request.status)
    if status in TERMINAL_STATUSES:
        return Claim(ClaimOutcome.TERMINAL, request_id, status)
    now = utcnow()
    if (
        request.lease_owner not in (None, owner)
        and request.lease_expires_at is not None
        and request.lease_expires_at > now
    ):
        return Claim(ClaimOutcome.BUSY, request_id, status)
    if status == RequestStatus.QUEUED and _cancel_requested(request):
        mark_cancelled(session, request=request, actor="system", message="cancelled before it started")
        return Claim(ClaimOutcome.CANCELLED, request_id, RequestStatus.CANCELLED)
    blocker = blocking_request(session, request=request)
    if blocker is not None:
        return Claim(ClaimOutcome.WAITING, request_id, status, blocked_by=blocker)
    if status == RequestStatus.CANCELLING:  # was running when its worker died: finish the cancel
        mark_cancelled(session, request=request, actor="system", message="cancelled")
        return Claim(ClaimOutcome.CANCELLED, request_id, RequestStatus.CANCELLED)
    if request.attempts >= max_attempts:
        mark_failed(
            session,
            request=request,
            actor="system",
            code="too_many_attempts",
            message=f"the request was started {request.attempts} times without finishing "
            "(its worker died each time)",
        )
        return Claim(ClaimOutcome.EXHAUSTED, request_id, RequestStatus.FAILED)

    # The atomic part: whoever's UPDATE matches first owns it; a concurrent claimer matches zero rows.
    lease_free = or_(
        UnlearnRequest.lease_owner.is_(None),
        UnlearnRequest.lease_owner == owner,
        UnlearnRequest.lease_expires_at.is_(None),
        UnlearnRequest.lease_expires_at <= now,
    )
    new_status = RequestStatus.RUNNING if status == RequestStatus.QUEUED else status
    previous_owner = request.lease_owner
    values: dict[str, Any] = {
        "lease_owner": owner,
        "lease_expires_at": now + timedelta(seconds=lease_seconds),
        "heartbeat_at": now,
        "attempts": UnlearnRequest.attempts + 1,
        "status": new_status,
        "updated_at": now,
    }
    if request.started_at is None:
        values["started_at"] = now
    result = _write(
        session,
        update(UnlearnRequest)
        .where(
            UnlearnRequest.id == request_id,
            UnlearnRequest.status == status,
            UnlearnRequest.attempts == request.attempts,
            lease_free,
        )
        .values(**values)
        .execution_options(synchronize_session=False),
    )
    if result.rowcount != 1:
        return Claim(ClaimOutcome.BUSY, request_id, status)
    session.refresh(request)
    resumed = request.attempts > 1
    _audit(
        session,
        request=request,
        actor=f"worker:{owner}",
        action="unlearn_request.resume" if resumed else "unlearn_request.start",
        data={"attempt": request.attempts, "status": new_status.value, "previous_owner": previous_owner},
    )
    return Claim(ClaimOutcome.CLAIMED, request_id, new_status, attempt=request.attempts, resumed=resumed)


def renew_lease(session: Session, *, request_id: str, owner: str, lease_seconds: int) -> LeaseState:
    """Heartbeat: push the lease's expiry out if we still hold it; also report a pending cancel."""
    now = utcnow()
    result = _write(
        session,
        update(UnlearnRequest)
        .where(UnlearnRequest.id == request_id, UnlearnRequest.lease_owner == owner)
        .values(lease_expires_at=now + timedelta(seconds=lease_seconds), heartbeat_at=now)
        .execution_options(synchronize_session=False),
    )
    row = session.execute(
        select(UnlearnRequest.status, UnlearnRequest.cancel_requested_at).where(
            UnlearnRequest.id == request_id
        )
    ).one_or_none()
    if row is None:
        return LeaseState(owned=False, cancel_requested=True, status=None)
    status = RequestStatus(row.status)
    cancel = status == RequestStatus.CANCELLING or row.cancel_requested_at is not None
    return LeaseState(owned=result.rowcount == 1, cancel_requested=cancel, status=status)


def release_lease(session: Session, *, request_id: str, owner: str) -> None:
    """Give the lease up (after a terminal state, or to let another worker take over at once)."""
    session.execute(
        update(UnlearnRequest)
        .where(UnlearnRequest.id == request_id, UnlearnRequest.lease_owner == owner)
        .values(lease_owner=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )


def is_cancel_requested(session: Session, *, request_id: str) -> bool:
    row = session.execute(
        select(UnlearnRequest.status, UnlearnRequest.cancel_requested_at).where(
            UnlearnRequest.id == request_id
        )
    ).one_or_none()
    return row is None or row.status == RequestStatus.CANCELLING or row.cancel_requested_at is not None


# --- progress -----------------------------------------------------------------------------------------------


def record_step(
    session: Session, *, request_id: str, owner: str, record: dict[str, Any], total_steps: int | None = None
) -> None:
    """Store one history record as a TrainingEvent (replacing that step's, if a resumed run re-publishes it)
    and move the request's progress to it."""
    request = lock_owned(session, request_id=request_id, owner=owner, lock=False)
    step = int(record.get("step", request.step + 1))
    session.execute(
        delete(TrainingEvent).where(TrainingEvent.request_id == request_id, TrainingEvent.step == step)
    )
    session.add(TrainingEvent(request_id=request_id, step=step, record=_jsonable(record)))
    request.step = step
    if total_steps is not None:
        request.total_steps = total_steps
    request.updated_at = utcnow()


def drop_steps_after(session: Session, *, request_id: str, step: int) -> int:
    """Forget events past `step` (a resumed run restarts from its checkpoint at `step`)."""
    result = _write(
        session,
        delete(TrainingEvent).where(TrainingEvent.request_id == request_id, TrainingEvent.step > step),
    )
    return int(result.rowcount or 0)


def last_step(session: Session, *, request_id: str) -> int:
    return int(
        session.scalar(select(func.max(TrainingEvent.step)).where(TrainingEvent.request_id == request_id))
        or 0
    )


def set_run_info(
    session: Session,
    *,
    request_id: str,
    owner: str,
    total_steps: int | None = None,
    checkpoint_key: str | None = None,
    metrics_before: dict[str, Any] | None = None,
) -> None:
    request = lock_owned(session, request_id=request_id, owner=owner)
    if total_steps is not None:
        request.total_steps = total_steps
    if checkpoint_key is not None:
        request.checkpoint_key = checkpoint_key
    if metrics_before is not None:
        request.metrics_before = _jsonable(metrics_before)
    request.updated_at = utcnow()


# --- state transitions --------------------------------------------------------------------------------------


def mark_evaluating(session: Session, *, request_id: str, owner: str, run_status: str | None = None) -> None:
    request = lock_owned(session, request_id=request_id, owner=owner)
    # A cancel that arrived after the last step leaves the request `cancelling`; the worker honours it
    # before registering the adapter.
    if request.status not in (RequestStatus.EVALUATING, RequestStatus.CANCELLING):
        _transition(request, RequestStatus.EVALUATING)
        _audit(
            session,
            request=request,
            actor=f"worker:{owner}",
            action="unlearn_request.evaluate",
            data={"run_status": run_status, "step": request.step},
        )
    if run_status is not None:
        request.run_status = run_status
    request.updated_at = utcnow()


def mark_succeeded(
    session: Session,
    *,
    request_id: str,
    owner: str,
    adapter_id: str,
    metrics_after: dict[str, Any] | None = None,
    gate: dict[str, Any] | None = None,
) -> None:
    request = lock_owned(session, request_id=request_id, owner=owner)
    if metrics_after is not None:
        request.metrics_after = _jsonable(metrics_after)
    if gate is not None:  # the policy gate's verdict (persistence/policy.py)
        request.gate = _jsonable(gate)
    _transition(request, RequestStatus.SUCCEEDED)
    _finish(request)
    _audit(
        session,
        request=request,
        actor=f"worker:{owner}",
        action="unlearn_request.succeed",
        data={"adapter_id": adapter_id, "step": request.step, "run_status": request.run_status},
    )


def mark_rejected(
    session: Session,
    *,
    request_id: str,
    owner: str,
    adapter_id: str,
    gate: dict[str, Any],
    message: str,
    metrics_after: dict[str, Any] | None = None,
) -> None:
    """Trained, but the base model's policy held the adapter back (stored disabled): terminal `rejected`."""
    request = lock_owned(session, request_id=request_id, owner=owner)
    if metrics_after is not None:
        request.metrics_after = _jsonable(metrics_after)
    request.gate = _jsonable(gate)
    request.error_code, request.error_message = "policy_rejected", message[:4000]
    _transition(request, RequestStatus.REJECTED)
    _finish(request)
    _audit(
        session,
        request=request,
        actor=f"worker:{owner}",
        action="unlearn_request.reject",
        data={"adapter_id": adapter_id, "failed": gate.get("failed", []), "step": request.step},
        reason=message,
    )


def mark_failed(
    session: Session,
    *,
    request: UnlearnRequest | None = None,
    request_id: str | None = None,
    owner: str | None = None,
    actor: str | None = None,
    code: str,
    message: str,
) -> bool:
    """Fail the request with a code and a readable message; False if it was already terminal."""
    request = request or _owned_or_any(session, request_id=request_id, owner=owner)
    if request is None or request.status in TERMINAL_STATUSES:
        return False
    _transition(request, RequestStatus.FAILED)
    request.error_code, request.error_message = code, message[:4000]
    _finish(request)
    _audit(
        session,
        request=request,
        actor=actor or f"worker:{owner}",
        action="unlearn_request.fail",
        data={"code": code, "message": message[:1000]},
    )
    return True


def mark_cancelled(
    session: Session,
    *,
    request: UnlearnRequest | None = None,
    request_id: str | None = None,
    owner: str | None = None,
    actor: str | None = None,
    message: str = "cancelled",
) -> bool:
    """Cancel the request (a cancel that was asked for has now taken effect); False if already terminal."""
    request = request or _owned_or_any(session, request_id=request_id, owner=owner)
    if request is None or request.status in TERMINAL_STATUSES:
        return False
    _transition(request, RequestStatus.CANCELLED)
    request.error_code, request.error_message = "cancelled", message
    _finish(request)
    _audit(
        session,
        request=request,
        actor=actor or f"worker:{owner}",
        action="unlearn_request.cancelled",
        data={"step": request.step},
    )
    return True


def _owned_or_any(session: Session, *, request_id: str | None, owner: str | None) -> UnlearnRequest | None:
    """With `owner`: the request locked, if `owner` holds its lease (LeaseLost otherwise); without: as is."""
    if owner is not None:
        return lock_owned(session, request_id=str(request_id), owner=owner)
    return get_request(session, request_id=str(request_id))


def _finish(request: UnlearnRequest) -> None:
    now = utcnow()
    request.finished_at = now
    request.updated_at = now
    request.lease_owner = None
    request.lease_expires_at = None


# --- dispatch bookkeeping and the reconciler ---------------------------------------------------------------


def mark_enqueued(session: Session, *, request_ids: list[str]) -> None:
    """Remember when a task was last published for these requests."""
    if request_ids:
        session.execute(
            update(UnlearnRequest)
            .where(UnlearnRequest.id.in_(request_ids))
            .values(enqueued_at=utcnow())
            .execution_options(synchronize_session=False)
        )


def unpublished_heads(session: Session, *, limit: int = 100) -> list[tuple[str, str | None]]:
    """(id, trace id) of the queued requests that head their base model's queue (nothing unfinished before
    them) and whose task was never published, oldest first: what the submission relay publishes. Locked FOR
    UPDATE SKIP LOCKED on PostgreSQL, so relays running side by side share them out instead of publishing
    one twice."""
    other = aliased(UnlearnRequest)
    ahead = (
        select(other.id)
        .where(
            other.base_model_id == UnlearnRequest.base_model_id,
            other.queue_seq < UnlearnRequest.queue_seq,
            other.status.in_(ACTIVE_STATUSES),
        )
        .exists()
    )
    stmt = (
        select(UnlearnRequest.id, UnlearnRequest.trace_id)
        .where(
            UnlearnRequest.status == RequestStatus.QUEUED,
            UnlearnRequest.enqueued_at.is_(None),
            ~ahead,
        )
        .order_by(UnlearnRequest.created_at)
        .limit(limit)
        .with_for_update(skip_locked=True, of=UnlearnRequest)
    )
    return [(row.id, row.trace_id) for row in session.execute(stmt)]


def next_in_line(session: Session, *, base_model_id: str) -> str | None:
    """The oldest unfinished request of a base model (the only one that may run now), read under a share lock
    on the base model's row. A submission holds that row locked until it commits; the lock makes this read
    wait for it, so a request submitted while the one before it finishes is seen here at once (the worker
    publishes it) instead of at the submission relay's next poll."""
    session.execute(select(BaseModel.id).where(BaseModel.id == base_model_id).with_for_update(read=True))
    return session.scalars(
        select(UnlearnRequest.id)
        .where(UnlearnRequest.base_model_id == base_model_id, UnlearnRequest.status.in_(ACTIVE_STATUSES))
        .order_by(UnlearnRequest.queue_seq)
        .limit(1)
    ).first()


def head_to_publish(session: Session, *, base_model_id: str) -> str | None:
    """The base model's next in line (`next_in_line`, so a submission racing the finish is seen) when it is
    queued and its task was never published, locked FOR UPDATE SKIP LOCKED as `unpublished_heads` locks
    it: what the worker that finished the request before it publishes, marking it in the same transaction.
    None when a relay or the reconciler published it already (or is publishing it now), or when it runs.
    A second task would only be consumed as a no-op, and each no-op's own finish used to publish the head
    once more (docs/performance.md)."""
    head = next_in_line(session, base_model_id=base_model_id)
    if head is None:
        return None
    return session.scalars(
        select(UnlearnRequest.id)
        .where(
            UnlearnRequest.id == head,
            UnlearnRequest.status == RequestStatus.QUEUED,
            UnlearnRequest.enqueued_at.is_(None),
        )
        .with_for_update(skip_locked=True)
    ).first()


def mark_unpublished(session: Session, *, request_id: str) -> None:
    """Its task was consumed without running it (an older request of its base model was active again): none
    is in flight now, so the finish before it, or a relay, publishes it when it heads its queue."""
    session.execute(
        update(UnlearnRequest)
        .where(UnlearnRequest.id == request_id, UnlearnRequest.status == RequestStatus.QUEUED)
        .values(enqueued_at=None)
        .execution_options(synchronize_session=False)
    )


# How long a submitted request may go unpublished before the reconciler publishes it: a worker's submission
# relay publishes it within moments of its commit, and a reconcile pass in between would only send a
# duplicate.
PUBLISH_GRACE_S = 10.0


def reconcile_candidates(
    session: Session,
    *,
    now: datetime | None = None,
    requeue_after_s: float = 300.0,
    publish_grace_s: float = PUBLISH_GRACE_S,
) -> list[str]:
    """Requests whose task the broker may have lost, to publish again (a duplicate is consumed as a no-op),
    locked until the caller commits (FOR UPDATE SKIP LOCKED, as the relays lock what they publish):
    - the head of each base model's queue when it is runnable, nobody holds a live lease, and its task was
      never published though it was submitted more than `publish_grace_s` ago (the API publishes right after
      its commit), or last published more than `requeue_after_s` ago (a worker busy elsewhere may simply
      not have reached it yet: don't flood the queue);
    - any head whose lease has expired (its worker died), at once.
    """
    now = now or utcnow()
    seq = (
        select(UnlearnRequest.base_model_id, func.min(UnlearnRequest.queue_seq).label("seq"))
        .where(UnlearnRequest.status.in_(ACTIVE_STATUSES))
        .group_by(UnlearnRequest.base_model_id)
        .subquery()
    )
    stale = now - timedelta(seconds=requeue_after_s)
    lease_expired = and_(UnlearnRequest.lease_owner.is_not(None), UnlearnRequest.lease_expires_at <= now)
    no_lease = or_(UnlearnRequest.lease_owner.is_(None), UnlearnRequest.lease_expires_at.is_(None))
    never_sent = and_(
        UnlearnRequest.enqueued_at.is_(None),
        UnlearnRequest.created_at <= now - timedelta(seconds=publish_grace_s),
    )
    never_or_long_ago = or_(never_sent, UnlearnRequest.enqueued_at <= stale)
    stmt = (
        select(UnlearnRequest.id)
        .join(
            seq,
            and_(seq.c.base_model_id == UnlearnRequest.base_model_id, seq.c.seq == UnlearnRequest.queue_seq),
        )
        .where(or_(lease_expired, and_(no_lease, never_or_long_ago)))
        .order_by(UnlearnRequest.created_at)
        # A relay publishing one of them holds its row: skipped here, it is not published twice.
        .with_for_update(skip_locked=True, of=UnlearnRequest)
    )
    return list(session.scalars(stmt))


def expire_lease_now(session: Session, *, request_id: str) -> None:
    """Mark a lease as expired (tests, and an operator who knows the worker is gone)."""
    session.execute(
        update(UnlearnRequest)
        .where(UnlearnRequest.id == request_id)
        .values(lease_expires_at=utcnow())
        .execution_options(synchronize_session=False)
    )


# --- worker heartbeats --------------------------------------------------------------------------------------


def beat_worker(
    session: Session,
    *,
    worker_name: str,
    queues: list[str] | None = None,
    hostname: str | None = None,
    pid: int | None = None,
    current_request_id: str | None = None,
    info: dict[str, Any] | None = None,
    alive: bool = True,
) -> None:
    """Upsert the worker's heartbeat row."""
    row = session.get(WorkerHeartbeat, worker_name)
    now = utcnow()
    if row is None:
        row = WorkerHeartbeat(worker_name=worker_name, started_at=now)
        session.add(row)
    if queues is not None:
        row.queues = list(queues)
    if hostname is not None:
        row.hostname = hostname
    if pid is not None:
        row.pid = pid
    if info is not None:
        row.info = _jsonable(info)
    row.current_request_id = current_request_id
    row.last_seen = now
    row.alive = alive


def _jsonable(value: Any) -> Any:
    """JSON-safe copy: numpy/torch scalars to floats, NaN/inf to None, tuples to lists."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError):
            pass
    try:
        return _jsonable(float(value))
    except (TypeError, ValueError):
        return str(value)
