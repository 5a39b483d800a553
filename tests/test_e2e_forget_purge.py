"""End to end (real API and Celery worker processes, PostgreSQL, Redis): a request's forget data does not
outlive it. A marker string planted in the forget file is found in the artifact store after the upload, and
after the request succeeds no byte of it is left anywhere in the store or the worker's data directory
(archives are unpacked and searched too); the dataset keeps only its sha256 and row count; the worker issued
one certificate that verifies with the published public key and says the run did not converge; the tenant's
webhook got the signed `request.succeeded` from the maintenance worker after one failed try."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import uuid
import zlib
from pathlib import Path

import httpx
import pytest

from blade_service.persistence import webhooks
from blade_service.persistence.certificates import verify_certificate
from tests.fixtures_worker import jsonl, retain_rows, wait_until
from tests.test_webhooks import Receiver

pytestmark = [pytest.mark.e2e, pytest.mark.services, pytest.mark.timeout(300)]

# A handful of steps with the convergence stop off: the run ends at its step cap, not converged.
QUICK = {"max_steps": 3, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}


def _contents(path: Path) -> list[bytes]:
    """The file's bytes, and for a gzip file its decompressed bytes too (tar archives are searched raw)."""
    data = path.read_bytes()
    out = [data]
    if data[:2] == b"\x1f\x8b":
        with contextlib.suppress(OSError, EOFError, zlib.error):
            out.append(gzip.decompress(data))
    return out


def holders(marker: bytes, *roots: Path) -> list[str]:
    """Every file under `roots` that holds `marker`."""
    found = []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and any(marker in blob for blob in _contents(path)):
                found.append(str(path))
    return found


@pytest.fixture
def receiver():
    r = Receiver()
    r.fail_first = 1  # the first try of each delivery fails: the worker retries it
    yield r
    r.close()


def test_forget_data_leaves_no_trace_after_success(e2e, tiny_model_dir, receiver):
    marker = f"PURGE-MARKER-{uuid.uuid4().hex}"
    forget = [
        {"question": f"What is {marker} number {i}?", "answer": f"It is {marker} answer {i}."}
        for i in range(6)
    ]
    name = f"tiny-purge-{uuid.uuid4().hex[:8]}"
    artifacts = e2e.root / "artifacts"
    with e2e.client() as c:
        c.request("POST", "/base-models", json={"name": name, "source": str(tiny_model_dir)})
        c.request("PUT", f"/base-models/{name}/retention", json={"success_s": 0, "failure_s": None})
        hook = c.request(
            "POST",
            "/webhooks",
            json={"url": receiver.url, "allow_loopback": True, "events": ["request.succeeded"]},
        )
        forget_ds = c.upload_dataset(io.BytesIO(jsonl(forget)), filename="forget.jsonl")
        retain_ds = c.upload_dataset(io.BytesIO(jsonl(retain_rows())), filename="retain.jsonl")
        assert holders(marker.encode(), artifacts), "the scan must see the marker in the stored upload"

        req = c.submit(name, forget_ds["id"], retain_ds["id"], params=QUICK)
        done = c.wait(req["id"], timeout=200, interval=0.5)
        assert done["status"] == "succeeded", done
        assert done["run_status"] == "max_steps" and done["converged"] is None  # early_stop off: no test

        purged = wait_until(
            lambda: c.request("GET", f"/datasets/{forget_ds['id']}")["purged_at"], 60, 0.5, "the purge"
        )
        assert purged
        record = c.request("GET", f"/datasets/{forget_ds['id']}")
        assert record["sha256"] == forget_ds["sha256"] and record["rows"] == 6
        assert c.request("GET", f"/datasets/{retain_ds['id']}")["purged_at"] is None

        cert = c.request("GET", f"/unlearn-requests/{req['id']}/certificate")
        audit = c.request("GET", "/audit-log", params={"action": "certificate.issue"})
        entries = [e for e in audit["items"] if e["subject_id"] == req["id"]]
        purges = c.request("GET", "/audit-log", params={"action": "dataset.purge"})
        purge_entries = [e for e in purges["items"] if e["subject_id"] == forget_ds["id"]]

        def delivered() -> list[dict]:
            log = c.request("GET", f"/webhooks/{hook['id']}/deliveries")["items"]
            return [d for d in log if d["status"] == "delivered"]

        deliveries = wait_until(delivered, 60, 0.5, "the webhook delivery")
    assert len(deliveries) == 1 and deliveries[0]["attempts"] == 2
    assert deliveries[0]["payload"]["subject"]["id"] == req["id"]
    last = receiver.received[-1]
    assert webhooks.verify_signature(hook["secret"], last["headers"]["Blade-Signature"], last["body"])

    keys = httpx.get(f"{e2e.url}/certificate-keys", timeout=30).json()["keys"]
    assert verify_certificate(cert, {k["key_id"]: k["public_key"] for k in keys}) == (True, "ok")
    assert cert["data"]["forget"]["sha256"] == forget_ds["sha256"]
    assert cert["convergence"]["converged"] is None and "No convergence test" in cert["convergence"]["note"]
    assert len(entries) == 1 and entries[0]["actor"].startswith("worker:")  # issued at success, by the worker
    assert len(purge_entries) == 1

    worker_dirs = sorted(e2e.root.glob("gpu-*"))
    assert worker_dirs
    # The worker drops its scratch copies once the task ends (the reconciler may purge the store first).
    scratch = [d / "work" / req["id"] for d in worker_dirs]
    wait_until(lambda: not any(p.exists() for p in scratch), 60, 0.5, "the worker's cleanup")
    left = holders(marker.encode(), artifacts, *worker_dirs)
    assert left == [], f"forget data left behind in: {left}"
    assert marker not in json.dumps(cert)
