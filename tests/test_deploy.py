"""The compose deployment as an operator runs it: one GPU per training worker, pinned images, /metrics off
the public port, one scheduler, alert rules and dashboard panels over metrics the code really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_each_training_worker_owns_one_distinct_gpu():
    workers = {name: s for name, s in SERVICES.items() if "unlearn" in (s.get("command") or [])}
    assert len(workers) >= 4
    ids = []
    for name, service in workers.items():
        (device,) = _devices(service)
        assert len(device["device_ids"]) == 1, name
        assert "count" not in device, name  # a count reservation does not spread replicas over GPUs
        assert service["environment"]["BLADE_DEVICE"] == "cuda:0", name  # the one GPU the container sees
        assert "NVIDIA_VISIBLE_DEVICES" not in service["environment"], name
        ids.append(device["device_ids"][0])
    assert len(set(ids)) == len(ids)


def test_images_are_pinned():
    for name, service in SERVICES.items():
        image = service.get("image")
        if image is not None:
            assert ":" in image and not image.endswith(":latest"), name


def test_metrics_stay_inside_the_compose_network():
    api = SERVICES["api"]
    assert api["ports"] == ["8000:8000"]
    metrics_port = api["environment"]["BLADE_METRICS_PORT"]
    assert all(metrics_port not in p for p in api["ports"])
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    api_job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "blade-api")
    assert api_job["static_configs"][0]["targets"] == [f"api:{metrics_port}"]


def test_only_the_api_is_published_beyond_the_hosts_loopback():
    """Prometheus answers without authentication and names every tenant's base models; Grafana's password
    defaults to admin."""
    published = {name: s["ports"] for name, s in SERVICES.items() if s.get("ports")}
    assert published.pop("api") == ["8000:8000"]
    assert published and all(p.startswith("127.0.0.1:") for ports in published.values() for p in ports), (
        published
    )


def test_the_schedule_runs_in_exactly_one_single_replica_service():
    beat = [name for name, s in SERVICES.items() if "--beat" in (s.get("command") or [])]
    assert beat == ["scheduler"]
    assert SERVICES["scheduler"]["deploy"]["replicas"] == 1
    assert "maintenance" in SERVICES["scheduler"]["command"]


def test_hub_models_get_a_token_and_a_cache_volume():
    for name, service in SERVICES.items():
        if "unlearn" in (service.get("command") or []) or name == "worker-inference":
            env = service["environment"]
            assert "HF_TOKEN" in env and env["HF_HOME"].startswith("/models"), name
            assert "hfcache:/models" in service["volumes"], name


def exported_metrics() -> set[str]:
    """Every `"blade_..."` string in the API's and the workers' code (metric names among them)."""
    exported = set()
    for package in ("api", "worker"):
        for path in (ROOT / "blade_service" / package).rglob("*.py"):
            exported |= set(re.findall(r'"(blade_[a-z_]+)"', path.read_text()))
    return exported


def test_alert_rules_use_metrics_the_code_exports():
    rules = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text())["groups"][0]["rules"]
    exported = exported_metrics()
    names = {r["alert"] for r in rules}
    assert {"BladeWorkerDown", "BladeWorkerHeartbeatStale", "BladeOldestQueuedRequestTooOld"} <= names
    assert {"BladeRequestFailureRate", "BladeAuditChainBroken"} <= names
    for rule in rules:
        for metric in re.findall(r"\b(blade_[a-z_]+)", rule["expr"]):
            assert metric in exported, (rule["alert"], metric)


def test_dashboard_panels_use_metrics_the_code_exports():
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "blade.json").read_text())
    exported = exported_metrics()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            for metric in re.findall(r"\b(blade_[a-z_]+)", target["expr"]):
                name = re.sub(r"_(bucket|count|sum|total)$", "", metric)
                assert name in exported, (panel["title"], metric)
