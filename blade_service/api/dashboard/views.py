"""The dashboard's pages: server-rendered Jinja2, refreshed in place by a little JavaScript.

    GET  /dashboard                      overview: requests by state, queues, workers, recent failures
    GET  /dashboard/requests             requests (filter by state / base model)
    GET  /dashboard/requests/{id}        status, live progress and dynamics charts, metrics, cancel
    GET  /dashboard/requests/{id}/certificate   the printable deletion certificate
    GET  /dashboard/models               base models (the operator: ?tenant= another tenant's)
    GET  /dashboard/models/{name}        the adapter stack as a timeline, disable / enable (admin keys)
    GET  /dashboard/audit                the audit log, filterable, with the hash chain verified
    GET/POST /dashboard/login · POST /dashboard/logout (with the session's CSRF token)

Each page takes `?fragment=1` and then returns only its live part (what the page's script swaps in).
"""

from __future__ import annotations

import math
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

from fastapi import APIRouter, Depends, Form, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import Session

from blade_service.api.dashboard import queries
from blade_service.api.dashboard import session as dash_session
from blade_service.api.dashboard.session import COOKIE, COOKIE_PATH, Viewer, cookie_secret, viewer_for
from blade_service.api.deps import SessionDep, TenantQuery
from blade_service.api.observability.state import broker_queue_depths, worker_alive_after_s
from blade_service.api.routes.certificates import certificate_response
from blade_service.api.templating import templates
from blade_service.contracts.names import ALL_QUEUES
from blade_service.persistence import base_models
from blade_service.persistence.errors import Forbidden, Invalid
from blade_service.persistence.settings import Settings, get_settings

router = APIRouter(prefix="/dashboard", include_in_schema=False)


# --- dependencies -------------------------------------------------------------------------------------------


def _settings(request: Request) -> Settings:
    return getattr(request.app.state, "settings", None) or get_settings()


class SignInRequired(Exception):
    def __init__(self, next_url: str):
        self.next_url = next_url


def current_viewer(request: Request, session: SessionDep) -> Viewer:
    viewer = viewer_for(session, cookie_secret(request))
    if viewer is None:
        raise SignInRequired(str(request.url.path) + (f"?{request.url.query}" if request.url.query else ""))
    return viewer


ViewerDep = Annotated[Viewer, Depends(current_viewer)]


def sign_in_redirect(request: Request, exc: SignInRequired) -> Response:
    if request.query_params.get("fragment"):
        return Response(status_code=401)
    return RedirectResponse(f"/dashboard/login?next={quote(exc.next_url)}", status_code=303)


# Pages with a live part.
FRAGMENTS = frozenset({"overview.html", "requests.html", "model.html", "request.html"})


def render(request: Request, name: str, viewer: Viewer | None, **context: Any) -> HTMLResponse:
    """A full page, or with ?fragment=1 only its live part (`_<name>` without the page chrome)."""
    fragment = bool(request.query_params.get("fragment")) and name in FRAGMENTS
    template = f"_{name}" if fragment else name
    return templates.TemplateResponse(
        request, template, {"viewer": viewer, **context}, headers={"Cache-Control": "no-store"}
    )


def not_found(request: Request, viewer: Viewer, what: str) -> HTMLResponse:
    return templates.TemplateResponse(
        request, "not_found.html", {"viewer": viewer, "what": what}, status_code=404
    )


# --- sign-in ------------------------------------------------------------------------------------------------


def _cross_site(request: Request) -> bool:
    """A browser form posted from another site (its Origin names another host): a login CSRF attempt."""
    origin = request.headers.get("origin")
    return bool(origin) and urlsplit(origin).netloc != request.headers.get("host", "")


def _safe_next(next_url: str | None) -> str:
    return (
        next_url if next_url and next_url.startswith("/dashboard") and "//" not in next_url else "/dashboard"
    )


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str | None = None) -> HTMLResponse:
    return templates.TemplateResponse(
        request, "login.html", {"viewer": None, "next": _safe_next(next), "error": None}
    )


@router.post("/login")
def login(
    request: Request,
    session: SessionDep,
    api_key: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/dashboard",
) -> Response:
    if _cross_site(request):
        return Response("sign-in from another site is refused", status_code=403)
    signed = dash_session.sign_in(session, api_key.strip(), hours=_settings(request).dashboard_session_hours)
    if signed is None:
        return templates.TemplateResponse(
            request,
            "login.html",
            {
                "viewer": None,
                "next": _safe_next(next),
                "error": "That key is not valid (unknown or revoked).",
            },
            status_code=401,
        )
    _, secret, max_age = signed
    response = RedirectResponse(_safe_next(next), status_code=303)
    response.set_cookie(
        COOKIE,
        secret,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        max_age=max_age,
    )
    return response


@router.post("/logout")
def logout(request: Request, session: SessionDep, csrf_token: Annotated[str, Form()] = "") -> Response:
    """Ends the session (the form carries its CSRF token, so no other site can sign a user out)."""
    viewer = viewer_for(session, cookie_secret(request))
    if viewer is not None and not dash_session.csrf_ok(viewer.csrf_token, csrf_token):
        return Response("the sign-out form's CSRF token is missing or wrong", status_code=403)
    dash_session.sign_out(session, cookie_secret(request))
    response = RedirectResponse("/dashboard/login", status_code=303)
    response.delete_cookie(COOKIE, path=COOKIE_PATH)
    return response


