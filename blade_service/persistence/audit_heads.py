"""Signed heads of the audit chain, kept outside the database: removing the newest entries is detected.

The hash chain (`persistence/audit.py`) shows any change to an entry that has a successor, but not the loss of
the newest entries: a chain cut short is still a valid chain. So, like a transparency log's signed tree head,
the head `(id, hash)` is signed with the service's Ed25519 key (`persistence/signing.py`, the certificates'
key) and stored in the artifact store, one immutable object per head:

    audit-heads/<id, 20 digits>-<first 16 hex of hash>.json
    {"log": "blade-audit", "head_id", "head_hash", "signed_at", "algorithm", "key_id", "signature"}

with the signature over the canonical JSON of every other field. Heads are signed whenever `verify` runs on an
intact chain, periodically by the reconciler, and whenever a certificate is issued (`current_signed_head`,
which a certificate embeds). `check_signed_heads` then requires every stored head to still be in the chain:
the entry `head_id` exists and has `head_hash`; a truncated or rewritten log fails it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from blade_service.persistence import audit, signing
from blade_service.persistence.db import after_commit
from blade_service.persistence.models import AuditEntry
from blade_service.persistence.settings import Settings
from blade_service.persistence.storage import Storage

log = logging.getLogger("blade.audit")

HEADS_PREFIX = "audit-heads"
LOG_NAME = "blade-audit"


def head_key(head_id: int, head_hash: str) -> str:
    return f"{HEADS_PREFIX}/{head_id:020d}-{head_hash[:16]}.json"


def _signed_bytes(record: dict[str, Any]) -> bytes:
    body = {k: v for k, v in record.items() if k != "signature"}
    return audit.canonical_json(body).encode()


def current_signed_head(session: Session, storage: Storage, settings: Settings) -> dict[str, Any] | None:
    """The newest entry's head, signed and stored (once per head); None for an empty log.

    Certificates embed this record; anyone with the published public key (`GET /certificate-keys`) can check
    its signature, and `GET /audit-log/verify` checks that the head is still in the chain. Publishes the key
    in the caller's transaction and stores the record when that transaction commits (`db.after_commit`):
    a rollback leaves no head behind naming a key, or an entry, that the rollback took back.
    """
    head_id, head_hash = audit.head(session)
    if head_id is None:
        return None
    key = head_key(head_id, head_hash)
    if storage.exists(key):
        stored: dict[str, Any] = json.loads(storage.get_bytes(key))
        return stored
    private = signing.load_private_key(settings)
    record: dict[str, Any] = {
        "log": LOG_NAME,
        "head_id": head_id,
        "head_hash": head_hash,
        "signed_at": datetime.now(UTC).isoformat(),
        "algorithm": signing.ALGORITHM,
        "key_id": signing.publish_key(session, private),
    }
    record["signature"] = signing.sign(private, _signed_bytes(record))
    data = json.dumps(record, sort_keys=True).encode()
    after_commit(session, lambda: _store(storage, key, data))
    return record


def _store(storage: Storage, key: str, data: bytes) -> None:
    """Store a signed head after its transaction committed. A failure is logged, not raised: the commit has
    happened, and a head left unstored only means the next signing (reconciler, verify) pins the chain."""
    try:
        storage.put_bytes(key, data)
    except Exception as exc:
        log.error("audit_heads.store_failed", extra={"key": key, "error": repr(exc)})


def verify_head_signature(record: dict[str, Any], public_keys: dict[str, str]) -> bool:
    """True when `record` is signed by the published key it names (`public_keys`: key id -> base64)."""
    public = public_keys.get(str(record.get("key_id")))
    if public is None or not isinstance(record.get("signature"), str):
        return False
    return signing.verify(signing.parse_public_key(public), _signed_bytes(record), record["signature"])


@dataclass(frozen=True)
class HeadCheck:
    checked: int  # signed heads read
    problem: str | None = None  # the first one that fails, worded for the caller
    head_id: int | None = None  # its entry id (only when the caller may see it)


def check_signed_heads(session: Session, storage: Storage, *, reveal_ids: bool) -> HeadCheck:
    """Every stored signed head must carry a valid signature and still be in the chain (same id, same hash).

    `reveal_ids` False (a tenant's view): problems do not name entry ids, which may be other tenants'.
    """
    public_keys = {k["key_id"]: k["public_key"] for k in signing.published_keys(session)}
    keys = storage.list_keys(HEADS_PREFIX)
    for checked, key in enumerate(keys, start=1):
        try:
            record = json.loads(storage.get_bytes(key))
            head_id, head_hash = int(record["head_id"]), str(record["head_hash"])
        except (ValueError, KeyError, TypeError):
            name = key if reveal_ids else "a signed head"
            return HeadCheck(checked, f"{name} is unreadable (altered or corrupt)")
        where = f"entry {head_id}" if reveal_ids else "an entry"
        if not verify_head_signature(record, public_keys):
            return HeadCheck(
                checked,
                f"the signed head of {where} ({record.get('signed_at')}) has no valid signature",
                head_id if reveal_ids else None,
            )
        if session.scalar(select(AuditEntry.hash).where(AuditEntry.id == head_id)) != head_hash:
            return HeadCheck(
                checked,
                f"the chain no longer contains the head signed at {record.get('signed_at')} ({where}): "
                "the newest entries were removed or rewritten",
                head_id if reveal_ids else None,
            )
    return HeadCheck(len(keys))
