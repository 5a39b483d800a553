"""The service's tables: SQLAlchemy 2.0 typed models shared by the API and the workers (no torch here).

Ids are opaque strings with a type prefix (`req_…`, `ad_…`) drawn from 128 random bits, so an id is never
reused, even after a row is gone. Timestamps are timezone-aware UTC on every backend (`UTCDateTime`).

What each table is for:
- `Tenant`, `ApiKey`: who is calling. Keys are stored as sha256 only; scopes are `submit`, `read`, `admin`.
- `Dataset`: an uploaded forget/retain file (validated, content-addressed by sha256, bytes in storage).
- `BaseModel`: a registered base model; `tenant_id` NULL means shared by every tenant. A name is unique among
  what one tenant sees: its own models and the shared ones (a tenant's name says nothing of other tenants').
- `UnlearnRequest`: one deletion request and its whole life (status, progress, lease, metrics, error).
  `queue_seq` numbers the requests of one base model 1, 2, 3… in submission order: the worker runs them in
  that order, one at a time. `lease_owner`/`lease_expires_at`/`heartbeat_at` keep two workers from running
  the same request; `attempts` counts deliveries.
- `TrainingEvent`: one `history.json` record per outer step, unique per (request, step): a run resumed from a
  checkpoint re-publishes the steps after it, so writers upsert (or delete steps > checkpoint first).
- `AdapterVersion`: the registry. Immutable once created except for `state` (active/disabled) and who changed
  it; `version` counts 1, 2, 3… per base model; one adapter per request at most (`request_id` unique);
  `parent_stack` is the ordered list of adapter ids that were active underneath it when it was trained.
- `AuditEntry`: append-only, hash-chained log of every state change (see `persistence/audit.py`).
- `WorkerHeartbeat`: one row per worker process, refreshed while it lives.
"""

from __future__ import annotations

import enum
import secrets
from datetime import UTC, datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Stable constraint names, so migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

GENESIS_HASH = "0" * 64  # prev_hash of the first audit entry


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    """`prefix_` + 32 hex characters (128 random bits): never reused."""
    return f"{prefix}_{secrets.token_hex(16)}"


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores naive UTC; PostgreSQL timestamptz)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use persistence.models.utcnow()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UTCDateTime,
        dict[str, Any]: JSON,
        list[Any]: JSON,
    }


def _str_enum(cls: type[enum.Enum]) -> Enum:
    """Store an enum by value as a short string (no native type, no CHECK: new states need no DDL)."""
    return Enum(
        cls,
        native_enum=False,
        create_constraint=False,
        length=16,
        values_callable=lambda c: [m.value for m in c],
        validate_strings=True,
    )


# --- enums ------------------------------------------------------------------------------------------------


class Scope(enum.StrEnum):
    SUBMIT = "submit"  # upload datasets, submit and cancel requests
    READ = "read"  # read everything of the tenant
    ADMIN = "admin"  # everything, including rollback, base-model registration and key management


class RequestStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    EVALUATING = "evaluating"
    SUCCEEDED = "succeeded"
    REJECTED = "rejected"  # trained, but its base model's policy held the adapter back (policy.py)
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {RequestStatus.SUCCEEDED, RequestStatus.REJECTED, RequestStatus.FAILED, RequestStatus.CANCELLED}
)

# The partial index of unfinished requests (0005_speed) is over exactly this predicate; queries that want it
# filter with `status IN (...)` on the same values (persistence/requests.py UNFINISHED_STATUSES).
UNFINISHED_SQL = "status IN ('queued', 'running', 'evaluating', 'cancelling')"

# Which status may follow which. Terminal states have no successors. RUNNING -> RUNNING is a redelivery
# (a new lease after a crash); the worker's state machine (persistence/jobs.py) enforces this table.
_S = RequestStatus
ALLOWED_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.QUEUED: frozenset({_S.RUNNING, _S.CANCELLED, _S.FAILED}),
    _S.RUNNING: frozenset({_S.RUNNING, _S.EVALUATING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLING, _S.CANCELLED}),
    _S.EVALUATING: frozenset({_S.SUCCEEDED, _S.REJECTED, _S.FAILED, _S.CANCELLING, _S.CANCELLED}),
    _S.CANCELLING: frozenset({_S.CANCELLED, _S.FAILED, _S.SUCCEEDED, _S.REJECTED}),
    _S.SUCCEEDED: frozenset(),
    _S.REJECTED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class AdapterState(enum.StrEnum):
    ACTIVE = "active"
    DISABLED = "disabled"


