"""Step 3 of an unlearn request: the training run (`blade_core.unlearn.run_unlearning`) with hooks that
publish each step, poll for a cancel and sync checkpoints to storage, and the service's rules for its config
(every method trains a LoRA adapter; the progress total; what run.json adds to the adapter's record)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from blade_service.contracts.records import load_dataset_rows
from blade_service.persistence import jobs
from blade_service.persistence.db import session_scope
from blade_service.worker import observability
from blade_service.worker.artifacts import checkpoint_key, checkpoint_step
from blade_service.worker.errors import TaskFailure
from blade_service.worker.lease import LeaseKeeper
from blade_service.worker.run_context import RunContext

log = logging.getLogger("blade.worker")


def planned_steps(
    method: str, overrides: dict[str, Any], forget_path: Path, preset: str | None = None
) -> int | None:
    """The steps the run takes at most: its config's cap, else a baseline's schedule over the forget set."""
    from blade_core.methods import service_preset
    from blade_core.unlearn import build_config

    config = build_config(method, preset or service_preset(method), overrides)
    if config.max_steps is not None:
        return int(config.max_steps)
    from blade_core.methods._loop import schedule

    return schedule(config, len(load_dataset_rows(forget_path)[0])).total_steps


def train(
    ctx: RunContext,
    lease: LeaseKeeper,
    base_ref: str,
    stack_dirs: list[Path],
    forget_path: Path,
    retain_path: Path,
    out_dir: Path,
) -> Any:
    """run_unlearning with hooks that publish each step, poll for a cancel and sync checkpoints to storage;
    a collapsed BLADE run starts over at half its eta_out, `settings.collapse_retries` times at most."""
    from blade_core.checkpoint import CheckpointMismatch
    from blade_core.methods.base import Hooks
    from blade_core.unlearn import run_unlearning

    settings, storage = ctx.settings, ctx.storage
    ckpt_dir = ctx.workdir / "checkpoint"
    overrides = dict(ctx.params)  # learning rates the params leave out follow the engine's LR rule
    requested_preset = overrides.pop("preset", None)  # persistence.requests.SERVICE_KEYS: not config fields
    overrides.pop("probe_datasets", None)
    overrides.setdefault("checkpoint_every", settings.checkpoint_every)
    every = int(overrides["checkpoint_every"])
    preset = service_config_preset(ctx.method, overrides, requested_preset)
    total = overrides.get("max_steps")
    with contextlib.suppress(Exception):  # only the progress total depends on it; the run reports bad configs
        total = total or planned_steps(ctx.method, overrides, forget_path, preset)

    # Resume: the newest checkpoint this request uploaded (from any worker) replaces whatever is local.
    resumed_from = 0
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    if ctx.checkpoint_key and storage.exists(ctx.checkpoint_key):
        storage.get_dir(ctx.checkpoint_key, ckpt_dir)
        resumed_from = checkpoint_step(ctx.checkpoint_key)
    with session_scope(settings) as session:
        jobs.drop_steps_after(session, request_id=ctx.request_id, step=resumed_from)
    if resumed_from:
        log.info(
            "unlearn.resume",
            extra={"request_id": ctx.request_id, "step": resumed_from, "attempt": ctx.attempt},
        )

    synced: dict[str, Any] = {"fingerprint": None, "key": ctx.checkpoint_key}
    first_record: dict[str, Any] = {"pending": True}

    def sync_checkpoint(step: int) -> None:
        """Upload the checkpoint dir when the engine rewrote it (it saves after the step it is named by)."""
        path = ckpt_dir / "checkpoint.pt"
        if not path.is_file():
            return
        stat = path.stat()
        fingerprint = (stat.st_mtime_ns, stat.st_size)
        if fingerprint == synced["fingerprint"]:
            return
        saved_at = ((step - 1) // every) * every if step > 1 else 0
        if saved_at <= checkpoint_step(synced["key"]):
            synced["fingerprint"] = fingerprint
            return
        key = checkpoint_key(request_id=ctx.request_id, step=saved_at)
        storage.put_dir(key, ckpt_dir)
        ctx.write(jobs.set_run_info, checkpoint_key=key)
        if synced["key"] and synced["key"] != key:
            with contextlib.suppress(Exception):
                storage.delete(synced["key"])
        synced.update(fingerprint=fingerprint, key=key)

    def on_step(record: dict[str, Any]) -> None:
        record = dict(record)
        record["attempt"] = ctx.attempt
        if first_record.pop("pending", False) and resumed_from:
            record["resumed_from"] = resumed_from
        if "restarted" in first_record:
            record["restarted"] = first_record.pop("restarted")
        ctx.write(jobs.record_step, record=record, total_steps=total)
        _observe(ctx, record, total)
        sync_checkpoint(int(record.get("step", 0)))
        if lease.lost.is_set():
            raise jobs.LeaseLost(f"request {ctx.request_id}: lease lost at step {record.get('step')}")

    hooks = Hooks(on_step=on_step, should_stop=lease.should_stop, checkpoint_dir=ckpt_dir)
    seed = int(overrides.pop("seed", 0))

    def run() -> Any:
        return run_unlearning(
            model=base_ref,
            forget=forget_path,
            retain=retain_path,
            out_dir=out_dir,
            method=ctx.method,
            preset=preset,
            adapters=stack_dirs,
            overrides=overrides,
            seed=seed,
            hooks=hooks,
            device=settings.device,
            progress=False,
        )

    def start_over(why: dict[str, Any]) -> Any:
        """Discard the checkpoint and the steps recorded, and run from step 0; `why` goes on the new first
        step's event as `restarted`."""
        nonlocal resumed_from
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # with the LR rule it saved (blade_core/lr_scale.py)
        with session_scope(settings) as session:
            jobs.drop_steps_after(session, request_id=ctx.request_id, step=0)
        with contextlib.suppress(Exception):
            storage.delete(synced["key"])
        synced.update(fingerprint=None, key=None)
        first_record["restarted"], resumed_from = why, 0
        return run()

    try:
        try:
            result = run()
        except CheckpointMismatch as exc:
            if not resumed_from:
                raise
            # A deploy changed the method's config while the request was paused: the client's request is
            # still valid, so it starts over under the config of this build rather than failing.
            log.warning(
                "unlearn.checkpoint_discarded",
                extra={"request_id": ctx.request_id, "step": resumed_from, "differences": exc.differences},
            )
            result = start_over({"discarded_checkpoint_step": resumed_from, "because": exc.differences})
        retries = settings.collapse_retries if ctx.method == "blade" and "eta_out" not in overrides else 0
        restarts = 0
        while result.status == "collapsed" and restarts < retries:
            ran_with = _config_value(out_dir, "eta_out")
            if ran_with is None:
                break
            overrides["eta_out"], restarts = ran_with / 2, restarts + 1
            log.warning(
                "unlearn.collapse_retry",
                extra={"request_id": ctx.request_id, "reason": result.message, "eta_out": ran_with / 2},
            )
            result = start_over({"collapsed": result.message, "eta_out": ran_with / 2})
        if result.status == "collapsed" and restarts:
            note = f"; started over {restarts} time(s), each at half the eta_out before"
            result = dataclasses.replace(result, message=result.message + note)
        return result
    except ValueError as exc:  # config or data the engine refused (validated up front, so rare)
        raise TaskFailure("invalid_request", str(exc)) from exc


