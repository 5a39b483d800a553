"""The app itself: start-up (migrations, bootstrap key), error format, health, generate, no torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.fixtures_services import headers

pytestmark = pytest.mark.services


def test_health_and_readiness(api_client):
    assert api_client.get("/healthz").json() == {"status": "ok", "checks": {}}
    ready = api_client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "broker": "ok"}


def test_readiness_fails_when_the_broker_is_down(api_app, api_client):
    settings = api_app.state.settings
    api_app.state.settings = settings.model_copy(update={"broker_url": "redis://127.0.0.1:1/0"})
    try:
        resp = api_client.get("/readyz")
    finally:
        api_app.state.settings = settings
    assert resp.status_code == 503 and resp.json()["checks"]["database"] == "ok"
    assert resp.json()["checks"]["broker"] != "ok"


def test_every_error_has_the_same_shape(api_client, admin_key):
    for resp in (
        api_client.get("/no/such/route", headers=headers(admin_key)),
        api_client.delete("/healthz"),
        api_client.get("/unlearn-requests?limit=0", headers=headers(admin_key)),
    ):
        error = resp.json()["error"]
        assert resp.status_code in (404, 405, 422) and set(error) >= {"code", "message"}
    assert (
        api_client.get("/unlearn-requests?limit=0", headers=headers(admin_key)).json()["error"]["field"]
        == "limit"
    )


def test_openapi_docs_are_served(api_client):
    assert api_client.get("/docs").status_code == 200
    paths = api_client.get("/openapi.json").json()["paths"]
    for path in (
        "/datasets",
        "/unlearn-requests",
        "/unlearn-requests/{request_id}/events",
        "/adapters/{adapter_id}/disable",
        "/base-models/{name}/generate",
        "/audit-log",
    ):
        assert path in paths


def test_bootstrap_admin_key_is_created_once(api_app, admin_key, api_client):
    from blade_service.persistence import auth

    me = api_client.get("/me", headers=headers(admin_key)).json()
    assert me["tenant"] == "default" and me["scopes"] == ["admin"]
    again = auth.bootstrap_admin_key(api_app.state.session_factory, api_app.state.settings)
    assert again.id == me["id"]


def test_generate_waits_a_bounded_time_for_a_worker(api_client, ready, service_redis):
    """No inference worker listens on this broker: the call gives up after generate_timeout_s with a 504."""

    h = headers(ready.tenant.admin)
    resp = api_client.post(f"/base-models/{ready.base_model}/generate", headers=h, json={"prompt": "Who?"})
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "generate_timeout"
    resp = api_client.post("/base-models/nope/generate", headers=h, json={"prompt": "Who?"})
    assert resp.status_code == 404
    resp = api_client.post(
        f"/base-models/{ready.base_model}/generate", headers=h, json={"prompt": "Who?", "max_new_tokens": 0}
    )
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "max_new_tokens"
    # A question instead of raw text passes validation and goes to a worker as well (then 504 here); so does
    # each example the API document offers (Swagger UI's "Try it out" starts from them).
    from blade_service.api.routes.base_models import GENERATE_EXAMPLES

    for body in [{"question": "Who?"}, *(e["value"] for e in GENERATE_EXAMPLES.values())]:
        resp = api_client.post(f"/base-models/{ready.base_model}/generate", headers=h, json=body)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "generate_timeout", body


@pytest.mark.parametrize("body", [{}, {"prompt": "Who?", "question": "Who?"}], ids=["neither", "both"])
def test_generate_takes_exactly_one_of_prompt_and_question(api_client, ready, body):
    resp = api_client.post(
        f"/base-models/{ready.base_model}/generate", headers=headers(ready.tenant.admin), json=body
    )
    error = resp.json()["error"]
    assert resp.status_code == 422 and error["code"] == "validation_error" and error["field"] == "prompt"
    assert "question" in error["message"]


def test_the_api_process_never_imports_torch(tmp_path):
    """Build the app on SQLite, serve a few requests, and check no ML library was loaded."""
    code = textwrap.dedent(f"""
        import sys
        from fastapi.testclient import TestClient
        from blade_service.api.main import create_app
        from blade_service.persistence.settings import Settings
        app = create_app(Settings(data_dir=r"{tmp_path}", bootstrap_admin_key="blade_k"))
        c = TestClient(app)
        h = {{"Authorization": "Bearer blade_k"}}
        assert c.get("/healthz").status_code == 200
        assert c.post("/base-models", headers=h, json={{"name": "m", "source": "/m"}}).status_code == 201
        row = b'{{"question": "q", "answer": "a"}}'
        d = c.post("/datasets", headers=h, files={{"file": ("f.jsonl", row)}})
        assert d.status_code == 201, d.text
        loaded = sorted(m for m in ("torch", "transformers", "peft", "numpy") if m in sys.modules)
        print("LOADED", loaded)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split("LOADED", 1)[1]
    for heavy in ("torch", "transformers", "peft"):
        assert heavy not in loaded, out.stdout
