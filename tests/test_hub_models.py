"""Hub-id base models: checked at registration against a hub (a local HTTP server standing in for the hub's
public model API), and resolved by the worker from a hub cache laid out as huggingface_hub lays it out
(`models--org--name/snapshots/<commit>`, `refs/main`) with HF_HUB_OFFLINE=1. Nothing touches the network."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from blade_service.persistence import hub
from blade_service.persistence.errors import Invalid
from tests.fixtures_services import headers

MAIN = "a" * 40  # the commit refs/main points at
OLD = "b" * 40  # an older commit, reachable only by pinning it
TOKEN = "hf_test_token"


class FakeHub(BaseHTTPRequestHandler):
    """GET /api/models/{org/name}[/revision/{rev}] as the hub answers it: org/tiny exists at MAIN, OLD and
    `main`; org/gated needs the token; anything else is 404 with the hub's X-Error-Message."""

    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        FakeHub.seen.append((self.path, self.headers.get("Authorization")))
        path = self.path.removeprefix("/api/models/")
        repo, _, revision = path.partition("/revision/")
        if repo == "org/gated" and self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._answer(401, "Access to model org/gated is restricted. You must have access to it.")
        elif repo not in ("org/tiny", "org/gated"):
            self._answer(404, "Repository not found")
        elif revision and revision not in (MAIN, OLD, "main"):
            self._answer(404, f"Invalid rev id: {revision}")
        else:
            self._answer(200, None, {"id": repo, "sha": MAIN})

    def _answer(self, status: int, error: str | None, body: dict | None = None) -> None:
        payload = json.dumps(body if body is not None else {"error": error}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if error:
            self.send_header("X-Error-Message", error)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def fake_hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def hub_at(api_client, monkeypatch):
    """hub_at(url): the API under test asks the hub at `url`."""

    def point(url: str) -> None:
        settings = api_client.app.state.settings
        monkeypatch.setattr(settings, "hub_url", url)
        monkeypatch.setattr(settings, "hub_check_timeout_s", 2.0)

    monkeypatch.delenv("HF_TOKEN", raising=False)
    return point


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- parsing ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "revision", "expected"),
    [
        ("meta-llama/Llama-3.2-1B-Instruct", None, hub.HubRef("meta-llama/Llama-3.2-1B-Instruct")),
        ("org/name@v1.0", None, hub.HubRef("org/name", "v1.0")),
        ("org/name@main", "main", hub.HubRef("org/name", "main")),
        ("org/name", MAIN, hub.HubRef("org/name", MAIN)),
        ("org/name", "refs/pr/3", hub.HubRef("org/name", "refs/pr/3")),
    ],
)
def test_well_formed_hub_ids_parse(source, revision, expected):
    assert hub.parse(source, revision) == expected


@pytest.mark.parametrize(
    ("source", "revision", "field"),
    [
        ("gpt2", None, "source"),  # a hub id here is org/name; a bare name is neither a path nor a key
        ("org/na--me", None, "source"),
        ("org/name.", None, "source"),
        ("org/name/extra", None, "source"),
        ("org/" + "x" * 97, None, "source"),
        ("org/name@", None, "source"),
        ("org/name@v1", "v2", "revision"),
        ("org/name", "a..b", "revision"),
        ("org/name", "has space", "revision"),
        ("org/name", "-rf", "revision"),
    ],
)
def test_malformed_hub_ids_name_the_field(source, revision, field):
    with pytest.raises(Invalid) as caught:
        hub.parse(source, revision)
    assert caught.value.field == field
    assert caught.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize("ref", ["var/models/mistyped", "./mistyped", "/models/none", "~/none", "a/../b"])
def test_a_missing_directory_that_cannot_be_a_hub_id_is_named_as_one(ref):
    from blade_core.modeling import load_model, load_tokenizer
    from blade_service.contracts.errors import BaseModelUnavailable

    for load in (load_model, load_tokenizer):
        with pytest.raises(BaseModelUnavailable, match=r": no such directory \(nor a hub id"):
            load(ref)


@pytest.mark.parametrize(("ref", "could"), [("gpt2", True), ("org/name", True), ("org/na--me", False)])
def test_a_hub_id_may_be_unscoped_for_the_engine(ref, could):
    from blade_service.contracts.hub_ids import could_be_hub_id

    assert could_be_hub_id(ref) is could


