"""Pydantic v2 models at the HTTP edge: what clients send (`...In`, no unknown fields) and get."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel as Schema
from pydantic import ConfigDict, Field

from blade_service.api.input_guard import SafeJson, SafeStr
from blade_service.persistence import models, requests
from blade_service.persistence import policy as _policy
from blade_service.persistence.convergence import converged


class StrictIn(Schema):
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(Schema):
    code: str
    message: str
    field: str | None = None


class ErrorOut(Schema):
    error: ErrorInfo


# --- datasets ---------------------------------------------------------------------------------------------


class DatasetOut(Schema):
    id: str
    name: str
    sha256: str
    rows: int
    format: str
    kind: str
    size_bytes: int
    created_at: datetime
    purged_at: datetime | None = Field(
        default=None, description="when its bytes were deleted (only sha256, rows and size remain)"
    )
    purge_reason: str | None = Field(
        default=None,
        description="why: deleted on request, its request's retention ended, or nothing named it",
    )

    @classmethod
    def of(cls, d: models.Dataset) -> DatasetOut:
        return cls(
            id=d.id,
            name=d.name,
            sha256=d.sha256,
            rows=d.rows,
            format=d.format,
            kind=d.kind,
            size_bytes=d.size_bytes,
            created_at=d.created_at,
            purged_at=d.purged_at,
            purge_reason=d.purge_reason,
        )


# --- base models ------------------------------------------------------------------------------------------


class BaseModelIn(StrictIn):
    name: SafeStr = Field(min_length=1, max_length=100, examples=["demo-tiny"])
    source: SafeStr = Field(
        min_length=1,
        max_length=1024,
        description="hub id `org/name[@revision]` (checked against the hub); the operator may also name a "
        "model dir on the workers or a storage key",
    )
    description: SafeStr | None = Field(default=None, max_length=2000)
    shared: bool = Field(default=False, description="visible to every tenant (default: only to yours)")
    tenant: SafeStr | None = Field(
        default=None,
        max_length=100,
        description="the operator only: register the model for this (existing) tenant instead of your own",
    )
    policy: dict[str, Any] | None = Field(
        default=None,
        description="unlearning policy rules overriding the defaults (persistence/policy.py), e.g. "
        '{"min_retain_prob_ratio": 0.8, "max_forget_rouge": 0.3}',
    )
    revision: SafeStr | None = Field(
        default=None, max_length=255, description="a hub source's revision (commit, tag or branch)"
    )
    canary_dataset: str | None = Field(
        default=None,
        description="dataset id the policy gate measures utility on (default: each request's retain set)",
    )


class BaseModelOut(Schema):
    id: str
    name: str
    source: str
    description: str | None
    shared: bool
    created_at: datetime
    policy: dict[str, Any] = Field(default_factory=dict, description="the effective unlearning policy")
    canary_dataset: str | None = None
    revision: str | None = None
    warnings: list[str] = Field(
        default_factory=list, description="e.g. a hub id registered unchecked because the hub was unreachable"
    )

    @classmethod
    def of(cls, m: models.BaseModel) -> BaseModelOut:
        return cls(
            id=m.id,
            name=m.name,
            source=m.source,
            description=m.description,
            shared=m.tenant_id is None,
            created_at=m.created_at,
            policy=_policy.effective(m),
            canary_dataset=m.canary_dataset_id,
            revision=m.revision,
        )


class GenerateIn(StrictIn):
    prompt: SafeStr | None = Field(
        default=None, min_length=1, max_length=8000, description="raw text to continue (or `question`)"
    )
    question: SafeStr | None = Field(
        default=None,
        min_length=1,
        max_length=8000,
        description="a question, asked the way the model's QA rows are (its chat template, else "
        "`Question: ...\\nAnswer:`): what forget and retain rows ask. Give this or `prompt`",
        examples=["Where was Teimo Aniavmont born?"],
    )
    max_new_tokens: int = Field(default=64, ge=1, le=1024)


class GenerateOut(Schema):
    base_model: str
    prompt: str = Field(description="the text the model continued (a `question` in the model's QA format)")
    question: str | None = None
    text: str
    stack: list[str] = Field(description="ids of the active adapters that were applied, in order")


# --- unlearn requests -------------------------------------------------------------------------------------


class UnlearnRequestIn(StrictIn):
    base_model: SafeStr = Field(examples=["demo-tiny"])
    forget_dataset: SafeStr = Field(description="dataset id")
    retain_dataset: SafeStr = Field(description="dataset id")
    method: SafeStr | None = Field(default=None, description="default: blade", examples=["blade"])
    params: SafeJson | None = Field(
        default=None,
        description="overrides of the method's config fields",
        examples=[{"max_steps": 50, "tau": 0.7}],
    )
    metadata: SafeJson | None = Field(default=None, description="yours, stored and returned as given")
    preset: SafeStr | None = Field(
        default=None,
        description="the method's hyperparameter preset (BLADE: tofu, muse, knowundo, ...; kept in `params`)",
        examples=["muse"],
    )
    probe_datasets: dict[SafeStr, SafeStr] | None = Field(
        default=None,
        description="text requests: QA probe dataset ids for KnowMem, keys forget_qa, retain_qa, icl "
        "(the few-shot examples); without them the metrics are VerbMem on the forget text (kept in `params`)",
        examples=[{"forget_qa": "ds_...", "retain_qa": "ds_...", "icl": "ds_..."}],
    )


class Progress(Schema):
    step: int = Field(description="outer steps done")
    total_steps: int | None = Field(
        description="the step cap: `params.max_steps`, else BLADE's default or a baseline's schedule"
    )
    fraction: float | None = Field(description="step / total_steps (1 once succeeded)")
    steps_per_s: float | None = Field(
        default=None, description="step rate over the latest steps (running only)"
    )
    eta_seconds: float | None = Field(
        default=None,
        description="seconds to the step cap at that rate (running only; a convergence stop can end sooner)",
    )
    eta: datetime | None = Field(default=None, description="when the step cap is reached at that rate")


class UnlearnRequestOut(Schema):
    id: str
    status: models.RequestStatus
    base_model: str
    forget_dataset: str
    retain_dataset: str
    method: str
    params: dict[str, Any]
    metadata: dict[str, Any]
    idempotency_key: str | None
    progress: Progress
    adapter_id: str | None
    error: ErrorInfo | None
    run_status: str | None
    converged: bool | None = Field(
        default=None,
        description="false: the run stopped at its step cap without converging (flagged); null: not ended",
    )
    attempts: int
    queue_seq: int
    queue_position: int | None = Field(
        default=None, description="unfinished requests of the same base model ahead of it (queued only)"
    )
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    gate: dict[str, Any] | None = Field(
        default=None,
        description="the policy gate's verdict: passed, failed rules, measured figures, any admin override",
    )

    @classmethod
    def of(
        cls,
        r: requests.RequestLike,
        *,
        queue_position: int | None = None,
        progress: requests.Progress | None = None,
    ) -> UnlearnRequestOut:
        """`progress` None: step and total only (no rate, no ETA)."""
        progress = progress or requests.progress_so_far(r)
        error = ErrorInfo(code=r.error_code, message=r.error_message or "") if r.error_code else None
        return cls(
            id=r.id,
            status=r.status,
            base_model=r.base_model_name,
            forget_dataset=r.forget_dataset_id,
            retain_dataset=r.retain_dataset_id,
            method=r.method,
            params=r.params or {},
            metadata=r.meta or {},
            idempotency_key=r.idempotency_key,
            progress=Progress(**dataclasses.asdict(progress)),
            adapter_id=r.adapter_id,
            error=error,
            run_status=r.run_status,
            converged=converged(r.run_status, method=r.method, params=r.params),
            attempts=r.attempts,
            queue_seq=r.queue_seq,
            queue_position=queue_position,
            created_at=r.created_at,
            updated_at=r.updated_at,
            started_at=r.started_at,
            finished_at=r.finished_at,
            cancel_requested_at=r.cancel_requested_at,
            gate=r.gate,
        )


class CancelIn(StrictIn):
    reason: SafeStr | None = Field(default=None, max_length=2000)


class MetricsOut(Schema):
    request_id: str
    status: models.RequestStatus
    before: dict[str, Any] | None = Field(description="forget/retain metrics of the stack before the request")
    after: dict[str, Any] | None = Field(description="… and after its adapter was added")


# --- adapters ---------------------------------------------------------------------------------------------


class AdapterOut(Schema):
    id: str
    base_model: str
    base_model_id: str = Field(
        description="the base model's id: names are per tenant, so the operator's view needs it"
    )
    version: int
    state: models.AdapterState
    request_id: str | None = Field(description="null for a compacted version (see lineage)")
    kind: str = Field(default="request", description="request, or compaction (the active stack as one)")
    lineage: dict[str, Any] | None = None
    method: str
    sha256: str
    size_bytes: int | None
    forget_sha256: str
    retain_sha256: str
    hyperparameters: dict[str, Any]
    parent_stack: list[str]
    trained_on_stale: bool = Field(description="the active adapters below it differ from those it trained on")
    superseded_by: str | None = Field(
        default=None,
        description="the later version that carries its change instead (its compaction or retrain)",
    )
    change_in_effect: bool = Field(
        default=True,
        description="its change is in the effective model: it is active, or a successor of it is",
    )
    created_at: datetime
    state_changed_at: datetime | None
    state_changed_by: str | None
    state_reason: str | None

    @classmethod
    def of(cls, a: models.AdapterVersion, *, stale: bool) -> AdapterOut:
        return cls(
            id=a.id,
            base_model=a.base_model.name,
            base_model_id=a.base_model_id,
            version=a.version,
            state=a.state,
            request_id=a.request_id,
            method=a.method,
            sha256=a.sha256,
            size_bytes=a.size_bytes,
            forget_sha256=a.forget_sha256,
            retain_sha256=a.retain_sha256,
            hyperparameters=a.hyperparameters or {},
            parent_stack=list(a.parent_stack or []),
            trained_on_stale=stale,
            created_at=a.created_at,
            state_changed_at=a.state_changed_at,
            state_changed_by=a.state_changed_by,
            state_reason=a.state_reason,
            kind=a.kind or "request",
            lineage=a.lineage,
            change_in_effect=a.state == models.AdapterState.ACTIVE,  # a successor's: `stack_views`
        )


class DisableIn(StrictIn):
    reason: SafeStr = Field(min_length=1, max_length=2000)
    cascade: bool | Literal["retrain"] = Field(
        default=False,
        description='true: also disable the later adapters trained on top of it; "retrain": re-run their '
        "requests in order on the new stack, each replacing its old version when it succeeds",
    )


class EnableIn(StrictIn):
    reason: SafeStr = Field(min_length=1, max_length=2000)


class OtherTenantAdapterOut(Schema):
    """Another tenant's version on a shared base model: only that it exists, with its version and state."""

    version: int
    state: models.AdapterState
    other_tenant: bool = Field(default=True, description="always true: its details are not yours to see")


