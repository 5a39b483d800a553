"""Key revocations reach every API process at once: PostgreSQL LISTEN/NOTIFY beside the in-memory key cache.

`revoke_key` sends `NOTIFY blade_key_revoked, '<key id>'` in its transaction, so PostgreSQL delivers it
exactly when the revocation commits. Each API process runs one `RevocationListener`: a daemon thread on its
own connection that LISTENs and drops the key from this process's `KeyCache`s. While the listener is not
connected (start-up, a lost connection) the caches are switched off, so every lookup reads the database: a
revocation is never missed, only the cache's saving is. SQLite (`make run`) has one API process, where
`revoke_key`'s own hook already drops the key.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.orm import Session

from blade_service.persistence.db import listen_dsn
from blade_service.persistence.settings import Settings

log = logging.getLogger("blade.auth")

CHANNEL = "blade_key_revoked"
RECONNECT_S = 1.0  # wait between reconnection attempts
POLL_S = 1.0  # how often the thread looks at its stop flag while idle


def notify_revoked(session: Session, key_id: str) -> None:
    """Queue the revocation notice in the caller's transaction (delivered on commit; PostgreSQL only)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_notify(:channel, :key_id)"), {"channel": CHANNEL, "key_id": key_id})


class RevocationListener:
    """LISTEN on `CHANNEL` and call `on_revoked(key_id)`; `set_enabled(False)` while not listening."""

    def __init__(
        self, dsn: str, *, on_revoked: Callable[[str], None], set_enabled: Callable[[bool], None]
    ) -> None:
        self.dsn, self.on_revoked, self.set_enabled = dsn, on_revoked, set_enabled
        self.listening = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="blade-key-revocations", daemon=True)

    def start(self) -> RevocationListener:
        self.set_enabled(False)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.set_enabled(True)
                    self.listening.set()
                    while not self._stop.is_set():
                        for notice in conn.notifies(timeout=POLL_S):
                            self.on_revoked(notice.payload)
            except Exception as exc:  # lost connection: no cache until listening again
                log.warning("auth.revocation_listener_down", extra={"error": repr(exc)})
            finally:
                self.listening.clear()
                self.set_enabled(False)
            self._stop.wait(RECONNECT_S)


def listener_for(settings: Settings, cache: Any) -> RevocationListener | None:
    """A started listener feeding `cache` (a `persistence.auth.KeyCache`) on PostgreSQL; None on SQLite."""
    dsn = listen_dsn(settings)
    if dsn is None:
        return None
    return RevocationListener(dsn, on_revoked=cache.drop, set_enabled=cache.set_enabled).start()
