"""Unlearn requests: validated creation with idempotency, reads, cancellation, and the worker's view of one.

Everything a request refers to is checked before it is stored: the method exists, every parameter is a known
config field of that method and in range (`contracts.params`, no torch), the base model is registered
and visible to the tenant, both datasets exist and belong to the tenant. A failure raises `Invalid` naming the
field and stores nothing.

An `Idempotency-Key` makes a retry return the original request: the same key with the same body gives the same
request (`created` False); the same key with a different body is a Conflict. Requests of one base model get
`queue_seq` 1, 2, 3… in submission order under a row lock on the base model.

Status changes made here are the client's: cancel (`queued -> cancelled` at once, `running`/`evaluating` ->
`cancelling`, which the worker turns into `cancelled` at its next step). Terminal states never change.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    BindParameter,
    Select,
    Table,
    bindparam,
    case,
    func,
    literal_column,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, aliased

from blade_service.contracts.errors import ParamError
from blade_service.contracts.methods import METHOD_NAMES, PRESETS, MethodConfig, service_preset
from blade_service.contracts.methods.baselines import BaselineConfig
from blade_service.contracts.params import make_config, validate_params
from blade_service.contracts.schedule import schedule
from blade_service.persistence import audit
from blade_service.persistence.db import execute_read
from blade_service.persistence.errors import Conflict, Invalid, NotFound
from blade_service.persistence.jsonlog import trace_id_var
from blade_service.persistence.models import (
    TERMINAL_STATUSES,
    AdapterVersion,
    BaseModel,
    Dataset,
    RequestStatus,
    TrainingEvent,
    UnlearnRequest,
    new_id,
    utcnow,
)

DEFAULT_METHOD = "blade"
MAX_METADATA_BYTES = 16 * 1024
# BLADE's outer-step cap when a request sets no `max_steps`: MethodConfig's default (250, BLADE paper, TOFU
# preset; the worker runs without a preset; tests/test_api_requests.py checks it against the engine's config).
# A baseline's step count follows from its schedule and the forget set, so the worker reports it once it runs.
DEFAULT_MAX_STEPS: int = cast(int, next(f.default for f in fields(MethodConfig) if f.name == "max_steps"))
RATE_WINDOW = 20  # the latest steps the ETA's step rate is measured over
# The presets a request may name (`preset`): the methods' own (contracts/methods: BLADE's from the paper's
# table, the baselines' 'lora'). Step caps that differ from the default:
REQUEST_PRESETS: dict[str, tuple[str, ...]] = {name: tuple(PRESETS[name]) for name in METHOD_NAMES}
PRESET_MAX_STEPS: dict[str, int] = {
    name: values["max_steps"]
    for name, values in PRESETS["blade"].items()
    if values.get("max_steps", DEFAULT_MAX_STEPS) != DEFAULT_MAX_STEPS
}
# QA probe sets a text request may name (`probe_datasets`) for its KnowMem metrics (MUSE's knowmem files).
PROBE_KINDS = ("forget_qa", "retain_qa", "icl")
# A request's `preset` and `probe_datasets` are kept in its params under these keys (no schema change);
# the worker takes them out before the params become config overrides.
SERVICE_KEYS = ("preset", "probe_datasets")


def fingerprint(body: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()
    ).hexdigest()


def _by_idempotency_key(session: Session, tenant_id: str, key: str) -> UnlearnRequest | None:
    query = select(UnlearnRequest).where(
        UnlearnRequest.tenant_id == tenant_id, UnlearnRequest.idempotency_key == key
    )
    return session.scalars(query).one_or_none()


def _replay(existing: UnlearnRequest, fp: str) -> UnlearnRequest:
    if existing.request_fingerprint != fp:
        raise Conflict(
            "Idempotency-Key was already used with a different request body",
            code="idempotency_key_reused",
            field="Idempotency-Key",
        )
    return existing


def _lock_datasets(session: Session, ids: list[Any]) -> dict[str, Dataset]:
    """The datasets among `ids`, read FOR SHARE in one statement (see `_dataset`)."""
    wanted = [i for i in ids if isinstance(i, str) and i]
    found = session.scalars(
        select(Dataset)
        .where(Dataset.id.in_(wanted))
        .with_for_update(read=True)
        .execution_options(populate_existing=True)
    )
    return {d.id: d for d in found}


def _dataset(
    session: Session,
    tenant_id: str,
    dataset_id: Any,
    field: str,
    locked: dict[str, Dataset] | dict[str, DatasetRow] | None = None,
) -> Dataset | DatasetRow:
    """The tenant's usable dataset `dataset_id` (from `locked` when `_lock_datasets` read it already)."""
    if not isinstance(dataset_id, str) or not dataset_id:
        raise Invalid(f"{field}: must be a dataset id", field=field)
    # FOR SHARE: a concurrent DELETE /datasets/{id} or purge (FOR UPDATE) either finishes first and is seen
    # here, or waits for this request to commit and then sees it as a user of the dataset.
    dataset: Dataset | DatasetRow | None
    if locked is not None:
        dataset = locked.get(dataset_id)
    else:
        dataset = session.get(Dataset, dataset_id, with_for_update={"read": True}, populate_existing=True)
    if dataset is None or dataset.tenant_id != tenant_id:
        raise Invalid(f"{field}: no dataset {dataset_id!r}", code="unknown_dataset", field=field)
    if dataset.purged_at is not None:
        raise Conflict(
            f"{field}: dataset {dataset_id} was purged ({dataset.purge_reason}); upload the data again",
            code="dataset_purged",
            field=field,
        )
    return dataset


