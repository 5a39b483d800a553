"""Observability: `/metrics` follows the service's state, worker metrics reach Prometheus from a real Celery
worker, and structured JSON log lines carry the request id from the API into the worker.

Tiers: the API's metrics on the real PostgreSQL (services); the worker's metric functions in process (unit);
a real Celery worker serving its metrics port, and the e2e service's logs (e2e).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures_services import headers

Samples = dict[tuple[str, frozenset], float]


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample whose labels include `labels` (None when absent)."""
    want = set(labels.items())
    for (n, ls), v in samples.items():
        if n == name and want <= set(ls):
            return v
    return None


def scrape_text(api_client, api_app) -> str:
    api_app.state.metrics_state.invalidate()  # the database snapshot is cached for a few seconds
    resp = api_client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    return resp.text


def scrape(api_client, api_app) -> Samples:
    return parse(scrape_text(api_client, api_app))


# What the workers export when events happen (worker/observability.py); the API has none of it under its own
# names: no histograms recomputed from past requests, no second copy of a running request's dynamics.
NOT_FROM_THE_API = (
    "blade_request_queue_wait_seconds_count",
    "blade_request_training_duration_seconds_count",
    "blade_request_training_steps_count",
    "blade_running_request_step",
    "blade_running_request_progress_ratio",
    "blade_running_request_lambda",
    "blade_running_request_l_ret",
    "blade_running_request_l_fgt",
    "blade_running_request_epsilon",
    "blade_running_request_outer_step_rate",
)


# --- the API's /metrics ---------------------------------------------------------------------------------


@pytest.mark.services
def test_metrics_follow_a_request_through_its_life(api_client, api_app, ready):
    from blade_service.persistence import jobs, registry

    before = scrape(api_client, api_app)
    assert all(k[0].startswith(("blade_", "python_", "process_")) or not k[0] for k in before)
    queued0 = value(before, "blade_unlearn_requests", state="queued", method="blade") or 0
    succeeded0 = value(before, "blade_unlearn_requests", state="succeeded", method="blade") or 0

    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    now = scrape(api_client, api_app)
    assert value(now, "blade_unlearn_requests", state="queued", method="blade") == queued0 + 1
    assert value(now, "blade_unlearn_requests_by_state", state="queued") is None  # one name: the sum by state
    assert value(now, "blade_oldest_queued_request_age_seconds") >= 0

    # A worker claims it and reports steps: it counts as running; its dynamics are the worker's to export.
    owner, worker = f"obs-{uuid.uuid4().hex[:6]}@test", f"obs-{uuid.uuid4().hex[:6]}@test"
    factory = api_app.state.session_factory
    with factory() as s, s.begin():
        assert jobs.claim_request(s, request_id=rid, owner=owner, lease_seconds=60).claimed
        jobs.beat_worker(
            s,
            worker_name=worker,
            queues=["unlearn"],
            current_request_id=rid,
            pid=os.getpid(),
            info={"device": "cpu", "gpu_memory_peak_bytes": 123456},
        )
    with factory() as s, s.begin():
        jobs.set_run_info(s, request_id=rid, owner=owner, total_steps=4)
        for step in (1, 2):
            jobs.record_step(
                s,
                request_id=rid,
                owner=owner,
                record={
                    "step": step,
                    "L_fgt": 3.0 - step,
                    "L_ret": 0.2 * step,
                    "r": 0.0,
                    "lambda": 0.5 * step,
                    "epsilon": 0.45,
                },
            )
    running = scrape(api_client, api_app)
    assert value(running, "blade_unlearn_requests", state="running", method="blade") >= 1
    assert all(value(running, name) is None for name in NOT_FROM_THE_API)
    assert value(running, "blade_worker_up", worker=worker) == 1
    assert value(running, "blade_worker_running", worker=worker) == 1
    assert 0 <= value(running, "blade_worker_heartbeat_age_seconds", worker=worker) < 30
    assert value(running, "blade_worker_gpu_memory_peak_bytes", worker=worker) is None  # the worker's own
    assert value(running, "blade_workers_alive", queue="unlearn") >= 1

    with factory() as s, s.begin():
        jobs.mark_evaluating(s, request_id=rid, owner=owner, run_status="max_steps")
    with factory() as s, s.begin():
        adapter = registry.create_adapter_version(s, request=rid, artifact_key=f"a/{rid}", sha256="c" * 64)
        jobs.mark_succeeded(s, request_id=rid, owner=owner, adapter_id=adapter.id)
        jobs.beat_worker(s, worker_name=worker, current_request_id=None)
    done = scrape(api_client, api_app)
    assert value(done, "blade_unlearn_requests", state="succeeded", method="blade") == succeeded0 + 1
    assert value(done, "blade_unlearn_requests", state="queued", method="blade") == queued0
    assert all(value(done, name) is None for name in NOT_FROM_THE_API)
    assert (
        value(done, "blade_adapters", base_model=ready.base_model, tenant=ready.tenant.name, state="active")
        == 1
    )
    assert value(done, "blade_worker_running", worker=worker) == 0
    assert value(done, "blade_database_up") == 1


