"""Deletion certificates over HTTP.

    GET /unlearn-requests/{id}/certificate[?format=html]   the stored, Ed25519-signed certificate (or a page)
    GET /certificate-keys                                  every public key that ever signed one (public)

See `persistence/certificates.py` for what a certificate holds and how it is signed; check one with
`blade verify-certificate FILE`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from sqlalchemy.orm import Session

from blade_service.api.deps import ReadKey, SessionDep
from blade_service.api.schemas import ErrorOut
from blade_service.api.templating import templates
from blade_service.persistence import signing
from blade_service.persistence.certificates import CANONICAL_FORM, CertificateError, CertificateNotFound
from blade_service.persistence.certificates import get_certificate as stored_certificate
from blade_service.persistence.models import AdapterVersion
from blade_service.persistence.settings import Settings, get_settings

router = APIRouter(tags=["certificates"])


class PublicKeyOut(BaseModel):
    key_id: str
    algorithm: str = Field(examples=["Ed25519"])
    public_key: str = Field(description="base64 of the raw 32-byte Ed25519 public key")
    created_at: str
    retired_at: str | None


class PublicKeysOut(BaseModel):
    keys: list[PublicKeyOut]
    signed_over: str = Field(description="what each certificate's signature covers")


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
        doc = stored_certificate(session, request_id, settings=settings, tenant_id=tenant_id)
    except CertificateNotFound as exc:
        return _error(404, "not_found", str(exc))
    except CertificateError as exc:
        return _error(409, "not_succeeded", str(exc))
    if fmt == "html":
        return templates.TemplateResponse(
            request,
            "certificate.html",
            {
                "c": doc,
                "pretty": json.dumps(doc, indent=2, ensure_ascii=False, sort_keys=True),
                "now": _adapter_now(session, doc),
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


def _adapter_now(session: Session, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The adapter's state today when it changed since issue (shown beside the certificate, not in it)."""
    issued = (doc.get("model") or {}).get("adapter") or {}
    adapter = session.get(AdapterVersion, issued.get("id") or "")
    if adapter is None or adapter.state.value == issued.get("state"):
        return None
    return {"state": adapter.state.value, "since": adapter.state_changed_at, "reason": adapter.state_reason}


@router.get(
    "/unlearn-requests/{request_id}/certificate",
    summary="Signed deletion certificate",
    responses={
        200: {"content": {"application/json": {}, "text/html": {}}},
        404: {"model": ErrorOut},
        409: {"model": ErrorOut},
    },
)
def get_certificate(
    request: Request,
    request_id: str,
    session: SessionDep,
    key: ReadKey,
    format: Literal["json", "html"] = "json",
) -> Response:
    """The deletion certificate issued when the request succeeded (JSON, or `?format=html` printable)."""
    settings = getattr(request.app.state, "settings", None) or get_settings()
    return certificate_response(
        request, session, request_id=request_id, tenant_id=key.tenant_id, settings=settings, fmt=format
    )


@router.get("/certificate-keys", response_model=PublicKeysOut, summary="Certificate public keys")
def certificate_keys(session: SessionDep) -> Any:
    """Every Ed25519 public key that has signed a certificate, by key id (public: verifying needs no key)."""
    return {"keys": signing.published_keys(session), "signed_over": CANONICAL_FORM}
