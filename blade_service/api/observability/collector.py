"""The Prometheus collector of the service's state (`ServiceStateCollector`): the gauges built from a
`snapshot` of the database's aggregates when Prometheus scrapes, cached for `SNAPSHOT_TTL_S` so several
scrapers cost one set of queries; every such metric's name and help text is defined here."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session

from blade_service.api.observability.history import HistoryTotals
from blade_service.api.observability.state import _queue_names, snapshot
from blade_service.persistence.models import RequestStatus
from blade_service.persistence.settings import Settings

log = logging.getLogger("blade.api.http")

SNAPSHOT_TTL_S = 5.0


class ServiceStateCollector(Collector):
    """Gauges computed from the database when Prometheus scrapes. Time in queue, training durations and
    steps and a running request's dynamics are not among them: the workers export those as they happen
    (`worker/observability.py`), and no value is exported here under a second name."""

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
            "blade_adapters",
            "Adapter versions by base model, its tenant ('' for a shared model) and state",
            labels=["base_model", "tenant", "state"],
        )
        for name, tenant, state, n in snap["adapters"]:
            adapters.add_metric([name, tenant, state], n)
        yield adapters