@pytest.mark.services
def test_one_name_per_metric(api_client, api_app, ready):
    """The API's only histogram is its own HTTP latency (observed as requests are served), and no metric
    name is exported by both the API and the workers."""
    from prometheus_client import REGISTRY

    from blade_service.worker import observability as obs

    api_client.get("/healthz")
    families = list(text_string_to_metric_families(scrape_text(api_client, api_app)))
    assert {f.name for f in families if f.type == "histogram"} == {"blade_http_request_duration_seconds"}
    obs.metrics()  # the worker's metric objects, in this process's default registry
    worker = {f.name for f in REGISTRY.collect() if f.name.startswith("blade_")}
    assert {"blade_training_step", "blade_training_duration_seconds"} <= worker
    assert not {f.name for f in families} & worker


@pytest.mark.services
def test_http_latency_is_recorded_by_route_template(api_client, api_app, ready):
    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    route = "/unlearn-requests/{request_id}"
    first = scrape(api_client, api_app)
    count0 = value(first, "blade_http_request_duration_seconds_count", method="GET", route=route) or 0
    for _ in range(3):
        assert (
            api_client.get(f"/unlearn-requests/{rid}", headers=headers(ready.tenant.admin)).status_code == 200
        )
    missing = api_client.get("/unlearn-requests/req_nope", headers=headers(ready.tenant.admin))
    assert missing.status_code == 404
    later = scrape(api_client, api_app)
    assert value(later, "blade_http_request_duration_seconds_count", method="GET", route=route) == count0 + 4
    assert value(later, "blade_http_requests_total", method="GET", route=route, status="404") >= 1
    assert (
        value(later, "blade_http_request_duration_seconds_bucket", method="GET", route=route, le="+Inf") >= 4
    )
    # Every response names its trace id; a caller's own X-Request-ID is kept.
    resp = api_client.get("/healthz", headers={"X-Request-ID": "trace-abc"})
    assert resp.headers["x-request-id"] == "trace-abc"


# --- worker metrics ------------------------------------------------------------------------------------


def test_worker_training_metrics_in_process():
    from prometheus_client import REGISTRY, generate_latest

    from blade_service.worker import observability as obs

    rid = f"req_{uuid.uuid4().hex}"
    for step in (1, 2, 3):
        obs.observe_step(
            request_id=rid,
            base_model="demo-tiny",
            method="blade",
            record={"step": step, "L_fgt": 2.5 - step, "L_ret": 0.3, "lambda": 0.2 * step, "epsilon": 0.5},
            total_steps=4,
        )
    samples = parse(generate_latest(REGISTRY).decode())
    assert value(samples, "blade_training_step", request_id=rid) == 3
    assert value(samples, "blade_training_progress_ratio", request_id=rid) == 0.75
    assert value(samples, "blade_training_lambda", request_id=rid) == pytest.approx(0.6)
    assert value(samples, "blade_training_l_ret", request_id=rid) == 0.3
    assert value(samples, "blade_training_epsilon", request_id=rid) == 0.5
    assert value(samples, "blade_training_outer_step_rate", request_id=rid) > 0
    steps0 = value(samples, "blade_training_steps_total", method="blade")
    assert steps0 >= 3

    obs.observe_run_finished(request_id=rid, outcome="success", duration_s=12.0)
    samples = parse(generate_latest(REGISTRY).decode())
    assert value(samples, "blade_training_lambda", request_id=rid) is None  # no longer running
    assert value(samples, "blade_training_progress_ratio", request_id=rid) is None
    assert value(samples, "blade_training_duration_seconds_count", method="blade", outcome="success") >= 1
    assert value(samples, "blade_training_run_steps_sum", method="blade", outcome="success") >= 3


