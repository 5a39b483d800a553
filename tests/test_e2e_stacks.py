"""Stacks end to end through HTTP (PostgreSQL + Redis + real workers): the policy gate holds a damaging
adapter back (and an admin activates it anyway), compaction replaces the stack with one verified version,
and the export is one adapter / merged weights that plain peft / transformers load and that answer as the
stack did.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from blade_service.client.http import ApiError
from tests.fixtures_worker import forget_rows, jsonl, retain_rows, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

QUICK = {"max_steps": 3, "early_stop": False, "inner_steps": 1, "max_length": 64, "batch_size": 4}
PROMPTS = ["Question: Where was fAda Birch born?\nAnswer:", "Question: What does rTom Reed write?\nAnswer:"]
MODEL = "stack-tiny"


def _wait_operation(c, operation_id: str, timeout: float = 240.0) -> dict:
    return wait_until(
        lambda: (op := c.stack_operation(operation_id))["status"] in ("succeeded", "failed") and op,
        timeout,
        0.5,
        f"stack operation {operation_id}",
    )


def _no_local_paths(directory: Path, forbidden: list[str]) -> None:
    for path in directory.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".txt", ".md", ""):
            text = path.read_text(errors="replace")
            for needle in forbidden:
                assert needle not in text, f"{path.name} contains the worker-local path {needle}"


def _greedy(model, tok) -> list[str]:
    from blade_core.evaluation.generation import generate

    return generate(model, tok, PROMPTS, max_new_tokens=12, batch_size=1)


@pytest.fixture(scope="module")
def stack_world(e2e, tiny_model_dir):
    with e2e.client() as c:
        c.register_base_model(MODEL, str(tiny_model_dir))
        c.set_retention(MODEL, success_s=3600, failure_s=3600)  # three requests share one forget set
        forget = c.upload_dataset(io.BytesIO(jsonl(forget_rows(4))), filename="forget.jsonl")
        retain = c.upload_dataset(io.BytesIO(jsonl(retain_rows(6))), filename="retain.jsonl")
    return {"forget": forget["id"], "retain": retain["id"]}


def test_gate_compaction_and_export(e2e_logs, stack_world, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel

    from blade_core.lora import load_with_stack
    from blade_core.modeling import load_model, load_tokenizer

    e2e = e2e_logs
    forbidden = [str(e2e.root), str(tiny_model_dir)]
    with e2e.client() as c:
        assert c.base_model(MODEL)["policy"]["min_retain_prob_ratio"] == 0.5  # the documented default

        # Two requests pass the default gate; their archives name the base model and hold no local path.
        passed, passed_requests = [], []
        for _ in range(2):
            req = c.submit(MODEL, stack_world["forget"], stack_world["retain"], params=QUICK)
            done = c.wait(req["id"], timeout=180, interval=0.3)
            assert done["status"] == "succeeded", done
            assert done["gate"]["passed"] and done["gate"]["canary"] == "retain_sample"
            mia = {r["rule"]: r for r in done["gate"]["rules"]}["max_mia_auc_gap"]  # off, but measured
            assert mia["passed"] is None and isinstance(mia["after"], float)
            assert mia["after"] == c.metrics(done["id"])["after"]["mia"]["auc"]
            passed.append(done["adapter_id"])
            passed_requests.append(done["id"])
        archive = c.download_adapter(passed[1], tmp_path / "v2")
        config = json.loads((archive / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == MODEL  # stacked ones too, not null
        _no_local_paths(archive, forbidden)

        # Policy errors name the field; a policy no adapter can meet rejects the next one.
        with pytest.raises(ApiError) as bad:
            c.set_policy(MODEL, reason="typo", policy={"min_retain_probability": 0.9})
        assert bad.value.status == 422 and "policy.min_retain_probability" in bad.value.message
        c.set_policy(
            MODEL,
            reason="test: impossible utility bar",
            policy={"min_retain_prob_ratio": 10.0},
            canary_dataset=stack_world["retain"],
        )
        req = c.submit(MODEL, stack_world["forget"], stack_world["retain"], params=QUICK)
        rejected = c.wait(req["id"], timeout=180, interval=0.3)
        assert rejected["status"] == "rejected", rejected
        assert rejected["gate"]["failed"] == ["min_retain_prob_ratio"]
        assert rejected["gate"]["canary"] == f"dataset:{stack_world['retain']}"
        assert rejected["error"]["code"] == "policy_rejected"
        assert "min_retain_prob_ratio" in rejected["error"]["message"]
        held = c.adapter(rejected["adapter_id"])
        assert held["state"] == "disabled" and held["state_reason"].startswith("rejected:")
        assert [a["id"] for a in c.adapters(MODEL) if a["state"] == "active"] == passed

        # An admin activates it anyway, with a reason: audited, and the verdict keeps the override.
        c.enable(rejected["adapter_id"], "reviewed: utility loss acceptable for this request")
        assert c.status(req["id"])["gate"]["override"]["reason"].startswith("reviewed")
        assert any(
            e["action"] == "adapter.enable" and e["data"].get("policy_override") for e in c.audit_log()
        )
        gate = c.certificate(req["id"])["evaluation"]["thresholds"]["policy_gate"]
        assert gate["failed"] == ["min_retain_prob_ratio"] and gate["override"]["reason"].startswith(
            "reviewed"
        )
        assert c.certificate(passed_requests[0])["evaluation"]["thresholds"]["policy_gate"]["passed"] is True
        c.set_policy(
            MODEL, reason="test: back to defaults", policy={"min_retain_prob_ratio": 0.5}, clear_canary=True
        )

        stack = [a["id"] for a in c.adapters(MODEL) if a["state"] == "active"]
        assert len(stack) == 3
        stack_dirs = [c.download_adapter(i, tmp_path / i) for i in stack]
        before = c.generate(MODEL, PROMPTS[0], max_new_tokens=12)["text"]

        # A lossy truncation fails verification and leaves the stack alone.
        op = _wait_operation(c, c.compact(MODEL, "test: too small", rank=1)["id"])
        assert op["status"] == "failed" and op["error"]["code"] == "verification_failed", op
        assert op["result"]["compaction"]["truncated"] and op["result"]["compaction"]["max_rel_error"] > 0
        assert [a["id"] for a in c.adapters(MODEL) if a["state"] == "active"] == stack

        # Exact compaction: one new version replaces the stack, verified; the old ones stay restorable.
        op = _wait_operation(c, c.compact(MODEL, "test: serve one adapter")["id"])
        assert op["status"] == "succeeded", op
        verification = op["result"]["verification"]
        assert verification["ok"] and verification["generations_identical"]
        assert verification["max_logit_diff"] <= verification["tolerance"]
        versions = c.adapters(MODEL)
        active = [a for a in versions if a["state"] == "active"]
        assert [a["id"] for a in active] == [op["result"]["adapter_id"]]
        compacted = active[0]
        assert compacted["kind"] == "compaction" and compacted["request_id"] is None
        assert compacted["lineage"]["contains"] == stack
        replaced = {a["id"]: a for a in versions if a["id"] in stack}
        assert all(a["state_reason"] == f"compacted into v{compacted['version']}" for a in replaced.values())
        assert not any(a["trained_on_stale"] for a in versions if a["state"] == "active")
        assert c.generate(MODEL, PROMPTS[0], max_new_tokens=12)["text"] == before
        with pytest.raises(ApiError) as busy:
            c.enable(stack[0], "restore one while its compaction is active")
        assert busy.value.status == 409 and busy.value.code == "compacted"

        # Export: one PEFT adapter and merged weights, self-describing, no local paths.
        exported = c.export(MODEL, tmp_path / "export-adapter", format="adapter")
        assert json.loads((exported / "adapter_config.json").read_text())["base_model_name_or_path"] == MODEL
        _no_local_paths(exported, forbidden)
        merged = c.export(MODEL, tmp_path / "export-merged", format="merged")
        _no_local_paths(merged, forbidden)
        with pytest.raises(ApiError) as bad_format:
            c.export(MODEL, tmp_path / "gguf", format="gguf")
        assert bad_format.value.status == 422

    # Plain peft / transformers load them and answer exactly as the stack they replace.
    cpu = torch.device("cpu")
    stacked, tok = load_with_stack(tiny_model_dir, stack_dirs, cpu)
    want = _greedy(stacked, tok)
    assert want[0] == before
    with e2e.client() as c:
        compacted_dir = c.download_adapter(compacted["id"], tmp_path / "compacted")
    for adapter_dir in (compacted_dir, exported):
        plain = PeftModel.from_pretrained(load_model(tiny_model_dir, cpu), str(adapter_dir)).eval()
        assert _greedy(plain, tok) == want
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert _greedy(full, load_tokenizer(merged)) == want
    ids = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert float((full(input_ids=ids).logits - stacked(input_ids=ids).logits).abs().max()) < 1e-3


def test_rollback_retrains_later_versions_on_the_new_stack(e2e_logs, tiny_model_dir):
    from blade_core.testing import tiny_qa_rows

    model = "rebase-tiny"
    with e2e_logs.client() as c:
        c.register_base_model(model, str(tiny_model_dir))
        c.set_retention(model, success_s=3600, failure_s=3600)  # keep forget data: retrains need it
        retain = c.upload_dataset(io.BytesIO(jsonl(retain_rows(6))), filename="retain.jsonl")["id"]
        files = [jsonl(tiny_qa_rows(3, seed=10 + i, prefix=f"g{i}")) for i in range(4)]
        forgets = [
            c.upload_dataset(io.BytesIO(f), filename=f"forget{i}.jsonl")["id"] for i, f in enumerate(files)
        ]
        versions = []
        for forget in forgets:
            done = c.wait(c.submit(model, forget, retain, params=QUICK)["id"], timeout=180, interval=0.3)
            assert done["status"] == "succeeded", done
            versions.append(done["adapter_id"])
        v1, v2, v3, v4 = versions
        c.delete_dataset(forgets[3])  # v4's forget data is gone: it cannot be retrained from the store

        change = c.request(
            "POST", f"/adapters/{v1}/disable", json={"reason": "request withdrawn", "cascade": "retrain"}
        )
        plan = {step["adapter_id"]: step for step in change["retrains"]}
        assert list(plan) == [v2, v3, v4]
        assert plan[v2]["request_id"] and plan[v3]["request_id"]
        assert plan[v4]["request_id"] is None and "purged" in plan[v4]["reason"]
        retrained, gates = [], []
        for old in (v2, v3):
            done = c.wait(plan[old]["request_id"], timeout=180, interval=0.3)
            assert done["status"] == "succeeded", done
            assert done["metadata"]["rebase"]["replaces"] == old
            retrained.append(done["adapter_id"])
            gates.append(done["gate"])
        stack = {a["id"]: a for a in c.adapters(model)}
        v5, v6 = retrained
        # the second retrain sits on the first: the gate checked that v5's forget set stays forgotten
        kept = [r for r in gates[1]["rules"] if r["rule"] == f"earlier_forget_kept:{forgets[1]}"]
        assert kept and kept[0]["passed"] is True and gates[1]["passed"]
        assert stack[v5]["lineage"]["retrain_of"] == v2 and stack[v6]["lineage"]["retrain_of"] == v3
        assert stack[v5]["parent_stack"] == [] and stack[v6]["parent_stack"] == [v5]  # on the new stack
        assert stack[v2]["state"] == stack[v3]["state"] == "disabled"
        assert stack[v2]["state_reason"].startswith(f"replaced by v{stack[v5]['version']}")
        active = [a for a in stack.values() if a["state"] == "active"]
        assert {a["id"] for a in active} == {v4, v5, v6}
        assert stack[v4]["trained_on_stale"]  # its data is gone: it keeps its flag (and so do those above it)

        # The operator supplies v4's forget data again (the same file): that one version is retrained.
        other = c.upload_dataset(io.BytesIO(files[0]), filename="not-v4.jsonl")["id"]
        with pytest.raises(ApiError) as wrong:
            c.request("POST", f"/adapters/{v4}/retrain", json={"reason": "x", "forget_dataset": other})
        assert wrong.value.status == 422 and "same file" in wrong.value.message
        again = c.upload_dataset(io.BytesIO(files[3]), filename="forget3-again.jsonl")["id"]
        req = c.request(
            "POST", f"/adapters/{v4}/retrain", json={"reason": "data re-supplied", "forget_dataset": again}
        )
        done = c.wait(req["id"], timeout=180, interval=0.3)
        assert done["status"] == "succeeded", done
        stack = c.adapters(model)
        assert not [a["id"] for a in stack if a["state"] == "active" and a["trained_on_stale"]]
        assert {a["id"] for a in stack if a["state"] == "active"} == {v5, v6, done["adapter_id"]}
