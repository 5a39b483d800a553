"""Fixtures for the service tests, on the real PostgreSQL of this machine.

- `pg_url`: a fresh, uniquely named database on 127.0.0.1:5432 for the whole test session, dropped at the end
  (`BLADE_TEST_POSTGRES_URL` names another server's maintenance database; default
  `postgresql://postgres@127.0.0.1:5432/postgres`). Tests skip when no server answers.
- `service_settings`, `api_app`, `api_client`: the API app on that database with artifacts under a temporary
  directory; `enqueued` lists the request ids the app handed to the workers (no broker needed).
- `admin_key`: the bootstrap admin key (default tenant). `tenant`: a fresh tenant with an admin key per test,
  so tests never see each other's rows; `make_key(tenant, scopes)` adds keys; `headers(key)` builds auth.
- `upload_dataset(client, key, rows)`, `qa_rows(n)`: dataset helpers; `row_counts(engine)`: "nothing stored".
"""

from __future__ import annotations

import json
import os
import secrets
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ADMIN_SECRET = "blade_test_bootstrap_" + secrets.token_hex(8)
DEFAULT_MAINTENANCE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def _maintenance_url() -> str:
    return os.environ.get("BLADE_TEST_POSTGRES_URL", DEFAULT_MAINTENANCE_URL)


@contextmanager
def temporary_database() -> Iterator[str]:
    """Create a uniquely named empty PostgreSQL database; yield its URL; drop it (skip if no server)."""
    psycopg = pytest.importorskip("psycopg")
    from sqlalchemy.engine import make_url

    maintenance = _maintenance_url()
    try:
        admin = psycopg.connect(maintenance, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.skip(f"no PostgreSQL at {maintenance}: {exc}")
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
    from persistence.db import dispose_engines

    with temporary_database() as url:
        yield url
        dispose_engines()


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    """A new empty PostgreSQL database for one test (migrations, tampering), dropped after it."""
    with temporary_database() as url:
        yield url


@pytest.fixture(scope="session")
def service_settings(pg_url, tmp_path_factory):
    from persistence.settings import Settings

    data_dir = tmp_path_factory.mktemp("service-data")
    return Settings(
        data_dir=data_dir,
        database_url=pg_url,
        storage_root=data_dir / "artifacts",
        bootstrap_admin_key=ADMIN_SECRET,
        max_upload_bytes=256 * 1024,
        generate_timeout_s=2.0,
    )


@pytest.fixture(scope="session")
def enqueued() -> list[str]:
    """Request ids the API handed to `worker.dispatch.enqueue_unlearn` (replaced by a recorder here)."""
    return []


@pytest.fixture(scope="session")
def api_app(service_settings, enqueued):
    import worker.dispatch as dispatch
    from api.main import create_app

    original = dispatch.enqueue_unlearn

    def record(request_id: str, **_: Any) -> bool:
        enqueued.append(request_id)
        return True

    dispatch.enqueue_unlearn = record
    try:
        yield create_app(service_settings)
    finally:
        dispatch.enqueue_unlearn = original


@pytest.fixture(scope="session")
def api_client(api_app):
    from fastapi.testclient import TestClient

    with TestClient(api_app) as client:
        yield client


@pytest.fixture(scope="session")
def db_engine(api_app):
    return api_app.state.session_factory.kw["bind"]


@pytest.fixture
def db_session(api_app):
    with api_app.state.session_factory() as session:
        yield session


def headers(key: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", **extra}


@pytest.fixture(scope="session")
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


def register_model(client, key: str, name: str | None = None, *, shared: bool = False) -> str:
    name = name or f"bm-{uuid.uuid4().hex[:10]}"
    resp = client.post(
        "/base-models", headers=headers(key), json={"name": name, "source": "/models/x", "shared": shared}
    )
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