@pytest.mark.e2e
@pytest.mark.services
@pytest.mark.timeout(180)
def test_a_real_worker_serves_its_metrics(e2e, tmp_path):
    """A Celery worker (prefork, as in production) with BLADE_WORKER_METRICS_PORT: its tasks show up there."""
    import httpx

    from blade_service.broker.app import make_celery
    from blade_service.contracts.names import TaskName
    from blade_service.persistence.settings import Settings
    from tests.fixtures_worker import free_port, stop_process, tail, wait_until

    port = free_port()
    queue = f"obs-{uuid.uuid4().hex[:6]}"  # only this worker consumes it
    env = dict(e2e.env, BLADE_WORKER_METRICS_PORT=str(port), BLADE_DATA_DIR=str(tmp_path / "worker"))
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "blade_service.worker.celery_app:app",
                "worker",
                "-Q",
                queue,
                "-c",
                "1",
                "--pool",
                "prefork",
                "--hostname",
                f"{queue}@test",
                "--without-mingle",
                "--without-gossip",
                "--loglevel",
                "INFO",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def metrics() -> Samples | None:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited ({proc.returncode}):\n{tail(log)}")
        try:
            return parse(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text)
        except httpx.HTTPError:
            return None

    try:
        wait_until(lambda: metrics() is not None, 60, 0.3, "the worker's metrics port")
        # A task published before the worker has bound its queue is dropped: wait for Celery's ready line.
        wait_until(lambda: f"{queue}@test ready." in log.read_text(errors="replace"), 60, 0.3, "the worker")
        app = make_celery(
            Settings(
                broker_url=e2e.env["BLADE_BROKER_URL"],
                result_backend=e2e.env["BLADE_RESULT_BACKEND"],
                data_dir=tmp_path,
            )
        )
        for _ in range(2):  # the reconciler: cheap, and harmless to run twice
            app.send_task(TaskName.RECONCILE.value, queue=queue)

        def tasks_done() -> Samples | None:
            s = metrics()
            done = s and value(
                s, "blade_worker_tasks_total", task=TaskName.RECONCILE.value, outcome="success"
            )
            return s if done and done >= 2 else None

        samples = wait_until(tasks_done, 60, 0.3, "two reconcile tasks in the worker's metrics")
        assert value(samples, "blade_worker_queue_wait_seconds_count", queue=queue) >= 2
        assert value(samples, "blade_worker_task_duration_seconds_count", task=TaskName.RECONCILE.value) >= 2
        # The heartbeat is a database row: the API exports its age (blade_worker_heartbeat_age_seconds).
        assert value(samples, "blade_worker_heartbeat_timestamp_seconds") is None
    finally:
        stop_process(proc)


# --- structured logs ----------------------------------------------------------------------------------------


def test_json_lines_carry_bound_ids_and_extras():
    from blade_service.persistence.jsonlog import bind, configure_logging, log_event

    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging(service="test", level="INFO", stream=stream)
        log = logging.getLogger("blade.test")
        with bind(request_id="req_123", trace_id="trace-9"):
            log_event(log, "request.submitted", base_model="demo-tiny", steps=5)
        log.info("outside")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines[0]["event"] == "request.submitted" and lines[0]["request_id"] == "req_123"
    assert (
        lines[0]["trace_id"] == "trace-9" and lines[0]["base_model"] == "demo-tiny" and lines[0]["steps"] == 5
    )
    assert lines[0]["service"] == "test" and lines[0]["level"] == "info" and "ts" in lines[0]
    assert "request_id" not in lines[1]
    assert lines[2]["level"] == "error" and "ValueError: boom" in lines[2]["exc"]


