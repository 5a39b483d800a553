"""Per-process running totals of the request table's history (`HistoryTotals`): finished requests by tenant,
method and state, a GROUP BY folded in once, so a scrape costs the same at 100,000 past requests as at 100.
(Training durations and steps and time in queue are histograms the workers observe when a run starts and
ends, `worker/observability.py`; the API does not rebuild them from past requests.)"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, literal_column, select
from sqlalchemy.orm import Session

from blade_service.persistence.models import TERMINAL_STATUSES, RequestStatus, UnlearnRequest

HISTORY_LAG = timedelta(minutes=5)  # rows newer than this are re-read each scrape, older ones folded in once
# label values (tenant, method, status), or fewer of them, -> [count]
Totals = dict[tuple[Any, ...], list[float]]


def _window(column: Any, lo: datetime | None, hi: datetime | None) -> list[Any]:
    return [column.is_not(None)] + ([column >= lo] if lo else []) + ([column < hi] if hi else [])


def _finished_rows(session: Session, lo: datetime | None, hi: datetime | None) -> Totals:
    """(tenant, method, status) -> [count] over the terminal requests that finished in [lo, hi)."""
    r = UnlearnRequest
    terminal = r.status.in_([literal_column(f"'{s.value}'") for s in TERMINAL_STATUSES])
    rows = session.execute(
        select(r.tenant_id, r.method, r.status, func.count())
        .where(terminal, *_window(r.finished_at, lo, hi))
        .group_by(r.tenant_id, r.method, r.status)
    ).all()
    return {(t, m, str(RequestStatus(st).value)): [float(n or 0)] for t, m, st, n in rows}


def _add(into: Totals, more: Totals) -> Totals:
    for key, values in more.items():
        into[key] = [a + b for a, b in zip(into.get(key, [0.0] * len(values)), values, strict=True)]
    return into


class HistoryTotals:
    """Per-process running totals of the request table's history: finished requests by tenant, state and
    method. Each read folds in the rows that finished since the last fold and older than HISTORY_LAG (an index
    range on finished_at, migration 0005_speed) and re-reads only the newer ones, so its cost follows recent
    traffic, not history. The bound: a row whose finished_at lies more than HISTORY_LAG before the commit that
    wrote it is missed until the process restarts (the workers stamp it at commit time)."""

    def __init__(self) -> None:
        self.through: datetime | None = None
        self.finished: Totals = {}
        self._lock = threading.Lock()

    def read(self, session: Session, now: datetime) -> Totals:
        """Finished requests as of `now`: the folded totals plus the rows newer than the fold."""
        with self._lock:
            fold_to = now - HISTORY_LAG
            if self.through is None or fold_to > self.through:
                _add(self.finished, _finished_rows(session, self.through, fold_to))
                self.through = fold_to
            recent = _finished_rows(session, fold_to, None)
            return _add({k: list(v) for k, v in self.finished.items()}, recent)
