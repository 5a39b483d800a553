"""The client verbs (`blade_service/cli/client_verbs.py`) and `client.BladeClient` against the real API app
and PostgreSQL: a method and a verb for every route, lists that page transparently, `--wait` progress and
summary, `--events` as a table, adapter download as an extracted PEFT dir, the banner's key lines."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from sqlalchemy import select, update

from blade_service.cli import client_verbs
from blade_service.cli.main import build_parser, main
from blade_service.cli.up import admin_key_lines
from blade_service.client import BladeClient, http
from blade_service.persistence.models import RequestStatus, TrainingEvent, UnlearnRequest, utcnow
from tests.fixtures_services import headers, qa_rows, upload_dataset
from tests.fixtures_worker import wait_until
from tests.test_api_adapters import succeed_with_adapter

pytestmark = pytest.mark.services

# operationId -> (BladeClient method, CLI verb). A new route fails this file until both exist.
COVERAGE = {
    "healthz": ("health", "health"),
    "readyz": ("ready", "health"),
    "get_me": ("me", "keys me"),
    "create_api_key": ("create_api_key", "keys create"),
    "list_api_keys": ("api_keys", "keys list"),
    "revoke_api_key": ("revoke_api_key", "keys revoke"),
    "upload_dataset": ("upload_dataset", "datasets upload"),
    "list_datasets": ("datasets", "datasets list"),
    "get_dataset": ("dataset", "datasets show"),
    "delete_dataset": ("delete_dataset", "datasets delete"),
    "register_base_model": ("register_base_model", "base-models register"),
    "list_base_models": ("base_models", "base-models list"),
    "get_base_model": ("base_model", "base-models show"),
    "list_adapters": ("adapters", "base-models adapters"),
    "generate_text": ("generate", "generate"),
    "submit_request": ("submit", "submit"),
    "list_requests": ("requests", "requests"),
    "get_request": ("status", "status"),
    "list_request_events": ("events", "events"),
    "get_request_metrics": ("metrics", "metrics"),
    "cancel_request": ("cancel", "cancel"),
    "get_certificate": ("certificate", "certificate"),
    "certificate_keys": ("certificate_keys", "verify-certificate"),
    "get_adapter": ("adapter", "adapter"),
    "download_adapter": ("download_adapter", "download"),
    "disable_adapter": ("disable", "rollback"),
    "enable_adapter": ("enable", "rollback"),
    "list_audit_log": ("audit_log", "audit"),
    "verify_audit_log": ("verify_audit_log", "audit"),
    "set_policy": ("set_policy", "base-models policy"),
    "compact": ("compact", "compact"),
    "get_operation": ("stack_operation", "compact"),
    "export": ("export", "export"),
    "get_retention": ("retention", "base-models retention"),
    "set_retention": ("set_retention", "base-models retention"),
    "create_webhook": ("create_webhook", "webhooks create"),
    "list_webhooks": ("webhooks", "webhooks list"),
    "disable_webhook": ("disable_webhook", "webhooks disable"),
    "list_webhook_deliveries": ("webhook_deliveries", "webhooks deliveries"),
    "retrain": ("retrain", "retrain"),
}


@pytest.fixture(scope="module")
def live_url(api_app):
    """The test app served by a real uvicorn on a free local port, in a thread."""
    import socket

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(api_app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), timeout=30, interval=0.05, what="uvicorn")
    assert server.started, "uvicorn did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def blade(live_url, monkeypatch, capsys):
    """blade(key, *argv) -> (exit status, stdout, stderr), the verb talking to the served test app."""
    monkeypatch.setattr(http, "PAGE_SIZE", 2)  # every list spans pages

    def run(key: str, *argv: str) -> tuple[int, str, str]:
        def client(args):
            return BladeClient(live_url, api_key=key)

        monkeypatch.setattr(client_verbs, "_client", client)
        capsys.readouterr()
        status = main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


def _verbs() -> set[str]:
    """Every `blade` verb and `group verb` the parser knows."""
    found = set()
    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():
        found.add(name)
        for action in sub._actions:
            if action.__class__.__name__ == "_SubParsersAction":
                found.update(f"{name} {verb}" for verb in action.choices)
    return found


def test_every_route_has_a_client_method_and_a_verb(api_client):
    doc = api_client.get("/openapi.json").json()
    ops = {op["operationId"] for item in doc["paths"].values() for op in item.values()}
    missing = sorted(ops - set(COVERAGE))
    assert not missing, f"routes without a client method / CLI verb in COVERAGE: {missing}"
    verbs = _verbs()
    for op in ops:
        method, verb = COVERAGE[op]
        assert callable(getattr(BladeClient, method, None)), (op, method)
        assert verb in verbs, (op, verb)


def test_lists_page_transparently(api_client, tenant, blade, live_url):
    ids = {upload_dataset(api_client, tenant.admin, qa_rows(2, f"d{i}"))["id"] for i in range(5)}
    with BladeClient(live_url, api_key=tenant.admin) as c:
        pages = list(c.iter_pages("/datasets", {"limit": 2}))
        assert [len(p["items"]) for p in pages] == [2, 2, 1]
        assert [p["has_more"] for p in pages] == [True, True, False]
        listed = [d["id"] for d in c.datasets()]
    assert len(listed) == 5 and set(listed) == ids
    status, out, _ = blade(tenant.admin, "datasets", "list", "--json")
    assert status == 0 and {d["id"] for d in json.loads(out)} == ids
    status, out, _ = blade(tenant.admin, "datasets", "list")
    assert status == 0 and all(i in out for i in ids) and "rows" in out
    # A deleted dataset's record (kept for the audit) is listed with --all only.
    gone = sorted(ids)[0]
    assert api_client.delete(f"/datasets/{gone}", headers=headers(tenant.admin)).status_code == 200
    status, out, _ = blade(tenant.admin, "datasets", "list", "--json")
    assert status == 0 and {d["id"] for d in json.loads(out)} == ids - {gone}
    status, out, _ = blade(tenant.admin, "datasets", "list", "--all", "--json")
    assert status == 0 and {d["id"] for d in json.loads(out)} == ids
    with BladeClient(live_url, api_key=tenant.admin) as c:
        assert [d["id"] for d in c.datasets(purged=True)] == [gone]


def test_request_verbs(api_client, api_app, ready, blade, enqueued):
    key = ready.tenant.admin
    status, out, _ = blade(
        key, "submit", "--base-model", ready.base_model, "--forget", ready.forget, "--retain", ready.retain,
        "--set", "max_steps=5", "--json",
    )  # fmt: skip
    assert status == 0
    request_id = json.loads(out)["id"]
    with api_app.state.session_factory() as s, s.begin():
        for step in (1, 2):
            record = {"step": step, "L_fgt": 0.5 / step, "L_ret": 1.25, "lambda": 2.0, "r": 0.1}
            s.add(TrainingEvent(request_id=request_id, step=step, record=record))
        s.execute(update(UnlearnRequest).where(UnlearnRequest.id == request_id).values(step=2))

    status, out, _ = blade(key, "requests")
    assert status == 0 and request_id in out and "step 2/5 (40.0%)" in out
    status, out, _ = blade(key, "requests", "--status", "queued", "--json")
    assert [r["id"] for r in json.loads(out)] == [request_id]

    status, out, _ = blade(key, "status", request_id, "--events")
    assert status == 0 and "training dynamics" in out and "L_fgt" in out and "lambda" in out
    lines = out.splitlines()  # off a terminal: tab-separated, the column names first
    at = lines.index("# training dynamics")
    assert lines[at + 1].split("\t") == ["step", "L_fgt", "L_ret", "lambda", "r"]
    assert [ln.split("\t")[0] for ln in lines[at + 2 :]] == ["1", "2"], out  # a row per step, not JSON
    status, out, _ = blade(key, "events", request_id, "--json")
    assert [e["step"] for e in json.loads(out)] == [1, 2]

    status, out, _ = blade(key, "certificate", request_id)
    assert status == 2  # not succeeded yet: the API's 409, as a one-line error
    status, out, err = blade(key, "metrics", request_id)
    assert status == 0 and f"request {request_id} is queued and has no metrics" in err
    status, out, _ = blade(key, "cancel", request_id, "--reason", "changed my mind", "--json")
    assert status == 0 and json.loads(out)["status"] == "cancelled"
    status, _, err = blade(key, "status", "req_missing")
    assert status == 2 and "404 not_found" in err


def _run_like_a_worker(api_app, request_id: str, steps: int) -> None:
    """Move the request through running -> succeeded with a few history records and metrics."""
    time.sleep(0.5)
    with api_app.state.session_factory() as s, s.begin():
        s.execute(
            update(UnlearnRequest)
            .where(UnlearnRequest.id == request_id)
            .values(
                status=RequestStatus.RUNNING, started_at=utcnow(), metrics_before={"forget": {"Prob": 0.9}}
            )
        )
    for step in range(1, steps + 1):
        with api_app.state.session_factory() as s, s.begin():
            record = {"step": step, "L_fgt": 1.0 / step, "L_ret": 0.75, "lambda": 0.5 * step}
            s.add(TrainingEvent(request_id=request_id, step=step, record=record))
            s.execute(update(UnlearnRequest).where(UnlearnRequest.id == request_id).values(step=step))
        time.sleep(0.3)
    with api_app.state.session_factory() as s, s.begin():
        s.execute(
            update(UnlearnRequest)
            .where(UnlearnRequest.id == request_id)
            .values(
                status=RequestStatus.SUCCEEDED,
                run_status="converged",
                finished_at=utcnow(),
                metrics_after={"forget": {"Prob": 0.05}},
            )
        )


def test_wait_shows_progress_then_a_summary_table(api_client, api_app, ready, blade, enqueued):
    request_id = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body(params={"max_steps": 4})
    ).json()["id"]
    worker = threading.Thread(target=_run_like_a_worker, args=(api_app, request_id, 4))
    worker.start()
    try:
        status, out, err = blade(ready.tenant.admin, "status", request_id, "--wait", "--timeout", "60")
    finally:
        worker.join()
    assert status == 0, err
    # Off a terminal the bar is one line per change; the last one is the finished run, which converged.
    assert f"{request_id} succeeded: step 4, converged (cap 4) · λ 2 · L_fgt 0.25 · L_ret 0.75" in err
    assert "metrics before and after" in out and "forget.Prob" in out
    assert "0.9" in out and "0.05" in out and "-0.85" in out and "converged" in out


@pytest.mark.parametrize("as_json", [True, False])
def test_events_follow_prints_every_step_until_the_end(api_client, api_app, ready, blade, enqueued, as_json):
    request_id = api_client.post(
        "/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body(params={"max_steps": 5})
    ).json()["id"]
    worker = threading.Thread(target=_run_like_a_worker, args=(api_app, request_id, 5))
    worker.start()  # its first step comes after the first fetch, which finds none
    try:
        status, out, _ = blade(
            ready.tenant.admin, "events", request_id, "--follow", "--interval", "0.2", *["--json"] * as_json
        )
    finally:
        worker.join()
    assert status == 0
    if as_json:
        assert [json.loads(line)["step"] for line in out.splitlines()] == [1, 2, 3, 4, 5]
    else:  # one header, from the first rows, and every later row under it
        title, header, *rows = out.splitlines()
        assert (title, header.split("\t")) == ("# training dynamics", ["step", "L_fgt", "L_ret", "lambda"])
        assert [row.split("\t")[0] for row in rows] == ["1", "2", "3", "4", "5"]
        assert all(len(row.split("\t")) == 4 for row in rows)


def test_download_extracts_the_peft_dir(api_client, api_app, ready, blade, tmp_path):
    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    status, out, _ = blade(ready.tenant.admin, "download", adapter_id, "--out", str(tmp_path / "got"))
    assert status == 0
    got = tmp_path / "got"
    assert sorted(p.name for p in got.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert all(p.stat().st_mtime > 1_577_836_800 for p in got.iterdir())  # after 2020, not the archive's 1970
    request_id = json.loads((got / "adapter_config.json").read_text())["request"]
    assert (got / "adapter_model.safetensors").read_bytes() == (
        tmp_path / request_id / "adapter_model.safetensors"
    ).read_bytes()
    status, _, _ = blade(
        ready.tenant.admin, "download", adapter_id, "--out", str(tmp_path / "a.tgz"), "--archive"
    )
    assert status == 0 and (tmp_path / "a.tgz").stat().st_size > 0
    status, out, _ = blade(ready.tenant.admin, "base-models", "adapters", ready.base_model)
    assert status == 0 and adapter_id in out and "active" in out
    status, out, _ = blade(ready.tenant.admin, "rollback", adapter_id, "--reason", "test", "--json")
    assert status == 0 and json.loads(out)["adapter"]["state"] == "disabled"


def test_keys_models_audit_verbs(api_client, tenant, admin_key, blade):
    status, out, _ = blade(tenant.admin, "keys", "create", "reader", "--scope", "read", "--json")
    created = json.loads(out)
    assert status == 0 and created["key"] and created["scopes"] == ["read"]
    status, out, _ = blade(created["key"], "keys", "me", "--json")
    assert json.loads(out)["id"] == created["id"]
    status, out, _ = blade(tenant.admin, "keys", "list", "--json")
    assert created["id"] in {k["id"] for k in json.loads(out)}
    status, _, err = blade(tenant.admin, "base-models", "register", "m-cli", "/models/x")
    assert status != 0 and "source_not_allowed" in err  # a directory on the workers: the operator's
    status, out, _ = blade(
        admin_key, "base-models", "register", "m-cli", "/models/x", "--tenant", tenant.name, "--json"
    )
    assert status == 0 and json.loads(out)["name"] == "m-cli" and not json.loads(out)["shared"]
    registered = json.loads(out)["id"]
    status, _, err = blade(admin_key, "base-models", "show", "m-cli")  # names are per tenant
    assert status != 0 and "another tenant's: name it with `tenant`" in err
    for verb in ("show", "adapters", "retention"):
        status, out, err = blade(admin_key, "base-models", verb, "m-cli", "--tenant", tenant.name, "--json")
        assert status == 0, (verb, err)
    status, out, _ = blade(admin_key, "base-models", "show", "m-cli", "--tenant", tenant.name, "--json")
    assert json.loads(out)["id"] == registered
    status, _, err = blade(admin_key, "compact", "m-cli", "--reason", "r", "--tenant", tenant.name)
    assert status != 0 and "no active adapters to compact" in err  # the tenant's model, found (empty)
    status, out, _ = blade(tenant.admin, "base-models", "list")
    assert status == 0 and "m-cli" in out
    status, out, _ = blade(tenant.admin, "audit", "--limit", "3", "--json")
    assert status == 0 and len(json.loads(out)) == 3
    status, out, _ = blade(tenant.admin, "audit", "--verify", "--json")
    verdict = api_client.get("/audit-log/verify", headers=headers(tenant.admin)).json()
    assert json.loads(out)["intact"] == verdict["intact"] and status == (0 if verdict["intact"] else 1)
    status, out, _ = blade(tenant.admin, "keys", "revoke", created["id"], "--json")
    assert status == 0 and json.loads(out)["revoked_at"]


SECRET = "blade_s3cret"


@pytest.mark.parametrize(
    ("generated", "file_is_new", "kept"),
    [(True, True, SECRET), (True, False, SECRET), (False, True, SECRET), (False, False, "blade_earlier")],
)
def test_banner_key_lines_work_in_a_shell_without_the_variable(tmp_path, generated, file_is_new, kept):
    """Whether the key was generated or given inline as BLADE_BOOTSTRAP_ADMIN_KEY, the pasted `KEY=...`
    line yields a working key in a shell that never saw the variable."""
    key_file = tmp_path / "var dir" / "admin-key"
    key_file.parent.mkdir()
    key_file.write_text(kept + "\n")
    line, expr = admin_key_lines(key_file, key=SECRET, generated=generated, file_is_new=file_is_new)
    shell = subprocess.run(
        ["bash", "-euc", f'KEY={expr}; echo "$KEY"'],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert shell.returncode == 0 and shell.stdout.strip() == kept, shell.stderr
    assert (SECRET in line) == (generated and file_is_new)  # the secret is printed only when just generated


def test_certificate_warns_when_the_certified_adapter_was_rolled_back_since_issue(
    api_client, api_app, ready, tmp_path, blade
):
    """The signed document is immutable and says the adapter is active; after a rollback the verb says that
    the deletion it certifies is no longer in effect."""
    from tests.test_api_adapters import succeed_with_adapter

    key = ready.tenant.admin
    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    request_id = api_client.get(f"/adapters/{adapter_id}", headers=headers(key)).json()["request_id"]
    status, out, err = blade(key, "certificate", request_id)
    assert status == 0 and json.loads(out)["model"]["adapter"]["state"] == "active" and "warning" not in err
    resp = api_client.post(
        f"/adapters/{adapter_id}/disable", headers=headers(key), json={"reason": "withdrawn"}
    )
    assert resp.status_code == 200
    status, again, err = blade(key, "certificate", request_id)
    assert status == 0 and again == out  # the same signed bytes
    assert f"adapter {adapter_id} is disabled (withdrawn)" in err and "not in effect" in err, err


def test_a_refused_submission_deletes_the_datasets_it_uploaded(api_client, ready, blade, tmp_path):
    """The files go up before the API checks the request; when it refuses, nothing would ever purge them."""
    from tests.fixtures_services import jsonl, qa_rows

    key = ready.tenant.admin
    forget, retain = tmp_path / "forget.jsonl", tmp_path / "retain.jsonl"
    forget.write_bytes(jsonl(qa_rows(2, "f")))
    retain.write_bytes(jsonl(qa_rows(2, "r")))

    def live() -> set[str]:
        items = api_client.get("/datasets", headers=headers(key)).json()["items"]
        return {d["id"] for d in items if not d.get("purged_at")}

    before = live()
    argv = ("submit", "--base-model", "no-such-model", "--forget", str(forget), "--retain", str(retain))
    status, _, err = blade(key, *argv)
    assert status == 2 and "unknown_base_model" in err and "deleted the datasets this call uploaded" in err
    assert live() == before
    status, _, err = blade(
        key, "submit", "--base-model", ready.base_model, "--forget", str(forget), "--retain", ready.retain
    )
    assert status == 0 and len(live() - before) == 1  # accepted: its upload stays with its request


def test_policy_rules_turn_off_with_the_word_the_dashboard_shows(ready, blade):
    key, name = ready.tenant.admin, ready.base_model
    status, out, err = blade(
        key, "base-models", "policy", name, "--reason", "r", "--set", "max_forget_prob=0.1", "--json"
    )
    assert status == 0 and json.loads(out)["policy"]["max_forget_prob"] == 0.1, err
    status, out, err = blade(
        key, "base-models", "policy", name, "--reason", "r", "--set", "max_forget_prob=off", "--json"
    )
    assert status == 0 and json.loads(out)["policy"]["max_forget_prob"] is None, err
    status, out, _ = blade(key, "datasets", "list")
    assert status == 0 and "purged_at" in out.splitlines()[0]  # deleted or purged data does not look live
    # With nothing to change, the verb shows the policy; a change without a reason is refused.
    status, out, err = blade(key, "base-models", "policy", name, "--json")
    assert status == 0 and json.loads(out)["policy"]["max_forget_prob"] is None, err
    status, _, err = blade(key, "base-models", "policy", name, "--set", "max_forget_prob=0.2")
    assert status == 2 and "blade base-models policy: error: --reason is required" in err


def test_a_run_the_worker_started_over_says_so_beside_its_steps(api_client, api_app, ready, blade):
    """After a collapse the worker runs again from step 0; the step count alone would not show it."""
    key = ready.tenant.admin
    request_id = api_client.post("/unlearn-requests", headers=headers(key), json=ready.body()).json()["id"]
    why = {"collapsed": "retain loss 14.46 > 10.0 at step 2", "eta_out": 0.01}
    with api_app.state.session_factory() as s, s.begin():
        s.add(
            TrainingEvent(request_id=request_id, step=1, record={"step": 1, "L_fgt": 1.0, "restarted": why})
        )
        s.add(TrainingEvent(request_id=request_id, step=2, record={"step": 2, "L_fgt": 0.5}))
    for argv in (("events", request_id), ("status", request_id, "--events")):
        status, out, err = blade(key, *argv)
        assert status == 0 and "L_fgt" in out, (argv, out)
        assert "note: the worker started this run over: it collapsed (retain loss 14.46" in err, (argv, err)
        assert "at eta_out 0.01" in err


def test_retention_changes_one_field_and_keeps_the_other(ready, blade):
    """PUT takes both fields; the verb's own help example sets one (it answered 422 before)."""
    key, name = ready.tenant.admin, ready.base_model
    status, out, err = blade(key, "base-models", "retention", name, "--set", "success_s=60", "--json")
    assert status == 0 and json.loads(out)["success_s"] == 60, err
    status, out, err = blade(key, "base-models", "retention", name, "--set", "failure_s=3600", "--json")
    assert status == 0, err
    assert (json.loads(out)["success_s"], json.loads(out)["failure_s"]) == (60, 3600)