# --- tables -----------------------------------------------------------------------------------------------


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ten"))
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    prefix: Mapped[str] = mapped_column(String(16))  # the first characters of the secret, to recognise it
    scopes: Mapped[list[Any]] = mapped_column(JSON)  # list of Scope values
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]

    tenant: Mapped[Tenant] = relationship()

    def has_scope(self, scope: Scope | str) -> bool:
        """`admin` implies every scope."""
        return Scope.ADMIN.value in self.scopes or str(scope) in self.scopes


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ds"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(255))  # the uploaded file name
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    rows: Mapped[int] = mapped_column(Integer)
    format: Mapped[str] = mapped_column(String(32))  # layout: json, jsonl, json-lines-of-arrays, txt
    kind: Mapped[str] = mapped_column(String(16))  # qa or text
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    storage_key: Mapped[str] = mapped_column(String(512))
    created_by_key_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Set once the bytes are gone (persistence/retention.py): only sha256, rows and the certificate remain.
    purged_at: Mapped[datetime | None]
    purge_reason: Mapped[str | None] = mapped_column(Text)


class BaseModel(Base):
    __tablename__ = "base_models"
    # Migration 0008: names per tenant. Unique among a tenant's own and among the shared ones; that a private
    # name never equals a shared one is `base_models.register`'s check, under a lock on the name.
    __table_args__ = (
        UniqueConstraint("tenant_id", "name"),
        Index(
            "uq_base_models_shared_name",
            "name",
            unique=True,
            postgresql_where=text("tenant_id IS NULL"),
            sqlite_where=text("tenant_id IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("bm"))
    name: Mapped[str] = mapped_column(String(100))
    source: Mapped[str] = mapped_column(String(1024))  # a local model dir, a storage key, or a hub id
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id"), index=True)  # None: shared
    description: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # How long a forget dataset outlives its request (persistence/retention.py); None: the settings' default.
    forget_retention_success_s: Mapped[int | None] = mapped_column(Integer)
    forget_retention_failure_s: Mapped[int | None] = mapped_column(Integer)
    # The unlearning policy (persistence/policy.py; None: its defaults) and the canary set it is measured on
    # (None: a sample of each request's retain set). Migration 0003_stacks.
    policy: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    canary_dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"))
    revision: Mapped[str | None] = mapped_column(String(255))  # a hub source's pinned revision (0003_stacks)


class UnlearnRequest(Base):
    __tablename__ = "unlearn_requests"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        UniqueConstraint("base_model_id", "queue_seq"),
        Index("ix_unlearn_requests_status_base_model", "status", "base_model_id"),
        # Migration 0005_speed: what keeps lists, the dashboard and /metrics flat as history grows
        # (docs/performance.md): newest-first pages per tenant (all, by status), recent failures, the queue of
        # unfinished requests per base model, and the finish/start windows the /metrics aggregates read.
        Index("ix_unlearn_requests_tenant_created", "tenant_id", "created_at"),
        Index("ix_unlearn_requests_tenant_status_created", "tenant_id", "status", "created_at"),
        Index(
            "ix_unlearn_requests_failed",
            "tenant_id",
            "finished_at",
            postgresql_where=text("status = 'failed'"),
            sqlite_where=text("status = 'failed'"),
        ),
        Index(
            "ix_unlearn_requests_unfinished",
            "base_model_id",
            "queue_seq",
            postgresql_where=text(UNFINISHED_SQL),
            sqlite_where=text(UNFINISHED_SQL),
        ),
        Index("ix_unlearn_requests_finished_at", "finished_at"),
        Index("ix_unlearn_requests_started_at", "started_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("req"))
    # No single-column index on either: the composite ones above lead with them (migration 0007).
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    base_model_id: Mapped[str] = mapped_column(ForeignKey("base_models.id"))
    forget_dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    retain_dataset_id: Mapped[str] = mapped_column(ForeignKey("datasets.id"))
    method: Mapped[str] = mapped_column(String(32))
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)  # overrides of the method's config
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)  # the client's, as given
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_fingerprint: Mapped[str] = mapped_column(String(64))  # sha256 of the submitted body
    queue_seq: Mapped[int] = mapped_column(BigInteger)  # 1, 2, 3… per base model, in submission order

    status: Mapped[RequestStatus] = mapped_column(_str_enum(RequestStatus), default=RequestStatus.QUEUED)
    step: Mapped[int] = mapped_column(Integer, default=0)  # outer steps done
    total_steps: Mapped[int | None] = mapped_column(Integer)  # the step cap (max_steps)
    run_status: Mapped[str | None] = mapped_column(String(16))  # the engine's: converged, max_steps, ...
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)

    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    enqueued_at: Mapped[datetime | None]  # last time a task was published for it (None: not yet / lost)
    # the submitting HTTP call's X-Request-ID, passed on with its task by the relay that publishes it (0006)
    trace_id: Mapped[str | None] = mapped_column(String(64))
    checkpoint_key: Mapped[str | None] = mapped_column(String(512))

    metrics_before: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    metrics_after: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The policy gate's verdict: rules, measured figures, which rule failed, any admin override (0003_stacks).
    gate: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    created_by_key_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]

    base_model: Mapped[BaseModel] = relationship(lazy="selectin")
    forget_dataset: Mapped[Dataset] = relationship(foreign_keys=[forget_dataset_id])
    retain_dataset: Mapped[Dataset] = relationship(foreign_keys=[retain_dataset_id])
    adapter: Mapped[AdapterVersion | None] = relationship(
        back_populates="request", uselist=False, lazy="selectin", viewonly=True
    )

    @property
    def adapter_id(self) -> str | None:
        return self.adapter.id if self.adapter is not None else None

    @property
    def base_model_name(self) -> str:
        return self.base_model.name


