"""The API's Prometheus metrics (`GET /metrics`) and its HTTP middleware (latency, trace ids, access log).

Two kinds of metric live here:
- process metrics kept in memory: HTTP requests and latency by method, route template and status;
- the state of the service as aggregate gauges read from the database at scrape time (cached for
  `SNAPSHOT_TTL_S`, so a busy Prometheus or several of them cost one set of queries): requests by state and
  method (GROUP BY; finished ones folded into per-process totals, `HistoryTotals`, so a scrape's cost does
  not grow with history), queue depth per queue (the broker's count), the oldest queued request, workers
  alive and each one's heartbeat age, adapters by state.

Where things live: `middleware.py` (HTTP metrics, trace ids, access log), `state.py` (the database snapshot
and the broker's queue depths), `history.py` (`HistoryTotals`), `collector.py` (the scrape-time metrics and
their names); this module wires them into the app.

Workers export their own metrics on their own port (`worker/observability.py`), observed when things happen:
time in queue, training durations and steps (the histograms), each running request's step, progress and
dynamics. No metric is exported by both under two names.
Every name starts with `blade_`. No torch here.

    install_observability(app, settings)   # in create_app: adds the middleware and GET /metrics
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, start_http_server
from sqlalchemy.orm import Session

from blade_service.api.observability.collector import ServiceStateCollector
from blade_service.api.observability.middleware import HttpMetrics, ObservabilityMiddleware
from blade_service.persistence.db import session_factory as make_factory
from blade_service.persistence.settings import Settings

log = logging.getLogger("blade.api.http")


def install_observability(
    app: Any,
    settings: Settings,
    session_factory: Callable[[], Session] | None = None,
) -> CollectorRegistry:
    """Add the middleware and `GET /metrics` to a FastAPI app; returns the app's registry."""
    if session_factory is None:
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
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        log.info("metrics.port_taken", extra={"port": port, "error": repr(exc)})