class StateChangeOut(Schema):
    adapter: AdapterOut
    changed: bool
    flagged: list[AdapterOut | OtherTenantAdapterOut] = Field(
        description="later adapters now on a different stack than they trained on"
    )
    cascaded: list[str] = Field(description="ids disabled along with it (cascade)")
    retrains: list[dict[str, Any]] = Field(
        default_factory=list,
        description='cascade "retrain": per later version, the queued request_id or why it cannot be '
        "retrained",
    )


# --- audit, keys, health ----------------------------------------------------------------------------------


class AuditEntryOut(Schema):
    id: int
    created_at: datetime
    tenant_id: str | None
    actor: str
    actor_key_id: str | None
    action: str
    subject_type: str
    subject_id: str
    reason: str | None
    data: dict[str, Any]
    prev_hash: str
    hash: str

    @classmethod
    def of(cls, e: models.AuditEntry) -> AuditEntryOut:
        return cls(
            id=e.id,
            created_at=e.created_at,
            tenant_id=e.tenant_id,
            actor=e.actor,
            actor_key_id=e.actor_key_id,
            action=e.action,
            subject_type=e.subject_type,
            subject_id=e.subject_id,
            reason=e.reason,
            data=e.data or {},
            prev_hash=e.prev_hash,
            hash=e.hash,
        )


