"""Stacks on the embedded service (`blade up`: SQLite, the server-less SQL broker, one real worker): the
policy gate's verdict on a request, compaction swapped in after verification, and the one-file export."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.fixtures_worker import (
    ROOT,
    forget_rows,
    free_port,
    jsonl,
    retain_rows,
    stop_process,
    wait_until,
)
from tests.test_e2e_embedded import _demo_data, blade_up_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

QUICK = {"max_steps": 2, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}


def test_gate_compaction_and_export_on_blade_up(tiny_model_dir, tmp_path):
    from blade_service.client import BladeClient

    port, key = free_port(), "blade_up_stacks_key_0123456789"
    env = blade_up_env(key)
    argv = [
        "up",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "var"),
        "--demo-model",
        str(tiny_model_dir),
    ]
    argv += ["--demo-data", str(_demo_data(tmp_path / "demo-data"))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "blade_service.cli", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    try:
        wait_until(
            lambda: any("Ctrl-C stops everything" in line for line in output) or proc.poll() is not None,
            240,
            0.3,
            "blade up",
        )
        assert proc.poll() is None, "".join(output)[-3000:]
        with BladeClient(f"http://127.0.0.1:{port}", api_key=key, timeout=120) as c:
            c.set_retention("demo-tiny", success_s=3600, failure_s=3600)
            forget = c.upload_dataset(io.BytesIO(jsonl(forget_rows(4))), filename="forget.jsonl")["id"]
            retain = c.upload_dataset(io.BytesIO(jsonl(retain_rows(6))), filename="retain.jsonl")["id"]
            for _ in range(2):
                done = c.wait(
                    c.submit("demo-tiny", forget, retain, params=QUICK)["id"], timeout=240, interval=0.3
                )
                assert done["status"] == "succeeded" and done["gate"]["passed"], done
            stack = [a["id"] for a in c.adapters("demo-tiny") if a["state"] == "active"]
            op = c.compact("demo-tiny", "embedded: one adapter")
            op = wait_until(
                lambda: (o := c.stack_operation(op["id"]))["status"] in ("succeeded", "failed") and o,
                240,
                0.5,
                "the compaction",
            )
            assert op["status"] == "succeeded" and op["result"]["verification"]["generations_identical"], op
            active = [a for a in c.adapters("demo-tiny") if a["state"] == "active"]
            assert [a["kind"] for a in active] == ["compaction"] and active[0]["lineage"]["contains"] == stack
            exported = c.export("demo-tiny", tmp_path / "export", format="adapter")
            config = json.loads((exported / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == "demo-tiny"
            assert config["r"] == op["result"]["compaction"]["exact_rank"]
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "".join(output)[-3000:]
    finally:
        stop_process(proc, signal.SIGINT, timeout=30)
