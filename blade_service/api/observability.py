"""The API's Prometheus metrics (`GET /metrics`) and its HTTP middleware (latency, trace ids, access log).

Two kinds of metric live here:
- process metrics kept in memory: HTTP requests and latency by method, route template and status;
- the state of the service, read from the database at scrape time (cached for `SNAPSHOT_TTL_S`, so a busy
  Prometheus or several of them cost one set of queries): requests by state and method, queue depth per
  queue (the broker's count) and the oldest queued request, time in queue and training duration and steps of
  finished requests (histograms aggregated in SQL and folded into per-process totals, `HistoryTotals`, so a
  scrape's cost does not grow with history), step / lambda / L_fgt / L_ret / epsilon and step
  rate of each running request (from its latest training events), workers alive and each one's heartbeat
  age, adapters by state.

Workers export their own process metrics on their own port (`worker/observability.py`).
Every name starts with `blade_`. No torch here.

    install_observability(app, settings)   # in create_app: adds the middleware and GET /metrics
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import and_, case, func, literal_column, select
from sqlalchemy.orm import Session

from blade_service.persistence.jsonlog import bind, new_trace_id
from blade_service.persistence.models import (
    TERMINAL_STATUSES,
    AdapterVersion,
    BaseModel,
    RequestStatus,
    TrainingEvent,
    UnlearnRequest,
    WorkerHeartbeat,
)
from blade_service.persistence.requests import unfinished
from blade_service.persistence.settings import Settings

log = logging.getLogger("blade.api.http")

SNAPSHOT_TTL_S = 5.0
BROKER_TIMEOUT_S = 2.0
RATE_WINDOW = 20  # training events used for a running request's outer-step rate
TIME_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
STEP_BUCKETS = (1, 5, 10, 25, 50, 100, 150, 200, 250, 400, 600, 1000)
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
RUNNING = (RequestStatus.RUNNING, RequestStatus.EVALUATING, RequestStatus.CANCELLING)
UNMATCHED_ROUTE = "<unmatched>"
SKIP_LOG_PREFIXES = ("/dashboard/static/",)  # no access-log line for these (still counted in the metrics)


def worker_alive_after_s(settings: Settings) -> float:
    """A worker whose last heartbeat is older than this counts as gone."""
    return max(3 * settings.heartbeat_seconds, 15)


# --- state of the service, from the database ------------------------------------------------------------


def _age_s(then: datetime | None, now: datetime) -> float | None:
    if then is None:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    return max(0.0, (now - then).total_seconds())


_depth_cache: dict[str, tuple[float, dict[str, int | None]]] = {}
_depth_lock = threading.Lock()


def broker_queue_depths(
    settings: Settings, queues: Iterable[str], timeout: float = BROKER_TIMEOUT_S, max_age_s: float = 2.0
) -> dict[str, int | None]:
    """Messages waiting in each broker queue (None: the broker did not answer within `timeout`).

    Asked of the settings' broker (Redis, or the embedded SQL transport), at most every `max_age_s` seconds.
    """
    queues = list(queues)
    url = settings.resolved_broker_url()
    with _depth_lock:
        cached = _depth_cache.get(url)
        if cached is not None and time.monotonic() - cached[0] < max_age_s:
            return dict(cached[1])

    def count() -> dict[str, int | None]:
        from kombu import Connection

        depths: dict[str, int | None] = {}
        with Connection(url, connect_timeout=timeout) as conn:
            channel = conn.default_channel
            for queue in queues:
                try:
                    depths[queue] = int(channel.queue_declare(queue=queue, passive=True).message_count)
                except Exception:  # queue not declared yet: nothing waits in it
                    depths[queue] = 0
        return depths

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blade-broker-depth")
    try:
        depths = pool.submit(count).result(timeout=timeout)
    except Exception as exc:
        log.warning("metrics.broker_unreachable", extra={"error": repr(exc)})
        depths = dict.fromkeys(queues)
    finally:
        pool.shutdown(wait=False)
    with _depth_lock:
        _depth_cache[url] = (time.monotonic(), depths)
    return dict(depths)


def running_dynamics(session: Session, request_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Latest record and outer-step rate (steps/s over the last RATE_WINDOW events) per running request."""
    out: dict[str, dict[str, Any]] = {}
    for rid in request_ids:
        rows = session.execute(
            select(TrainingEvent.step, TrainingEvent.record, TrainingEvent.created_at)
            .where(TrainingEvent.request_id == rid)
            .order_by(TrainingEvent.step.desc())
            .limit(RATE_WINDOW)
        ).all()
        if not rows:
            continue
        latest = dict(rows[0].record or {})
        rate = None
        if len(rows) > 1:
            dt = (rows[0].created_at - rows[-1].created_at).total_seconds()
            if dt > 0:
                rate = (rows[0].step - rows[-1].step) / dt
        out[rid] = {"record": latest, "step": rows[0].step, "rate": rate}
    return out


