"""Where a request's artifacts live in storage and in the worker's local cache: storage keys of adapters and
checkpoints, fetching (and checking) datasets and adapter archives, and resolving a base model's source to a
loadable directory (a local dir, a storage key, or a hub id)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any, cast

from blade_service.contracts.errors import BaseModelUnavailable
from blade_service.persistence import hub, registry
from blade_service.persistence.errors import Invalid, NotFound
from blade_service.persistence.models import AdapterVersion, BaseModel
from blade_service.persistence.settings import Settings
from blade_service.persistence.storage import Storage, extract_archive, sha256_file
from blade_service.worker.errors import TaskFailure

log = logging.getLogger("blade.worker")


def adapter_key(*, base_model_id: str, request_id: str) -> str:
    """Where a request's adapter archive lives: one key per request (a redelivery overwrites, never adds)."""
    return f"adapters/{base_model_id}/{request_id}.tar.gz"


def checkpoint_key(*, request_id: str, step: int) -> str:
    return f"checkpoints/{request_id}/step-{step:06d}.tar.gz"


_STEP_IN_KEY = re.compile(r"step-(\d+)\.tar\.gz$")


def checkpoint_step(key: str | None) -> int:
    match = _STEP_IN_KEY.search(key or "")
    return int(match.group(1)) if match else 0


def cache_dir(settings: Settings, *parts: str) -> Path:
    path = settings.data_dir.resolve().joinpath("cache", *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def dataset_suffix(key: str) -> str:
    """The file extension a dataset keeps locally (the loader reads by extension); `.jsonl` by default."""
    name = key.rsplit("/", 1)[-1]
    for ext in (".jsonl", ".json", ".txt"):
        if name.endswith(ext):
            return ext
    return ".jsonl"


def fetch_adapter(storage: Storage, settings: Settings, *, adapter_id: str, key: str, sha256: str) -> Path:
    """The unpacked adapter dir of a registered version (cached per worker; adapters are immutable)."""
    target = cache_dir(settings, "adapters") / adapter_id
    if (target / "adapter_config.json").is_file():
        return target
    tmp = target.with_name(f".{adapter_id}.{uuid.uuid4().hex[:6]}")
    archive = tmp.with_suffix(".tar.gz")
    try:
        storage.get_to_path(key, archive)
        actual = sha256_file(archive)
        if sha256 and actual != sha256:
            raise TaskFailure(
                "artifact_corrupt",
                f"adapter {adapter_id}: stored archive has sha256 {actual}, the registry says {sha256}",
            )
        with open(archive, "rb") as fh:
            extract_archive(fh, tmp)
        with contextlib.suppress(OSError):
            os.replace(tmp, target)  # another process may have won the race: theirs is identical
    finally:
        archive.unlink(missing_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_base_model(storage: Storage, settings: Settings, source: str, revision: str | None = None) -> str:
    """A loadable directory for a base model's `source`: a local dir as is, a storage key unpacked into the
    worker's cache, anything else a hub id `org/name[@rev]` whose snapshot at the registered `revision` is
    fetched into the hub cache (HF_HOME; HF_TOKEN for gated models), then loaded as any local dir is."""
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if source.startswith(("/", "./", "../", "~")):
        # The message reaches the tenant (a request's error, a 502); which host missed it is the operator's.
        log.warning("base_model.missing_dir", extra={"source": source, "host": socket.gethostname()})
        raise TaskFailure(
            "base_model_unavailable", f"base model source {source!r} is not a directory on the workers"
        )
    with contextlib.suppress(ValueError):
        if storage.exists(source):
            digest = hashlib.sha256(source.encode()).hexdigest()[:16]
            target = cache_dir(settings, "base-models") / digest
            if not (target / "config.json").is_file():
                tmp = target.with_name(f".{digest}.{uuid.uuid4().hex[:6]}")
                storage.get_dir(source, tmp)
                with contextlib.suppress(OSError):
                    os.replace(tmp, target)
                shutil.rmtree(tmp, ignore_errors=True)
            return str(target)
    return _fetch_hub_model(source, revision)


def _fetch_hub_model(source: str, revision: str | None) -> str:
    from blade_core.modeling import fetch_hub_model

    try:
        ref = hub.parse(source, revision)
        return str(fetch_hub_model(ref.repo_id, ref.revision))
    except (Invalid, BaseModelUnavailable) as exc:
        log.warning("base_model.fetch_failed", extra={"source": source, "host": socket.gethostname()})
        raise TaskFailure("base_model_unavailable", f"base model {source!r}: {exc}") from exc


def task_base_model(session: Any, *, base_model_id: str | None, base_model: str | None) -> BaseModel | None:
    """The base model a generate or export task names: by id, or by a name only one model has (the form an
    API from before per-tenant names sent); None otherwise."""
    with contextlib.suppress(NotFound):
        return cast(
            BaseModel | None,
            session.get(BaseModel, base_model_id or registry.base_model_id(session, base_model or "")),
        )
    return None


def active_stack(session: Any, *, base_model_id: str) -> list[AdapterVersion]:
    """The effective stack of a base model: its active adapter versions in version order."""
    return registry.effective_stack(session, session.get(BaseModel, base_model_id))


def fetch_dataset(storage: Storage, ds: dict[str, str], dest: Path) -> Path:
    """A dataset's stored bytes at `dest` (kept when already there), checked against its recorded sha256."""
    if dest.is_file() and sha256_file(dest) == ds["sha256"]:
        return dest
    storage.get_to_path(ds["key"], dest)
    actual = sha256_file(dest)
    if ds["sha256"] and actual != ds["sha256"]:
        raise TaskFailure(
            "artifact_corrupt",
            f"dataset {ds['id']}: stored bytes have sha256 {actual}, the record says {ds['sha256']}",
        )
    return dest
