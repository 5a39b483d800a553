"""A base model's stack as a whole: its unlearning policy, compaction into one version, one-file export."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from blade_service.api.deps import (
    AdminKey,
    ReadKey,
    SessionDep,
    SettingsDep,
    StorageDep,
    TenantQuery,
    base_model_for,
)
from blade_service.api.error_responses import error_responses
from blade_service.api.routes.requests import request_out
from blade_service.api.schemas import (
    BaseModelOut,
    CompactIn,
    PolicyIn,
    RetrainIn,
    StackOperationOut,
    UnlearnRequestOut,
)
from blade_service.api.worker_waits import waiting_for_a_worker
from blade_service.broker import dispatch
from blade_service.persistence import auth, policy, rebase, stack_operations
from blade_service.persistence.errors import (
    Conflict,
    Forbidden,
    GatewayTimeout,
    NotFound,
    ServiceError,
    Unavailable,
)

router = APIRouter(tags=["stacks"])


@router.put("/base-models/{name}/policy", response_model=BaseModelOut)
def set_policy(
    name: str, body: PolicyIn, session: SessionDep, key: AdminKey, tenant: TenantQuery = None
) -> BaseModelOut:
    """Change the unlearning policy and/or canary set (admin; audited with old and new values, under the
    model's tenant: its canary is that tenant's data)."""
    model = base_model_for(session, key, name, tenant)
    stack_operations.check_may_change_stack(model, tenant_id=key.tenant_id, operator=auth.is_operator(key))
    policy.set_policy(
        session,
        model=model,
        policy=body.policy,
        canary_dataset_id=body.canary_dataset,
        clear_canary=body.clear_canary,
        reason=body.reason,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
        tenant_id=model.tenant_id or key.tenant_id,
    )
    session.commit()
    return BaseModelOut.of(model)


@router.post("/base-models/{name}/compact", status_code=202, response_model=StackOperationOut)
def compact(
    name: str, body: CompactIn, session: SessionDep, key: AdminKey, tenant: TenantQuery = None
) -> StackOperationOut:
    """Queue the active stack's compaction into one verified version (admin); poll the operation. The
    operation and its audit entry are the model's tenant's (the operator's, for a shared model)."""
    model = base_model_for(session, key, name, tenant)
    op = stack_operations.create_compaction(
        session,
        model=model,
        rank=body.rank,
        reason=body.reason,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
        tenant_id=model.tenant_id or key.tenant_id,
        operator=auth.is_operator(key),
    )
    session.commit()

    dispatch.enqueue_compact(op.id)
    return StackOperationOut.of(op)


@router.post("/adapters/{adapter_id}/retrain", status_code=202, response_model=UnlearnRequestOut)
def retrain(adapter_id: str, body: RetrainIn, session: SessionDep, key: AdminKey) -> UnlearnRequestOut:
    """Re-run one active version's request on the current stack (admin), e.g. a stale version whose forget
    data was purged, supplied again as `forget_dataset`; the retrain replaces the version when it succeeds."""
    adapter = stack_operations.adapter_to_change(
        session, adapter_id=adapter_id, tenant_id=key.tenant_id, operator=auth.is_operator(key)
    )
    request = rebase.retrain_one(
        session,
        adapter=adapter,
        forget_dataset_id=body.forget_dataset,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()  # a worker's submission relay publishes it
    return request_out(session, request)  # with its queue position, as every route returns a request


@router.get("/stack-operations/{operation_id}", response_model=StackOperationOut)
def get_operation(operation_id: str, session: SessionDep, key: ReadKey) -> StackOperationOut:
    return StackOperationOut.of(
        stack_operations.get_operation(session, operation_id=operation_id, tenant_id=key.tenant_id)
    )


@router.get(
    "/base-models/{name}/export",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/gzip": {}}}, **error_responses(429, 502, 504)},
)
def export(
    name: str,
    session: SessionDep,
    settings: SettingsDep,
    storage: StorageDep,
    key: ReadKey,
    format: Literal["adapter", "merged"] = Query("adapter", description="one PEFT adapter or merged weights"),
    tenant: TenantQuery = None,
) -> StreamingResponse:
    """The effective model (base + active stack) as one PEFT adapter or merged safetensors, a `.tar.gz`.

    A shared base model's stack holds other tenants' adapters: only the operator exports it."""
    model = base_model_for(session, key, name, tenant)
    if model.tenant_id is None and not auth.is_operator(key):
        raise Forbidden(
            f"base model {model.name} is shared: its export holds other tenants' adapters; "
            "only the operator may export it",
            code="shared_model_export",
        )
    session.close()  # hold no connection while a worker builds the archive

    try:
        with waiting_for_a_worker("export"):
            built = dispatch.export(
                model.id,
                format,
                timeout=settings.export_timeout_s,
                accept_timeout=settings.generate_timeout_s,
            )
    except TimeoutError:
        raise GatewayTimeout(
            f"no worker finished the export within {settings.export_timeout_s:g} s", code="export_timeout"
        ) from None
    except dispatch.DispatchError as exc:
        if exc.code == "empty_stack":
            raise Conflict(exc.message, code=exc.code) from None
        if exc.code.endswith("unavailable"):
            raise Unavailable(exc.message, code=exc.code) from None
        error = ServiceError(exc.message, code=exc.code)
        error.status = 502
        raise error from None
    if not storage.exists(built["key"]):
        raise NotFound("the exported archive is missing from storage", code="artifact_missing")
    filename = f"{model.name}-{format}-{built['sha256'][:12]}.tar.gz"
    return StreamingResponse(
        storage.iter_chunks(built["key"]),
        media_type="application/gzip",
        headers={
            "Content-Disposition": f'attachment; filename="{filename}"',
            "Content-Length": str(built["size"]),
            "X-Content-SHA256": built["sha256"],
            "X-Blade-Stack": ",".join(built["stack"]),
        },
    )
