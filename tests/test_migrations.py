"""Migrations upgrade an empty PostgreSQL and an empty SQLite to head, matching the models exactly."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from blade_service.persistence.db import current_revision, make_engine, upgrade_to_head
from blade_service.persistence.models import Base


def _upgrade_and_compare(url: str) -> None:
    assert current_revision(url) is None
    upgrade_to_head(url)
    upgrade_to_head(url)  # a second start changes nothing
    assert current_revision(url) is not None
    engine = make_engine(url)
    try:
        assert set(Base.metadata.tables) <= set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            diff = compare_metadata(
                MigrationContext.configure(conn, opts={"compare_type": False}), Base.metadata
            )
        assert diff == [], f"models and migrations differ: {diff}"
    finally:
        engine.dispose()


@pytest.mark.services
def test_upgrade_empty_postgres(fresh_pg_url):
    _upgrade_and_compare(fresh_pg_url)


def test_upgrade_empty_sqlite(tmp_path):
    _upgrade_and_compare(f"sqlite:///{tmp_path / 'new' / 'blade.db'}")


def test_downgrade_and_upgrade_again_on_sqlite(tmp_path):
    from alembic import command

    from blade_service.persistence.db import alembic_config

    url = f"sqlite:///{tmp_path / 'blade.db'}"
    upgrade_to_head(url)
    command.downgrade(alembic_config(url), "base")
    engine = make_engine(url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    upgrade_to_head(url)
    assert current_revision(url) is not None


def test_alembic_cli_config_works_from_the_repo(tmp_path, monkeypatch):
    """`alembic -c blade_service/migrations/alembic.ini upgrade head` with the URL from Settings
    (BLADE_DATABASE_URL)."""
    from pathlib import Path

    from alembic import command
    from alembic.config import Config

    import blade_service.persistence.settings as settings_module

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("BLADE_DATABASE_URL", url)
    settings_module.get_settings.cache_clear()
    try:
        ini = Path(__file__).resolve().parent.parent / "blade_service" / "migrations" / "alembic.ini"
        command.upgrade(Config(str(ini)), "head")
    finally:
        settings_module.get_settings.cache_clear()
    assert current_revision(url) is not None


def test_a_table_rebuild_on_a_populated_sqlite_keeps_every_row(tmp_path):
    """`make run`'s database, with requests and datasets pointing at a base model: 0008 rebuilds
    `base_models` (SQLite drops a constraint by copying the table), which an enforced foreign key refused
    ('FOREIGN KEY constraint failed' on DROP TABLE), so such a service could not start after an upgrade."""
    import json

    from alembic import command
    from sqlalchemy import text
    from starlette.testclient import TestClient

    from blade_service.api.main import create_app
    from blade_service.persistence.db import alembic_config
    from blade_service.persistence.settings import Settings

    url = f"sqlite:///{tmp_path / 'blade.db'}"
    secret = "blade_migration_test_0123456789abcdef"
    settings = Settings(data_dir=tmp_path, database_url=url, bootstrap_admin_key=secret)
    auth = {"Authorization": f"Bearer {secret}"}
    with TestClient(create_app(settings)) as client:
        assert (
            client.post("/base-models", headers=auth, json={"name": "m", "source": "/m"}).status_code == 201
        )
        rows = "".join(json.dumps({"question": f"q{i}?", "answer": f"a{i}."}) + "\n" for i in range(3))
        ids = [
            client.post("/datasets", headers=auth, files={"file": (f"{n}.jsonl", rows.encode())}).json()["id"]
            for n in ("f", "r")
        ]
        body = {"base_model": "m", "forget_dataset": ids[0], "retain_dataset": ids[1]}
        assert client.post("/unlearn-requests", headers=auth, json=body).status_code == 202
    engine = make_engine(url)

    def counts() -> dict[str, int]:
        with engine.connect() as conn:
            tables = ("base_models", "unlearn_requests", "datasets", "audit_entries")
            return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in tables}

    try:
        before = counts()
        assert before["unlearn_requests"] == 1
        command.downgrade(alembic_config(url), "0007_redundant_indexes")  # the rebuild, backwards
        assert counts() == before
        upgrade_to_head(url)  # and forwards, as a start-up runs it
        assert counts() == before
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA foreign_key_check").all() == []
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1  # enforced again afterwards
    finally:
        engine.dispose()
