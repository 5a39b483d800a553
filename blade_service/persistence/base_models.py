"""Registered base models. A tenant sees the shared ones (`tenant_id` NULL) and its own, and a name is unique
among those: two tenants may each hold a private model of one name, and neither learns of the other's."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from blade_service.persistence import audit
from blade_service.persistence import policy as policy_rules
from blade_service.persistence.auth import tenant_named
from blade_service.persistence.errors import Conflict, Forbidden, Invalid, NotFound
from blade_service.persistence.hub import is_local_path
from blade_service.persistence.models import BaseModel

# Checked with fullmatch: a `$` anchor also matches before a final newline, which then reached file names
# and Content-Disposition headers.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_NAME_LOCK = 727274  # pg_advisory_xact_lock(key, hashtext(name)): registrations of one name take turns


def owner_for(
    session: Session, *, key_tenant_id: str, operator: bool, tenant: str | None, shared: bool
) -> str:
    """The tenant a new base model is registered for (and its audit entry is filed under): the key's own,
    or the one the operator names (`tenant`). Forbidden for anyone else, and `shared` too: a shared model
    appears in every tenant's list and takes its name in every tenant. Invalid with both."""
    if shared and not operator:
        raise Forbidden(
            "shared: only the operator registers a model every tenant sees; register it for your tenant",
            code="cross_tenant",
            field="shared",
        )
    if not tenant:
        return key_tenant_id
    if not operator:
        raise Forbidden(
            "tenant: only the operator registers a base model for another tenant",
            code="cross_tenant",
            field="tenant",
        )
    if shared:
        raise Invalid(
            "tenant: a shared model belongs to every tenant; give `shared` or `tenant`", field="tenant"
        )
    return tenant_named(session, name=tenant).id


def check_source_allowed(source: str, *, operator: bool, is_storage_key: Callable[[str], bool]) -> None:
    """Forbidden unless the operator registers a model directory on the workers or a storage key: any file
    the workers can read would otherwise be any tenant's to load. A tenant registers hub ids."""
    if not operator and (is_local_path(source) or is_storage_key(source)):
        raise Forbidden(
            "source: a model directory on the workers or a storage key is registered by the operator "
            "(for your tenant with `tenant`); register a hub id `org/name[@revision]`",
            code="source_not_allowed",
            field="source",
        )


def register(
    session: Session,
    *,
    name: str,
    source: str,
    tenant_id: str | None,
    actor: str,
    actor_key_id: str | None = None,
    description: str | None = None,
    audit_tenant_id: str | None = None,
    policy: dict[str, Any] | None = None,
    canary_dataset_id: str | None = None,
    revision: str | None = None,
) -> BaseModel:
    """A new base model (`tenant_id` None: shared by every tenant); Conflict if the name is taken.

    `policy`: unlearning-policy rules over the defaults (persistence/policy.py); `canary_dataset_id`: the
    dataset the policy gate measures utility on (default: each request's retain sample)."""
    if not NAME_PATTERN.fullmatch(name or ""):
        raise Invalid(
            "name: 1-100 characters of letters, digits, '.', '_', '-', starting with a letter or digit",
            field="name",
        )
    if not (source or "").strip():
        raise Invalid("source: must be a non-empty string", field="source")
    _check_name_free(session, name=name, tenant_id=tenant_id)

    rules = policy_rules.parse(policy) if policy is not None else None
    canary = policy_rules.check_canary(
        session, dataset_id=canary_dataset_id, tenant_id=audit_tenant_id or tenant_id
    )
    model = BaseModel(
        name=name,
        source=source,
        tenant_id=tenant_id,
        description=description,
        policy=rules,
        canary_dataset_id=canary.id if canary is not None else None,
        revision=(revision or "").strip() or None,
    )
    session.add(model)
    session.flush()
    audit.append(
        session,
        action="base_model.register",
        subject_type="base_model",
        subject_id=model.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=audit_tenant_id or tenant_id,
        data={
            "name": name,
            "source": source,
            "shared": tenant_id is None,
            "policy": policy_rules.effective(model),
            "canary_dataset": model.canary_dataset_id,
            "revision": model.revision,
        },
    )
    return model


def _check_name_free(session: Session, *, name: str, tenant_id: str | None) -> None:
    """Conflict when the name is taken among what the owner's tenant sees (a shared name: among every
    tenant's, since every tenant sees a shared model). Only the operator registers shared models, so only it
    learns that some tenant holds a name."""
    if session.get_bind().dialect.name == "postgresql":  # SQLite runs one writer at a time
        session.execute(select(func.pg_advisory_xact_lock(_NAME_LOCK, func.hashtext(name))))
    taken = select(BaseModel.tenant_id).where(BaseModel.name == name)
    if tenant_id is not None:
        taken = taken.where(_visible(tenant_id))
    holders = set(session.scalars(taken))
    if not holders:
        return
    if tenant_id is None and holders != {None}:
        raise Conflict(
            f"a base model named {name!r} exists in another tenant; a shared model's name must be free in "
            "every tenant",
            code="base_model_exists",
        )
    whose = "a shared model" if None in holders else "a base model of this tenant"
    raise Conflict(f"{whose} is already named {name!r}", code="base_model_exists")


def ensure_registered(session: Session, *, name: str, source: str, actor: str = "system") -> BaseModel:
    """The shared base model `name`, registered now if missing (used by `blade up` for demo-tiny)."""
    model = session.scalars(
        select(BaseModel).where(BaseModel.name == name, BaseModel.tenant_id.is_(None))
    ).one_or_none()
    return model or register(session, name=name, source=source, tenant_id=None, actor=actor)


def _visible(tenant_id: str | None) -> ColumnElement[bool]:
    return or_(BaseModel.tenant_id.is_(None), BaseModel.tenant_id == tenant_id)


def get_visible(session: Session, *, name: str, tenant_id: str | None) -> BaseModel:
    """The base model `name` if the tenant may see it; NotFound otherwise."""
    model = session.scalars(
        select(BaseModel).where(BaseModel.name == name, _visible(tenant_id))
    ).one_or_none()
    if model is None:
        raise NotFound(f"no base model {name!r}")
    return model


def tenant_for_caller(
    session: Session, *, key_tenant_id: str, key_tenant: str, operator: bool, tenant: str | None
) -> str:
    """The id of the tenant whose models the caller means: its own, or for the operator the one `tenant`
    names. Anyone else naming a tenant but its own: Forbidden, before any lookup (a 422 for an unknown name
    would list the tenants)."""
    if not tenant or tenant == key_tenant:
        return key_tenant_id
    if not operator:
        raise Forbidden(
            "tenant: only the operator names another tenant's model", code="cross_tenant", field="tenant"
        )
    return tenant_named(session, name=tenant).id


def get_for_caller(session: Session, *, name: str, tenant_id: str, hint_tenant: bool) -> BaseModel:
    """`get_visible` for the tenant `tenant_for_caller` named; `hint_tenant`: the operator looked in its own
    tenant, so a miss says how to reach another tenant's model (names are per tenant)."""
    try:
        return get_visible(session, name=name, tenant_id=tenant_id)
    except NotFound:
        if not hint_tenant:
            raise
        raise NotFound(
            f"no base model {name!r} of your tenant or shared; another tenant's: name it with `tenant`"
        ) from None


def list_visible(session: Session, *, tenant_id: str | None) -> list[BaseModel]:
    return list(session.scalars(select(BaseModel).where(_visible(tenant_id)).order_by(BaseModel.name)))