def create_request(session: Session, **kwargs: Any) -> tuple[UnlearnRequest, bool]:
    """(request, created): a new `queued` request as an entity of `session` (read back: one statement more
    than `submit_request`), or the original one for a repeated Idempotency-Key (the arguments of
    `submit_request`)."""
    request, created, _ = submit_request(session, **kwargs)
    if isinstance(request, UnlearnRequest):
        return request, created
    return session.get_one(UnlearnRequest, request.id), created


@dataclass(frozen=True, slots=True)
class DatasetRow:
    """A dataset as a submission reads it (`_claim`): `_dataset`'s checks, the audit entry, the step cap."""

    id: str
    tenant_id: str
    purged_at: datetime | None
    purge_reason: str | None
    sha256: str
    rows: int


_DATASET_COLUMNS = tuple(f.name for f in fields(DatasetRow))


@dataclass(frozen=True, slots=True)
class ModelRow:
    """The base model as a submission uses it: its id for the INSERT, its name for the entry and response."""

    id: str
    name: str


@dataclass(frozen=True)
class _Claim:
    """What `_claim` read and locked for a submission."""

    model: ModelRow
    datasets: dict[str, DatasetRow]
    existing_id: str | None  # the request already stored under the Idempotency-Key
    chain_locked: bool  # the statement also took the audit chain's append lock (PostgreSQL)


@functools.cache
def _claim_query(dialect: str) -> Select[Any]:
    """Built once per dialect (see `_claim`): composing it costs more CPU than running it. Plain columns,
    not entities: the model's id, name and tenant, each dataset's `_DATASET_COLUMNS` (prefixed `forget_`
    and `retain_`) and the id stored under the Idempotency-Key."""
    forget, retain = aliased(Dataset, name="forget"), aliased(Dataset, name="retain")
    tenant_id: BindParameter[str] = bindparam("tenant_id")
    existing = (
        select(UnlearnRequest.id)
        .where(UnlearnRequest.tenant_id == tenant_id, UnlearnRequest.idempotency_key == bindparam("key"))
        .scalar_subquery()
    )
    claim = (
        select(
            BaseModel.id,
            BaseModel.name,
            BaseModel.tenant_id,
            *(
                getattr(d, c).label(f"{d_name}_{c}")
                for d_name, d in (("forget", forget), ("retain", retain))
                for c in _DATASET_COLUMNS
            ),
            existing.label("existing_id"),
        )
        .select_from(BaseModel)
        .join(forget, forget.id == bindparam("forget_id"))
        .join(retain, retain.id == bindparam("retain_id"))
        .where(
            BaseModel.name == bindparam("name"),
            BaseModel.tenant_id.is_(None) | (BaseModel.tenant_id == tenant_id),
        )
        .with_for_update(key_share=True, of=BaseModel)
        .suffix_with("FOR SHARE OF forget, retain", dialect="postgresql")  # one statement, two lock modes
    )
    if dialect != "postgresql":
        return claim
    # The audit chain's append lock, in the order every writer takes the two: the base model's row, then the
    # chain. PostgreSQL computes a locking query's select list before it locks the rows, so the chain's lock
    # is taken by an outer query.
    rows = claim.subquery("claim")
    return select(*rows.c, audit.CHAIN_LOCK.label("chain_lock"))


