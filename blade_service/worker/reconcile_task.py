"""The `reconcile` task (maintenance queue, periodic): re-publish what the broker lost, purge forget data
whose retention is over, verify the audit chain and sign its head."""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

from sqlalchemy import text

from blade_service.broker.dispatch import enqueue_unlearn
from blade_service.contracts.names import TaskName
from blade_service.persistence import audit, audit_heads, jobs, retention
from blade_service.persistence.db import session_scope
from blade_service.persistence.settings import Settings, get_settings
from blade_service.persistence.storage import get_storage
from blade_service.worker.celery_app import app
from blade_service.worker.observability import metrics as worker_metrics
from blade_service.worker.stacks import reconcile_operations

log = logging.getLogger("blade.worker")

RECONCILE_LOCK_ID = int.from_bytes(hashlib.sha256(b"blade-reconcile").digest()[:4], "big") & 0x7FFFFFFF


@app.task(name=TaskName.RECONCILE.value, soft_time_limit=60, time_limit=120, ignore_result=True)
def reconcile() -> dict[str, Any]:
    """Re-publish requests the broker may have lost (see `persistence.jobs.reconcile_candidates`).

    One reconciler at a time: a PostgreSQL advisory lock (SQLite serialises writers anyway); the periodic
    message `expires` after one interval, so a backlog of them never piles up behind a busy worker.
    """
    settings = get_settings()
    with session_scope(settings) as session:
        if session.get_bind().dialect.name == "postgresql":
            got = session.execute(
                text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": RECONCILE_LOCK_ID}
            ).scalar()
            if not got:
                return {"skipped": "locked"}
        ids = jobs.reconcile_candidates(session, requeue_after_s=settings.requeue_after_s)
        sent = [rid for rid in ids if enqueue_unlearn(rid)]
        jobs.mark_enqueued(session, request_ids=sent)
    if sent:
        log.info("reconcile.requeued", extra={"requests": sent})
    return {
        "requeued": sent,
        "operations": _reconcile_operations(settings),
        "purged": _purge_due(settings),
        "audit_ok": _check_audit_chain(settings),
        "audit_head": _sign_audit_head(settings),
    }


_audit_checked_at = 0.0  # monotonic time of this process's last full audit check


def _check_audit_chain(settings: Settings) -> bool | None:
    """At most every `audit_check_interval_s`: verify the whole hash chain and every signed head, and export
    the outcome as `blade_audit_chain_ok` (deploy/alerts.yml pages on 0). None when it was not due."""
    global _audit_checked_at

    if time.monotonic() - _audit_checked_at < settings.audit_check_interval_s:
        return None
    _audit_checked_at = time.monotonic()
    try:
        with session_scope(settings) as session:
            ok = audit.verify_chain(session).intact
            ok = (
                ok
                and audit_heads.check_signed_heads(session, get_storage(settings), reveal_ids=True).problem
                is None
            )
    except Exception as exc:
        log.warning("reconcile.audit_check_failed", extra={"error": repr(exc)})
        return None
    if not ok:
        log.error(
            "audit.chain_broken", extra={"hint": "GET /audit-log/verify with an operator key says where"}
        )
    worker_metrics().audit_chain_ok.set(1 if ok else 0)
    return ok


def _sign_audit_head(settings: Settings) -> int | None:
    """Sign the audit chain's head into the artifact store (persistence/audit_heads.py), so removing the
    newest entries is caught by the next verify; the id of the head signed."""
    try:
        with session_scope(settings) as session:
            record = audit_heads.current_signed_head(session, get_storage(settings), settings)
    except Exception as exc:
        log.warning("reconcile.sign_head_failed", extra={"error": repr(exc)})
        return None
    return record["head_id"] if record else None


def _reconcile_operations(settings: Settings) -> list[str]:
    """Stack operations (compactions) whose message the broker lost, re-published (worker/stacks.py)."""
    try:
        return reconcile_operations(settings, requeue_after_s=settings.requeue_after_s)
    except Exception as exc:
        log.warning("reconcile.operations_failed", extra={"error": repr(exc)})
        return []


def _purge_due(settings: Settings) -> list[str]:
    """Forget datasets whose retention is over and that no worker purged (cancelled while queued, a
    retention that ends days after a failure, a purge that failed)."""
    try:
        with session_scope(settings) as session:
            purged = retention.purge_due(session, get_storage(settings), settings=settings)
    except Exception as exc:
        log.warning("reconcile.purge_failed", extra={"error": repr(exc)})
        return []
    if purged:
        log.info("reconcile.purged", extra={"datasets": purged})
    return purged
