"""`GET /audit-log` (newest first) and `GET /audit-log/verify` (the chain, and its signed heads).

A tenant's keys see that tenant's entries; the operator (an admin key of the default tenant) sees every entry,
including the installation's own (tenant-less) ones such as shared base models registered at start-up.
`verify` checks the whole chain for the operator and only the tenant's own entries for a tenant.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from blade_service.api.deps import ReadKey, SessionDep, SettingsDep, StorageDep
from blade_service.api.pagination import Cursor, Limit, Page, cursor_only, decode_cursor, page
from blade_service.api.schemas import AuditEntryOut, ChainOut
from blade_service.persistence import audit, audit_heads, auth

router = APIRouter(prefix="/audit-log", tags=["audit"])


@router.get("", response_model=Page[AuditEntryOut], dependencies=[Depends(cursor_only)])
def list_audit_log(
    session: SessionDep,
    key: ReadKey,
    action: str | None = None,
    subject_id: str | None = None,
    before_id: int | None = Query(
        None, description="only entries older than this id (what `cursor` carries)"
    ),
    limit: Limit = 100,
    cursor: Cursor = None,
) -> Page[AuditEntryOut]:
    """Newest first, a cursor page."""
    after = decode_cursor(cursor, "int")
    if after is not None:
        before_id = min(after[0], before_id) if before_id is not None else after[0]
    entries = audit.list_entries(
        session,
        tenant_id=None if auth.is_operator(key) else key.tenant_id,
        action=action,
        subject_id=subject_id,
        before_id=before_id,
        limit=limit + 1,
    )
    return page([AuditEntryOut.of(e) for e in entries], limit=limit, key=lambda e: [e.id])


@router.get("/verify", response_model=ChainOut)
def verify_audit_log(
    session: SessionDep, storage: StorageDep, settings: SettingsDep, key: ReadKey
) -> ChainOut:
    """Recompute the hash chain (the operator: every entry; a tenant: its own entries and their links) and
    check every signed head is still in it; then sign the current head. Intact, or the first problem."""
    tenant_id = auth.tenant_scope(key)
    if tenant_id is None:
        status = audit.verify_chain(session)
    else:
        status = audit.verify_tenant(session, tenant_id=tenant_id)
    heads = audit_heads.check_signed_heads(session, storage, reveal_ids=tenant_id is None)
    result = status.as_dict()
    if status.intact and heads.problem:
        result.update(intact=False, first_bad_id=heads.head_id, problem=heads.problem)
    signed = None
    if result["intact"]:
        signed = audit_heads.current_signed_head(session, storage, settings)
        session.commit()
    return ChainOut(
        **result,
        scope="chain" if tenant_id is None else "tenant",
        signed_heads_checked=heads.checked,
        signed_head=signed,
    )
