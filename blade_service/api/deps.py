"""Dependency aliases for route handlers: `SessionDep`, `ReadSessionDep`, `SettingsDep`, `CurrentKey`, and
scoped keys.

def handler(session: SessionDep, key: ReadKey) -> ...     # 401 without a valid key, 403 without `read`
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from blade_service.persistence import auth, base_models
from blade_service.persistence.errors import Forbidden, Unauthorized
from blade_service.persistence.models import ApiKey, BaseModel, Scope
from blade_service.persistence.settings import Settings
from blade_service.persistence.storage import Storage


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def _closing(session: Session) -> None:
    """Close a request's session: inline when it holds no connection (pure Python), else in the threadpool
    (returning a connection may roll back), so the event loop never waits on the database."""
    if session.in_transaction():
        await run_in_threadpool(session.close)
    else:
        session.close()


async def get_session(request: Request) -> AsyncIterator[Session]:
    """One session per HTTP request; handlers commit what they change, the rest is rolled back. Created on
    the event loop (no I/O until first used), used by the sync handler in the threadpool."""
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        await _closing(session)


async def get_read_session(request: Request) -> AsyncIterator[Session]:
    """A session for a route that only reads (autocommit on PostgreSQL: a lone SELECT is one round trip)."""
    session = request.app.state.read_session_factory()
    try:
        yield session
    finally:
        if session.get_bind().dialect.name == "postgresql":
            session.close()  # autocommit: nothing to roll back, so returning the connection sends nothing
        else:
            await _closing(session)


def get_storage_dep(request: Request) -> Storage:
    storage: Storage = request.app.state.storage
    return storage


SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
StorageDep = Annotated[Storage, Depends(get_storage_dep)]


# Declares the bearer scheme in the OpenAPI document (every route that takes a key lists it); the header
# itself is read below, so a missing one gets this API's own 401 body.
bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearerAuth",
    description="an API key (`POST /api-keys`, or the admin key `blade up` prints)",
)
BearerDoc = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]


async def current_key(request: Request, _: BearerDoc = None) -> ApiKey:
    """The API key of `Authorization: Bearer <key>`; 401 when missing, unknown or revoked.

    Served from the app's key cache when it can be (no thread hop, no query: persistence/auth.py bounds how
    long a revocation elsewhere takes to land); a miss looks it up in its own short session in the threadpool.
    The key is detached either way: its columns and its tenant are loaded."""
    header = request.headers.get("authorization", "")
    scheme, _sep, secret = header.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise Unauthorized("send an API key as 'Authorization: Bearer <key>'", code="missing_api_key")
    cache: auth.KeyCache = request.app.state.key_cache
    key = cache.get(auth.hash_key(secret))
    if key is None:
        key = await run_in_threadpool(_look_up_key, request.app.state.session_factory, secret, cache)
    if key is None:
        raise Unauthorized("invalid or revoked API key", code="invalid_api_key")
    return key


def _look_up_key(session_factory: Any, secret: str, cache: auth.KeyCache) -> ApiKey | None:
    with session_factory() as session:
        key = auth.authenticate_cached(session, secret, cache)
        if session.dirty:
            session.commit()  # last_used_at
        return key


CurrentKey = Annotated[ApiKey, Depends(current_key)]


def require_scope(scope: Scope) -> Callable[[ApiKey], Awaitable[ApiKey]]:
    """A dependency that returns the caller's key if it has `scope` (admin has all); else 403."""

    async def check(key: CurrentKey) -> ApiKey:
        if not key.has_scope(scope):
            raise Forbidden(f"this API key lacks the '{scope.value}' scope", code="insufficient_scope")
        return key

    return check


ReadKey = Annotated[ApiKey, Depends(require_scope(Scope.READ))]
SubmitKey = Annotated[ApiKey, Depends(require_scope(Scope.SUBMIT))]
AdminKey = Annotated[ApiKey, Depends(require_scope(Scope.ADMIN))]
# `/base-models/{name}/...`: names are per tenant, so the operator names the tenant whose model it means.
TenantQuery = Annotated[
    str | None,
    Query(max_length=100, description="the operator: the tenant whose model `name` is (default: yours)"),
]


def tenant_id_for(session: Session, key: ApiKey, tenant: str | None) -> str:
    """The tenant whose models a route lists or acts on: the key's, or the one the operator names."""
    return base_models.tenant_for_caller(
        session,
        key_tenant_id=key.tenant_id,
        key_tenant=key.tenant.name,
        operator=auth.is_operator(key),
        tenant=tenant,
    )


def base_model_for(session: Session, key: ApiKey, name: str, tenant: str | None) -> BaseModel:
    """The base model a `/base-models/{name}` route acts on (`base_models.get_for_caller`)."""
    tenant_id = tenant_id_for(session, key, tenant)
    hint = auth.is_operator(key) and tenant_id == key.tenant_id
    return base_models.get_for_caller(session, name=name, tenant_id=tenant_id, hint_tenant=hint)
