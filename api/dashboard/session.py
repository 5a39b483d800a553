"""Dashboard sign-in: the API key lives in a cookie the pages' JavaScript also reads.

The server renders pages for the key in the `blade_key` cookie (SameSite=Strict, path /dashboard); the
JavaScript reads the same cookie and calls the JSON API with `Authorization: Bearer <key>`, so every action
has exactly that key's scopes (a read-only key gets no buttons, and the API refuses it anyway). The JSON API
itself never reads cookies, so the cookie cannot be used for cross-site requests against it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fastapi import Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from persistence.models import ApiKey, Scope, utcnow

COOKIE = "blade_key"
COOKIE_PATH = "/dashboard"


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the key's id, name, tenant and scopes (never the secret)."""

    key_id: str
    key_name: str
    key_prefix: str
    tenant_id: str
    tenant_name: str
    scopes: tuple[str, ...]

    @property
    def is_admin(self) -> bool:
        return Scope.ADMIN.value in self.scopes

    @property
    def can_submit(self) -> bool:
        return self.is_admin or Scope.SUBMIT.value in self.scopes


def lookup_key(session: Session, raw_key: str) -> ApiKey | None:
    """The live key for a secret (stored as sha256), or None."""
    if not raw_key:
        return None
    try:  # the API's own lookup, when present, is the one truth about keys
        from persistence import auth

        finder = getattr(auth, "authenticate_key", None) or getattr(auth, "find_key", None)
    except ImportError:
        finder = None
    if finder is not None:
        try:
            return finder(session, raw_key)
        except Exception:
            return None
    digest = hashlib.sha256(raw_key.encode()).hexdigest()
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == digest))
    if key is None or key.revoked_at is not None:
        return None
    return key


def viewer_for(session: Session, raw_key: str) -> Viewer | None:
    key = lookup_key(session, raw_key)
    if key is None:
        return None
    key.last_used_at = utcnow()
    return Viewer(key_id=key.id, key_name=key.name, key_prefix=key.prefix, tenant_id=key.tenant_id,
                  tenant_name=key.tenant.name, scopes=tuple(sorted(str(s) for s in key.scopes)))


def cookie_key(request: Request) -> str:
    return request.cookies.get(COOKIE, "")