# --- history totals: folded in once, so a scrape costs the same at 100,000 past requests as at 100 ----------

HISTORY_LAG = timedelta(minutes=5)  # rows newer than this are re-read each scrape, older ones folded in once
TIMED_OUTCOMES = (RequestStatus.SUCCEEDED, RequestStatus.FAILED, RequestStatus.CANCELLED)  # histogrammed


def _seconds(later: Any, earlier: Any, dialect: str) -> Any:
    """SQL for `later - earlier` in seconds."""
    if dialect == "sqlite":
        return (func.julianday(later) - func.julianday(earlier)) * 86400.0
    return func.extract("epoch", later - earlier)


def _window(column: Any, lo: datetime | None, hi: datetime | None) -> list[Any]:
    return [column.is_not(None)] + ([column >= lo] if lo else []) + ([column < hi] if hi else [])


def _finished_rows(session: Session, lo: datetime | None, hi: datetime | None) -> dict[tuple, list[float]]:
    """(tenant, method, status) -> [count, timed count, duration sum, steps sum, *duration buckets,
    *step buckets] over the terminal requests that finished in [lo, hi); "timed" ones (started, and
    succeeded, failed or cancelled) are the histograms' samples; bucket counts are cumulative (`<= bound`),
    as Prometheus wants them."""
    r = UnlearnRequest
    duration = _seconds(r.finished_at, r.started_at, session.get_bind().dialect.name)
    timed = and_(
        r.started_at.is_not(None), r.status.in_([literal_column(f"'{s.value}'") for s in TIMED_OUTCOMES])
    )
    columns = [
        func.count(),
        func.count().filter(timed),
        func.coalesce(func.sum(case((timed, duration), else_=0.0)), 0.0),
        func.coalesce(func.sum(case((timed, r.step), else_=0)), 0),
        *(func.count().filter(and_(timed, duration <= bound)) for bound in TIME_BUCKETS),
        *(func.count().filter(and_(timed, r.step <= bound)) for bound in STEP_BUCKETS),
    ]
    terminal = r.status.in_([literal_column(f"'{s.value}'") for s in TERMINAL_STATUSES])
    rows = session.execute(
        select(r.tenant_id, r.method, r.status, *columns)
        .where(terminal, *_window(r.finished_at, lo, hi))
        .group_by(r.tenant_id, r.method, r.status)
    ).all()
    return {(t, m, str(RequestStatus(st).value)): [float(v or 0) for v in rest] for t, m, st, *rest in rows}


def _wait_rows(session: Session, lo: datetime | None, hi: datetime | None) -> dict[tuple, list[float]]:
    """() -> [count, wait sum, *wait buckets] over the requests that started in [lo, hi)."""
    r = UnlearnRequest
    wait = _seconds(r.started_at, r.created_at, session.get_bind().dialect.name)
    row = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(wait), 0.0),
            *(func.count().filter(wait <= bound) for bound in TIME_BUCKETS),
        ).where(*_window(r.started_at, lo, hi))
    ).one()
    return {(): [float(v or 0) for v in row]} if row[0] else {}


def _add(into: dict[tuple, list[float]], more: dict[tuple, list[float]]) -> dict[tuple, list[float]]:
    for key, values in more.items():
        into[key] = [a + b for a, b in zip(into.get(key, [0.0] * len(values)), values, strict=True)]
    return into


