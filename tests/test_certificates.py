"""Deletion certificates: HMAC signing over canonical JSON, tampering detected, the per-installation key,
`blade verify-certificate`, and `GET /unlearn-requests/{id}/certificate` for a request taken through the
worker's state machine on the real PostgreSQL."""

from __future__ import annotations

import copy
import json
import stat
from typing import Any

import pytest

from persistence.certificates import (
    STATEMENT,
    assemble_certificate,
    canonical_json,
    key_id,
    resolve_signing_key,
    sign_certificate,
    verify_certificate,
)
from tests.fixtures_services import headers

KEY = "test-signing-key-0123456789"


def sample_doc() -> dict[str, Any]:
    stack = [
        {"id": "ad_1", "version": 1, "sha256": "a" * 64, "state": "active"},
        {"id": "ad_2", "version": 2, "sha256": "b" * 64, "state": "active"},
    ]
    return assemble_certificate(
        request={"id": "req_1", "tenant_id": "ten_1", "method": "blade", "status": "succeeded"},
        forget={"dataset_id": "ds_f", "sha256": "f" * 64, "rows": 3},
        retain={"dataset_id": "ds_r", "sha256": "e" * 64, "rows": 5},
        base_model={"name": "demo-tiny", "source": "/models/demo", "digest": "c" * 64},
        adapter=stack[1],
        stack=stack,
        metrics={
            "before": {"forget": {"Prob": 0.91, "ROUGE": 0.88}},
            "after": {"forget": {"Prob": 0.12, "ROUGE": 0.2}},
        },
        thresholds={"epsilon": 0.45},
        audit_head={"id": 7, "hash": "d" * 64, "chain_intact": True},
    )


def test_signed_certificate_verifies_and_says_evidence_not_proof():
    doc = sign_certificate(sample_doc(), KEY)
    assert verify_certificate(doc, KEY) == (True, "ok")
    assert doc["signature"]["alg"] == "HMAC-SHA256" and doc["signature"]["key_id"] == key_id(KEY)
    assert "evidence of removal, not proof" in doc["statement"] and doc["statement"] == STATEMENT
    # What a client stores and reads back (any key order, any whitespace) still verifies.
    reread = json.loads(json.dumps(doc, indent=3, sort_keys=False))
    assert verify_certificate(reread, KEY)[0]


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
    ],
)
def test_any_change_breaks_the_signature(path, value):
    doc = sign_certificate(sample_doc(), KEY)
    tampered = copy.deepcopy(doc)
    target = tampered
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    ok, reason = verify_certificate(tampered, KEY)
    assert not ok and "altered" in reason


def test_removed_member_wrong_key_and_no_signature_are_refused():
    doc = sign_certificate(sample_doc(), KEY)
    without = copy.deepcopy(doc)
    del without["model"]["stack"]
    assert not verify_certificate(without, KEY)[0]

    ok, reason = verify_certificate(doc, "another-key")
    assert not ok and "different key" in reason

    unsigned = {k: v for k, v in doc.items() if k != "signature"}
    assert verify_certificate(unsigned, KEY) == (False, "the certificate carries no signature")
    assert not verify_certificate([doc], KEY)[0]
    assert not verify_certificate(dict(doc, type="invoice"), KEY)[0]

    forged_id = copy.deepcopy(doc)
    forged_id["signature"]["key_id"] = key_id("another-key")
    assert not verify_certificate(forged_id, KEY)[0]


def test_canonical_json_is_stable_and_refuses_nan():
    assert canonical_json({"b": 1, "a": [1.5, "é"]}) == '{"a":[1.5,"é"],"b":1}'.encode()
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    # assemble_certificate turns non-finite measurements into null, so a certificate can always be signed
    doc = sample_doc()
    doc = assemble_certificate(**{**_parts_of(doc), "metrics": {"before": {"x": float("nan")}, "after": {}}})
    assert doc["evaluation"]["before"] == {"x": None}


def _parts_of(doc: dict[str, Any]) -> dict[str, Any]:
    return {
        "request": doc["request"],
        "forget": doc["data"]["forget"],
        "retain": doc["data"]["retain"],
        "base_model": doc["model"]["base_model"],
        "adapter": doc["model"]["adapter"],
        "stack": doc["model"]["stack"],
        "metrics": {},
        "thresholds": {},
        "audit_head": {},
    }


