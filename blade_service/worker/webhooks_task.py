"""The `deliver_webhooks` task (maintenance queue, periodic): POST the webhook deliveries that are due."""

from __future__ import annotations

import logging
from typing import Any

from blade_service.contracts.names import TaskName
from blade_service.persistence import webhooks
from blade_service.persistence.db import session_scope
from blade_service.persistence.settings import get_settings
from blade_service.worker.celery_app import app

log = logging.getLogger("blade.worker")


@app.task(name=TaskName.WEBHOOKS.value, soft_time_limit=120, time_limit=150)
def deliver_webhooks() -> dict[str, Any]:
    """POST the webhook deliveries that are due; each failure waits twice as long (persistence/webhooks.py).

    Rows are locked while sent (SKIP LOCKED), so overlapping runs never send one delivery twice.
    """
    settings = get_settings()
    with session_scope(settings) as session:
        tried = webhooks.deliver_due(session, settings=settings)
    if tried:
        log.info("webhooks.tried", extra={"deliveries": tried})
    return {"tried": tried}
