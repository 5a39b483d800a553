"""Unlearn requests: submit (202, `Idempotency-Key`), list, get, events, metrics, cancel."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Response
from sqlalchemy.orm import Session

from blade_service.api.deps import ReadKey, ReadSessionDep, SessionDep, SubmitKey
from blade_service.api.pagination import Cursor, Limit, Offset, Page, cursor_only, decode_cursor, page
from blade_service.api.schemas import CancelIn, MetricsOut, UnlearnRequestIn, UnlearnRequestOut
from blade_service.persistence import auth, requests
from blade_service.persistence.models import RequestStatus, UnlearnRequest

router = APIRouter(prefix="/unlearn-requests", tags=["unlearn requests"])


def request_out(session: Session, request: UnlearnRequest) -> UnlearnRequestOut:
    """The request as every route returns it: with its queue position and its progress (rate, ETA)."""
    return UnlearnRequestOut.of(
        request,
        queue_position=requests.queue_position(session, request=request),
        progress=requests.progress(session, request=request),
    )


@router.post("", status_code=202, response_model=UnlearnRequestOut)
def submit_request(
    body: UnlearnRequestIn,
    session: SessionDep,
    key: SubmitKey,
    idempotency_key: str | None = Header(default=None, alias="Idempotency-Key"),
) -> Response:
    """Validate and queue a request; a repeated `Idempotency-Key` returns the original request. Two
    statements in one transaction on PostgreSQL (tests/test_api_speed.py counts them); a worker's submission
    relay publishes the task (worker/submission_relay.py)."""
    request, created, position = requests.submit_request(
        session,
        tenant_id=key.tenant_id,
        base_model=body.base_model,
        forget_dataset=body.forget_dataset,
        retain_dataset=body.retain_dataset,
        method=body.method,
        params=body.params,
        metadata=body.metadata,
        preset=body.preset,
        probe_datasets=body.probe_datasets,
        idempotency_key=idempotency_key,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    if created:
        return json_response(UnlearnRequestOut.of(request, queue_position=position), status_code=202)
    assert isinstance(request, UnlearnRequest)  # a replay answers with the stored request (`submit_request`)
    replayed = request_out(session, request)
    return json_response(replayed, status_code=202, headers={"Idempotent-Replayed": "true"})


def json_response(out: UnlearnRequestOut, **kwargs: Any) -> Response:
    """`out`, validated when it was built, serialised once (the response model would dump and validate it
    again)."""
    return Response(out.model_dump_json(), media_type="application/json", **kwargs)


@router.get("", response_model=Page[UnlearnRequestOut])
def list_requests(
    session: SessionDep,
    key: ReadKey,
    status: RequestStatus | None = None,
    base_model: str | None = None,
    limit: Limit = 100,
    cursor: Cursor = None,
    offset: Offset = 0,
) -> Page[UnlearnRequestOut]:
    """Newest first, a cursor page."""
    after = decode_cursor(cursor, "iso,str")
    found = requests.list_requests(
        session,
        tenant_id=key.tenant_id,
        status=status,
        base_model=base_model,
        limit=limit + 1,
        offset=offset,
        after=(after[0], after[1]) if after else None,
    )
    positions = requests.queue_positions(session, requests=found)
    items = [
        UnlearnRequestOut.of(
            r, queue_position=positions.get(r.id), progress=requests.progress(session, request=r)
        )
        for r in found
    ]
    return page(items, limit=limit, key=lambda r: [r.created_at, r.id])


@router.get("/{request_id}", response_model=UnlearnRequestOut)
def get_request(request_id: str, session: ReadSessionDep, key: ReadKey) -> Response:
    """One statement (the request, its base model, adapter and queue position), plus the latest steps' times
    while it runs; the key comes from the cache (tests/test_api_speed.py counts them)."""
    request, position = requests.get_request_view(session, tenant_id=key.tenant_id, request_id=request_id)
    out = UnlearnRequestOut.of(
        request, queue_position=position, progress=requests.progress(session, request=request)
    )
    return json_response(out)


@router.get("/{request_id}/events", response_model=Page[dict[str, Any]], dependencies=[Depends(cursor_only)])
def list_request_events(
    request_id: str,
    session: SessionDep,
    key: ReadKey,
    after_step: int | None = Query(None, description="only steps after this one (what `cursor` carries)"),
    limit: int | None = Query(None, ge=1, le=100_000, description="default: every step so far"),
    cursor: Cursor = None,
) -> Page[dict[str, Any]]:
    """The `history.json` records so far in step order, as a cursor page (`after_step` works too)."""
    requests.get_request(session, tenant_id=key.tenant_id, request_id=request_id)
    after = decode_cursor(cursor, "int")
    if after is not None:
        after_step = max(after[0], after_step or 0)
    found = requests.list_events(
        session, request_id=request_id, after_step=after_step, limit=limit + 1 if limit else None
    )
    return page(found, limit=limit or len(found), key=lambda e: [int(e.get("step", 0))])


@router.get("/{request_id}/metrics", response_model=MetricsOut)
def get_request_metrics(request_id: str, session: SessionDep, key: ReadKey) -> MetricsOut:
    request = requests.get_request(session, tenant_id=key.tenant_id, request_id=request_id)
    return MetricsOut(
        request_id=request.id,
        status=request.status,
        before=request.metrics_before,
        after=request.metrics_after,
    )


@router.post("/{request_id}/cancel", response_model=UnlearnRequestOut)
def cancel_request(
    request_id: str, session: SessionDep, key: SubmitKey, body: CancelIn | None = None
) -> UnlearnRequestOut:
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
    return request_out(session, request)