def _claim(
    session: Session, tenant_id: str, base_model: str, dataset_ids: list[Any], idempotency_key: str | None
) -> _Claim | None:
    """One statement for what a submission reads before it writes: the base model, locked FOR NO KEY UPDATE
    (queue numbering in submission order), both datasets FOR SHARE (see `_dataset`), the id stored under
    the Idempotency-Key and, on PostgreSQL, the audit chain's append lock (the entry is appended by the
    INSERT: `_insert_queued`). None when the base model or a dataset is missing: the step-by-step checks
    name it."""
    if not all(isinstance(i, str) and i for i in dataset_ids):
        return None
    params = {
        "tenant_id": tenant_id,
        "name": base_model,
        "forget_id": dataset_ids[0],
        "retain_id": dataset_ids[1],
        "key": idempotency_key,
    }
    dialect = session.get_bind().dialect.name
    # A Core statement runs on the session's connection: the ORM's execute path around it cost about 0.2 ms
    # of CPU per statement here and adds nothing to plain rows (docs/performance.md).
    row = session.connection().execute(_claim_query(dialect), params).one_or_none()
    if row is None:
        return None
    n = len(_DATASET_COLUMNS)
    forget, retain = DatasetRow(*row[3 : 3 + n]), DatasetRow(*row[3 + n : 3 + 2 * n])
    datasets = {forget.id: forget, retain.id: retain}
    return _Claim(ModelRow(row[0], row[1]), datasets, row[3 + 2 * n], dialect == "postgresql")


def _locked_base_model(session: Session, tenant_id: str, base_model: str) -> BaseModel:
    """The base model visible to the tenant, locked FOR NO KEY UPDATE (serialises queue_seq numbering)."""
    model = session.scalars(
        select(BaseModel)
        .where(
            BaseModel.name == base_model, (BaseModel.tenant_id.is_(None)) | (BaseModel.tenant_id == tenant_id)
        )
        .with_for_update(key_share=True)
    ).one_or_none()
    if model is None:
        raise Invalid(
            f"base_model: no base model {base_model!r} is registered",
            code="unknown_base_model",
            field="base_model",
        )
    return model


# NOTIFY channel of a committed submission: it wakes the submission relays (worker/submission_relay.py).
SUBMITTED_CHANNEL = "blade_request_submitted"


def _next_queue_seq(table: Table, model_id: BindParameter[str]) -> Any:
    """The base model's last `queue_seq` + 1 (read under its row lock: `_claim`). The newest row's number, not
    max(): PostgreSQL reads it from the end of the (base_model_id, queue_seq) index whatever its statistics
    say, where max() over a table not analysed yet (a new deployment, a bulk load) read every request of
    the base model."""
    last = (
        select(table.c.queue_seq)
        .where(table.c.base_model_id == model_id)
        .order_by(table.c.queue_seq.desc())
        .limit(1)
        .scalar_subquery()
    )
    return func.coalesce(last, 0) + 1


def _ahead(table: Table, model_id: BindParameter[str]) -> Any:
    """A column `ahead`: the base model's unfinished requests other than the new one (all ahead of it)."""
    other = table.alias("other")
    return (
        select(func.count())
        .select_from(other)
        .where(
            other.c.base_model_id == model_id, unfinished(other.c.status), other.c.id != bindparam("new_id")
        )
        .scalar_subquery()
        .label("ahead")
    )


# The attributes a submission sets on the new request (`submit_request`); the others take their defaults.
_SUBMITTED = (
    "tenant_id",
    "base_model_id",
    "forget_dataset_id",
    "retain_dataset_id",
    "method",
    "params",
    "meta",
    "idempotency_key",
    "request_fingerprint",
    "status",
    "total_steps",
    "created_by_key_id",
    "trace_id",
)

# What a new request's INSERT binds besides `_SUBMITTED`: its id and the columns whose model default is not
# NULL (`_new_row`). The database numbers `queue_seq`; every other column starts NULL.
_DEFAULTED = ("id", "step", "attempts", "created_at", "updated_at")
_BOUND = (*_SUBMITTED, *_DEFAULTED)


@functools.cache
def _row_keys() -> tuple[str, ...]:
    """Every column attribute of a request but `queue_seq` (read from the mapper once, not per POST)."""
    return tuple(a.key for a in UnlearnRequest.__mapper__.column_attrs if a.key != "queue_seq")


def _new_row(request_id: str, submitted: dict[str, Any]) -> dict[str, Any]:
    """The new request's columns by attribute name, but `queue_seq`: what was submitted, the model's
    defaults for the counters and timestamps, None for the rest. The INSERT writes the same, so the view
    built from them (`RequestView.inserted`) is the row, and nothing needs reading back."""
    now = utcnow()
    row: dict[str, Any] = dict.fromkeys(_row_keys())
    row |= {"id": request_id, "step": 0, "attempts": 0, "created_at": now, "updated_at": now}
    return row | submitted


