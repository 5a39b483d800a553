"""Artifact storage (datasets, adapters, checkpoints) behind one small interface, on local disk or S3.

Keys are relative, slash-separated paths such as `datasets/<tenant>/<id>.jsonl`. A key can never name a file
outside the store: `validate_key` refuses absolute paths, `..`, backslashes, empty or odd characters, and the
local backend also refuses any path that resolves (through symlinks) outside its root.

Directories (a PEFT adapter dir, a checkpoint dir) are stored as one deterministic `.tar.gz` archive (sorted
names, zeroed times and owners), so the same files always give the same sha256; `get_dir` unpacks one with
tarfile's `data` filter (no links out, no absolute names, no devices).

    storage = get_storage(settings)
    obj = storage.put_bytes("datasets/t/ds_1.jsonl", data)   # StoredObject(key, sha256, size)
    storage.put_dir("adapters/demo-tiny/ad_1.tar.gz", adapter_dir)
    storage.get_dir("adapters/demo-tiny/ad_1.tar.gz", dest)
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import tarfile
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from blade_service.persistence.settings import Settings, get_settings

CHUNK = 1024 * 1024
_KEY_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=+@-]*")  # fullmatch


class StorageError(Exception):
    """A storage operation failed (I/O, the remote store)."""


class InvalidKey(StorageError, ValueError):
    """A key that could name something outside the store."""


class ObjectNotFound(StorageError, FileNotFoundError):
    """No object under that key."""


@dataclass(frozen=True)
class StoredObject:
    key: str
    sha256: str
    size: int


def validate_key(key: str) -> str:
    """The key itself, when it is a safe relative path; InvalidKey otherwise."""
    if not isinstance(key, str) or not key or len(key) > 512:
        raise InvalidKey(f"invalid storage key {key!r}: must be 1-512 characters")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKey(f"invalid storage key {key!r}: must be a relative path with '/' separators")
    for part in key.split("/"):
        if part in ("", ".", "..") or not _KEY_PART.fullmatch(part):
            raise InvalidKey(f"invalid storage key {key!r}: bad component {part!r}")
    return key


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def archive_dir(src: str | Path, dest: IO[bytes]) -> None:
    """Write `src`'s files as a deterministic tar.gz to `dest` (symlinks and special files skipped)."""
    src = Path(src)
    if not src.is_dir():
        raise StorageError(f"{src}: not a directory")
    with (
        gzip.GzipFile(filename="", fileobj=dest, mode="wb", mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,
    ):
        for path in sorted(p for p in src.rglob("*") if not p.is_symlink()):
            if not (path.is_file() or path.is_dir()):
                continue
            info = tar.gettarinfo(str(path), arcname=path.relative_to(src).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_dir():
                tar.addfile(info)
            else:
                with open(path, "rb") as f:
                    tar.addfile(info, f)


def extract_archive(archive: IO[bytes], dest: str | Path) -> Path:
    """Unpack a tar.gz into `dest` with tarfile's `data` filter (nothing can land outside `dest`)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=archive, mode="r:gz") as tar:
            tar.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise StorageError(f"cannot unpack archive into {dest}: {exc}") from exc
    return dest


class Storage(ABC):
    """Put, get and check artifacts by key; every method validates the key first."""

    @abstractmethod
    def put_file(self, key: str, path: str | Path) -> StoredObject:
        """Copy a local file in under `key` (replacing what was there)."""

    @abstractmethod
    def open(self, key: str) -> IO[bytes]:
        """A readable binary stream of the object; the caller closes it. ObjectNotFound when missing."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; no error when it is not there."""

    @abstractmethod
    def size(self, key: str) -> int: ...

    def list_keys(self, prefix: str) -> list[str]:
        """Keys of every object under `prefix/`, sorted (e.g. the audit log's signed heads)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list keys")

    @abstractmethod
    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under `prefix/` (e.g. all checkpoints of one request); none there is fine."""

    def put_bytes(self, key: str, data: bytes) -> StoredObject:
        with tempfile.NamedTemporaryFile(delete=False) as tmp:
            tmp.write(data)
        try:
            return self.put_file(key, tmp.name)
        finally:
            os.unlink(tmp.name)

    def put_dir(self, key: str, src: str | Path) -> StoredObject:
        """Store a directory as one deterministic tar.gz archive under `key`."""
        validate_key(key)
        with tempfile.NamedTemporaryFile(suffix=".tar.gz", delete=False) as tmp:
            archive_dir(src, tmp)
        try:
            return self.put_file(key, tmp.name)
        finally:
            os.unlink(tmp.name)

    def get_bytes(self, key: str) -> bytes:
        with self.open(key) as f:
            return f.read()

    def get_to_path(self, key: str, path: str | Path) -> Path:
        """Copy the object to a local file (written atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        with self.open(key) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)
        os.replace(tmp, path)
        return path

    def get_dir(self, key: str, dest: str | Path) -> Path:
        """Unpack an archive stored with `put_dir` into `dest`."""
        with self.open(key) as f:
            return extract_archive(f, dest)

    def iter_chunks(self, key: str, chunk_size: int = CHUNK) -> Iterator[bytes]:
        """The object's bytes in chunks (for streaming HTTP responses)."""
        with self.open(key) as f:
            while chunk := f.read(chunk_size):
                yield chunk

    def digest(self, key: str) -> str:
        """sha256 hex of the stored bytes."""
        digest = hashlib.sha256()
        for chunk in self.iter_chunks(key):
            digest.update(chunk)
        return digest.hexdigest()


class LocalStorage(Storage):
    """Objects as files under `root` (the embedded default, or a shared volume)."""

    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """The file behind `key`; InvalidKey if it would resolve outside the root (e.g. through a symlink)."""
        path = (self.root / validate_key(key)).resolve()
        if not path.is_relative_to(self.root) or path == self.root:
            raise InvalidKey(f"invalid storage key {key!r}: resolves outside the storage root")
        return path

    def put_file(self, key: str, path: str | Path) -> StoredObject:
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.parent.resolve().is_relative_to(self.root):
            raise InvalidKey(f"invalid storage key {key!r}: resolves outside the storage root")
        digest, size = hashlib.sha256(), 0
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".upload-")
        try:
            with open(path, "rb") as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return StoredObject(key, digest.hexdigest(), size)

    def open(self, key: str) -> IO[bytes]:
        path = self.path(key)
        if not path.is_file():
            raise ObjectNotFound(f"no stored object {key!r}")
        return open(path, "rb")

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def list_keys(self, prefix: str) -> list[str]:
        folder = self.path(prefix)
        if not folder.is_dir():
            return []
        found = (p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".upload-"))
        return sorted(p.relative_to(self.root).as_posix() for p in found)

    def delete_prefix(self, prefix: str) -> None:
        path = self.path(prefix)
        if path.is_dir():
            shutil.rmtree(path)

    def size(self, key: str) -> int:
        path = self.path(key)
        if not path.is_file():
            raise ObjectNotFound(f"no stored object {key!r}")
        return path.stat().st_size


