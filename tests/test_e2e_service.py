"""End to end through HTTP: a real API process, real Celery worker processes, PostgreSQL and Redis.

The life of requests on a tiny model: upload -> submit -> succeeded -> adapter v1 -> a second request
stacks v2 on v1 -> disable v1 (v2 flagged) -> enable; an idempotent retry; a cancel; a GPU worker SIGKILLed
mid-run and restarted -> the request resumes from its checkpoint and succeeds with exactly one adapter.
"""

from __future__ import annotations

import hashlib
import io
import socket
import uuid

import pytest

from blade_service.client.http import ApiError
from tests.fixtures_worker import EVAL_MAX_NEW_TOKENS, forget_rows, jsonl, retain_rows, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.services, pytest.mark.timeout(300)]

# Small, fast runs: a handful of BLADE outer steps on the tiny model.
QUICK = {"max_steps": 4, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}


@pytest.fixture(scope="module")
def world(e2e, tiny_model_dir):
    """A tenant-independent base model (unique name) and uploaded forget/retain datasets."""
    name = f"tiny-{uuid.uuid4().hex[:8]}"
    with e2e.client() as c:
        c.request("POST", "/base-models", json={"name": name, "source": str(tiny_model_dir), "shared": True})
        forget = c.upload_dataset(io.BytesIO(jsonl(forget_rows())), filename="forget.jsonl")
        retain = c.upload_dataset(io.BytesIO(jsonl(retain_rows())), filename="retain.jsonl")
    return {"base_model": name, "forget": forget["id"], "retain": retain["id"]}


def _wait(c, request_id: str, timeout: float = 150.0) -> dict:
    return c.wait(request_id, timeout=timeout, interval=0.3)


def test_request_lifecycle_stacking_and_rollback(e2e_logs, world, tmp_path):
    e2e = e2e_logs
    with e2e.client() as c:
        key = uuid.uuid4().hex
        first = c.submit(
            world["base_model"], world["forget"], world["retain"], params=QUICK, idempotency_key=key
        )
        assert first["status"] == "queued"
        # An idempotent retry returns the original request, and creates nothing.
        again = c.submit(
            world["base_model"], world["forget"], world["retain"], params=QUICK, idempotency_key=key
        )
        assert again["id"] == first["id"]

        done = _wait(c, first["id"])
        assert done["status"] == "succeeded", done
        assert done["progress"]["step"] == QUICK["max_steps"]
        v1_id = done["adapter_id"]
        assert v1_id

        events = c.events(first["id"])
        assert [e["step"] for e in events] == list(range(1, QUICK["max_steps"] + 1))
        for record in events:
            assert {"step", "L_fgt", "L_ret", "lambda"} <= set(record)
        metrics = c.metrics(first["id"])
        for phase in ("before", "after"):
            assert {"forget", "retain", "mia"} <= set(metrics[phase])
            # the worker generates BLADE_EVAL_MAX_NEW_TOKENS for ROUGE, not the evaluation library's default
            assert metrics[phase]["settings"]["max_new_tokens"] == EVAL_MAX_NEW_TOKENS
        assert metrics["before"]["stack"] == []

        stack = c.adapters(world["base_model"])
        assert [(a["id"], a["version"], a["state"]) for a in stack] == [(v1_id, 1, "active")]
        v1 = stack[0]
        assert v1["request_id"] == first["id"] and len(v1["sha256"]) == 64 and v1["parent_stack"] == []
        archive = c.download_adapter(v1_id, tmp_path / "v1.tar.gz", extract=False)
        assert hashlib.sha256(archive.read_bytes()).hexdigest() == v1["sha256"]

        # The second request trains on top of v1.
        second = c.submit(world["base_model"], world["forget"], world["retain"], params=QUICK)
        done2 = _wait(c, second["id"])
        assert done2["status"] == "succeeded", done2
        stack = c.adapters(world["base_model"])
        assert [a["version"] for a in stack] == [1, 2]
        v2 = stack[1]
        assert v2["id"] == done2["adapter_id"] and v2["parent_stack"] == [v1_id]
        assert c.metrics(second["id"])["before"]["stack"] == [v1_id]

        # Greedy generation through the worker uses the active stack.
        out = c.generate(world["base_model"], "Where was Ada Alder born?", max_new_tokens=5)
        assert out["stack"] == [v1_id, v2["id"]] and isinstance(out["text"], str)

        # Roll v1 back: v2 is flagged as trained on a different stack; enable restores.
        change = c.disable(v1_id, "test rollback")
        assert change["adapter"]["state"] == "disabled"
        assert [a["id"] for a in change["flagged"]] == [v2["id"]]
        states = {a["id"]: (a["state"], a["trained_on_stale"]) for a in c.adapters(world["base_model"])}
        assert states == {v1_id: ("disabled", False), v2["id"]: ("active", True)}
        out = c.generate(world["base_model"], "Where was Ada Alder born?", max_new_tokens=5)
        assert out["stack"] == [v2["id"]]

        change = c.enable(v1_id, "restore")
        assert change["adapter"]["state"] == "active"
        states = {a["id"]: (a["state"], a["trained_on_stale"]) for a in c.adapters(world["base_model"])}
        assert states == {v1_id: ("active", False), v2["id"]: ("active", False)}

        actions = [e["action"] for e in c.audit_log() if e["subject_id"] in (first["id"], v1_id)]
        for action in (
            "unlearn_request.start",
            "unlearn_request.evaluate",
            "unlearn_request.succeed",
            "adapter.create",
            "adapter.disable",
            "adapter.enable",
        ):
            assert action in actions, actions


