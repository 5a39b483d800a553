"""The dashboard's server side through HTTP on the real PostgreSQL: sign-in, tenant scoping, live fragments,
and no open redirect. (The browser test drives the same pages in Chromium against real workers.)"""

from __future__ import annotations

import pytest

from tests.fixtures_services import headers

pytestmark = pytest.mark.services


def signed_in(api_client, key: str):
    api_client.cookies.clear()
    resp = api_client.post(
        "/dashboard/login", data={"api_key": key, "next": "/dashboard/models"}, follow_redirects=False
    )
    assert resp.status_code == 303 and resp.headers["location"] == "/dashboard/models"
    cookie = resp.headers["set-cookie"]
    assert "blade_key=" in cookie and "Path=/dashboard" in cookie and "samesite=strict" in cookie.lower()
    api_client.cookies.set("blade_key", key, path="/dashboard")
    return api_client


def test_pages_need_a_valid_key(api_client):
    api_client.cookies.clear()
    resp = api_client.get("/dashboard/audit?action=x", follow_redirects=False)
    assert resp.status_code == 303
    assert resp.headers["location"] == "/dashboard/login?next=/dashboard/audit%3Faction%3Dx"
    assert api_client.get("/dashboard?fragment=1", follow_redirects=False).status_code == 401
    bad = api_client.post("/dashboard/login", data={"api_key": "blade_nope"}, follow_redirects=False)
    assert bad.status_code == 401 and "not valid" in bad.text
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

    stranger = signed_in(api_client, make_key("another-tenant", ["admin"]))
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
