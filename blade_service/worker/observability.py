"""Worker metrics for Prometheus, fed by Celery signals and served on an HTTP port.

A Celery worker runs each task in a pool child (prefork; on GPU queues a fresh child per task), so metrics use
prometheus-client's multiprocess mode: every process writes its samples to files under a per-worker directory
and the main process serves their union (`MultiProcessCollector`) on `Settings.worker_metrics_port`
(env `BLADE_WORKER_METRICS_PORT`; 0 disables the server, the metrics are still kept). Gauges of a running job
are "live": they vanish when the child that set them exits.

Metrics (all `blade_worker_*` or `blade_training_*` / `blade_gpu_*`):
- tasks by name and outcome, task duration, time in queue (publish -> start, from a header set at publish);
- per running unlearn request: outer step, progress (step / step cap), L_fgt, L_ret, lambda, epsilon,
  outer-step rate;
- training runs: duration and steps per run by method and the request's outcome, steps counter; GPU memory
  peak per task and device.
These are the service's only histograms and per-run gauges: the API's `/metrics` exports the aggregates it
reads from the database (requests by state, the oldest queued request, workers alive and their heartbeat
rows), none of these under another name.

Wiring: `connect_signals()` (called by `worker/celery_app.py`) connects the Celery signals; the unlearn task's
step hook calls `observe_step(...)` (also reached through the training-event writer, see `_watch_events`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from celery import signals
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from blade_service.broker.app import HEADER_PUBLISHED_AT
from blade_service.persistence.settings import get_settings

log = logging.getLogger("blade.worker.metrics")

RUNNING_LABELS = ("request_id", "base_model", "method")

_TIME_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)
_STEP_BUCKETS = (1, 5, 10, 25, 50, 100, 150, 200, 250, 400, 600, 1000)


class WorkerMetrics:
    """The metric objects, built once the multiprocess directory is set (prometheus-client reads it then)."""

    def __init__(self) -> None:
        self.tasks = Counter(
            "blade_worker_tasks",
            "Tasks finished by this worker, by task name and outcome",
            ["task", "outcome"],
        )
        self.task_seconds = Histogram(
            "blade_worker_task_duration_seconds", "Wall time of a task", ["task"], buckets=_TIME_BUCKETS
        )
        self.queue_wait = Histogram(
            "blade_worker_queue_wait_seconds",
            "Time between a task's publication and its start (time in queue)",
            ["queue"],
            buckets=_TIME_BUCKETS,
        )
        self.busy = Gauge(
            "blade_worker_busy", "1 while a pool process runs a task", ["task"], multiprocess_mode="livesum"
        )
        self.step = Gauge(
            "blade_training_step",
            "Outer step of a running unlearn request",
            RUNNING_LABELS,
            multiprocess_mode="livemostrecent",
        )
        self.progress = Gauge(
            "blade_training_progress_ratio",
            "Outer step / step cap of a running unlearn request",
            RUNNING_LABELS,
            multiprocess_mode="livemostrecent",
        )
        self.lam = Gauge(
            "blade_training_lambda",
            "Dual variable lambda of a running request",
            RUNNING_LABELS,
            multiprocess_mode="livemostrecent",
        )
        self.l_ret = Gauge(
            "blade_training_l_ret",
            "Retain loss L_ret of a running request",
            RUNNING_LABELS,
            multiprocess_mode="livemostrecent",
        )
        self.l_fgt = Gauge(
            "blade_training_l_fgt",
            "Forget loss L_fgt of a running request",
            RUNNING_LABELS,
            multiprocess_mode="livemostrecent",
        )
        self.epsilon = Gauge(
            "blade_training_epsilon",
            "Retain-loss budget epsilon of a running request",
            RUNNING_LABELS,
            multiprocess_mode="livemostrecent",
        )
        self.step_rate = Gauge(
            "blade_training_outer_step_rate",
            "Outer steps per second of a running request",
            RUNNING_LABELS,
            multiprocess_mode="livemostrecent",
        )
        self.steps_total = Counter("blade_training_steps", "Outer steps trained", ["method"])
        self.run_seconds = Histogram(
            "blade_training_duration_seconds",
            "Wall time of one training run",
            ["method", "outcome"],
            buckets=_TIME_BUCKETS,
        )
        self.run_steps = Histogram(
            "blade_training_run_steps",
            "Outer steps of one training run",
            ["method", "outcome"],
            buckets=_STEP_BUCKETS,
        )
        self.gpu_peak = Gauge(
            "blade_gpu_memory_peak_bytes",
            "Peak GPU memory allocated by the last task",
            ["device"],
            multiprocess_mode="mostrecent",
        )
        self.audit_chain_ok = Gauge(
            "blade_audit_chain_ok",
            "1 when the audit chain and every signed head verified at the reconciler's last check, else 0",
            multiprocess_mode="mostrecent",
        )


_metrics: WorkerMetrics | None = None
_multiproc_dir: Path | None = None
_lock = threading.Lock()
_task_started: dict[str, float] = {}
# request id -> (first step seen, its time, last step, method, base model) for rates and run summaries
_runs: dict[str, dict[str, Any]] = {}


def metrics() -> WorkerMetrics:
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = WorkerMetrics()
        return _metrics


def enable_multiprocess(directory: Path | None = None) -> Path:
    """Switch prometheus-client to multiprocess mode (before any metric is built); returns the directory."""
    global _multiproc_dir
    if _multiproc_dir is not None:
        return _multiproc_dir
    if _metrics is not None:
        raise RuntimeError("worker metrics were built before multiprocess mode was enabled")
    directory = Path(directory or tempfile.mkdtemp(prefix="blade-worker-metrics-"))
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.db"):
        old.unlink()
    # prometheus-client reads this variable; children forked later inherit it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.get_value_class()
    _multiproc_dir = directory
    return directory


def multiprocess_registry():
    registry = CollectorRegistry()
    if _multiproc_dir is not None:
        MultiProcessCollector(registry, path=str(_multiproc_dir))
    return registry


def start_metrics_server(port: int, *, host: str = "0.0.0.0", tries: int = 10) -> int | None:
    """Serve the worker's metrics on `port` (or the next free one of `tries`); returns the port or None."""
    for candidate in range(port, port + tries):
        try:
            start_http_server(candidate, addr=host, registry=multiprocess_registry())
        except OSError:
            continue
        log.info("worker.metrics.serving", extra={"port": candidate})
        return candidate
    log.warning("worker.metrics.no_port", extra={"port": port, "tries": tries})
    return None


