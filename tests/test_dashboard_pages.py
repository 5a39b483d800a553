"""The dashboard's server side through HTTP on the real PostgreSQL: sign-in, tenant scoping, live fragments,
and no open redirect. (The browser test drives the same pages in Chromium against real workers.)"""

from __future__ import annotations

import re
import uuid

import pytest

from tests.fixtures_services import headers, qa_rows, register_model, upload_dataset

pytestmark = pytest.mark.services


def signed_in(api_client, key: str):
    """Sign in through the form; the client keeps the session cookie the server set (never the key)."""
    api_client.cookies.clear()
    resp = api_client.post(
        "/dashboard/login", data={"api_key": key, "next": "/dashboard/models"}, follow_redirects=False
    )
    assert resp.status_code == 303 and resp.headers["location"] == "/dashboard/models"
    cookie = resp.headers["set-cookie"]
    assert cookie.startswith("blade_session=") and key not in cookie
    assert (
        "Path=/dashboard" in cookie and "samesite=strict" in cookie.lower() and "httponly" in cookie.lower()
    )
    assert "Max-Age=43200" in cookie and "secure" not in cookie.lower()  # plain HTTP here; Secure over HTTPS
    return api_client


def csrf_of(client, path: str = "/dashboard") -> str:
    match = re.search(r'<meta name="csrf-token" content="([^"]+)">', client.get(path).text)
    assert match, "every signed-in page carries the session's CSRF token"
    return match.group(1)


def test_pages_need_a_valid_key(api_client):
    api_client.cookies.clear()
    root = api_client.get("/", follow_redirects=False)  # the URL `blade up` prints, opened in a browser
    assert root.status_code == 307 and root.headers["location"] == "/dashboard"
    resp = api_client.get("/dashboard/audit?action=x", follow_redirects=False)
    assert resp.status_code == 303
    assert resp.headers["location"] == "/dashboard/login?next=/dashboard/audit%3Faction%3Dx"
    assert api_client.get("/dashboard?fragment=1", follow_redirects=False).status_code == 401
    bad = api_client.post("/dashboard/login", data={"api_key": "blade_nope"}, follow_redirects=False)
    assert bad.status_code == 401 and "not valid" in bad.text
    # A sign-in posted from another site is refused (login CSRF); the same origin is fine.
    foreign = {"origin": "https://evil.example"}
    resp = api_client.post("/dashboard/login", data={"api_key": "x"}, headers=foreign, follow_redirects=False)
    assert resp.status_code == 403 and "set-cookie" not in resp.headers
    same = {"origin": "http://testserver"}
    assert api_client.post("/dashboard/login", data={"api_key": "x"}, headers=same).status_code == 401
    # `next` must stay on the dashboard (no open redirect).
    page = api_client.get("/dashboard/login?next=https://evil.example/")
    assert 'value="/dashboard"' in page.text and "evil" not in page.text


def test_pages_render_for_a_tenant_and_hide_other_tenants(api_client, ready, make_key):
    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    client = signed_in(api_client, ready.tenant.admin)
    for path in (
        "/dashboard",
        "/dashboard/requests",
        "/dashboard/models",
        "/dashboard/audit",
        f"/dashboard/requests/{rid}",
        f"/dashboard/models/{ready.base_model}",
    ):
        resp = client.get(path)
        assert resp.status_code == 200, (path, resp.text[:300])
        assert "<!doctype html>" in resp.text and 'id="who"' in resp.text
    assert rid in client.get("/dashboard/requests").text
    bogus = client.get("/dashboard/requests", params={"state": "bogus"}).text
    assert 'id="unknown-state"' in bogus and "“bogus”" in bogus and rid in bogus  # said, then all shown
    assert 'id="unknown-state"' not in client.get("/dashboard/requests", params={"state": "queued"}).text
    hostile = client.get("/dashboard/requests", params={"state": "<script>x</script>"}).text
    assert "<script>x</script>" not in hostile and "&lt;script&gt;" in hostile
    fragment = client.get("/dashboard?fragment=1")
    assert (
        fragment.status_code == 200 and 'id="state-tiles"' in fragment.text and "<html" not in fragment.text
    )
    assert client.get(f"/dashboard/requests/{rid}/certificate").status_code == 409  # not succeeded yet
    for asset in (
        "dashboard.css",
        "dashboard.js",
        "request.js",
        "model.js",
        "vendor/uplot/uPlot.iife.min.js",
        "vendor/uplot/uPlot.min.css",
        "vendor/uplot/LICENSE.txt",
    ):
        assert client.get(f"/dashboard/static/{asset}").status_code == 200, asset

    assert ready.base_model in client.get("/dashboard").text  # its queued request, by base model
    stranger = signed_in(api_client, make_key("another-tenant", ["admin"]))
    assert ready.base_model not in stranger.get("/dashboard").text  # not even the private model's name
    assert stranger.get(f"/dashboard/requests/{rid}").status_code == 404
    assert stranger.get(f"/dashboard/models/{ready.base_model}").status_code == 404
    assert rid not in stranger.get("/dashboard/requests").text
    api_client.cookies.clear()


