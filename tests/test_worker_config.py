"""Unit tests of the worker's wiring: Celery settings, worker command lines, names, storage keys, the
torch-free API side, and publishing when the broker is down."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from blade_service.broker.app import build_config
from blade_service.contracts.names import ROUTES, Queue, TaskName
from blade_service.persistence.settings import Settings
from tests.fixtures_worker import ROOT
from tests.tiers import unavailable


def test_delivery_semantics_on_redis(tmp_path):
    conf = build_config(
        Settings(
            data_dir=tmp_path,
            broker_url="redis://127.0.0.1:6379/0",
            result_backend="redis://127.0.0.1:6379/1",
            task_time_limit_s=7200,
        )
    )
    assert conf["task_acks_late"] is True
    assert conf["task_reject_on_worker_lost"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    # A long training run is never handed to a second worker while the first still works on it.
    assert conf["broker_transport_options"]["visibility_timeout"] > conf["task_time_limit"] == 7200
    assert conf["task_soft_time_limit"] < conf["task_time_limit"]
    assert conf["task_routes"][TaskName.UNLEARN]["queue"] == Queue.UNLEARN
    assert conf["task_routes"][TaskName.GENERATE]["queue"] == Queue.INFERENCE
    assert conf["task_routes"][TaskName.RECONCILE]["queue"] == Queue.MAINTENANCE
    reconcile = conf["beat_schedule"]["reconcile"]
    assert reconcile["task"] == TaskName.RECONCILE and reconcile["options"]["expires"] > 0


def test_embedded_defaults_need_no_server(tmp_path):
    settings = Settings(data_dir=tmp_path)
    conf = build_config(settings)
    assert conf["broker_url"] == f"sqla+sqlite:///{(tmp_path / 'broker.db').resolve()}"
    assert conf["result_backend"].startswith("db+sqlite:///")
    # The SQL transport passes its options to create_engine and has no fanout: nothing of Redis's here.
    assert "broker_transport_options" not in conf
    assert conf["worker_enable_remote_control"] is False


def test_every_task_has_a_route():
    assert set(ROUTES) == {t.value for t in TaskName}
    assert set(ROUTES.values()) <= {q.value for q in Queue}


def test_worker_command_lines():
    from blade_service.cli.worker import worker_argv

    gpu = worker_argv(
        queues=["unlearn"],
        concurrency=1,
        pool="prefork",
        max_tasks_per_child=None,
        beat=None,
        name="gpu0@h",
        loglevel="info",
    )
    assert gpu[gpu.index("--max-tasks-per-child") + 1] == "1"
    assert gpu[gpu.index("--concurrency") + 1] == "1" and "--beat" not in gpu
    side = worker_argv(
        queues=["inference", "maintenance"],
        concurrency=1,
        pool="threads",
        max_tasks_per_child=None,
        beat=None,
        name=None,
        loglevel="info",
    )
    assert "--max-tasks-per-child" not in side and "--beat" in side


def test_storage_keys():
    from blade_service.worker.artifacts import adapter_key, checkpoint_key, checkpoint_step

    assert adapter_key(base_model_id="bm_1", request_id="req_2") == "adapters/bm_1/req_2.tar.gz"
    key = checkpoint_key(request_id="req_2", step=30)
    assert key == "checkpoints/req_2/step-000030.tar.gz" and checkpoint_step(key) == 30
    assert checkpoint_step(None) == 0


def _run(code: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("BLADE_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def test_api_side_never_imports_torch(tmp_path):
    code = (
        "import sys, blade_service.api.main, blade_service.broker.app, blade_service.broker.dispatch\n"
        "import blade_service.client, blade_service.persistence.jobs\n"
        "assert not [m for m in sys.modules if m.startswith('blade_service.worker')], 'imports the worker'\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "print('ok')"
    )
    done = _run(code, {"BLADE_DATA_DIR": str(tmp_path)})
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


def test_enqueue_with_the_broker_down_leaves_the_request_to_the_reconciler(tmp_path):
    code = "from blade_service.broker.dispatch import enqueue_unlearn\nprint(enqueue_unlearn('req_x'))"
    done = _run(
        code,
        {
            "BLADE_DATA_DIR": str(tmp_path),
            "BLADE_BROKER_URL": "redis://127.0.0.1:1/0",
            "BLADE_RESULT_BACKEND": "redis://127.0.0.1:1/1",
        },
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


@pytest.mark.services
def test_generate_waits_a_bounded_time_when_no_worker_answers(tmp_path):
    import redis

    url = "redis://127.0.0.1:6379/14"
    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).flushdb()
    except redis.exceptions.ConnectionError:
        unavailable("no Redis at 127.0.0.1:6379")
    code = (
        "from blade_service.broker.dispatch import generate, GenerateTimeout\n"
        "try:\n    generate('m', 'p', 4, timeout=1.5)\nexcept GenerateTimeout as e:\n"
        "    print('timeout', e.code)"
    )
    done = _run(code, {"BLADE_DATA_DIR": str(tmp_path), "BLADE_BROKER_URL": url, "BLADE_RESULT_BACKEND": url})
    redis.Redis.from_url(url).flushdb()
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["timeout", "generate_timeout"]


def test_a_one_task_pool_child_inherits_its_imports_and_skips_the_collection():
    """The GPU queue's prefork children run one task each (`--max-tasks-per-child 1`): the main process's
    preload must leave a child nothing heavy to import (the ROUGE scorer: nltk and scipy) and nothing of its
    own for a collection to walk, and the child must not collect garbage just before it exits. In a fresh
    interpreter, as a worker's main process is."""
    script = """
import gc, sys
from types import SimpleNamespace
from blade_service.worker import process
process._note_pool(sender=SimpleNamespace(max_tasks_per_child=1))
process._preload()
from blade_core.evaluation import metrics
assert metrics._SCORER is not None and "rouge_score.rouge_scorer" in sys.modules and "peft" in sys.modules
assert gc.get_freeze_count() > 0  # and kept out of every later collection
def refuse():
    raise AssertionError("collected in a child that exits after its task")
gc.collect = refuse
process.free_accelerator()
process._note_pool(sender=SimpleNamespace(max_tasks_per_child=None))  # a threaded worker still collects
try:
    process.free_accelerator()
except AssertionError:
    print("collected")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "collected", done.stdout
