"""Webhooks (blade_service/persistence/webhooks.py) on the real PostgreSQL with a real HTTP receiver:
endpoints refused on loopback unless the operator allows it, HMAC-signed JSON with a timestamp on terminal
request states and adapter state changes, retries with exponential backoff until delivered, the delivery log
through the API, tenants apart, and the loopback check repeated at delivery time."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest
from sqlalchemy import select, update

from blade_service.persistence import webhooks
from blade_service.persistence.models import Tenant, WebhookDelivery, WebhookEndpoint, utcnow
from tests.fixtures_services import headers
from tests.test_certificates import run_to_success

pytestmark = pytest.mark.services


class Receiver:
    """A local HTTP server: 500 to the first `fail_first` POSTs of each delivery, then 204; keeps all."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.fail_first = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"])).decode()
                receiver.received.append({"headers": dict(self.headers), "body": body})
                delivery = self.headers["Blade-Delivery"]
                tries = [r for r in receiver.received if r["headers"]["Blade-Delivery"] == delivery]
                failing = len(tries) <= receiver.fail_first
                self.send_response(500 if failing else 204)
                self.end_headers()
                if failing:
                    self.wfile.write(b"try again later")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def loopback_allowed(api_app) -> Iterator[Any]:
    """The operator's explicit choice (BLADE_WEBHOOK_ALLOW_LOOPBACK), with a 1 s first retry."""
    settings = api_app.state.settings
    allowed = settings.model_copy(update={"webhook_allow_loopback": True, "webhook_retry_base_s": 1.0})
    api_app.state.settings = allowed
    yield allowed
    api_app.state.settings = settings


def test_endpoints_are_validated_and_never_loopback_by_default(api_client, tenant, make_key, receiver):
    admin = headers(tenant.admin)
    for body, field in (
        ({"url": receiver.url}, "url"),
        ({"url": "http://localhost:9/hook"}, "url"),
        ({"url": "http://0.0.0.0:9/hook"}, "url"),
        ({"url": "http://[::ffff:127.0.0.1]:9/hook"}, "url"),  # IPv4-mapped: connects to 127.0.0.1
        ({"url": "http://[::1]:9/hook"}, "url"),
        ({"url": "http://169.254.169.254/latest/meta-data/"}, "url"),  # link-local: cloud metadata
        ({"url": "http://[::ffff:169.254.169.254]/"}, "url"),
        ({"url": "http://hooks.example.com\n.evil.com/"}, "url"),  # never deliverable: refused up front
        ({"url": "http://a b/"}, "url"),
        ({"url": "http://hooks.example.com:99999/"}, "url"),
        ({"url": "http://hooks.example.com:0/"}, "url"),
        ({"url": "http://[fe80::1%25eth0]/"}, "url"),
        ({"url": receiver.url, "allow_loopback": True}, "allow_loopback"),
        ({"url": "ftp://hooks.example.com/x"}, "url"),
        ({"url": "https://hooks.example.com/x", "events": ["request.exploded"]}, "events"),
    ):
        resp = api_client.post("/webhooks", headers=admin, json=body)
        assert resp.status_code == 422, (body, resp.text)
        assert resp.json()["error"]["field"] == field, resp.json()
    reader = make_key(tenant.name, ["read", "submit"])
    resp = api_client.post("/webhooks", headers=headers(reader), json={"url": "https://hooks.example.com/x"})
    assert resp.status_code == 403


def test_signed_events_with_backoff_retries_and_a_delivery_log(
    api_client, api_app, ready, make_key, receiver, loopback_allowed
):
    admin = headers(ready.tenant.admin)
    resp = api_client.post(
        "/webhooks",
        headers=admin,
        json={
            "url": receiver.url,
            "allow_loopback": True,
            "events": ["request.succeeded", "adapter.disabled"],
        },
    )
    assert resp.status_code == 201, resp.text
    hook = resp.json()
    assert hook["secret"].startswith("whsec_")
    assert "secret" not in api_client.get("/webhooks", headers=admin).json()["items"][0]

    request_id = api_client.post("/unlearn-requests", headers=admin, json=ready.body()).json()["id"]
    adapter_id = run_to_success(api_app, request_id)
    resp = api_client.post(f"/adapters/{adapter_id}/disable", headers=admin, json={"reason": "hook test"})
    assert resp.status_code == 200, resp.text

    def deliver() -> list[str]:
        with api_app.state.session_factory() as session, session.begin():
            return webhooks.deliver_due(session, settings=loopback_allowed)

    def make_due() -> None:
        with api_app.state.session_factory() as session, session.begin():
            session.execute(update(WebhookDelivery).values(next_attempt_at=utcnow() - timedelta(seconds=1)))

    receiver.fail_first = 2  # each delivery fails twice, then gets through
    before = utcnow()
    tried = deliver()
    after = utcnow()
    assert len(tried) == 2 and len(receiver.received) == 2
    log = api_client.get(f"/webhooks/{hook['id']}/deliveries", headers=admin).json()["items"]
    assert {d["event"] for d in log} == {"request.succeeded", "adapter.disabled"}
    for d in log:
        assert d["status"] == "pending" and d["attempts"] == 1 and d["last_status_code"] == 500
        assert "try again later" in d["last_error"]
    assert deliver() == []  # not due yet: the backoff holds

    def next_attempts_within(start, end, wait_s: float) -> bool:
        """Every pending delivery is next due `wait_s` after a moment between start and end."""
        with api_app.state.session_factory() as session:
            rows = session.scalars(select(WebhookDelivery).where(WebhookDelivery.status == "pending")).all()
        lo, hi = start + timedelta(seconds=wait_s), end + timedelta(seconds=wait_s)
        return len(rows) == 2 and all(lo <= r.next_attempt_at <= hi for r in rows)

    # Each failure waits twice as long as the one before: base (1 s) after the first, 2 s after the second.
    assert next_attempts_within(before, after, 1.0)
    make_due()
    before = utcnow()
    assert len(deliver()) == 2
    assert next_attempts_within(before, utcnow(), 2.0)
    make_due()
    assert len(deliver()) == 2
    deliveries = api_client.get(f"/webhooks/{hook['id']}/deliveries", headers=admin).json()["items"]
    log = {d["event"]: d for d in deliveries}
    assert all(d["status"] == "delivered" and d["attempts"] == 3 for d in log.values()), log

    ok = [
        r
        for r in receiver.received
        if r["body"] and json.loads(r["body"])["id"] in {d["id"] for d in log.values()}
    ]
    for r in ok:
        body = json.loads(r["body"])
        assert r["headers"]["Blade-Event"] == body["event"] and r["headers"]["Blade-Delivery"] == body["id"]
        assert webhooks.verify_signature(hook["secret"], r["headers"]["Blade-Signature"], r["body"])
        assert not webhooks.verify_signature("whsec_wrong", r["headers"]["Blade-Signature"], r["body"])
        assert not webhooks.verify_signature(hook["secret"], r["headers"]["Blade-Signature"], r["body"] + " ")
        stale = int(r["headers"]["Blade-Signature"].split(",")[0][2:]) + 3600
        assert not webhooks.verify_signature(
            hook["secret"], r["headers"]["Blade-Signature"], r["body"], now=stale
        )
    succeeded = json.loads(next(r["body"] for r in ok if '"request.succeeded"' in r["body"]))
    assert succeeded["subject"] == {"type": "unlearn_request", "id": request_id} and succeeded["created_at"]

    # Another tenant sees neither the endpoint nor its log; a disabled endpoint gets nothing more.
    stranger = headers(make_key("webhook-stranger", ["admin"]))
    assert api_client.get(f"/webhooks/{hook['id']}/deliveries", headers=stranger).status_code == 404
    assert api_client.get("/webhooks", headers=stranger).json()["items"] == []
    assert api_client.delete(f"/webhooks/{hook['id']}", headers=admin).json()["disabled_at"]
    api_client.post(f"/adapters/{adapter_id}/enable", headers=admin, json={"reason": "back"})
    assert len(api_client.get(f"/webhooks/{hook['id']}/deliveries", headers=admin).json()["items"]) == 2


def test_loopback_is_checked_again_when_sending(api_app, tenant, receiver, service_settings):
    from blade_service.persistence import audit

    with api_app.state.session_factory() as session, session.begin():
        tenant_id = session.scalars(select(Tenant.id).where(Tenant.name == tenant.name)).one()
        # A host that resolved elsewhere when registered and to loopback now (DNS rebinding) is refused.
        session.add(
            WebhookEndpoint(
                id="wh_rebound", tenant_id=tenant_id, url=receiver.url, secret="s", allow_loopback=False
            )
        )
        session.flush()
        audit.append(
            session,
            action="adapter.disable",
            subject_type="adapter",
            subject_id="ad_x",
            actor="test",
            tenant_id=tenant_id,
        )
    with api_app.state.session_factory() as session, session.begin():
        assert webhooks.deliver_due(session, settings=service_settings)
        delivery = session.query(WebhookDelivery).filter_by(endpoint_id="wh_rebound").one()
        assert delivery.last_error.startswith("refused: 127.0.0.1 resolves to loopback")
    assert receiver.received == []
