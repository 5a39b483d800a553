"""The `unlearn` task (GPU queue): one unlearn request run to a terminal state.

Tasks take ids as keyword arguments, open short database sessions (never one across a training run) and import
torch inside the task body, so CUDA is initialised in the pool process that runs the task, after the fork.

The life of one unlearn task (`unlearn(request_id=...)`):
1. claim the request under a database lease (`persistence.jobs.claim_request`): nothing happens unless it is
   the oldest unfinished request of its base model and nobody else holds a live lease, so duplicated or
   redelivered messages are harmless; a heartbeat thread renews the lease and watches for a cancel;
2. fetch the datasets and the active adapter stack from storage; measure `metrics_before` on that stack;
3. train with `blade_core.unlearn.run_unlearning`; every step's record becomes a TrainingEvent and the
   request's progress; checkpoints go to a per-request dir that is uploaded to artifact storage, so a task
   redelivered to another worker after a crash resumes from the last one (its events say `resumed_from`);
4. stage the adapter archive in storage, state `evaluating`, measure `metrics_after` on the new stack;
5. one transaction: the adapter version (created once per request, found again on a redelivery) and
   `succeeded`. Failures set `failed` with a code and a message; a cancel ends as `cancelled`;
6. publish the next request of the same base model (its task may have been dropped while it waited).

    celery -A blade_service.worker.celery_app:app worker -Q unlearn -c 1 --max-tasks-per-child 1
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from blade_service.broker.dispatch import enqueue_unlearn
from blade_service.contracts.names import TaskName
from blade_service.contracts.records import load_dataset_rows
from blade_service.persistence import jobs, registry
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import AdapterState, AdapterVersion, RequestStatus, UnlearnRequest
from blade_service.persistence.policy import failure_message
from blade_service.persistence.settings import Settings, get_settings
from blade_service.worker import observability
from blade_service.worker.artifacts import (
    adapter_key,
    dataset_suffix,
    fetch_adapter,
    fetch_dataset,
    resolve_base_model,
)
from blade_service.worker.celery_app import app
from blade_service.worker.cleanup import cleanup_terminal, issue_certificate
from blade_service.worker.errors import TaskFailure, classify
from blade_service.worker.lease import LeaseKeeper
from blade_service.worker.process import free_accelerator, worker_id
from blade_service.worker.run_context import RunContext, load_context
from blade_service.worker.stacks import base_reference, gate_sets, gate_verdict, sets_metrics
from blade_service.worker.training import run_notes, train

log = logging.getLogger("blade.worker")


@app.task(name=TaskName.UNLEARN.value, bind=True, acks_late=True, reject_on_worker_lost=True)
def unlearn(self: Any, *, request_id: str) -> dict[str, Any]:
    """Run one unlearn request to a terminal state (or do nothing, when it is not this task's to run)."""
    settings = get_settings()
    worker_name = getattr(self.request, "hostname", None) or worker_id()
    owner = f"{worker_name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    with session_scope(settings) as session:
        claim = jobs.claim_request(
            session,
            request_id=request_id,
            owner=owner,
            lease_seconds=settings.lease_seconds,
            max_attempts=settings.max_attempts,
        )
    log.info(
        "unlearn.claim",
        extra={
            "request_id": request_id,
            "outcome": claim.outcome.value,
            "attempt": claim.attempt,
            "blocked_by": claim.blocked_by,
        },
    )
    if not claim.claimed:
        if claim.outcome in (
            jobs.ClaimOutcome.TERMINAL,
            jobs.ClaimOutcome.CANCELLED,
            jobs.ClaimOutcome.EXHAUSTED,
        ):
            _kick_next(settings, request_id=request_id)
        elif claim.outcome is jobs.ClaimOutcome.WAITING:  # this task is spent: let the head's finish publish
            with session_scope(settings) as session:
                jobs.mark_unpublished(session, request_id=request_id)
        return {"request_id": request_id, "outcome": claim.outcome.value, "blocked_by": claim.blocked_by}

    outcome = "failed"
    started = time.monotonic()
    try:
        with LeaseKeeper(
            request_id=request_id, owner=owner, settings=settings, worker_name=worker_name
        ) as lease:
            ctx = load_context(settings, owner=owner, request_id=request_id, attempt=claim.attempt)
            outcome = _run_request(ctx, lease)
    except jobs.LeaseLost as exc:
        outcome = "lease_lost"
        log.warning("unlearn.lease_lost", extra={"request_id": request_id, "error": str(exc)})
    except SoftTimeLimitExceeded:
        _fail(
            settings,
            request_id,
            owner,
            "time_limit",
            f"training exceeded the worker's time limit of {settings.task_soft_time_limit_s} s",
        )
    except TaskFailure as exc:
        _fail(settings, request_id, owner, exc.code, exc.message)
    except Exception as exc:
        code, message = classify(exc)
        log.exception("unlearn.error", extra={"request_id": request_id, "code": code})
        if not _fail(settings, request_id, owner, code, message):
            raise  # could not even record the failure (database away): let the lease expire and retry
    finally:
        with contextlib.suppress(Exception), session_scope(settings) as session:
            jobs.beat_worker(session, worker_name=worker_name, current_request_id=None)
        free_accelerator()
    log.info(
        "unlearn.done",
        extra={"request_id": request_id, "outcome": outcome, "seconds": round(time.monotonic() - started, 3)},
    )
    with contextlib.suppress(Exception):  # the run's histograms, labelled with the request's outcome
        observability.observe_run_finished(request_id=request_id, outcome=outcome)
    if outcome != "lease_lost":
        cleanup_terminal(settings, request_id=request_id)
        _kick_next(settings, request_id=request_id)
    return {"request_id": request_id, "outcome": outcome, "attempt": claim.attempt}


def _run_request(ctx: RunContext, lease: LeaseKeeper) -> str:
    """Steps 2-5 of the module docstring; returns the outcome ('succeeded', 'cancelled', 'failed')."""
    settings, storage = ctx.settings, ctx.storage
    ctx.workdir.mkdir(parents=True, exist_ok=True)
    forget_path = fetch_dataset(
        storage, ctx.forget, ctx.workdir / f"forget{dataset_suffix(ctx.forget['key'])}"
    )
    retain_path = fetch_dataset(
        storage, ctx.retain, ctx.workdir / f"retain{dataset_suffix(ctx.retain['key'])}"
    )
    base_ref = resolve_base_model(storage, settings, ctx.base_source, ctx.base_revision)
    stack_dirs = [
        fetch_adapter(storage, settings, adapter_id=a["id"], key=a["key"], sha256=a["sha256"])
        for a in ctx.stack
    ]
    out_dir = ctx.workdir / "adapter"
    staged = adapter_key(base_model_id=ctx.base_model_id, request_id=ctx.request_id)

    forget_rows = load_dataset_rows(forget_path)[0]
    retain_rows = load_dataset_rows(retain_path)[0]
    probes: dict[str, Sequence[dict[str, Any]]] = {
        kind: load_dataset_rows(
            fetch_dataset(storage, ds, ctx.workdir / f"probe-{kind}{dataset_suffix(ds['key'])}")
        )[0]
        for kind, ds in ctx.probes.items()
    }
    gated = gate_sets(storage=storage, canary=ctx.canary, earlier=ctx.earlier, workdir=ctx.workdir)
    sets_before: dict[str, dict] | None = None  # known only when this attempt runs the first evaluation

    if ctx.status == RequestStatus.EVALUATING and storage.exists(staged):
        # A redelivery after training had finished: the adapter is already staged, don't train again.
        shutil.rmtree(out_dir, ignore_errors=True)
        storage.get_dir(staged, out_dir)
        run_status = None
    else:
        if ctx.metrics_before is None:
            before, sets_before = _measure(
                base_ref, stack_dirs, forget_rows, retain_rows, settings, probes, gated
            )
            before["stack"] = [a["id"] for a in ctx.stack]
            ctx.write(jobs.set_run_info, metrics_before=before)
            ctx.metrics_before = before
        result = train(ctx, lease, base_ref, stack_dirs, forget_path, retain_path, out_dir)
        if lease.lost.is_set():
            raise jobs.LeaseLost(f"request {ctx.request_id}: lease lost during training")
        if result.status == "cancelled":
            ctx.write(jobs.mark_cancelled, message=f"cancelled by request: {result.message}")
            return "cancelled"
        if result.status == "collapsed":
            raise TaskFailure("collapsed", f"training collapsed: {result.message}")
        run_status = result.status
        for warning in result.warnings:
            log.warning("unlearn.forgot_nothing", extra={"request_id": ctx.request_id, "warning": warning})
        _describe(ctx, base_ref, out_dir)
        storage.put_dir(staged, out_dir)
        ctx.write(jobs.mark_evaluating, run_status=run_status)

    after, sets_after = _measure(
        base_ref, [*stack_dirs, out_dir], forget_rows, retain_rows, settings, probes, gated
    )
    after["stack"] = [a["id"] for a in ctx.stack] + ["(this request)"]
    if warnings := _run_warnings(out_dir):  # e.g. forget Prob unchanged: shown with the metrics
        after["warnings"] = warnings
    verdict = gate_verdict(
        settings=settings,
        policy=ctx.policy,
        canary=ctx.canary,
        base_ref=base_ref,
        stack_dirs=stack_dirs,
        sets=gated,
        sets_before=sets_before,
        sets_after=sets_after,
        before=ctx.metrics_before or {},
        after=after,
        earlier=ctx.earlier,
    )
    if lease.should_stop():
        if lease.lost.is_set():
            raise jobs.LeaseLost(f"request {ctx.request_id}: lease lost during evaluation")
        ctx.write(jobs.mark_cancelled, message="cancelled during evaluation; no adapter was registered")
        return "cancelled"

    sha = storage.digest(staged)
    size = storage.size(staged)
    with session_scope(settings) as session:
        request = jobs.lock_owned(session, request_id=ctx.request_id, owner=ctx.owner)
        if jobs.is_cancel_requested(session, request_id=ctx.request_id):
            jobs.mark_cancelled(
                session,
                request=request,
                actor=f"worker:{ctx.owner}",
                message="cancelled before the adapter was registered",
            )
            outcome = "cancelled"
        elif not verdict["passed"]:
            message = failure_message(verdict)
            adapter = _register_adapter(
                session,
                ctx,
                request=request,
                key=staged,
                sha256=sha,
                size=size,
                run_status=run_status,
                state=AdapterState.DISABLED,
                state_reason=f"rejected: {message}",
            )
            after["stack"][-1] = adapter.id
            jobs.mark_rejected(
                session,
                request_id=ctx.request_id,
                owner=ctx.owner,
                adapter_id=adapter.id,
                gate=verdict,
                message=message,
                metrics_after=after,
            )
            outcome = "rejected"
        else:
            adapter = _register_adapter(
                session, ctx, request=request, key=staged, sha256=sha, size=size, run_status=run_status
            )
            after["stack"][-1] = adapter.id
            jobs.mark_succeeded(
                session,
                request_id=ctx.request_id,
                owner=ctx.owner,
                adapter_id=adapter.id,
                metrics_after=after,
                gate=verdict,
            )
            outcome = "succeeded"
    if outcome == "succeeded":
        # Right after the success commits (never inside it): the audit head it signs is then in the chain.
        issue_certificate(settings, request_id=ctx.request_id)
    return outcome


def _measure(
    base_ref: str,
    adapter_dirs: list[Path],
    forget_rows: list[dict[str, Any]],
    retain_rows: list[dict[str, Any]],
    settings: Settings,
    probes: dict[str, Sequence[dict[str, Any]]] | None = None,
    gated: dict[str, list[dict[str, Any]]] | None = None,
) -> tuple[dict[str, Any], dict[str, dict]]:
    """Forget/retain metrics of base + `adapter_dirs` on the request's data (+ MUSE's on text requests), and
    the gate's `sets_metrics` of `gated` (`stacks.gate_sets`) on the same loaded model."""
    from blade_core.evaluation.request import request_metrics
    from blade_core.lora import load_with_stack

    model, tokenizer = load_with_stack(base_ref, adapter_dirs, settings.device)
    try:
        metrics = request_metrics(
            model,
            tokenizer,
            forget_rows,
            retain_rows,
            probes=probes,
            max_new_tokens=settings.eval_max_new_tokens,
        )
        return dict(metrics), sets_metrics(model, tokenizer, gated or {}, settings)
    finally:
        del model
        free_accelerator()


def _register_adapter(
    session: Any,
    ctx: RunContext,
    *,
    request: UnlearnRequest,
    key: str,
    sha256: str,
    size: int,
    run_status: str | None,
    **state: Any,
) -> AdapterVersion:
    """The request's adapter version: created once; a redelivery finds the one it made before. `state`:
    `state` and `state_reason` of a version the policy gate holds back."""
    hyper = {**ctx.params, "method": ctx.method, **run_notes(ctx.workdir / "adapter")}
    if run_status:
        hyper["run_status"] = run_status
    adapter = registry.create_adapter_version(
        session,
        request=request,
        artifact_key=key,
        sha256=sha256,
        size_bytes=size,
        parent_stack=[a["id"] for a in ctx.stack],
        hyperparameters=hyper,
        actor=f"worker:{ctx.owner}",
        **state,
    )
    replaces = ctx.rebase.get("replaces")
    if replaces and adapter.lineage is None:
        adapter.lineage = {"retrain_of": replaces, "replaces_version": ctx.rebase.get("replaces_version")}
        if adapter.state == AdapterState.ACTIVE:  # the retrain is live: the version it replaces goes out
            registry.disable(
                session,
                adapter_id=replaces,
                actor=f"worker:{ctx.owner}",
                reason=f"replaced by v{adapter.version}, retrained on the new stack (rebase)",
                operator=True,
            )
    return adapter


def _run_warnings(out_dir: Path) -> list[str]:
    """The training run's warnings, from the run.json it staged with the adapter (so a redelivery that did
    not train again has them too)."""
    try:
        return list(json.loads((out_dir / "run.json").read_text()).get("warnings") or [])
    except (OSError, ValueError):
        return []


def _describe(ctx: RunContext, base_ref: str, out_dir: Path) -> None:
    """The archive names its base model (hub id or registry name) and holds no worker-local path."""
    from blade_core.export import describe_adapter_dir

    reference, revision = base_reference(base_ref, ctx.base_model_name, ctx.base_source, ctx.base_revision)
    describe_adapter_dir(
        out_dir,
        base_model=reference,
        revision=revision,
        run_fields={
            "stack": [a["id"] for a in ctx.stack],
            "forget": ctx.forget["id"],
            "retain": ctx.retain["id"],
            "request_id": ctx.request_id,
        },
    )


def _fail(settings: Settings, request_id: str, owner: str, code: str, message: str) -> bool:
    """Record a failure; True when recorded (or there was nothing left to record)."""
    try:
        with session_scope(settings) as session:
            jobs.mark_failed(session, request_id=request_id, owner=owner, code=code, message=message)
    except jobs.LeaseLost:
        return True
    except Exception as exc:
        log.error("unlearn.fail_not_recorded", extra={"request_id": request_id, "error": repr(exc)})
        return False
    log.info("unlearn.failed", extra={"request_id": request_id, "code": code, "reason": message})
    return True


def _kick_next(settings: Settings, *, request_id: str) -> None:
    """Publish the task of the request now first in line for the same base model, unless one was published
    for it already (`jobs.head_to_publish`)."""
    try:
        with session_scope(settings) as session:
            req = jobs.get_request(session, request_id=request_id)
            nxt = jobs.head_to_publish(session, base_model_id=req.base_model_id) if req is not None else None
            if nxt is None or nxt == request_id:
                return
            if enqueue_unlearn(nxt):
                jobs.mark_enqueued(session, request_ids=[nxt])
    except Exception as exc:  # the reconciler covers this
        log.warning("unlearn.kick_failed", extra={"request_id": request_id, "error": repr(exc)})
