"""`GET /unlearn-requests/{id}/certificate`: the signed deletion certificate, as JSON or (`?format=html`) a
printable page. See `persistence/certificates.py` for what it holds and how it is signed; check one with
`blade verify-certificate FILE`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.orm import Session

from api.deps import ReadKey, SessionDep
from persistence.certificates import CertificateError, CertificateNotFound, build_certificate
from persistence.settings import Settings, get_settings

router = APIRouter(tags=["certificates"])


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def certificate_response(
    request: Request,
    session: Session,
    *,
    request_id: str,
    tenant_id: str | None,
    settings: Settings,
    fmt: str = "json",
) -> Response:
    """The certificate in the asked format, or the API's error shape (404 unknown, 409 not succeeded)."""
    try:
        doc = build_certificate(session, request_id, settings=settings, tenant_id=tenant_id)
    except CertificateNotFound as exc:
        return _error(404, "not_found", str(exc))
    except CertificateError as exc:
        return _error(409, "not_succeeded", str(exc))
    if fmt == "html":
        from api.dashboard.views import templates  # the dashboard's templates and filters

        return templates.TemplateResponse(
            request,
            "certificate.html",
            {
                "c": doc,
                "pretty": json.dumps(doc, indent=2, ensure_ascii=False, sort_keys=True),
                "metric_rows": _metric_rows(doc),
            },
            headers={"Cache-Control": "no-store"},
        )
    return JSONResponse(
        doc,
        headers={
            "Content-Disposition": f'inline; filename="certificate-{request_id}.json"',
            "Cache-Control": "no-store",
        },
    )


def _metric_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    from api.dashboard.queries import metric_rows

    evaluation = doc.get("evaluation") or {}
    return metric_rows(evaluation.get("before"), evaluation.get("after"))


@router.get("/unlearn-requests/{request_id}/certificate", summary="Signed deletion certificate")
def get_certificate(
    request: Request,
    request_id: str,
    session: SessionDep,
    key: ReadKey,
    format: Literal["json", "html"] = "json",
) -> Response:
    """The deletion certificate (JSON, or `?format=html` printable); 409 until the request succeeded."""
    settings = getattr(request.app.state, "settings", None) or get_settings()
    return certificate_response(
        request, session, request_id=request_id, tenant_id=key.tenant_id, settings=settings, fmt=format
    )
