"""`blade up` end to end: the embedded default (SQLite, the server-less SQL broker, artifacts on local disk,
one real Celery worker process) serves requests through HTTP, and Ctrl-C stops everything.

The tiny test model stands in for the demo model (`--demo-model`), so the test never builds the real one.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.fixtures_worker import (
    EVAL_MAX_NEW_TOKENS,
    ROOT,
    forget_rows,
    free_port,
    jsonl,
    retain_rows,
    stop_process,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

QUICK = {"max_steps": 3, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}


def _demo_data(directory: Path) -> Path:
    """A minimal TOFU-format dir with the two files the printed example uploads."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "forget01_perturbed.json").write_text(json.dumps(forget_rows(4)))
    (directory / "retain99.json").write_text(json.dumps(retain_rows(6)))
    return directory


def blade_up_env(key: str, **extra: str) -> dict[str, str]:
    """This process's environment without its BLADE_ settings, plus the tests' `blade up` settings: `key` as
    the bootstrap admin key, the CPU, short ROUGE generations (EVAL_MAX_NEW_TOKENS), one torch thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLADE_")}
    return env | {
        "BLADE_BOOTSTRAP_ADMIN_KEY": key,
        "BLADE_DEVICE": "cpu",
        "BLADE_EVAL_MAX_NEW_TOKENS": str(EVAL_MAX_NEW_TOKENS),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def test_blade_up_serves_a_request_end_to_end(tiny_model_dir, tmp_path):
    from blade_service.client import BladeClient

    port = free_port()
    key = "blade_up_test_key_0123456789"
    env = blade_up_env(key, BLADE_HEARTBEAT_SECONDS="1")
    data_dir = tmp_path / "var"
    demo = _demo_data(tmp_path / "demo-data")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "blade_service.cli",
            "up",
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--demo-model",
            str(tiny_model_dir),
            "--demo-data",
            str(demo),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"blade up exited ({proc.returncode}):\n{''.join(output)[-4000:]}")
            return any("Ctrl-C stops everything" in line for line in output)

        wait_until(ready, 180, 0.3, "blade up to print its banner")
        banner = "".join(output)
        assert f"BLADE service ready at {url}" in banner
        assert "demo-tiny" in banner and "BLADE_BOOTSTRAP_ADMIN_KEY" in banner
        # Everything embedded: SQLite database, SQL broker, local artifacts, all under the data dir.
        assert (data_dir / "blade.db").is_file() and (data_dir / "broker.db").is_file()

        # The printed first request is ready to paste: run its upload + submit lines in a shell.
        script = banner.split("A first request (paste into a shell):", 1)[1].split("Logs:", 1)[0]
        lines = [ln for ln in script.strip().splitlines() if ln.strip()]
        submit_lines = [ln for ln in lines if not ln.startswith("curl ")]
        # ... in a shell that never saw the key (given inline to `blade up`): the lines read the key file.
        shell = subprocess.run(
            ["bash", "-euc", "\n".join([*submit_lines, 'echo "REQ=$REQ"'])],
            env={k: v for k, v in env.items() if k != "BLADE_BOOTSTRAP_ADMIN_KEY"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shell.returncode == 0, shell.stderr
        pasted = re.search(r"REQ=(req_[0-9a-f]+)", shell.stdout).group(1)
        # Its last line asks the model the forget file's first question.
        ask = [ln for ln in lines if ln.endswith("# before and after the request")]
        shell = subprocess.run(
            ["bash", "-euc", "\n".join([*lines[:2], *ask])],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        answer = json.loads(shell.stdout)
        assert answer.get("question") == forget_rows(1)[0]["question"], (ask, answer)
        assert answer["prompt"] == f"Question: {answer['question']}\nAnswer:"

        with BladeClient(url, api_key=key, timeout=60) as c:
            assert [m["name"] for m in c.base_models()] == ["demo-tiny"]
            assert c.status(pasted)["status"] in ("queued", "running", "evaluating", "succeeded")
            # The pasted request uses the default step budget: cancel it, then run a quick one.
            c.cancel(pasted)
            assert c.wait(pasted, timeout=120, interval=0.3)["status"] in ("cancelled", "succeeded")

            forget = c.upload_dataset(io.BytesIO(jsonl(forget_rows(4))), filename="forget.jsonl")
            retain = c.upload_dataset(io.BytesIO(jsonl(retain_rows(6))), filename="retain.jsonl")
            req = c.submit("demo-tiny", forget["id"], retain["id"], params=QUICK)
            done = c.wait(req["id"], timeout=150, interval=0.3)
            assert done["status"] == "succeeded", done
            assert [e["step"] for e in c.events(req["id"])] == [1, 2, 3]
            stack = c.adapters("demo-tiny")
            assert stack[-1]["id"] == done["adapter_id"] and stack[-1]["state"] == "active"
            out = c.generate("demo-tiny", "Where was Ada Alder born?", max_new_tokens=4)
            assert out["stack"] == [a["id"] for a in stack if a["state"] == "active"]
            # A question is asked as the model's QA rows were: the same completion as that prompt, raw.
            question = retain_rows(1)[0]["question"]
            asked = c.generate("demo-tiny", question=question, max_new_tokens=8)
            assert asked["question"] == question and asked["prompt"] == f"Question: {question}\nAnswer:"
            assert c.generate("demo-tiny", asked["prompt"], max_new_tokens=8)["text"] == asked["text"]

        # Ctrl-C: everything stops, cleanly.
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "".join(output)[-3000:]

        def port_closed() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) != 0

        wait_until(port_closed, 10, 0.2, "the API to stop listening after Ctrl-C")
    finally:
        stop_process(proc, signal.SIGINT, timeout=30)
