"""A bound on the calls that wait for a worker (`/generate`, `/export`).

Each such call holds one of the API process's threadpool threads for as long as it waits, up to its
timeout (`generate_timeout_s`, `export_timeout_s`). With no worker answering, 40 concurrent generate calls
(AnyIO's default thread count) left no thread for a status poll or a submission for a whole minute. Past
`MAX_WAITING` waiting calls a process answers the next one 429 at once, and the rest of the API keeps its
threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from blade_service.persistence.errors import TooManyRequests

MAX_WAITING = 8  # of AnyIO's 40 threadpool threads per API process
RETRY_AFTER_S = 5

_slots = threading.BoundedSemaphore(MAX_WAITING)


@contextmanager
def waiting_for_a_worker(what: str) -> Iterator[None]:
    """Hold one of the process's MAX_WAITING slots while `what` waits; TooManyRequests when none is free."""
    if not _slots.acquire(blocking=False):
        raise TooManyRequests(
            f"{MAX_WAITING} calls to this API process are already waiting for a worker; retry the {what} in "
            f"{RETRY_AFTER_S} s",
            code="too_many_waiting",
        )
    try:
        yield
    finally:
        _slots.release()
