"""Dashboard sign-in: the API key lives in a cookie the pages' JavaScript also reads.

The server renders pages for the key in the `blade_key` cookie (SameSite=Strict, path /dashboard); the
JavaScript reads the same cookie and calls the JSON API with `Authorization: Bearer <key>`, so every action
has exactly that key's scopes (a read-only key gets no buttons, and the API refuses it anyway). The JSON API
itself never reads cookies, so the cookie cannot be used for cross-site requests against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from sqlalchemy.orm import Session

from persistence import auth
from persistence.models import Scope

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
    operator: bool = False  # an admin key of the default tenant: sees every tenant's audit entries

    @property
    def is_admin(self) -> bool:
        return Scope.ADMIN.value in self.scopes

    @property
    def can_submit(self) -> bool:
        return self.is_admin or Scope.SUBMIT.value in self.scopes


def viewer_for(session: Session, raw_key: str) -> Viewer | None:
    """Who holds this secret (the API's own key lookup), or None for an unknown or revoked key."""
    key = auth.authenticate(session, raw_key)
    if key is None:
        return None
    if session.dirty:
        session.commit()  # last_used_at
    return Viewer(
        key_id=key.id,
        key_name=key.name,
        key_prefix=key.prefix,
        tenant_id=key.tenant_id,
        tenant_name=key.tenant.name,
        scopes=tuple(str(s) for s in key.scopes),
        operator=auth.is_operator(key),
    )


def cookie_key(request: Request) -> str:
    return request.cookies.get(COOKIE, "")