class HistoryTotals:
    """Per-process running totals of the request table's history: finished requests by state and method,
    their training durations and steps, and queue waits. Each read folds in the rows that finished (started)
    since the last fold and older than HISTORY_LAG (index ranges on finished_at / started_at, migration
    0005_speed) and re-reads only the newer ones, so its cost follows recent traffic, not history. The bound:
    a row whose finished_at (started_at) lies more than HISTORY_LAG before the commit that wrote it is missed
    until the process restarts (the workers stamp these at commit time)."""

    def __init__(self) -> None:
        self.through: datetime | None = None
        self.finished: dict[tuple, list[float]] = {}
        self.waits: dict[tuple, list[float]] = {}
        self._lock = threading.Lock()

    def read(
        self, session: Session, now: datetime
    ) -> tuple[dict[tuple, list[float]], dict[tuple, list[float]]]:
        """(finished, waits) as of `now`: the folded totals plus the rows newer than the fold."""
        with self._lock:
            fold_to = now - HISTORY_LAG
            if self.through is None or fold_to > self.through:
                _add(self.finished, _finished_rows(session, self.through, fold_to))
                _add(self.waits, _wait_rows(session, self.through, fold_to))
                self.through = fold_to
            finished = _add(
                {k: list(v) for k, v in self.finished.items()}, _finished_rows(session, fold_to, None)
            )
            waits = _add({k: list(v) for k, v in self.waits.items()}, _wait_rows(session, fold_to, None))
            return finished, waits


def snapshot(
    session: Session, settings: Settings, *, broker: bool = True, totals: HistoryTotals | None = None
) -> dict[str, Any]:
    """Everything the gauges need, in a few queries, none of them over the whole history (`HistoryTotals`:
    pass the collector's own so its folds last; a fresh one reads everything once)."""
    now = datetime.now(UTC)
    by_tenant, waits = (totals or HistoryTotals()).read(session, now)
    finished: dict[tuple, list[float]] = {}
    for (_, method, status), values in by_tenant.items():
        _add(finished, {(method, status): values})
    open_by_state_method = session.execute(  # the partial index ix_unlearn_requests_unfinished
        select(UnlearnRequest.status, UnlearnRequest.method, func.count())
        .where(unfinished(UnlearnRequest.status))
        .group_by(UnlearnRequest.status, UnlearnRequest.method)
    ).all()
    by_state_method = [(st, m, int(v[0])) for (m, st), v in finished.items()] + [
        (str(RequestStatus(st).value), m, n) for st, m, n in open_by_state_method
    ]
    oldest_queued = session.execute(
        select(func.min(UnlearnRequest.created_at)).where(UnlearnRequest.status == literal_column("'queued'"))
    ).scalar()
    running = session.execute(
        select(
            UnlearnRequest.id,
            UnlearnRequest.method,
            UnlearnRequest.step,
            UnlearnRequest.total_steps,
            BaseModel.name,
        )
        .join(BaseModel, BaseModel.id == UnlearnRequest.base_model_id)
        .where(UnlearnRequest.status.in_(RUNNING))
    ).all()
    workers = session.execute(select(WorkerHeartbeat)).scalars().all()
    adapters = session.execute(
        select(BaseModel.name, AdapterVersion.state, func.count())
        .select_from(AdapterVersion)
        .join(BaseModel, BaseModel.id == AdapterVersion.base_model_id)
        .group_by(BaseModel.name, AdapterVersion.state)
    ).all()
    dynamics = running_dynamics(session, [r.id for r in running])
    alive_after = worker_alive_after_s(settings)
    worker_rows = []
    for w in workers:
        age = _age_s(w.last_seen, now)
        worker_rows.append(
            {
                "name": w.worker_name,
                "queues": list(w.queues or []),
                "hostname": w.hostname,
                "pid": w.pid,
                "current_request_id": w.current_request_id,
                "info": dict(w.info or {}),
                "heartbeat_age_s": age,
                "alive": bool(w.alive) and age is not None and age <= alive_after,
                "started_at": w.started_at,
            }
        )
    queues = broker_queue_depths(settings, _queue_names()) if broker else {}
    return {
        "at": now,
        "by_state_method": by_state_method,
        "oldest_queued_age_s": _age_s(oldest_queued, now),
        # Histograms as [count, sum, *cumulative bucket counts] (see _finished_rows / _wait_rows).
        "queue_wait": waits.get((), [0.0, 0.0] + [0.0] * len(TIME_BUCKETS)),
        "training": {
            key: {
                "durations": [v[1], v[2], *v[4 : 4 + len(TIME_BUCKETS)]],
                "steps": [v[1], v[3], *v[4 + len(TIME_BUCKETS) :]],
            }
            for key, v in finished.items()
            if key[1] in {s.value for s in TIMED_OUTCOMES} and v[1]
        },
        "running": [
            {
                "id": r.id,
                "method": r.method,
                "base_model": r.name,
                "step": r.step,
                "total_steps": r.total_steps,
                **dynamics.get(r.id, {}),
            }
            for r in running
        ],
        "workers": worker_rows,
        "adapters": [
            (name, str(state.value if hasattr(state, "value") else state), n) for name, state, n in adapters
        ],
        "queues": queues,
    }


