"""Per-process running totals of the request table's history (`HistoryTotals`): finished requests by tenant,
method and state, their training durations and steps, and queue waits, as SQL aggregates folded in once, so
a scrape costs the same at 100,000 past requests as at 100."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, func, literal_column, select
from sqlalchemy.orm import Session

from blade_service.persistence.models import TERMINAL_STATUSES, RequestStatus, UnlearnRequest

TIME_BUCKETS = (1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
STEP_BUCKETS = (1, 5, 10, 25, 50, 100, 150, 200, 250, 400, 600, 1000)

HISTORY_LAG = timedelta(minutes=5)  # rows newer than this are re-read each scrape, older ones folded in once
TIMED_OUTCOMES = (RequestStatus.SUCCEEDED, RequestStatus.FAILED, RequestStatus.CANCELLED)  # histogrammed
# label values (tenant, method, status), or fewer of them, -> counts and sums in a fixed order
Totals = dict[tuple[Any, ...], list[float]]


def _seconds(later: Any, earlier: Any, dialect: str) -> Any:
    """SQL for `later - earlier` in seconds."""
    if dialect == "sqlite":
        return (func.julianday(later) - func.julianday(earlier)) * 86400.0
    return func.extract("epoch", later - earlier)


def _window(column: Any, lo: datetime | None, hi: datetime | None) -> list[Any]:
    return [column.is_not(None)] + ([column >= lo] if lo else []) + ([column < hi] if hi else [])


def _finished_rows(session: Session, lo: datetime | None, hi: datetime | None) -> Totals:
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


def _wait_rows(session: Session, lo: datetime | None, hi: datetime | None) -> Totals:
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


def _add(into: Totals, more: Totals) -> Totals:
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
        self.finished: Totals = {}
        self.waits: Totals = {}
        self._lock = threading.Lock()

    def read(self, session: Session, now: datetime) -> tuple[Totals, Totals]:
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