def test_installation_key_is_created_once_private_and_reused(tmp_path):
    from persistence.settings import Settings

    settings = Settings(data_dir=tmp_path / "data", signing_key="")
    with pytest.raises(FileNotFoundError):
        resolve_signing_key(settings, create=False)
    first = resolve_signing_key(settings)
    assert len(first) == 64 and resolve_signing_key(settings) == first
    key_file = tmp_path / "data" / "certificate-signing.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert resolve_signing_key(Settings(data_dir=tmp_path / "other")) != first  # per installation
    assert resolve_signing_key(Settings(data_dir=tmp_path / "data", signing_key="explicit")) == "explicit"


def test_cli_verifies_and_names_the_problem(tmp_path, capsys):
    from cli.main import main

    path = tmp_path / "cert.json"
    path.write_text(json.dumps(sign_certificate(sample_doc(), KEY)))
    assert main(["verify-certificate", str(path), "--key", KEY]) == 0
    assert "valid: certificate for request req_1" in capsys.readouterr().out

    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert main(["verify-certificate", str(path), "--key-file", str(key_file)]) == 0

    doc = json.loads(path.read_text())
    doc["evaluation"]["after"]["forget"]["Prob"] = 0.0
    path.write_text(json.dumps(doc))
    assert main(["verify-certificate", str(path), "--key", KEY]) == 1
    assert "INVALID" in capsys.readouterr().err

    path.write_text("{not json")
    assert main(["verify-certificate", str(path), "--key", KEY]) == 2
    assert "not a JSON document" in capsys.readouterr().err


# --- through the API, on PostgreSQL -----------------------------------------------------------------------


def run_to_success(api_app, request_id: str, *, epsilon: float = 0.5) -> str:
    """Take a submitted request through the worker state machine: claim, steps, metrics, adapter, success."""
    from persistence import jobs, registry

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
        jobs.mark_evaluating(session, request_id=request_id, owner=owner, run_status="converged")
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


def test_certificate_of_a_succeeded_request(api_client, api_app, ready, make_key, service_settings, tmp_path):
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
    key = resolve_signing_key(service_settings)
    assert verify_certificate(cert, key) == (True, "ok")

    datasets = {
        d: api_client.get(f"/datasets/{d}", headers=headers(reader)).json()
        for d in (ready.forget, ready.retain)
    }
    assert cert["request"]["id"] == request_id
    assert cert["data"]["forget"]["sha256"] == datasets[ready.forget]["sha256"]
    assert cert["data"]["retain"]["sha256"] == datasets[ready.retain]["sha256"]
    assert cert["model"]["base_model"]["name"] == ready.base_model
    assert cert["model"]["adapter"]["id"] == adapter_id and cert["model"]["adapter_in_effective_model"]
    assert [a["id"] for a in cert["model"]["stack"]] == [adapter_id]
    assert cert["evaluation"]["before"]["forget"]["Prob"] == 0.9
    assert cert["evaluation"]["after"]["forget"]["Prob"] == 0.1
    assert cert["evaluation"]["thresholds"]["epsilon"] == 0.5
    assert cert["audit_chain_head"]["chain_intact"] is True and len(cert["audit_chain_head"]["hash"]) == 64
    assert "not proof" in cert["statement"]

    # The CLI checks what the API served, with the server's key.
    path = tmp_path / "cert.json"
    path.write_text(resp.text)
    from cli.main import main

    assert main(["verify-certificate", str(path), "--key", key]) == 0

    html = api_client.get(f"/unlearn-requests/{request_id}/certificate?format=html", headers=headers(reader))
    assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
    assert "Deletion certificate" in html.text and "evidence of removal, not proof" in html.text

    # After a rollback the certificate says the adapter is no longer part of the effective model.
    resp = api_client.post(
        f"/adapters/{adapter_id}/disable",
        headers=headers(ready.tenant.admin),
        json={"reason": "test rollback"},
    )
    assert resp.status_code == 200, resp.text
    cert = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(reader)).json()
    assert cert["model"]["adapter"]["state"] == "disabled" and not cert["model"]["adapter_in_effective_model"]


def test_certificate_needs_a_key_and_stays_in_its_tenant(api_client, api_app, ready, make_key):
    request_id = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()
    ).json()["id"]
    run_to_success(api_app, request_id)
    assert api_client.get(f"/unlearn-requests/{request_id}/certificate").status_code == 401
    stranger = make_key("stranger-tenant", ["read"])
    resp = api_client.get(f"/unlearn-requests/{request_id}/certificate", headers=headers(stranger))
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "not_found"