class S3Storage(Storage):
    """Objects in an S3-compatible bucket (AWS, MinIO, Ceph…) under an optional prefix."""

    def __init__(self, bucket: str, *, endpoint_url: str | None = None, prefix: str = "", client: Any = None):
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url)

    def _name(self, key: str) -> str:
        return self.prefix + validate_key(key)

    @contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        try:
            yield
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise ObjectNotFound(f"no stored object {key!r}") from None
            raise StorageError(f"s3://{self.bucket}/{self._name(key)}: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageError(f"s3://{self.bucket}/{self._name(key)}: {exc}") from exc

    def put_file(self, key: str, path: str | Path) -> StoredObject:
        digest, size = sha256_file(path), Path(path).stat().st_size
        with self._errors(key):
            self.client.upload_file(
                str(path), self.bucket, self._name(key), ExtraArgs={"Metadata": {"sha256": digest}}
            )
        return StoredObject(key, digest, size)

    def open(self, key: str) -> IO[bytes]:
        with self._errors(key):
            body = self.client.get_object(Bucket=self.bucket, Key=self._name(key))["Body"]
        return io.BufferedReader(_StreamingBody(body), CHUNK)

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=self._name(key))

    def list_keys(self, prefix: str) -> list[str]:
        names: list[str] = []
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._name(prefix) + "/"
            )
            for listing in pages:
                names.extend(obj["Key"][len(self.prefix) :] for obj in listing.get("Contents", []))
        return sorted(names)

    def delete_prefix(self, prefix: str) -> None:
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._name(prefix) + "/"
            )
            for listing in pages:
                for obj in listing.get("Contents", []):
                    self.client.delete_object(Bucket=self.bucket, Key=obj["Key"])

    def size(self, key: str) -> int:
        with self._errors(key):
            return int(self.client.head_object(Bucket=self.bucket, Key=self._name(key))["ContentLength"])

    def digest(self, key: str) -> str:
        """The sha256 recorded at upload when present, else computed from the bytes."""
        with self._errors(key):
            head = self.client.head_object(Bucket=self.bucket, Key=self._name(key))
        return head.get("Metadata", {}).get("sha256") or super().digest(key)


class _StreamingBody(io.RawIOBase):
    """botocore's StreamingBody as a file object (context manager, read(n))."""

    def __init__(self, body: Any):
        self._body = body

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._body.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._body.close()
        super().close()


def get_storage(settings: Settings | None = None) -> Storage:
    """The storage backend the settings name."""
    settings = settings or get_settings()
    if settings.storage_backend == "s3":
        return S3Storage(settings.s3_bucket, endpoint_url=settings.s3_endpoint_url, prefix=settings.s3_prefix)
    return LocalStorage(settings.resolved_storage_root())
