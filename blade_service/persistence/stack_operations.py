"""Stack operations (compaction) as rows the API creates and a worker completes (`worker/stacks.py`).

Who may change a base model's stack: the admin of the tenant that owns it; for a shared base model, only
the operator (the admin of the default tenant), because its stack is every tenant's effective model.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from blade_service.persistence import audit, registry
from blade_service.persistence.errors import Conflict, Forbidden, NotFound
from blade_service.persistence.models import AdapterVersion, BaseModel, StackOperation

COMPACT = "compact"
UNFINISHED = ("queued", "running")


def check_may_change_stack(model: BaseModel, *, tenant_id: str | None, operator: bool) -> None:
    if operator or tenant_id is None or model.tenant_id == tenant_id:
        return
    raise Forbidden(
        f"base model {model.name} is shared: only the operator may change its stack",
        code="not_your_base_model",
    )


def adapter_to_change(
    session: Session, *, adapter_id: str, tenant_id: str | None, operator: bool
) -> AdapterVersion:
    """The adapter (404 when not visible: the operator sees every tenant's), once this caller may change its
    base model's stack (else 403)."""
    adapter = registry.get_adapter(session, adapter_id=adapter_id, tenant_id=None if operator else tenant_id)
    check_may_change_stack(adapter.base_model, tenant_id=tenant_id, operator=operator)
    return adapter


def create_compaction(
    session: Session,
    *,
    model: BaseModel,
    rank: int | None,
    reason: str,
    actor: str,
    actor_key_id: str | None,
    tenant_id: str | None,
    operator: bool,
) -> StackOperation:
    """A queued compaction of the model's active stack; Conflict when there is nothing to compact or one is
    already under way."""
    check_may_change_stack(model, tenant_id=tenant_id, operator=operator)
    if not registry.effective_stack(session, model):
        raise Conflict(f"base model {model.name} has no active adapters to compact", code="empty_stack")
    running = session.scalars(
        select(StackOperation.id).where(
            StackOperation.base_model_id == model.id,
            StackOperation.kind == COMPACT,
            StackOperation.status.in_(UNFINISHED),
        )
    ).first()
    if running:
        raise Conflict(f"compaction {running} of {model.name} is still under way", code="compaction_running")
    op = StackOperation(
        base_model_id=model.id,
        kind=COMPACT,
        status="queued",
        params={"rank": rank, "actor_key_id": actor_key_id},
        reason=reason.strip(),
        created_by=actor,
        tenant_id=tenant_id,
    )
    session.add(op)
    session.flush()
    audit.append(
        session,
        action="base_model.compact_requested",
        subject_type="base_model",
        subject_id=model.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=tenant_id,
        reason=op.reason,
        data={"name": model.name, "operation_id": op.id, "rank": rank},
    )
    return op


def get_operation(session: Session, *, operation_id: str, tenant_id: str | None) -> StackOperation:
    op = session.get(StackOperation, operation_id)
    # A compaction of a shared model lists every tenant's versions and datasets: the operator's to read,
    # or the tenant's when every version in it is (`op.tenant_id`).
    visible = op is not None and (
        tenant_id is None or op.base_model.tenant_id == tenant_id or op.tenant_id == tenant_id
    )
    if op is None or not visible:
        raise NotFound(f"no stack operation {operation_id!r}")
    return op
