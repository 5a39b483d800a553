"""The Celery application, configured from `Settings`: the one app both sides of the queue share. Torch-free:
the API publishes with it (`broker.dispatch`); the worker registers its tasks on it (`worker.celery_app`).

Brokers:
- production: Redis (`BLADE_BROKER_URL=redis://...`); unacknowledged messages come back after the visibility
  timeout, which is set above the task's hard time limit so a long training run is never handed out twice;
- embedded default: kombu's SQLAlchemy transport on a SQLite file under the data dir (`sqla+sqlite:///...`),
  which needs no server and works across processes (the API publishes, the worker consumes). It has no
  visibility timeout: a message taken by a worker that is then SIGKILLed stays taken, and the reconciler
  (`worker.reconcile_task.reconcile`, periodic) re-enqueues its request once the request's database lease
  expires.

Acks are late and a task whose worker process dies is rejected back to the queue, so a crash never drops an
accepted request; the task itself is idempotent (a database lease decides who runs a request, and the adapter
is created once per request). The GPU worker runs one task per child process (`--max-tasks-per-child 1`,
set by `blade worker` for the unlearn queue) so CUDA memory is returned to the driver after every run.

    celery -A blade_service.worker.celery_app:app worker -Q unlearn -c 1 --max-tasks-per-child 1
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from celery import Celery, signals

from blade_service.contracts.names import ALL_QUEUES, ROUTES, Queue, TaskName
from blade_service.persistence.jsonlog import connect_celery_signals
from blade_service.persistence.settings import Settings, get_settings

# Margin between the task's hard time limit and the broker's visibility timeout.
VISIBILITY_MARGIN_S = 600


def is_sql_broker(url: str) -> bool:
    return url.startswith(("sqla+", "sqlalchemy+"))


def build_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for this deployment (a plain dict, so tests can read it)."""
    broker = settings.resolved_broker_url()
    backend = settings.resolved_result_backend()
    if is_sql_broker(broker) or backend.startswith("db+sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    conf: dict[str, Any] = {
        "broker_url": broker,
        "result_backend": backend,
        "broker_connection_retry_on_startup": True,
        # Publishing from the API must not hang a request handler when the broker is down: a few quick
        # retries, then the caller leaves the request queued and the reconciler enqueues it later.
        "task_publish_retry_policy": {
            "max_retries": 2,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 1,
        },
        "broker_connection_timeout": 4,
        # Delivery semantics.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_track_started": True,
        "task_default_queue": Queue.UNLEARN.value,
        "task_routes": {name: {"queue": queue} for name, queue in ROUTES.items()},
        "task_create_missing_queues": True,
        # The soft limit raises inside the task (it records `failed: time_limit`); the hard one kills it.
        "task_soft_time_limit": max(1, min(settings.task_soft_time_limit_s, settings.task_time_limit_s - 60)),
        "task_time_limit": settings.task_time_limit_s,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_expires": timedelta(hours=1),  # results only serve generate's bounded wait
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "timezone": "UTC",
        "enable_utc": True,
        # Periodic: the reconciler, on its own queue so a long training run never delays it.
        "beat_schedule": {
            "reconcile": {
                "task": TaskName.RECONCILE.value,
                "schedule": float(settings.reconcile_interval_s),
                "options": {
                    "queue": Queue.MAINTENANCE.value,
                    "expires": float(settings.reconcile_interval_s),
                },
            },
            "webhooks": {  # due webhook deliveries and their retries (persistence/webhooks.py)
                "task": TaskName.WEBHOOKS.value,
                "schedule": float(settings.webhook_interval_s),
                "options": {"queue": Queue.MAINTENANCE.value, "expires": float(settings.webhook_interval_s)},
            },
        },
        "beat_schedule_filename": str((settings.data_dir / "celerybeat-schedule").resolve()),
    }
    if is_sql_broker(broker):
        # The SQL transport has no fanout exchange: remote control and events would need one. Its transport
        # options go straight to create_engine, so nothing else is set there.
        conf["worker_enable_remote_control"] = False
        conf["worker_send_task_events"] = False
    else:
        conf["broker_transport_options"] = {
            "visibility_timeout": settings.task_time_limit_s + VISIBILITY_MARGIN_S,
            "socket_connect_timeout": 4,
        }
        # Only generate's bounded wait reads results: give up on an unreachable store quickly.
        conf["result_backend_transport_options"] = {
            "socket_connect_timeout": 4,
            "retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
        }
    return conf


# A message header stamped at publish; the worker's metrics read it for the time a task waited in its queue.
HEADER_PUBLISHED_AT = "blade_published_at"


def _stamp_published_at(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None:
        headers.setdefault(HEADER_PUBLISHED_AT, time.time())


def make_celery(settings: Settings | None = None) -> Celery:
    """The app for `settings`; publishing from it stamps the publish time and the request/trace ids."""
    settings = settings or get_settings()
    celery = Celery("blade")
    celery.conf.update(build_config(settings))
    signals.before_task_publish.connect(_stamp_published_at, weak=False, dispatch_uid="blade-published-at")
    connect_celery_signals()  # the request id and trace id ride along in task headers (structured logs)
    return celery


app = make_celery()


__all__ = ["ALL_QUEUES", "HEADER_PUBLISHED_AT", "app", "build_config", "is_sql_broker", "make_celery"]
