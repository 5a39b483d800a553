"""Deletion certificates: a signed JSON record of one unlearn request and what it did to the model.

A certificate names the request, the sha256 and row count of its forget and retain data, the base model and
the digests of the adapter it produced and of the stack it sits in, forget/retain metrics before and after,
each with how to read it (e.g. a MIA AUC of 0.5 is the ideal, 0 is not a success), whether the run converged,
the head of the audit hash chain at the time of issue, and a plain statement that approximate unlearning is
evidence of removal, not proof.

It is issued once, when the request succeeds (the worker calls `issue_certificate`; the API does it on the
first GET if that did not happen), stored as the exact signed text in `certificates` (database triggers refuse
any UPDATE or DELETE), audited as `certificate.issue`; every GET returns those same bytes. The signature is
Ed25519 (`persistence/signing.py`) over the canonical JSON (keys sorted, no whitespace, UTF-8) of everything
except the `signature` member; the signature names its key id, and the public keys are published at
`GET /certificate-keys`, so anyone can verify one without a secret:

    blade verify-certificate cert.json                          # fetches the published keys from the API
    blade verify-certificate cert.json --public-key KEY_B64     # or offline, with the one public key
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from blade_service.persistence import audit, registry, signing
from blade_service.persistence.audit_heads import current_signed_head
from blade_service.persistence.convergence import converged, convergence_note
from blade_service.persistence.models import (
    AdapterVersion,
    Certificate,
    RequestStatus,
    TrainingEvent,
    UnlearnRequest,
)
from blade_service.persistence.storage import get_storage

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from sqlalchemy.orm import Session

    from blade_service.persistence.models import Certificate
    from blade_service.persistence.settings import Settings

CERTIFICATE_TYPE = "blade-deletion-certificate"
CERTIFICATE_VERSION = 2
SIGNATURE_ALG = signing.ALGORITHM
CANONICAL_FORM = (
    "Ed25519 over the UTF-8 JSON of the certificate without its 'signature' member, "
    "keys sorted, no whitespace (separators ',' and ':'), non-ASCII characters unescaped"
)

STATEMENT = (
    "This certificate records that the service ran approximate machine unlearning on the named base model "
    "for the named forget data, and the measurements taken before and after. Approximate unlearning reduces "
    "what the model reveals about the forget data; it is evidence of removal, not proof: it does not "
    "guarantee that the model retains no information derived from that data. The change takes effect only "
    "while the adapter named here is active in the model's stack."
)

# How to read each metric the worker measures (blade_core/evaluation/request.py): the ideal value and what
# moving away from it means. MIA AUC follows OpenUnlearning's convention (forget labelled 0, reference 1).
METRIC_GUIDE: dict[str, dict[str, Any]] = {
    "forget.Prob": {
        "ideal": "low (that of a model never trained on the data)",
        "better": "lower",
        "meaning": "mean probability the model gives the forget answers; high means still memorised",
    },
    "forget.ROUGE": {
        "ideal": "low",
        "better": "lower",
        "meaning": "ROUGE-L recall of the model's answers against the forget answers; high means it still "
        "reproduces them",
    },
    "retain.Prob": {
        "ideal": "unchanged from before",
        "better": "higher",
        "meaning": "mean probability of the retain answers; a drop means collateral damage to kept knowledge",
    },
    "retain.ROUGE": {
        "ideal": "unchanged from before",
        "better": "higher",
        "meaning": "ROUGE-L recall on the retain data; a drop means collateral damage to kept knowledge",
    },
    "muse.VerbMem": {
        "ideal": "low (that of a model never trained on the text)",
        "better": "lower",
        "meaning": "text requests (MUSE): ROUGE-L F1 of the model's 128-token continuation of each forget "
        "text's first 32 tokens against the true continuation; high means it still reproduces the text",
    },
    "muse.KnowMem_forget": {
        "ideal": "low",
        "better": "lower",
        "meaning": "text requests with probe datasets (MUSE): ROUGE-L F1 of the model's answers to questions "
        "about the forget text; high means it still knows what the text says",
    },
    "muse.KnowMem_retain": {
        "ideal": "unchanged from before",
        "better": "higher",
        "meaning": "text requests with probe datasets (MUSE): ROUGE-L F1 on questions about the retain text; "
        "a drop means collateral damage to kept knowledge",
    },
    "mia.auc": {
        "ideal": 0.5,
        "better": "closer to 0.5",
        "meaning": "membership-inference AUC (LOSS score) of forget rows against a reference population: 0.5 "
        "means an attacker cannot tell them apart (the ideal); near 1 means the forget rows still look "
        "seen; near 0 means they are perfectly distinguishable the other way (over-forgotten, itself a "
        "trace of the data), which is not a success",
    },
}
MIA_TOLERANCE = 0.1  # |AUC - 0.5| within this reads as "indistinguishable"


class CertificateError(ValueError):
    """A certificate that cannot be issued (e.g. the request has not succeeded)."""


class CertificateNotFound(LookupError):
    """No such request for this tenant."""


# --- signing ------------------------------------------------------------------------------------------


def canonical_json(doc: Any) -> bytes:
    """The bytes that are signed: sorted keys, no whitespace, UTF-8, NaN refused."""
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _signed_bytes(doc: dict[str, Any]) -> bytes:
    return canonical_json({k: v for k, v in doc.items() if k != "signature"})


def sign_certificate(doc: dict[str, Any], key: Ed25519PrivateKey) -> dict[str, Any]:
    """A copy of `doc` with its `signature` member (alg, key_id, base64 value) set."""
    signed = copy.deepcopy(doc)
    signed.pop("signature", None)
    signed["signature"] = {
        "alg": SIGNATURE_ALG,
        "key_id": signing.key_id(key),
        "value": signing.sign(key, _signed_bytes(signed)),
    }
    return signed


def verify_certificate(doc: Any, keys: bytes | str | Mapping[str, bytes | str]) -> tuple[bool, str]:
    """(True, "ok") when `doc` is exactly what the named key signed; else (False, why).

    `keys` is one public key (raw, base64 or PEM) or the published `{key_id: public key}` set.
    """
    if not isinstance(doc, dict):
        return False, "not a certificate: the document is not a JSON object"
    if doc.get("type") != CERTIFICATE_TYPE:
        return False, f"not a certificate: 'type' is {doc.get('type')!r}, expected {CERTIFICATE_TYPE!r}"
    signature = doc.get("signature")
    if not isinstance(signature, dict) or not isinstance(signature.get("value"), str):
        return False, "the certificate carries no signature"
    if signature.get("alg") != SIGNATURE_ALG:
        return False, f"unsupported signature algorithm {signature.get('alg')!r} (expected {SIGNATURE_ALG})"
    kid = str(signature.get("key_id"))
    try:
        if isinstance(keys, Mapping):
            if kid not in keys:
                known = ", ".join(sorted(keys)) or "none"
                return False, f"signed with key {kid!r}, which is not among the published keys ({known})"
            public = signing.parse_public_key(keys[kid])
        else:
            public = signing.parse_public_key(keys)
    except signing.SigningKeyError as exc:
        return False, f"unusable public key: {exc}"
    if signing.key_id(public) != kid:
        return False, f"signed with key {kid!r}, but the key given is {signing.key_id(public)!r}"
    try:
        body = _signed_bytes(doc)
    except ValueError as exc:  # NaN / infinity smuggled in
        return False, f"the certificate is not canonical JSON: {exc}"
    if not signing.verify(public, body, signature["value"]):
        return False, "signature mismatch: the certificate was altered after it was signed"
    return True, "ok"


# --- building -----------------------------------------------------------------------------------------


def stack_digest(adapters: list[dict[str, Any]]) -> str:
    """sha256 over the ordered (version, id, artifact sha256) of the adapters in a stack."""
    lines = "\n".join(f"{a['version']}:{a['id']}:{a.get('sha256') or ''}" for a in adapters)
    return hashlib.sha256(lines.encode()).hexdigest()


def _iso(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return (value if value.tzinfo is not None else value.replace(tzinfo=UTC)).isoformat()
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
    convergence: dict[str, Any] | None = None,
    issuer: dict[str, Any] | None = None,
    issued_at: datetime | None = None,
) -> dict[str, Any]:
    """The unsigned document from plain parts (the database-facing builder below gathers them)."""
    active = [a for a in stack if a.get("state") == "active"]
    document: dict[str, Any] = _plain(
        {
            "type": CERTIFICATE_TYPE,
            "version": CERTIFICATE_VERSION,
            "issued_at": _iso(issued_at or datetime.now(UTC)),
            "issuer": issuer or {"service": "blade-unlearning"},
            "request": request,
            "convergence": convergence or {"converged": None, "note": None},
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
                "metrics": interpret_metrics(metrics.get("before"), metrics.get("after")),
                "thresholds": thresholds,
            },
            "audit_chain_head": audit_head,
            "statement": STATEMENT,
        }
    )
    return document


def _value(doc: Any, dotted: str) -> float | None:
    for part in dotted.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    is_number = isinstance(doc, int | float) and not isinstance(doc, bool) and doc == doc
    return float(doc) if is_number else None


def _reading(name: str, before: float | None, after: float | None) -> str:
    """A one-line verdict on the after-value (what a reader should conclude, not a pass/fail)."""
    if after is None:
        return "not measured"
    if name == "mia.auc":
        if abs(after - 0.5) <= MIA_TOLERANCE:
            return "indistinguishable from the reference population (the ideal)"
        if after > 0.5:
            return "the forget rows still look seen: a membership attack can tell them apart"
        return "the forget rows are distinguishable as over-forgotten (not a success)"
    if before is None:
        return "measured after only"
    change = after - before
    if METRIC_GUIDE[name]["better"] == "lower":
        return f"{'dropped' if change < 0 else 'did not drop'} ({before:.3g} -> {after:.3g})"
    return f"{'kept' if change >= -0.05 else 'fell'} ({before:.3g} -> {after:.3g})"


def interpret_metrics(before: Any, after: Any) -> list[dict[str, Any]]:
    """One entry per known metric: before, after, the ideal, what it means and how to read the result."""
    rows = []
    for name, guide in METRIC_GUIDE.items():
        b, a = _value(before, name), _value(after, name)
        if b is None and a is None:
            continue
        rows.append(
            {
                "name": name,
                "before": b,
                "after": a,
                "ideal": guide["ideal"],
                "better": guide["better"],
                "meaning": guide["meaning"],
                "reading": _reading(name, b, a),
            }
        )
    return rows


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
        part.update(digest=None, digest_of="unavailable: not a local directory on the issuing host")
    return part


def gather(session: Session, request_id: str, *, tenant_id: str | None = None) -> dict[str, Any]:
    """The parts of a certificate for a succeeded request (`CertificateNotFound`, `CertificateError`)."""
    request = session.get(UnlearnRequest, request_id)
    if request is None or (tenant_id is not None and request.tenant_id != tenant_id):
        raise CertificateNotFound(f"no unlearn request {request_id}")
    status = RequestStatus(request.status)
    # a rejected request whose adapter an admin activated anyway (persistence/policy.py) is live too
    overridden = status == RequestStatus.REJECTED and bool((request.gate or {}).get("override"))
    if (status != RequestStatus.SUCCEEDED and not overridden) or request.adapter is None:
        why = (
            "its adapter was held back by the base model's policy gate (an admin may enable it: it is then "
            "certified)"
            if status == RequestStatus.REJECTED
            else "it produced no adapter in the effective model"
        )
        raise CertificateError(
            f"request {request_id} is {status.value}: a certificate is issued only for a request whose "
            f"adapter went live, and {why}"
        )
    adapter = request.adapter
    stack_rows = session.scalars(
        select(AdapterVersion)
        .where(AdapterVersion.base_model_id == adapter.base_model_id)
        .order_by(AdapterVersion.version)
    ).all()
    by_id = {a.id: a for a in stack_rows}

    def adapter_part(a: AdapterVersion) -> dict[str, Any]:
        """What the request's tenant may see of a version: another tenant's shows only that it exists."""
        if not registry.visible_to(a, request.tenant_id):
            ref = registry.public_ref(a, request.tenant_id)
            return {"id": ref, "version": a.version, "state": str(a.state.value)}
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
        # the base model's policy gate (persistence/policy.py): rules, figures, failed rules, override
        "policy_gate": request.gate,
    }
    for part in (request.metrics_after or {}, request.metrics_before or {}):
        if isinstance(part, dict) and isinstance(part.get("thresholds"), dict):
            thresholds["evaluation"] = part["thresholds"]
            break
    convergence = {
        "converged": converged(request.run_status, method=request.method, params=request.params),
        "run_status": request.run_status,
        "steps": request.step,
        "step_cap": request.total_steps,
        "note": convergence_note(
            request.run_status,
            method=request.method,
            params=request.params,
            steps=request.step,
            step_cap=request.total_steps,
        ),
    }
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
        "convergence": convergence,
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
    key: Ed25519PrivateKey,
    issued_at: datetime | None = None,
    sign_head: Callable[[], dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The signed certificate for one succeeded request, read from the database (not stored).

    `sign_head`: signs the audit chain's head at issue (`persistence/audit_heads.py`); its record is embedded
    so `GET /audit-log/verify` can later show the log was not cut back past this certificate. It is called
    only once the request is known to be certifiable: a signed head goes to the artifact store at once, and
    one signed by a key whose publication is then rolled back would fail every later verify.
    """
    parts = gather(session, request_id)
    parts["audit_head"]["signed_head"] = sign_head() if sign_head is not None else None
    issuer = {"service": "blade-unlearning", "signing_key_id": signing.key_id(key)}
    return sign_certificate(assemble_certificate(**parts, issued_at=issued_at, issuer=issuer), key)


