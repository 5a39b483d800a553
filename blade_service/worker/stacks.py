"""Stack tasks: the policy gate after training, compaction (`blade.compact`) and export (`blade.export`).

- `gate_verdict` (called by `worker.unlearn_task.unlearn` once the candidate adapter is measured): the canary
  set (the base model's registered dataset, else the request's retain sample) before and after, the forget set
  after, judged by `persistence.policy.evaluate`. The registered canary's and a retrain's earlier forget sets
  (`gate_sets`) are measured in the request's two evaluations, on the models they load anyway.
- `compact(operation_id=...)`: the active stack as one adapter (`blade_core.compaction`), exact or truncated
  to `rank`; verified against the stack on canary prompts (greedy generations identical, logits within
  `LOGIT_ATOL`) before `registry.create_compacted_version` swaps it in. A failed verification leaves the
  stack as it was and fails the operation with the figures.
- `export(base_model=..., fmt=...)`: the effective model as one PEFT adapter or merged weights, archived in
  storage once per stack digest and format (`exports/<base model id>/<digest>-<format>.tar.gz`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select

from blade_service.broker import dispatch
from blade_service.contracts.names import TaskName
from blade_service.contracts.records import load_dataset_rows
from blade_service.persistence import policy as policy_rules
from blade_service.persistence import registry
from blade_service.persistence.db import session_scope
from blade_service.persistence.hub import is_hub_snapshot
from blade_service.persistence.models import (
    AdapterVersion,
    BaseModel,
    Dataset,
    StackOperation,
    UnlearnRequest,
    utcnow,
)
from blade_service.persistence.settings import Settings, get_settings
from blade_service.persistence.storage import Storage, get_storage
from blade_service.worker.artifacts import (
    dataset_suffix,
    fetch_adapter,
    fetch_dataset,
    resolve_base_model,
    task_base_model,
)
from blade_service.worker.celery_app import app
from blade_service.worker.errors import TaskFailure
from blade_service.worker.process import free_accelerator

log = logging.getLogger("blade.worker.stacks")

CANARY_MAX_ROWS = 32  # canary rows measured by the gate and prompts compared by compaction (seeded sample)
# A retrain (rebase) must leave the earlier forget sets forgotten: after <= before + slack on the stack below.
# The slack absorbs sampling noise of 32-row Prob / greedy ROUGE-L on tiny models; a real regression (an
# adapter undoing an earlier deletion) moves these by far more.
EARLIER_PROB_SLACK, EARLIER_ROUGE_SLACK = 0.05, 0.10


# --- the policy gate --------------------------------------------------------------------------------------


def base_reference(
    base_ref: str, name: str, source: str, revision: str | None = None
) -> tuple[str, str | None]:
    """What adapter_config.json names as the base model: the hub id and its registered revision, or the
    registry name for local sources (see blade_core.export.base_model_reference)."""
    from blade_core.export import base_model_reference

    local = Path(base_ref).is_dir() and not is_hub_snapshot(base_ref)  # a hub model resolves to its snapshot
    reference, pinned = base_model_reference(name, source, source_is_local=local)
    return reference, (revision or pinned) if not local else None


def load_rows(storage: Storage, dataset: dict[str, str], dest: Path) -> list[dict[str, Any]]:
    dest.mkdir(parents=True, exist_ok=True)
    path = fetch_dataset(storage, dataset, dest / f"{dataset['id']}{dataset_suffix(dataset['key'])}")
    return load_dataset_rows(path)[0]


CANARY = "canary"  # the canary's key in `gate_sets`; the earlier forget sets go by dataset id


def gate_sets(
    *, storage: Storage, canary: dict[str, str] | None, earlier: list[dict[str, Any]], workdir: Path
) -> dict[str, list[dict[str, Any]]]:
    """The rows the gate measures on both sides of the candidate, by key: the registered canary dataset's
    (`CANARY`) and each earlier forget set's that is not purged (its dataset id). The request's own two
    evaluations measure them (`sets_metrics`), so the gate loads no model of its own."""
    sets = {CANARY: load_rows(storage, canary, workdir / "canary")} if canary is not None else {}
    for e in earlier:
        if not e["purged"]:
            sets[e["id"]] = load_rows(storage, e, workdir / "earlier")
    return sets


def sets_metrics(
    model: Any, tokenizer: Any, sets: dict[str, list[dict]], settings: Settings
) -> dict[str, dict]:
    """Prob and ROUGE of a loaded model on each of `sets` (a seeded sample of CANARY_MAX_ROWS rows each)."""
    from blade_core.evaluation.request import dataset_metrics
    from blade_core.evaluation.tofu import json_ready, sample_rows

    return {
        key: json_ready(
            dataset_metrics(
                model,
                tokenizer,
                sample_rows(rows, CANARY_MAX_ROWS),
                max_new_tokens=settings.eval_max_new_tokens,
            )[0]
        )
        for key, rows in sets.items()
    }


def gate_verdict(
    *,
    settings: Settings,
    policy: dict[str, Any],
    canary: dict[str, str] | None,
    base_ref: str,
    stack_dirs: list[Path],
    sets: dict[str, list[dict[str, Any]]],
    sets_before: dict[str, dict] | None,
    sets_after: dict[str, dict],
    before: dict[str, Any],
    after: dict[str, Any],
    earlier: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The policy verdict on base + stack + candidate, measured against base + stack; with `earlier` (a
    retrain's), also that those forget sets stay forgotten. `sets_before` and `sets_after` are `sets_metrics`
    of `sets` (`gate_sets`) on base + stack and on base + stack + candidate; `sets_before` is None when the
    request's first evaluation ran in an earlier attempt, and is then measured here."""
    if sets_before is None:
        sets_before = _loaded_sets_metrics(base_ref, stack_dirs, sets, settings) if sets else {}
    if canary is not None:
        canary_before, canary_after = sets_before[CANARY], sets_after[CANARY]
        source = f"dataset:{canary['id']}"
    else:
        canary_before, canary_after, source = before["retain"], after["retain"], "retain_sample"
    verdict = policy_rules.evaluate(
        policy,
        canary_before=canary_before,
        canary_after=canary_after,
        forget_after=after["forget"],
        canary_source=source,
        mia_after=after.get("mia"),
    )
    verdict["canary_metrics"] = {"before": canary_before, "after": canary_after}
    if earlier:
        _check_earlier(verdict, earlier, sets_before, sets_after)
    return verdict