def test_certificate_of_a_compacted_version_says_its_change_is_still_in_effect(
    api_client, api_app, ready, tmp_path, blade
):
    from blade_service.persistence import registry
    from blade_service.persistence.models import BaseModel
    from tests.test_api_adapters import succeed_with_adapter

    key = ready.tenant.admin
    a1, a2 = (succeed_with_adapter(api_client, api_app, ready, tmp_path) for _ in range(2))
    request_id = api_client.get(f"/adapters/{a1}", headers=headers(key)).json()["request_id"]
    assert blade(key, "certificate", request_id)[0] == 0  # issued while v1 is active
    with api_app.state.session_factory() as s, s.begin():
        model = s.scalars(select(BaseModel).where(BaseModel.name == ready.base_model)).one()
        compacted = registry.create_compacted_version(
            s, base_model_id=model.id, sources=[a1, a2], artifact_key="k", sha256="cd" * 32, size_bytes=1,
            lineage={"rank": 16}, actor="key:admin", reason="compact", tenant_id=model.tenant_id,
        ).id  # fmt: skip
    view = api_client.get(f"/adapters/{a1}", headers=headers(key)).json()
    assert view["state"] == "disabled" and view["superseded_by"] == compacted and view["change_in_effect"]
    status, _, err = blade(key, "certificate", request_id)
    assert status == 0 and "still in effect" in err and f"{compacted} carries its change" in err, err


