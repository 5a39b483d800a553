"""`/unlearn-requests`: up-front validation, 202 + enqueue, idempotency, reads, events, metrics, cancel."""

from __future__ import annotations

import base64
import json
import uuid
from datetime import datetime, timedelta
from typing import Any

import pytest
import redis
from sqlalchemy import update

from blade_service.persistence import requests
from blade_service.persistence.jsonlog import HEADER_TRACE_ID
from blade_service.persistence.models import RequestStatus, TrainingEvent, UnlearnRequest, utcnow
from blade_service.worker.submission_relay import SubmissionRelay, publish_pending
from tests.fixtures_services import (
    celery_configured_for,
    headers,
    qa_rows,
    register_model,
    row_counts,
    upload_dataset,
)
from tests.fixtures_worker import wait_until

pytestmark = pytest.mark.services


def submit(client, ready, key=None, idem=None, **overrides):
    extra = {"Idempotency-Key": idem} if idem else {}
    return client.post(
        "/unlearn-requests", headers=headers(key or ready.tenant.admin, **extra), json=ready.body(**overrides)
    )


def set_status(api_app, request_id: str, status: RequestStatus, **values):
    with api_app.state.session_factory() as s, s.begin():
        s.execute(
            update(UnlearnRequest).where(UnlearnRequest.id == request_id).values(status=status, **values)
        )


def published_headers(broker_url: str, request_id: str) -> dict[str, Any]:
    """The headers of the unlearn task published for `request_id` on the broker (Redis) at `broker_url`."""
    client = redis.Redis.from_url(broker_url)
    for queue in client.keys("unlearn*"):
        for raw in client.lrange(queue, 0, -1):
            message = json.loads(raw)
            _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
            if kwargs["request_id"] == request_id:
                return message["headers"]
    raise AssertionError(f"no task published for {request_id}")


def test_submit_queues_and_a_relay_publishes_the_head(api_client, api_app, ready, enqueued, service_settings):
    resp = submit(api_client, ready, metadata={"ticket": "DSR-1"})
    assert resp.status_code == 202, resp.text
    body = resp.json()
    assert body["status"] == "queued" and body["base_model"] == ready.base_model
    assert body["params"] == {"max_steps": 5} and body["metadata"] == {"ticket": "DSR-1"}
    assert body["progress"] == {
        "step": 0,
        "total_steps": 5,
        "fraction": 0.0,
        "steps_per_s": None,
        "eta_seconds": None,
        "eta": None,
    }
    assert body["queue_position"] == 0
    assert body["adapter_id"] is None and body["error"] is None and body["queue_seq"] == 1
    assert body["id"] not in enqueued()  # the API publishes nothing
    got = api_client.get(f"/unlearn-requests/{body['id']}", headers=headers(ready.tenant.admin)).json()
    assert got["id"] == body["id"] and got["queue_position"] == 0
    behind = submit(api_client, ready).json()
    assert behind["queue_position"] == 1

    def enqueued_at(request_id: str) -> Any:
        with api_app.state.session_factory() as s:
            return s.get(UnlearnRequest, request_id).enqueued_at

    # A worker's relay (its thread, as every worker's main process runs it) publishes the head at once: it
    # LISTENs for the notice each submission's commit sends. Only the head may run, so only it is sent.
    relay = SubmissionRelay(service_settings, poll_s=60).start()
    try:
        # It publishes inside the transaction that records enqueued_at, so the broker may hold the task a
        # moment before the commit shows.
        wait_until(
            lambda: body["id"] in enqueued() and enqueued_at(body["id"]) is not None,
            timeout=30,
            what="the relay to publish the head and record it",
        )
        assert behind["id"] not in enqueued() and enqueued_at(behind["id"]) is None
        third = api_client.post(  # the submitting call's trace id rides with the task the relay publishes
            "/unlearn-requests",
            headers=headers(ready.tenant.admin, **{"X-Request-ID": "trace-relayed"}),
            json=ready.body(base_model=register_model(api_client, ready.tenant.admin)),
        ).json()
        wait_until(lambda: third["id"] in enqueued(), timeout=30, what="a notice to wake the relay")
        headers_sent = published_headers(service_settings.broker_url, third["id"])
        assert headers_sent[HEADER_TRACE_ID] == "trace-relayed"
        set_status(api_app, body["id"], RequestStatus.SUCCEEDED)  # the head finishes ...
        relay.stop()  # ... and, were no worker to publish the next, the relay's poll would:
        assert behind["id"] in publish_pending(service_settings)
        assert behind["id"] in enqueued() and enqueued_at(behind["id"]) is not None
    finally:
        relay.stop()