def _insert(dialect: str) -> Any:
    """A Core INSERT of a new request (`_SUBMITTED` and `_DEFAULTED`, bound as `row_<attribute>`) numbered
    after the base model's last request; nothing when the tenant's Idempotency-Key is taken."""
    table = cast(Table, UnlearnRequest.__table__)  # a mapped class's table (typed as any FromClause)
    columns = UnlearnRequest.__mapper__.column_attrs
    values: dict[Any, Any] = {columns[key].columns[0]: bindparam(f"row_{key}") for key in _BOUND}
    values[table.c.queue_seq] = _next_queue_seq(table, bindparam("seq_base_model_id"))
    inserts: dict[str, Callable[[Table], postgresql.Insert | sqlite.Insert]] = {
        "postgresql": postgresql.insert,
        "sqlite": sqlite.insert,
    }
    return (
        inserts[dialect](table)
        .values(values)
        .on_conflict_do_nothing(index_elements=["tenant_id", "idempotency_key"])
    )


@functools.cache
def _insert_statement(dialect: str) -> Any:
    """Built once per dialect (see `_insert_queued`): `_insert` RETURNING only what the database decides,
    the number and `ahead`, and on PostgreSQL the relays' wake-up call (delivered on commit)."""
    table = cast(Table, UnlearnRequest.__table__)
    returned: list[Any] = [table.c.queue_seq, _ahead(table, bindparam("seq_base_model_id"))]
    if dialect == "postgresql":
        returned.append(func.pg_notify(SUBMITTED_CHANNEL, ""))
    return _insert(dialect).returning(*returned)


@functools.cache
def _insert_with_entry_statement() -> Any:
    """PostgreSQL, built once: `_insert_statement` with the INSERT as a CTE and the request's audit entry
    appended from its row in the same statement (`audit.spliced_append`, the queue number spliced into the
    entry). The transaction holds the chain's append lock since `_claim`."""
    table = cast(Table, UnlearnRequest.__table__)
    inserted = _insert("postgresql").returning(table.c.queue_seq).cte("inserted")
    entry = audit.spliced_append(inserted, inserted.c.queue_seq).cte("entry")
    ahead = _ahead(table, bindparam("seq_base_model_id"))
    return select(inserted.c.queue_seq, ahead, func.pg_notify(SUBMITTED_CHANNEL, "")).add_cte(entry)


def _insert_queued(
    session: Session, request_id: str, values: dict[str, Any], entry: dict[str, Any] | None
) -> tuple[dict[str, Any], int] | None:
    """INSERT the request (`values` by attribute name) numbered after the last of its base model (under the
    base model's lock); returns its row (`_new_row` and `queue_seq`) with its queue position, or None when a
    concurrent request took its Idempotency-Key first. One statement: the number, the position (the unfinished
    requests of the base model, all ahead of it), on PostgreSQL the notice that wakes the submission relays
    (`SUBMITTED_CHANNEL`) and, given `entry` (`audit.spliced_params`), the request's audit entry."""
    # Only `_SUBMITTED` is bound: a value outside it would reach the returned row but not the stored one.
    assert values.keys() == set(_SUBMITTED), sorted(values.keys() ^ set(_SUBMITTED))
    row = _new_row(request_id, values)
    params = {f"row_{key}": row[key] for key in _BOUND}
    params |= {"new_id": request_id, "seq_base_model_id": values["base_model_id"]}
    if entry is not None:
        statement = _insert_with_entry_statement()
        params |= entry
    else:
        statement = _insert_statement(session.get_bind().dialect.name)
    numbered = session.connection().execute(statement, params).first()
    if numbered is None:
        return None
    return row | {"queue_seq": numbered[0]}, numbered[1]


