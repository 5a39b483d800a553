"""What a caller sees of a base model's adapter versions: its own in full, another tenant's as a stub.

On a shared base model tenants stack adapters on one another's; a tenant sees only that another tenant's
version exists (`OtherTenantAdapterOut`: version and state), and where its own adapters name another tenant's
(`parent_stack`, a generate call's stack) that entry reads `other-tenant:v<version>`, never the id. The
operator (`tenant_id` None) sees everything. Visibility itself is `persistence.registry.visible_to`.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from blade_service.api.schemas import AdapterOut, OtherTenantAdapterOut, StateChangeOut
from blade_service.persistence import registry
from blade_service.persistence.models import AdapterVersion

AdapterView = AdapterOut | OtherTenantAdapterOut


def stack_views(stack: list[AdapterVersion], *, tenant_id: str | None) -> dict[str, AdapterView]:
    """adapter id -> what `tenant_id` sees of it, for a whole stack as `registry.list_stack` returns it."""
    stale = registry.stale_flags(stack)
    by_id = {a.id: a for a in stack}
    views: dict[str, AdapterView] = {}
    for a in stack:
        if not registry.visible_to(a, tenant_id):
            views[a.id] = OtherTenantAdapterOut(version=a.version, state=a.state)
            continue
        out = AdapterOut.of(a, stale=stale[a.id])
        parents = [registry.public_ref(by_id[p], tenant_id) if p in by_id else p for p in out.parent_stack]
        after = registry.successor(stack, a)
        views[a.id] = out.model_copy(
            update={
                "parent_stack": parents,
                "superseded_by": registry.public_ref(after, tenant_id) if after is not None else None,
                "change_in_effect": registry.change_in_effect(stack, a),
            }
        )
    return views


def adapter_view(session: Session, adapter: AdapterVersion, *, tenant_id: str | None) -> AdapterOut:
    """One adapter the caller may see (`registry.get_adapter` checked that), its references redacted."""
    view = stack_views(registry.list_stack(session, adapter.base_model), tenant_id=tenant_id)[adapter.id]
    assert isinstance(view, AdapterOut)
    return view


def change_view(
    session: Session, change: registry.RegistryChange, *, tenant_id: str | None
) -> StateChangeOut:
    views = stack_views(registry.list_stack(session, change.adapter.base_model), tenant_id=tenant_id)
    adapter = views[change.adapter.id]
    assert isinstance(adapter, AdapterOut)
    return StateChangeOut(
        adapter=adapter,
        changed=change.changed,
        flagged=[views[a.id] for a in change.flagged],
        cascaded=[a.id for a in change.cascaded],
    )


def stack_refs(stack: list[AdapterVersion], *, tenant_id: str | None) -> list[str]:
    """Ids of `stack` as `tenant_id` may see them (another tenant's: `other-tenant:v<version>`)."""
    return [registry.public_ref(a, tenant_id) for a in stack]
