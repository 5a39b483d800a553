"""The dashboard in a real headless Chromium (Debian's /usr/bin/chromium driven by Playwright), against the
e2e service: a real API process and real Celery workers on PostgreSQL and Redis, training a tiny model.

Sign in; watch a running request's chart draw points as steps arrive; open the model page, disable an adapter
and see the stack update (the version trained on top of it flagged); a read-only key sees no rollback buttons
and the API refuses it anyway, but it may ask the effective model a question; cancel a running request.
Screenshots of each page go to the test's tmp dir and to `out/screenshots/`.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_worker import ROOT, forget_rows, jsonl, retain_rows, wait_until
from tests.tiers import unavailable

pytestmark = [pytest.mark.browser, pytest.mark.e2e, pytest.mark.services, pytest.mark.timeout(300)]

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "out" / "screenshots"
# Enough steps to watch the chart grow; BLADE's early stop off so the run is as long as asked.
WATCHED = {"max_steps": 30, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}
QUICK = {"max_steps": 6, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}
LONG = {"max_steps": 2000, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        unavailable("no /usr/bin/chromium (make browser installs Debian's chromium)")
    from playwright import sync_api

    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


class Shots:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def __call__(self, page: Any, name: str) -> None:
        path = self.tmp / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        shutil.copy(path, SCREENSHOTS / path.name)


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Shots:
    return Shots(tmp_path_factory.mktemp("screenshots"))


@pytest.fixture(scope="module")
def site(e2e, tiny_model_dir):
    """A fresh tenant (admin and read-only keys), its base model and datasets, on the e2e service."""
    import httpx

    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    with httpx.Client(base_url=e2e.url, timeout=60) as c:

        def key(scopes: list[str], name: str) -> str:
            resp = c.post(
                "/api-keys",
                headers={"Authorization": f"Bearer {e2e.admin_key}"},
                json={"name": name, "scopes": scopes, "tenant": tenant},
            )
            assert resp.status_code == 201, resp.text
            return resp.json()["key"]

        admin, reader = key(["admin"], "ops admin"), key(["read"], "auditor (read-only)")
        auth = {"Authorization": f"Bearer {admin}"}
        model = f"tiny-{uuid.uuid4().hex[:6]}"
        resp = c.post(  # a directory on the workers: the operator registers it for the tenant
            "/base-models",
            headers={"Authorization": f"Bearer {e2e.admin_key}"},
            json={
                "name": model,
                "source": str(tiny_model_dir),
                "description": "tiny Llama for the dashboard test",
                "tenant": tenant,
            },
        )
        assert resp.status_code == 201, resp.text
        forget = c.post(
            "/datasets", headers=auth, files={"file": ("forget-author-7.jsonl", jsonl(forget_rows()))}
        )
        retain = c.post("/datasets", headers=auth, files={"file": ("retain.jsonl", jsonl(retain_rows()))})
        assert forget.status_code == retain.status_code == 201
    return {
        "url": e2e.url,
        "admin": admin,
        "reader": reader,
        "model": model,
        "forget": forget.json()["id"],
        "retain": retain.json()["id"],
        "tenant": tenant,
    }


def submit(site: dict[str, Any], params: dict[str, Any], note: str) -> str:
    import httpx

    resp = httpx.post(
        f"{site['url']}/unlearn-requests",
        headers={"Authorization": f"Bearer {site['admin']}"},
        json={
            "base_model": site["model"],
            "forget_dataset": site["forget"],
            "retain_dataset": site["retain"],
            "method": "blade",
            "params": params,
            "metadata": {"ticket": note},
        },
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def api_status(site: dict[str, Any], request_id: str) -> dict[str, Any]:
    import httpx

    return httpx.get(
        f"{site['url']}/unlearn-requests/{request_id}",
        headers={"Authorization": f"Bearer {site['admin']}"},
        timeout=30,
    ).json()


def new_page(browser, site, problems: list[str]):
    context = browser.new_context(viewport={"width": 1440, "height": 900}, base_url=site["url"])
    page = context.new_page()
    # Every asset is local: any failed request or script error is a bug. But a poll still in flight when the
    # page navigates (the test's goto, or the page reloading itself once a request ends) is aborted by the
    # browser, not failed by the server.
    page.on(
        "requestfailed",
        lambda r: _aborted_poll(r) or problems.append(f"request failed ({r.failure}): {r.url}"),
    )
    page.on(
        "response",
        lambda r: r.status >= 400 and "/dashboard/static" in r.url and problems.append(f"{r.status} {r.url}"),
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("dialog", lambda d: d.accept())  # the cancel button's confirm()
    return page


def _aborted_poll(request) -> bool:
    return request.failure == "net::ERR_ABORTED" and request.resource_type in ("fetch", "xhr")


def sign_in(page, key: str, shots: Shots | None = None) -> None:
    page.goto("/dashboard")
    assert "/dashboard/login" in page.url
    page.fill("#api_key", "blade_wrong_key")
    page.click("#login-form button[type=submit]")
    assert "not valid" in page.inner_text("#login-error")
    page.fill("#api_key", key)
    if shots:
        shots(page, "01-sign-in")
    page.click("#login-form button[type=submit]")
    page.wait_for_url("**/dashboard")


class Timer:
    """Prints how long each stage took (pytest -s), to keep the browser test's time in view."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()

    def mark(self, what: str) -> None:
        now = time.monotonic()
        print(f"[browser] {what}: +{now - self.last:.1f} s (total {now - self.start:.1f} s)")
        self.last = now


