"""Deletion certificates: Ed25519 over canonical JSON, tampering and unknown keys detected, the installation
key, key rotation, metric interpretation and the non-converged flag, `blade verify-certificate` with only a
public key, and `GET /unlearn-requests/{id}/certificate` (issued once, stored immutably, audited) on the real
PostgreSQL."""

from __future__ import annotations

import copy
import json
import stat
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from blade_service.persistence import signing
from blade_service.persistence.certificates import (
    STATEMENT,
    assemble_certificate,
    canonical_json,
    interpret_metrics,
    sign_certificate,
    verify_certificate,
)
from tests.fixtures_services import headers

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
PUBLIC = signing.b64(signing.public_raw(KEY))


def sample_doc(**overrides: Any) -> dict[str, Any]:
    stack = [
        {"id": "ad_1", "version": 1, "sha256": "a" * 64, "state": "active"},
        {"id": "ad_2", "version": 2, "sha256": "b" * 64, "state": "active"},
    ]
    parts: dict[str, Any] = {
        "request": {"id": "req_1", "tenant_id": "ten_1", "method": "blade", "status": "succeeded"},
        "forget": {"dataset_id": "ds_f", "sha256": "f" * 64, "rows": 3},
        "retain": {"dataset_id": "ds_r", "sha256": "e" * 64, "rows": 5},
        "base_model": {"name": "demo-tiny", "source": "/models/demo", "digest": "c" * 64},
        "adapter": stack[1],
        "stack": stack,
        "metrics": {
            "before": {"forget": {"Prob": 0.91, "ROUGE": 0.88}, "mia": {"auc": 0.9}},
            "after": {"forget": {"Prob": 0.12, "ROUGE": 0.2}, "mia": {"auc": 0.52}},
        },
        "thresholds": {"epsilon": 0.45},
        "audit_head": {"id": 7, "hash": "d" * 64, "chain_intact": True},
    }
    return assemble_certificate(**{**parts, **overrides})


def test_signed_certificate_verifies_with_the_public_key_only():
    doc = sign_certificate(sample_doc(), KEY)
    assert verify_certificate(doc, PUBLIC) == (True, "ok")
    assert verify_certificate(doc, {signing.key_id(KEY): PUBLIC}) == (True, "ok")
    assert doc["signature"]["alg"] == "Ed25519" and doc["signature"]["key_id"] == signing.key_id(KEY)
    assert "evidence of removal, not proof" in doc["statement"] and doc["statement"] == STATEMENT
    # What a client stores and reads back (any key order, any whitespace) still verifies.
    reread = json.loads(json.dumps(doc, indent=3, sort_keys=False))
    assert verify_certificate(reread, PUBLIC)[0]


@pytest.mark.parametrize(
    "path, value",
    [
        (("evaluation", "after", "forget", "Prob"), 0.01),  # better-looking metrics
        (("data", "forget", "sha256"), "0" * 64),  # different data
        (("model", "adapter", "sha256"), "1" * 64),
        (("statement",), "Approximate unlearning is proof of removal."),
        (("audit_chain_head", "hash"), "2" * 64),
        (("issued_at",), "2030-01-01T00:00:00+00:00"),
        (("request", "extra"), "added field"),
        (("convergence", "converged"), True),
    ],
)
def test_any_change_breaks_the_signature(path, value):
    doc = sign_certificate(sample_doc(), KEY)
    tampered = copy.deepcopy(doc)
    target = tampered
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    ok, reason = verify_certificate(tampered, PUBLIC)
    assert not ok and "altered" in reason


