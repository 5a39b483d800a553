"""Publishing work to the workers, by task name: the API's calls (compactions, exports, generation) and the
workers' own (the submission relay, the reconciler, the stack tasks). Torch-free; it imports only the Celery
app.

from blade_service.broker.dispatch import enqueue_unlearn, generate
enqueue_unlearn(request.id)                          # after the request row is committed (submission relay)
completion = generate("demo-tiny", "Who wrote ...?", max_new_tokens=32, timeout=60, as_question=True)
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, NamedTuple

from celery.exceptions import TimeoutError as CeleryTimeout

from blade_service.broker.app import app
from blade_service.contracts.names import Priority, Queue, TaskName

log = logging.getLogger(__name__)


class DispatchError(RuntimeError):
    """The work could not be handed to a worker, or the worker reported a failure."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class GenerateTimeout(DispatchError, TimeoutError):
    """No worker answered within the bounded wait."""


def enqueue_unlearn(request_id: str, *, countdown: float | None = None) -> bool:
    """Publish the unlearn task for a committed request; False (logged) when the broker is unreachable.

    A False is not an error for the client: the request row is already committed as `queued`, and the
    reconciler enqueues it again later. Safe to call twice: the task decides by a database lease.
    """
    try:
        app.send_task(
            TaskName.UNLEARN.value,
            kwargs={"request_id": str(request_id)},
            queue=Queue.UNLEARN.value,
            priority=Priority.NORMAL.value,
            countdown=countdown,
            ignore_result=True,  # progress and outcome live in the database, not the result backend
        )
    except Exception as exc:  # broker down or misconfigured: the reconciler is the safety net
        log.warning("enqueue.failed", extra={"request_id": str(request_id), "error": repr(exc)})
        return False
    return True


def enqueue_compact(operation_id: str) -> bool:
    """Publish the compaction of a committed stack operation; False (logged) when the broker is away."""
    try:
        app.send_task(
            TaskName.COMPACT.value,
            kwargs={"operation_id": str(operation_id)},
            queue=Queue.UNLEARN.value,
            priority=Priority.NORMAL.value,
            ignore_result=True,  # the outcome lives in the stack_operations row
        )
    except Exception as exc:
        log.warning("enqueue.failed", extra={"operation_id": str(operation_id), "error": repr(exc)})
        return False
    return True


def export(
    base_model_id: str, fmt: str, timeout: float = 600.0, accept_timeout: float | None = None
) -> dict[str, Any]:
    """Have a worker archive the effective model of the base model (`fmt` adapter or merged) in storage;
    {key, sha256, size, stack, format}. Raises GenerateTimeout / DispatchError as `generate` does: when no
    worker takes the task within `accept_timeout` (it then expires unprocessed) or ends it in `timeout`."""
    kwargs = {"base_model_id": base_model_id, "fmt": fmt}
    return _call(TaskName.EXPORT.value, kwargs, timeout, accept_timeout)


def _call(
    task: str, kwargs: dict[str, Any], timeout: float, accept_timeout: float | None = None
) -> dict[str, Any]:
    accept = min(accept_timeout or timeout, timeout)
    try:
        result = app.send_task(
            task, kwargs=kwargs, queue=Queue.INFERENCE.value, priority=Priority.HIGH.value, expires=accept
        )
    except Exception as exc:
        raise DispatchError("broker_unavailable", f"could not reach the task broker: {exc}") from exc
    if accept < timeout:  # the task reports STARTED (track_started): wait for a worker to take it first
        deadline = time.monotonic() + accept
        try:
            while result.state == "PENDING":
                if time.monotonic() >= deadline:
                    with contextlib.suppress(Exception):
                        result.forget()
                    raise GenerateTimeout(f"{task}_timeout", f"no worker took the task within {accept:g} s")
                time.sleep(0.2)
        except GenerateTimeout:
            raise
        except Exception as exc:
            raise DispatchError("result_backend_unavailable", f"could not read the result: {exc}") from exc
    try:
        payload: Any = result.get(timeout=timeout, propagate=False, interval=0.2)
    except CeleryTimeout:
        with contextlib.suppress(Exception):
            result.forget()
        raise GenerateTimeout(f"{task}_timeout", f"no worker answered within {timeout:g} s") from None
    except Exception as exc:
        raise DispatchError("result_backend_unavailable", f"could not read the result: {exc}") from exc
    if result.failed() or not isinstance(payload, dict):
        raise DispatchError(f"{task}_failed", f"{task} failed on the worker: {payload!r}")
    if payload.get("error"):
        err = payload["error"]
        raise DispatchError(err.get("code", "task_failed"), err.get("message", "the task failed"))
    return payload


def enqueue_reconcile() -> bool:
    """Ask for a reconciliation pass now (same task the periodic schedule sends)."""
    try:
        app.send_task(TaskName.RECONCILE.value, queue=Queue.MAINTENANCE.value, expires=60, ignore_result=True)
    except Exception as exc:
        log.warning("enqueue.failed", extra={"task": TaskName.RECONCILE.value, "error": repr(exc)})
        return False
    return True


class Completion(NamedTuple):
    prompt: str  # the text the model continued: a question in the model's own QA format (`as_question`)
    text: str


def generate(
    base_model_id: str,
    prompt: str,
    max_new_tokens: int = 64,
    timeout: float = 60.0,
    *,
    as_question: bool = False,
) -> Completion:
    """Greedy completion of `prompt` by the base model plus its active adapter stack, computed on a worker;
    with `as_question`, `prompt` is a question the worker formats as the model's QA rows are formatted.

    Waits at most `timeout` seconds: raises GenerateTimeout when no worker answered in time (the message
    expires unprocessed), DispatchError when the broker is unreachable or the worker failed.
    """
    kwargs: dict[str, Any] = {
        "base_model_id": base_model_id,
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
    }
    if as_question:  # only then: a worker deployed before questions still serves raw prompts
        kwargs["as_question"] = True
    try:
        result = app.send_task(
            TaskName.GENERATE.value,
            kwargs=kwargs,
            queue=Queue.INFERENCE.value,
            priority=Priority.HIGH.value,
            expires=timeout,  # nobody waits for an answer after this: don't compute it
        )
    except Exception as exc:
        raise DispatchError("broker_unavailable", f"could not reach the task broker: {exc}") from exc
    try:
        payload: Any = result.get(timeout=timeout, propagate=False, interval=0.1)
    except CeleryTimeout:
        with contextlib.suppress(Exception):
            result.forget()
        raise GenerateTimeout("generate_timeout", f"no worker answered within {timeout:g} s") from None
    except Exception as exc:  # result backend unreachable
        raise DispatchError("result_backend_unavailable", f"could not read the result: {exc}") from exc
    if result.failed() or not isinstance(payload, dict):
        raise DispatchError("generate_failed", f"generation failed on the worker: {payload!r}")
    if payload.get("error"):
        err = payload["error"]
        raise DispatchError(err.get("code", "generate_failed"), err.get("message", "generation failed"))
    return Completion(prompt=str(payload.get("prompt", prompt)), text=str(payload["text"]))  # ditto
