"""Every Celery task of the worker, imported so that a worker process registers them all
(`worker.celery_app` lists this module in `imports`). Each task lives in the module named for it:

- `worker.unlearn_task.unlearn` (GPU queue): one unlearn request to a terminal state (its steps: that module);
- `worker.generate_task.generate` (inference queue): a greedy completion by base model + active stack;
- `worker.reconcile_task.reconcile` (maintenance, periodic): re-publish what the broker lost, purge, audit;
- `worker.webhooks_task.deliver_webhooks` (maintenance, periodic): POST the webhook deliveries that are due;
- `worker.stacks.compact` and `.export`: an adapter stack compacted into one adapter, or exported.

The pieces they share: `worker.process` (pool-process signals), `worker.artifacts` (storage keys, the local
cache, base models), `worker.lease` (the lease heartbeat), `worker.errors` (typed failures). Beside the tasks,
each worker's main process runs a heartbeat (`worker.heartbeat`) and the submission relay
(`worker.submission_relay`), which publishes the task of each request that heads its base model's queue.

    celery -A blade_service.worker.celery_app:app worker -Q unlearn -c 1 --max-tasks-per-child 1
"""

from __future__ import annotations

from blade_service.worker import heartbeat as _heartbeat  # noqa: F401  (connects the worker's heartbeat signals)
from blade_service.worker import process as _process  # noqa: F401  (connects the pool-process signals)
from blade_service.worker import submission_relay as _relay  # noqa: F401  (starts the relay on worker_ready)
from blade_service.worker.generate_task import generate
from blade_service.worker.reconcile_task import reconcile
from blade_service.worker.stacks import compact, export
from blade_service.worker.unlearn_task import unlearn
from blade_service.worker.webhooks_task import deliver_webhooks

__all__ = ["compact", "deliver_webhooks", "export", "generate", "reconcile", "unlearn"]