def earlier_forgets(session: Any, adapter_ids: list[str]) -> list[dict[str, Any]]:
    """The forget datasets of the stack's versions (what must stay forgotten), purged ones marked."""
    out = []
    for adapter in session.scalars(select(AdapterVersion).where(AdapterVersion.id.in_(adapter_ids))):
        if adapter.request is None:
            continue
        ds = adapter.request.forget_dataset
        out.append(
            {"adapter_id": adapter.id, "id": ds.id, "key": ds.storage_key, "sha256": ds.sha256,
             "purged": ds.purged_at is not None}
        )  # fmt: skip
    return out


def _loaded_sets_metrics(
    base_ref: str, dirs: list[Path], sets: dict[str, list[dict]], settings: Settings
) -> dict[str, dict]:
    """`sets_metrics` of base + `dirs`, loaded for it."""
    from blade_core.lora import load_with_stack

    model, tokenizer = load_with_stack(base_ref, dirs, settings.device)
    try:
        return sets_metrics(model, tokenizer, sets, settings)
    finally:
        del model
        free_accelerator()


def _check_earlier(
    verdict: dict[str, Any],
    earlier: list[dict[str, Any]],
    sets_before: dict[str, dict],
    sets_after: dict[str, dict],
) -> None:
    """Rules `earlier_forget_kept:<dataset>`: the earlier forget sets stay forgotten with the candidate."""
    for e in earlier:
        if e["purged"]:
            continue
        b, a = sets_before[e["id"]], sets_after[e["id"]]
        ok = (a["Prob"] or 0) <= (b["Prob"] or 0) + EARLIER_PROB_SLACK and (a["ROUGE"] or 0) <= (
            b["ROUGE"] or 0
        ) + EARLIER_ROUGE_SLACK
        rule = f"earlier_forget_kept:{e['id']}"
        verdict["rules"].append(
            {"rule": rule, "limit": [EARLIER_PROB_SLACK, EARLIER_ROUGE_SLACK], "value": None,
             "before": b, "after": a, "passed": ok, "adapter_id": e["adapter_id"]}
        )  # fmt: skip
        if not ok:
            verdict["failed"].append(rule)
    for e in earlier:
        if e["purged"]:
            verdict["rules"].append(
                {"rule": f"earlier_forget_kept:{e['id']}", "limit": None, "value": None, "passed": None,
                 "adapter_id": e["adapter_id"], "note": "forget data purged: not measurable"}
            )  # fmt: skip
    verdict["passed"] = not verdict["failed"]


# --- compaction -------------------------------------------------------------------------------------------


def _finish_operation(settings: Settings, operation_id: str, **fields: Any) -> None:
    with session_scope(settings) as session:
        op = session.get_one(StackOperation, operation_id)
        for name, value in fields.items():
            setattr(op, name, value)
        if fields.get("status") in ("succeeded", "failed"):
            op.finished_at = utcnow()


def _stack_of(session: Any, base: BaseModel) -> list[dict[str, Any]]:
    return [
        {"id": a.id, "key": a.storage_key, "sha256": a.sha256, "version": a.version}
        for a in registry.effective_stack(session, base)
    ]


def _canary_for_compaction(session: Any, base: BaseModel, stack: list[dict[str, Any]]) -> dict | None:
    """The registered canary set, else the retain set of the newest request in the stack that has one."""
    ids = [base.canary_dataset_id] if base.canary_dataset_id else []
    if not ids:
        requests = session.scalars(
            select(UnlearnRequest)
            .join(registry.AdapterVersion, registry.AdapterVersion.request_id == UnlearnRequest.id)
            .where(registry.AdapterVersion.id.in_([a["id"] for a in stack]))
            .order_by(UnlearnRequest.queue_seq.desc())
        ).all()
        ids = [r.retain_dataset_id for r in requests]
    for dataset_id in ids:
        ds = session.get(Dataset, dataset_id)
        if ds is not None and getattr(ds, "purged_at", None) is None:
            return {"id": ds.id, "key": ds.storage_key, "sha256": ds.sha256}
    return None


