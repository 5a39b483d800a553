"""Database engines and sessions from `Settings`, and the start-up migration step.

PostgreSQL (production) goes through psycopg 3: a `postgresql://` URL is read as `postgresql+psycopg://`.
SQLite (the embedded default) is set up for several processes (API + worker) on one file: WAL journal,
foreign keys on, a busy timeout, and every transaction started with `BEGIN IMMEDIATE`, so a transaction that
will write holds the write lock from its first statement instead of failing to upgrade a stale read snapshot.

    engine = get_engine(settings)
    with session_scope(settings) as session:  # commits, or rolls back on an exception
        ...
    upgrade_to_head(settings.resolved_database_url())  # what the API runs on start-up

PostgreSQL pools check connections out without a pre-ping (it cost a round trip per request): connections
are recycled after `POOL_RECYCLE_S`, and a disconnect (server restart, idle timeout) invalidates the pool so
the next checkout connects afresh; reads made with `execute_read` retry once on such a disconnect. Reads that
need one statement use `read_session_factory`: on PostgreSQL its sessions run in autocommit, so a lone
SELECT costs exactly one round trip (no BEGIN before it, no ROLLBACK after it). `after_commit(session, fn)`
runs a side effect outside the database (a file in the artifact store) only once the transaction it
describes has committed.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, Engine, Executable, Result, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker

from blade_service.persistence.settings import Settings, get_settings


def _migrations_dir() -> Path:
    """The `migrations` package (beside this one, in the repo and when installed), found unimported."""
    spec = importlib.util.find_spec("blade_service.migrations")
    if spec is None or spec.origin is None:
        raise ImportError(
            "blade_service.migrations: the package is not installed beside blade_service.persistence"
        )
    return Path(spec.origin).resolve().parent


MIGRATIONS_DIR = _migrations_dir()

POOL_RECYCLE_S = 1800  # below common server/proxy idle timeouts (PgBouncer's server_idle_timeout: 600 s+)

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
    kwargs.setdefault("pool_pre_ping", False)  # recycle + retry instead (module doc)
    kwargs.setdefault("pool_recycle", POOL_RECYCLE_S)
    # Kept open: up to 20 (an API process under a few dozen concurrent polls checks out more than 10 at once,
    # and overflow connections are closed on return, so each burst paid PostgreSQL a backend start per extra
    # connection); 30 at most, as before.
    kwargs.setdefault("pool_size", 20)
    kwargs.setdefault("max_overflow", 10)
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


def listen_dsn(settings: Settings) -> str | None:
    """The database as a libpq DSN for a LISTEN connection of its own (plain psycopg); None unless it is
    PostgreSQL (SQLite has no NOTIFY)."""
    url = make_url(settings.resolved_database_url())
    if url.get_backend_name() != "postgresql":
        return None
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def session_factory(settings: Settings | None = None) -> sessionmaker[Session]:
    return sessionmaker(get_engine(settings), expire_on_commit=False)


def read_session_factory(settings: Settings | None = None) -> sessionmaker[Session]:
    """Sessions for reads only: autocommit on PostgreSQL (one round trip per statement, nothing to roll
    back); the ordinary sessions on SQLite. Never write through one: each statement commits on its own."""
    engine = get_engine(settings)
    if engine.dialect.name == "postgresql":
        engine = engine.execution_options(isolation_level="AUTOCOMMIT")
    return sessionmaker(engine, expire_on_commit=False)


def execute_read(
    session: Session, statement: Executable, params: dict[str, Any] | None = None, *, columns: bool = False
) -> Result[*tuple[Any, ...]]:
    """`session.execute(statement)`, run once more when the first try found the connection dead (the pool
    then connects afresh), if it opened the session's transaction: nothing done before it is lost.

    `columns`: the statement selects plain columns, no entities, so it runs on the session's connection,
    past the ORM's execute path (0.3 ms of CPU less a status poll, docs/performance.md); the rows are the
    same."""

    def run() -> Result[*tuple[Any, ...]]:
        if columns:
            return session.connection().execute(statement, params)
        return session.execute(statement, params)

    fresh = not session.in_transaction()
    try:
        return run()
    except DBAPIError as exc:
        if not (fresh and exc.connection_invalidated):
            raise
        session.rollback()
        return run()


_AFTER_COMMIT = "blade.after_commit"  # session.info key: the actions `after_commit` queued


def after_commit(session: Session, action: Callable[[], None]) -> None:
    """Run `action` when the session's current transaction commits; drop it if the transaction rolls back or
    the session closes first (a savepoint's rollback inside it does not count)."""
    session.info.setdefault(_AFTER_COMMIT, []).append(action)


@event.listens_for(Session, "after_commit")
def _run_after_commit(session: Session) -> None:
    for action in session.info.pop(_AFTER_COMMIT, []):
        action()


@event.listens_for(Session, "after_transaction_end")
def _drop_after_commit(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:  # the outermost transaction ended: committed (run above) or not
        session.info.pop(_AFTER_COMMIT, None)


@contextmanager
def session_scope(settings: Settings | None = None) -> Iterator[Session]:
    """A short session: commit at the end, roll back on an exception."""
    with session_factory(settings)() as session, session.begin():
        yield session


def alembic_config(url: str) -> Any:
    """An Alembic config for `url` that works from the repo and when installed (no alembic.ini needed)."""
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", normalise_url(url).replace("%", "%%"))
    config.attributes["configure_logging"] = False
    return config


@contextmanager
def migration_connection(engine: Engine) -> Iterator[Connection]:
    """A connection in one transaction, for migrations. On SQLite foreign keys go unenforced while it runs
    and are checked once before it commits: rebuilding a table (how SQLite drops a constraint) drops the
    table other rows reference, which an enforced key refuses even though the rebuilt table holds every row.
    `PRAGMA foreign_keys` changes only outside a transaction, hence on the driver's connection first."""
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        driver: Any = connection.connection.driver_connection
        if sqlite:
            driver.execute("PRAGMA foreign_keys=OFF")
        try:
            with connection.begin():
                yield connection
                if sqlite and (broken := connection.exec_driver_sql("PRAGMA foreign_key_check").all()):
                    raise RuntimeError(f"the migration left rows whose foreign keys dangle: {broken[:5]}")
        finally:
            if sqlite:
                driver.execute("PRAGMA foreign_keys=ON")


def upgrade_to_head(url: str) -> None:
    """`alembic upgrade head` on `url`: the API's start-up step; concurrent callers take turns."""
    engine = make_engine(url)
    try:
        with migration_connection(engine) as connection:
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
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
