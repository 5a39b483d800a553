"""The worker's Celery entry point: the shared app (`broker.app`) with this process's tasks and metrics.

    celery -A blade_service.worker.celery_app:app worker -Q unlearn -c 1 --max-tasks-per-child 1

The task modules are listed by name, so importing this module (as every task module does, for `app.task`)
does not import them in turn; the worker imports them at start-up.
"""

from __future__ import annotations

from blade_service.broker.app import app
from blade_service.worker.observability import connect_signals as connect_metrics_signals

app.conf.imports = ("blade_service.worker.tasks", "blade_service.worker.stacks")
connect_metrics_signals()  # Prometheus metrics of tasks and training runs (worker/observability.py)

__all__ = ["app"]