def test_cancel_running_request(e2e_logs, world):
    e2e = e2e_logs
    with e2e.client() as c:
        req = c.submit(
            world["base_model"], world["forget"], world["retain"], params={**QUICK, "max_steps": 5000}
        )
        wait_until(lambda: c.status(req["id"])["progress"]["step"] >= 2, 120, 0.3, "training to start")
        assert c.cancel(req["id"])["status"] in ("cancelling", "cancelled")
        done = _wait(c, req["id"], timeout=60)
        assert done["status"] == "cancelled", done
        assert done["adapter_id"] is None
        assert all(a["request_id"] != req["id"] for a in c.adapters(world["base_model"]))
        # Terminal states never change: a second cancel is answered, and nothing moves.
        assert c.cancel(req["id"])["status"] == "cancelled"


def test_worker_killed_mid_run_resumes_from_checkpoint(e2e_logs, world):
    e2e = e2e_logs
    steps = 24
    with e2e.client() as c:
        req = c.submit(
            world["base_model"],
            world["forget"],
            world["retain"],
            params={**QUICK, "max_steps": steps, "checkpoint_every": 3},
        )
        # Past a checkpoint that reached storage (steps 3, 6, ... are saved; step 7's record means 6 is saved
        # and uploaded), kill the worker and its pool child without warning.
        wait_until(lambda: c.status(req["id"])["progress"]["step"] >= 8, 120, 0.2, "a few steps")
        e2e.kill_gpu_worker()
        killed_at = c.status(req["id"])["progress"]["step"]
        assert killed_at < steps, "training finished before the kill; make the run longer"
        e2e.start_gpu_worker()

        done = _wait(c, req["id"], timeout=180)
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 2

        events = c.events(req["id"])
        assert [e["step"] for e in events] == list(range(1, steps + 1)), "the step history must be continuous"
        resumed = [e for e in events if "resumed_from" in e]
        assert len(resumed) == 1
        start = resumed[0]["resumed_from"]
        assert start >= 6 and start % 3 == 0 and start <= killed_at
        assert resumed[0]["step"] == start + 1 and resumed[0]["attempt"] == 2
        assert all(e["attempt"] == 1 for e in events if e["step"] <= start)
        assert all(e["attempt"] == 2 for e in events if e["step"] > start)

        mine = [a for a in c.adapters(world["base_model"]) if a["request_id"] == req["id"]]
        assert len(mine) == 1 and mine[0]["id"] == done["adapter_id"]
        actions = [e["action"] for e in c.audit_log() if e["subject_id"] == req["id"]]
        assert actions.count("unlearn_request.start") == 1 and actions.count("unlearn_request.resume") == 1


