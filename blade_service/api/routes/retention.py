"""How long a base model's forget data outlives its requests (persistence/retention.py).

GET /base-models/{name}/retention         the model's own values (null: the default) and the effective ones
PUT /base-models/{name}/retention         {success_s, failure_s} (admin; null restores the default)
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel as Schema
from pydantic import ConfigDict, Field

from blade_service.api.deps import AdminKey, ReadKey, SessionDep, SettingsDep, TenantQuery, base_model_for
from blade_service.api.schemas import ErrorOut
from blade_service.persistence import auth, retention
from blade_service.persistence.errors import Forbidden

router = APIRouter(prefix="/base-models", tags=["base models"])

TEN_YEARS_S = 10 * 365 * 24 * 3600


class RetentionIn(Schema):
    model_config = ConfigDict(extra="forbid")

    success_s: int | None = Field(
        ge=0, le=TEN_YEARS_S, description="seconds kept after a success; null: the default (0, at once)"
    )
    failure_s: int | None = Field(
        ge=0, le=TEN_YEARS_S, description="seconds kept after a failure or cancel; null: the default (3 days)"
    )


class RetentionOut(Schema):
    base_model: str
    success_s: int | None = Field(description="this model's own value; null: the default")
    failure_s: int | None
    effective_success_s: int
    effective_failure_s: int


def _out(model: Any, settings: Any) -> RetentionOut:
    return RetentionOut.model_validate({"base_model": model.name, **retention.retention_of(model, settings)})


@router.get("/{name}/retention", response_model=RetentionOut, responses={404: {"model": ErrorOut}})
def get_retention(
    name: str, session: SessionDep, settings: SettingsDep, key: ReadKey, tenant: TenantQuery = None
) -> RetentionOut:
    model = base_model_for(session, key, name, tenant)
    return _out(model, settings)


@router.put(
    "/{name}/retention",
    response_model=RetentionOut,
    responses={403: {"model": ErrorOut}, 404: {"model": ErrorOut}},
)
def set_retention(
    name: str,
    body: RetentionIn,
    session: SessionDep,
    settings: SettingsDep,
    key: AdminKey,
    tenant: TenantQuery = None,
) -> RetentionOut:
    """Longer than the default is the operator's explicit choice (e.g. to retrain after a rollback)."""
    model = base_model_for(session, key, name, tenant)
    if model.tenant_id is None and not auth.is_operator(key):
        raise Forbidden(f"base model {name} is shared: only the operator sets its retention")
    retention.set_retention(
        session,
        base_model=model,
        success_s=body.success_s,
        failure_s=body.failure_s,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    return _out(model, settings)
