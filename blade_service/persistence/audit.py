"""The append-only audit log: every state change, with actor, time and reason, in one hash chain.

Each entry stores the hash of the one before it and its own hash,

    hash = sha256(prev_hash + canonical_json(entry))      (the first entry's prev_hash is 64 zeros)

where the canonical JSON holds every column except `id`, `prev_hash` and `hash` (keys sorted, no whitespace,
times in ISO 8601 UTC). Changing, removing or reordering any entry breaks every hash after it; `verify_chain`
finds the first entry that does not fit, and `verify_tenant` checks one tenant's entries and their links to
their neighbours without reporting anything about other tenants' entries. Losing the newest entries leaves a
valid (shorter) chain: `persistence/audit_heads.py` keeps signed heads outside the table to catch that.
The database refuses UPDATE and DELETE on the table (triggers in the initial migration) and `prev_hash` is
unique, so two writers can never fork the chain; on PostgreSQL appends take a transaction-scoped advisory
lock so they queue instead of failing, and one INSERT ... SELECT reads the head, links the entry to it and
computes the hash above in SQL (`_pg_append_statement`): one round trip after the lock.

Appending joins the caller's transaction: the entry commits (or rolls back) with the change it records.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import (
    JSON,
    ColumnElement,
    Executable,
    FromClause,
    Insert,
    Select,
    Subquery,
    Table,
    Text,
    bindparam,
    func,
    select,
    true,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.orm import Session

from blade_service.persistence import webhook_outbox
from blade_service.persistence.models import GENESIS_HASH, AuditEntry, utcnow

_APPEND_LOCK = 727273  # pg_advisory_xact_lock key for appends
# PostgreSQL: a column that takes the append lock (held until the transaction ends) when a statement evaluates
# it. A writer may fold it into a statement of its own before `append(..., chain_locked=True)` or
# `spliced_append`, one round trip fewer; the head is still read by a later statement, whose snapshot is taken
# once the lock is held.
CHAIN_LOCK = func.pg_advisory_xact_lock(_APPEND_LOCK)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def entry_payload(entry: AuditEntry) -> dict[str, Any]:
    """What the hash covers: every column but id, prev_hash and hash."""
    return _payload({name: getattr(entry, name) for name in _CONTENT})


def _payload(content: dict[str, Any]) -> dict[str, Any]:
    """`entry_payload` of an entry's `_CONTENT` columns."""
    return content | {"created_at": content["created_at"].isoformat()}


def compute_hash(prev_hash: str, payload: dict[str, Any]) -> str:
    return hashlib.sha256((prev_hash + canonical_json(payload)).encode()).hexdigest()


def append(
    session: Session,
    *,
    action: str,
    subject_type: str,
    subject_id: str,
    actor: str,
    actor_key_id: str | None = None,
    tenant_id: str | None = None,
    reason: str | None = None,
    data: dict[str, Any] | None = None,
    chain_locked: bool = False,
) -> AuditEntry:
    """Add one entry at the head of the chain, in the caller's transaction. `chain_locked`: an earlier
    statement of this transaction took the append lock already (`CHAIN_LOCK`), so it is not taken again."""
    draft = AuditEntry(
        created_at=utcnow(),
        tenant_id=tenant_id,
        actor=actor,
        actor_key_id=actor_key_id,
        action=action,
        subject_type=subject_type,
        subject_id=str(subject_id),
        reason=reason,
        data=json.loads(canonical_json(data or {})),
    )
    if session.get_bind().dialect.name == "postgresql":
        if not chain_locked:
            session.execute(select(CHAIN_LOCK))
        # One statement: it reads the head (its snapshot is taken after the lock is held) and hashes onto it.
        params = {f"v_{name}": getattr(draft, name) for name in _CONTENT}
        params["canonical"] = canonical_json(entry_payload(draft))
        entry: AuditEntry = session.execute(_pg_append_statement(), params).scalar_one()
    else:
        prev = session.scalar(_head_hash_query()) or GENESIS_HASH
        entry = draft
        entry.prev_hash, entry.hash = prev, compute_hash(prev, entry_payload(draft))
        session.add(entry)
    webhook_outbox.capture(session, entry)  # a tenant's webhook deliveries commit with the change
    session.flush()
    return entry


# The columns an append writes besides the links (prev_hash, hash); `entry_payload` covers exactly these.
_CONTENT = (
    "created_at",
    "tenant_id",
    "actor",
    "actor_key_id",
    "action",
    "subject_type",
    "subject_id",
    "reason",
    "data",
)


