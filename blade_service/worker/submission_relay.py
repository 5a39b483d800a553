"""The submission relay: publishes the unlearn task of each request that heads its base model's queue.

The API commits a submitted request and answers; it publishes nothing (a Celery publish costs the API
process several ms of CPU, more than the rest of the POST). Every worker's main process runs one relay, a
daemon thread started on Celery's `worker_ready`, which publishes what `jobs.unpublished_heads` finds and
records `enqueued_at` in the same transaction:
- at once on PostgreSQL, woken by the `NOTIFY` each submission's commit sends (`requests.SUBMITTED_CHANNEL`);
- at least every `POLL_S` on any database (SQLite has no NOTIFY; a notice lost with a connection is
  covered too).
Relays side by side share the rows out (FOR UPDATE SKIP LOCKED), and a duplicate publish would be harmless
anyway: the task decides by the request's lease. Requests behind the head are published by the worker that
finishes the one before (`unlearn_task._kick_next`), or by this relay once they head the queue. The
reconciler (`reconcile_task`) still re-publishes what the broker lost.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
from celery import signals

from blade_service.broker.dispatch import enqueue_unlearn
from blade_service.persistence import jobs
from blade_service.persistence.db import listen_dsn, session_scope
from blade_service.persistence.jsonlog import bind
from blade_service.persistence.requests import SUBMITTED_CHANNEL
from blade_service.persistence.settings import Settings, get_settings

log = logging.getLogger("blade.worker.relay")

POLL_S = 1.0  # the longest a head waits without a notice (SQLite, or a notice missed)
RECONNECT_S = 1.0  # wait after a failed pass or a lost LISTEN connection


def publish_pending(settings: Settings) -> list[str]:
    """One pass: publish every unpublished head, with the trace id of the call that submitted it, and record
    when; the ids sent (a refused publish stays unpublished for the next pass)."""
    sent = []
    with session_scope(settings) as session:
        for request_id, trace_id in jobs.unpublished_heads(session):
            with bind(request_id=request_id, trace_id=trace_id):
                if enqueue_unlearn(request_id):
                    sent.append(request_id)
        jobs.mark_enqueued(session, request_ids=sent)
    if sent:
        log.info("relay.published", extra={"requests": sent})
    return sent


class SubmissionRelay:
    """A daemon thread running `publish_pending` on each submission notice and every `POLL_S`."""

    def __init__(self, settings: Settings, *, poll_s: float = POLL_S) -> None:
        self.settings, self.poll_s = settings, poll_s
        self.dsn = listen_dsn(settings)  # None: SQLite, which polls
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blade-submission-relay", daemon=True)

    def start(self) -> SubmissionRelay:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.dsn is None:
                    self._poll()
                else:
                    self._listen(self.dsn)
            except Exception as exc:  # database or broker away: try again shortly
                log.warning("relay.pass_failed", extra={"error": repr(exc)})
                self._stop.wait(RECONNECT_S)

    def _poll(self) -> None:
        while not self._stop.is_set():
            publish_pending(self.settings)
            self._stop.wait(self.poll_s)

    def _listen(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"LISTEN {SUBMITTED_CHANNEL}")
            while not self._stop.is_set():
                publish_pending(self.settings)  # after LISTEN: sees earlier commits; later ones wake it
                for _ in conn.notifies(timeout=self.poll_s, stop_after=1):
                    pass  # one notice is enough: the pass publishes every head there is


_relay: dict[str, SubmissionRelay] = {}


@signals.worker_ready.connect(weak=False)
def _on_ready(**_: Any) -> None:
    _relay["main"] = SubmissionRelay(get_settings()).start()


@signals.worker_shutdown.connect(weak=False)
def _on_shutdown(**_: Any) -> None:
    if (relay := _relay.pop("main", None)) is not None:
        relay.stop()