def submit_request(
    session: Session,
    *,
    tenant_id: str,
    base_model: str,
    forget_dataset: str,
    retain_dataset: str,
    method: str | None = None,
    params: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    idempotency_key: str | None = None,
    actor: str,
    actor_key_id: str | None = None,
    preset: str | None = None,
    probe_datasets: dict[str, str] | None = None,
) -> tuple[RequestLike, bool, int | None]:
    """(request, created, queue_position): a new request as a `RequestView` of the row just stored (no entity
    is built for it: `create_request` reads one back), or the original entity for a repeated Idempotency-Key;
    and the new request's queue position (None for a replay). Nothing is published here: once the request
    heads its base model's queue, a worker process's submission relay publishes its task
    (`worker/submission_relay.py`, woken by the notice this commit sends on PostgreSQL), or the worker that
    finishes the one before it does (`jobs.next_in_line`).

    Two statements on PostgreSQL when everything exists (tests/test_api_speed.py counts them): `_claim`,
    which also takes the audit chain's lock, and `_insert_queued`, which also appends the audit entry. On
    SQLite the entry is appended by `audit.append` after the INSERT."""
    method = method or DEFAULT_METHOD
    body = {
        "base_model": base_model,
        "forget_dataset": forget_dataset,
        "retain_dataset": retain_dataset,
        "method": method,
        "params": params or {},
        "metadata": metadata or {},
    }
    if preset is not None:  # only when given, so earlier requests' fingerprints stay the same
        body["preset"] = preset
    if probe_datasets:
        body["probe_datasets"] = probe_datasets
    fp = fingerprint(body)
    if idempotency_key is not None and not 0 < len(idempotency_key) <= 255:
        raise Invalid("Idempotency-Key: must be 1-255 characters", field="Idempotency-Key")
    claim = _claim(session, tenant_id, base_model, [forget_dataset, retain_dataset], idempotency_key)
    if claim is not None:
        existing = session.get(UnlearnRequest, claim.existing_id) if claim.existing_id else None
    else:
        existing = _by_idempotency_key(session, tenant_id, idempotency_key) if idempotency_key else None
    if existing is not None:  # a replay is answered before anything in its body is checked again
        return _replay(existing, fp), False, None

    if method not in METHOD_NAMES:
        raise Invalid(
            f"method: unknown method {method!r}; choose one of {', '.join(METHOD_NAMES)}",
            code="unknown_method",
            field="method",
        )
    try:
        checked = validate_params(method, params)
    except ParamError as exc:  # every field at fault, the first as `field`
        raise Invalid(exc.describe("params."), code="invalid_param", field=f"params.{exc.field}") from None
    if checked.get("use_lora") is False:  # every result is an adapter version: it must stack and roll back
        raise Invalid(
            "params.use_lora: the service stores every result as a LoRA adapter; use_lora=false "
            "(full-parameter, as the baselines were published) runs only in `blade unlearn` and the bench",
            code="invalid_param",
            field="params.use_lora",
        )
    if metadata is not None and not isinstance(metadata, dict):
        raise Invalid("metadata: must be an object", field="metadata")
    if len(json.dumps(metadata or {}, default=str)) > MAX_METADATA_BYTES:
        raise Invalid(f"metadata: at most {MAX_METADATA_BYTES} bytes of JSON", field="metadata")
    locked: dict[str, DatasetRow] | dict[str, Dataset]
    if claim is not None:
        model, locked = claim.model, claim.datasets
    else:
        entity = _locked_base_model(session, tenant_id, base_model)
        model = ModelRow(entity.id, entity.name)
        locked = _lock_datasets(session, [forget_dataset, retain_dataset])
    forget = _dataset(session, tenant_id, forget_dataset, "forget_dataset", locked)
    retain = _dataset(session, tenant_id, retain_dataset, "retain_dataset", locked)
    if forget.id == retain.id:
        raise Invalid("retain_dataset: must differ from forget_dataset", field="retain_dataset")
    checked = _with_service_keys(session, tenant_id, method, checked, preset, probe_datasets)

    request_id = new_id("req")
    entry: dict[str, Any] = {
        "action": "unlearn_request.create",
        "subject_type": "unlearn_request",
        "subject_id": request_id,
        "actor": actor,
        "actor_key_id": actor_key_id,
        "tenant_id": tenant_id,
    }
    data: dict[str, Any] = {
        "base_model": model.name,
        "method": method,
        "params": checked,
        "forget_sha256": forget.sha256,
        "retain_sha256": retain.sha256,
    }
    chain_locked = claim is not None and claim.chain_locked
    spliced = audit.spliced_params(**entry, data=data, slot="queue_seq") if chain_locked else None
    inserted = _insert_queued(
        session,
        request_id,
        {
            "tenant_id": tenant_id,
            "base_model_id": model.id,
            "forget_dataset_id": forget.id,
            "retain_dataset_id": retain.id,
            "method": method,
            "params": checked,
            "meta": metadata or {},
            "idempotency_key": idempotency_key,
            "request_fingerprint": fp,
            "status": RequestStatus.QUEUED,
            "total_steps": step_cap(method, checked, n_forget=forget.rows),
            "created_by_key_id": actor_key_id,
            "trace_id": (trace_id_var.get() or "").replace("\x00", "")[:64] or None,
        },
        spliced,
    )
    if inserted is None:  # a concurrent request with the same Idempotency-Key committed first
        existing = _by_idempotency_key(session, tenant_id, idempotency_key) if idempotency_key else None
        if existing is None:
            raise Conflict("the request conflicts with a concurrent one; retry", code="conflict")
        return _replay(existing, fp), False, None
    row, ahead = inserted
    if spliced is None:  # SQLite, or an entry the INSERT could not append (`audit.spliced_params`)
        data["queue_seq"] = row["queue_seq"]
        audit.append(session, **entry, data=data, chain_locked=chain_locked)
    return RequestView.inserted(row, base_model_name=model.name), True, ahead