def issue_certificate(
    session: Session, request_id: str, *, settings: Settings, actor: str = "system"
) -> Certificate:
    """The request's stored certificate, issued, stored and audited now if it has none yet (idempotent)."""
    existing = session.get(Certificate, request_id)
    if existing is not None:
        return existing

    key = signing.load_private_key(settings)
    kid = signing.publish_key(session, key)
    doc = build_certificate(
        session,
        request_id,
        key=key,
        sign_head=lambda: current_signed_head(session, get_storage(settings), settings),
    )
    text = canonical_json(doc).decode()
    row = Certificate(
        request_id=request_id,
        tenant_id=doc["request"]["tenant_id"],
        key_id=kid,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        document=text,
        issued_at=datetime.fromisoformat(doc["issued_at"]),
    )
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
            audit.append(
                session,
                action="certificate.issue",
                subject_type="request",
                subject_id=request_id,
                actor=actor,
                tenant_id=row.tenant_id,
                data={"sha256": row.sha256, "key_id": kid},
            )
    except IntegrityError:  # issued by another process at the same moment: theirs is the one
        session.expire_all()
        found = session.get(Certificate, request_id)
        if found is None:
            raise
        return found
    return row


def get_certificate(
    session: Session, request_id: str, *, settings: Settings, tenant_id: str | None = None
) -> dict[str, Any]:
    """The stored certificate of a succeeded request (issued now when it was not yet); never a new one."""
    request = session.get(UnlearnRequest, request_id)
    if request is None or (tenant_id is not None and request.tenant_id != tenant_id):
        raise CertificateNotFound(f"no unlearn request {request_id}")
    row = session.get(Certificate, request_id)
    if row is None:
        row = issue_certificate(session, request_id, settings=settings)
        session.commit()
    document: dict[str, Any] = json.loads(row.document)
    return document