def _queue_names() -> tuple[str, ...]:
    from blade_service.contracts.names import ALL_QUEUES

    return ALL_QUEUES


def _histogram(
    name: str,
    doc: str,
    buckets: tuple[float, ...],
    labelnames: list[str],
    series: dict[tuple[str, ...], list[float]],
) -> HistogramMetricFamily:
    """A histogram family from aggregates: labels -> [count, sum, *cumulative counts per bound]."""
    family = HistogramMetricFamily(name, doc, labels=labelnames)
    for labels, (count, total, *cumulative) in sorted(series.items()):
        counts = [(str(float(b)), c) for b, c in zip(buckets, cumulative, strict=True)]
        counts.append(("+Inf", count))
        family.add_metric(list(labels), counts, sum_value=float(total))
    return family


class ServiceStateCollector(Collector):
    """Gauges and histograms computed from the database when Prometheus scrapes."""

    def __init__(self, settings: Settings, session_factory: Callable[[], Session]):
        self.settings = settings
        self.session_factory = session_factory
        self._cache: tuple[float, dict[str, Any]] | None = None
        self._lock = threading.Lock()
        self.totals = HistoryTotals()

    def current(self) -> dict[str, Any]:
        with self._lock:
            if self._cache is not None and time.monotonic() - self._cache[0] < SNAPSHOT_TTL_S:
                return self._cache[1]
            with self.session_factory() as session:
                snap = snapshot(session, self.settings, totals=self.totals)
            self._cache = (time.monotonic(), snap)
            return snap

    def invalidate(self) -> None:
        with self._lock:
            self._cache = None

    def collect(self) -> Iterable[Any]:
        try:
            snap = self.current()
        except Exception as exc:  # the database is down: say so, don't fail the whole scrape
            log.warning("metrics.snapshot_failed", extra={"error": repr(exc)})
            up = GaugeMetricFamily("blade_database_up", "1 when the last scrape could read the database")
            up.add_metric([], 0)
            yield up
            return
        up = GaugeMetricFamily("blade_database_up", "1 when the last scrape could read the database")
        up.add_metric([], 1)
        yield up

        # One name per value: all methods together is `sum by (state) (blade_unlearn_requests)`.
        by_state = GaugeMetricFamily(
            "blade_unlearn_requests", "Unlearn requests by state and method", labels=["state", "method"]
        )
        counts: dict[tuple[str, str], int] = defaultdict(int)
        methods = {m for _, m, _ in snap["by_state_method"]} or {"blade"}
        for state, method, n in snap["by_state_method"]:
            counts[(state, method)] += n
        for state in RequestStatus:  # every state present (0 when none), so panels do not go blank
            for method in sorted(methods):
                by_state.add_metric([state.value, method], counts.get((state.value, method), 0))
        yield by_state

        depth = GaugeMetricFamily(
            "blade_queue_depth", "Messages waiting in each broker queue", labels=["queue"]
        )
        for queue, n in sorted(snap["queues"].items()):
            if n is not None:
                depth.add_metric([queue], n)
        yield depth
        broker_up = GaugeMetricFamily("blade_broker_up", "1 when the broker answered the queue-depth query")
        broker_up.add_metric(
            [], 1 if snap["queues"] and all(v is not None for v in snap["queues"].values()) else 0
        )
        yield broker_up

        oldest = GaugeMetricFamily(
            "blade_oldest_queued_request_age_seconds", "Age of the oldest request still queued (0 when none)"
        )
        oldest.add_metric([], snap["oldest_queued_age_s"] or 0.0)
        yield oldest

        yield _histogram(
            "blade_request_queue_wait_seconds",
            "Time from submission to the start of training",
            TIME_BUCKETS,
            [],
            {(): snap["queue_wait"]},
        )
        durations = {key: h["durations"] for key, h in snap["training"].items()}
        steps = {key: h["steps"] for key, h in snap["training"].items()}
        yield _histogram(
            "blade_request_training_duration_seconds",
            "Start to finish of finished requests, by method and outcome",
            TIME_BUCKETS,
            ["method", "outcome"],
            durations,
        )
        yield _histogram(
            "blade_request_training_steps",
            "Outer steps of finished requests, by method and outcome",
            STEP_BUCKETS,
            ["method", "outcome"],
            steps,
        )

        labels = ["request_id", "base_model", "method"]
        fams = {
            "step": GaugeMetricFamily(
                "blade_running_request_step", "Outer step of each running request", labels=labels
            ),
            "progress": GaugeMetricFamily(
                "blade_running_request_progress_ratio",
                "step / step cap of each running request",
                labels=labels,
            ),
            "lambda": GaugeMetricFamily(
                "blade_running_request_lambda", "Dual variable lambda (latest step)", labels=labels
            ),
            "L_ret": GaugeMetricFamily(
                "blade_running_request_l_ret", "Retain loss L_ret (latest step)", labels=labels
            ),
            "L_fgt": GaugeMetricFamily(
                "blade_running_request_l_fgt", "Forget loss L_fgt (latest step)", labels=labels
            ),
            "epsilon": GaugeMetricFamily(
                "blade_running_request_epsilon", "Retain-loss budget epsilon", labels=labels
            ),
            "rate": GaugeMetricFamily(
                "blade_running_request_outer_step_rate",
                "Outer steps per second over the latest events",
                labels=labels,
            ),
        }
        for r in snap["running"]:
            lv = [r["id"], r["base_model"], r["method"]]
            fams["step"].add_metric(lv, r.get("step") or 0)
            if r.get("total_steps"):
                fams["progress"].add_metric(lv, min(1.0, (r.get("step") or 0) / r["total_steps"]))
            record = r.get("record") or {}
            for key in ("lambda", "L_ret", "L_fgt", "epsilon"):
                if isinstance(record.get(key), int | float):
                    fams[key].add_metric(lv, float(record[key]))
            if r.get("rate") is not None:
                fams["rate"].add_metric(lv, r["rate"])
        yield from fams.values()

        alive = GaugeMetricFamily(
            "blade_workers_alive", "Workers whose heartbeat is recent, by queue", labels=["queue"]
        )
        per_queue: dict[str, int] = defaultdict(int)
        age = GaugeMetricFamily(
            "blade_worker_heartbeat_age_seconds", "Seconds since each worker's heartbeat", labels=["worker"]
        )
        up_w = GaugeMetricFamily(
            "blade_worker_up", "1 when the worker's heartbeat is recent", labels=["worker"]
        )
        busy = GaugeMetricFamily(
            "blade_worker_running", "1 while the worker runs an unlearn request", labels=["worker"]
        )
        for w in snap["workers"]:
            if w["alive"]:
                for q in w["queues"] or ["unknown"]:
                    per_queue[q] += 1
            if w["heartbeat_age_s"] is not None:
                age.add_metric([w["name"]], w["heartbeat_age_s"])
            up_w.add_metric([w["name"]], 1 if w["alive"] else 0)
            busy.add_metric([w["name"]], 1 if w["alive"] and w["current_request_id"] else 0)
        for q in _queue_names():
            per_queue.setdefault(q, 0)
        for q, n in sorted(per_queue.items()):
            alive.add_metric([q], n)
        yield from (alive, age, up_w, busy)  # GPU peak: the worker's own blade_gpu_memory_peak_bytes

        adapters = GaugeMetricFamily(
            "blade_adapters", "Adapter versions by base model and state", labels=["base_model", "state"]
        )
        for name, state, n in snap["adapters"]:
            adapters.add_metric([name, state], n)
        yield adapters