def test_wrong_or_unknown_key_and_no_signature_are_refused():
    doc = sign_certificate(sample_doc(), KEY)
    without = copy.deepcopy(doc)
    del without["model"]["stack"]
    assert not verify_certificate(without, PUBLIC)[0]

    other = Ed25519PrivateKey.generate()
    ok, reason = verify_certificate(doc, signing.public_raw(other))
    assert not ok and "the key given is" in reason
    ok, reason = verify_certificate(doc, {signing.key_id(other): signing.public_raw(other)})
    assert not ok and "not among the published keys" in reason

    # A forger re-signs an altered copy with their own key but keeps the real key id: still refused.
    forged = sign_certificate(dict(copy.deepcopy(doc), statement="proof"), other)
    forged["signature"]["key_id"] = signing.key_id(KEY)
    ok, reason = verify_certificate(forged, {signing.key_id(KEY): PUBLIC})
    assert not ok and "altered" in reason

    unsigned = {k: v for k, v in doc.items() if k != "signature"}
    assert verify_certificate(unsigned, PUBLIC) == (False, "the certificate carries no signature")
    assert not verify_certificate([doc], PUBLIC)[0]
    assert not verify_certificate(dict(doc, type="invoice"), PUBLIC)[0]
    hmac_era = copy.deepcopy(doc)
    hmac_era["signature"]["alg"] = "HMAC-SHA256"
    assert "unsupported signature algorithm" in verify_certificate(hmac_era, PUBLIC)[1]


def test_canonical_json_is_stable_and_refuses_nan():
    assert canonical_json({"b": 1, "a": [1.5, "é"]}) == '{"a":[1.5,"é"],"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    # assemble_certificate turns non-finite measurements into null, so a certificate can always be signed
    doc = sample_doc(metrics={"before": {"x": float("nan")}, "after": {}})
    assert doc["evaluation"]["before"] == {"x": None}


def test_each_metric_carries_its_interpretation():
    rows = {
        m["name"]: m
        for m in interpret_metrics(
            {"forget": {"Prob": 0.9, "ROUGE": 0.8}, "retain": {"Prob": 0.7}, "mia": {"auc": 0.95}},
            {"forget": {"Prob": 0.1, "ROUGE": 0.85}, "retain": {"Prob": 0.4}, "mia": {"auc": 0.0}},
        )
    }
    assert set(rows) == {"forget.Prob", "forget.ROUGE", "retain.Prob", "mia.auc"}
    assert rows["mia.auc"]["ideal"] == 0.5 and "not a success" in rows["mia.auc"]["meaning"]
    assert "not a success" in rows["mia.auc"]["reading"]  # AUC 0: perfectly distinguishable
    assert rows["forget.Prob"]["reading"].startswith("dropped")
    assert rows["forget.ROUGE"]["reading"].startswith("did not drop")
    assert rows["retain.Prob"]["reading"].startswith("fell")
    ideal = interpret_metrics(None, {"mia": {"auc": 0.53}})
    assert ideal[0]["reading"].startswith("indistinguishable")
    assert "still look seen" in interpret_metrics(None, {"mia": {"auc": 0.9}})[0]["reading"]


def test_installation_key_is_created_once_private_and_reused(tmp_path):
    from blade_service.persistence.settings import Settings

    settings = Settings(data_dir=tmp_path / "data", certificate_signing_key="")
    with pytest.raises(FileNotFoundError):
        signing.load_private_key(settings, create=False)
    first = signing.key_id(signing.load_private_key(settings))
    assert signing.key_id(signing.load_private_key(settings)) == first
    key_file = tmp_path / "data" / signing.KEY_FILE_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert signing.key_id(signing.load_private_key(Settings(data_dir=tmp_path / "other"))) != first
    seed = signing.b64(bytes(range(32)))
    explicit = Settings(data_dir=tmp_path / "data", certificate_signing_key=seed)
    assert signing.key_id(signing.load_private_key(explicit)) == signing.key_id(KEY)
    with pytest.raises(signing.SigningKeyError):
        signing.load_private_key(Settings(data_dir=tmp_path, certificate_signing_key="c2hvcnQ="))


