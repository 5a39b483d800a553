"""The API's HTTP metrics and its pure-ASGI middleware: requests and latency by method, route template and
status, requests in flight, the X-Request-ID trace id (taken from the caller or generated, echoed in the
response and bound to every log line) and the access log."""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import Message, Receive, Scope, Send

from blade_service.persistence.jsonlog import bind, new_trace_id

log = logging.getLogger("blade.api.http")

HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
UNMATCHED_ROUTE = "<unmatched>"
SKIP_LOG_PREFIXES = ("/dashboard/static/",)  # no access-log line for these (still counted in the metrics)


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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

        async def send_wrapper(message: Message) -> None:
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
