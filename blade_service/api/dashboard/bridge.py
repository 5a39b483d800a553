"""The JSON calls the dashboard's scripts make, under `/dashboard/api`, authorised by the session cookie.

The pages never hold the API key, so their scripts cannot call the JSON API with a Bearer header; instead each
call goes here with the session cookie and the session's CSRF token (`X-CSRF-Token`, required on every call,
so a cross-site page can neither read nor change anything). Each route runs the JSON API's own handler with
the session's key after checking the scope that route's dependency would, so both paths answer alike.

    GET  /dashboard/api/unlearn-requests/{id}             GET  /dashboard/api/unlearn-requests/{id}/events
    POST /dashboard/api/unlearn-requests/{id}/cancel      POST /dashboard/api/adapters/{id}/disable|enable
    POST /dashboard/api/base-models/{name}/generate
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request

from blade_service.api.dashboard import session as dash_session
from blade_service.api.deps import SessionDep, SettingsDep
from blade_service.api.routes import adapters as adapter_routes
from blade_service.api.routes import base_models as base_model_routes
from blade_service.api.routes import requests as request_routes
from blade_service.api.schemas import CancelIn, DisableIn, EnableIn, GenerateIn
from blade_service.persistence.errors import Forbidden, Unauthorized
from blade_service.persistence.models import ApiKey, Scope

router = APIRouter(prefix="/dashboard/api", include_in_schema=False)


def session_api_key(request: Request, session: SessionDep) -> ApiKey:
    """The signed-in key, for a call that carries the session's CSRF token (401 / 403 otherwise)."""
    found = dash_session.session_key(session, dash_session.cookie_secret(request))
    if found is None:
        raise Unauthorized("not signed in to the dashboard (or the session expired)", code="not_signed_in")
    key, row = found
    if not dash_session.csrf_ok(row.csrf_token, request.headers.get(dash_session.CSRF_HEADER)):
        raise Forbidden(f"the {dash_session.CSRF_HEADER} header is missing or wrong", code="csrf")
    return key


SessionKey = Annotated[ApiKey, Depends(session_api_key)]


def _needs(key: ApiKey, scope: Scope) -> None:
    if not key.has_scope(scope):
        raise Forbidden(f"this API key lacks the '{scope.value}' scope", code="insufficient_scope")


@router.get("/unlearn-requests/{request_id}")
def get_request(request_id: str, session: SessionDep, key: SessionKey) -> Any:
    _needs(key, Scope.READ)
    return request_routes.get_request(request_id, session, key)


@router.get("/unlearn-requests/{request_id}/events")
def list_request_events(
    request_id: str, session: SessionDep, key: SessionKey, after_step: int | None = None
) -> Any:
    _needs(key, Scope.READ)
    return request_routes.list_request_events(
        request_id, session, key, after_step=after_step, limit=None, cursor=None
    )


@router.post("/unlearn-requests/{request_id}/cancel")
def cancel_request(
    request_id: str, session: SessionDep, key: SessionKey, body: Annotated[CancelIn | None, Body()] = None
) -> Any:
    _needs(key, Scope.SUBMIT)
    return request_routes.cancel_request(request_id, session, key, body)


@router.post("/adapters/{adapter_id}/disable")
def disable_adapter(adapter_id: str, body: DisableIn, session: SessionDep, key: SessionKey) -> Any:
    _needs(key, Scope.ADMIN)
    return adapter_routes.disable_adapter(adapter_id, body, session, key)


@router.post("/adapters/{adapter_id}/enable")
def enable_adapter(adapter_id: str, body: EnableIn, session: SessionDep, key: SessionKey) -> Any:
    _needs(key, Scope.ADMIN)
    return adapter_routes.enable_adapter(adapter_id, body, session, key)


@router.post("/base-models/{name}/generate")
def generate_text(
    name: str, body: GenerateIn, session: SessionDep, settings: SettingsDep, key: SessionKey
) -> Any:
    _needs(key, Scope.READ)
    return base_model_routes.generate_text(name, body, session, settings, key)
