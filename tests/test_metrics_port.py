"""With BLADE_METRICS_PORT set, /metrics is served on that port only, never on the public API port."""

from __future__ import annotations

import socket

import httpx
import pytest

pytestmark = pytest.mark.services


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_move_to_their_own_port(service_settings):
    from fastapi.testclient import TestClient

    from blade_service.api.main import create_app

    port = _free_port()
    settings = service_settings.model_copy(update={"metrics_port": port})
    with TestClient(create_app(settings)) as client:
        assert client.get("/metrics").status_code == 404
        assert client.get("/healthz").status_code == 200
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert scraped.status_code == 200
    assert "blade_database_up 1.0" in scraped.text and "blade_http_requests_total" in scraped.text
