"""The HTTP API: `create_app(settings)` builds the FastAPI app (no torch anywhere in this process).

Start-up runs the database migrations (`alembic upgrade head`) and creates `BLADE_BOOTSTRAP_ADMIN_KEY` as an
admin key on first start. Every error leaves as `{"error": {"code", "message"}}` (plus `field` where one field
is at fault) with its 4xx/5xx status. OpenAPI docs at `/docs`.

    uvicorn --factory blade_service.api.main:server_app   # what `blade api` runs (BLADE_* variables)
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blade_service.api.dashboard import install_dashboard
from blade_service.api.error_responses import install_error_responses
from blade_service.api.input_guard import check_declared_params, check_json_body, parsed_as_json
from blade_service.api.observability import install_observability
from blade_service.api.openapi_docs import install_docs, operation_id
from blade_service.api.params_docs import install_params_schemas
from blade_service.api.routes import (
    adapters,
    audit,
    base_models,
    certificates,
    datasets,
    health,
    keys,
    requests,
    retention,
    stacks,
    webhooks,
)
from blade_service.api.worker_waits import RETRY_AFTER_S
from blade_service.persistence import auth, key_revocations
from blade_service.persistence.db import read_session_factory, session_factory, upgrade_to_head
from blade_service.persistence.errors import ServiceError
from blade_service.persistence.settings import Settings, get_settings
from blade_service.persistence.storage import InvalidKey, ObjectNotFound, StorageError, get_storage

log = logging.getLogger("blade.api")

MULTIPART_SLACK = 1024 * 1024  # multipart framing on top of the file itself
MAX_JSON_BODY_BYTES = 1024 * 1024  # a JSON body; the largest we take is a request's 16 KB of metadata
MAX_DETAILS = 20  # a 422's `details`, the first of the faults (`more_details` counts the rest)
HTTP_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid",
    429: "too_many_requests",
}


class ErrorJSON(JSONResponse):
    """JSON written in ASCII: an error may quote the input it refuses, and a lone surrogate there (a JSON
    `\\ud800` escape) has no UTF-8 encoding, so it goes out escaped as it came in."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(
    status: int, code: str, message: str, field: str | None = None, **extra: Any
) -> JSONResponse:
    error: dict[str, Any] = {"code": code, "message": message}
    if field:
        error["field"] = field
    error.update(extra)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 429:
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    return ErrorJSON({"error": error}, status_code=status, headers=headers)


# What pydantic appends to an error's location for the member of a union it tried ("cascade.bool"): type
# names, never a field of ours.
_UNION_MEMBER_TAGS = frozenset({"bool", "str", "int", "float", "none", "list", "dict", "bytes", "tuple"})


def _field_of(loc: tuple[Any, ...]) -> str:
    """('body', 'params', 'tau') -> 'params.tau'; ('query', 'limit') -> 'limit'; ('body',) -> 'body';
    ('body', 'cascade', "literal['retrain']") -> 'cascade' (a union member's tag is not a field)."""
    parts = (
        [str(p) for p in loc[1:]] if len(loc) > 1 and loc[0] in ("body", "query", "path", "header") else []
    )
    while len(parts) > 1 and (parts[-1] in _UNION_MEMBER_TAGS or "[" in parts[-1]):
        parts.pop()
    return ".".join(parts) or str(loc[0] if loc else "body")


