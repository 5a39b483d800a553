"""WorkerHeartbeat rows: each worker's main process says it is alive every `heartbeat_seconds`.

Started on Celery's `worker_ready` (main process only, never in a pool child), marked `alive=False` on a clean
shutdown. A SIGKILLed worker simply stops beating: readers judge liveness by `last_seen`. The request a worker
is running is set by that task's lease keeper (worker/lease.py), on the same row.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import threading
from typing import Any

from celery import signals

from blade_service.persistence import jobs
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import WorkerHeartbeat
from blade_service.persistence.settings import get_settings

log = logging.getLogger("blade.worker.heartbeat")

_stop = threading.Event()
_state: dict[str, Any] = {}


def _queues(consumer: Any) -> list[str]:
    try:
        return sorted(q.name for q in consumer.task_consumer.queues)
    except Exception:  # consumer layout differs between Celery versions: best effort
        return []


def _beat(*, alive: bool = True) -> None:
    with session_scope(get_settings()) as session:
        jobs.beat_worker(
            session,
            worker_name=_state["name"],
            queues=_state.get("queues"),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            info=_state.get("info"),
            alive=alive,
            current_request_id=None if not alive else _current(session),
        )


def _current(session: Any) -> str | None:
    """Keep the running request the lease keeper recorded (this beat must not clear it)."""
    row = session.get(WorkerHeartbeat, _state["name"])
    return row.current_request_id if row is not None else None


def _loop(interval: float) -> None:
    while not _stop.wait(interval):
        try:
            _beat()
        except Exception as exc:
            log.warning("worker.heartbeat_failed", extra={"error": repr(exc)})


@signals.worker_ready.connect(weak=False)
def _on_ready(sender: Any = None, **_: Any) -> None:
    settings = get_settings()
    _state["name"] = getattr(sender, "hostname", None) or f"worker@{socket.gethostname()}"
    _state["queues"] = _queues(sender)
    _state["info"] = {"python": platform.python_version(), "device": settings.device or "auto"}
    try:
        _beat()
    except Exception as exc:
        log.warning("worker.heartbeat_failed", extra={"error": repr(exc)})
    threading.Thread(
        target=_loop, args=(float(settings.heartbeat_seconds),), daemon=True, name="blade-worker-heartbeat"
    ).start()


@signals.worker_shutdown.connect(weak=False)
def _on_shutdown(**_: Any) -> None:
    _stop.set()
    if "name" in _state:
        try:
            _beat(alive=False)
        except Exception as exc:
            log.warning("worker.heartbeat_failed", extra={"error": repr(exc)})