@functools.cache
def _head_hash_query() -> Select[str]:
    return select(AuditEntry.hash).order_by(AuditEntry.id.desc()).limit(1)


def _linked_to_head(canonical: ColumnElement[str]) -> tuple[Subquery, ColumnElement[str]]:
    """PostgreSQL: the chain's head (`prev`: its hash, GENESIS_HASH for an empty log) as a one-row subquery,
    and the hash of an entry whose canonical JSON is `canonical`, computed in SQL exactly as `compute_hash`
    does: hex(sha256(UTF-8 of prev_hash || canonical JSON))."""
    head = select(func.coalesce(_head_hash_query().scalar_subquery(), GENESIS_HASH).label("prev")).subquery(
        "head"
    )
    return head, func.encode(func.sha256(func.convert_to(head.c.prev.concat(canonical), "UTF8")), "hex")


@functools.cache
def _pg_append_statement() -> Executable:
    """PostgreSQL: INSERT ... SELECT that links the entry to the head and computes its hash in SQL
    (`_linked_to_head`), read back as the entity. Built once."""
    table = cast(Table, AuditEntry.__table__)
    head, digest = _linked_to_head(bindparam("canonical", type_=Text))
    content = [bindparam(f"v_{name}", type_=table.c[name].type) for name in _CONTENT]
    insert = table.insert().from_select(
        [*_CONTENT, "prev_hash", "hash"], select(*content, head.c.prev, digest)
    )
    return select(AuditEntry).from_statement(insert.returning(*table.c))


# What stands for the spliced integer while the canonical JSON is built (`spliced_params`). JSON escapes the
# NULs, so only data that holds this very string encodes the same way, and the split's count catches that.
_SLOT = "\x00slot\x00"
_SLOT_MARKER = json.dumps(_SLOT)


def spliced_params(
    *,
    action: str,
    subject_type: str,
    subject_id: str,
    actor: str,
    actor_key_id: str | None,
    tenant_id: str | None,
    data: dict[str, Any],
    slot: str,
) -> dict[str, Any] | None:
    """The bind parameters of `spliced_append` for one entry whose `data[slot]` is an integer the same
    statement computes (a request's queue number): its canonical JSON and its data's JSON, each split where
    that integer goes. None when the entry must go through `append` instead: its action is a webhook event
    (the deliveries are made from the entry), or the marker cannot be told apart in its JSON."""
    if action in webhook_outbox.EVENTS:
        return None
    content = {
        "created_at": utcnow(),
        "tenant_id": tenant_id,
        "actor": actor,
        "actor_key_id": actor_key_id,
        "action": action,
        "subject_type": subject_type,
        "subject_id": str(subject_id),
        "reason": None,
        "data": {**data, slot: _SLOT},
    }
    whole = canonical_json(_payload(content)).split(_SLOT_MARKER)
    own = canonical_json(content["data"]).split(_SLOT_MARKER)
    if len(whole) != 2 or len(own) != 2:
        return None
    params = {f"a_{name}": value for name, value in content.items() if name != "data"}
    return params | {
        "a_canonical_head": whole[0],
        "a_canonical_tail": whole[1],
        "a_data_head": own[0],
        "a_data_tail": own[1],
    }


def spliced_append(source: FromClause, value: ColumnElement[int]) -> Insert:
    """PostgreSQL: INSERT ... SELECT that appends one entry for each row of `source` (a CTE of the same
    statement), with `value` (a column of `source`) spliced into its data and its canonical JSON
    (`spliced_params` gives the rest), linked to the head and hashed in SQL (`_linked_to_head`). The
    transaction must hold the append lock (`CHAIN_LOCK`) since an earlier statement, so that this
    statement's snapshot is taken after the entry before it committed."""
    table = cast(Table, AuditEntry.__table__)
    text = sql_cast(value, Text)
    canonical = bindparam("a_canonical_head", type_=Text) + text + bindparam("a_canonical_tail", type_=Text)
    data = sql_cast(bindparam("a_data_head", type_=Text) + text + bindparam("a_data_tail", type_=Text), JSON)
    head, digest = _linked_to_head(canonical)
    content = [
        data if name == "data" else bindparam(f"a_{name}", type_=table.c[name].type) for name in _CONTENT
    ]
    rows = select(*content, head.c.prev, digest).select_from(source).join(head, true())
    return table.insert().from_select([*_CONTENT, "prev_hash", "hash"], rows)