def test_hub_snapshot_dirs_are_recognised(tmp_path):
    assert hub.is_hub_snapshot(tmp_path / "hub" / "models--org--tiny" / "snapshots" / MAIN)
    assert not hub.is_hub_snapshot(tmp_path / "models" / "tiny")


# --- registration -----------------------------------------------------------------------------------------


def register(api_client, admin_key, name: str, source: str, revision: str | None = None):
    body = {"name": name, "source": source, **({"revision": revision} if revision else {})}
    return api_client.post("/base-models", headers=headers(admin_key), json=body)


def test_registration_checks_the_hub(api_client, admin_key, fake_hub, hub_at):
    hub_at(fake_hub)
    FakeHub.seen.clear()

    resp = register(api_client, admin_key, "hub-pinned", "org/tiny", revision=OLD)
    assert resp.status_code == 201, resp.text
    assert (resp.json()["revision"], resp.json()["warnings"]) == (OLD, [])
    assert FakeHub.seen[-1] == (f"/api/models/org/tiny/revision/{OLD}", None)
    got = api_client.get("/base-models/hub-pinned", headers=headers(admin_key)).json()
    assert (got["source"], got["revision"]) == ("org/tiny", OLD)

    resp = register(api_client, admin_key, "hub-inline", "org/tiny@main")
    assert resp.status_code == 201, resp.text
    assert resp.json()["revision"] == "main"

    resp = register(api_client, admin_key, "hub-unpinned", "org/tiny")
    assert resp.status_code == 201 and resp.json()["revision"] is None
    assert FakeHub.seen[-1][0] == "/api/models/org/tiny"


def test_a_hub_that_denies_the_model_is_a_422_with_its_message(
    api_client, admin_key, fake_hub, hub_at, monkeypatch
):
    hub_at(fake_hub)
    missing = register(api_client, admin_key, "hub-missing", "org/no-such-model")
    assert missing.status_code == 422, missing.text
    error = missing.json()["error"]
    assert error["field"] == "source" and "Repository not found" in error["message"]
    assert "org/no-such-model" in error["message"] and "HTTP 404" in error["message"]

    bad_rev = register(api_client, admin_key, "hub-bad-rev", "org/tiny", revision="v9")
    assert bad_rev.status_code == 422
    assert bad_rev.json()["error"]["field"] == "revision"
    assert "Invalid rev id: v9" in bad_rev.json()["error"]["message"]

    gated = register(api_client, admin_key, "hub-gated", "org/gated")
    assert gated.status_code == 422 and "HTTP 401" in gated.json()["error"]["message"]
    assert "HF_TOKEN" in gated.json()["error"]["message"]
    monkeypatch.setenv("HF_TOKEN", TOKEN)  # the API sends the token it has
    assert register(api_client, admin_key, "hub-gated", "org/gated").status_code == 201
    assert FakeHub.seen[-1] == ("/api/models/org/gated", f"Bearer {TOKEN}")

    for name in ("hub-missing", "hub-bad-rev"):
        assert api_client.get(f"/base-models/{name}", headers=headers(admin_key)).status_code == 404


def test_malformed_ids_are_refused_without_asking_the_hub(api_client, admin_key, fake_hub, hub_at):
    hub_at(fake_hub)
    FakeHub.seen.clear()
    resp = register(api_client, admin_key, "hub-malformed", "org/bad--name")
    assert resp.status_code == 422
    assert (
        resp.json()["error"]["field"] == "source" and "org/name[@revision]" in resp.json()["error"]["message"]
    )
    local = register(api_client, admin_key, "local-with-rev", "/models/x", revision="main")
    assert local.status_code == 422 and local.json()["error"]["field"] == "revision"
    assert FakeHub.seen == []
    assert (
        register(api_client, admin_key, "local-plain", "/models/x").status_code == 201
    )  # paths: not checked