class ChainOut(Schema):
    intact: bool
    scope: str = Field(description="`chain`: every entry (the operator); `tenant`: your tenant's entries")
    checked: int = Field(description="entries checked (up to and including the first bad one)")
    head_id: int | None = Field(description="the last checked entry that fits")
    head_hash: str
    first_bad_id: int | None = Field(description="the first entry that does not fit (never another tenant's)")
    problem: str | None
    signed_heads_checked: int = Field(
        description="signed heads (kept outside the database) found still in the chain; a missing one means "
        "the newest entries were removed"
    )
    signed_head: dict[str, Any] | None = Field(
        description="the current head, Ed25519-signed and stored by this check (intact chains only)"
    )


class ApiKeyIn(StrictIn):
    name: SafeStr = Field(min_length=1, max_length=100)
    scopes: list[SafeStr] = Field(min_length=1, examples=[["submit", "read"]])
    tenant: SafeStr | None = Field(
        default=None,
        max_length=100,
        description="another tenant's name (created if new); only the default tenant's admins",
    )


class ApiKeyOut(Schema):
    id: str
    name: str
    prefix: str
    scopes: list[str]
    tenant: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @classmethod
    def of(cls, k: models.ApiKey) -> ApiKeyOut:
        return cls(
            id=k.id,
            name=k.name,
            prefix=k.prefix,
            scopes=list(k.scopes),
            tenant=k.tenant.name,
            created_at=k.created_at,
            last_used_at=k.last_used_at,
            revoked_at=k.revoked_at,
        )