def points(page) -> int:
    return int(page.get_attribute("#chart-losses", "data-points") or 0)


def test_dashboard_end_to_end(browser, site, shots):
    problems: list[str] = []
    pages: list[Any] = []
    try:
        run_scenario(browser, site, shots, problems, pages)
    except Exception:
        for i, page in enumerate(pages):  # what the browser showed when it failed
            shots(page, f"failure-{i}")
        print("browser problems:", problems)
        raise


def run_scenario(browser, site, shots, problems: list[str], pages: list[Any]) -> None:
    timer = Timer()
    # A run too long to end on its own while we watch: its chart must grow, then we cancel it. (A short run
    # can finish between two polls on an idle machine, so the live view is watched on this one.)
    long_run = submit(site, LONG, "DSR-1040")
    page = new_page(browser, site, problems)
    pages.append(page)
    sign_in(page, site["admin"], shots)

    # The request page: the chart gains points while the worker reports steps.
    page.goto(f"/dashboard/requests/{long_run}")
    # Polled from here: the pages' CSP (script-src 'self') forbids the eval that wait_for_function uses.
    wait_until(lambda: points(page) >= 2, 120, 0.25, "two chart points")
    seen = points(page)
    wait_until(lambda: points(page) > seen, 60, 0.25, "a new chart point")
    assert points(page) > seen >= 2
    assert (
        page.locator("#chart-losses canvas").count() == 1
        and page.locator("#chart-lambda canvas").count() == 1
    )
    assert page.locator("#cancel-btn").is_visible()
    # The "before" metrics (measured ahead of step 1) appear while it runs, without a reload.
    page.wait_for_selector("#metrics", timeout=30_000)
    assert "forget.Prob" in page.inner_text("#metrics")
    shots(page, "03-request-running")
    timer.mark("chart grew")

    # The overview meanwhile: the worker is running it, with its progress.
    page.goto("/dashboard")
    page.wait_for_selector(f".worker-row a[href='/dashboard/requests/{long_run}']", timeout=30_000)
    shots(page, "02-overview")

    # Cancel it from its page.
    page.goto(f"/dashboard/requests/{long_run}")
    with page.expect_navigation(timeout=60_000):  # the page reloads once the request is cancelled
        page.click("#cancel-btn")
    page.wait_for_selector(".notice.warn")
    assert api_status(site, long_run)["status"] == "cancelled"
    assert page.locator("#status-badge .badge.cancelled").count() == 1
    assert page.locator("#cancel-btn").count() == 0
    shots(page, "11-request-cancelled")
    timer.mark("long request cancelled")

    # Two short requests; the second trains on top of the first one's adapter. When the first ends, its page
    # reloads with the metrics and the certificate link.
    first = submit(site, WATCHED, "DSR-1041")
    second = submit(site, QUICK, "DSR-1042")
    page.goto(f"/dashboard/requests/{first}")
    page.wait_for_selector("#status-badge .badge.succeeded", timeout=150_000)
    page.wait_for_selector("#metrics")
    assert points(page) == WATCHED["max_steps"]
    assert "forget.Prob" in page.inner_text("#metrics")
    assert page.locator("#cancel-btn").count() == 0
    shots(page, "04-request-succeeded")
    timer.mark("first request succeeded")

    wait_until(lambda: api_status(site, second)["status"] == "succeeded", 150, 0.5, "the second request")
    timer.mark("second request succeeded")
    # The model page: v1 and v2 (on top of v1); disable v1 with a reason and a confirmation.
    page.goto(f"/dashboard/models/{site['model']}")
    v1, v2 = page.locator("li[data-version='1']"), page.locator("li[data-version='2']")
    assert v1.get_attribute("data-state") == "active" and v2.get_attribute("data-state") == "active"
    assert page.locator(".badge.stale").count() == 0
    shots(page, "05-model-stack")
    v1.locator("button[data-action='disable']").click()
    page.wait_for_selector("#state-dialog[open]")
    page.click("#dlg-next")  # no reason yet: refused
    assert page.is_visible("#dlg-reason")
    page.fill("#dlg-reason", "DSR-1041 adapter degraded retain accuracy")
    page.click("#dlg-next")
    assert "Disable version 1" in page.inner_text("#dlg-confirm-text")
    shots(page, "06-model-disable-confirm")
    page.click("#dlg-confirm")
    page.wait_for_selector("li[data-version='1'][data-state='disabled']")
    assert "Trained on a different stack now: v2" in page.inner_text("#toast")
    assert page.locator("li[data-version='2'] .badge.stale").count() == 1
    assert "DSR-1041 adapter degraded retain accuracy" in v1.inner_text()
    assert page.inner_text("#active-versions").strip() == "v2"
    shots(page, "07-model-after-disable")

    # The audit page: the chain verifies, and the disable is there with its reason.
    page.goto("/dashboard/audit?action=adapter.disable")
    assert page.get_attribute("#chain-status", "data-intact") == "true"
    assert "DSR-1041 adapter degraded retain accuracy" in page.inner_text("#audit")
    page.goto("/dashboard/audit")
    shots(page, "08-audit")

    # The printable certificate of the first request.
    page.goto(f"/dashboard/requests/{first}/certificate")
    assert "evidence of removal, not proof" in page.inner_text(".statement")
    assert "not in the effective model" in page.inner_text("body")  # v1 is disabled now
    shots(page, "09-certificate")

    # Restore v1 so the stack is whole again.
    page.goto(f"/dashboard/models/{site['model']}")
    page.locator("li[data-version='1'] button[data-action='enable']").click()
    page.fill("#dlg-reason", "reviewed: restore")
    page.click("#dlg-next")
    page.click("#dlg-confirm")
    page.wait_for_selector("li[data-version='1'][data-state='active']")

    # A read-only key: no rollback buttons, and the API refuses the call if it is made anyway.
    reader = new_page(browser, site, problems)
    pages.append(reader)
    sign_in(reader, site["reader"])
    reader.goto(f"/dashboard/models/{site['model']}")
    assert reader.locator(".state-btn").count() == 0 and reader.locator("#state-dialog").count() == 0
    assert reader.is_visible("#readonly-note")
    adapter_id = reader.get_attribute("li[data-version='2']", "data-adapter")
    refused = reader.evaluate(
        """async (id) => { try { await Blade.api('POST', `/adapters/${id}/disable`, {reason: 'x'});
                               return 'accepted'; } catch (e) { return e.status + ' ' + e.code; } }""",
        adapter_id,
    )
    assert refused == "403 insufficient_scope"
    shots(reader, "10-model-read-only")
    # A read-only key may ask the effective model (base + v1 + v2) a question, as QA rows ask it.
    question = forget_rows(1)[0]["question"]
    reader.fill("#ask-question", question)
    reader.click("#ask-btn")
    reader.wait_for_selector("#ask-answer:not([hidden])", timeout=90_000)
    said = reader.inner_text("#ask-stack")
    assert "+ 2 active version(s)" in said and f"Question: {question}" in said, said
    assert reader.inner_text("#ask-text").strip() != ""
    shots(reader, "13-model-ask")
    reader.goto(f"/dashboard/requests/{first}")
    assert reader.locator("#cancel-btn").count() == 0

    page.goto("/dashboard/requests")
    assert page.locator("#requests tbody tr").count() == 3
    shots(page, "12-requests")

    assert not problems, problems
