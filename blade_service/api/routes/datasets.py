"""`POST /datasets` (multipart `file`), `GET /datasets`, `GET /datasets/{id}`, `DELETE /datasets/{id}`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Query, UploadFile

from blade_service.api.deps import ReadKey, SessionDep, SettingsDep, StorageDep, SubmitKey
from blade_service.api.pagination import Cursor, Limit, Offset, Page, decode_cursor, page
from blade_service.api.schemas import DatasetOut, ErrorOut
from blade_service.persistence import auth, datasets, retention
from blade_service.persistence.errors import Invalid, TooLarge

router = APIRouter(prefix="/datasets", tags=["datasets"])


@router.post("", status_code=201, response_model=DatasetOut)
def upload_dataset(
    session: SessionDep,
    storage: StorageDep,
    settings: SettingsDep,
    key: SubmitKey,
    file: UploadFile = File(description="JSON, JSON Lines or .txt; QA rows or text rows"),
) -> DatasetOut:
    """Store a forget/retain dataset after checking every row (errors name the file, line and field)."""
    data = file.file.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise TooLarge(f"file: larger than the {settings.max_upload_bytes} byte limit", field="file")
    if not data:
        raise Invalid(f"{file.filename or 'file'}: the file is empty", code="invalid_dataset", field="file")
    dataset = datasets.create_dataset(
        session,
        storage,
        tenant_id=key.tenant_id,
        filename=file.filename,
        data=data,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    return DatasetOut.of(dataset)


@router.get("", response_model=Page[DatasetOut])
def list_datasets(
    session: SessionDep,
    key: ReadKey,
    limit: Limit = 100,
    cursor: Cursor = None,
    offset: Offset = 0,
    purged: Annotated[
        bool | None, Query(description="false: only datasets whose bytes are kept; true: only purged ones")
    ] = None,
) -> Page[DatasetOut]:
    """Newest first, a cursor page."""
    after = decode_cursor(cursor, "iso,str")
    found = datasets.list_datasets(
        session,
        tenant_id=key.tenant_id,
        limit=limit + 1,
        offset=offset,
        after=(after[0], after[1]) if after else None,
        purged=purged,
    )
    return page([DatasetOut.of(d) for d in found], limit=limit, key=lambda d: [d.created_at, d.id])


@router.get("/{dataset_id}", response_model=DatasetOut)
def get_dataset(dataset_id: str, session: SessionDep, key: ReadKey) -> DatasetOut:
    return DatasetOut.of(datasets.get_dataset(session, tenant_id=key.tenant_id, dataset_id=dataset_id))


@router.delete(
    "/{dataset_id}", response_model=DatasetOut, responses={404: {"model": ErrorOut}, 409: {"model": ErrorOut}}
)
def delete_dataset(dataset_id: str, session: SessionDep, storage: StorageDep, key: SubmitKey) -> DatasetOut:
    """Delete the dataset's bytes now (409 while a queued or running request uses it); the record stays with
    its sha256 and row count, marked `purged_at`. Forget data is also purged when its request ends."""
    dataset = retention.delete_dataset(
        session,
        storage,
        tenant_id=key.tenant_id,
        dataset_id=dataset_id,
        actor=auth.actor_of(key),
        actor_key_id=key.id,
    )
    session.commit()
    return DatasetOut.of(dataset)