class ApiKeyCreated(ApiKeyOut):
    key: str = Field(description="the secret: shown once, stored only as its sha256")


class HealthOut(Schema):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)


# --- stacks: policy, compaction, export (api/routes/stacks.py) --------------------------------------------


class PolicyIn(StrictIn):
    policy: dict[str, Any] | None = Field(default=None, description="rules to change; null leaves them")
    canary_dataset: str | None = Field(default=None, description="a dataset id to measure utility on")
    clear_canary: bool = Field(default=False, description="go back to each request's retain sample")
    reason: SafeStr = Field(min_length=1, max_length=2000)


class RetrainIn(StrictIn):
    reason: SafeStr = Field(min_length=1, max_length=2000)
    forget_dataset: str | None = Field(
        default=None,
        description="the same forget data uploaded again (its sha256 must match), if it was purged",
    )


class CompactIn(StrictIn):
    reason: SafeStr = Field(min_length=1, max_length=2000)
    rank: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="SVD-truncate to this rank (default: exact, rank = sum of ranks)",
    )


class StackOperationOut(Schema):
    id: str
    base_model: str
    base_model_id: str = Field(
        description="the base model's id: names are per tenant, so the operator's view needs it"
    )
    kind: str
    status: str
    params: dict[str, Any]
    result: dict[str, Any] | None
    error: ErrorInfo | None
    reason: str | None
    created_by: str
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def of(cls, op: models.StackOperation) -> StackOperationOut:
        error = ErrorInfo(code=op.error_code, message=op.error_message or "") if op.error_code else None
        params = {k: v for k, v in (op.params or {}).items() if k != "actor_key_id"}
        return cls(
            id=op.id,
            base_model=op.base_model.name,
            base_model_id=op.base_model_id,
            kind=op.kind,
            status=op.status,
            params=params,
            result=op.result,
            error=error,
            reason=op.reason,
            created_by=op.created_by,
            created_at=op.created_at,
            finished_at=op.finished_at,
        )
