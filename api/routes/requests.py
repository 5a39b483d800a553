"""Unlearn requests: submit (202, `Idempotency-Key`), list, get, events, metrics, cancel."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Header, Query, Response

from api.deps import ReadKey, SessionDep, SubmitKey
from api.schemas import CancelIn, MetricsOut, UnlearnRequestIn, UnlearnRequestOut
from persistence import auth, requests
from persistence.models import RequestStatus

router = APIRouter(prefix="/unlearn-requests", tags=["unlearn requests"])
log = logging.getLogger("blade.api")


@router.post("", status_code=202, response_model=UnlearnRequestOut)
def submit(
    body: UnlearnRequestIn,
    session: SessionDep,
    key: SubmitKey,
    response: Response,
    idempotency_key: str | None = Header(default=None, alias="Idempotency-Key"),
):
    """Validate and queue a request; a repeated `Idempotency-Key` returns the original request."""
    request, created = requests.create_request(
        session,
        tenant_id=key.tenant_id,
        base_model=body.base_model,
        forget_dataset=body.forget_dataset,
        retain_dataset=body.retain_dataset,
        method=body.method,
        params=body.params,
        metadata=body.metadata,
        idempotency_key=idempotency_key,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    if created:
        enqueue(session, request.id)
    else:
        response.headers["Idempotent-Replayed"] = "true"
    return UnlearnRequestOut.of(request)


def enqueue(session: Any, request_id: str) -> None:
    """Hand the committed request to the workers; if the broker is down the reconciler sends it later."""
    try:
        from persistence import jobs
        from worker.dispatch import enqueue_unlearn

        if enqueue_unlearn(request_id):
            jobs.mark_enqueued(session, request_ids=[request_id])
            session.commit()
    except Exception:  # never fail an accepted request: it is stored as queued
        session.rollback()
        log.exception("enqueue.failed", extra={"request_id": request_id})


@router.get("", response_model=list[UnlearnRequestOut])
def list_requests(
    session: SessionDep,
    key: ReadKey,
    status: RequestStatus | None = None,
    base_model: str | None = None,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
):
    found = requests.list_requests(
        session, tenant_id=key.tenant_id, status=status, base_model=base_model, limit=limit, offset=offset
    )
    return [UnlearnRequestOut.of(r) for r in found]


@router.get("/{request_id}", response_model=UnlearnRequestOut)
def get_request(request_id: str, session: SessionDep, key: ReadKey):
    request = requests.get_request(session, tenant_id=key.tenant_id, request_id=request_id)
    return UnlearnRequestOut.of(request, queue_position=requests.queue_position(session, request=request))


@router.get("/{request_id}/events", response_model=list[dict[str, Any]])
def events(
    request_id: str,
    session: SessionDep,
    key: ReadKey,
    after_step: int | None = None,
    limit: int | None = Query(None, ge=1, le=100_000),
):
    """The `history.json` records so far, in step order (`after_step` for only the newer ones)."""
    requests.get_request(session, tenant_id=key.tenant_id, request_id=request_id)
    return requests.list_events(session, request_id=request_id, after_step=after_step, limit=limit)


@router.get("/{request_id}/metrics", response_model=MetricsOut)
def metrics(request_id: str, session: SessionDep, key: ReadKey):
    request = requests.get_request(session, tenant_id=key.tenant_id, request_id=request_id)
    return MetricsOut(
        request_id=request.id,
        status=request.status,
        before=request.metrics_before,
        after=request.metrics_after,
    )


@router.post("/{request_id}/cancel", response_model=UnlearnRequestOut)
def cancel(request_id: str, session: SessionDep, key: SubmitKey, body: CancelIn | None = None):
    """Queued: cancelled at once. Running: `cancelling` until the worker stops at its next step."""
    request = requests.cancel_request(
        session,
        tenant_id=key.tenant_id,
        request_id=request_id,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
        reason=body.reason if body else None,
    )
    session.commit()
    return UnlearnRequestOut.of(request)
