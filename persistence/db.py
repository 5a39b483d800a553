"""Database engines and sessions from `Settings`, and the start-up migration step.

PostgreSQL (production) goes through psycopg 3: a `postgresql://` URL is read as `postgresql+psycopg://`.
SQLite (the embedded default) is set up for several processes (API + worker) on one file: WAL journal,
foreign keys on, a busy timeout, and every transaction started with `BEGIN IMMEDIATE`, so a transaction that
will write holds the write lock from its first statement instead of failing to upgrade a stale read snapshot.

    engine = get_engine(settings)
    with session_scope(settings) as session:  # commits, or rolls back on an exception
        ...
    upgrade_to_head(settings.resolved_database_url())  # what the API runs on start-up
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from persistence.settings import Settings, get_settings

# The `migrations` package (beside this one, in the repo and when installed), found without importing it.
MIGRATIONS_DIR = Path(importlib.util.find_spec("migrations").origin).resolve().parent

_engines: dict[str, Engine] = {}
_lock = threading.Lock()


def normalise_url(url: str) -> str:
    """`postgresql://` and `postgres://` mean psycopg 3 here; everything else is left as given."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+psycopg://" + url[len(plain) :]
    return url


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # we issue BEGIN ourselves (below)
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def _sqlite_begin(conn: Any) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def make_engine(url: str, **kwargs: Any) -> Engine:
    """A new engine for `url` with the backend's settings (use `get_engine` for the shared one)."""
    url = normalise_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 20)
    return create_engine(url, **kwargs)


def get_engine(settings: Settings | None = None) -> Engine:
    """The process-wide engine for the settings' database (one per URL)."""
    url = normalise_url((settings or get_settings()).resolved_database_url())
    with _lock:
        if url not in _engines:
            _engines[url] = make_engine(url)
        return _engines[url]


def dispose_engines() -> None:
    """Close every pooled connection (tests; a worker child after fork)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def session_factory(settings: Settings | None = None) -> sessionmaker[Session]:
    return sessionmaker(get_engine(settings), expire_on_commit=False)


@contextmanager
def session_scope(settings: Settings | None = None) -> Iterator[Session]:
    """A short session: commit at the end, roll back on an exception."""
    with session_factory(settings)() as session, session.begin():
        yield session


def alembic_config(url: str) -> Any:
    """An Alembic config for `url` that works from the repo and when installed (no alembic.ini needed)."""
    from alembic.config import Config

    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", normalise_url(url).replace("%", "%%"))
    config.attributes["configure_logging"] = False
    return config


def upgrade_to_head(url: str) -> None:
    """`alembic upgrade head` on `url`: the API's start-up step; concurrent callers take turns."""
    from alembic import command

    engine = make_engine(url)
    try:
        with engine.begin() as connection:
            if engine.dialect.name == "postgresql":
                # Two processes starting together (API replicas, API + worker) must not race on the DDL.
                connection.exec_driver_sql("SELECT pg_advisory_xact_lock(727272)")
            config = alembic_config(url)
            config.attributes["connection"] = connection
            command.upgrade(config, "head")
    finally:
        engine.dispose()


def current_revision(url: str) -> str | None:
    """The revision the database is at (None: not migrated)."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
