"""The lease heartbeat of a running request: a daemon thread renews the database lease (`persistence.jobs`),
beats the worker's row and notes a cancel or a lost lease for the training loop to act on."""

from __future__ import annotations

import logging
import threading

from blade_service.persistence import jobs
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import RequestStatus
from blade_service.persistence.settings import Settings

log = logging.getLogger("blade.worker")


class LeaseKeeper:
    """Renews the request's lease every `heartbeat_seconds` in a daemon thread; notes cancels."""

    def __init__(self, *, request_id: str, owner: str, settings: Settings, worker_name: str):
        self.request_id, self.owner, self.settings, self.worker_name = (
            request_id,
            owner,
            settings,
            worker_name,
        )
        self.cancelled = threading.Event()
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{request_id}", daemon=True)

    def __enter__(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or self.lost.is_set()

    def beat(self) -> None:
        with session_scope(self.settings) as session:
            state = jobs.renew_lease(
                session,
                request_id=self.request_id,
                owner=self.owner,
                lease_seconds=self.settings.lease_seconds,
            )
            jobs.beat_worker(session, worker_name=self.worker_name, current_request_id=self.request_id)
        if not state.owned and not (state.status and RequestStatus(state.status).terminal):
            log.warning("lease.lost", extra={"request_id": self.request_id, "owner": self.owner})
            self.lost.set()
        if state.cancel_requested:
            self.cancelled.set()

    def _run(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_seconds):
            try:
                self.beat()
            except Exception as exc:  # the database is away: keep trying; the lease may expire meanwhile
                log.warning("lease.renew_failed", extra={"request_id": self.request_id, "error": repr(exc)})
