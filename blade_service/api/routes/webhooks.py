"""A tenant's webhooks (persistence/webhooks.py); admin keys only.

POST   /webhooks                      {url, events?, allow_loopback?} -> 201 with the secret (shown once)
GET    /webhooks                      the tenant's endpoints (without secrets)
DELETE /webhooks/{id}                 stop sending to it (its log stays)
GET    /webhooks/{id}/deliveries      the delivery log, newest first
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel as Schema
from pydantic import ConfigDict, Field

from blade_service.api.deps import AdminKey, SessionDep, SettingsDep
from blade_service.api.input_guard import SafeStr
from blade_service.api.pagination import MAX_LIMIT, Cursor, Limit, Offset, Page, cursor_only, page_after
from blade_service.api.schemas import ErrorOut
from blade_service.persistence import auth, webhooks
from blade_service.persistence.webhook_outbox import EVENTS

router = APIRouter(prefix="/webhooks", tags=["webhooks"])


class WebhookIn(Schema):
    model_config = ConfigDict(extra="forbid")

    url: SafeStr = Field(min_length=1, max_length=2048, examples=["https://hooks.example.com/blade"])
    events: list[SafeStr] = Field(
        default_factory=list,
        max_length=len(EVENTS),
        description=f"any of {sorted(EVENTS.values())}; empty: every event",
    )
    allow_loopback: bool = Field(
        default=False, description="send to a loopback address (only where the operator permits it)"
    )


class WebhookOut(Schema):
    id: str
    url: str
    events: list[str]
    allow_loopback: bool
    created_at: datetime
    disabled_at: datetime | None

    @classmethod
    def of(cls, e: Any) -> WebhookOut:
        return cls(
            id=e.id,
            url=e.url,
            events=list(e.events or []),
            allow_loopback=e.allow_loopback,
            created_at=e.created_at,
            disabled_at=e.disabled_at,
        )


class WebhookCreated(WebhookOut):
    secret: str = Field(description="the HMAC-SHA256 key of the Blade-Signature header; shown only now")


class DeliveryOut(Schema):
    id: str
    endpoint_id: str
    event: str
    status: str = Field(description="pending, delivered or failed (retries exhausted)")
    attempts: int
    last_status_code: int | None
    last_error: str | None
    next_attempt_at: datetime | None
    created_at: datetime
    delivered_at: datetime | None
    payload: dict[str, Any]


@router.post("", status_code=201, response_model=WebhookCreated, responses={422: {"model": ErrorOut}})
def create_webhook(
    body: WebhookIn, session: SessionDep, settings: SettingsDep, key: AdminKey
) -> WebhookCreated:
    """Signed JSON on terminal request states and adapter state changes of this tenant."""
    endpoint = webhooks.create_endpoint(
        session,
        tenant_id=key.tenant_id,
        url=body.url,
        events=body.events,
        allow_loopback=body.allow_loopback,
        settings=settings,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    return WebhookCreated(**WebhookOut.of(endpoint).model_dump(), secret=endpoint.secret)


@router.get("", response_model=Page[WebhookOut])
def list_webhooks(
    session: SessionDep, key: AdminKey, limit: Limit = 100, cursor: Cursor = None, offset: Offset = 0
) -> Page[WebhookOut]:
    """Oldest first, a cursor page."""
    found = [WebhookOut.of(e) for e in webhooks.list_endpoints(session, tenant_id=key.tenant_id)]
    return page_after(
        found, cursor=cursor, kinds="iso,str", limit=limit, offset=offset, key=lambda e: [e.created_at, e.id]
    )


@router.delete("/{webhook_id}", response_model=WebhookOut, responses={404: {"model": ErrorOut}})
def disable_webhook(webhook_id: str, session: SessionDep, key: AdminKey) -> WebhookOut:
    endpoint = webhooks.disable_endpoint(
        session,
        tenant_id=key.tenant_id,
        endpoint_id=webhook_id,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    return WebhookOut.of(endpoint)


@router.get(
    "/{webhook_id}/deliveries",
    response_model=Page[DeliveryOut],
    responses={404: {"model": ErrorOut}},
    dependencies=[Depends(cursor_only)],
)
def list_webhook_deliveries(
    webhook_id: str, session: SessionDep, key: AdminKey, limit: Limit = 100, cursor: Cursor = None
) -> Page[DeliveryOut]:
    """Newest first (the latest MAX_LIMIT deliveries), a cursor page."""
    found = webhooks.list_deliveries(
        session, tenant_id=key.tenant_id, endpoint_id=webhook_id, limit=MAX_LIMIT
    )
    return page_after(
        [DeliveryOut(**webhooks.delivery_view(d)) for d in found],
        cursor=cursor,
        kinds="iso,str",
        limit=limit,
        offset=0,
        key=lambda d: [d.created_at, d.id],
        newest_first=True,
    )
