"""API keys: created random and shown once, stored as sha256, scoped (`submit`, `read`, `admin`) per tenant.

The first start with `BLADE_BOOTSTRAP_ADMIN_KEY` set creates that key as an admin key of the `default`
tenant (`bootstrap_admin_key`); a later start that finds it revoked re-activates it, logs that loudly and
audits it (the operator's way back in). A tenant's last active admin key cannot be revoked (409).

`KeyCache` keeps a looked-up live key in memory for `KEY_CACHE_TTL_S` seconds, so a status poll costs no
key query. A revocation takes effect at once in every process: through this process (`revoke_key`) its
`_on_revoke` hook drops the key, and for one TTL afterwards that key is always read from the database, so a
lookup racing the revoking transaction cannot put it back; on PostgreSQL the other API processes hear it by
LISTEN/NOTIFY and drop it the same way, and their caches are off whenever they are not listening
(`persistence/key_revocations.py`). A cache hit writes nothing: `last_used_at` is refreshed (at most once a
minute) on the lookups that miss.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, joinedload, make_transient_to_detached
from sqlalchemy.orm.attributes import set_committed_value

from blade_service.persistence import audit, key_revocations
from blade_service.persistence.db import execute_read
from blade_service.persistence.errors import Conflict, Invalid, NotFound
from blade_service.persistence.models import ApiKey, Base, Scope, Tenant, utcnow
from blade_service.persistence.settings import Settings

log = logging.getLogger("blade.auth")

DEFAULT_TENANT = "default"
KEY_PREFIX = "blade_"
_TOUCH_EVERY = timedelta(minutes=1)  # last_used_at is refreshed at most this often (reads stay read-only)
# How long a key stays cached: the bound on how late another process's revocation takes effect here.
KEY_CACHE_TTL_S = 5.0
KEY_CACHE_MAX = 10_000  # entries; only live keys are cached, so this bounds memory, not correctness


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def generate_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def actor_of(key: ApiKey) -> str:
    """How a key appears in the audit log."""
    return f"key:{key.id}"


def is_operator(key: ApiKey) -> bool:
    """An admin key of the default tenant: runs the installation (sees every tenant's audit entries)."""
    return key.has_scope(Scope.ADMIN) and key.tenant.name == DEFAULT_TENANT


def tenant_scope(key: ApiKey) -> str | None:
    """The tenant whose objects `key` may see; None for the operator, who sees every tenant's."""
    return None if is_operator(key) else key.tenant_id


def normalise_scopes(scopes: Iterable[str]) -> list[str]:
    """Known scopes, deduplicated, in a fixed order; Invalid naming the first unknown one."""
    given = list(scopes)
    known = [s.value for s in Scope]
    for scope in given:
        if scope not in known:
            raise Invalid(f"scopes: unknown scope {scope!r}; choose from {', '.join(known)}", field="scopes")
    if not given:
        raise Invalid("scopes: at least one scope is needed", field="scopes")
    return [s for s in known if s in given]


def tenant_named(session: Session, *, name: str) -> Tenant:
    """The tenant called `name`; Invalid naming `tenant` when there is none."""
    tenant = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
    if tenant is None:
        raise Invalid(f"tenant: no tenant named {name!r}", field="tenant")
    return tenant


# A new tenant's name: letters, digits, '.', '_', '-', starting with a letter or digit (fullmatch), and
# no other tenant's name in another letter case: `DEFAULT`, `default ` or `default` in fullwidth letters
# would read as the operator's tenant in an audit log.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def get_or_create_tenant(session: Session, *, name: str) -> Tenant:
    tenant = session.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
    if tenant is not None:
        return tenant
    if not TENANT_NAME.fullmatch(name):
        raise Invalid(
            "tenant: 1-100 characters of letters, digits, '.', '_', '-', starting with a letter or digit",
            field="tenant",
        )
    twin = session.scalars(select(Tenant.name).where(func.lower(Tenant.name) == name.lower())).first()
    if twin is not None:
        raise Invalid(
            f"tenant: {name!r} differs from the tenant {twin!r} only in letter case", field="tenant"
        )
    tenant = Tenant(name=name)
    session.add(tenant)
    session.flush()
    return tenant


def create_key(
    session: Session,
    *,
    tenant: Tenant,
    name: str,
    scopes: Iterable[str],
    actor: str,
    actor_key_id: str | None = None,
    secret: str | None = None,
) -> tuple[ApiKey, str]:
    """A new key and its secret (shown once: only the sha256 is stored)."""
    secret = secret or generate_secret()
    key_hash = hash_key(secret)
    if session.scalars(select(ApiKey.id).where(ApiKey.key_hash == key_hash)).first():
        raise Conflict("that key already exists", code="key_exists")
    key = ApiKey(
        tenant_id=tenant.id, name=name, key_hash=key_hash, prefix=secret[:12], scopes=normalise_scopes(scopes)
    )
    session.add(key)
    session.flush()
    audit.append(
        session,
        action="api_key.create",
        subject_type="api_key",
        subject_id=key.id,
        actor=actor,
        actor_key_id=actor_key_id,
        tenant_id=tenant.id,
        data={"name": name, "scopes": key.scopes},
    )
    return key, secret


def authenticate(session: Session, secret: str) -> ApiKey | None:
    """The live key with this secret (its tenant loaded in the same query), or None."""
    if not secret:
        return None
    query = select(ApiKey).where(ApiKey.key_hash == hash_key(secret)).options(joinedload(ApiKey.tenant))
    key: ApiKey | None = execute_read(session, query).scalars().one_or_none()
    if key is None or key.revoked_at is not None:
        return None
    now = utcnow()
    if key.last_used_at is None or now - key.last_used_at > _TOUCH_EVERY:
        key.last_used_at = now
    return key


def _columns(obj: Any) -> dict[str, Any]:
    return {c.key: getattr(obj, c.key) for c in obj.__mapper__.column_attrs}


_Row = TypeVar("_Row", bound=Base)


def _detached(cls: type[_Row], columns: dict[str, Any]) -> _Row:
    """A detached instance with these column values: usable like a loaded row (attaching it never INSERTs)."""
    obj = cls(**{k: list(v) if isinstance(v, list) else v for k, v in columns.items()})
    make_transient_to_detached(obj)
    return obj


class KeyCache:
    """Live keys by secret hash for `ttl_s` seconds; `drop(key_id)` on revocation (see the module doc)."""

    def __init__(self, ttl_s: float = KEY_CACHE_TTL_S, max_entries: int = KEY_CACHE_MAX):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}
        self._revoked: dict[str, float] = {}  # key id -> until when it bypasses the cache
        self._lock = threading.Lock()
        self.enabled = True  # False: every lookup reads the database (no revocation listener yet)
        _caches.add(self)

    def set_enabled(self, enabled: bool) -> None:
        with self._lock:
            self.enabled = enabled
            if not enabled:
                self._entries.clear()

    def get(self, key_hash: str) -> ApiKey | None:
        """A fresh detached copy of the cached key (with its tenant), or None on a miss."""
        with self._lock:
            entry = self._entries.get(key_hash) if self.enabled else None
            if entry is None:
                return None
            expires, key_cols, tenant_cols = entry
            if expires < time.monotonic() or self._bypassed(key_cols["id"]):
                del self._entries[key_hash]
                return None
        key = _detached(ApiKey, key_cols)
        set_committed_value(key, "tenant", _detached(Tenant, tenant_cols))
        return key

    def put(self, key: ApiKey) -> None:
        with self._lock:
            if not self.enabled or self._bypassed(key.id):
                return
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[key.key_hash] = (
                time.monotonic() + self.ttl_s,
                _columns(key),
                _columns(key.tenant),
            )

    def drop(self, key_id: str) -> None:
        """Forget `key_id` now and keep it out of the cache for one TTL (a racing lookup cannot re-add it)."""
        with self._lock:
            self._revoked[key_id] = time.monotonic() + self.ttl_s
            for key_hash in [h for h, e in self._entries.items() if e[1]["id"] == key_id]:
                del self._entries[key_hash]

    def _bypassed(self, key_id: str) -> bool:
        until = self._revoked.get(key_id)
        if until is None:
            return False
        if until < time.monotonic():
            del self._revoked[key_id]
            return False
        return True


