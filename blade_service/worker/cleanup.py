"""What follows a request's terminal state: its checkpoints, staged archive and scratch dir go, a success gets
its deletion certificate, and the forget data is purged once its retention is over."""

from __future__ import annotations

import logging
import shutil

from blade_service.persistence import certificates, jobs, retention
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import TERMINAL_STATUSES, RequestStatus
from blade_service.persistence.settings import Settings
from blade_service.persistence.storage import get_storage
from blade_service.worker.artifacts import adapter_key
from blade_service.worker.process import worker_id

log = logging.getLogger("blade.worker")


def cleanup_terminal(settings: Settings, *, request_id: str) -> None:
    """Once a request is terminal: drop every checkpoint, its staged archive when no adapter was registered
    from it, and the local scratch dir (the worker's copies of the data); then issue the certificate of a
    success and purge the forget data when its retention is over (persistence/retention.py). Best effort;
    never raises: the reconciler's purge pass and the certificate route catch up on what failed here."""
    succeeded = False
    try:
        with session_scope(settings) as session:
            req = jobs.get_request(session, request_id=request_id)
            if req is None or RequestStatus(req.status) not in TERMINAL_STATUSES:
                return
            ckpt, base_model_id, has_adapter = req.checkpoint_key, req.base_model_id, req.adapter is not None
            succeeded = RequestStatus(req.status) == RequestStatus.SUCCEEDED
        storage = get_storage(settings)
        if ckpt:
            storage.delete(ckpt)
        storage.delete_prefix(f"checkpoints/{request_id}")  # also any a crash left behind
        if not has_adapter:
            storage.delete(adapter_key(base_model_id=base_model_id, request_id=request_id))
    except Exception as exc:
        log.warning("unlearn.cleanup_failed", extra={"request_id": request_id, "error": repr(exc)})
    shutil.rmtree(settings.data_dir.resolve() / "work" / request_id, ignore_errors=True)
    if succeeded:
        issue_certificate(settings, request_id=request_id)
    _purge_forget_data(settings, request_id=request_id)


def issue_certificate(settings: Settings, *, request_id: str) -> None:
    """The deletion certificate of a success (once: a second call finds it). A failure here (say, an
    unreadable signing key) is logged and leaves the success alone: cleanup or the API's first GET retry."""
    try:
        with session_scope(settings) as session:
            certificates.issue_certificate(
                session, request_id, settings=settings, actor=f"worker:{worker_id()}"
            )
    except Exception as exc:
        log.warning("unlearn.certificate_failed", extra={"request_id": request_id, "error": repr(exc)})


def _purge_forget_data(settings: Settings, *, request_id: str) -> None:
    """Purge the request's forget data when its retention is over (persistence/retention.py); best effort."""
    try:
        with session_scope(settings) as session:
            if retention.purge_for_request(
                session, get_storage(settings), request_id=request_id, settings=settings
            ):
                log.info("unlearn.forget_data_purged", extra={"request_id": request_id})
    except Exception as exc:
        log.warning("unlearn.purge_failed", extra={"request_id": request_id, "error": repr(exc)})
