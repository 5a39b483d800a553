"""Structured logs: one JSON object per line, carrying the request id from the API into the worker.

Every line has `ts`, `level`, `logger`, `service`, `event` (the message) and, when one is bound, `request_id`
(the unlearn request being worked on) and `trace_id` (the HTTP request that started the work, from the
`X-Request-ID` header or generated). Extra fields come from `logger.info("...", extra={...})` or `log_event`.

How the ids travel:
- API: `bind(request_id=..., trace_id=...)` sets context variables (the HTTP middleware binds the trace id;
  a route that creates or touches an unlearn request binds its id).
- Celery: `connect_celery_signals()` adds both ids as task message headers when a task is published
  (`before_task_publish`), and binds them again in the worker before the task runs (`task_prerun`);
  a task whose keyword arguments hold `request_id` binds that even when the header is missing.

    from blade_service.persistence.jsonlog import configure_logging, log_event, bind
    configure_logging(service="api")
    with bind(request_id="r-123"):
        log_event(logger, "request.submitted", base_model="demo-tiny")
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from typing import IO, Any

request_id_var: ContextVar[str | None] = ContextVar("blade_request_id", default=None)
trace_id_var: ContextVar[str | None] = ContextVar("blade_trace_id", default=None)

HEADER_REQUEST_ID = "blade_request_id"  # Celery message headers
HEADER_TRACE_ID = "blade_trace_id"

# Attributes every LogRecord has; anything else on a record came from `extra=` and goes into the line.
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON; never raises on odd extras (falls back to `repr`)."""

    def __init__(self, service: str = "blade") -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "service": self.service,
            "event": record.getMessage(),
        }
        for key in ("request_id", "trace_id"):
            value = (
                getattr(record, key, None) or (request_id_var if key == "request_id" else trace_id_var).get()
            )
            if value:
                line[key] = value
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in line and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=repr, ensure_ascii=False)


class TaskDataUnlogged(logging.Filter):
    """Celery logs every task's arguments when it is received and its return value when it succeeds, at
    INFO ("Task blade.generate[...] received", "... succeeded in 0.4s: {...}"). A generate task's are the
    prompt and the model's answer: personal data, kept in a log that outlives the forget data's purge. The
    lines stay; those values are dropped, from the message's arguments and from `data`, the extra that
    Celery attaches."""

    HIDDEN = ("args", "kwargs", "return_value")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("celery."):
            for attribute in ("args", "data"):
                context = getattr(record, attribute, None)
                if isinstance(context, dict) and any(k in context for k in self.HIDDEN):
                    hidden = {k: "(not logged)" for k in self.HIDDEN if k in context}
                    setattr(record, attribute, {**context, **hidden})
        return True


def configure_logging(*, service: str, level: str | int = "INFO", stream: IO[str] | None = None) -> None:
    """Route the root logger (and uvicorn's and Celery's) through one JSON handler. Idempotent."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_blade_json", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    handler.addFilter(TaskDataUnlogged())
    handler._blade_json = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level if isinstance(level, int) else level.upper())
    # uvicorn and celery install their own handlers; let their records reach ours instead.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "celery", "celery.task", "celery.worker"):
        named = logging.getLogger(name)
        named.handlers.clear()
        named.propagate = True


def log_event(logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """One structured line: `event` is a short dotted name, `fields` go in as keys."""
    logger.log(level, event, extra=fields)


@contextmanager
def bind(*, request_id: str | None = None, trace_id: str | None = None) -> Iterator[None]:
    """Bind ids for the lines logged inside the block (and the tasks published from it)."""
    tokens = []
    if request_id is not None:
        tokens.append((request_id_var, request_id_var.set(str(request_id))))
    if trace_id is not None:
        tokens.append((trace_id_var, trace_id_var.set(str(trace_id))))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def new_trace_id() -> str:
    return uuid.uuid4().hex[:16]


# --- Celery: ids into task headers on publish, back into context variables before the task runs ---------

_celery_tokens: dict[str, list[tuple[ContextVar[str | None], Token[str | None]]]] = {}


def _on_publish(
    sender: Any = None, headers: dict[str, Any] | None = None, body: Any = None, **_: Any
) -> None:
    if headers is None:
        return
    request_id = request_id_var.get()
    if request_id is None:  # tasks take ids as keyword arguments: the request id is often right there
        kwargs = body[1] if isinstance(body, tuple | list) and len(body) > 1 else headers.get("kwargsrepr")
        if isinstance(kwargs, dict) and kwargs.get("request_id"):
            request_id = str(kwargs["request_id"])
    if request_id:
        headers.setdefault(HEADER_REQUEST_ID, request_id)
    if trace_id_var.get():
        headers.setdefault(HEADER_TRACE_ID, trace_id_var.get())


def _on_prerun(
    task_id: str | None = None, task: Any = None, kwargs: dict[str, Any] | None = None, **_: Any
) -> None:
    request = getattr(task, "request", None)
    request_id = _header(request, HEADER_REQUEST_ID) or (kwargs or {}).get("request_id")
    trace_id = _header(request, HEADER_TRACE_ID) or task_id
    tokens = [(trace_id_var, trace_id_var.set(str(trace_id) if trace_id else None))]
    if request_id:
        tokens.append((request_id_var, request_id_var.set(str(request_id))))
    _celery_tokens[task_id or ""] = tokens


def _on_postrun(task_id: str | None = None, **_: Any) -> None:
    for var, token in reversed(_celery_tokens.pop(task_id or "", [])):
        try:
            var.reset(token)
        except ValueError:  # set in another context (thread pools); just clear it
            var.set(None)


def _header(request: Any, name: str) -> str | None:
    if request is None:
        return None
    value = getattr(request, name, None)  # Celery copies custom headers onto the request
    if value is None and isinstance(getattr(request, "headers", None), dict):
        value = request.headers.get(name)
    return str(value) if value else None


def connect_celery_signals() -> None:
    """Wire the header propagation into Celery (both processes: the API publishes, the worker runs)."""
    from celery import signals  # lazy: the CLI loads this module for `--help`, which must not load celery

    signals.before_task_publish.connect(_on_publish, weak=False, dispatch_uid="blade-jsonlog-publish")
    signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="blade-jsonlog-prerun")
    signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="blade-jsonlog-postrun")