def test_read_only_key_gets_no_action_buttons(api_client, ready, make_key):
    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    admin = signed_in(api_client, ready.tenant.admin)
    assert 'id="cancel-btn"' in admin.get(f"/dashboard/requests/{rid}").text
    reader = signed_in(api_client, make_key(ready.tenant.name, ["read"]))
    assert 'id="cancel-btn"' not in reader.get(f"/dashboard/requests/{rid}").text
    page = reader.get(f"/dashboard/models/{ready.base_model}").text
    assert 'id="readonly-note"' in page and "state-dialog" not in page
    api_client.cookies.clear()


def test_the_page_never_sees_the_key_and_every_page_has_a_strict_csp(api_client, ready):
    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    client = signed_in(api_client, ready.tenant.admin)
    for path in ("/dashboard", f"/dashboard/requests/{rid}", f"/dashboard/models/{ready.base_model}"):
        resp = client.get(path)
        assert ready.tenant.admin not in resp.text
        csp = resp.headers["content-security-policy"]
        assert (
            "script-src 'self';" in csp
            and "frame-ancestors 'none'" in csp
            and "unsafe-inline" not in csp.split("style-src")[0]
        )
        # Nothing the CSP would block: no inline script, no on* handler attributes.
        assert not re.search(r"\son[a-z]+=", resp.text), path
        assert all(
            "src=" in tag or "application/json" in tag for tag in re.findall(r"<script[^>]*>", resp.text)
        )
    login = client.get("/dashboard/login")
    assert "content-security-policy" in login.headers
    assert "content-security-policy" not in client.get("/healthz").headers  # the JSON API is untouched
    api_client.cookies.clear()


def test_dashboard_actions_need_the_session_and_its_csrf_token(api_client, ready, make_key):
    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    path = f"/dashboard/api/unlearn-requests/{rid}/cancel"
    api_client.cookies.clear()
    assert api_client.post(path, headers={"X-CSRF-Token": "x"}).status_code == 401

    reader = signed_in(api_client, make_key(ready.tenant.name, ["read"]))
    token = csrf_of(reader)
    assert (
        reader.get(f"/dashboard/api/unlearn-requests/{rid}", headers={"X-CSRF-Token": token}).json()["id"]
        == rid
    )
    resp = reader.post(path, headers={"X-CSRF-Token": token})
    assert resp.status_code == 403 and "submit" in resp.json()["error"]["message"]  # the key's scopes hold
    # Asking the model needs only the read scope, and the token like every call; the API's handler answers.
    ask = f"/dashboard/api/base-models/{ready.base_model}/generate"
    assert reader.post(ask, json={"question": "Who?"}).json()["error"]["code"] == "csrf"
    resp = reader.post(ask, headers={"X-CSRF-Token": token}, json={})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "prompt", resp.text

    admin = signed_in(api_client, ready.tenant.admin)
    token = csrf_of(admin)
    for bad in (
        {},
        {"X-CSRF-Token": "not-the-token"},
        {"X-CSRF-Token": token[:-2]},
        {"X-CSRF-Token": "é".encode()},  # non-ASCII: hmac.compare_digest refuses such a str (was a 500)
    ):
        resp = admin.post(path, headers=bad)
        assert resp.status_code == 403 and resp.json()["error"]["code"] == "csrf", bad
    assert (
        api_client.get(f"/unlearn-requests/{rid}", headers=headers(ready.tenant.admin)).json()["status"]
        == "queued"
    )
    resp = admin.post(path, headers={"X-CSRF-Token": token})
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled", resp.text
    events = admin.get(f"/dashboard/api/unlearn-requests/{rid}/events", headers={"X-CSRF-Token": token})
    assert events.status_code == 200 and events.json()["items"] == []
    api_client.cookies.clear()