def test_cli_verifies_with_a_public_key_or_a_keys_file(tmp_path, capsys):
    from blade_service.cli.main import main

    path = tmp_path / "cert.json"
    path.write_text(json.dumps(sign_certificate(sample_doc(), KEY)))
    assert main(["verify-certificate", str(path), "--public-key", PUBLIC]) == 0
    assert "valid: certificate for request req_1" in capsys.readouterr().out

    pem = tmp_path / "key.pem"
    pem.write_bytes(
        KEY.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    assert main(["verify-certificate", str(path), "--public-key-file", str(pem)]) == 0
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"key_id": signing.key_id(KEY), "public_key": PUBLIC}]}))
    assert main(["verify-certificate", str(path), "--keys-file", str(keys)]) == 0

    doc = json.loads(path.read_text())
    doc["evaluation"]["after"]["forget"]["Prob"] = 0.0
    path.write_text(json.dumps(doc))
    assert main(["verify-certificate", str(path), "--public-key", PUBLIC]) == 1
    assert "INVALID" in capsys.readouterr().err

    path.write_text("{not json")
    assert main(["verify-certificate", str(path), "--public-key", PUBLIC]) == 2
    assert "not a JSON document" in capsys.readouterr().err


def test_cli_says_when_a_valid_certificate_did_not_converge(tmp_path, capsys):
    from blade_service.cli.main import main

    convergence = {"converged": False, "note": "Not converged: the run stopped at its step cap of 3"}
    path = tmp_path / "cert.json"
    path.write_text(json.dumps(sign_certificate(sample_doc(convergence=convergence), KEY)))
    assert main(["verify-certificate", str(path), "--public-key", PUBLIC]) == 0
    assert "warning: Not converged" in capsys.readouterr().out


# --- through the API, on PostgreSQL -----------------------------------------------------------------------


def run_to_success(api_app, request_id: str, *, epsilon: float = 0.5, run_status: str = "converged") -> str:
    """Take a submitted request through the worker state machine: claim, steps, metrics, adapter, success."""
    from blade_service.persistence import jobs, registry

    owner = "cert-test@worker"
    with api_app.state.session_factory() as session, session.begin():
        assert jobs.claim_request(session, request_id=request_id, owner=owner, lease_seconds=60).claimed
    with api_app.state.session_factory() as session, session.begin():
        jobs.set_run_info(
            session,
            request_id=request_id,
            owner=owner,
            total_steps=3,
            metrics_before={"forget": {"Prob": 0.9, "ROUGE": 0.8}, "mia": {"auc": 0.7}},
        )
        for step in (1, 2, 3):
            jobs.record_step(
                session,
                request_id=request_id,
                owner=owner,
                record={
                    "step": step,
                    "L_fgt": 2.0 + step,
                    "L_ret": 0.4,
                    "r": -0.1,
                    "lambda": 0.1 * step,
                    "epsilon": epsilon,
                },
            )
        jobs.mark_evaluating(session, request_id=request_id, owner=owner, run_status=run_status)
    with api_app.state.session_factory() as session, session.begin():
        adapter = registry.create_adapter_version(
            session,
            request=request_id,
            artifact_key=f"adapters/{request_id}",
            sha256="ab" * 32,
            size_bytes=1234,
            actor=f"worker:{owner}",
        )
        jobs.mark_succeeded(
            session,
            request_id=request_id,
            owner=owner,
            adapter_id=adapter.id,
            metrics_after={"forget": {"Prob": 0.1, "ROUGE": 0.2}, "mia": {"auc": 0.5}},
        )
        return adapter.id


def _published(api_client) -> dict[str, str]:
    resp = api_client.get("/certificate-keys")  # public: no key
    assert resp.status_code == 200, resp.text
    return {k["key_id"]: k["public_key"] for k in resp.json()["keys"]}