def get_request(session: Session, *, tenant_id: str | None, request_id: str) -> UnlearnRequest:
    """The tenant's request (`tenant_id` None: any tenant's); NotFound otherwise."""
    request = session.get(UnlearnRequest, request_id)
    if request is None or (tenant_id is not None and request.tenant_id != tenant_id):
        raise NotFound(f"no unlearn request {request_id!r}")
    return request


UNFINISHED_STATUSES = tuple(s for s in RequestStatus if s not in TERMINAL_STATUSES)


def unfinished(status: Any) -> Any:
    """`status IN (unfinished states)` with the values inline (not bound), so PostgreSQL's planner can match
    the partial index ix_unlearn_requests_unfinished (models.UNFINISHED_SQL) even in a generic plan."""
    return status.in_([literal_column(f"'{s.value}'") for s in UNFINISHED_STATUSES])


def _queue_position_column() -> Any:
    """A column: unfinished requests of the same base model ahead of a queued one (NULL when not queued)."""
    other = aliased(UnlearnRequest)
    ahead = (
        select(func.count())
        .select_from(other)
        .where(
            other.base_model_id == UnlearnRequest.base_model_id,
            other.queue_seq < UnlearnRequest.queue_seq,
            unfinished(other.status),
        )
        .correlate(UnlearnRequest)
        .scalar_subquery()
    )
    return case((UnlearnRequest.status == RequestStatus.QUEUED, ahead), else_=None)


@dataclass(frozen=True, slots=True)
class RequestView:
    """A request as the status poll shows it, read as one row of plain columns: no ORM objects for it, its
    base model and its adapter (a third of the CPU). Attributes are named as on `UnlearnRequest`, so
    `progress` and the response schema read either."""

    id: str
    tenant_id: str
    status: RequestStatus
    base_model_name: str
    adapter_id: str | None
    forget_dataset_id: str
    retain_dataset_id: str
    method: str
    params: dict[str, Any]
    meta: dict[str, Any]
    idempotency_key: str | None
    step: int
    total_steps: int | None
    run_status: str | None
    error_code: str | None
    error_message: str | None
    attempts: int
    queue_seq: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    gate: dict[str, Any] | None

    @classmethod
    def inserted(cls, row: dict[str, Any], *, base_model_name: str) -> RequestView:
        """A request just stored, from the values its INSERT bound and its number (`_insert_queued`):
        no adapter yet."""
        own = {name: row[name] for name in _VIEW_COLUMNS}
        return cls(**own, base_model_name=base_model_name, adapter_id=None)


# The fields of `RequestView` that are the request's own columns (named as on `UnlearnRequest`).
_VIEW_COLUMNS = tuple(f.name for f in fields(RequestView) if f.name not in ("base_model_name", "adapter_id"))

# A request as `progress` and the response schema read it: the mapped row, or the status poll's view.
RequestLike = UnlearnRequest | RequestView


@functools.cache
def _view_query() -> Select[Any]:
    """Built once: composing it (an aliased subquery, two joins) costs more CPU than running it. The columns
    in `RequestView`'s order, then the queue position."""
    columns = {name: getattr(UnlearnRequest, name) for name in _VIEW_COLUMNS}
    columns |= {"base_model_name": BaseModel.name, "adapter_id": AdapterVersion.id}
    return (
        select(*(columns[f.name] for f in dataclasses.fields(RequestView)), _queue_position_column())
        .join(BaseModel, BaseModel.id == UnlearnRequest.base_model_id)
        .outerjoin(AdapterVersion, AdapterVersion.request_id == UnlearnRequest.id)
        .where(UnlearnRequest.id == bindparam("request_id"))
    )


def get_request_view(
    session: Session, *, tenant_id: str | None, request_id: str
) -> tuple[RequestView, int | None]:
    """(request, queue_position) in one statement, with the base model's name and the adapter's id the
    response shows; NotFound as `get_request`."""
    row = execute_read(session, _view_query(), {"request_id": request_id}, columns=True).one_or_none()
    if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
        raise NotFound(f"no unlearn request {request_id!r}")
    return RequestView(*row[:-1]), row[-1]


def list_requests(
    session: Session,
    *,
    tenant_id: str | None,
    status: RequestStatus | None = None,
    base_model: str | None = None,
    limit: int = 100,
    offset: int = 0,
    after: tuple[datetime, str] | None = None,
) -> list[UnlearnRequest]:
    """Newest first; `after` (created_at, id) of the last request of the previous page starts after it."""
    query = select(UnlearnRequest).order_by(UnlearnRequest.created_at.desc(), UnlearnRequest.id)
    if after is not None:
        created, rid = after
        query = query.where(
            UnlearnRequest.created_at <= created,  # a range the (tenant_id, created_at) index seeks to
            (UnlearnRequest.created_at < created) | (UnlearnRequest.id > rid),
        )
    if tenant_id is not None:
        query = query.where(UnlearnRequest.tenant_id == tenant_id)
    if status is not None:
        query = query.where(UnlearnRequest.status == status)
    if base_model is not None:
        query = query.join(BaseModel, UnlearnRequest.base_model_id == BaseModel.id).where(
            BaseModel.name == base_model
        )
    return list(session.scalars(query.limit(limit).offset(offset)))


