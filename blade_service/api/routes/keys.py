"""API keys of your tenant (admin): create (the secret is shown once), list, revoke; and `GET /me`."""

from __future__ import annotations

from fastapi import APIRouter

from blade_service.api.deps import AdminKey, CurrentKey, SessionDep
from blade_service.api.pagination import Cursor, Limit, Offset, Page, page_after
from blade_service.api.schemas import ApiKeyCreated, ApiKeyIn, ApiKeyOut
from blade_service.persistence import auth
from blade_service.persistence.errors import Forbidden

router = APIRouter(tags=["api keys"])


@router.get("/me", response_model=ApiKeyOut)
def get_me(key: CurrentKey) -> ApiKeyOut:
    """The calling key: its tenant and scopes."""
    return ApiKeyOut.of(key)


@router.post("/api-keys", status_code=201, response_model=ApiKeyCreated)
def create_api_key(body: ApiKeyIn, session: SessionDep, key: AdminKey) -> ApiKeyCreated:
    """A new key for your tenant, or (default tenant's admins only) for another tenant, created if new."""
    tenant = key.tenant
    if body.tenant and body.tenant != tenant.name:
        if tenant.name != auth.DEFAULT_TENANT:
            raise Forbidden(
                "only admins of the default tenant create keys for other tenants",
                code="cross_tenant",
                field="tenant",
            )
        tenant = auth.get_or_create_tenant(session, name=body.tenant)
    new_key, secret = auth.create_key(
        session,
        tenant=tenant,
        name=body.name,
        scopes=body.scopes,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    return ApiKeyCreated(**ApiKeyOut.of(new_key).model_dump(), key=secret)


@router.get("/api-keys", response_model=Page[ApiKeyOut])
def list_api_keys(
    session: SessionDep, key: AdminKey, limit: Limit = 100, cursor: Cursor = None, offset: Offset = 0
) -> Page[ApiKeyOut]:
    """Oldest first, a cursor page."""
    found = [ApiKeyOut.of(k) for k in auth.list_keys(session, tenant_id=key.tenant_id)]
    return page_after(
        found, cursor=cursor, kinds="iso,str", limit=limit, offset=offset, key=lambda k: [k.created_at, k.id]
    )


@router.post("/api-keys/{key_id}/revoke", response_model=ApiKeyOut)
def revoke_api_key(key_id: str, session: SessionDep, key: AdminKey) -> ApiKeyOut:
    revoked = auth.revoke_key(
        session, tenant_id=key.tenant_id, key_id=key_id, actor=auth.actor_of(key), actor_key_id=key.id
    )
    session.commit()
    return ApiKeyOut.of(revoked)
