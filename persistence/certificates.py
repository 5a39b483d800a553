"""Deletion certificates: a signed JSON record of one unlearn request and what it did to the model.

A certificate names the request, the sha256 of its forget and retain data, the base model and the digests of
the adapter it produced and of the stack it sits in, forget/retain metrics before and after with the
thresholds used, the head of the audit hash chain at the time of issue, and a plain statement that
approximate unlearning is evidence of removal, not proof. It is signed with HMAC-SHA256 over its canonical
JSON (keys sorted, no whitespace, UTF-8), everything except the `signature` member.

The key is `Settings.signing_key` (env `BLADE_SIGNING_KEY`). When that is empty a random per-installation key
is created once and kept in `<data_dir>/certificate-signing.key` (mode 0600): certificates then verify only
against that installation's key, so deployments with several API replicas must set `BLADE_SIGNING_KEY`.
The signature carries a key id (a digest of the key, not the key) so a verifier can tell "signed with another
key" from "altered".

    blade verify-certificate cert.json            # key from the same settings as the server
    blade verify-certificate cert.json --key K    # or an explicit key
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import json
import os
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from persistence.settings import Settings

CERTIFICATE_TYPE = "blade-deletion-certificate"
CERTIFICATE_VERSION = 1
SIGNATURE_ALG = "HMAC-SHA256"
KEY_FILE_NAME = "certificate-signing.key"

STATEMENT = (
    "This certificate records that the service ran approximate machine unlearning on the named base model "
    "for the named forget data, and the measurements taken before and after. Approximate unlearning reduces "
    "what the model reveals about the forget data; it is evidence of removal, not proof: it does not "
    "guarantee that the model retains no information derived from that data. The change takes effect only "
    "while the adapter named here is active in the model's stack."
)


class CertificateError(ValueError):
    """A certificate that cannot be issued (e.g. the request has not succeeded)."""


# --- signing ------------------------------------------------------------------------------------------


def canonical_json(doc: Any) -> bytes:
    """The bytes that are signed: sorted keys, no whitespace, UTF-8, NaN refused."""
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def key_id(key: str | bytes) -> str:
    """A short public name for a key: the first 16 hex digits of sha256("blade-key-id:" + key)."""
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(b"blade-key-id:" + raw).hexdigest()[:16]


def _mac(doc: dict[str, Any], key: str | bytes) -> str:
    body = {k: v for k, v in doc.items() if k != "signature"}
    raw = key.encode() if isinstance(key, str) else key
    return hmac.new(raw, canonical_json(body), hashlib.sha256).hexdigest()


def sign_certificate(doc: dict[str, Any], key: str | bytes) -> dict[str, Any]:
    """A copy of `doc` with its `signature` member (alg, key_id, value) set."""
    if not key:
        raise ValueError("signing key is empty")
    signed = copy.deepcopy(doc)
    signed.pop("signature", None)
    signed["signature"] = {"alg": SIGNATURE_ALG, "key_id": key_id(key), "value": _mac(signed, key)}
    return signed


def verify_certificate(doc: Any, key: str | bytes) -> tuple[bool, str]:
    """(True, "ok") when `doc` is exactly what was signed with `key`; else (False, why)."""
    if not isinstance(doc, dict):
        return False, "not a certificate: the document is not a JSON object"
    if doc.get("type") != CERTIFICATE_TYPE:
        return False, f"not a certificate: 'type' is {doc.get('type')!r}, expected {CERTIFICATE_TYPE!r}"
    signature = doc.get("signature")
    if not isinstance(signature, dict) or not isinstance(signature.get("value"), str):
        return False, "the certificate carries no signature"
    if signature.get("alg") != SIGNATURE_ALG:
        return False, f"unsupported signature algorithm {signature.get('alg')!r}"
    if not key:
        return False, "no key to verify with"
    try:
        expected = _mac(doc, key)
    except ValueError as exc:  # NaN / infinity smuggled in
        return False, f"the certificate is not canonical JSON: {exc}"
    if hmac.compare_digest(expected, signature["value"]):
        if signature.get("key_id") not in (None, key_id(key)):
            return False, "the signature matches but its key id was altered"
        return True, "ok"
    if signature.get("key_id") != key_id(key):
        return False, (
            f"signed with a different key (key id {signature.get('key_id')}, this key's id is "
            f"{key_id(key)}), or the key id was altered"
        )
    return False, "signature mismatch: the certificate was altered after it was signed"


def resolve_signing_key(settings: Settings, *, create: bool = True) -> str:
    """Settings.signing_key, or this installation's persisted random key (made on first use if `create`)."""
    if settings.signing_key:
        return settings.signing_key
    path = Path(settings.data_dir) / KEY_FILE_NAME
    if path.is_file():
        return path.read_text().strip()
    if not create:
        raise FileNotFoundError(f"no signing key: BLADE_SIGNING_KEY is empty and {path} does not exist")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)
    try:  # O_EXCL: two processes starting together agree on one key
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip()
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return key