def test_cli_client_verbs(e2e_logs, world, tmp_path):
    """`blade submit`, `blade status`, `blade rollback` over HTTP, configured by flags or BLADE_API_*."""
    import json
    import os
    import subprocess
    import sys

    from tests.fixtures_worker import ROOT

    e2e = e2e_logs
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLADE_")}
    env.update({"BLADE_API_URL": e2e.url, "BLADE_API_KEY": e2e.admin_key})

    def blade(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "blade_service.cli", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    forget = tmp_path / "forget.jsonl"
    forget.write_bytes(jsonl(forget_rows(3)))
    done = blade(
        "submit",
        "--base-model",
        world["base_model"],
        "--forget",
        str(forget),
        "--retain",
        world["retain"],
        "--set",
        "max_steps=2",
        "--set",
        "early_stop=false",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    req = json.loads(done.stdout)
    assert req["status"] == "queued" and req["params"] == {"max_steps": 2, "early_stop": False}
    with e2e.client() as c:
        c.cancel(req["id"])
        assert c.wait(req["id"], timeout=120, interval=0.3)["status"] in ("cancelled", "succeeded")

    shown = blade("status", req["id"], "--events", "--json", "--url", e2e.url, "--key", e2e.admin_key)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == req["id"]

    missing = blade("rollback", "ad_doesnotexist", "--reason", "test")
    assert missing.returncode == 2 and "404" in missing.stderr


def test_a_failure_carries_a_code_and_a_readable_message(e2e_logs, world):
    e2e = e2e_logs
    name = f"gone-{uuid.uuid4().hex[:6]}"
    with e2e.client() as c:
        c.request(
            "POST", "/base-models", json={"name": name, "source": "/nonexistent/model-dir", "shared": True}
        )
        req = c.submit(name, world["forget"], world["retain"], params=QUICK)
        done = _wait(c, req["id"], timeout=120)
        assert done["status"] == "failed", done
        assert done["error"]["code"] == "base_model_unavailable"
        assert "/nonexistent/model-dir" in done["error"]["message"]
        assert socket.gethostname() not in done["error"]["message"]  # which worker: the operator's log says
        assert done["adapter_id"] is None and c.adapters(name) == []
        # A completion on it: the worker's code, so 503 (a model the workers cannot load), not 502.
        with pytest.raises(ApiError) as unloadable:
            c.generate(name, "Who?", max_new_tokens=2)
        assert (unloadable.value.status, unloadable.value.code) == (503, "base_model_unavailable")


def test_a_run_that_forgot_nothing_says_so_with_its_metrics(e2e_logs, world):
    """A learning rate far too small leaves forget Prob where it was: the worker keeps the run's warning with
    the metrics after it (`after.warnings`), and `blade metrics` prints it, as `blade unlearn` does."""
    import os
    import subprocess
    import sys

    from tests.fixtures_worker import ROOT

    e2e = e2e_logs
    with e2e.client() as c:
        params = {**QUICK, "max_steps": 1, "eta_out": 1e-12, "eta_in": 1e-12}
        rid = c.submit(world["base_model"], world["forget"], world["retain"], params=params)["id"]
        done = _wait(c, rid)
        assert done["status"] in ("succeeded", "rejected"), done
        warnings = c.metrics(rid)["after"]["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("forget Prob essentially unchanged"), warnings

    env = {k: v for k, v in os.environ.items() if not k.startswith("BLADE_")}
    env.update({"BLADE_API_URL": e2e.url, "BLADE_API_KEY": e2e.admin_key})
    shown = subprocess.run(
        [sys.executable, "-m", "blade_service.cli", "metrics", rid],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0 and f"warning: {warnings[0]}" in shown.stderr, shown.stderr