def test_a_publish_the_broker_refuses_is_sent_by_the_relays_next_pass(
    api_client, api_app, ready, service_settings, enqueued
):
    """The 202 never depends on the broker; a relay pass that cannot reach it records nothing, so the next
    pass (or the reconciler) sends the request."""
    down = service_settings.model_copy(
        update={"broker_url": "redis://127.0.0.1:1/0", "result_backend": "redis://127.0.0.1:1/1"}
    )
    with celery_configured_for(down):
        resp = submit(api_client, ready)
        assert resp.status_code == 202, resp.text
        assert publish_pending(service_settings) == []
    request_id = resp.json()["id"]
    with api_app.state.session_factory() as s:
        stored = s.get(UnlearnRequest, request_id)
        assert stored is not None and stored.status == RequestStatus.QUEUED and stored.enqueued_at is None
    assert request_id in publish_pending(service_settings) and request_id in enqueued()


def test_default_method_is_blade_and_queue_order_follows_submission(api_client, ready):
    first = submit(api_client, ready, method=None, params=None).json()
    second = submit(api_client, ready).json()
    assert first["method"] == "blade" and first["params"] == {}
    assert first["progress"]["total_steps"] == requests.DEFAULT_MAX_STEPS == 250  # the method's own cap
    assert second["queue_seq"] == first["queue_seq"] + 1 and second["queue_position"] == 1
    got = api_client.get(f"/unlearn-requests/{second['id']}", headers=headers(ready.tenant.admin)).json()
    assert got["queue_position"] == 1
    listed = api_client.get("/unlearn-requests", headers=headers(ready.tenant.admin)).json()
    assert [r["id"] for r in listed["items"]] == [second["id"], first["id"]]
    assert [r["queue_position"] for r in listed["items"]] == [1, 0]
    assert listed["has_more"] is False and listed["next_cursor"] is None
    queued = api_client.get("/unlearn-requests?status=cancelled", headers=headers(ready.tenant.admin)).json()
    assert queued["items"] == []


BAD_BODIES = [
    # (overrides, status, field)
    ({"method": "forget_everything"}, 422, "method"),
    ({"params": {"tau": 5}}, 422, "params.tau"),
    ({"params": {"max_steps": 0}}, 422, "params.max_steps"),
    ({"params": {"max_step": 10}}, 422, "params.max_step"),
    ({"params": {"eps_mul": "lots"}}, 422, "params.eps_mul"),
    ({"method": "npo", "params": {"tau": 0.5}}, 422, "params.tau"),
    ({"params": [1, 2]}, 422, "params"),
    ({"base_model": "no-such-model"}, 422, "base_model"),
    ({"forget_dataset": "ds_missing"}, 422, "forget_dataset"),
    ({"retain_dataset": "ds_missing"}, 422, "retain_dataset"),
    ({"metadata": "not an object"}, 422, "metadata"),
    ({"surprise": True}, 422, "surprise"),
    ({"base_model": None}, 422, "base_model"),
]


@pytest.mark.parametrize(("overrides", "status", "field"), BAD_BODIES)
def test_bad_requests_name_the_field_and_store_nothing(
    api_client, ready, db_engine, enqueued, overrides, status, field
):
    before, sent = row_counts(db_engine), len(enqueued())
    resp = submit(api_client, ready, **overrides)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["field"] == field and field.split(".")[-1] in error["message"] and error["code"]
    assert row_counts(db_engine) == before and len(enqueued()) == sent


def test_every_bad_param_is_named_in_one_answer(api_client, ready, db_engine):
    before = row_counts(db_engine)
    resp = submit(api_client, ready, params={"tau": "lots", "max_step": 10, "eta_out": 5, "lora_r": 8})
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["field"] == "params.tau"  # the first, as a client reading one field expects
    assert "params.tau: cannot use 'lots'" in error["message"]
    assert "params.max_step: unknown" in error["message"]
    assert row_counts(db_engine) == before
    # bounds are checked once every type is right, and every bound broken is named
    resp = submit(api_client, ready, params={"eta_out": 5, "tau": 3})
    message = resp.json()["error"]["message"]
    assert resp.status_code == 422
    assert "params.eta_out: must be" in message and "params.tau: must be" in message
    # a thousand bad keys get a short answer: ten named, the known names once, the rest counted
    resp = submit(api_client, ready, params={f"k{i}": i for i in range(1000)})
    message = resp.json()["error"]["message"]
    assert resp.status_code == 422 and message.endswith("; and 990 more") and len(message) < 2000
    assert message.count("params.k") == 10 and message.count("known:") == 1