# --- HTTP metrics and middleware --------------------------------------------------------------------------


class HttpMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "blade_http_requests",
            "HTTP requests by method, route template and status",
            ["method", "route", "status"],
            registry=registry,
        )
        self.latency = Histogram(
            "blade_http_request_duration_seconds",
            "HTTP request latency by method and route template",
            ["method", "route"],
            buckets=HTTP_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "blade_http_requests_in_flight", "HTTP requests being served", registry=registry
        )


class ObservabilityMiddleware:
    """Pure ASGI (cheap on the hot path): latency and counts by route template, X-Request-ID, access log."""

    def __init__(
        self,
        app: Any,
        metrics: HttpMetrics,
        *,
        skip_paths: tuple[str, ...] = ("/metrics", "/healthz", "/readyz"),
    ):
        self.app = app
        self.metrics = metrics
        self.skip_paths = skip_paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace_id = None
        for name, value in scope.get("headers") or ():
            if name == b"x-request-id":
                trace_id = value.decode("latin-1")[:64]
                break
        trace_id = trace_id or new_trace_id()
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", trace_id.encode("latin-1"))]
            await send(message)

        start = time.perf_counter()
        self.metrics.in_flight.inc()
        try:
            with bind(trace_id=trace_id):
                await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight.dec()
            elapsed = time.perf_counter() - start
            route = scope.get("route")
            template = getattr(route, "path", None) or UNMATCHED_ROUTE
            method = scope.get("method", "")
            self.metrics.requests.labels(method, template, str(status["code"])).inc()
            self.metrics.latency.labels(method, template).observe(elapsed)
            path = scope.get("path") or ""
            if path not in self.skip_paths and not path.startswith(SKIP_LOG_PREFIXES):
                # A route about one unlearn request names it, so its lines join the worker's for that request.
                request_id = (scope.get("path_params") or {}).get("request_id")
                with bind(trace_id=trace_id, request_id=request_id):
                    log.info(
                        "http.request",
                        extra={
                            "method": method,
                            "path": path,
                            "route": template,
                            "status": status["code"],
                            "duration_ms": round(elapsed * 1000, 2),
                        },
                    )


def install_observability(
    app: Any,
    settings: Settings,
    session_factory: Callable[[], Session] | None = None,
) -> CollectorRegistry:
    """Add the middleware and `GET /metrics` to a FastAPI app; returns the app's registry."""
    from fastapi import Response

    if session_factory is None:
        from blade_service.persistence.db import session_factory as make_factory

        session_factory = make_factory(settings)
    registry = CollectorRegistry()
    http = HttpMetrics(registry)
    state = ServiceStateCollector(settings, session_factory)
    registry.register(state)
    app.add_middleware(ObservabilityMiddleware, metrics=http)
    app.state.metrics_registry = registry
    app.state.metrics_state = state

    if settings.metrics_port:
        serve_metrics_port(registry, settings.host, settings.metrics_port)
        return registry

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return registry


def serve_metrics_port(registry: CollectorRegistry, host: str, port: int) -> None:
    """Serve `registry` on its own port (a daemon thread); the public app then has no `/metrics`. With several
    API processes the first one binds it; the others log that and rely on it (the state gauges come from the
    database, so any one process reports them)."""
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.info("metrics.port_taken", extra={"port": port, "error": repr(exc)})
