"""Base-model registry: register, list, get; a model's adapter stack; greedy generation by base + stack."""

from __future__ import annotations

import functools
from typing import Annotated

from fastapi import APIRouter, Body, Query

from blade_service.api.adapter_views import AdapterView, stack_refs, stack_views
from blade_service.api.deps import (
    AdminKey,
    ReadKey,
    SessionDep,
    SettingsDep,
    StorageDep,
    TenantQuery,
    base_model_for,
    tenant_id_for,
)
from blade_service.api.error_responses import error_responses
from blade_service.api.pagination import Cursor, Limit, Offset, Page, page_after
from blade_service.api.schemas import BaseModelIn, BaseModelOut, GenerateIn, GenerateOut
from blade_service.api.worker_waits import waiting_for_a_worker
from blade_service.broker import dispatch
from blade_service.persistence import auth, base_models, hub, registry
from blade_service.persistence.errors import GatewayTimeout, Invalid, ServiceError, Unavailable
from blade_service.persistence.storage import Storage

router = APIRouter(prefix="/base-models", tags=["base models"])


@router.post("", status_code=201, response_model=BaseModelOut)
def register_base_model(
    body: BaseModelIn, session: SessionDep, settings: SettingsDep, storage: StorageDep, key: AdminKey
) -> BaseModelOut:
    """Register a base model for your tenant (or, with `shared`, for every tenant).

    A hub-id `source` (`org/name[@revision]`) is checked against the hub: 422 when it denies the model,
    registered with a warning in `warnings` when it cannot be reached. A directory on the workers or a
    storage key is the operator's to register (for a tenant: `tenant`): any file the workers can read
    would otherwise be any tenant's to load."""
    operator = auth.is_operator(key)
    owner = base_models.owner_for(
        session, key_tenant_id=key.tenant_id, operator=operator, tenant=body.tenant, shared=body.shared
    )
    stored = functools.partial(_stored, storage)
    base_models.check_source_allowed(body.source, operator=operator, is_storage_key=stored)
    revision, warning = hub.check_source(
        body.source,
        body.revision,
        is_storage_key=stored,
        hub_url=settings.hub_url,
        timeout_s=settings.hub_check_timeout_s,
        token=hub.hub_token(),
    )
    model = base_models.register(
        session,
        name=body.name,
        source=body.source,
        description=body.description,
        tenant_id=None if body.shared else owner,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
        audit_tenant_id=owner,
        policy=body.policy,
        canary_dataset_id=body.canary_dataset,
        revision=revision,
    )
    session.commit()
    out = BaseModelOut.of(model)
    out.warnings = [warning] if warning else []
    return out


def _stored(storage: Storage, key: str) -> bool:
    try:
        return storage.exists(key)
    except ValueError:  # not a valid storage key
        return False


@router.get("", response_model=Page[BaseModelOut])
def list_base_models(
    session: SessionDep,
    key: ReadKey,
    limit: Limit = 100,
    cursor: Cursor = None,
    offset: Offset = 0,
    tenant: Annotated[
        str | None, Query(max_length=100, description="the operator: list this tenant's (default: yours)")
    ] = None,
) -> Page[BaseModelOut]:
    """The tenant's own and the shared ones, by name, a cursor page."""
    visible = base_models.list_visible(session, tenant_id=tenant_id_for(session, key, tenant))
    found = [BaseModelOut.of(m) for m in visible]
    return page_after(found, cursor=cursor, kinds="str", limit=limit, offset=offset, key=lambda m: [m.name])


@router.get("/{name}", response_model=BaseModelOut)
def get_base_model(name: str, session: SessionDep, key: ReadKey, tenant: TenantQuery = None) -> BaseModelOut:
    return BaseModelOut.of(base_model_for(session, key, name, tenant))


@router.get("/{name}/adapters", response_model=Page[AdapterView])
def list_adapters(
    name: str,
    session: SessionDep,
    key: ReadKey,
    limit: Limit = 1000,
    cursor: Cursor = None,
    offset: Offset = 0,
    tenant: TenantQuery = None,
) -> Page[AdapterView]:
    """Every adapter version of the model in stack order (by version), active and disabled; a cursor page.

    On a shared base model another tenant's versions show only their version and state."""
    model = base_model_for(session, key, name, tenant)
    found = list(stack_views(registry.list_stack(session, model), tenant_id=auth.tenant_scope(key)).values())
    return page_after(
        found, cursor=cursor, kinds="int", limit=limit, offset=offset, key=lambda a: [a.version]
    )


# Swagger UI's "Try it out" starts from the first; a body built from the schema alone would fill both fields.
GENERATE_EXAMPLES = {
    "question": {
        "summary": "a question, asked the way QA rows are",
        "value": {"question": "Where was Teimo Aniavmont born?"},
    },
    "prompt": {
        "summary": "raw text to continue",
        "value": {"prompt": "Teimo Aniavmont was born in", "max_new_tokens": 16},
    },
}


@router.post("/{name}/generate", response_model=GenerateOut, responses=error_responses(429, 502, 504))
def generate_text(
    name: str,
    body: Annotated[GenerateIn, Body(openapi_examples=GENERATE_EXAMPLES)],
    session: SessionDep,
    settings: SettingsDep,
    key: ReadKey,
    tenant: TenantQuery = None,
) -> GenerateOut:
    """Greedy completion by the base model plus its active adapters, computed on a worker (bounded wait):
    of raw text (`prompt`), or of a `question` asked as the model's QA rows ask it."""
    model = base_model_for(session, key, name, tenant)  # 404 before the body's 422
    text, as_question = _text_to_continue(body)
    stack = stack_refs(registry.effective_stack(session, model), tenant_id=auth.tenant_scope(key))
    session.close()  # hold no connection while waiting for the worker
    completion = _dispatch_generate(
        model.id, text, body.max_new_tokens, settings.generate_timeout_s, as_question=as_question
    )
    return GenerateOut(
        base_model=model.name,
        prompt=completion.prompt,
        question=body.question,
        text=completion.text,
        stack=stack,
    )


def _text_to_continue(body: GenerateIn) -> tuple[str, bool]:
    """(text, whether it is a question): exactly one of `prompt` and `question`."""
    if body.prompt is not None and body.question is None:
        return body.prompt, False
    if body.question is not None and body.prompt is None:
        return body.question, True
    raise Invalid(
        "prompt: give exactly one of prompt (raw text to continue) and question",
        code="validation_error",
        field="prompt",
    )


def _dispatch_generate(
    base_model_id: str, text: str, max_new_tokens: int, timeout: float, *, as_question: bool
) -> dispatch.Completion:
    try:
        with waiting_for_a_worker("generation"):
            return dispatch.generate(
                base_model_id, text, max_new_tokens=max_new_tokens, timeout=timeout, as_question=as_question
            )
    except TimeoutError:
        raise GatewayTimeout(f"no worker answered within {timeout:g} s", code="generate_timeout") from None
    except dispatch.DispatchError as exc:
        if exc.code.endswith("unavailable"):
            raise Unavailable(exc.message, code=exc.code) from None
        error = ServiceError(exc.message, code=exc.code)
        error.status = 502
        raise error from None