def test_same_dataset_twice_and_missing_fields_are_refused(api_client, ready, db_engine):
    before = row_counts(db_engine)
    resp = submit(api_client, ready, retain_dataset=ready.forget)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "retain_dataset"
    resp = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json={"base_model": "x"})
    assert resp.status_code == 422 and resp.json()["error"]["field"] in ("forget_dataset", "retain_dataset")
    resp = api_client.post(
        "/unlearn-requests",
        headers={**headers(ready.tenant.admin), "Content-Type": "application/json"},
        content=b"{nope",
    )
    error = resp.json()["error"]
    assert (
        resp.status_code == 422
        and error["field"] == "body"
        and error["message"].startswith("body: invalid JSON")
    )
    assert row_counts(db_engine) == before


def test_another_tenants_dataset_and_model_are_unknown(api_client, ready, make_key, db_engine):
    other = make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"])
    their_model = register_model(api_client, other)
    their_data = upload_dataset(api_client, other, qa_rows(2))["id"]
    before = row_counts(db_engine)
    resp = submit(api_client, ready, forget_dataset=their_data)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "forget_dataset"
    resp = submit(api_client, ready, base_model=their_model)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "base_model"
    assert row_counts(db_engine) == before


def test_idempotency_key_returns_the_original(api_client, ready, enqueued, db_engine):
    key = f"idem-{uuid.uuid4().hex}"
    first = submit(api_client, ready, idem=key)
    sent = len(enqueued())
    before = row_counts(db_engine)
    again = submit(api_client, ready, idem=key)
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.headers["Idempotent-Replayed"] == "true"
    assert len(enqueued()) == sent and row_counts(db_engine) == before
    changed = submit(api_client, ready, idem=key, params={"max_steps": 6})
    assert changed.status_code == 409 and changed.json()["error"]["code"] == "idempotency_key_reused"
    assert submit(api_client, ready, idem=f"other-{key}").json()["id"] != first.json()["id"]


def test_idempotency_keys_are_per_tenant(api_client, ready, make_key):
    key = f"idem-{uuid.uuid4().hex}"
    mine = submit(api_client, ready, idem=key).json()
    other = make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"])
    forget = upload_dataset(api_client, other, qa_rows(2))["id"]
    retain = upload_dataset(api_client, other, qa_rows(3))["id"]
    model = register_model(api_client, other)
    theirs = api_client.post(
        "/unlearn-requests",
        headers=headers(other, **{"Idempotency-Key": key}),
        json={"base_model": model, "forget_dataset": forget, "retain_dataset": retain},
    )
    assert theirs.status_code == 202 and theirs.json()["id"] != mine["id"]


def test_cancel_queued_is_immediate_and_final(api_client, ready, db_engine):
    request_id = submit(api_client, ready).json()["id"]
    resp = api_client.post(
        f"/unlearn-requests/{request_id}/cancel",
        headers=headers(ready.tenant.admin),
        json={"reason": "user withdrew"},
    )
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    assert resp.json()["finished_at"] and resp.json()["cancel_requested_at"]
    again = api_client.post(f"/unlearn-requests/{request_id}/cancel", headers=headers(ready.tenant.admin))
    assert again.status_code == 200 and again.json()["status"] == "cancelled"


def test_cancel_running_asks_the_worker(api_client, api_app, ready):
    request_id = submit(api_client, ready).json()["id"]
    set_status(api_app, request_id, RequestStatus.RUNNING)
    resp = api_client.post(f"/unlearn-requests/{request_id}/cancel", headers=headers(ready.tenant.admin))
    assert resp.status_code == 200 and resp.json()["status"] == "cancelling"


@pytest.mark.parametrize("final", [RequestStatus.SUCCEEDED, RequestStatus.FAILED])
def test_finished_requests_never_change(api_client, api_app, ready, final):
    request_id = submit(api_client, ready).json()["id"]
    set_status(
        api_app,
        request_id,
        final,
        error_code="boom" if final == RequestStatus.FAILED else None,
        error_message="it broke" if final == RequestStatus.FAILED else None,
    )
    resp = api_client.post(f"/unlearn-requests/{request_id}/cancel", headers=headers(ready.tenant.admin))
    assert resp.status_code == 409 and resp.json()["error"]["code"] == "already_finished"
    got = api_client.get(f"/unlearn-requests/{request_id}", headers=headers(ready.tenant.admin)).json()
    assert got["status"] == final.value
    if final == RequestStatus.FAILED:
        assert got["error"] == {"code": "boom", "message": "it broke", "field": None}


