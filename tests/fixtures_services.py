"""Fixtures for the service tests, on the real PostgreSQL of this machine.

- `pg_url`: a fresh, uniquely named database on 127.0.0.1:5432 for the whole test session, dropped at the end
  (`BLADE_TEST_POSTGRES_URL` names another server's maintenance database; default
  `postgresql://postgres@127.0.0.1:5432/postgres`). Tests fail when no server answers (tests/tiers.py).
- `service_redis`, `service_settings`, `api_app`, `api_client`: the API app on that database, artifacts in a
  temporary directory, tasks published to dedicated Redis db numbers (7, 8; per pytest process: REDIS_DBS)
  where no worker consumes them;
  `enqueued()` lists the request ids waiting in the broker's `unlearn` queue.
- `admin_key`: the bootstrap admin key (default tenant). `tenant`: a fresh tenant with an admin key per test,
  so tests never see each other's rows; `make_key(tenant, scopes)` adds keys; `headers(key)` builds auth.
- `upload_dataset(client, key, rows)`, `qa_rows(n)`: dataset helpers; `row_counts(engine)`: "nothing stored".
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.tiers import unavailable

ADMIN_SECRET = "blade_test_bootstrap_" + secrets.token_hex(8)
DEFAULT_MAINTENANCE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def _maintenance_url() -> str:
    return os.environ.get("BLADE_TEST_POSTGRES_URL", DEFAULT_MAINTENANCE_URL)


@contextmanager
def temporary_database() -> Iterator[str]:
    """Create a uniquely named empty PostgreSQL database; yield its URL; drop it (fail if no server)."""
    import psycopg
    from sqlalchemy.engine import make_url

    maintenance = _maintenance_url()
    try:
        admin = psycopg.connect(maintenance, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        unavailable(f"no PostgreSQL at {maintenance}: {exc}")
    name = f"blade_test_{uuid.uuid4().hex[:12]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    url = make_url(maintenance.replace("postgresql://", "postgresql+psycopg://", 1)).set(database=name)
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL of a new empty PostgreSQL database shared by the session's tests, dropped at the end."""
    from blade_service.persistence.db import dispose_engines

    with temporary_database() as url:
        yield url
        dispose_engines()


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    """A new empty PostgreSQL database for one test (migrations, tampering), dropped after it."""
    with temporary_database() as url:
        yield url


# Redis db numbers per pytest process (`make test` runs TEST_JOBS of them, pytest-xdist): (service broker,
# service results, worker broker, worker results). No worker consumes the service tests' queue; the e2e
# services' workers consume theirs, so two processes must never share one.
REDIS_DBS = ((7, 8, 11, 12), (2, 3, 4, 5), (6, 9, 10, 13))


def xdist_slot() -> int:
    """This pytest process's index among pytest-xdist's workers (gw0 -> 0); 0 when run without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    slot = int(worker.removeprefix("gw"))
    if slot >= len(REDIS_DBS):
        pytest.fail(f"{worker}: the suite has Redis db numbers for {len(REDIS_DBS)} processes (REDIS_DBS)")
    return slot


def redis_dbs() -> tuple[int, int, int, int]:
    """This process's Redis db numbers (REDIS_DBS)."""
    return REDIS_DBS[xdist_slot()]