def canary_prompts(tokenizer: Any, rows: list[dict[str, Any]]) -> list[str]:
    """Prompts from canary rows: the QA prompt for question rows, the first half of a text row's words."""
    from blade_core.data import format_qa
    from blade_core.evaluation.tofu import sample_rows

    prompts = []
    for row in sample_rows(rows, CANARY_MAX_ROWS):
        if "question" in row:
            prompts.append(format_qa(tokenizer, row["question"], row.get("answer", ""))[0])
        elif row.get("text"):
            words = str(row["text"]).split()
            prompts.append(" ".join(words[: max(1, len(words) // 2)]))
    return prompts


def compaction_key(*, base_model_id: str, operation_id: str) -> str:
    return f"adapters/{base_model_id}/compact-{operation_id}.tar.gz"


@app.task(name=TaskName.COMPACT.value, bind=True, acks_late=True, soft_time_limit=3600, time_limit=3700)
def compact(self: Any, *, operation_id: str) -> dict[str, Any]:
    """Compact the active stack of the operation's base model; the operation records the outcome."""
    settings = get_settings()
    try:
        return _compact(settings, operation_id)
    except TaskFailure as exc:
        _finish_operation(
            settings, operation_id, status="failed", error_code=exc.code, error_message=exc.message
        )
        return {"operation_id": operation_id, "status": "failed", "code": exc.code}
    except Exception as exc:
        log.exception("compact.error", extra={"operation_id": operation_id})
        code = getattr(exc, "code", None) or "internal_error"
        _finish_operation(
            settings,
            operation_id,
            status="failed",
            error_code=code,
            error_message=f"{type(exc).__name__}: {exc}",
        )
        return {"operation_id": operation_id, "status": "failed", "code": code}
    finally:
        free_accelerator()


def _compact(settings: Settings, operation_id: str) -> dict[str, Any]:
    from blade_core.compaction import compact_adapters, verify_equivalent
    from blade_core.export import describe_adapter_dir
    from blade_core.modeling import load_tokenizer

    storage = get_storage(settings)
    with session_scope(settings) as session:
        op = session.get(StackOperation, operation_id)
        if op is None or op.status != "queued":  # a duplicate message (the reconciler re-publishes)
            return {"operation_id": operation_id, "status": getattr(op, "status", "missing")}
        op.status = "running"
        op.params = {**op.params, "started_at": utcnow().isoformat()}
        base: BaseModel = op.base_model
        stack = _stack_of(session, base)
        canary = _canary_for_compaction(session, base, stack)
        rank, reason, actor = op.params.get("rank"), op.reason or "compaction", op.created_by
        actor_key_id, tenant_id = op.params.get("actor_key_id"), op.tenant_id
        name, source, base_id, revision = base.name, base.source, base.id, base.revision
    if not stack:
        raise TaskFailure("empty_stack", f"base model {name} has no active adapters to compact")

    base_ref = resolve_base_model(storage, settings, source, revision)
    dirs = [
        fetch_adapter(storage, settings, adapter_id=a["id"], key=a["key"], sha256=a["sha256"]) for a in stack
    ]
    work = settings.data_dir.resolve() / "work" / operation_id
    shutil.rmtree(work, ignore_errors=True)
    try:
        out = work / "adapter"
        reference, revision = base_reference(base_ref, name, source, revision)
        report = compact_adapters(dirs, out, rank=rank, base_model=reference)
        describe_adapter_dir(out, base_model=reference, revision=revision)
        tokenizer = load_tokenizer(base_ref)
        rows = load_rows(storage, canary, work / "canary") if canary else []
        prompts = canary_prompts(tokenizer, rows) or [tokenizer.bos_token or "The"]
        verdict = verify_equivalent(base_ref, dirs, [out], prompts, device=settings.device)
        figures = {"compaction": report.as_dict(), "verification": verdict.as_dict()}
        figures["verification"]["canary"] = f"dataset:{canary['id']}" if canary else "none"
        if not verdict.ok:
            _finish_operation(
                settings,
                operation_id,
                status="failed",
                result=figures,
                error_code="verification_failed",
                error_message=(
                    f"the compacted adapter does not reproduce the stack on {verdict.prompts} canary prompts "
                    f"(generations identical: {verdict.generations_identical}, max |Δlogit| "
                    f"{verdict.max_logit_diff:.3g} > {verdict.tolerance:g}); the stack is unchanged"
                    + ("; try a larger rank" if report.truncated else "")
                ),
            )
            return {"operation_id": operation_id, "status": "failed", **figures}
        key = compaction_key(base_model_id=base_id, operation_id=operation_id)
        storage.put_dir(key, out)
        sha, size = storage.digest(key), storage.size(key)
        with session_scope(settings) as session:
            adapter = registry.create_compacted_version(
                session,
                base_model_id=base_id,
                sources=[a["id"] for a in stack],
                artifact_key=key,
                sha256=sha,
                size_bytes=size,
                lineage={
                    **figures["compaction"],
                    "operation_id": operation_id,
                    "verification": figures["verification"],
                },
                actor=actor,
                actor_key_id=actor_key_id,
                tenant_id=tenant_id,
                reason=reason,
            )
            result = {
                **figures,
                "adapter_id": adapter.id,
                "version": adapter.version,
                "replaced": (adapter.lineage or {})["contains"],  # a compacted version names what it contains
            }
            op = session.get_one(StackOperation, operation_id)
            op.status, op.result, op.finished_at = "succeeded", result, utcnow()
        log.info("compact.done", extra={"operation_id": operation_id, "adapter_id": result["adapter_id"]})
        return {"operation_id": operation_id, "status": "succeeded", **result}
    finally:
        shutil.rmtree(work, ignore_errors=True)


COMPACT_TIME_LIMIT_S = 3700  # the task's hard limit: a compaction "running" for longer lost its worker


def reconcile_operations(settings: Settings, *, requeue_after_s: float) -> list[str]:
    """Re-publish queued compactions whose message may be lost; fail those whose worker died. The ids sent."""
    now, sent = utcnow(), []
    with session_scope(settings) as session:
        ops = session.scalars(select(StackOperation).where(StackOperation.status.in_(("queued", "running"))))
        for op in ops:
            if op.status == "running":
                started = op.params.get("started_at")
                if started and now - datetime.fromisoformat(started) > timedelta(
                    seconds=COMPACT_TIME_LIMIT_S
                ):
                    op.status, op.finished_at, op.error_code = "failed", now, "worker_lost"
                    op.error_message = "the worker running this compaction stopped; the stack is unchanged"
                continue
            published = datetime.fromisoformat(op.params.get("published_at") or op.created_at.isoformat())
            if now - published > timedelta(seconds=requeue_after_s) and dispatch.enqueue_compact(op.id):
                op.params = {**op.params, "published_at": now.isoformat()}
                sent.append(op.id)
    return sent


# --- export -----------------------------------------------------------------------------------------------


def export_key(*, base_model_id: str, digest: str, fmt: str) -> str:
    return f"exports/{base_model_id}/{digest}-{fmt}.tar.gz"


@app.task(name=TaskName.EXPORT.value, soft_time_limit=3600, time_limit=3700, track_started=True)
def export(*, fmt: str, base_model_id: str | None = None, base_model: str | None = None) -> dict[str, Any]:
    """Archive the effective model of the base model as one adapter or merged weights (once per stack)."""
    from blade_core.export import FORMATS, describe_adapter_dir, export_adapter, export_merged

    settings = get_settings()
    try:
        if fmt not in FORMATS:
            return {"error": {"code": "invalid_format", "message": f"format: one of {', '.join(FORMATS)}"}}
        storage = get_storage(settings)
        with session_scope(settings) as session:
            base = task_base_model(session, base_model_id=base_model_id, base_model=base_model)
            if base is None:
                raise TaskFailure("not_found", f"no base model {base_model_id or base_model!r}")
            stack, name, source, base_id = _stack_of(session, base), base.name, base.source, base.id
            pinned = base.revision
        if fmt == "adapter" and not stack:
            return {
                "error": {
                    "code": "empty_stack",
                    "message": f"base model {name} has no active adapters: nothing to export as an adapter "
                    "(format=merged exports the base weights)",
                }
            }
        digest = hashlib.sha256("|".join([source, *(f"{a['id']}:{a['sha256']}" for a in stack)]).encode())
        key = export_key(base_model_id=base_id, digest=digest.hexdigest()[:32], fmt=fmt)
        if not storage.exists(key):
            base_ref = resolve_base_model(storage, settings, source, pinned)
            dirs = [
                fetch_adapter(storage, settings, adapter_id=a["id"], key=a["key"], sha256=a["sha256"])
                for a in stack
            ]
            reference, revision = base_reference(base_ref, name, source, pinned)
            with tempfile.TemporaryDirectory(dir=settings.data_dir.resolve()) as tmp:
                out = Path(tmp) / uuid.uuid4().hex
                if fmt == "adapter":
                    export_adapter(dirs, out, base_model=reference, revision=revision)
                    describe_adapter_dir(out, base_model=reference, revision=revision)
                else:
                    export_merged(base_ref, dirs, out, device="cpu")
                contents = [{"id": a["id"], "version": a["version"], "sha256": a["sha256"]} for a in stack]
                manifest = {"base_model": reference, "revision": revision, "format": fmt, "stack": contents}
                (out / "stack.json").write_text(json.dumps(manifest, indent=1))
                storage.put_dir(key, out)
        return {
            "key": key,
            "sha256": storage.digest(key),
            "size": storage.size(key),
            "stack": [a["id"] for a in stack],
            "format": fmt,
        }
    except TaskFailure as exc:  # not_found, or base_model_unavailable: the API answers 503, not 502
        log.warning("export.failed", extra={"base_model_id": base_model_id, "code": exc.code})
        return {"error": {"code": exc.code, "message": exc.message}}
    except Exception as exc:
        log.exception("export.error", extra={"base_model_id": base_model_id, "base_model": base_model})
        return {"error": {"code": "export_failed", "message": f"{type(exc).__name__}: {exc}"}}
    finally:
        free_accelerator()
