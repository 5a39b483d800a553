"""Fixtures for the worker and end-to-end tests: real processes against real PostgreSQL and Redis.

- `worker_pg_url`: a fresh PostgreSQL database (migrated) for the service-tier worker tests; each `e2e`
  service gets one of its own too, so the live workers' reconciler never touches rows other tests left
  half-made (nor the API tests' database); dropped at the end. Skip when no server answers.
- `redis_urls`: broker and result-backend URLs on dedicated Redis db numbers (11, 12; per pytest process:
  `fixtures_services.REDIS_DBS`), flushed at start/end.
- `make_request`: a factory of queued requests in `worker_pg_url`'s database (rows only, nothing stored).
- `tiny_model_dir`: a tiny Llama + tokenizer (blade_core.testing), built in well under a second.
- `e2e` (per module): an `E2EService`: a real uvicorn API subprocess (`blade api`) and real Celery worker
  subprocesses (`blade worker`): a GPU-style worker (`-Q unlearn`, prefork, one task per child, acks late)
  and an inference + maintenance worker (threads, with the periodic reconciler), sharing one artifact root,
  with short leases and a fast reconciler so crash recovery takes seconds. `e2e.kill_gpu_worker()` SIGKILLs
  the GPU worker's whole process group; `e2e.start_gpu_worker()` starts a new one (with its own data dir).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_services import redis_dbs
from tests.tiers import unavailable

ROOT = Path(__file__).resolve().parent.parent
E2E_ADMIN_KEY = "blade_e2e_admin_" + secrets.token_hex(8)
# The worker's ROUGE generations in tests (BLADE_EVAL_MAX_NEW_TOKENS; the service's default is 200): the tiny
# models' answers are a few tokens, and 200 greedy steps per measured row dominate a test request's time.
EVAL_MAX_NEW_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Any, timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    """Poll `predicate()` until it returns something truthy; its value, or AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last value: {last!r})")


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
    """Signal the child's whole process group; SIGKILL it if it is still there after `timeout`."""
    stop_processes([proc], sig, timeout)