def _message_of(err: dict[str, Any]) -> str:
    """pydantic's message, in words for strings (its constraints on an annotated str say "items")."""
    kind, ctx = err.get("type"), err.get("ctx") or {}
    if kind == "json_invalid":
        return "invalid JSON" + (f" ({ctx['error']})" if ctx.get("error") else "")
    if kind in ("too_short", "too_long") and isinstance(err.get("input"), str):
        short = kind == "too_short"
        which, n = ("at least", ctx.get("min_length")) if short else ("at most", ctx.get("max_length"))
        unit = "character" if n == 1 else "characters"
        return f"must be {which} {n} {unit} long, not {ctx.get('actual_length')}"
    return str(err.get("msg", "invalid"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    def service_error(_: Request, exc: ServiceError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.field)

    @app.exception_handler(RequestValidationError)
    def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        details: list[dict[str, str]] = []
        for err in errors[:MAX_DETAILS]:
            loc = tuple(err.get("loc", ()))
            field = "body" if err.get("type") == "json_invalid" else _field_of(loc)  # loc: (body, offset)
            message = _message_of(err)
            if details and details[-1]["field"] == field:  # the members of one union: one line
                details[-1]["message"] += f"; or {message}"
                continue
            details.append({"field": field, "message": f"{field}: {message}"})
        first = details[0] if details else {"field": "body", "message": "body: invalid request"}
        more = {"more_details": len(errors) - MAX_DETAILS} if len(errors) > MAX_DETAILS else {}
        return error_response(
            422, "validation_error", first["message"], first["field"], details=details, **more
        )

    @app.exception_handler(StarletteHTTPException)
    def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_response(
            exc.status_code, HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}"), message
        )

    @app.exception_handler(InvalidKey)
    def invalid_key(_: Request, exc: InvalidKey) -> JSONResponse:
        return error_response(400, "invalid_storage_key", str(exc))

    @app.exception_handler(ObjectNotFound)
    def missing_object(_: Request, exc: ObjectNotFound) -> JSONResponse:
        return error_response(404, "artifact_missing", str(exc))

    @app.exception_handler(StorageError)
    def storage_error(_: Request, exc: StorageError) -> JSONResponse:
        log.error("storage.error", exc_info=exc)
        return error_response(503, "storage_unavailable", f"artifact storage failed: {exc}")

    @app.exception_handler(IntegrityError)
    def integrity_error(_: Request, exc: IntegrityError) -> JSONResponse:
        log.warning("db.integrity_error", exc_info=exc)
        return error_response(409, "conflict", "the change conflicts with the current state; retry")

    @app.exception_handler(DataError)
    def unstorable_value(_: Request, exc: DataError) -> JSONResponse:
        # A backstop: api/input_guard.py names the field for every known case before the database sees it.
        log.warning("db.data_error", exc_info=exc)
        return error_response(
            422,
            "unstorable_value",
            "a value in the request cannot be stored (out of range or an invalid character)",
        )

    @app.exception_handler(OperationalError)
    def database_down(_: Request, exc: OperationalError) -> JSONResponse:
        log.error("db.operational_error", exc_info=exc)
        return error_response(503, "database_unavailable", "the database is unavailable; retry")

    @app.exception_handler(Exception)
    def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled", exc_info=exc)
        return error_response(500, "internal", "internal server error")


class _TooLarge(StarletteHTTPException):
    """Raised from `receive` mid-stream; an HTTPException so FastAPI's body parsing passes it on as a 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than {limit} bytes")


class BodySizeLimit:
    """Refuse request bodies over `limit` bytes with 413 before reading them whole; bodies read as JSON
    (`input_guard.parsed_as_json`) over `json_limit`: uploads are multipart, and a JSON body of millions of
    keys would hold the event loop while FastAPI parses it and answer with one error per key."""

    def __init__(self, app: ASGIApp, limit: int, json_limit: int):
        self.app, self.upload_limit, self.json_limit = app, limit, json_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        json_body = parsed_as_json(headers.get(b"content-type", b"").decode("latin-1"))
        limit = self.json_limit if json_body else self.upload_limit
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, limit)
        seen, started = 0, False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send, limit)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = error_response(413, "too_large", f"request body larger than {limit} bytes")
        await response(scope, receive, send)


def server_app() -> FastAPI:
    """`blade api`'s uvicorn factory: `create_app` from the environment, with what start-up built frozen out
    of the garbage collector (one server process per app, unlike tests, which build many)."""
    return create_app(freeze_gc=True)


def create_app(settings: Settings | None = None, *, migrate: bool = True, freeze_gc: bool = False) -> FastAPI:
    """The API app for `settings` (default: from the environment); migrates the database first. `freeze_gc`:
    once started, move every object alive to the collector's permanent generation (`gc.freeze`)."""
    settings = settings or get_settings()
    if migrate:
        upgrade_to_head(settings.resolved_database_url())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # other API processes' key revocations, by LISTEN/NOTIFY (PostgreSQL; persistence/key_revocations.py)
        listener = key_revocations.listener_for(settings, app.state.key_cache)
        if listener is not None:
            listener.listening.wait(timeout=10)  # the cache stays off until then; serve at once regardless
        if freeze_gc:
            # What start-up built (imports, the app, the mappers: ~180k objects) lives as long as the process:
            # keep it out of later collections, whose full passes would otherwise walk all of it (tens of ms
            # each: the status GET's p99 under load, docs/performance.md).
            gc.collect()
            gc.freeze()
        try:
            yield
        finally:
            if listener is not None:
                listener.stop()

    app = FastAPI(
        lifespan=lifespan,
        title="BLADE unlearning service",
        version="0.1.0",
        description="Deletion requests in, BLADE adapters out: an adapter registry per base model with "
        "rollback. Authenticate with `Authorization: Bearer <API key>`. Lists are cursor pages: "
        "`{items, has_more, next_cursor}`; pass `next_cursor` back as `cursor`.",
        # unstorable or out-of-range parameters and body strings -> 422 naming the field
        dependencies=[Depends(check_declared_params), Depends(check_json_body)],
        docs_url=None,  # /docs and /redoc come from install_docs, with local assets
        redoc_url=None,
        generate_unique_id_function=operation_id,
    )
    app.state.settings = settings
    app.state.session_factory = session_factory(settings)
    app.state.read_session_factory = read_session_factory(settings)  # autocommit reads (persistence/db.py)
    app.state.key_cache = auth.KeyCache()  # API keys for KEY_CACHE_TTL_S; a revocation drops them at once
    app.state.storage = get_storage(settings)
    auth.bootstrap_admin_key(app.state.session_factory, settings)

    install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit, limit=settings.max_upload_bytes + MULTIPART_SLACK, json_limit=MAX_JSON_BODY_BYTES
    )
    for router in (
        health.router,
        keys.router,
        datasets.router,
        base_models.router,
        requests.router,
        adapters.router,
        stacks.router,
        retention.router,
        webhooks.router,
        audit.router,
        certificates.router,
    ):
        app.include_router(router)
    install_observability(app, settings, app.state.session_factory)  # GET /metrics, HTTP metrics, trace ids
    install_dashboard(app)  # GET /dashboard and its JSON bridge; security headers on pages and certificates
    install_docs(app)  # GET /docs, /redoc (no CDN); bearer security scheme in /openapi.json
    install_error_responses(app)  # every error status each operation returns, declared with ErrorOut
    install_params_schemas(app)  # one `params` schema per method, from contracts.methods
    return app
