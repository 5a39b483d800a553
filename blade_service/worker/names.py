"""Task names, queue names and priorities: re-exported from the torch-free contracts layer
(`contracts/names.py`), where the API, the worker and the CLI all read them."""

from __future__ import annotations

from blade_service.contracts.names import ALL_QUEUES, RECONCILE_LOCK, ROUTES, Priority, Queue, TaskName

__all__ = ["ALL_QUEUES", "RECONCILE_LOCK", "ROUTES", "Priority", "Queue", "TaskName"]