def test_an_unreachable_hub_registers_with_a_warning(api_client, admin_key, hub_at, caplog):
    url = f"http://127.0.0.1:{closed_port()}"
    hub_at(url)
    with caplog.at_level(logging.WARNING, logger="blade.hub"):
        resp = register(api_client, admin_key, "hub-unchecked", "org/anything", revision="v1")
    assert resp.status_code == 201, resp.text
    assert resp.json()["revision"] == "v1"
    [warning] = resp.json()["warnings"]
    assert url in warning and "org/anything" in warning and "unchecked" in warning
    assert any(r.getMessage() == "base_model.hub_unchecked" for r in caplog.records)
    got = api_client.get("/base-models/hub-unchecked", headers=headers(admin_key)).json()
    assert got["warnings"] == [] and got["revision"] == "v1"


def test_a_directory_on_the_workers_registers_with_a_warning_that_it_was_not_checked(api_client, admin_key):
    """The API cannot see the workers' disks: a directory source is registered, but not as if checked."""
    resp = register(api_client, admin_key, f"dir-{os.urandom(4).hex()}", "/nonexistent/model-dir")
    assert resp.status_code == 201, resp.text
    [warning] = resp.json()["warnings"]
    assert "'/nonexistent/model-dir' is a directory on the workers, not checked here" in warning
    assert "base_model_unavailable" in warning


