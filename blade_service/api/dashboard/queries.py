"""What the dashboard pages show, read from the database: plain dicts, scoped to the caller's tenant.

Read-only. Every write (cancel, disable, enable) goes through the JSON API from the page's JavaScript, so the
dashboard has exactly the permissions of the key it signed in with.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, literal_column, select
from sqlalchemy.orm import Session

from blade_service.persistence import audit, base_models, policy, registry, requests
from blade_service.persistence.convergence import converged
from blade_service.persistence.errors import NotFound
from blade_service.persistence.models import (
    AdapterVersion,
    ApiKey,
    AuditEntry,
    BaseModel,
    RequestStatus,
    UnlearnRequest,
    WorkerHeartbeat,
)

STATE_ORDER = [s.value for s in RequestStatus]
ACTIVE_STATES = (
    RequestStatus.QUEUED,
    RequestStatus.RUNNING,
    RequestStatus.EVALUATING,
    RequestStatus.CANCELLING,
)


def _status(value: Any) -> str:
    return value.value if hasattr(value, "value") else str(value)


def request_summary(r: UnlearnRequest) -> dict[str, Any]:
    so_far = requests.progress_so_far(r)  # total: the request's max_steps, else the method's step cap
    total, progress = so_far.total_steps, so_far.fraction
    return {
        "id": r.id,
        "status": _status(r.status),
        "method": r.method,
        "base_model": r.base_model.name,
        "step": r.step or 0,
        "total_steps": total,
        "progress": progress,
        "run_status": r.run_status,
        "converged": converged(r.run_status, method=r.method, params=r.params),
        # held back by the policy gate, then enabled by an admin: live although `rejected`
        "overridden": bool((r.gate or {}).get("override")),
        "error_code": r.error_code,
        "error_message": r.error_message,
        "attempts": r.attempts,
        "created_at": r.created_at,
        "started_at": r.started_at,
        "finished_at": r.finished_at,
        "adapter_id": r.adapter_id,
        "params": dict(r.params or {}),
        "metadata": dict(r.meta or {}),
        "forget": {
            "id": r.forget_dataset.id,
            "name": r.forget_dataset.name,
            "sha256": r.forget_dataset.sha256,
            "rows": r.forget_dataset.rows,
        },
        "retain": {
            "id": r.retain_dataset.id,
            "name": r.retain_dataset.name,
            "sha256": r.retain_dataset.sha256,
            "rows": r.retain_dataset.rows,
        },
        "terminal": RequestStatus(r.status).terminal,
        "queue_seq": r.queue_seq,
        "lease_owner": r.lease_owner,
    }


def _anonymous(worker: dict[str, Any], number: int) -> dict[str, Any]:
    """A worker as a tenant sees it: its queues, device and state, not the host or process it runs as."""
    return {
        **worker,
        "name": f"worker {number}",
        "hostname": None,
        "pid": None,
        "info": {"device": worker["info"].get("device")},
    }


def overview(
    session: Session,
    *,
    tenant_id: str,
    now: datetime | None = None,
    alive_after_s: float = 30.0,
    broker_depths: dict[str, int | None] | None = None,
    totals: Any = None,
    operator: bool = False,
) -> dict[str, Any]:
    """Counts by state, queues, workers and what they run, recent requests and failures. `totals` (the
    /metrics collector's `HistoryTotals`): finished requests are counted from its folded totals, so the
    page's cost does not grow with the tenant's history; without it, one count over the tenant's rows.
    Workers are named (host, pid) for the operator only; a tenant sees them numbered."""
    now = now or datetime.now(UTC)
    if totals is None:
        counts = Counter(
            {
                _status(s): n
                for s, n in session.execute(
                    select(UnlearnRequest.status, func.count())
                    .where(UnlearnRequest.tenant_id == tenant_id)
                    .group_by(UnlearnRequest.status)
                ).all()
            }
        )
    else:
        finished = totals.read(session, now)
        counts = Counter()
        for (tenant, _method, status), values in finished.items():
            if tenant == tenant_id:
                counts[status] += int(values[0])
        for status, n in session.execute(  # unfinished: the partial index ix_unlearn_requests_unfinished
            select(UnlearnRequest.status, func.count())
            .where(UnlearnRequest.tenant_id == tenant_id, requests.unfinished(UnlearnRequest.status))
            .group_by(UnlearnRequest.status)
        ).all():
            counts[_status(status)] += n
    recent = session.scalars(
        select(UnlearnRequest)
        .where(UnlearnRequest.tenant_id == tenant_id)
        .order_by(UnlearnRequest.created_at.desc())
        .limit(12)
    ).all()
    failures = session.scalars(  # the partial index ix_unlearn_requests_failed, read backwards
        select(UnlearnRequest)
        .where(
            UnlearnRequest.tenant_id == tenant_id,
            UnlearnRequest.status == literal_column("'failed'"),  # inline: matches the index predicate
            UnlearnRequest.finished_at.is_not(None),  # every failure has one (persistence/jobs.py _finish)
        )
        .order_by(UnlearnRequest.finished_at.desc())
        .limit(8)
    ).all()
    waiting = dict(
        session.execute(
            select(BaseModel.name, func.count())
            .select_from(UnlearnRequest)
            .join(BaseModel, BaseModel.id == UnlearnRequest.base_model_id)
            .where(UnlearnRequest.status == literal_column("'queued'"))  # in ix_unlearn_requests_unfinished
            .where(UnlearnRequest.tenant_id == tenant_id)  # its own: not other tenants' on a shared model
            .group_by(BaseModel.name)
        ).all()
    )
    workers: list[dict[str, Any]] = []
    running_ids: set[str] = set()
    for w in session.scalars(select(WorkerHeartbeat).order_by(WorkerHeartbeat.worker_name)).all():
        last_seen = w.last_seen if w.last_seen.tzinfo else w.last_seen.replace(tzinfo=UTC)
        age = max(0.0, (now - last_seen).total_seconds())
        alive = bool(w.alive) and age <= alive_after_s
        workers.append(
            {
                "name": w.worker_name,
                "queues": list(w.queues or []),
                "hostname": w.hostname,
                "pid": w.pid,
                "age_s": age,
                "alive": alive,
                "info": dict(w.info or {}),
                "current_request_id": w.current_request_id if alive else None,
                "running": None,
            }
        )
        if alive and w.current_request_id:
            running_ids.add(w.current_request_id)
    if running_ids:
        rows = {
            r.id: r for r in session.scalars(select(UnlearnRequest).where(UnlearnRequest.id.in_(running_ids)))
        }
        for worker in workers:
            r = rows.get(worker["current_request_id"] or "")
            if r is not None:
                worker["running"] = request_summary(r) if r.tenant_id == tenant_id else {"other_tenant": True}
    workers.sort(key=lambda w: (not w["alive"], w["name"]))
    if not operator:
        workers = [_anonymous(w, n) for n, w in enumerate(workers, 1)]
    return {
        "counts": [(s, counts.get(s, 0)) for s in STATE_ORDER],
        "total": sum(counts.values()),
        "active": sum(counts.get(s.value, 0) for s in ACTIVE_STATES),
        "queues": broker_depths or {},
        "waiting_by_model": waiting,
        "workers": workers,
        "workers_alive": sum(1 for w in workers if w["alive"]),
        "recent": summaries(session, recent),
        "failures": [request_summary(r) for r in failures],
    }


def list_requests(
    session: Session,
    *,
    tenant_id: str,
    status: str | None = None,
    base_model: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    found = requests.list_requests(
        session,
        tenant_id=tenant_id,
        status=RequestStatus(status) if status else None,
        base_model=base_model,
        limit=limit,
    )
    return summaries(session, found)


def summaries(session: Session, found: Sequence[UnlearnRequest]) -> list[dict[str, Any]]:
    """`request_summary` of each, with `rolled_back`: its adapter's change is in the effective model no
    longer (disabled, and no compaction or retrain carries it). One stack read per base model."""
    models = {r.base_model_id: r.base_model for r in found if r.adapter}
    stacks = {model_id: registry.list_stack(session, model) for model_id, model in models.items()}
    out = []
    for r in found:
        summary = request_summary(r)
        adapter = r.adapter
        summary["rolled_back"] = adapter is not None and not registry.change_in_effect(
            stacks[r.base_model_id], adapter
        )
        out.append(summary)
    return out


def get_request(session: Session, *, tenant_id: str, request_id: str) -> UnlearnRequest | None:
    try:
        return requests.get_request(session, tenant_id=tenant_id, request_id=request_id)
    except NotFound:
        return None


def request_detail(session: Session, *, tenant_id: str, request_id: str) -> dict[str, Any] | None:
    r = get_request(session, tenant_id=tenant_id, request_id=request_id)
    if r is None:
        return None
    out = request_summary(r)
    out["metrics_before"] = r.metrics_before
    out["metrics_after"] = r.metrics_after
    out["metric_rows"] = metric_rows(r.metrics_before, r.metrics_after)
    out["events"] = events(session, request_id=r.id)
    out["queue_position"] = requests.queue_position(session, request=r)
    out["eta_seconds"] = requests.progress(session, request=r).eta_seconds
    out["gate"] = r.gate  # the policy gate's verdict (persistence/policy.py)
    if r.adapter is not None:
        stack = registry.list_stack(session, r.adapter.base_model)
        out["adapter"] = {
            "id": r.adapter.id,
            "version": r.adapter.version,
            "state": _status(r.adapter.state),
            "sha256": r.adapter.sha256,
            "change_in_effect": registry.change_in_effect(stack, r.adapter),  # a compaction may carry it
        }
        out["rolled_back"] = not out["adapter"]["change_in_effect"]
    out["audit"] = label_actors(
        session,
        [
            audit_row(e)
            for e in session.scalars(
                select(AuditEntry).where(AuditEntry.subject_id == r.id).order_by(AuditEntry.id)
            )
        ],
    )
    return out


def events(session: Session, *, request_id: str) -> list[dict[str, Any]]:
    return requests.list_events(session, request_id=request_id)


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = value


# Bookkeeping that rides along with the metrics (sample sizes, evaluation settings, timings): not shown.
NOT_METRICS = frozenset(
    {"settings", "n", "n_forget", "n_reference", "time_s", "seed", "max_rows", "thresholds"}
)


def metric_rows(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Before/after side by side: one row per numeric metric, dotted names for nested groups."""
    b: dict[str, Any] = {}
    a: dict[str, Any] = {}
    _flatten("", before or {}, b)
    _flatten("", after or {}, a)
    rows = []
    for name in list(dict.fromkeys([*b, *a])):
        if name.split(".")[0] in NOT_METRICS or name.split(".")[-1] in NOT_METRICS:
            continue
        vb, va = b.get(name), a.get(name)
        if not any(isinstance(v, int | float) and not isinstance(v, bool) for v in (vb, va)):
            continue
        delta = va - vb if isinstance(va, int | float) and isinstance(vb, int | float) else None
        rows.append({"name": name, "before": vb, "after": va, "delta": delta})
    return rows


def visible_base_models(session: Session, *, tenant_id: str) -> list[dict[str, Any]]:
    models = base_models.list_visible(session, tenant_id=tenant_id)
    counts: dict[tuple[str, str], int] = {}
    for bm_id, state, n in session.execute(
        select(AdapterVersion.base_model_id, AdapterVersion.state, func.count()).group_by(
            AdapterVersion.base_model_id, AdapterVersion.state
        )
    ).all():
        counts[(bm_id, _status(state))] = n
    return [
        {
            "name": m.name,
            "source": m.source,
            "description": m.description,
            "created_at": m.created_at,
            "shared": m.tenant_id is None,
            "active": counts.get((m.id, "active"), 0),
            "disabled": counts.get((m.id, "disabled"), 0),
        }
        for m in models
    ]


def model_detail(session: Session, *, tenant_id: str, name: str) -> dict[str, Any] | None:
    """The base model and its adapter stack, oldest first, with who changed each adapter's state and why."""
    try:
        model = base_models.get_visible(session, name=name, tenant_id=tenant_id)
    except NotFound:
        return None
    adapters = registry.list_stack(session, model)
    stale = registry.stale_flags(adapters)
    versions = {a.id: a.version for a in adapters}
    history: dict[str, list[dict[str, Any]]] = {}
    if adapters:
        for e in session.scalars(
            select(AuditEntry)
            .where(AuditEntry.subject_id.in_([a.id for a in adapters]))
            .order_by(AuditEntry.id)
        ):
            history.setdefault(e.subject_id, []).append(audit_row(e))
        label_actors(session, [row for rows in history.values() for row in rows])
    items, active_below = [], []
    for a in adapters:
        if not registry.visible_to(a, tenant_id):  # another tenant's version: only that it exists
            items.append(_other_tenants(a, stale=stale[a.id]))
            if _status(a.state) == "active":
                active_below.append(a.id)
            continue
        own = a.request
        req = own if own is not None and own.tenant_id == tenant_id else None  # only the caller's own
        mine = req is not None
        parent = list(a.parent_stack or [])
        items.append(
            {
                "id": a.id,
                "version": a.version,
                "state": _status(a.state),
                "method": a.method,
                "sha256": a.sha256,
                "size_bytes": a.size_bytes,
                "created_at": a.created_at,
                "request_id": a.request_id,
                "request_visible": mine,
                "headline": [] if req is None else headline_metrics(req.metrics_before, req.metrics_after),
                "parent_ids": parent,
                "parent_versions": [versions.get(p, p) for p in parent],
                "stale": stale[a.id],
                # how the active stack below differs from the one it was trained on
                "missing_below": [versions.get(p, p) for p in parent if p not in active_below],
                "added_below": [versions[p] for p in active_below if p not in parent],
                "state_changed_at": a.state_changed_at,
                "state_changed_by": a.state_changed_by,
                "state_reason": a.state_reason,
                "history": history.get(a.id, []),
                "kind": a.kind,
                "contains_versions": (a.lineage or {}).get("versions", []),
            }
        )
        if _status(a.state) == "active":
            active_below.append(a.id)
    for item in items:  # the versions trained on top of each one (what a disable would flag)
        item["dependents"] = [other["version"] for other in items if item["id"] in other["parent_ids"]]
    return {
        "name": model.name,
        "source": model.source,
        "description": model.description,
        "shared": model.tenant_id is None,
        "policy": policy.effective(model),
        "canary_dataset": model.canary_dataset_id,
        "adapters": items,
        "active": [i["version"] for i in items if i["state"] == "active"],
    }


def _other_tenants(a: Any, *, stale: bool) -> dict[str, Any]:
    """Another tenant's version on a shared model: its version and state, nothing that identifies it."""
    blank: dict[str, Any] = {"method": "", "sha256": "", "request_id": "", "size_bytes": None}
    return {
        **blank,
        "id": f"other-tenant-v{a.version}",
        "version": a.version,
        "state": _status(a.state),
        "other_tenant": True,
        "created_at": None,
        "request_visible": False,
        "headline": [],
        "parent_ids": [],
        "parent_versions": [],
        "stale": stale,
        "missing_below": [],
        "added_below": [],
        "state_changed_at": None,
        "state_changed_by": None,
        "state_reason": None,
        "history": [],
    }


HEADLINE = ("forget.Prob", "forget.ROUGE", "mia.auc", "retain.Prob", "retain.ROUGE")


def headline_metrics(
    before: dict[str, Any] | None, after: dict[str, Any] | None, limit: int = 5
) -> list[dict[str, Any]]:
    """A few before -> after pairs for the stack timeline: forget side, MIA, retain side (else the first)."""
    rows = metric_rows(before, after)
    known = sorted((r for r in rows if r["name"] in HEADLINE), key=lambda r: HEADLINE.index(r["name"]))
    return (known or rows)[:limit]


def label_actors(session: Session, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Name the API keys behind `key:<id>` actors ("ops admin (key_1a2b…)"); other actors stay as they are."""
    ids = {r["actor"][4:] for r in rows if r["actor"].startswith("key:")}
    names = (
        dict(session.execute(select(ApiKey.id, ApiKey.name).where(ApiKey.id.in_(ids))).all()) if ids else {}
    )
    for r in rows:
        key_id = r["actor"][4:] if r["actor"].startswith("key:") else None
        r["actor_label"] = f"{names[key_id]} ({key_id[:12]}…)" if key_id in names else r["actor"]
    return rows


def audit_row(e: AuditEntry) -> dict[str, Any]:
    return {
        "id": e.id,
        "created_at": e.created_at,
        "actor": e.actor,
        "action": e.action,
        "subject_type": e.subject_type,
        "subject_id": e.subject_id,
        "reason": e.reason,
        "data": dict(e.data or {}),
        "hash": e.hash,
        "prev_hash": e.prev_hash,
        "tenant_id": e.tenant_id,
    }


def audit_page(
    session: Session,
    *,
    tenant_id: str | None,
    action: str | None = None,
    subject: str | None = None,
    actor: str | None = None,
    before_id: int | None = None,
    limit: int = 50,
) -> dict[str, Any]:
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit + 1)
    if tenant_id is not None:
        query = query.where(AuditEntry.tenant_id == tenant_id)
    if action:
        query = query.where(AuditEntry.action.like(action.replace("*", "%") if "*" in action else action))
    if subject:
        query = query.where(AuditEntry.subject_id == subject)
    if actor:
        query = query.where(AuditEntry.actor.like(f"%{actor}%"))
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    rows = list(session.scalars(query))
    more = len(rows) > limit
    rows = rows[:limit]
    base = select(AuditEntry.action).distinct().order_by(AuditEntry.action)
    if tenant_id is not None:
        base = base.where(AuditEntry.tenant_id == tenant_id)
    return {
        "entries": label_actors(session, [audit_row(e) for e in rows]),
        "more": more,
        "next_before": rows[-1].id if more and rows else None,
        "actions": list(session.scalars(base)),
        "scope": "chain" if tenant_id is None else "tenant",  # as GET /audit-log/verify
        "chain": (
            audit.verify_chain(session)
            if tenant_id is None
            else audit.verify_tenant(session, tenant_id=tenant_id)
        ).as_dict(),
    }
