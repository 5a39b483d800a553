"""The state of the service read from the database (and the broker) for one scrape: `snapshot` gathers
aggregates — requests by state and method (GROUP BY), the oldest queued request, workers and their heartbeat
rows, adapters by state — and the broker's queue depths, in a few queries. A running request's dynamics are
not read here: its worker exports them as they happen (`worker/observability.py`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kombu import Connection
from sqlalchemy import func, literal_column, select
from sqlalchemy.orm import Session

from blade_service.api.observability.history import HistoryTotals, Totals, _add
from blade_service.contracts.names import ALL_QUEUES
from blade_service.persistence.models import (
    AdapterVersion,
    BaseModel,
    RequestStatus,
    Tenant,
    UnlearnRequest,
    WorkerHeartbeat,
)
from blade_service.persistence.requests import unfinished
from blade_service.persistence.settings import Settings

log = logging.getLogger("blade.api.http")

BROKER_TIMEOUT_S = 2.0


def worker_alive_after_s(settings: Settings) -> float:
    """A worker whose last heartbeat is older than this counts as gone."""
    return max(3 * settings.heartbeat_seconds, 15)


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


def snapshot(
    session: Session, settings: Settings, *, broker: bool = True, totals: HistoryTotals | None = None
) -> dict[str, Any]:
    """Everything the gauges need, in a few queries, none of them over the whole history (`HistoryTotals`:
    pass the collector's own so its folds last; a fresh one reads everything once)."""
    now = datetime.now(UTC)
    by_tenant = (totals or HistoryTotals()).read(session, now)
    finished: Totals = {}
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
    workers = session.execute(select(WorkerHeartbeat)).scalars().all()
    adapters = session.execute(  # names are per tenant: two tenants' "x" are two series
        select(BaseModel.name, func.coalesce(Tenant.name, ""), AdapterVersion.state, func.count())
        .select_from(AdapterVersion)
        .join(BaseModel, BaseModel.id == AdapterVersion.base_model_id)
        .outerjoin(Tenant, Tenant.id == BaseModel.tenant_id)
        .group_by(BaseModel.name, Tenant.name, AdapterVersion.state)
    ).all()
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
        "workers": worker_rows,
        "adapters": [
            (name, tenant, str(state.value if hasattr(state, "value") else state), n)
            for name, tenant, state, n in adapters
        ],
        "queues": queues,
    }


def _queue_names() -> tuple[str, ...]:
    return ALL_QUEUES