def test_a_tasks_return_value_never_reaches_the_log():
    """Celery logs each task's return value; a generate task's is the prompt and the model's answer, which
    must not outlive the forget data's purge in a log file. The success line stays, without the value."""
    from celery import Celery

    from blade_service.persistence.jsonlog import configure_logging

    app = Celery("t", broker="memory://", backend="cache+memory://")

    @app.task(name="blade.generate")
    def generate() -> dict:
        return {"text": "Born in Bryria, Teimo grew up in Goustith.", "prompt": "Where was Teimo born?"}

    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        configure_logging(service="test", level="INFO", stream=stream)
        assert generate.apply().get()["text"].startswith("Born in Bryria")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    logged = stream.getvalue()
    assert "succeeded in" in logged and "(not logged)" in logged, logged
    assert "Bryria" not in logged and "Teimo" not in logged
    # the worker's "received" line carries the task's arguments, a generate task's prompt among them
    from celery.app import trace

    stream.truncate(0)
    configure_logging(service="test", level="INFO", stream=stream)
    try:
        context = {
            "id": "1",
            "name": "blade.generate",
            "args": "()",
            "kwargs": "{'prompt': 'Where was Teimo born?'}",
        }
        logging.getLogger("celery.worker.strategy").info(trace.LOG_RECEIVED, context, extra={"data": context})
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert "received" in stream.getvalue() and "Teimo" not in stream.getvalue(), stream.getvalue()


def test_celery_publish_puts_the_ids_in_task_headers():
    """Publishing a task through a real Celery app (in-memory broker): the ids ride in the message headers."""
    from celery import Celery, signals

    from blade_service.persistence.jsonlog import (
        HEADER_REQUEST_ID,
        HEADER_TRACE_ID,
        bind,
        connect_celery_signals,
    )

    connect_celery_signals()
    seen: list[dict[str, Any]] = []

    def record(headers: dict | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    signals.before_task_publish.connect(record, weak=False)
    try:
        app = Celery("t", broker="memory://", backend="cache+memory://")
        with bind(trace_id="trace-7"):
            app.send_task("blade.unlearn", kwargs={"request_id": "req_abc"})  # id taken from the kwargs
        with bind(request_id="req_bound"):
            app.send_task("blade.generate", kwargs={"prompt": "x"})
    finally:
        signals.before_task_publish.disconnect(record)
    assert seen[0][HEADER_REQUEST_ID] == "req_abc" and seen[0][HEADER_TRACE_ID] == "trace-7"
    assert seen[1][HEADER_REQUEST_ID] == "req_bound"


@pytest.mark.e2e
@pytest.mark.services
@pytest.mark.timeout(240)
def test_request_id_and_trace_id_reach_the_workers_log_lines(e2e, tiny_model_dir):
    """Submit with an X-Request-ID through the real API; the GPU worker's JSON lines name both ids."""
    import httpx

    from tests.fixtures_worker import forget_rows, jsonl, retain_rows

    trace = f"trace-{uuid.uuid4().hex[:10]}"
    auth = {"Authorization": f"Bearer {e2e.admin_key}"}
    with httpx.Client(base_url=e2e.url, headers=auth, timeout=60) as c:
        name = f"tiny-log-{uuid.uuid4().hex[:6]}"
        assert c.post("/base-models", json={"name": name, "source": str(tiny_model_dir)}).status_code == 201
        f = c.post("/datasets", files={"file": ("f.jsonl", jsonl(forget_rows()))}).json()["id"]
        r = c.post("/datasets", files={"file": ("r.jsonl", jsonl(retain_rows()))}).json()["id"]
        resp = c.post(
            "/unlearn-requests",
            headers={"X-Request-ID": trace},
            json={
                "base_model": name,
                "forget_dataset": f,
                "retain_dataset": r,
                "params": {"max_steps": 2, "early_stop": False, "inner_steps": 1, "max_length": 64},
            },
        )
        assert resp.status_code == 202 and resp.headers["x-request-id"] == trace
        rid = resp.json()["id"]
        with e2e.client() as client:
            assert client.wait(rid, timeout=150, interval=0.3)["status"] == "succeeded"

    def json_lines(path) -> list[dict[str, Any]]:
        out = []
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return out

    worker_lines = [x for x in json_lines(e2e.logs["gpu"]) if x.get("request_id") == rid]
    assert worker_lines, "no worker log line names the request"
    assert all(x["service"] == "worker" for x in worker_lines)
    assert any(x.get("trace_id") == trace for x in worker_lines), (
        "the API's trace id did not reach the worker"
    )
    api_lines = [x for x in json_lines(e2e.logs["api"]) if x.get("trace_id") == trace]
    assert any(x["event"] == "http.request" and x["status"] == 202 for x in api_lines)
    assert not any(math.isnan(x.get("duration_ms", 0.0)) for x in api_lines)
