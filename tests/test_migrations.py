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
