"""Adapter versions: get one, download its archive, disable (rollback) and enable (restore)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from blade_service.api.adapter_views import adapter_view, change_view
from blade_service.api.deps import AdminKey, ReadKey, SessionDep, StorageDep
from blade_service.api.schemas import AdapterOut, DisableIn, EnableIn, StateChangeOut
from blade_service.persistence import auth, rebase, registry, stack_operations
from blade_service.persistence.errors import NotFound

router = APIRouter(prefix="/adapters", tags=["adapters"])


@router.get("/{adapter_id}", response_model=AdapterOut)
def get_adapter(adapter_id: str, session: SessionDep, key: ReadKey) -> AdapterOut:
    """One version: yours, or on a shared base model one your request made (else 404; the operator: any)."""
    tenant_id = auth.tenant_scope(key)
    adapter = registry.get_adapter(session, adapter_id=adapter_id, tenant_id=tenant_id)
    return adapter_view(session, adapter, tenant_id=tenant_id)


@router.get(
    "/{adapter_id}/download",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/gzip": {}}}},
)
def download_adapter(
    adapter_id: str, session: SessionDep, storage: StorageDep, key: ReadKey
) -> StreamingResponse:
    """The adapter's PEFT files as the stored `.tar.gz` archive."""
    adapter = registry.get_adapter(session, adapter_id=adapter_id, tenant_id=auth.tenant_scope(key))
    if not storage.exists(adapter.storage_key):
        raise NotFound(f"adapter {adapter_id}: its archive is missing from storage", code="artifact_missing")
    name = f"{adapter.base_model.name}-v{adapter.version}-{adapter.id}.tar.gz"
    return StreamingResponse(
        storage.iter_chunks(adapter.storage_key),
        media_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="{name}"',
            "Content-Length": str(storage.size(adapter.storage_key)),
            "X-Content-SHA256": adapter.sha256,
        },
    )


@router.post("/{adapter_id}/disable", response_model=StateChangeOut)
def disable_adapter(adapter_id: str, body: DisableIn, session: SessionDep, key: AdminKey) -> StateChangeOut:
    """Roll back: take it out of the effective model; lists (`cascade`: disables) adapters built on it;
    `cascade: "retrain"` re-runs their requests on the new stack (persistence/rebase.py)."""
    retrain = body.cascade == "retrain"
    if retrain:
        stack_operations.adapter_to_change(
            session, adapter_id=adapter_id, tenant_id=key.tenant_id, operator=auth.is_operator(key)
        )
    change = registry.disable(
        session,
        adapter_id=adapter_id,
        reason=body.reason,
        cascade=body.cascade is True,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
        tenant_id=key.tenant_id,
        operator=auth.is_operator(key),
    )
    plan = []
    if retrain:
        plan = rebase.plan_retrains(
            session,
            disabled=change.adapter,
            dependents=change.flagged,
            actor=auth.actor_of(key),
            actor_key_id=key.id,
            tenant_id=key.tenant_id,
        )
    session.commit()  # a worker's submission relay publishes the retrains
    view = change_view(session, change, tenant_id=auth.tenant_scope(key))
    return view.model_copy(update={"retrains": plan})


@router.post("/{adapter_id}/enable", response_model=StateChangeOut)
def enable_adapter(adapter_id: str, body: EnableIn, session: SessionDep, key: AdminKey) -> StateChangeOut:
    """Restore a disabled adapter; lists later adapters that were trained while it was out."""
    change = registry.enable(
        session,
        adapter_id=adapter_id,
        reason=body.reason,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
        tenant_id=key.tenant_id,
        operator=auth.is_operator(key),
    )
    session.commit()
    return change_view(session, change, tenant_id=auth.tenant_scope(key))