_caches: weakref.WeakSet[KeyCache] = weakref.WeakSet()


def authenticate_cached(session: Session, secret: str, cache: KeyCache) -> ApiKey | None:
    """`authenticate` through `cache`: a hit issues no query; a miss looks the key up (and caches it)."""
    if not secret:
        return None
    key = cache.get(hash_key(secret))
    if key is not None:
        return key
    key = authenticate(session, secret)
    if key is not None:
        cache.put(key)
    return key


def list_keys(session: Session, *, tenant_id: str) -> list[ApiKey]:
    return list(
        session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at))
    )


def _active_admin_keys(session: Session, tenant_id: str) -> list[ApiKey]:
    """The tenant's live admin keys, read under a lock on the tenant row so two revocations take turns."""
    session.scalars(select(Tenant).where(Tenant.id == tenant_id).with_for_update()).one()
    keys = session.scalars(
        select(ApiKey)
        .where(ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None))
        .execution_options(populate_existing=True)
    )
    return [k for k in keys if k.has_scope(Scope.ADMIN)]


def _drop_from_caches(key_id: str) -> None:
    for cache in list(_caches):
        cache.drop(key_id)


_on_revoke: list[Callable[[str], None]] = [
    _drop_from_caches
]  # callables(key_id) run on every revocation, e.g. to drop the key from a cache