@dataclass(frozen=True)
class ChainStatus:
    intact: bool
    checked: int  # entries verified (up to and including the first bad one)
    head_id: int | None  # the last entry that fits the chain
    head_hash: str  # its hash (GENESIS_HASH for an empty log)
    first_bad_id: int | None = None
    problem: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "intact": self.intact,
            "checked": self.checked,
            "head_id": self.head_id,
            "head_hash": self.head_hash,
            "first_bad_id": self.first_bad_id,
            "problem": self.problem,
        }


def verify_chain(session: Session) -> ChainStatus:
    """Walk the whole chain in id order and report the first entry whose links or hash do not fit."""
    expected, checked, head_id = GENESIS_HASH, 0, None
    for entry in session.scalars(
        select(AuditEntry).order_by(AuditEntry.id).execution_options(yield_per=1000)
    ):
        checked += 1
        if entry.prev_hash != expected:
            return ChainStatus(
                False,
                checked,
                head_id,
                expected,
                entry.id,
                f"entry {entry.id}: prev_hash does not match the entry before it "
                "(an entry was removed, reordered or altered)",
            )
        if compute_hash(entry.prev_hash, entry_payload(entry)) != entry.hash:
            return ChainStatus(
                False,
                checked,
                head_id,
                expected,
                entry.id,
                f"entry {entry.id}: content does not match its hash (the entry was altered)",
            )
        expected, head_id = entry.hash, entry.id
    return ChainStatus(True, checked, head_id, expected)


def verify_tenant(session: Session, *, tenant_id: str) -> ChainStatus:
    """Check only `tenant_id`'s entries, in id order: each one's hash covers its content and `prev_hash`, that
    `prev_hash` is the hash of the entry just before it in the chain, and the entry just after it links back
    to it. Neighbours may be other tenants' entries: they are read for the links, never reported."""
    window = select(
        AuditEntry.id.label("id"),
        func.lag(AuditEntry.hash).over(order_by=AuditEntry.id).label("before_hash"),
        func.lead(AuditEntry.prev_hash).over(order_by=AuditEntry.id).label("after_prev"),
    ).subquery()
    rows = session.execute(
        select(AuditEntry, window.c.before_hash, window.c.after_prev)
        .join(window, window.c.id == AuditEntry.id)
        .where(AuditEntry.tenant_id == tenant_id)
        .order_by(AuditEntry.id)
        .execution_options(yield_per=1000)
    )
    checked, head_id, head_hash = 0, None, GENESIS_HASH
    for entry, before_hash, after_prev in rows:
        checked += 1
        problem = None
        if entry.prev_hash != (before_hash or GENESIS_HASH):
            problem = (
                "prev_hash does not match the entry before it (an entry was removed, reordered or altered)"
            )
        elif compute_hash(entry.prev_hash, entry_payload(entry)) != entry.hash:
            problem = "content does not match its hash (the entry was altered)"
        elif after_prev is not None and after_prev != entry.hash:
            problem = "the entry after it does not link to it (this entry was altered, or its successor)"
        if problem:
            return ChainStatus(False, checked, head_id, head_hash, entry.id, f"entry {entry.id}: {problem}")
        head_id, head_hash = entry.id, entry.hash
    return ChainStatus(True, checked, head_id, head_hash)


def head(session: Session) -> tuple[int | None, str]:
    """(id, hash) of the newest entry; (None, GENESIS_HASH) for an empty log."""
    row = session.execute(
        select(AuditEntry.id, AuditEntry.hash).order_by(AuditEntry.id.desc()).limit(1)
    ).first()
    return (row[0], row[1]) if row else (None, GENESIS_HASH)


def list_entries(
    session: Session,
    *,
    tenant_id: str | None,
    action: str | None = None,
    subject_id: str | None = None,
    before_id: int | None = None,
    limit: int = 100,
) -> list[AuditEntry]:
    """Newest first; `tenant_id` None lists every tenant's (for operators), else only that tenant's."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if tenant_id is not None:
        query = query.where(AuditEntry.tenant_id == tenant_id)
    if action:
        query = query.where(AuditEntry.action == action)
    if subject_id:
        query = query.where(AuditEntry.subject_id == subject_id)
    if before_id is not None:
        query = query.where(AuditEntry.id < before_id)
    return list(session.scalars(query))
