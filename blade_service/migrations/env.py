"""Alembic environment: the URL comes from the caller (`persistence.db.upgrade_to_head`) or from Settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from blade_service.persistence.db import make_engine, migration_connection, normalise_url
from blade_service.persistence.models import Base
from blade_service.persistence.settings import get_settings

config = context.config
target_metadata = Base.metadata

if config.attributes.get("configure_logging", True) and config.config_file_name:
    from logging.config import fileConfig

    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    return normalise_url(config.get_main_option("sqlalchemy.url") or get_settings().resolved_database_url())


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif (connection := config.attributes.get("connection")) is not None:
    _run(connection)
else:
    engine = make_engine(_url())
    try:
        with migration_connection(engine) as conn:
            _run(conn)
    finally:
        engine.dispose()