def revoke_key(
    session: Session, *, tenant_id: str, key_id: str, actor: str, actor_key_id: str | None = None
) -> ApiKey:
    """Revoke at once; Conflict when it is the tenant's last active admin key (that would lock it out)."""
    key = session.get(ApiKey, key_id)
    if key is None or key.tenant_id != tenant_id:
        raise NotFound(f"no API key {key_id!r}")
    if key.revoked_at is None:
        if key.has_scope(Scope.ADMIN) and [k.id for k in _active_admin_keys(session, tenant_id)] == [key.id]:
            raise Conflict(
                f"API key {key.id} is the last active admin key of tenant {key.tenant.name!r}: revoking it "
                "would lock the tenant out; create another admin key first",
                code="last_admin_key",
            )
        key.revoked_at = utcnow()
        for hook in _on_revoke:
            hook(key.id)
        key_revocations.notify_revoked(session, key.id)  # the other API processes' caches, on commit
        audit.append(
            session,
            action="api_key.revoke",
            subject_type="api_key",
            subject_id=key.id,
            actor=actor,
            actor_key_id=actor_key_id,
            tenant_id=tenant_id,
        )
    return key


def _reactivate(session: Session, key: ApiKey) -> None:
    """Bring a revoked bootstrap key back (with the admin scope): the operator's way back in."""
    log.warning(
        "bootstrap admin key %s (%s) was revoked at %s; BLADE_BOOTSTRAP_ADMIN_KEY is set, so it is ACTIVE "
        "again. Unset or change BLADE_BOOTSTRAP_ADMIN_KEY to retire it.",
        key.id,
        key.prefix,
        key.revoked_at.isoformat() if key.revoked_at else "?",
    )
    revoked_at = key.revoked_at
    key.revoked_at = None
    if not key.has_scope(Scope.ADMIN):
        key.scopes = normalise_scopes([*key.scopes, Scope.ADMIN.value])
    audit.append(
        session,
        action="api_key.reactivate",
        subject_type="api_key",
        subject_id=key.id,
        actor="system",
        tenant_id=key.tenant_id,
        reason="BLADE_BOOTSTRAP_ADMIN_KEY is set at start-up",
        data={"revoked_at": revoked_at.isoformat() if revoked_at else None},
    )


def bootstrap_admin_key(session_factory: Callable[[], Session], settings: Settings) -> ApiKey | None:
    """Create `settings.bootstrap_admin_key` as an admin key of the default tenant unless it exists;
    re-activate it (logged loudly, audited) if it was revoked."""
    secret = settings.bootstrap_admin_key
    if not secret:
        return None
    with session_factory() as session:
        try:
            with session.begin():
                key = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(secret))).one_or_none()
                if key is not None and (key.revoked_at is not None or not key.has_scope(Scope.ADMIN)):
                    _reactivate(session, key)
                if key is None:
                    tenant = get_or_create_tenant(session, name=DEFAULT_TENANT)
                    key, _ = create_key(
                        session,
                        tenant=tenant,
                        name="bootstrap admin",
                        scopes=[Scope.ADMIN.value],
                        actor="system",
                        secret=secret,
                    )
            return key
        except (IntegrityError, Conflict):  # another process created it at the same moment
            with session.begin():
                return session.scalars(
                    select(ApiKey).where(ApiKey.key_hash == hash_key(secret))
                ).one_or_none()
