"""Ed25519 signing keys: the service's private key, key ids, and the public keys it publishes.

The private key is `Settings.certificate_signing_key` (env `BLADE_CERTIFICATE_SIGNING_KEY`: base64 of the
32-byte seed, or a PKCS#8 PEM); when that is empty a random key is made once and kept in
`<data_dir>/certificate-ed25519.key` (mode 0600). Whoever signs with a key first records its public half in
the `signing_keys` table (`publish_key`); the API serves every row at `GET /certificate-keys`, and rows are
never removed, so after a rotation (a new key) old certificates still verify. A verifier needs only the
public key: `verify(public_key, data, signature)`.

    key = load_private_key(settings)
    kid = publish_key(session, key)
    sig = sign(key, b"...")                     # base64
    verify(public_raw(key), b"...", sig)        # True
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from blade_service.persistence.models import SigningKey

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from blade_service.persistence.settings import Settings

ALGORITHM = "Ed25519"
KEY_FILE_NAME = "certificate-ed25519.key"


class SigningKeyError(ValueError):
    """A key that cannot be read (bad base64, wrong length, not Ed25519)."""


def public_raw(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    """The 32 raw bytes of the public key."""
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public: bytes | Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """A key's public name: `ed25519:` + the first 16 hex digits of sha256(raw public key)."""
    raw = public if isinstance(public, bytes) else public_raw(public)
    return "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def parse_public_key(text: str | bytes) -> bytes:
    """Raw 32-byte public key from base64 (as published), hex, or a PEM `PUBLIC KEY` block."""
    if isinstance(text, bytes) and len(text) == 32:
        return text
    data = text.decode() if isinstance(text, bytes) else text
    data = data.strip()
    if data.startswith("-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(data.encode())
        except ValueError as exc:
            raise SigningKeyError(f"not a PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise SigningKeyError("the PEM public key is not an Ed25519 key")
        return public_raw(key)
    for decode in (bytes.fromhex, lambda s: base64.b64decode(s, validate=True)):
        try:
            raw = decode(data)
        except (ValueError, binascii.Error):
            continue
        if len(raw) == 32:
            return raw
    raise SigningKeyError("not an Ed25519 public key: expected 32 bytes as base64 or hex, or a PEM block")


def _private_from_text(text: str) -> Ed25519PrivateKey:
    text = text.strip()
    if text.startswith("-----BEGIN"):
        key = serialization.load_pem_private_key(text.encode(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError("the PEM private key is not an Ed25519 key")
        return key
    try:
        seed = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise SigningKeyError("the certificate signing key is neither a PEM block nor base64") from None
    if len(seed) != 32:
        raise SigningKeyError(f"the certificate signing key must be a 32-byte seed, got {len(seed)} bytes")
    return Ed25519PrivateKey.from_private_bytes(seed)


def _seed_text(key: Ed25519PrivateKey) -> str:
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    return b64(raw)


def load_private_key(settings: Settings, *, create: bool = True) -> Ed25519PrivateKey:
    """The signing key: from settings, else this installation's key file (made on first use if `create`)."""
    if settings.certificate_signing_key:
        return _private_from_text(settings.certificate_signing_key)
    path = Path(settings.data_dir) / KEY_FILE_NAME
    if path.is_file():
        return _private_from_text(path.read_text())
    if not create:
        raise FileNotFoundError(
            f"no signing key: BLADE_CERTIFICATE_SIGNING_KEY is empty and {path} does not exist"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    try:  # O_EXCL: two processes starting together agree on one key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _private_from_text(path.read_text())
    with os.fdopen(fd, "w") as fh:
        fh.write(_seed_text(key) + "\n")
    return key


def sign(key: Ed25519PrivateKey, data: bytes) -> str:
    """The base64 Ed25519 signature of `data`."""
    return b64(key.sign(data))


def verify(public: bytes, data: bytes, signature: str) -> bool:
    """True when `signature` (base64) is `public`'s signature of `data`."""
    try:
        raw_sig = base64.b64decode(signature, validate=True)
        Ed25519PublicKey.from_public_bytes(public).verify(raw_sig, data)
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True


def publish_key(session: Session, key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """Record the key's public half in `signing_keys` (once); its key id."""
    kid = key_id(key)
    if session.get(SigningKey, kid) is None:
        try:
            with session.begin_nested():
                session.add(SigningKey(key_id=kid, algorithm=ALGORITHM, public_key=b64(public_raw(key))))
        except IntegrityError:  # another process published the same key at the same moment
            pass
    return kid


def published_keys(session: Session) -> list[dict[str, Any]]:
    """Every public key ever used, oldest first: `{key_id, algorithm, public_key, created_at, retired_at}`."""
    rows = session.scalars(select(SigningKey).order_by(SigningKey.created_at, SigningKey.key_id))
    return [
        {
            "key_id": k.key_id,
            "algorithm": k.algorithm,
            "public_key": k.public_key,
            "created_at": k.created_at.isoformat(),
            "retired_at": k.retired_at.isoformat() if k.retired_at else None,
        }
        for k in rows
    ]