def _run_info(adapter_dir: Path) -> dict[str, Any]:
    """The engine's run.json in `adapter_dir` ({} when it is missing or unreadable)."""
    try:
        info = json.loads((adapter_dir / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _config_value(adapter_dir: Path, name: str) -> Any:
    """A config value the engine ran with, from its run.json (learning rates after the LR rule)."""
    config = _run_info(adapter_dir).get("config")
    return config.get(name) if isinstance(config, dict) else None


def run_notes(adapter_dir: Path) -> dict[str, Any]:
    """What the engine's run.json says about learning rates and forgetting, for the adapter's hyperparameters:
    the LR rule used (blade_core/lr_scale.py) and any warnings (blade_core/forget_check.py). The rule lists
    the rates it did not set (`explicit`); their values are added from the run's config, since one may be the
    worker's and not the request's (a collapsed run starts over at half its eta_out)."""
    info = _run_info(adapter_dir)
    notes = {k: info[k] for k in ("lr_rule", "forget_prob", "warnings") if info.get(k)}
    rule, config = notes.get("lr_rule"), info.get("config")
    if isinstance(rule, dict) and isinstance(config, dict) and rule.get("explicit"):
        notes["lr_rule"] = {**rule, "explicit_values": {n: config.get(n) for n in rule["explicit"]}}
    return notes


def service_config_preset(method: str, overrides: dict[str, Any], requested: str | None = None) -> str | None:
    """The preset the service trains `method` with (a LoRA adapter for every method: it must stack and roll
    back); TaskFailure('invalid_request') when the request's params make the run something else."""
    from blade_core.methods import service_preset
    from blade_core.unlearn import build_config

    preset = requested or service_preset(method)  # the request's `preset` (e.g. muse), else the service's
    try:
        config = build_config(method, preset, overrides)
    except ValueError as exc:
        raise TaskFailure("invalid_request", str(exc)) from exc
    if not config.use_lora:
        raise TaskFailure(
            "invalid_request",
            f"params.use_lora: the service stores every result as a LoRA adapter; method {method!r} with "
            "use_lora=false (full-parameter) runs only in `blade unlearn` and `blade bench`",
        )
    return preset


def _observe(ctx: RunContext, record: dict[str, Any], total_steps: int | None) -> None:
    """Export a step to the worker's Prometheus metrics; a metrics failure never stops training."""
    with contextlib.suppress(Exception):
        observability.observe_step(
            request_id=ctx.request_id,
            base_model=ctx.base_model_name,
            method=ctx.method,
            record=record,
            total_steps=total_steps,
        )