def test_sign_out_revocation_and_expiry_end_the_session(api_client, api_app, ready, make_key):
    from sqlalchemy import update

    from blade_service.persistence.models import DashboardSession, utcnow

    client = signed_in(api_client, ready.tenant.admin)
    token = csrf_of(client)
    assert (
        client.post("/dashboard/logout", data={"csrf_token": "wrong"}, follow_redirects=False).status_code
        == 403
    )
    assert client.get("/dashboard", follow_redirects=False).status_code == 200
    resp = client.post("/dashboard/logout", data={"csrf_token": token}, follow_redirects=False)
    assert resp.status_code == 303
    old = resp.request.headers.get("cookie", "")
    api_client.cookies.clear()
    api_client.headers["cookie"] = old  # replaying the old cookie after sign-out
    assert api_client.get("/dashboard", follow_redirects=False).status_code == 303
    del api_client.headers["cookie"]

    secret = make_key(ready.tenant.name, ["admin"], name="to revoke")
    client = signed_in(api_client, secret)
    assert client.get("/dashboard", follow_redirects=False).status_code == 200
    me = api_client.get("/me", headers=headers(secret)).json()
    assert (
        api_client.post(f"/api-keys/{me['id']}/revoke", headers=headers(ready.tenant.admin)).status_code
        == 200
    )
    assert client.get("/dashboard", follow_redirects=False).status_code == 303  # at once

    client = signed_in(api_client, ready.tenant.admin)
    assert client.get("/dashboard", follow_redirects=False).status_code == 200
    with api_app.state.session_factory() as session, session.begin():
        session.execute(update(DashboardSession).values(expires_at=utcnow()))
    assert client.get("/dashboard", follow_redirects=False).status_code == 303
    api_client.cookies.clear()


def test_non_converged_run_has_an_amber_badge(api_client, api_app, ready):
    from tests.test_certificates import run_to_success

    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    run_to_success(api_app, rid, run_status="max_steps")
    client = signed_in(api_client, ready.tenant.admin)
    assert "badge amber not-converged" in client.get(f"/dashboard/requests/{rid}").text
    assert "badge amber not-converged" in client.get("/dashboard/requests").text
    assert "run-warning" not in client.get(f"/dashboard/requests/{rid}").text
    # The run's warnings (the worker keeps them with the metrics after it) are shown on its page.
    from blade_service.persistence.models import UnlearnRequest

    with api_app.state.session_factory() as session, session.begin():
        request = session.get(UnlearnRequest, rid)
        request.metrics_after = {**request.metrics_after, "warnings": ["forget Prob essentially unchanged"]}
    page = client.get(f"/dashboard/requests/{rid}").text
    assert (
        '<div class="notice warn run-warning" style="margin-top:12px">forget Prob essentially unchanged'
        in page
    )
    api_client.cookies.clear()


def test_a_request_whose_adapter_was_rolled_back_says_so(api_client, api_app, ready, tmp_path):
    from tests.test_api_adapters import succeed_with_adapter

    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    rid = api_client.get(f"/adapters/{adapter_id}", headers=headers(ready.tenant.admin)).json()["request_id"]
    client = signed_in(api_client, ready.tenant.admin)
    pages = (f"/dashboard/requests/{rid}", "/dashboard/requests", "/dashboard")
    assert all("badge amber rolled-back" not in client.get(page).text for page in pages)
    body = {"reason": "withdrawn"}
    assert (
        api_client.post(
            f"/adapters/{adapter_id}/disable", headers=headers(ready.tenant.admin), json=body
        ).status_code
        == 200
    )
    assert all("badge amber rolled-back" in client.get(page).text for page in pages)
    api_client.cookies.clear()


def test_a_tenants_overview_and_audit_page_count_only_its_own(api_client, ready, make_key):
    """Queued requests on a shared model are counted per tenant (another tenant's are its activity, not
    the viewer's), and the audit page verifies the tenant's own entries, as `GET /audit-log/verify` does."""
    shared = register_model(api_client, ready.tenant.admin, shared=True)
    other = make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"])
    bodies = [(ready.tenant.admin, ready.body(base_model=shared))] * 2
    forget, retain = (upload_dataset(api_client, other, qa_rows(3, p))["id"] for p in ("f", "r"))
    bodies.append(
        (other, {**ready.body(base_model=shared), "forget_dataset": forget, "retain_dataset": retain})
    )
    for key, body in bodies:
        assert api_client.post("/unlearn-requests", headers=headers(key), json=body).status_code == 202
    for key, mine in ((ready.tenant.admin, 2), (other, 1)):
        page = signed_in(api_client, key).get("/dashboard").text
        assert f'<a href="/dashboard/models/{shared}">{shared}</a>: {mine}</div>' in page
        audit_page = api_client.get("/dashboard/audit").text
        assert (
            "of your tenant's entries verified" in audit_page
            and "from the first to the head" not in audit_page
        )
    api_client.cookies.clear()


def workers_panel(page: str) -> str:
    match = re.search(r'<table id="workers">.*?</table>', page, re.S)
    assert match, "the overview has a workers table"
    return match.group(0)


