"""The adapter registry: one ordered stack of adapter versions per base model, with rollback and restore.

Every successful request becomes an `AdapterVersion` with the next version number of its base model (1, 2, …,
numbered under a row lock on the base model, never reused). The effective model is the base plus its active
adapters in version order (`effective_stack`). Each adapter records `parent_stack`, the active adapters it was
trained on top of; an adapter whose parent stack differs from the active adapters now below it is
`trained_on_stale` (computed, so it clears itself when the stack is restored).

`disable` takes an adapter out of the effective model and reports the later adapters that were trained on top
of it (now on a different stack); with `cascade` it disables those too. `enable` puts it back and reports
later active adapters that were trained while it was out. Every change is audited with actor and reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, object_session

from blade_service.persistence import audit
from blade_service.persistence.errors import Conflict, Forbidden, Invalid, NotFound
from blade_service.persistence.models import AdapterState, AdapterVersion, BaseModel, UnlearnRequest, utcnow


@dataclass
class RegistryChange:
    adapter: AdapterVersion
    changed: bool  # False: it was already in that state
    flagged: list[AdapterVersion] = field(default_factory=list)  # later adapters now on a different stack
    cascaded: list[AdapterVersion] = field(default_factory=list)  # disabled along with it (cascade)


def _lock_base_model(session: Session, base_model_id: str) -> BaseModel:
    """Row lock on the base model: stack changes and version numbering of one model take turns.

    FOR NO KEY UPDATE: it does not block inserts that merely reference the row (their FK check's KEY SHARE).
    """
    query = select(BaseModel).where(BaseModel.id == base_model_id).with_for_update(key_share=True)
    return session.scalars(query).one()


def base_model_id(session: Session, base_model: BaseModel | str) -> str:
    """The id of a BaseModel, or of the one model a name belongs to (NotFound when none or several do)."""
    if isinstance(base_model, BaseModel):
        return base_model.id
    found = session.scalars(select(BaseModel.id).where(BaseModel.name == base_model).limit(2)).all()
    if len(found) != 1:  # names are per tenant: one that two tenants hold names no single model
        raise NotFound(
            f"no base model {base_model!r}" if not found else f"base model {base_model!r}: ambiguous"
        )
    return found[0]


def list_stack(session: Session, base_model: BaseModel | str) -> list[AdapterVersion]:
    """Every adapter of the base model (active and disabled), in version order."""
    query = (
        select(AdapterVersion)
        .where(AdapterVersion.base_model_id == base_model_id(session, base_model))
        .order_by(AdapterVersion.version)
        .execution_options(populate_existing=True)
    )
    return list(session.scalars(query))


def effective_stack(session: Session, base_model: BaseModel | str) -> list[AdapterVersion]:
    """The active adapters of the base model (a BaseModel, or a name only one model has), in the order
    they apply."""
    return [a for a in list_stack(session, base_model) if a.state == AdapterState.ACTIVE]


def _expand(ids: list[str], contains: dict[str, list[str]]) -> list[str]:
    """Adapter ids with each compacted version replaced by the versions it contains (recursively)."""
    out: list[str] = []
    for i in ids:
        out.extend(_expand(contains[i], contains) if i in contains else [i])
    return out


def stale_flags(stack: list[AdapterVersion]) -> dict[str, bool]:
    """adapter id -> trained_on_stale, for a whole stack as `list_stack` returns it.

    A compacted version stands for the versions it contains: an adapter trained on v1..v3 is not stale on a
    stack where their compaction v4 is active instead, and v1..v3 themselves are not (v4 carries them); nor is
    v4 when v1..v3 are active again below it (restored by disabling v4 and enabling them).
    """
    contains = {a.id: list((a.lineage or {}).get("contains", [])) for a in stack if a.kind == COMPACTION_KIND}
    carried = {
        i
        for a in stack
        if a.id in contains and a.state == AdapterState.ACTIVE
        for i in (*contains[a.id], *_expand(contains[a.id], contains))
    }
    flags: dict[str, bool] = {}
    active_below: list[str] = []
    for adapter in stack:
        parents = _expand(list(adapter.parent_stack or []), contains)
        # a disabled compaction's own versions, active below it, are it restored (not a stack it missed)
        own = (
            set()
            if adapter.state == AdapterState.ACTIVE
            else set(_expand(contains.get(adapter.id, []), contains))
        )
        below = [i for i in _expand(active_below, contains) if i not in own]
        flags[adapter.id] = adapter.id not in carried and parents != below
        if adapter.state == AdapterState.ACTIVE:
            active_below = [*active_below, adapter.id]
    return flags


def create_adapter_version(
    session: Session,
    *,
    request: UnlearnRequest | str,
    artifact_key: str,
    sha256: str,
    size_bytes: int | None = None,
    parent_stack: list[str] | None = None,
    hyperparameters: dict[str, Any] | None = None,
    actor: str = "system",
    state: AdapterState = AdapterState.ACTIVE,
    state_reason: str | None = None,
) -> AdapterVersion:
    """The request's adapter as the next version of its base model; the existing one if it already has one.

    `parent_stack` is the ids of the active adapters the run trained on top of, in stack order (default: the
    effective stack now). `hyperparameters` default to the request's params. `state` DISABLED stores it
    without putting it into the effective model (an adapter the policy gate held back).
    """
    if isinstance(request, str):
        found = session.get(UnlearnRequest, request)
        if found is None:
            raise NotFound("no such unlearn request")
        request = found
    _lock_base_model(session, request.base_model_id)
    existing = session.scalars(
        select(AdapterVersion).where(AdapterVersion.request_id == request.id)
    ).one_or_none()
    if existing is not None:
        return existing
    if parent_stack is None:
        parent_stack = [a.id for a in effective_stack(session, request.base_model)]
    adapter = AdapterVersion(
        base_model_id=request.base_model_id,
        version=_next_version(session, request.base_model_id),
        state=state,
        state_reason=state_reason,
        state_changed_at=utcnow() if state_reason else None,
        state_changed_by=actor if state_reason else None,
        request_id=request.id,
        method=request.method,
        sha256=sha256,
        size_bytes=size_bytes,
        storage_key=artifact_key,
        forget_sha256=request.forget_dataset.sha256,
        retain_sha256=request.retain_dataset.sha256,
        hyperparameters=dict(request.params if hyperparameters is None else hyperparameters),
        parent_stack=list(parent_stack),
    )
    session.add(adapter)
    session.flush()
    audit.append(
        session,
        action="adapter.create",
        subject_type="adapter",
        subject_id=adapter.id,
        actor=actor,
        tenant_id=request.tenant_id,
        data={
            "base_model": request.base_model.name,
            "version": adapter.version,
            "request_id": request.id,
            "sha256": sha256,
            "parent_stack": _refs(session, list(adapter.parent_stack), request.tenant_id),
            "state": adapter.state.value,
        },
        reason=state_reason,
    )
    return adapter


def _next_version(session: Session, base_model_id: str) -> int:
    last = session.scalar(
        select(func.max(AdapterVersion.version)).where(AdapterVersion.base_model_id == base_model_id)
    )
    return (last or 0) + 1


COMPACTION_KIND = "compaction"


def create_compacted_version(
    session: Session,
    *,
    base_model_id: str,
    sources: list[str],
    artifact_key: str,
    sha256: str,
    size_bytes: int | None,
    lineage: dict[str, Any],
    actor: str,
    reason: str,
    actor_key_id: str | None = None,
    tenant_id: str | None = None,
) -> AdapterVersion:
    """One new version equivalent to the active stack `sources`, which it replaces (they are disabled with
    "compacted into vN" and stay restorable). Conflict when the active stack is no longer `sources`."""
    model = _lock_base_model(session, base_model_id)
    stack = list_stack(session, model)
    active = [a for a in stack if a.state == AdapterState.ACTIVE]
    if [a.id for a in active] != list(sources):
        raise Conflict(
            f"base model {model.name}: the active stack changed while it was being compacted "
            f"(compacted {list(sources)}, active now {[a.id for a in active]}); compact again",
            code="stack_changed",
        )
    digest = hashlib.sha256
    adapter = AdapterVersion(
        base_model_id=base_model_id,
        version=_next_version(session, base_model_id),
        state=AdapterState.ACTIVE,
        request_id=None,
        kind=COMPACTION_KIND,
        method=COMPACTION_KIND,
        sha256=sha256,
        size_bytes=size_bytes,
        storage_key=artifact_key,
        forget_sha256=digest("".join(a.forget_sha256 for a in active).encode()).hexdigest(),
        retain_sha256=digest("".join(a.retain_sha256 for a in active).encode()).hexdigest(),
        hyperparameters={"rank": lineage.get("rank")},
        parent_stack=[],
        lineage={
            **lineage,
            "contains": list(sources),
            "versions": [a.version for a in active],
            "request_ids": [a.request_id for a in active],
            "methods": [a.method for a in active],
        },
    )
    session.add(adapter)
    session.flush()
    audit.append(
        session,
        action="adapter.compact",
        subject_type="adapter",
        subject_id=adapter.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=tenant_id,
        reason=reason,
        data={"base_model": model.name, "version": adapter.version, "lineage": adapter.lineage},
    )
    for source in active:
        _set_state(
            session,
            source,
            AdapterState.DISABLED,
            actor=actor,
            actor_key_id=actor_key_id,
            tenant_id=tenant_id,
            reason=f"compacted into v{adapter.version}",
            data={"compacted_into": adapter.id},
        )
    session.flush()
    return adapter


def get_adapter(session: Session, *, adapter_id: str, tenant_id: str | None) -> AdapterVersion:
    """The adapter, if its base model is visible to the tenant (`tenant_id` None: any); NotFound otherwise."""
    query = (
        select(AdapterVersion)
        .join(BaseModel, AdapterVersion.base_model_id == BaseModel.id)
        .where(AdapterVersion.id == adapter_id)
    )
    if tenant_id is not None:
        query = query.where(or_(BaseModel.tenant_id.is_(None), BaseModel.tenant_id == tenant_id))
    adapter = session.scalars(query).one_or_none()
    if adapter is None or not visible_to(adapter, tenant_id):
        raise NotFound(f"no adapter {adapter_id!r}")
    return adapter


def _stands_for(adapter: AdapterVersion) -> list[str]:
    """The versions whose change `adapter` carries instead: those it compacts, or the one it retrains."""
    lineage = adapter.lineage or {}
    return [*lineage.get("contains", []), *([lineage["retrain_of"]] if lineage.get("retrain_of") else [])]


def _carried_by(stack: list[AdapterVersion]) -> dict[str, set[str]]:
    """adapter id -> every version whose change it carries, through nested compactions and retrains (a
    compaction of v3 = (v1, v2) and v4 carries v1 and v2 too)."""
    direct = {a.id: _stands_for(a) for a in stack}
    carried: dict[str, set[str]] = {}

    def of(adapter_id: str) -> set[str]:
        if adapter_id not in carried:
            carried[adapter_id] = set()  # a cycle (never written) ends here
            for i in direct.get(adapter_id, []):
                carried[adapter_id] |= {i, *of(i)}
        return carried[adapter_id]

    for a in stack:
        of(a.id)
    return carried


def _same_change(a: AdapterVersion, b: AdapterVersion, carried: dict[str, set[str]]) -> bool:
    return a.id in carried.get(b.id, set()) or b.id in carried.get(a.id, set())


def _relation(adapter: AdapterVersion, other: AdapterVersion, carried: dict[str, set[str]]) -> str:
    replacement, replaced = (
        (other, adapter) if adapter.id in carried.get(other.id, set()) else (adapter, other)
    )
    verb = "compacts" if replacement.kind == COMPACTION_KIND else "retrains"
    return f"v{replacement.version} {verb} v{replaced.version}"


def successor(stack: list[AdapterVersion], adapter: AdapterVersion) -> AdapterVersion | None:
    """The newest later version of `stack` (a base model's, as `list_stack` returns it) that carries
    `adapter`'s change instead of it: a compaction containing it, or its retrain on a rebased stack."""
    later = [a for a in stack if a.version > adapter.version and adapter.id in _stands_for(a)]
    return max(later, key=lambda a: a.version, default=None)


def change_in_effect(stack: list[AdapterVersion], adapter: AdapterVersion) -> bool:
    """Whether `adapter`'s change is in the effective model: it is active, or a successor of it is."""
    current: AdapterVersion | None = adapter
    while current is not None:
        if current.state == AdapterState.ACTIVE:
            return True
        current = successor(stack, current)
    return False


def visible_to(adapter: AdapterVersion, tenant_id: str | None) -> bool:
    """May the tenant see this adapter (`tenant_id` None: the operator, who sees all)?

    Every adapter of its own base model; on a shared base model only those its own requests made, and a
    compaction of only such versions. Another tenant's version shows at most that it exists (version and
    state): no id, request, data hash or file.
    """
    if tenant_id is None or adapter.base_model.tenant_id == tenant_id:
        return True
    if adapter.base_model.tenant_id is not None:
        return False
    if adapter.kind == COMPACTION_KIND:  # no request of its own: the tenant's when everything in it is
        session = object_session(adapter)
        contained = [session.get(AdapterVersion, i) for i in _stands_for(adapter)] if session else []
        return bool(contained) and all(a is not None and visible_to(a, tenant_id) for a in contained)
    request = adapter.request
    return request is not None and request.tenant_id == tenant_id


def public_ref(adapter: AdapterVersion, tenant_id: str | None) -> str:
    """How `tenant_id` may name the adapter: its id, or `other-tenant:v<version>` for another tenant's."""
    return adapter.id if visible_to(adapter, tenant_id) else f"other-tenant:v{adapter.version}"


def _refs(session: Session, ids: list[str], tenant_id: str | None) -> list[str]:
    """`public_ref` of each adapter id (an audit row is read by its tenant: no other tenant's ids in it)."""
    found = {a.id: a for a in session.scalars(select(AdapterVersion).where(AdapterVersion.id.in_(ids)))}
    return [public_ref(found[i], tenant_id) if i in found else i for i in ids]


def _check_may_change(adapter: AdapterVersion, tenant_id: str | None, operator: bool) -> None:
    """Your base model's adapters; on a shared base model, those your requests made (the operator: all)."""
    if tenant_id is None or operator or adapter.base_model.tenant_id == tenant_id:
        return
    if (
        adapter.base_model.tenant_id is None
        and adapter.request is not None
        and adapter.request.tenant_id == tenant_id
    ):
        return
    raise Forbidden(
        f"adapter {adapter.id} belongs to a shared base model and was made by another tenant's request; "
        "only the operator may change it",
        code="not_your_adapter",
    )


def _set_state(
    session: Session,
    adapter: AdapterVersion,
    state: AdapterState,
    *,
    actor: str,
    actor_key_id: str | None,
    tenant_id: str | None,
    reason: str,
    data: dict[str, Any],
) -> None:
    adapter.state = state
    adapter.state_changed_at, adapter.state_changed_by, adapter.state_reason = utcnow(), actor, reason
    action = "adapter.enable" if state == AdapterState.ACTIVE else "adapter.disable"
    audit.append(
        session,
        action=action,
        subject_type="adapter",
        subject_id=adapter.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=tenant_id,
        reason=reason,
        data={"base_model": adapter.base_model.name, "version": adapter.version, **data},
    )


def _require_reason(reason: str | None) -> str:
    if not reason or not reason.strip():
        raise Invalid("reason: a reason is required for every registry change", field="reason")
    return reason.strip()


def _locked_stack(
    session: Session, *, adapter_id: str, tenant_id: str | None, operator: bool
) -> tuple[AdapterVersion, list[AdapterVersion], str | None]:
    """(the adapter, its base model's stack, the viewer) for a state change, after the visibility and
    may-change checks, with the base model row locked; the viewer is whose eyes the audit rows are for."""
    viewer = None if operator else tenant_id
    adapter = get_adapter(session, adapter_id=adapter_id, tenant_id=viewer)
    _check_may_change(adapter, tenant_id, operator)
    _lock_base_model(session, adapter.base_model_id)
    stack = list_stack(session, adapter.base_model)
    return next(a for a in stack if a.id == adapter_id), stack, viewer


def disable(
    session: Session,
    *,
    adapter_id: str,
    actor: str,
    reason: str | None,
    cascade: bool = False,
    actor_key_id: str | None = None,
    tenant_id: str | None = None,
    operator: bool = False,
) -> RegistryChange:
    """Take the adapter out of the effective model; report (`cascade`: disable) adapters built on it."""
    reason = _require_reason(reason)
    adapter, stack, viewer = _locked_stack(
        session, adapter_id=adapter_id, tenant_id=tenant_id, operator=operator
    )
    dependents = [
        a
        for a in stack
        if a.version > adapter.version
        and adapter.id in (a.parent_stack or [])
        and a.state == AdapterState.ACTIVE
    ]
    changed = adapter.state != AdapterState.DISABLED
    if changed:
        _set_state(
            session,
            adapter,
            AdapterState.DISABLED,
            actor=actor,
            actor_key_id=actor_key_id,
            tenant_id=tenant_id,
            reason=reason,
            data={"cascade": cascade, "flagged": [public_ref(a, viewer) for a in dependents]},
        )
    cascaded = []
    if cascade:
        # only what the caller may change: another tenant's version on a shared model stays, flagged
        for dependent in (d for d in dependents if operator or visible_to(d, tenant_id)):
            _set_state(
                session,
                dependent,
                AdapterState.DISABLED,
                actor=actor,
                actor_key_id=actor_key_id,
                tenant_id=tenant_id,
                reason=f"cascade from {adapter.id} (v{adapter.version}): {reason}",
                data={"cascade_from": adapter.id},
            )
            cascaded.append(dependent)
    session.flush()
    return RegistryChange(adapter, changed or bool(cascaded), dependents, cascaded)


def enable(
    session: Session,
    *,
    adapter_id: str,
    actor: str,
    reason: str | None,
    actor_key_id: str | None = None,
    tenant_id: str | None = None,
    operator: bool = False,
) -> RegistryChange:
    """Put the adapter back into the effective model; report later active adapters trained without it."""
    reason = _require_reason(reason)
    adapter, stack, viewer = _locked_stack(
        session, adapter_id=adapter_id, tenant_id=tenant_id, operator=operator
    )
    flagged = [
        a
        for a in stack
        if a.version > adapter.version
        and adapter.id not in (a.parent_stack or [])
        and a.state == AdapterState.ACTIVE
    ]
    changed = adapter.state != AdapterState.ACTIVE
    carried = _carried_by(stack)
    overlapping = [a for a in stack if a.state == AdapterState.ACTIVE and _same_change(a, adapter, carried)]
    if changed and overlapping:
        other = overlapping[0]
        raise Conflict(
            f"adapter {adapter.id} (v{adapter.version}) and the active v{other.version} "
            f"({public_ref(other, viewer)}) carry the same change ({_relation(adapter, other, carried)}): "
            f"both active would apply it twice; disable v{other.version} first",
            code="compacted" if COMPACTION_KIND in (adapter.kind, other.kind) else "replaced",
        )
    request = adapter.request
    override = changed and request is not None and request.status == "rejected"
    if changed:
        _set_state(
            session,
            adapter,
            AdapterState.ACTIVE,
            actor=actor,
            actor_key_id=actor_key_id,
            tenant_id=tenant_id,
            reason=reason,
            data={
                "flagged": [public_ref(a, viewer) for a in flagged],
                **({"policy_override": True} if override else {}),
            },
        )
    if override and request is not None:  # the policy gate held it back: an admin activates it anyway
        gate = dict(request.gate or {})  # the verdict keeps the record
        gate["override"] = {"by": actor, "reason": reason, "at": utcnow().isoformat()}
        request.gate = gate
    session.flush()
    return RegistryChange(adapter, changed, flagged if changed else [], [])