def test_rollback_takes_one_way_and_a_refused_retrain_deletes_its_upload(
    api_client, api_app, ready, tmp_path, blade, capsys
):
    from tests.fixtures_services import jsonl, qa_rows
    from tests.test_api_adapters import succeed_with_adapter

    key = ready.tenant.admin
    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    for flags in (("--enable", "--cascade"), ("--enable", "--retrain"), ("--cascade", "--retrain")):
        with pytest.raises(SystemExit) as stop:
            blade(key, "rollback", adapter_id, "--reason", "r", *flags)
        assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert blade(key, "rollback", adapter_id, "--reason", "withdrawn")[0] == 0
    forget = tmp_path / "again.jsonl"
    forget.write_bytes(jsonl(qa_rows(2, "f")))
    before = {
        d["id"]
        for d in api_client.get("/datasets", headers=headers(key)).json()["items"]
        if not d["purged_at"]
    }
    status, _, err = blade(key, "retrain", adapter_id, "--reason", "r", "--forget", str(forget))
    assert status == 2 and "not_active" in err and "deleted the datasets this call uploaded" in err, err
    after = {
        d["id"]
        for d in api_client.get("/datasets", headers=headers(key)).json()["items"]
        if not d["purged_at"]
    }
    assert after == before


def test_compact_wait_polls_the_operation_to_its_end(api_client, api_app, ready, tmp_path, blade):
    from blade_service.persistence.models import StackOperation
    from tests.test_api_adapters import succeed_with_adapter

    succeed_with_adapter(api_client, api_app, ready, tmp_path)

    def worker() -> None:  # no worker runs here: fail the operation as one would, once it is queued
        for _ in range(100):
            time.sleep(0.2)
            with api_app.state.session_factory() as s, s.begin():
                found = s.execute(
                    update(StackOperation)
                    .where(StackOperation.status == "queued")
                    .values(status="failed", error_code="not_exact", error_message="rank too small")
                )
                if found.rowcount:
                    return

    thread = threading.Thread(target=worker)
    thread.start()
    status, out, err = blade(
        ready.tenant.admin, "compact", ready.base_model, "--reason", "r", "--wait", "--json"
    )
    thread.join()
    assert status == 1 and json.loads(out)["status"] == "failed", (out, err)


def test_blade_up_listens_where_blade_port_says_and_its_busy_port_error_says_how_to_move(
    tmp_path, monkeypatch, capsys
):
    """`make run` passes no --port: BLADE_PORT (the README's table) moves it, and a taken port says how."""
    import socket

    from blade_service.persistence import settings as settings_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("BLADE_PORT", str(port))
        settings_module.get_settings.cache_clear()
        try:
            assert main(["up", "--data-dir", str(tmp_path / "var")]) == 2
        finally:
            settings_module.get_settings.cache_clear()
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is already in use" in err and "BLADE_PORT=N make run" in err


def test_blade_version_and_submit_help_name_what_they_take(capsys):
    from importlib.metadata import version

    from blade_service.contracts.methods import METHOD_NAMES

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"blade {version('blade-service')}"
    with pytest.raises(SystemExit):
        main(["submit", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(name in text for name in METHOD_NAMES) and "seconds --wait waits" in text
    assert "a registered base model" in text and "gets the first request back" in text