@pytest.fixture(scope="session")
def service_redis() -> Iterator[tuple[str, str]]:
    """(broker URL, result-backend URL): dedicated db numbers of the local Redis, flushed before and after."""
    import redis

    base = os.environ.get("BLADE_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    broker, results = redis_dbs()[:2]
    urls = (f"{base}/{broker}", f"{base}/{results}")
    try:
        for url in urls:
            redis.Redis.from_url(url, socket_connect_timeout=2).flushdb()
    except redis.exceptions.ConnectionError as exc:
        unavailable(f"no Redis at {base}: {exc}")
    yield urls
    for url in urls:
        with contextlib.suppress(redis.exceptions.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=2).flushdb()


@pytest.fixture(scope="session")
def service_settings(pg_url, service_redis, tmp_path_factory):
    from blade_service.persistence.settings import Settings

    data_dir = tmp_path_factory.mktemp("service-data")
    return Settings(
        data_dir=data_dir,
        database_url=pg_url,
        broker_url=service_redis[0],
        result_backend=service_redis[1],
        storage_root=data_dir / "artifacts",
        bootstrap_admin_key=ADMIN_SECRET,
        max_upload_bytes=256 * 1024,
        generate_timeout_s=2.0,
    )


@contextmanager
def celery_configured_for(settings) -> Iterator[Any]:
    """Point this process's Celery app (`broker.app.app`, what the API publishes with) at the settings'
    broker and result backend, as BLADE_BROKER_URL would at start-up; restore it afterwards."""
    from blade_service.broker.app import app, build_config

    wanted = build_config(settings)
    saved = {key: app.conf.get(key) for key in wanted}

    def drop_connections() -> None:  # the app caches its pool and backend on first use; kombu keeps the pools
        app._pool = None
        app.amqp._producer_pool = None
        app._backend_cache = None
        app._local = threading.local()

    drop_connections()
    app.conf.update(wanted)
    try:
        yield app
    finally:
        drop_connections()
        app.conf.update(saved)


@pytest.fixture(scope="module")
def api_app(service_settings):
    """The API app on the session's database, publishing to the session's Redis (per test module, so the
    process-wide Celery configuration is put back before other modules run)."""
    from blade_service.api.main import create_app

    with celery_configured_for(service_settings):
        yield create_app(service_settings)


@pytest.fixture(scope="session")
def enqueued(service_redis) -> Callable[[], list[str]]:
    """enqueued() -> ids of the requests whose unlearn task waits in the `unlearn` queue, oldest first."""
    import base64

    import redis

    client = redis.Redis.from_url(service_redis[0])

    def ids() -> list[str]:
        found = []
        for queue in sorted(client.keys("unlearn*")):  # one list per priority level
            for raw in reversed(client.lrange(queue, 0, -1)):  # LPUSHed: oldest last
                message = json.loads(raw)
                _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
                if "request_id" in kwargs:  # the queue also carries compactions (`operation_id`)
                    found.append(kwargs["request_id"])
        return found

    return ids


@pytest.fixture(scope="module")
def api_client(api_app):
    from fastapi.testclient import TestClient

    with TestClient(api_app) as client:
        yield client


@pytest.fixture(scope="module")
def db_engine(api_app):
    return api_app.state.session_factory.kw["bind"]


@pytest.fixture
def db_session(api_app):
    with api_app.state.session_factory() as session:
        yield session


def headers(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


@pytest.fixture(scope="module")
def admin_key(api_client) -> str:
    return ADMIN_SECRET


@dataclass
class TestTenant:
    name: str
    admin: str  # secret of an admin key

    __test__ = False


@pytest.fixture
def make_key(api_client, admin_key) -> Callable[..., str]:
    """make_key(tenant_name, scopes=[...]) -> a new key's secret for that tenant (created if new)."""

    def make(tenant: str, scopes: list[str] | tuple[str, ...] = ("admin",), name: str = "test key") -> str:
        resp = api_client.post(
            "/api-keys",
            headers=headers(admin_key),
            json={"name": name, "scopes": list(scopes), "tenant": tenant},
        )
        assert resp.status_code == 201, resp.text
        return resp.json()["key"]

    return make


@pytest.fixture
def tenant(make_key) -> TestTenant:
    """A fresh tenant with an admin key: a clean slate for one test."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    return TestTenant(name=name, admin=make_key(name, ["admin"]))


def qa_rows(n: int = 3, prefix: str = "q") -> list[dict[str, str]]:
    return [{"question": f"{prefix} question {i}?", "answer": f"{prefix} answer {i}."} for i in range(n)]


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def upload_dataset(
    client,
    key: str,
    rows: list[dict[str, Any]] | None = None,
    *,
    filename: str = "data.jsonl",
    content: bytes | None = None,
) -> dict[str, Any]:
    """Upload and return the JSON answer (asserts 201)."""
    data = content if content is not None else jsonl(rows if rows is not None else qa_rows())
    resp = client.post(
        "/datasets", headers=headers(key), files={"file": (filename, data, "application/jsonl")}
    )
    assert resp.status_code == 201, resp.text
    return resp.json()


def register_model(
    client, key: str, name: str | None = None, *, shared: bool = False, operator: str = ADMIN_SECRET
) -> str:
    """A base model with a local source for `key`'s tenant (or shared), registered by the operator's key:
    a directory on the workers is the operator's to register."""
    name = name or f"bm-{uuid.uuid4().hex[:10]}"
    body: dict[str, Any] = {"name": name, "source": "/models/x", "shared": shared}
    if not shared:
        body["tenant"] = client.get("/me", headers=headers(key)).json()["tenant"]
    resp = client.post("/base-models", headers=headers(operator), json=body)
    assert resp.status_code == 201, resp.text
    return name


@dataclass
class Ready:
    """A tenant with a registered base model and a forget + retain dataset: ready to submit."""

    tenant: TestTenant
    base_model: str
    forget: str
    retain: str

    __test__ = False

    def body(self, **overrides: Any) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "forget_dataset": self.forget,
            "retain_dataset": self.retain,
            "method": "blade",
            "params": {"max_steps": 5},
            **overrides,
        }


@pytest.fixture
def ready(api_client, tenant) -> Ready:
    model = register_model(api_client, tenant.admin)
    forget = upload_dataset(api_client, tenant.admin, qa_rows(3, "forget"))["id"]
    retain = upload_dataset(api_client, tenant.admin, qa_rows(5, "retain"))["id"]
    return Ready(tenant, model, forget, retain)


TABLES = (
    "tenants",
    "api_keys",
    "datasets",
    "base_models",
    "unlearn_requests",
    "training_events",
    "adapter_versions",
    "audit_entries",
)


def row_counts(engine) -> dict[str, int]:
    from sqlalchemy import text

    with engine.connect() as conn:
        return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in TABLES}


def stored_files(root: Path) -> int:
    return sum(1 for p in Path(root).rglob("*") if p.is_file())