def test_events_in_step_order_and_metrics(api_client, api_app, ready):
    request_id = submit(api_client, ready).json()["id"]
    with api_app.state.session_factory() as s, s.begin():
        for step in (3, 1, 2):
            s.add(
                TrainingEvent(
                    request_id=request_id,
                    step=step,
                    record={"step": step, "L_fgt": 1.0 / step, "L_ret": 0.5, "lambda": 1.0},
                )
            )
        s.execute(
            update(UnlearnRequest)
            .where(UnlearnRequest.id == request_id)
            .values(step=3, metrics_before={"forget": {"Prob": 0.9}}, metrics_after={"forget": {"Prob": 0.1}})
        )
    h = headers(ready.tenant.admin)
    events = api_client.get(f"/unlearn-requests/{request_id}/events", headers=h).json()
    assert [e["step"] for e in events["items"]] == [1, 2, 3] and events["items"][0]["L_fgt"] == 1.0
    assert events["has_more"] is False
    newer = api_client.get(f"/unlearn-requests/{request_id}/events?after_step=1", headers=h).json()
    assert [e["step"] for e in newer["items"]] == [2, 3]
    first = api_client.get(f"/unlearn-requests/{request_id}/events?limit=2", headers=h).json()
    assert [e["step"] for e in first["items"]] == [1, 2] and first["has_more"] is True
    rest = api_client.get(
        f"/unlearn-requests/{request_id}/events", params={"cursor": first["next_cursor"]}, headers=h
    ).json()
    assert [e["step"] for e in rest["items"]] == [3] and rest["has_more"] is False
    metrics = api_client.get(f"/unlearn-requests/{request_id}/metrics", headers=h).json()
    assert metrics["before"] == {"forget": {"Prob": 0.9}} and metrics["after"] == {"forget": {"Prob": 0.1}}
    assert api_client.get(f"/unlearn-requests/{request_id}", headers=h).json()["progress"]["fraction"] == 0.6


def test_missing_request_is_404_everywhere(api_client, tenant):
    h = headers(tenant.admin)
    for method, path in (
        ("get", "/unlearn-requests/req_nope"),
        ("get", "/unlearn-requests/req_nope/events"),
        ("get", "/unlearn-requests/req_nope/metrics"),
        ("post", "/unlearn-requests/req_nope/cancel"),
    ):
        resp = getattr(api_client, method)(path, headers=h)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found", path


def test_running_request_reports_its_rate_and_eta(api_client, api_app, ready):
    """The ETA comes from the times the latest steps were recorded: 4 steps over 6 s is 0.5 steps/s, so the
    6 steps left of the cap of 10 take 12 s from the last step."""
    request_id = submit(api_client, ready, params={"max_steps": 10}).json()["id"]
    last = utcnow()
    with api_app.state.session_factory() as s, s.begin():
        for step in range(1, 5):
            at = last - timedelta(seconds=2 * (4 - step))
            s.add(TrainingEvent(request_id=request_id, step=step, record={"step": step}, created_at=at))
    set_status(api_app, request_id, RequestStatus.RUNNING, step=4, started_at=last - timedelta(seconds=9))
    h = headers(ready.tenant.admin)
    progress = api_client.get(f"/unlearn-requests/{request_id}", headers=h).json()["progress"]
    assert progress["step"] == 4 and progress["total_steps"] == 10 and progress["fraction"] == 0.4
    assert progress["steps_per_s"] == pytest.approx(0.5)
    eta = datetime.fromisoformat(progress["eta"])
    assert eta == last + timedelta(seconds=12)
    assert 0 < progress["eta_seconds"] <= 12
    listed = api_client.get("/unlearn-requests", headers=h).json()["items"]
    assert listed[0]["progress"]["steps_per_s"] == pytest.approx(0.5)


def test_total_matches_what_the_worker_plans(tmp_path):
    """The API (no torch) states BLADE's cap before the run; the worker plans the same one, and a baseline's
    count from its published schedule over the forget set (reported once it runs)."""
    from blade_core.methods import service_preset
    from blade_core.methods._loop import schedule
    from blade_core.unlearn import build_config
    from blade_service.worker.training import planned_steps as _planned_steps

    forget = tmp_path / "forget.jsonl"
    forget.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(40)))
    assert requests.step_cap("blade", {}) == _planned_steps("blade", {}, forget) == 250
    assert requests.step_cap("npo", {"max_steps": 7}) == _planned_steps("npo", {"max_steps": 7}, forget) == 7
    assert requests.step_cap("npo", {}) is None
    planned = schedule(build_config("npo", service_preset("npo")), 40).total_steps
    assert _planned_steps("npo", {}, forget) == planned > 1
    assert requests.step_cap("npo", {}, n_forget=40) == planned  # known before the run: the schedule's count
    rmu = _planned_steps("rmu", {"batch_size": 2}, forget)
    assert requests.step_cap("rmu", {"batch_size": 2}, n_forget=40) == rmu