def queue_position(session: Session, *, request: UnlearnRequest) -> int | None:
    """How many unfinished requests of the same base model are ahead of a queued one (None once it left)."""
    if request.status != RequestStatus.QUEUED:
        return None
    return session.scalar(
        select(func.count())
        .select_from(UnlearnRequest)
        .where(
            UnlearnRequest.base_model_id == request.base_model_id,
            UnlearnRequest.queue_seq < request.queue_seq,
            unfinished(UnlearnRequest.status),
        )
    )


def queue_positions(session: Session, *, requests: list[UnlearnRequest]) -> dict[str, int]:
    """`queue_position` of each queued request in `requests`, one query per base model among them."""
    queued = [r for r in requests if r.status == RequestStatus.QUEUED]
    ahead: dict[str, list[int]] = {}
    for model_id in {r.base_model_id for r in queued}:
        ahead[model_id] = sorted(
            session.scalars(
                select(UnlearnRequest.queue_seq).where(
                    UnlearnRequest.base_model_id == model_id, unfinished(UnlearnRequest.status)
                )
            )
        )
    return {r.id: bisect.bisect_left(ahead[r.base_model_id], r.queue_seq) for r in queued}


# --- progress -----------------------------------------------------------------------------------------------


def step_cap(method: str, params: dict[str, Any] | None, *, n_forget: int | None = None) -> int | None:
    """The run's outer-step cap as known before it runs: the request's `max_steps`, else its preset's or
    BLADE's default; for a baseline, its published schedule over the `n_forget` forget rows in the preset the
    service trains it with (`contracts.schedule`, what the worker runs); None when `n_forget` is unknown."""
    given = (params or {}).get("max_steps")
    if given:
        return int(given)
    if method == DEFAULT_METHOD:
        return PRESET_MAX_STEPS.get(str((params or {}).get("preset")), DEFAULT_MAX_STEPS)
    if not n_forget:
        return None
    overrides = {k: v for k, v in (params or {}).items() if k not in SERVICE_KEYS}
    preset = (params or {}).get("preset") or service_preset(method)
    config = make_config(method, preset=preset, overrides=overrides)
    return schedule(cast(BaselineConfig, config), n_forget).total_steps


def _with_service_keys(
    session: Session,
    tenant_id: str,
    method: str,
    params: dict[str, Any],
    preset: str | None,
    probe_datasets: dict[str, str] | None,
) -> dict[str, Any]:
    """`params` plus the validated `preset` and `probe_datasets` (see SERVICE_KEYS)."""
    out = dict(params)
    if preset is not None:
        if preset not in REQUEST_PRESETS[method]:
            raise Invalid(
                f"preset: unknown preset {preset!r} for method {method!r}; choose one of "
                f"{', '.join(REQUEST_PRESETS[method])}",
                code="unknown_preset",
                field="preset",
            )
        out["preset"] = preset
    if probe_datasets:
        if not isinstance(probe_datasets, dict):
            raise Invalid(
                "probe_datasets: must be an object of probe set -> dataset id", field="probe_datasets"
            )
        probes = {}
        for kind, dataset_id in probe_datasets.items():
            field = f"probe_datasets.{kind}"
            if kind not in PROBE_KINDS:
                raise Invalid(f"{field}: unknown probe set; use {', '.join(PROBE_KINDS)}", field=field)
            probes[kind] = _dataset(session, tenant_id, dataset_id, field).id
        out["probe_datasets"] = probes
    return out


@dataclass(frozen=True)
class Progress:
    step: int
    total_steps: int | None
    fraction: float | None
    steps_per_s: float | None  # observed over the latest RATE_WINDOW steps while running
    eta_seconds: float | None  # to the step cap at that rate (BLADE's convergence stop may end it sooner)
    eta: datetime | None


def progress_so_far(request: RequestLike) -> Progress:
    """Step, total (the cap) and fraction, without the rate."""
    total = request.total_steps or step_cap(request.method, request.params)
    fraction = min(1.0, request.step / total) if total else None
    if request.status == RequestStatus.SUCCEEDED:
        fraction = 1.0
    return Progress(request.step, total, fraction, None, None, None)