def test_certificate_is_issued_once_stored_and_verifiable(api_client, api_app, ready, make_key, tmp_path):
    resp = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body())
    assert resp.status_code == 202, resp.text
    request_id = resp.json()["id"]

    early = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(ready.tenant.admin))
    assert early.status_code == 409 and early.json()["error"]["code"] == "not_succeeded"

    adapter_id = run_to_success(api_app, request_id)
    reader = make_key(ready.tenant.name, ["read"])
    resp = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(reader))
    assert resp.status_code == 200, resp.text
    cert = resp.json()
    assert verify_certificate(cert, _published(api_client)) == (True, "ok")

    datasets = {
        d: api_client.get(f"/datasets/{d}", headers=headers(reader)).json()
        for d in (ready.forget, ready.retain)
    }
    assert cert["request"]["id"] == request_id
    assert cert["data"]["forget"]["sha256"] == datasets[ready.forget]["sha256"]
    assert cert["data"]["forget"]["rows"] == datasets[ready.forget]["rows"]
    assert cert["data"]["retain"]["sha256"] == datasets[ready.retain]["sha256"]
    assert cert["model"]["base_model"]["name"] == ready.base_model
    assert cert["model"]["adapter"]["id"] == adapter_id and cert["model"]["adapter_in_effective_model"]
    assert [a["id"] for a in cert["model"]["stack"]] == [adapter_id]
    assert cert["evaluation"]["before"]["forget"]["Prob"] == 0.9
    assert cert["evaluation"]["after"]["forget"]["Prob"] == 0.1
    mia = next(m for m in cert["evaluation"]["metrics"] if m["name"] == "mia.auc")
    assert mia["ideal"] == 0.5 and mia["after"] == 0.5 and mia["reading"].startswith("indistinguishable")
    assert cert["evaluation"]["thresholds"]["epsilon"] == 0.5
    assert cert["convergence"]["converged"] is True and cert["convergence"]["note"] is None
    assert cert["audit_chain_head"]["chain_intact"] is True and len(cert["audit_chain_head"]["hash"]) == 64
    signed_head = cert["audit_chain_head"]["signed_head"]  # kept outside the table: a cut log is detected
    assert signed_head["head_hash"] == cert["audit_chain_head"]["hash"]
    from blade_service.persistence.audit_heads import verify_head_signature

    assert verify_head_signature(signed_head, _published(api_client))
    assert "not proof" in cert["statement"]

    # The CLI checks what the API served with nothing but the published public key.
    path = tmp_path / "cert.json"
    path.write_text(resp.text)
    from blade_service.cli.main import main

    public = _published(api_client)[cert["signature"]["key_id"]]
    assert main(["verify-certificate", str(path), "--public-key", public]) == 0

    html = api_client.get(f"/unlearn-requests/{request_id}/certificate?format=html", headers=headers(reader))
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert "Deletion certificate" in html.text and "evidence of removal, not proof" in html.text
    assert "not-converged" not in html.text and 'id="since-issue"' not in html.text

    # Every later GET, even after a rollback, returns the very same stored bytes: no new certificate.
    resp = api_client.post(
        f"/adapters/{adapter_id}/disable",
        headers=headers(ready.tenant.admin),
        json={"reason": "test rollback"},
    )
    assert resp.status_code == 200, resp.text
    again = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(reader))
    assert again.json() == cert and again.json()["issued_at"] == cert["issued_at"]
    # The printable page says what changed since, outside the signed document.
    page = api_client.get(f"/unlearn-requests/{request_id}/certificate?format=html", headers=headers(reader))
    assert 'id="since-issue"' in page.text and "not in the effective model" in page.text
    assert "test rollback" in page.text
    audit = api_client.get(
        "/audit-log", headers=headers(ready.tenant.admin), params={"action": "certificate.issue"}
    ).json()
    entries = audit["items"] if isinstance(audit, dict) else audit
    assert [e["subject_id"] for e in entries].count(request_id) == 1


def test_stored_certificate_cannot_be_rewritten(api_client, api_app, ready):
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    request_id = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()
    ).json()["id"]
    run_to_success(api_app, request_id)
    assert (
        api_client.get(
            f"/unlearn-requests/{request_id}/certificate", headers=headers(ready.tenant.admin)
        ).status_code
        == 200
    )
    for statement in (
        "UPDATE certificates SET document = '{}' WHERE request_id = :r",
        "DELETE FROM certificates WHERE request_id = :r",
    ):
        with api_app.state.session_factory() as session, pytest.raises(DBAPIError, match="immutable"):
            session.execute(text(statement), {"r": request_id})