# --- what the task code calls --------------------------------------------------------------------------


def observe_step(
    *,
    request_id: str,
    base_model: str = "",
    method: str = "",
    record: dict[str, Any],
    total_steps: int | None = None,
) -> None:
    """One outer step of a running unlearn request (a `history.json` record; `total_steps`: its step cap)."""
    m = metrics()
    labels = (str(request_id), base_model or "", method or "")
    step = int(record.get("step", 0))
    now = time.monotonic()
    run = _runs.setdefault(
        str(request_id),
        {"first_step": step, "first_t": now, "method": method, "base_model": base_model, "steps": 0},
    )
    run["steps"] = run.get("steps", 0) + 1
    run["last_step"] = step
    m.step.labels(*labels).set(step)
    if total_steps:
        m.progress.labels(*labels).set(min(1.0, step / total_steps))
    for gauge, key in ((m.lam, "lambda"), (m.l_ret, "L_ret"), (m.l_fgt, "L_fgt"), (m.epsilon, "epsilon")):
        value = record.get(key)
        if isinstance(value, int | float):
            gauge.labels(*labels).set(float(value))
    elapsed = now - run["first_t"]
    if elapsed > 0 and step > run["first_step"]:
        m.step_rate.labels(*labels).set((step - run["first_step"]) / elapsed)
    m.steps_total.labels(method or "").inc()