class TrainingEvent(Base):
    __tablename__ = "training_events"
    __table_args__ = (UniqueConstraint("request_id", "step"),)

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(ForeignKey("unlearn_requests.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    record: Mapped[dict[str, Any]] = mapped_column(JSON)  # the history.json record as the engine wrote it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class AdapterVersion(Base):
    __tablename__ = "adapter_versions"
    __table_args__ = (UniqueConstraint("base_model_id", "version"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("ad"))
    base_model_id: Mapped[str] = mapped_column(ForeignKey("base_models.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    state: Mapped[AdapterState] = mapped_column(_str_enum(AdapterState), default=AdapterState.ACTIVE)
    # None for a compacted version, which no single request made (its `lineage` says what it contains).
    request_id: Mapped[str | None] = mapped_column(ForeignKey("unlearn_requests.id"), unique=True)
    method: Mapped[str] = mapped_column(String(32))
    sha256: Mapped[str] = mapped_column(String(64))  # of the stored archive
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    storage_key: Mapped[str] = mapped_column(String(512))
    forget_sha256: Mapped[str] = mapped_column(String(64))
    retain_sha256: Mapped[str] = mapped_column(String(64))
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(default=dict)
    parent_stack: Mapped[list[Any]] = mapped_column(default=list)  # adapter ids underneath, in stack order
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    state_changed_at: Mapped[datetime | None]
    state_changed_by: Mapped[str | None] = mapped_column(String(255))  # actor of the last enable/disable
    state_reason: Mapped[str | None] = mapped_column(Text)
    # 0003_stacks: "request" (trained by one request) or "compaction" (the active stack as one adapter);
    # lineage of a compacted version: {"contains": [ids], "versions", "request_ids", "rank", ...}.
    kind: Mapped[str] = mapped_column(String(16), default="request", server_default="request")
    lineage: Mapped[dict[str, Any] | None] = mapped_column(JSON)

    base_model: Mapped[BaseModel] = relationship(lazy="selectin")
    request: Mapped[UnlearnRequest | None] = relationship(back_populates="adapter")


class AuditEntry(Base):
    __tablename__ = "audit_entries"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    tenant_id: Mapped[str | None] = mapped_column(String(40), index=True)  # None: not a tenant's
    actor: Mapped[str] = mapped_column(String(255))  # "key:<id>", "worker:<name>", "system"
    actor_key_id: Mapped[str | None] = mapped_column(String(40))
    action: Mapped[str] = mapped_column(String(64), index=True)  # e.g. "adapter.disable"
    subject_type: Mapped[str] = mapped_column(String(32))  # e.g. "adapter"
    subject_id: Mapped[str] = mapped_column(String(255), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)
    prev_hash: Mapped[str] = mapped_column(String(64), unique=True)  # unique: the chain cannot fork
    hash: Mapped[str] = mapped_column(String(64), unique=True)


class WorkerHeartbeat(Base):
    __tablename__ = "worker_heartbeats"

    worker_name: Mapped[str] = mapped_column(String(255), primary_key=True)  # Celery hostname, e.g. gpu0@host
    queues: Mapped[list[Any]] = mapped_column(default=list)
    hostname: Mapped[str | None] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    current_request_id: Mapped[str | None] = mapped_column(String(40))
    info: Mapped[dict[str, Any]] = mapped_column(default=dict)  # device, GPU memory, versions
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen: Mapped[datetime] = mapped_column(default=utcnow)
    alive: Mapped[bool] = mapped_column(Boolean, default=True)  # False after a clean shutdown


# --- trust and compliance (migration 0002_trust) ------------------------------------------------------------


class Certificate(Base):
    """A deletion certificate as issued: the exact signed JSON text, never rewritten (triggers refuse it)."""

    __tablename__ = "certificates"

    request_id: Mapped[str] = mapped_column(ForeignKey("unlearn_requests.id"), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(40), index=True)
    key_id: Mapped[str] = mapped_column(String(32))
    sha256: Mapped[str] = mapped_column(String(64))  # of `document`
    document: Mapped[str] = mapped_column(Text)  # canonical JSON of the signed certificate
    issued_at: Mapped[datetime] = mapped_column(default=utcnow)


class SigningKey(Base):
    """A published Ed25519 public key; rows are never removed, so old certificates stay verifiable."""

    __tablename__ = "signing_keys"

    key_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    algorithm: Mapped[str] = mapped_column(String(16))
    public_key: Mapped[str] = mapped_column(String(128))  # base64 of the raw 32-byte key
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    retired_at: Mapped[datetime | None]


class DashboardSession(Base):
    """A signed-in dashboard browser: the cookie holds a random secret, the row only its sha256."""

    __tablename__ = "dashboard_sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # sha256 hex of the cookie's secret
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    csrf_token: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    last_seen_at: Mapped[datetime | None]


class WebhookEndpoint(Base):
    """A tenant's webhook: HMAC-SHA256-signed JSON POSTs on request and adapter state changes."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("wh"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    url: Mapped[str] = mapped_column(String(2048))
    secret: Mapped[str] = mapped_column(String(128))  # the HMAC key (the receiver holds it too)
    events: Mapped[list[Any]] = mapped_column(default=list)  # empty: every event
    allow_loopback: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    disabled_at: Mapped[datetime | None]


class WebhookDelivery(Base):
    """One event for one endpoint and what became of it (the delivery log)."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("whd"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id"), index=True)
    tenant_id: Mapped[str] = mapped_column(String(40), index=True)
    event: Mapped[str] = mapped_column(String(64))
    payload: Mapped[str] = mapped_column(Text)  # the exact JSON body sent (and signed)
    status: Mapped[str] = mapped_column(String(16), default="pending")  # pending, delivered, failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None]


# --- stacks (migration 0003_stacks) ---------------------------------------------------------------------


class StackOperation(Base):
    """One asynchronous operation on a base model's adapter stack (compaction), run by a worker."""

    __tablename__ = "stack_operations"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("op"))
    base_model_id: Mapped[str] = mapped_column(ForeignKey("base_models.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # compact
    status: Mapped[str] = mapped_column(String(16), default="queued")  # queued, running, succeeded, failed
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(255))
    tenant_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]

    base_model: Mapped[BaseModel] = relationship(lazy="selectin")
