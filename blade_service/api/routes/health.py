"""`GET /healthz` (the process answers), `GET /readyz` (the database and the broker answer), and `GET /`,
which sends a browser that opened the URL `blade up` prints to the dashboard."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse
from kombu import Connection
from sqlalchemy import text

from blade_service.api.schemas import HealthOut

router = APIRouter(tags=["health"])
log = logging.getLogger("blade.api")
CHECK_TIMEOUT_S = 3.0
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="readyz")


@router.get("/", include_in_schema=False)
def root() -> RedirectResponse:
    return RedirectResponse("/dashboard", status_code=307)


@router.get("/healthz", response_model=HealthOut)
def healthz() -> HealthOut:
    return HealthOut(status="ok")


def _database(request: Request) -> None:
    with request.app.state.session_factory() as session:
        session.execute(text("SELECT 1"))


def _broker(request: Request) -> None:
    settings = request.app.state.settings
    with Connection(settings.resolved_broker_url(), connect_timeout=CHECK_TIMEOUT_S) as conn:
        conn.ensure_connection(max_retries=1, timeout=CHECK_TIMEOUT_S)


@router.get("/readyz", response_model=HealthOut, responses={503: {"model": HealthOut}})
def readyz(request: Request) -> JSONResponse:
    """Ready when the database and the task broker both answer within a few seconds."""
    checks: dict[str, str] = {}
    for name, check in (("database", _database), ("broker", _broker)):
        try:
            _pool.submit(check, request).result(timeout=CHECK_TIMEOUT_S + 1)
            checks[name] = "ok"
        except FutureTimeout:
            checks[name] = "timeout"
        except Exception as exc:
            checks[name] = f"error: {type(exc).__name__}: {exc}"[:300]
    ok = all(v == "ok" for v in checks.values())
    body = HealthOut(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)