# --- the worker: resolving from the hub cache -------------------------------------------------------------


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """HF_HOME with org/tiny at two commits: MAIN (refs/main, seed 0) and OLD (seed 1), as the hub caches."""
    from blade_core.testing import write_tiny_model

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--org--tiny"
    for commit, seed in ((MAIN, 0), (OLD, 1)):
        write_tiny_model(repo / "snapshots" / commit, seed=seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    return home


WORKER_SCRIPT = r"""
import json, sys, torch
from blade_core.modeling import load_model, load_tokenizer
from blade_service.persistence.settings import Settings
from blade_service.persistence.storage import get_storage
from blade_service.worker.stacks import base_reference
from blade_service.worker.artifacts import resolve_base_model
from blade_service.worker.errors import TaskFailure

settings = Settings(data_dir=sys.argv[1])
storage = get_storage(settings)
out = {}
main = resolve_base_model(storage, settings, "org/tiny")
old = resolve_base_model(storage, settings, "org/tiny", sys.argv[2])
inline = resolve_base_model(storage, settings, "org/tiny@" + sys.argv[2])
out["dirs"] = [main, old, inline]
out["reference"] = list(base_reference(old, "tiny", "org/tiny", sys.argv[2]))
for source, revision in (("org/missing", None), ("org/tiny", "v9"), ("not-a-hub-id", None)):
    try:
        resolve_base_model(storage, settings, source, revision)
        out[source] = None
    except TaskFailure as exc:
        out[source] = [exc.code, str(exc)]
cpu = torch.device("cpu")
ids = load_tokenizer(old)("the cat sat", return_tensors="pt").input_ids
by_dir = load_model(old, cpu)(ids).logits
by_id = load_model("org/tiny", cpu, revision=sys.argv[2])(ids).logits  # from_pretrained with the revision
by_main = load_model(main, cpu)(ids).logits
out["same_as_pinned"] = bool(torch.equal(by_dir, by_id))
out["differs_from_main"] = not torch.equal(by_dir, by_main)
out["tokenizer_by_id"] = load_tokenizer("org/tiny", revision=sys.argv[2]).pad_token is not None
try:
    load_model("demo-tiny", cpu)  # a service's registered name, given to `blade unlearn --model`
except Exception as exc:
    out["bare_name"] = str(exc)
print(json.dumps(out))
"""


def test_the_worker_loads_a_hub_model_from_the_hub_cache(hub_home, tmp_path):
    env = {
        **os.environ,
        "HF_HOME": str(hub_home),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_TOKEN", None)
    done = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT, str(tmp_path / "data"), OLD],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    snapshots = hub_home / "hub" / "models--org--tiny" / "snapshots"
    assert [Path(d) for d in out["dirs"]] == [snapshots / MAIN, snapshots / OLD, snapshots / OLD]
    assert out["reference"] == ["org/tiny", OLD]  # adapter_config.json names the hub id, not the cache path
    for source in ("org/missing", "org/tiny", "not-a-hub-id"):
        code, message = out[source]
        assert code == "base_model_unavailable", out[source]
        assert source in message
    assert "org/missing" in out["org/missing"][1] and "cache" in out["org/missing"][1].lower()
    assert "v9" in out["org/tiny"][1]
    assert out["same_as_pinned"] and out["differs_from_main"] and out["tokenizer_by_id"]
    assert out["bare_name"].startswith("demo-tiny: no such directory here, so it was read as a hub id")


TASK_SCRIPT = r"""
import hashlib, json, sys, time, uuid
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import BaseModel, Dataset, Tenant, UnlearnRequest
from blade_service.persistence.settings import get_settings
from blade_service.persistence.storage import get_storage
from blade_service.worker.unlearn_task import unlearn

settings = get_settings()
data = b'{"question": "q", "answer": "a"}\n'
key = f"datasets/hub-test/{uuid.uuid4().hex}.jsonl"
get_storage(settings).put_bytes(key, data)
with session_scope(settings) as s:
    tenant = Tenant(name=f"hub-{uuid.uuid4().hex[:8]}")
    s.add(tenant)
    s.flush()
    ds = Dataset(tenant_id=tenant.id, name="d.jsonl", sha256=hashlib.sha256(data).hexdigest(), rows=1,
                 format="jsonl", kind="qa", size_bytes=len(data), storage_key=key)
    bm = BaseModel(name=f"hub-{uuid.uuid4().hex[:8]}", source=sys.argv[1], revision=sys.argv[2] or None)
    s.add_all([ds, bm])
    s.flush()
    req = UnlearnRequest(tenant_id=tenant.id, base_model_id=bm.id, forget_dataset_id=ds.id,
                         retain_dataset_id=ds.id, method="blade", params={}, request_fingerprint="f" * 64,
                         queue_seq=1)
    s.add(req)
    s.flush()
    request_id = req.id
unlearn.run(request_id=request_id)
with session_scope(settings) as s:
    req = s.get(UnlearnRequest, request_id)
    print(json.dumps({"status": req.status, "error": {"code": req.error_code, "message": req.error_message}}))
"""


@pytest.mark.services
@pytest.mark.parametrize(
    ("source", "revision", "words"),
    [("org/missing", "", "org/missing"), ("org/tiny", "v9", "v9")],
)
def test_a_request_on_an_unloadable_hub_model_fails_as_base_model_unavailable(
    hub_home, worker_pg_url, tmp_path, source, revision, words
):
    env = {
        **os.environ,
        "HF_HOME": str(hub_home),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "BLADE_DATABASE_URL": worker_pg_url,
        "BLADE_DATA_DIR": str(tmp_path / "data"),
    }
    done = subprocess.run(
        [sys.executable, "-c", TASK_SCRIPT, source, revision],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["status"] == "failed", out
    error = out["error"]
    assert error["code"] == "base_model_unavailable", error
    assert words in error["message"] and "LocalEntryNotFoundError" in error["message"], error


UNREACHABLE_SCRIPT = r"""
import json, torch
from blade_core.modeling import fetch_hub_model, load_model, load_tokenizer
from blade_service.contracts.errors import BaseModelUnavailable

out = {"snapshot": str(fetch_hub_model("org/tiny"))}
out["pad"] = load_tokenizer("org/tiny").pad_token is not None
out["logits"] = list(load_model("org/tiny", torch.device("cpu"))(torch.tensor([[1, 2]])).logits.shape)
for load in (load_model, load_tokenizer, fetch_hub_model):
    try:
        load("org/missing")
        out[load.__name__] = None
    except BaseModelUnavailable as exc:
        out[load.__name__] = str(exc)
print(json.dumps(out))
"""


def test_with_the_hub_unreachable_a_hub_id_is_read_from_the_cache_or_fails_at_once(hub_home, tmp_path):
    """Not in offline mode, but the hub cannot be reached (a machine without its network): one connect
    says so, and every load reads the hub cache only. The hub client's retries (about a minute per file)
    never start: a cached model loads, a missing one fails with a message that names the hub."""
    env = {
        **os.environ,
        "HF_HOME": str(hub_home),
        "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", UNREACHABLE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(out["snapshot"]) == hub_home / "hub" / "models--org--tiny" / "snapshots" / MAIN
    assert out["pad"] and out["logits"][:2] == [1, 2]
    for name in ("load_model", "load_tokenizer", "fetch_hub_model"):
        assert "org/missing" in out[name] and "the hub cannot be reached from here" in out[name], out
        assert "not in the hub cache" in out[name], out
    assert "Retrying" not in done.stderr, done.stderr[-2000:]
