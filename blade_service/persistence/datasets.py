"""Forget/retain datasets: validated on upload, stored by key, owned by one tenant."""

from __future__ import annotations

import hashlib
import re
from datetime import datetime
from pathlib import PurePosixPath

from sqlalchemy import select
from sqlalchemy.orm import Session

from blade_service.contracts.records import DatasetError, load_dataset_rows
from blade_service.persistence import audit
from blade_service.persistence.errors import Invalid, NotFound
from blade_service.persistence.models import Dataset, new_id
from blade_service.persistence.storage import Storage

SUFFIX_BY_LAYOUT = {"json": ".json", "jsonl": ".jsonl", "json-lines-of-arrays": ".jsonl", "txt": ".txt"}


def clean_filename(filename: str | None) -> str:
    """The base name of an uploaded file, reduced to safe characters (it only labels the dataset)."""
    name = PurePosixPath((filename or "").replace("\\", "/")).name
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:200]
    return name or "upload.jsonl"


def create_dataset(
    session: Session,
    storage: Storage,
    *,
    tenant_id: str,
    filename: str | None,
    data: bytes,
    actor: str,
    actor_key_id: str | None = None,
) -> Dataset:
    """Validate `data` (rows, fields; errors name file, line and field), store it, and record it."""
    name = clean_filename(filename)
    try:
        rows, kind, layout = load_dataset_rows(name, raw=data)
    except DatasetError as exc:
        raise Invalid(str(exc), code="invalid_dataset", field=exc.field or "file") from None
    dataset_id = new_id("ds")
    stored = storage.put_bytes(f"datasets/{tenant_id}/{dataset_id}{SUFFIX_BY_LAYOUT[layout]}", data)
    try:
        dataset = Dataset(
            id=dataset_id,
            tenant_id=tenant_id,
            name=name,
            sha256=hashlib.sha256(data).hexdigest(),
            rows=len(rows),
            format=layout,
            kind=kind,
            size_bytes=len(data),
            storage_key=stored.key,
            created_by_key_id=actor_key_id,
        )
        session.add(dataset)
        session.flush()
        audit.append(
            session,
            action="dataset.create",
            subject_type="dataset",
            subject_id=dataset.id,
            actor=actor,
            actor_key_id=actor_key_id,
            tenant_id=tenant_id,
            data={"name": name, "sha256": dataset.sha256, "rows": dataset.rows, "format": layout},
        )
    except BaseException:
        storage.delete(stored.key)
        raise
    return dataset


def get_dataset(session: Session, *, tenant_id: str, dataset_id: str) -> Dataset:
    """The tenant's dataset; NotFound for a missing one or another tenant's."""
    dataset = session.get(Dataset, dataset_id)
    if dataset is None or dataset.tenant_id != tenant_id:
        raise NotFound(f"no dataset {dataset_id!r}")
    return dataset


def list_datasets(
    session: Session,
    *,
    tenant_id: str,
    limit: int = 100,
    offset: int = 0,
    after: tuple[datetime, str] | None = None,
    purged: bool | None = None,
) -> list[Dataset]:
    """Newest first; `after` (created_at, id) of the last dataset of the previous page starts after it;
    `purged` False: only those whose bytes are kept, True: only the records of purged ones."""
    query = (
        select(Dataset)
        .where(Dataset.tenant_id == tenant_id)
        .order_by(Dataset.created_at.desc(), Dataset.id)
        .limit(limit)
        .offset(offset)
    )
    if after is not None:
        created, dataset_id = after
        query = query.where(
            (Dataset.created_at < created) | ((Dataset.created_at == created) & (Dataset.id > dataset_id))
        )
    if purged is not None:
        query = query.where(Dataset.purged_at.is_not(None) if purged else Dataset.purged_at.is_(None))
    return list(session.scalars(query))
