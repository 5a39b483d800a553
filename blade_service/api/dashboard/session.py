"""Dashboard sign-in: the API key is typed once; the browser then holds only a server-side session.

`POST /dashboard/login` checks the key and creates a `DashboardSession` row; the cookie `blade_session`
carries a random secret (the row keeps only its sha256), HttpOnly (page scripts never see it, nor the key),
Secure when the dashboard is served over HTTPS, SameSite=Strict, path /dashboard, with an expiry
(`Settings.dashboard_session_hours`). Every page checks the session and that its key is still live, so a key
revocation or a sign-out ends it at once. State-changing dashboard calls (`api/dashboard/bridge.py`, sign-out)
must carry the session's CSRF token (rendered into each page's `<meta name="csrf-token">`) in the
`X-CSRF-Token` header or a `csrf_token` form field.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta

from fastapi import Request
from sqlalchemy import delete
from sqlalchemy.orm import Session

from blade_service.persistence import auth
from blade_service.persistence.models import ApiKey, DashboardSession, Scope, utcnow

COOKIE = "blade_session"
COOKIE_PATH = "/dashboard"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the key's id, name, tenant and scopes (never the secret); the session's CSRF token."""

    key_id: str
    key_name: str
    key_prefix: str
    tenant_id: str
    tenant_name: str
    scopes: tuple[str, ...]
    operator: bool = False  # an admin key of the default tenant: sees every tenant's audit entries
    csrf_token: str = ""

    @property
    def is_admin(self) -> bool:
        return Scope.ADMIN.value in self.scopes

    @property
    def can_submit(self) -> bool:
        return self.is_admin or Scope.SUBMIT.value in self.scopes


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _viewer(key: ApiKey, csrf_token: str) -> Viewer:
    return Viewer(
        key_id=key.id,
        key_name=key.name,
        key_prefix=key.prefix,
        tenant_id=key.tenant_id,
        tenant_name=key.tenant.name,
        scopes=tuple(str(s) for s in key.scopes),
        operator=auth.is_operator(key),
        csrf_token=csrf_token,
    )


def sign_in(session: Session, raw_key: str, *, hours: float) -> tuple[Viewer, str, int] | None:
    """A new session for a live key: (viewer, the cookie's secret, max-age in seconds); None for a bad key."""
    key = auth.authenticate(session, raw_key)
    if key is None:
        return None
    now = utcnow()
    session.execute(delete(DashboardSession).where(DashboardSession.expires_at < now))
    secret, csrf = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    max_age = int(hours * 3600)
    session.add(
        DashboardSession(
            id=_digest(secret), key_id=key.id, csrf_token=csrf, expires_at=now + timedelta(seconds=max_age)
        )
    )
    session.commit()
    return _viewer(key, csrf), secret, max_age


def session_key(session: Session, secret: str) -> tuple[ApiKey, DashboardSession] | None:
    """The live key and session behind a cookie's secret; None when unknown, expired or the key is revoked."""
    if not secret:
        return None
    row = session.get(DashboardSession, _digest(secret))
    if row is None:
        return None
    if row.expires_at <= utcnow():
        session.delete(row)
        session.commit()
        return None
    key = session.get(ApiKey, row.key_id, populate_existing=True)
    if key is None or key.revoked_at is not None:
        return None
    return key, row


def viewer_for(session: Session, secret: str) -> Viewer | None:
    found = session_key(session, secret)
    return _viewer(found[0], found[1].csrf_token) if found else None


def sign_out(session: Session, secret: str) -> None:
    if secret:
        session.execute(delete(DashboardSession).where(DashboardSession.id == _digest(secret)))
        session.commit()


def csrf_ok(expected: str, given: str | None) -> bool:
    """Bytes compared (compare_digest refuses str with non-ASCII characters, which a forged token has)."""
    if not expected or not given:
        return False
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogateescape"))


def cookie_secret(request: Request) -> str:
    return request.cookies.get(COOKIE, "")
