"""The webhook outbox: `audit.append` calls `capture`, which, in the audit entry's transaction, queues one
`WebhookDelivery` per subscribed endpoint of the entry's tenant, so an event is queued exactly when the state
change commits. Endpoints and delivery are `persistence/webhooks.py`'s."""

from __future__ import annotations

import json

from sqlalchemy import select
from sqlalchemy.orm import Session

from blade_service.persistence.models import AuditEntry, WebhookDelivery, WebhookEndpoint, new_id, utcnow

# Audit actions that are webhook events, and the event names receivers see.
EVENTS: dict[str, str] = {
    "unlearn_request.succeed": "request.succeeded",
    "unlearn_request.fail": "request.failed",
    "unlearn_request.cancelled": "request.cancelled",
    "unlearn_request.reject": "request.rejected",
    "adapter.create": "adapter.created",
    "adapter.disable": "adapter.disabled",
    "adapter.enable": "adapter.enabled",
    "adapter.compact": "adapter.compacted",
}


def capture(session: Session, entry: AuditEntry) -> list[WebhookDelivery]:
    """Queue one delivery per subscribed endpoint of the entry's tenant, in the entry's transaction."""
    event = EVENTS.get(entry.action)
    if event is None or entry.tenant_id is None:
        return []
    with session.no_autoflush:
        endpoints = session.scalars(
            select(WebhookEndpoint).where(
                WebhookEndpoint.tenant_id == entry.tenant_id, WebhookEndpoint.disabled_at.is_(None)
            )
        ).all()
    deliveries = []
    for endpoint in endpoints:
        if endpoint.events and event not in endpoint.events:
            continue
        delivery_id = new_id("whd")
        body = {
            "id": delivery_id,
            "event": event,
            "created_at": entry.created_at.isoformat(),
            "tenant_id": entry.tenant_id,
            "subject": {"type": entry.subject_type, "id": entry.subject_id},
            "actor": entry.actor,
            "reason": entry.reason,
            "data": entry.data,
        }
        delivery = WebhookDelivery(
            id=delivery_id,
            endpoint_id=endpoint.id,
            tenant_id=entry.tenant_id,
            event=event,
            payload=json.dumps(body, sort_keys=True, separators=(",", ":")),
            status="pending",
            attempts=0,
            next_attempt_at=utcnow(),
        )
        session.add(delivery)
        deliveries.append(delivery)
    return deliveries