def test_a_tenant_sees_workers_numbered_and_the_operator_sees_their_hosts(api_client, api_app, ready):
    """The host and process a worker runs as are the operator's to see: a tenant's workers panel numbers the
    workers (queues, state, device, its own request) and its request page names no lease owner. (The audit
    entries keep their actor, `worker:<owner>`: it is part of what the tenant verifies.)"""
    from blade_service.persistence import jobs
    from tests.fixtures_services import ADMIN_SECRET

    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    host = f"gpu-node-{uuid.uuid4().hex[:8]}.internal"
    owner = f"celery@{host}:4242"
    with api_app.state.session_factory() as session, session.begin():
        assert jobs.claim_request(session, request_id=rid, owner=owner, lease_seconds=60).claimed
        jobs.beat_worker(
            session,
            worker_name=f"celery@{host}",
            queues=["unlearn"],
            hostname=host,
            pid=4242,
            current_request_id=rid,
            info={"python": "3.11", "device": "cuda"},
        )
    try:
        tenant = signed_in(api_client, ready.tenant.admin)
        panel = workers_panel(tenant.get("/dashboard").text)
        assert host not in panel and "pid 4242" not in panel
        assert re.search(r'data-worker="worker \d+"', panel) and f"/dashboard/requests/{rid}" in panel
        assert "Worker: " not in tenant.get(f"/dashboard/requests/{rid}").text
        operator = signed_in(api_client, ADMIN_SECRET)
        assert f'data-worker="celery@{host}"' in workers_panel(operator.get("/dashboard").text)
    finally:
        with api_app.state.session_factory() as session, session.begin():
            jobs.beat_worker(session, worker_name=f"celery@{host}", current_request_id=None, alive=False)
        api_client.cookies.clear()


def test_the_operator_opens_a_tenants_model_and_nobody_else_can(api_client, ready, make_key):
    """Names are per tenant, so the operator's dashboard takes `?tenant=` as the API does: the models page
    lists that tenant's models with links that keep it, and the model page (and its live fragment) shows the
    stack. A tenant naming another tenant gets the same 404 as for a model that does not exist."""
    from tests.fixtures_services import ADMIN_SECRET

    tenant = ready.tenant.name
    operator = signed_in(api_client, ADMIN_SECRET)
    assert ready.base_model not in operator.get("/dashboard/models").text  # not the operator's own
    assert operator.get(f"/dashboard/models/{ready.base_model}").status_code == 404
    listing = operator.get("/dashboard/models", params={"tenant": tenant}).text
    assert f'href="/dashboard/models/{ready.base_model}?tenant={tenant}"' in listing
    for params in ({"tenant": tenant}, {"tenant": tenant, "fragment": "1"}):
        page = operator.get(f"/dashboard/models/{ready.base_model}", params=params)
        assert page.status_code == 200 and 'class="tl-item base"' in page.text, page.text[:300]
    assert (
        f"&amp;tenant={tenant}" in operator.get(f"/dashboard/models/{ready.base_model}?tenant={tenant}").text
    )
    assert operator.get("/dashboard/models", params={"tenant": "no-such-tenant"}).status_code == 404
    for hostile in ("a%00b", "x" * 101, "%ED%A0%80", "%FF"):  # NUL, too long, a lone surrogate, not UTF-8
        status = operator.get(f"/dashboard/models/{ready.base_model}?tenant={hostile}").status_code
        assert 400 <= status < 500, (hostile, status)

    stranger = signed_in(api_client, make_key(f"t-{uuid.uuid4().hex[:8]}", ["admin"]))
    for path in ("/dashboard/models", f"/dashboard/models/{ready.base_model}"):
        assert stranger.get(path, params={"tenant": tenant}).status_code == 404, path
    assert 'id="tenant-form"' not in stranger.get("/dashboard/models").text
    api_client.cookies.clear()


def test_the_operator_sees_a_tenants_request_ids_on_its_model_without_links_it_cannot_open(
    api_client, api_app, ready, tmp_path
):
    from tests.fixtures_services import ADMIN_SECRET
    from tests.test_api_adapters import succeed_with_adapter

    adapter_id = succeed_with_adapter(api_client, api_app, ready, tmp_path)
    rid = api_client.get(f"/adapters/{adapter_id}", headers=headers(ready.tenant.admin)).json()["request_id"]
    path = f"/dashboard/models/{ready.base_model}"
    own = signed_in(api_client, ready.tenant.admin).get(path).text
    assert f'href="/dashboard/requests/{rid}"' in own  # the tenant opens its own request
    page = signed_in(api_client, ADMIN_SECRET).get(path, params={"tenant": ready.tenant.name}).text
    assert rid[:16] in page and f'href="/dashboard/requests/{rid}"' not in page
    api_client.cookies.clear()