def progress(session: Session, *, request: RequestLike) -> Progress:
    """`progress_so_far` plus, while it runs, the step rate and the ETA, measured from the times the latest
    steps were recorded."""
    so_far = progress_so_far(request)
    if request.status != RequestStatus.RUNNING:
        return so_far
    latest = session.execute(
        select(TrainingEvent.step, TrainingEvent.created_at)
        .where(TrainingEvent.request_id == request.id)
        .order_by(TrainingEvent.step.desc())
        .limit(RATE_WINDOW)
    ).all()
    if len(latest) < 2:
        return so_far
    (last_step, last_at), (first_step, first_at) = latest[0], latest[-1]
    elapsed = (last_at - first_at).total_seconds()
    if elapsed <= 0 or last_step <= first_step or not so_far.total_steps:
        return so_far
    rate = (last_step - first_step) / elapsed
    eta = last_at + timedelta(seconds=max(0, so_far.total_steps - last_step) / rate)
    eta_seconds = max(0.0, (eta - utcnow()).total_seconds())
    return dataclasses.replace(so_far, steps_per_s=rate, eta_seconds=eta_seconds, eta=eta)


def list_events(
    session: Session, *, request_id: str, after_step: int | None = None, limit: int | None = None
) -> list[dict[str, Any]]:
    """The request's history records in step order (optionally only steps after `after_step`)."""
    query = (
        select(TrainingEvent.record)
        .where(TrainingEvent.request_id == request_id)
        .order_by(TrainingEvent.step)
    )
    if after_step is not None:
        query = query.where(TrainingEvent.step > after_step)
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query))


def cancel_request(
    session: Session,
    *,
    tenant_id: str,
    request_id: str,
    actor: str,
    actor_key_id: str | None = None,
    reason: str | None = None,
) -> UnlearnRequest:
    """Cancel: queued -> cancelled now; running/evaluating -> cancelling. Conflict once it has finished."""
    request = session.scalars(
        select(UnlearnRequest)
        .where(UnlearnRequest.id == request_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one_or_none()
    if request is None or request.tenant_id != tenant_id:
        raise NotFound(f"no unlearn request {request_id!r}")
    status = RequestStatus(request.status)
    if status in (RequestStatus.CANCELLED, RequestStatus.CANCELLING):
        return request  # already asked for: nothing changes
    if status in TERMINAL_STATUSES:
        raise Conflict(
            f"request {request_id} has already {status.value}; finished requests never change",
            code="already_finished",
        )
    now = utcnow()
    request.cancel_requested_at = now
    if status == RequestStatus.QUEUED:
        request.status, request.finished_at = RequestStatus.CANCELLED, now
    else:
        request.status = RequestStatus.CANCELLING
    audit.append(
        session,
        action="unlearn_request.cancel",
        subject_type="unlearn_request",
        subject_id=request.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=request.tenant_id,
        reason=reason,
        data={"from": status.value, "to": request.status.value},
    )
    return request


# --- the worker's view -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetRef:
    id: str
    name: str
    storage_key: str
    sha256: str
    kind: str  # qa or text
    format: str  # json, jsonl, json-lines-of-arrays, txt
    rows: int


@dataclass(frozen=True)
class WorkItem:
    """What a worker needs to run a request, detached from any session."""

    request_id: str
    tenant_id: str
    status: RequestStatus
    method: str
    params: dict[str, Any]
    metadata: dict[str, Any]
    base_model_id: str
    base_model_name: str
    base_model_source: str
    forget: DatasetRef
    retain: DatasetRef
    queue_seq: int
    attempts: int
    checkpoint_key: str | None
    created_at: datetime


def _ref(dataset: Dataset) -> DatasetRef:
    return DatasetRef(
        id=dataset.id,
        name=dataset.name,
        storage_key=dataset.storage_key,
        sha256=dataset.sha256,
        kind=dataset.kind,
        format=dataset.format,
        rows=dataset.rows,
    )


def load_work_item(session: Session, *, request_id: str) -> WorkItem:
    """The request with its base model and its datasets' storage keys; NotFound if missing."""
    request = get_request(session, tenant_id=None, request_id=request_id)
    return WorkItem(
        request_id=request.id,
        tenant_id=request.tenant_id,
        status=RequestStatus(request.status),
        method=request.method,
        params=dict(request.params or {}),
        metadata=dict(request.meta or {}),
        base_model_id=request.base_model_id,
        base_model_name=request.base_model.name,
        base_model_source=request.base_model.source,
        forget=_ref(request.forget_dataset),
        retain=_ref(request.retain_dataset),
        queue_seq=request.queue_seq,
        attempts=request.attempts,
        checkpoint_key=request.checkpoint_key,
        created_at=request.created_at,
    )