# --- pages --------------------------------------------------------------------------------------------------


@router.get("", response_class=HTMLResponse)
def overview(request: Request, session: SessionDep, viewer: ViewerDep) -> HTMLResponse:
    settings = _settings(request)
    data = queries.overview(
        session,
        tenant_id=viewer.tenant_id,
        alive_after_s=worker_alive_after_s(settings),
        broker_depths=broker_queue_depths(settings, ALL_QUEUES, timeout=1.5),
        totals=request.app.state.metrics_state.totals,  # finished counts without a scan of history
        operator=viewer.operator,
    )
    return render(request, "overview.html", viewer, page="overview", data=data)


@router.get("/requests", response_class=HTMLResponse)
def requests_page(
    request: Request,
    session: SessionDep,
    viewer: ViewerDep,
    state: str | None = None,
    base_model: str | None = None,
) -> HTMLResponse:
    unknown = state if state and state not in queries.STATE_ORDER else None  # said, not silently dropped
    state = None if unknown else state or None
    rows = queries.list_requests(
        session, tenant_id=viewer.tenant_id, status=state, base_model=base_model or None
    )
    models = [m["name"] for m in queries.visible_base_models(session, tenant_id=viewer.tenant_id)]
    return render(
        request,
        "requests.html",
        viewer,
        page="requests",
        rows=rows,
        state=state,
        unknown_state=unknown,
        base_model=base_model or "",
        states=queries.STATE_ORDER,
        models=models,
    )


@router.get("/requests/{request_id}", response_class=HTMLResponse)
def request_page(request: Request, request_id: str, session: SessionDep, viewer: ViewerDep) -> HTMLResponse:
    detail = queries.request_detail(session, tenant_id=viewer.tenant_id, request_id=request_id)
    if detail is None:
        return not_found(request, viewer, f"request {request_id}")
    initial = _nan_to_none(
        {
            "id": detail["id"],
            "status": detail["status"],
            "step": detail["step"],
            "total_steps": detail["total_steps"],
            "terminal": detail["terminal"],
            "events": detail["events"],
        }
    )
    return render(request, "request.html", viewer, page="requests", r=detail, initial=initial)


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@router.get("/requests/{request_id}/certificate", response_class=HTMLResponse)
def certificate_page(request: Request, request_id: str, session: SessionDep, viewer: ViewerDep) -> Response:
    return certificate_response(
        request,
        session,
        request_id=request_id,
        tenant_id=viewer.tenant_id,
        settings=_settings(request),
        fmt=request.query_params.get("format", "html"),
    )


@router.get("/models", response_class=HTMLResponse)
def models_page(
    request: Request, session: SessionDep, viewer: ViewerDep, tenant: TenantQuery = None
) -> HTMLResponse:
    tenant_id = _tenant_of(session, viewer, tenant)
    if tenant_id is None:
        return not_found(request, viewer, f"tenant {tenant}")
    models = queries.visible_base_models(session, tenant_id=tenant_id)
    shown = tenant if tenant_id != viewer.tenant_id else None
    return render(request, "models.html", viewer, page="models", models=models, tenant=shown)


@router.get("/models/{name}", response_class=HTMLResponse)
def model_page(
    request: Request, name: str, session: SessionDep, viewer: ViewerDep, tenant: TenantQuery = None
) -> HTMLResponse:
    tenant_id = _tenant_of(session, viewer, tenant)
    detail = None if tenant_id is None else queries.model_detail(session, tenant_id=tenant_id, name=name)
    if detail is None:
        return not_found(request, viewer, f"base model {name}")
    shown = tenant if tenant_id != viewer.tenant_id else None
    if shown:  # the request pages are the tenant's own: ids without links
        for adapter in detail["adapters"]:
            adapter["request_visible"] = False
    return render(request, "model.html", viewer, page="models", m=detail, tenant=shown)


def _tenant_of(session: Session, viewer: Viewer, tenant: str | None) -> str | None:
    """The id of the tenant whose models the page shows: the viewer's, or the one the operator names (None
    for a tenant that does not exist or is not the viewer's to name: the page is a 404 either way)."""
    try:
        return base_models.tenant_for_caller(
            session,
            key_tenant_id=viewer.tenant_id,
            key_tenant=viewer.tenant_name,
            operator=viewer.operator,
            tenant=tenant,
        )
    except (Forbidden, Invalid):
        return None


@router.get("/audit", response_class=HTMLResponse)
def audit_page(
    request: Request,
    session: SessionDep,
    viewer: ViewerDep,
    action: str | None = None,
    subject: str | None = None,
    actor: str | None = None,
    before: Annotated[int | None, Query()] = None,
) -> HTMLResponse:
    data = queries.audit_page(
        session,
        tenant_id=None if viewer.operator else viewer.tenant_id,
        action=action or None,
        subject=(subject or "").strip() or None,
        actor=(actor or "").strip() or None,
        before_id=before,
    )
    return render(
        request,
        "audit.html",
        viewer,
        page="audit",
        data=data,
        filters={"action": action or "", "subject": subject or "", "actor": actor or ""},
    )
