"""Task names, queue names and priorities: constants in one place, never string literals scattered around.

Imported by the API (to publish) and by the worker (to register); nothing
here imports Celery or torch.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class Queue(StrEnum):
    """Celery queues. `unlearn` is the GPU training queue (one task per process, acks late)."""

    UNLEARN = "unlearn"  # GPU: one training run at a time per worker process
    INFERENCE = "inference"  # GPU or CPU: short greedy generations, model cached per stack digest
    MAINTENANCE = "maintenance"  # periodic jobs (the reconciler); never waits behind a training run


class TaskName(StrEnum):
    UNLEARN = "blade.unlearn"
    GENERATE = "blade.generate"
    RECONCILE = "blade.reconcile"
    COMPACT = "blade.compact"  # worker/stacks.py: the active stack as one verified adapter
    EXPORT = "blade.export"  # worker/stacks.py: the effective model as one adapter or merged weights
    WEBHOOKS = "blade.webhooks"  # periodic: POST due webhook deliveries, retrying with backoff


class Priority(IntEnum):
    """Redis emulates priorities with separate lists (0 is served first); the SQL broker ignores them."""

    HIGH = 0
    NORMAL = 3
    LOW = 6


# Which queue each task goes to (Celery `task_routes`).
ROUTES: dict[str, str] = {
    TaskName.UNLEARN: Queue.UNLEARN,
    TaskName.GENERATE: Queue.INFERENCE,
    TaskName.RECONCILE: Queue.MAINTENANCE,
    TaskName.COMPACT: Queue.UNLEARN,  # loads the model twice to verify: GPU work, behind training runs
    TaskName.EXPORT: Queue.INFERENCE,  # the API waits for it (bounded), like generate
    TaskName.WEBHOOKS: Queue.MAINTENANCE,
}

ALL_QUEUES: tuple[str, ...] = tuple(q.value for q in Queue)

# Cache key for the reconciler's lock (a row-level lock in the database; see worker.reconcile_task.reconcile).
RECONCILE_LOCK = "blade-reconcile"