def observe_run_finished(*, request_id: str, outcome: str, duration_s: float | None = None) -> None:
    """A run ended (`outcome`: the request's, e.g. succeeded, failed or cancelled; else the task's state):
    record its duration and steps, drop its live gauges."""
    m = metrics()
    run = _runs.pop(str(request_id), None)
    if run is None:
        return
    method = run.get("method") or ""
    if duration_s is None:
        duration_s = time.monotonic() - run["first_t"]
    m.run_seconds.labels(method, outcome).observe(duration_s)
    m.run_steps.labels(method, outcome).observe(run.get("last_step", 0))
    labels = (str(request_id), run.get("base_model") or "", method)
    multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
    for gauge in (m.step, m.progress, m.lam, m.l_ret, m.l_fgt, m.epsilon, m.step_rate):
        if multiprocess:  # its files cannot drop a series: NaN marks it ended until the process exits
            gauge.labels(*labels).set(float("nan"))
        else:
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)


def _gpu_memory_peak() -> None:
    torch = sys.modules.get("torch")  # only if the task loaded it; never initialise CUDA here
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    for index in range(torch.cuda.device_count()):
        peak = torch.cuda.max_memory_allocated(index)
        if peak:
            metrics().gpu_peak.labels(f"cuda:{index}").set(peak)


# --- Celery signal handlers --------------------------------------------------------------------------------


def _task_name(task: Any, sender: Any = None) -> str:
    return str(getattr(task, "name", None) or getattr(sender, "name", None) or sender or "unknown")


def _on_prerun(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    m = metrics()
    _task_started[task_id or ""] = time.monotonic()
    request = getattr(task, "request", None)
    published = getattr(request, HEADER_PUBLISHED_AT, None)
    headers = getattr(request, "headers", None)
    if published is None and isinstance(headers, dict):
        published = headers.get(HEADER_PUBLISHED_AT)
    queue = ((getattr(request, "delivery_info", None) or {}).get("routing_key")) or "unknown"
    if isinstance(published, int | float | str):
        with contextlib.suppress(ValueError):
            m.queue_wait.labels(queue).observe(max(0.0, time.time() - float(published)))
    m.busy.labels(_task_name(task)).set(1)


def _on_postrun(
    task_id: str | None = None,
    task: Any = None,
    state: str | None = None,
    kwargs: dict | None = None,
    **_: Any,
) -> None:
    m = metrics()
    name = _task_name(task)
    started = _task_started.pop(task_id or "", None)
    duration = time.monotonic() - started if started is not None else None
    if duration is not None:
        m.task_seconds.labels(name).observe(duration)
    m.tasks.labels(name, (state or "unknown").lower()).inc()
    m.busy.labels(name).set(0)
    request_id = (kwargs or {}).get("request_id")
    if request_id is not None and str(request_id) in _runs:
        observe_run_finished(request_id=str(request_id), outcome=(state or "unknown").lower())
    _gpu_memory_peak()


def _on_process_shutdown(**_: Any) -> None:
    # A pool child exits (on GPU queues after every task): its live gauges go with it.
    if _multiproc_dir is not None:
        mark_process_dead(os.getpid(), path=str(_multiproc_dir))


def _on_worker_init(**_: Any) -> None:
    """Main worker process, before the pool starts: multiprocess dir, HTTP server. (Its heartbeat is the
    database row that `worker/heartbeat.py` renews; the API exports its age.)"""
    settings = get_settings()
    directory = Path(settings.data_dir) / "worker-metrics" / f"{socket.gethostname()}-{os.getpid()}"
    try:
        enable_multiprocess(directory)
    except RuntimeError:
        log.warning("worker.metrics.single_process")
    port = settings.worker_metrics_port
    if port:
        start_metrics_server(port)


def _on_worker_shutdown(**_: Any) -> None:
    if _multiproc_dir is not None:
        shutil.rmtree(_multiproc_dir, ignore_errors=True)


def connect_signals() -> None:
    """Connect the handlers (the publish-time header they read is stamped by `broker.app`)."""
    signals.task_prerun.connect(_on_prerun, weak=False, dispatch_uid="blade-metrics-prerun")
    signals.task_postrun.connect(_on_postrun, weak=False, dispatch_uid="blade-metrics-postrun")
    signals.worker_init.connect(_on_worker_init, weak=False, dispatch_uid="blade-metrics-worker-init")
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False, dispatch_uid="blade-metrics-shutdown")
    signals.worker_process_shutdown.connect(
        _on_process_shutdown, weak=False, dispatch_uid="blade-metrics-process-shutdown"
    )
