"""Artifact storage: keys cannot escape the root, directories round-trip as deterministic archives."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

import pytest

from blade_service.persistence.storage import (
    InvalidKey,
    LocalStorage,
    ObjectNotFound,
    S3Storage,
    get_storage,
    validate_key,
)


@pytest.fixture
def store(tmp_path):
    return LocalStorage(tmp_path / "root")


def make_dir(path):
    (path / "sub").mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "sub" / "weights.bin").write_bytes(os.urandom(1000))
    return path


@pytest.mark.parametrize(
    "key",
    [
        "",
        "/etc/passwd",
        "../x",
        "a/../../x",
        "a/./b",
        "a//b",
        "a\\b",
        "a/b/",
        ".hidden",
        "a\x00b",
        "x" * 600,
        "a/..",
        "~/x",
        "a b",
    ],
)
def test_bad_keys_are_refused(store, key):
    with pytest.raises(InvalidKey):
        validate_key(key)
    with pytest.raises(InvalidKey):
        store.put_bytes(key, b"x")
    with pytest.raises(InvalidKey):
        store.exists(key)


def test_bytes_round_trip_with_digest(store, tmp_path):
    obj = store.put_bytes("datasets/t1/ds_1.jsonl", b"hello")
    assert obj.sha256 == hashlib.sha256(b"hello").hexdigest() and obj.size == 5
    assert store.exists("datasets/t1/ds_1.jsonl") and not store.exists("datasets/t1/nope")
    assert store.get_bytes("datasets/t1/ds_1.jsonl") == b"hello"
    assert store.digest("datasets/t1/ds_1.jsonl") == obj.sha256
    assert store.size("datasets/t1/ds_1.jsonl") == 5
    assert store.get_to_path("datasets/t1/ds_1.jsonl", tmp_path / "out" / "f").read_bytes() == b"hello"
    store.put_bytes("datasets/t1/ds_1.jsonl", b"replaced")
    assert store.get_bytes("datasets/t1/ds_1.jsonl") == b"replaced"
    store.delete("datasets/t1/ds_1.jsonl")
    store.delete("datasets/t1/ds_1.jsonl")  # deleting twice is fine
    with pytest.raises(ObjectNotFound):
        store.open("datasets/t1/ds_1.jsonl")


def test_symlink_out_of_the_root_is_refused(store, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    (store.root / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(InvalidKey):
        store.open("link/secret")
    with pytest.raises(InvalidKey):
        store.put_bytes("link/new", b"x")
    assert not (outside / "new").exists()


def test_directory_archives_are_deterministic_and_unpack(store, tmp_path):
    src = make_dir(tmp_path / "adapter")
    a = store.put_dir("adapters/m/ad_1.tar.gz", src)
    os.utime(src / "adapter_config.json", (1, 1))  # times do not change the archive
    b = store.put_dir("adapters/m/ad_2.tar.gz", src)
    assert a.sha256 == b.sha256
    dest = store.get_dir("adapters/m/ad_1.tar.gz", tmp_path / "unpacked")
    assert (dest / "adapter_config.json").read_text() == '{"r": 8}'
    assert (dest / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()


def test_unpacking_refuses_paths_out_of_the_destination(store, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escaped")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    store.put_bytes("evil.tar.gz", buf.getvalue())
    with pytest.raises(Exception):  # noqa: B017 - StorageError wrapping tarfile's refusal
        store.get_dir("evil.tar.gz", tmp_path / "dest")
    assert not (tmp_path / "escaped").exists()


def test_get_storage_picks_the_backend(tmp_path):
    from blade_service.persistence.settings import Settings

    local = get_storage(Settings(data_dir=tmp_path))
    assert isinstance(local, LocalStorage) and local.root == (tmp_path / "artifacts").resolve()
    s3 = get_storage(
        Settings(
            data_dir=tmp_path,
            storage_backend="s3",
            s3_bucket="b",
            s3_prefix="p",
            s3_endpoint_url="http://127.0.0.1:9",
        )
    )
    assert isinstance(s3, S3Storage) and s3.prefix == "p/"


def test_s3_backend_round_trip(tmp_path, monkeypatch):
    import boto3
    import moto

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="artifacts")
        store = S3Storage("artifacts", prefix="blade")
        obj = store.put_bytes("datasets/t/ds.jsonl", b"rows")
        assert store.exists("datasets/t/ds.jsonl") and not store.exists("datasets/t/other")
        assert store.get_bytes("datasets/t/ds.jsonl") == b"rows"
        assert store.digest("datasets/t/ds.jsonl") == obj.sha256 and store.size("datasets/t/ds.jsonl") == 4
        src = make_dir(tmp_path / "adapter")
        store.put_dir("adapters/a.tar.gz", src)
        assert (store.get_dir("adapters/a.tar.gz", tmp_path / "out") / "adapter_config.json").exists()
        store.delete("datasets/t/ds.jsonl")
        with pytest.raises(ObjectNotFound):
            store.open("datasets/t/ds.jsonl")
        with pytest.raises(InvalidKey):
            store.put_bytes("../x", b"x")


def _delete_prefix_checks(store) -> None:
    for key in ("checkpoints/req_1/step-000025.tar.gz", "checkpoints/req_1/step-000050.tar.gz"):
        store.put_bytes(key, b"ckpt")
    store.put_bytes("checkpoints/req_10/step-000025.tar.gz", b"other")  # a longer id with the same start
    store.delete_prefix("checkpoints/req_1")
    assert not store.exists("checkpoints/req_1/step-000025.tar.gz")
    assert not store.exists("checkpoints/req_1/step-000050.tar.gz")
    assert store.exists("checkpoints/req_10/step-000025.tar.gz")
    store.delete_prefix("checkpoints/req_1")  # nothing left: fine
    with pytest.raises(InvalidKey):
        store.delete_prefix("../checkpoints")


def test_delete_prefix_removes_only_that_folder(store):
    _delete_prefix_checks(store)


def test_s3_delete_prefix(monkeypatch):
    import boto3
    import moto

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="artifacts")
        _delete_prefix_checks(S3Storage("artifacts", prefix="blade"))
