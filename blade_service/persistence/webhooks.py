"""Per-tenant webhooks: HMAC-signed JSON on terminal request states and adapter state changes.

Events come from the audit log: `audit.append` calls `webhook_outbox.capture`, which, in the same
transaction, adds one `WebhookDelivery` per subscribed endpoint of the entry's tenant (an outbox: an event is
queued exactly when the state change commits). The maintenance worker's periodic task
(`worker.webhooks_task`) POSTs what is due; a failure is retried with exponential backoff
(`webhook_retry_base_s` x 2^(attempt-1)) until `webhook_max_attempts`, then the delivery is `failed`. The log
is readable at `GET /webhooks/{id}/deliveries`.

Each POST carries the exact JSON body and
    Blade-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>
    Blade-Event: request.succeeded          Blade-Delivery: whd_...
so a receiver checks the signature with its endpoint's secret and refuses stale timestamps (replays).
Endpoints never get requests on a loopback or unspecified address (checked when created and again, after DNS,
at every delivery) unless the endpoint allows it, which only the operator's `BLADE_WEBHOOK_ALLOW_LOOPBACK`
permits. Redirects are not followed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
import socket
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from blade_service.persistence import audit
from blade_service.persistence.errors import Invalid, NotFound
from blade_service.persistence.models import WebhookDelivery, WebhookEndpoint, new_id, utcnow
from blade_service.persistence.settings import Settings
from blade_service.persistence.webhook_outbox import EVENTS

TIMEOUT_S = 10.0
RESPONSE_EXCERPT = 500  # characters of a failed response kept in the log


def signature(secret: str, timestamp: int, body: str) -> str:
    """`t=<timestamp>,v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.{body}".encode(), hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify_signature(
    secret: str, header: str, body: str, *, tolerance_s: int = 300, now: int | None = None
) -> bool:
    """What a receiver does: the MAC matches and the timestamp is within `tolerance_s` of now."""
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        timestamp = int(parts["t"])
    except (ValueError, KeyError):
        return False
    if abs((now if now is not None else int(time.time())) - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(signature(secret, timestamp, body), header)


# --- endpoints ----------------------------------------------------------------------------------------------


def _internal(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Loopback, unspecified or link-local (169.254.0.0/16 holds cloud metadata services), also written as an
    IPv4-mapped IPv6 address (`::ffff:127.0.0.1`), which a dual-stack socket connects to as the IPv4 one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified or address.is_link_local


def _internal_addresses(host: str) -> list[str]:
    """The internal addresses (`_internal`) `host` resolves to (none for a host that does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError, ValueError):  # unresolvable, or not a host name at all
        return []
    found = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if _internal(address):
            found.append(str(address))
    return found


def check_url(url: str, *, allow_loopback: bool) -> str:
    """The URL when it may receive webhooks; Invalid naming the field otherwise."""
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError:
        hostname = None
    if hostname is None or parts.scheme not in ("http", "https"):
        raise Invalid("url: must be an absolute http:// or https:// URL", field="url")
    if parts.username or parts.password:
        raise Invalid("url: must not carry credentials", field="url")
    if any(c.isspace() or not c.isprintable() for c in url) or "%" in hostname:
        raise Invalid("url: must not hold whitespace, control characters or a scoped address", field="url")
    try:
        port = parts.port
    except ValueError:  # out of range or not a number
        port = 0
    if port is not None and not 0 < port < 65536:
        raise Invalid("url: the port must be 1-65535", field="url")
    loopback = _internal_addresses(hostname)
    if loopback and not allow_loopback:
        raise Invalid(
            f"url: {hostname} is a loopback or link-local address ({', '.join(sorted(set(loopback)))}); "
            "webhooks are never sent there unless the endpoint allows it",
            code="loopback_refused",
            field="url",
        )
    return url


def create_endpoint(
    session: Session,
    *,
    tenant_id: str,
    url: str,
    events: list[str],
    allow_loopback: bool,
    settings: Settings,
    actor: str,
    actor_key_id: str | None = None,
) -> WebhookEndpoint:
    """A new endpoint with a fresh secret (returned once, by the route that creates it)."""
    unknown = sorted(set(events) - set(EVENTS.values()))
    if unknown:
        raise Invalid(f"events: unknown {unknown}; known: {sorted(EVENTS.values())}", field="events")
    if allow_loopback and not settings.webhook_allow_loopback:
        raise Invalid(
            "allow_loopback: this installation does not permit webhooks to loopback addresses "
            "(the operator's BLADE_WEBHOOK_ALLOW_LOOPBACK)",
            field="allow_loopback",
        )
    endpoint = WebhookEndpoint(
        id=new_id("wh"),
        tenant_id=tenant_id,
        url=check_url(url, allow_loopback=allow_loopback),
        secret="whsec_" + secrets.token_urlsafe(32),
        events=sorted(set(events)),
        allow_loopback=allow_loopback,
    )
    session.add(endpoint)
    session.flush()
    audit.append(
        session,
        action="webhook.create",
        subject_type="webhook",
        subject_id=endpoint.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=tenant_id,
        data={"url": endpoint.url, "events": endpoint.events, "allow_loopback": allow_loopback},
    )
    return endpoint


def get_endpoint(session: Session, *, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    endpoint = session.get(WebhookEndpoint, endpoint_id)
    if endpoint is None or endpoint.tenant_id != tenant_id:
        raise NotFound(f"no webhook {endpoint_id!r}")
    return endpoint


def list_endpoints(session: Session, *, tenant_id: str) -> list[WebhookEndpoint]:
    query = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
    return list(session.scalars(query.order_by(WebhookEndpoint.created_at, WebhookEndpoint.id)))


def disable_endpoint(
    session: Session, *, tenant_id: str, endpoint_id: str, actor: str, actor_key_id: str | None = None
) -> WebhookEndpoint:
    endpoint = get_endpoint(session, tenant_id=tenant_id, endpoint_id=endpoint_id)
    if endpoint.disabled_at is None:
        endpoint.disabled_at = utcnow()
        audit.append(
            session,
            action="webhook.disable",
            subject_type="webhook",
            subject_id=endpoint.id,
            actor=actor,
            actor_key_id=actor_key_id,
            tenant_id=tenant_id,
        )
    return endpoint


def list_deliveries(
    session: Session, *, tenant_id: str, endpoint_id: str, limit: int = 100
) -> list[WebhookDelivery]:
    get_endpoint(session, tenant_id=tenant_id, endpoint_id=endpoint_id)
    query = (
        select(WebhookDelivery)
        .where(WebhookDelivery.endpoint_id == endpoint_id)
        .order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id)
        .limit(limit)
    )
    return list(session.scalars(query))


# --- delivery -----------------------------------------------------------------------------------------------


def _post(endpoint: WebhookEndpoint, delivery: WebhookDelivery) -> tuple[int | None, str | None]:
    """(HTTP status, error); the error is None only for a 2xx answer."""
    host = urlsplit(endpoint.url).hostname or ""
    loopback = _internal_addresses(host)
    if loopback and not endpoint.allow_loopback:
        return None, f"refused: {host} resolves to loopback or link-local {', '.join(sorted(set(loopback)))}"
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "blade-webhooks/1",
        "Blade-Event": delivery.event,
        "Blade-Delivery": delivery.id,
        "Blade-Signature": signature(endpoint.secret, timestamp, delivery.payload),
    }
    try:
        response = httpx.post(
            endpoint.url, content=delivery.payload, headers=headers, timeout=TIMEOUT_S, follow_redirects=False
        )
    except httpx.HTTPError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if 200 <= response.status_code < 300:
        return response.status_code, None
    return response.status_code, f"HTTP {response.status_code}: {response.text[:RESPONSE_EXCERPT]}"


def backoff_s(attempts: int, settings: Settings) -> float:
    """Delay before the next try after `attempts` failed ones: base x 2^(attempts-1)."""
    factor: float = 2 ** (attempts - 1)  # int ** int is typed Any (a negative power is a float)
    return settings.webhook_retry_base_s * factor


def deliver_due(session: Session, *, settings: Settings, limit: int = 20) -> list[str]:
    """POST the deliveries that are due (rows locked, so two workers never send one twice); the ids tried."""
    query = (
        select(WebhookDelivery)
        .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= utcnow())
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
    )
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    tried = []
    for delivery in session.scalars(query).all():
        endpoint = session.get(WebhookEndpoint, delivery.endpoint_id)
        if endpoint is None or endpoint.disabled_at is not None:
            delivery.status, delivery.last_error = "failed", "the endpoint was disabled"
            continue
        code, error = _post(endpoint, delivery)
        delivery.attempts += 1
        delivery.last_status_code, delivery.last_error = code, error
        if error is None:
            delivery.status, delivery.delivered_at, delivery.next_attempt_at = "delivered", utcnow(), None
        elif delivery.attempts >= settings.webhook_max_attempts:
            delivery.status, delivery.next_attempt_at = "failed", None
        else:
            delivery.next_attempt_at = utcnow() + timedelta(seconds=backoff_s(delivery.attempts, settings))
        tried.append(delivery.id)
    return tried


def delivery_view(d: WebhookDelivery) -> dict[str, Any]:
    return {
        "id": d.id,
        "endpoint_id": d.endpoint_id,
        "event": d.event,
        "status": d.status,
        "attempts": d.attempts,
        "last_status_code": d.last_status_code,
        "last_error": d.last_error,
        "next_attempt_at": d.next_attempt_at,
        "created_at": d.created_at,
        "delivered_at": d.delivered_at,
        "payload": json.loads(d.payload),
    }