# --- building -----------------------------------------------------------------------------------------


def stack_digest(adapters: list[dict[str, Any]]) -> str:
    """sha256 over the ordered (version, id, artifact sha256) of the adapters in a stack."""
    lines = "\n".join(f"{a['version']}:{a['id']}:{a.get('sha256') or ''}" for a in adapters)
    return hashlib.sha256(lines.encode()).hexdigest()


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.isoformat()
    return str(value)


def _plain(value: Any) -> Any:
    """JSON-safe copy: datetimes to ISO strings, non-finite floats to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, datetime):
        return _iso(value)
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    return value


def assemble_certificate(
    *,
    request: dict[str, Any],
    forget: dict[str, Any],
    retain: dict[str, Any],
    base_model: dict[str, Any],
    adapter: dict[str, Any] | None,
    stack: list[dict[str, Any]],
    metrics: dict[str, Any],
    thresholds: dict[str, Any],
    audit_head: dict[str, Any],
    issuer: dict[str, Any] | None = None,
    issued_at: datetime | None = None,
) -> dict[str, Any]:
    """The unsigned document from plain parts (the database-facing builder below gathers them)."""
    active = [a for a in stack if a.get("state") == "active"]
    return _plain(
        {
            "type": CERTIFICATE_TYPE,
            "version": CERTIFICATE_VERSION,
            "issued_at": _iso(issued_at or datetime.now(UTC)),
            "issuer": issuer or {"service": "blade-unlearning"},
            "request": request,
            "data": {"forget": forget, "retain": retain},
            "model": {
                "base_model": base_model,
                "adapter": adapter,
                "adapter_in_effective_model": bool(adapter and adapter.get("state") == "active"),
                "stack": stack,
                "stack_digest": stack_digest(stack),
                "effective_stack_digest": stack_digest(active),
            },
            "evaluation": {
                "before": metrics.get("before"),
                "after": metrics.get("after"),
                "thresholds": thresholds,
            },
            "audit_chain_head": audit_head,
            "statement": STATEMENT,
        }
    )


class CertificateNotFound(LookupError):
    """No such request for this tenant."""


_DIGEST_CACHE: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


def directory_digest(path: Path, *, max_bytes: int = 2 * 2**30) -> str | None:
    """sha256 over the sorted (relative path, file sha256) of a model directory; None when too large.

    Cached by the files' names, sizes and modification times, so a certificate does not rehash the model.
    """
    files = sorted(p for p in path.rglob("*") if p.is_file())
    stamp = tuple((str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if sum(size for _, size, _ in stamp) > max_bytes:
        return None
    cache_key = (str(path.resolve()), stamp)
    if cache_key not in _DIGEST_CACHE:
        outer = hashlib.sha256()
        for p in files:
            inner = hashlib.sha256()
            with p.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    inner.update(chunk)
            outer.update(f"{p.relative_to(path)}\0{inner.hexdigest()}\n".encode())
        _DIGEST_CACHE[cache_key] = outer.hexdigest()
    return _DIGEST_CACHE[cache_key]


def _base_model_part(model: Any, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = {"id": model.id, "name": model.name, "source": model.source}
    recorded = hyperparameters.get("base_model_sha256") or hyperparameters.get("base_model_digest")
    if recorded:
        part.update(digest=recorded, digest_of="recorded by the worker at training time")
        return part
    source = Path(model.source)
    digest = directory_digest(source) if source.is_dir() else None
    if digest:
        part.update(digest=digest, digest_of="sha256 over the sorted (file, sha256) of the model directory")
    else:
        part.update(digest=None, digest_of="unavailable: the source is not a local directory on the API host")
    return part


def gather(session: Session, request_id: str, *, tenant_id: str | None = None) -> dict[str, Any]:
    """The parts of a certificate for a succeeded request (`CertificateNotFound`, `CertificateError`)."""
    from sqlalchemy import select

    from persistence import audit
    from persistence.models import AdapterVersion, RequestStatus, TrainingEvent, UnlearnRequest

    request = session.get(UnlearnRequest, request_id)
    if request is None or (tenant_id is not None and request.tenant_id != tenant_id):
        raise CertificateNotFound(f"no unlearn request {request_id}")
    status = RequestStatus(request.status)
    if status != RequestStatus.SUCCEEDED or request.adapter is None:
        raise CertificateError(
            f"request {request_id} is {status.value}: a certificate is issued only for a "
            "succeeded request (one that produced an adapter)"
        )
    adapter = request.adapter
    stack_rows = session.scalars(
        select(AdapterVersion)
        .where(AdapterVersion.base_model_id == adapter.base_model_id)
        .order_by(AdapterVersion.version)
    ).all()
    by_id = {a.id: a for a in stack_rows}

    def adapter_part(a: AdapterVersion) -> dict[str, Any]:
        return {
            "id": a.id,
            "version": a.version,
            "sha256": a.sha256,
            "state": str(a.state.value),
            "request_id": a.request_id,
            "created_at": a.created_at,
        }

    last = session.scalars(
        select(TrainingEvent)
        .where(TrainingEvent.request_id == request.id)
        .order_by(TrainingEvent.step.desc())
        .limit(1)
    ).first()
    record = dict(last.record or {}) if last is not None else {}
    hyper = dict(adapter.hyperparameters or {})
    thresholds: dict[str, Any] = {
        "epsilon": record.get("epsilon"),  # the retain-loss budget the run enforced (final value)
        "final_step": {k: record.get(k) for k in ("step", "L_fgt", "L_ret", "r", "lambda") if k in record},
        "run_status": request.run_status,
        "params": dict(request.params or {}),
        "hyperparameters": hyper,
    }
    for part in (request.metrics_after or {}, request.metrics_before or {}):
        if isinstance(part, dict) and isinstance(part.get("thresholds"), dict):
            thresholds["evaluation"] = part["thresholds"]
            break
    head_id, head_hash = audit.head(session)
    chain = audit.verify_chain(session)
    parent = [by_id[p] for p in (adapter.parent_stack or []) if p in by_id]
    return {
        "request": {
            "id": request.id,
            "tenant_id": request.tenant_id,
            "method": request.method,
            "status": status.value,
            "submitted_at": request.created_at,
            "started_at": request.started_at,
            "finished_at": request.finished_at,
            "steps": request.step,
            "attempts": request.attempts,
            "metadata": dict(request.meta or {}),
        },
        "forget": {
            "dataset_id": request.forget_dataset.id,
            "name": request.forget_dataset.name,
            "sha256": request.forget_dataset.sha256,
            "rows": request.forget_dataset.rows,
        },
        "retain": {
            "dataset_id": request.retain_dataset.id,
            "name": request.retain_dataset.name,
            "sha256": request.retain_dataset.sha256,
            "rows": request.retain_dataset.rows,
        },
        "base_model": _base_model_part(request.base_model, hyper),
        "adapter": {
            **adapter_part(adapter),
            "forget_sha256": adapter.forget_sha256,
            "retain_sha256": adapter.retain_sha256,
            "trained_on": [adapter_part(a) for a in parent],
            "trained_on_digest": stack_digest([adapter_part(a) for a in parent]),
            "state_changed_at": adapter.state_changed_at,
            "state_reason": adapter.state_reason,
        },
        "stack": [adapter_part(a) for a in stack_rows],
        "metrics": {"before": request.metrics_before, "after": request.metrics_after},
        "thresholds": thresholds,
        "audit_head": {
            "id": head_id,
            "hash": head_hash,
            "chain_intact": chain.intact,
            "entries_checked": chain.checked,
        },
    }


def build_certificate(
    session: Session,
    request_id: str,
    *,
    settings: Settings,
    tenant_id: str | None = None,
    issued_at: datetime | None = None,
) -> dict[str, Any]:
    """The signed certificate for one succeeded request, read from the database."""
    key = resolve_signing_key(settings)
    parts = gather(session, request_id, tenant_id=tenant_id)
    doc = assemble_certificate(
        **parts, issued_at=issued_at, issuer={"service": "blade-unlearning", "signing_key_id": key_id(key)}
    )
    return sign_certificate(doc, key)