def test_non_converged_run_is_flagged_in_api_and_certificate(api_client, api_app, ready):
    request_id = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()
    ).json()["id"]
    assert (
        api_client.get(f"/unlearn-requests/{request_id}", headers=headers(ready.tenant.admin)).json()[
            "converged"
        ]
        is None
    )
    run_to_success(api_app, request_id, run_status="max_steps")
    doc = api_client.get(f"/unlearn-requests/{request_id}", headers=headers(ready.tenant.admin)).json()
    assert doc["status"] == "succeeded" and doc["converged"] is False
    cert = api_client.get(
        f"/unlearn-requests/{request_id}/certificate", headers=headers(ready.tenant.admin)
    ).json()
    assert cert["convergence"]["converged"] is False and cert["convergence"]["run_status"] == "max_steps"
    assert "step cap of 3" in cert["convergence"]["note"]
    html = api_client.get(
        f"/unlearn-requests/{request_id}/certificate?format=html", headers=headers(ready.tenant.admin)
    )
    assert 'id="not-converged"' in html.text


@pytest.mark.parametrize(
    "body",
    [{"method": "npo", "params": {}}, {"params": {"max_steps": 5, "early_stop": False}}],
    ids=["npo", "no-stop"],
)
def test_a_run_without_a_convergence_test_is_not_flagged_when_it_ends_its_schedule(
    api_client, api_app, ready, body
):
    """A baseline (or BLADE with its stop turned off) runs its schedule to its end: `converged` is null
    there, with a note saying why, and no warning badge or CLI warning."""
    admin = headers(ready.tenant.admin)
    request_id = api_client.post("/unlearn-requests", headers=admin, json=ready.body(**body)).json()["id"]
    run_to_success(api_app, request_id, run_status="max_steps")
    doc = api_client.get(f"/unlearn-requests/{request_id}", headers=admin).json()
    assert doc["status"] == "succeeded" and doc["run_status"] == "max_steps" and doc["converged"] is None
    cert = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=admin).json()
    assert cert["convergence"]["converged"] is None
    assert cert["convergence"]["note"].startswith("No convergence test"), cert["convergence"]
    html = api_client.get(f"/unlearn-requests/{request_id}/certificate?format=html", headers=admin).text
    assert 'id="not-converged"' not in html and 'id="no-convergence-test"' in html
    from tests.test_dashboard_pages import signed_in

    client = signed_in(api_client, ready.tenant.admin)
    assert "not-converged" not in client.get(f"/dashboard/requests/{request_id}").text
    api_client.cookies.clear()


def test_rotated_key_keeps_old_certificates_verifiable(api_client, api_app, ready):
    first = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()
    ).json()
    run_to_success(api_app, first["id"])
    old_cert = api_client.get(
        f"/unlearn-requests/{first['id']}/certificate", headers=headers(ready.tenant.admin)
    ).json()

    settings = api_app.state.settings
    rotated = Ed25519PrivateKey.generate()
    raw = rotated.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    seed = signing.b64(raw)
    api_app.state.settings = settings.model_copy(update={"certificate_signing_key": seed})
    try:
        second = api_client.post(
            "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()
        ).json()
        run_to_success(api_app, second["id"])
        new_cert = api_client.get(
            f"/unlearn-requests/{second['id']}/certificate", headers=headers(ready.tenant.admin)
        ).json()
    finally:
        api_app.state.settings = settings
    assert new_cert["signature"]["key_id"] == signing.key_id(rotated) != old_cert["signature"]["key_id"]
    published = _published(api_client)
    assert verify_certificate(old_cert, published) == (True, "ok")
    assert verify_certificate(new_cert, published) == (True, "ok")


def test_certificate_needs_a_key_and_stays_in_its_tenant(api_client, api_app, ready, make_key):
    request_id = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()
    ).json()["id"]
    run_to_success(api_app, request_id)
    assert api_client.get(f"/unlearn-requests/{request_id}/certificate").status_code == 401
    stranger = make_key("stranger-tenant", ["read"])
    resp = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(stranger))
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
