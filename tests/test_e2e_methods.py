"""Every method through the service, end to end over HTTP: a real API process, real Celery workers,
PostgreSQL and Redis.

Each of the eight methods runs a few steps on a tiny model, one request after the other on the same base model
(so each trains on top of the adapters before it, as the service stacks them); each must end with a registered
adapter version whose archive is a PEFT adapter that plain `peft` loads on the base model. The seven baselines
train a LoRA adapter there (OpenUnlearning's TOFU LoRA experiment), RMU's on its three down-projections only.
A request that asks for full-parameter training is refused up front, naming the field.
"""

from __future__ import annotations

import io
import json
import uuid

import pytest

from blade_core.methods import METHOD_NAMES
from tests.fixtures_worker import forget_rows, jsonl, retain_rows

pytestmark = [pytest.mark.e2e, pytest.mark.services, pytest.mark.timeout(900)]

COMMON = {"max_steps": 2, "max_length": 64, "batch_size": 2}
PARAMS = {
    "blade": {**COMMON, "early_stop": False, "inner_steps": 1},
    **{m: {**COMMON, "grad_accum": 1} for m in METHOD_NAMES if m != "blade"},
}


@pytest.fixture(scope="module")
def world(e2e, tiny_model_dir):
    name = f"tiny-methods-{uuid.uuid4().hex[:8]}"
    with e2e.client() as c:
        c.request("POST", "/base-models", json={"name": name, "source": str(tiny_model_dir), "shared": True})
        # Few rows: each request's before/after metrics generate an answer per row.
        forget = c.upload_dataset(io.BytesIO(jsonl(forget_rows(4))), filename="forget.jsonl")
        retain = c.upload_dataset(io.BytesIO(jsonl(retain_rows(4))), filename="retain.jsonl")
    return {"base_model": name, "forget": forget["id"], "retain": retain["id"]}


def _load_adapter(c, adapter_id: str, tiny_model_dir, dest):
    """The adapter's archive, unpacked and loaded with plain peft on the base model: (its config, model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from blade_service.persistence.storage import extract_archive

    archive = c.request("GET", f"/adapters/{adapter_id}/download")
    extract_archive(io.BytesIO(archive), dest)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    model = PeftModel.from_pretrained(base, str(dest))
    return json.loads((dest / "adapter_config.json").read_text()), model


def test_every_method_trains_a_stackable_lora_adapter(e2e_logs, world, tiny_model_dir, tmp_path):
    e2e = e2e_logs
    with e2e.client() as c:
        submitted = {
            method: c.submit(
                world["base_model"], world["forget"], world["retain"], method=method, params=PARAMS[method]
            )["id"]
            for method in METHOD_NAMES
        }
        done = {method: c.wait(rid, timeout=600, interval=0.5) for method, rid in submitted.items()}
        failed = {m: (d["status"], d.get("error")) for m, d in done.items() if not d.get("adapter_id")}
        assert not failed, failed
        for method, state in done.items():
            # 'rejected': trained and stored, held back by the base model's utility gate (a random tiny model)
            assert state["status"] in ("succeeded", "rejected"), (method, state)
            events = c.events(submitted[method])
            assert [e["step"] for e in events] == [1, 2], method
            config, model = _load_adapter(c, state["adapter_id"], tiny_model_dir, tmp_path / method)
            assert config["peft_type"] == "LORA", method
            if method == "rmu":  # the tiny model has two layers: the steered one (1) and the one below it
                assert sorted(config["target_modules"]) == [
                    f"model.layers.{i}.mlp.down_proj" for i in (0, 1)
                ], config["target_modules"]
            elif method != "blade":
                assert config["r"] == 128 and config["lora_alpha"] == 128, (method, config)
            assert any("lora_" in n for n, _ in model.named_parameters()), method
        versions = [a["request_id"] for a in c.adapters(world["base_model"])]
        assert versions == list(submitted.values())  # one version per request, in submission order
    log = e2e.logs["gpu"].read_text(errors="replace")  # JSON lines: no tqdm bar from a loop or a model load
    assert "\r" not in log and "Loading weights" not in log, log[-2000:]


def test_a_full_parameter_request_is_refused_naming_the_field(e2e_logs, world):
    from blade_service.client.http import ApiError

    with e2e_logs.client() as c, pytest.raises(ApiError) as info:
        c.submit(
            world["base_model"],
            world["forget"],
            world["retain"],
            method="grad_diff",
            params={"use_lora": False},
        )
    assert info.value.status == 422 and "use_lora" in info.value.message