def stop_processes(procs: list[subprocess.Popen], sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
    """`stop_process` for several children side by side: all are signalled at once and share one `timeout`,
    so their shutdowns overlap instead of adding up."""
    running = []
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
                running.append(proc)
    deadline = time.monotonic() + timeout
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(line[:400] for line in path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- databases ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """A new PostgreSQL database migrated to head (its SQLAlchemy URL); dropped afterwards. Fails without a
    server."""
    import psycopg
    from sqlalchemy.engine import make_url

    maintenance = os.environ.get("BLADE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    try:
        admin = psycopg.connect(maintenance, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unavailable(f"no PostgreSQL at {maintenance}: {exc}")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(maintenance.replace("postgresql://", "postgresql+psycopg://", 1)).set(database=name)
    rendered = url.render_as_string(hide_password=False)
    try:
        from blade_service.persistence.db import upgrade_to_head

        upgrade_to_head(rendered)
        yield rendered
    finally:
        from blade_service.persistence.db import dispose_engines

        dispose_engines()
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(scope="session")
def worker_pg_url() -> Iterator[str]:
    """The database of the worker's service-tier tests (their half-made requests stay out of e2e's way)."""
    with fresh_database("blade_worker") as url:
        yield url


@pytest.fixture(scope="session")
def redis_urls() -> Iterator[tuple[str, str]]:
    """(broker URL, result backend URL) on dedicated db numbers of the local Redis, flushed."""
    import redis

    base = os.environ.get("BLADE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    broker_db, results_db = redis_dbs()[2:]
    broker, results = f"{base}/{broker_db}", f"{base}/{results_db}"
    try:
        for url in (broker, results):
            redis.Redis.from_url(url, socket_connect_timeout=2).flushdb()
    except redis.exceptions.ConnectionError as exc:
        unavailable(f"no Redis at {base}: {exc}")
    yield broker, results
    for url in (broker, results):
        with contextlib.suppress(redis.exceptions.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=2).flushdb()


@pytest.fixture(scope="session")
def worker_settings(worker_pg_url, tmp_path_factory):
    """Settings for calling the worker's functions in the test process (database `worker_pg_url`)."""
    from blade_service.persistence.settings import Settings

    data_dir = tmp_path_factory.mktemp("worker-unit")
    return Settings(
        data_dir=data_dir,
        database_url=worker_pg_url,
        storage_root=data_dir / "artifacts",
        lease_seconds=4,
        heartbeat_seconds=1,
        eval_max_new_tokens=EVAL_MAX_NEW_TOKENS,
    )


@pytest.fixture
def worker_session(worker_settings):
    from blade_service.persistence.db import session_factory

    with session_factory(worker_settings)() as session:
        yield session


@pytest.fixture
def make_request(worker_settings):
    """make_request(base_model_id=None) -> request id: a queued blade request of a new tenant on a (new or
    given) base model, its datasets rows that name no stored file."""
    from sqlalchemy import select

    from blade_service.persistence.db import session_scope
    from blade_service.persistence.models import BaseModel, Dataset, Tenant, UnlearnRequest

    with session_scope(worker_settings) as s:
        tenant = Tenant(name=f"jobs-{uuid.uuid4().hex[:8]}")
        s.add(tenant)
        s.flush()
        ds = Dataset(
            tenant_id=tenant.id,
            name="d.jsonl",
            sha256="0" * 64,
            rows=1,
            format="jsonl",
            kind="qa",
            size_bytes=1,
            storage_key="datasets/x/d.jsonl",
        )
        s.add(ds)
        s.flush()
        tenant_id, ds_id = tenant.id, ds.id

    def make(base_model_id: str | None = None) -> str:
        with session_scope(worker_settings) as s:
            if base_model_id is None:
                bm = BaseModel(name=f"bm-{uuid.uuid4().hex[:8]}", source="/nowhere")
                s.add(bm)
                s.flush()
                base_model_id = bm.id
            seq = (
                s.scalar(
                    select(UnlearnRequest.queue_seq)
                    .where(UnlearnRequest.base_model_id == base_model_id)
                    .order_by(UnlearnRequest.queue_seq.desc())
                    .limit(1)
                )
                or 0
            ) + 1
            req = UnlearnRequest(
                tenant_id=tenant_id,
                base_model_id=base_model_id,
                forget_dataset_id=ds_id,
                retain_dataset_id=ds_id,
                method="blade",
                params={},
                request_fingerprint="f" * 64,
                queue_seq=seq,
            )
            s.add(req)
            s.flush()
            return req.id

    return make


# --- a tiny base model --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random-init Llama (2 layers, hidden 32) with its tokenizer, as a Hugging Face model dir."""
    from blade_core.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model")


def forget_rows(n: int = 6) -> list[dict[str, Any]]:
    from blade_core.testing import tiny_qa_rows

    return tiny_qa_rows(n, seed=1, prefix="f")


def retain_rows(n: int = 10) -> list[dict[str, Any]]:
    from blade_core.testing import tiny_qa_rows

    return tiny_qa_rows(n, seed=2, prefix="r")


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    import json

    return "".join(json.dumps(r) + "\n" for r in rows).encode()


# --- the end-to-end service ---------------------------------------------------------------------------------


@dataclass
class E2EService:
    url: str
    admin_key: str
    env: dict[str, str]
    root: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    gpu_starts: int = 0

    __test__ = False

    def client(self, key: str | None = None):
        from blade_service.client import BladeClient

        return BladeClient(self.url, api_key=key or self.admin_key, timeout=60)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        self.logs[name] = log
        handle = open(log, "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "blade_service.cli", *argv],
            cwd=ROOT,
            env=env or self.env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()
        self.procs[name] = proc
        return proc

    def start_gpu_worker(self) -> subprocess.Popen:
        """A GPU-queue worker as production runs it (prefork, -c 1, one task per child), own data dir; returns
        once it is ready."""
        self.gpu_starts += 1
        env = dict(self.env, BLADE_DATA_DIR=str(self.root / f"gpu-{self.gpu_starts}"))
        proc = self._spawn(
            "gpu",
            [
                "worker",
                "--queues",
                "unlearn",
                "--concurrency",
                "1",
                "--pool",
                "prefork",
                "--no-beat",
                "--name",
                f"gpu{self.gpu_starts}@e2e",
            ],
            env,
        )
        self.wait_worker(f"gpu{self.gpu_starts}@e2e")
        return proc

    def spawn_inference_worker(self) -> subprocess.Popen:
        """The inference + maintenance worker (threads, with beat), without waiting for it: the caller starts
        the GPU worker meanwhile (their imports overlap) and then `wait_worker("inference@e2e")`."""
        env = dict(self.env, BLADE_DATA_DIR=str(self.root / "inference"))
        return self._spawn(
            "inference",
            [
                "worker",
                "--queues",
                "inference,maintenance",
                "--pool",
                "threads",
                "--concurrency",
                "2",
                "--beat",
                "--name",
                "inference@e2e",
            ],
            env,
        )

    def wait_worker(self, name: str, timeout: float = 90.0) -> None:
        """Until the worker's heartbeat row says it is up (written on Celery's worker_ready)."""
        from sqlalchemy import create_engine, text

        engine = create_engine(self.env["BLADE_DATABASE_URL"])
        started = time.time()

        def ready() -> bool:
            for proc_name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise AssertionError(
                        f"{proc_name} exited ({proc.returncode}):\n{tail(self.logs[proc_name])}"
                    )
            with engine.connect() as conn:
                row = conn.execute(
                    text("SELECT last_seen, alive FROM worker_heartbeats WHERE worker_name = :n"), {"n": name}
                ).first()
            return bool(row and row.alive and row.last_seen.timestamp() >= started - 1)

        try:
            wait_until(ready, timeout, 0.3, f"worker {name} to be ready")
        finally:
            engine.dispose()

    def kill_gpu_worker(self) -> None:
        """SIGKILL the GPU worker and its pool children (a crash: no cleanup, no ack)."""
        proc = self.procs["gpu"]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        stop_processes([self.procs[name] for name in ("api", "gpu", "inference") if name in self.procs])

    def log_tails(self) -> str:
        return "\n".join(f"--- {name} ---\n{tail(path)}" for name, path in self.logs.items())


@pytest.fixture(scope="module")
def e2e(redis_urls, tmp_path_factory) -> Iterator[E2EService]:
    """A fresh service per test module (its own database, flushed broker): modules never see each other's
    requests, and no idle workers run while other modules' tests do."""
    import redis

    for url in redis_urls:
        redis.Redis.from_url(url, socket_connect_timeout=2).flushdb()
    with fresh_database("blade_e2e") as db_url:
        yield from _run_service(db_url, redis_urls, tmp_path_factory.mktemp("e2e"))


def _run_service(e2e_pg_url: str, redis_urls: tuple[str, str], root: Path) -> Iterator[E2EService]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLADE_")}
    env.update(
        {
            "BLADE_DATABASE_URL": e2e_pg_url,
            "BLADE_BROKER_URL": redis_urls[0],
            "BLADE_RESULT_BACKEND": redis_urls[1],
            "BLADE_DATA_DIR": str(root / "api"),
            # Shared by every process: the local storage backend.
            "BLADE_STORAGE_ROOT": str(root / "artifacts"),
            "BLADE_BOOTSTRAP_ADMIN_KEY": E2E_ADMIN_KEY,
            "BLADE_HOST": "127.0.0.1",
            "BLADE_PORT": str(port),
            "BLADE_DEVICE": "cpu",
            "BLADE_LEASE_SECONDS": "4",
            "BLADE_HEARTBEAT_SECONDS": "1",
            "BLADE_RECONCILE_INTERVAL_S": "2",
            "BLADE_REQUEUE_AFTER_S": "20",
            "BLADE_GENERATE_TIMEOUT_S": "60",
            "BLADE_EVAL_MAX_NEW_TOKENS": str(EVAL_MAX_NEW_TOKENS),
            # Tests reuse one forget dataset across requests; the purge test sets a model's retention to 0.
            "BLADE_FORGET_RETENTION_SUCCESS_S": "86400",
            # Webhook tests receive on 127.0.0.1: the operator's explicit choice, retried fast.
            "BLADE_WEBHOOK_ALLOW_LOOPBACK": "true",
            "BLADE_WEBHOOK_RETRY_BASE_S": "1",
            "BLADE_WEBHOOK_INTERVAL_S": "1",
            "BLADE_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    service = E2EService(url=f"http://127.0.0.1:{port}", admin_key=E2E_ADMIN_KEY, env=env, root=root)
    try:
        service._spawn("api", ["api", "--host", "127.0.0.1", "--port", str(port)])
        import httpx

        def api_up() -> bool:
            if service.procs["api"].poll() is not None:
                raise AssertionError(f"api exited:\n{tail(service.logs['api'])}")
            try:
                return httpx.get(f"{service.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(api_up, 60, 0.3, "the API")
        service.spawn_inference_worker()
        service.start_gpu_worker()
        service.wait_worker("inference@e2e")
        yield service
    finally:
        service.stop()


@pytest.fixture
def e2e_logs(e2e, request) -> Iterator[E2EService]:
    """`e2e`, printing the processes' last log lines when the test fails."""
    yield e2e
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(e2e.log_tails())


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep
