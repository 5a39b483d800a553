"""The stack services on PostgreSQL: policy rules and verdicts, compacted versions in the registry (stale
flags, restore, conflicts), the admin override of a rejected adapter, and the policy API and dashboard."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from blade_service.persistence import policy, registry
from blade_service.persistence.errors import Conflict, Invalid
from blade_service.persistence.models import (
    AdapterState,
    AdapterVersion,
    AuditEntry,
    BaseModel,
    RequestStatus,
    UnlearnRequest,
)
from blade_service.persistence.storage import LocalStorage
from tests.fixtures_services import headers
from tests.test_dashboard_pages import signed_in
from tests.test_registry import World

pytestmark = pytest.mark.services


@pytest.fixture
def world(api_app, tmp_path):
    return World(api_app.state.session_factory, LocalStorage(tmp_path / "artifacts"))


# --- policy rules (pure) -----------------------------------------------------------------------------------


def test_policy_defaults_validation_and_verdict():
    assert policy.parse(None) == policy.DEFAULT_POLICY
    assert (
        policy.DEFAULT_POLICY["min_retain_prob_ratio"] == 0.5
        and policy.DEFAULT_POLICY["max_forget_rouge"] is None
    )
    with pytest.raises(Invalid, match=r"policy\.min_retain_probability: unknown rule") as unknown:
        policy.parse({"min_retain_probability": 0.9})
    assert unknown.value.field == "policy.min_retain_probability"
    for bad in (-0.1, 1.5, True, "0.3", float("nan")):
        with pytest.raises(Invalid, match=r"policy\.max_forget_prob"):
            policy.parse({"max_forget_prob": bad})

    rules = policy.parse({"max_forget_rouge": 0.3})
    verdict = policy.evaluate(
        rules,
        canary_before={"Prob": 0.8, "ROUGE": 0.9},
        canary_after={"Prob": 0.3, "ROUGE": 0.9},  # Prob ratio 0.375 < 0.5
        forget_after={"Prob": 0.01, "ROUGE": 0.2},
        canary_source="retain_sample",
    )
    assert not verdict["passed"] and verdict["failed"] == ["min_retain_prob_ratio"]
    by_rule = {r["rule"]: r for r in verdict["rules"]}
    assert by_rule["min_retain_prob_ratio"]["value"] == pytest.approx(0.375)
    assert by_rule["max_forget_rouge"]["passed"] is True and by_rule["max_forget_prob"]["passed"] is None
    assert "min_retain_prob_ratio: measured 0.3750 < limit 0.5" in policy.failure_message(verdict)

    off = policy.evaluate(
        {**rules, "enabled": False},
        canary_before={"Prob": 0.8, "ROUGE": 0.9},
        canary_after={"Prob": 0.0, "ROUGE": 0.0},
        forget_after={"Prob": 1.0, "ROUGE": 1.0},
        canary_source="retain_sample",
    )
    assert off["passed"]


def test_the_mia_rule_holds_back_an_adapter_whose_forget_rows_stand_out_either_way():
    assert policy.DEFAULT_POLICY["max_mia_auc_gap"] is None  # off unless an operator sets it
    for bad in (-0.1, 0.6, True):
        with pytest.raises(
            Invalid, match=r"policy\.max_mia_auc_gap: must be null or a number in \[0, 0\.5\]"
        ):
            policy.parse({"max_mia_auc_gap": bad})
    rules = policy.parse({"max_mia_auc_gap": 0.2})
    fine = {"Prob": 0.8, "ROUGE": 0.9}

    def verdict(mia: dict | None) -> dict:
        return policy.evaluate(
            rules, canary_before=fine, canary_after=fine, forget_after={"Prob": 0.0, "ROUGE": 0.1},
            canary_source="retain_sample", mia_after=mia,
        )  # fmt: skip

    over = verdict({"auc": 0.008, "score": "loss", "reference": "retain"})  # the demo's BLADE request
    assert over["failed"] == ["max_mia_auc_gap"]
    assert "max_mia_auc_gap: measured 0.4920 > limit 0.2" in policy.failure_message(over)
    assert verdict({"auc": 0.93})["failed"] == ["max_mia_auc_gap"]  # still remembered: as telling
    by_rule = {r["rule"]: r for r in verdict({"auc": 0.62})["rules"]}
    assert by_rule["max_mia_auc_gap"]["passed"] is True
    assert by_rule["max_mia_auc_gap"]["value"] == pytest.approx(0.12)
    assert by_rule["max_mia_auc_gap"]["after"] == 0.62
    assert verdict(None)["passed"] and verdict({"auc": float("nan")})["passed"]  # nothing measured


# --- registry: compacted versions and overrides ------------------------------------------------------------


def test_compacted_version_replaces_the_stack_and_stays_restorable(world):
    a1 = world.adapter()
    a2 = world.adapter()
    running = world.request()  # trained on [a1, a2] while the compaction ran
    with world.factory() as s, s.begin():
        base_id = s.scalars(select(BaseModel.id).where(BaseModel.name == world.model)).one()
        with pytest.raises(Conflict, match="active stack changed"):
            registry.create_compacted_version(
                s, base_model_id=base_id, sources=[a1], artifact_key="k", sha256="cd" * 32, size_bytes=1,
                lineage={"rank": 16}, actor="key:admin", reason="compact",
            )  # fmt: skip
        compacted = registry.create_compacted_version(
            s, base_model_id=base_id, sources=[a1, a2], artifact_key="k", sha256="cd" * 32, size_bytes=1,
            lineage={"rank": 16}, actor="key:admin", reason="compact", tenant_id=world.tenant_id,
        )  # fmt: skip
        c3 = compacted.id
        assert compacted.version == 3 and compacted.request_id is None and compacted.kind == "compaction"
        assert compacted.lineage["contains"] == [a1, a2] and compacted.lineage["versions"] == [1, 2]
    with world.factory() as s, s.begin():
        late = registry.create_adapter_version(
            s, request=running, artifact_key="x", sha256="ef" * 32, parent_stack=[a1, a2], actor="w"
        ).id
    stack = {a: (version, state, stale) for a, version, state, stale in world.stack()}
    assert stack[a1][1] == stack[a2][1] == "disabled" and stack[c3][1] == "active"
    assert not stack[a1][2] and not stack[a2][2]  # their compaction carries them: nothing below is missing
    assert not stack[c3][2] and not stack[late][2]  # trained on v1+v2 = what v3 stands for: not stale
    with world.factory() as s:
        reasons = {a.id: a.state_reason for a in registry.list_stack(s, world.model)}
    assert reasons[a1] == reasons[a2] == "compacted into v3"

    with pytest.raises(Conflict, match="disable v3 first") as busy:
        world.enable(a1)
    assert busy.value.code == "compacted"
    world.disable(c3, reason="back to the separate versions")
    world.enable(a1)
    world.enable(a2)
    stack = {a: (state, stale) for a, _, state, stale in world.stack()}
    assert stack[a1] == stack[a2] == ("active", False) and stack[late] == ("active", False)
    # and back: the compaction while the versions it contains are active would apply their changes twice
    with pytest.raises(Conflict, match="v3 compacts v1") as busy:
        world.enable(c3)
    assert busy.value.code == "compacted"
    assert _successors(world) == {a1: c3, a2: c3}


def test_a_version_inside_a_nested_compaction_cannot_be_enabled_beside_it(world):
    """v3 compacts (v1, v2), v4 is trained on v3, v5 compacts (v3, v4): v5 carries v1 too, so enabling v1
    while v5 is active would apply its change twice (409), and a compaction active over its own versions
    would be flagged stale."""
    a1, a2 = world.adapter(), world.adapter()
    with world.factory() as s, s.begin():
        base_id = s.scalars(select(BaseModel.id).where(BaseModel.name == world.model)).one()

        def compact(sources: list[str]) -> str:
            return registry.create_compacted_version(
                s, base_model_id=base_id, sources=sources, artifact_key="k", sha256="cd" * 32, size_bytes=1,
                lineage={"rank": 16}, actor="key:admin", reason="compact", tenant_id=world.tenant_id,
            ).id  # fmt: skip

        c3 = compact([a1, a2])
    a4 = world.adapter()
    with world.factory() as s, s.begin():
        c5 = compact([c3, a4])
    with pytest.raises(Conflict, match="v5 compacts v1") as busy:
        world.enable(a1)
    assert busy.value.code == "compacted"
    with world.factory() as s:
        stack = registry.list_stack(s, world.model)
    for a in stack:  # what a bypass of that check would leave: v1 and v2 active under the active v5
        if a.id in (a1, a2):
            a.state = AdapterState.ACTIVE
    assert registry.stale_flags(stack)[c5] is True


def test_rejected_adapter_is_stored_disabled_and_an_override_is_recorded(world):
    request_id = world.request()
    with world.factory() as s, s.begin():
        held = registry.create_adapter_version(
            s,
            request=request_id,
            artifact_key="k",
            sha256="ab" * 32,
            actor="worker:w",
            state=AdapterState.DISABLED,
            state_reason="rejected: held back by the base model's policy",
        )
        held_id = held.id
        req = s.get(UnlearnRequest, request_id)
        req.status, req.gate = RequestStatus.REJECTED, {"passed": False, "failed": ["min_retain_prob_ratio"]}
    assert [(state, stale) for a, _, state, stale in world.stack() if a == held_id] == [("disabled", False)]
    world.enable(held_id, reason="reviewed by the DPO")
    with world.factory() as s:
        gate = s.get(UnlearnRequest, request_id).gate
        entry = s.scalars(
            select(AuditEntry).where(AuditEntry.subject_id == held_id, AuditEntry.action == "adapter.enable")
        ).one()
    assert gate["failed"] == ["min_retain_prob_ratio"] and gate["override"]["reason"] == "reviewed by the DPO"
    assert entry.data["policy_override"] is True and entry.reason == "reviewed by the DPO"
    from blade_service.api.dashboard import queries

    with world.factory() as s:  # `rejected` still, but live: the dashboard's lists say so
        (row,) = [r for r in queries.list_requests(s, tenant_id=world.tenant_id) if r["id"] == request_id]
    assert row["status"] == "rejected" and row["overridden"] and not row["rolled_back"]


# --- HTTP: policy, compaction guards, dashboard ------------------------------------------------------------


def test_policy_api_is_admin_only_validated_and_audited(api_client, ready, make_key):
    h = headers(ready.tenant.admin)
    model = api_client.get(f"/base-models/{ready.base_model}", headers=h).json()
    assert model["policy"] == policy.DEFAULT_POLICY and model["canary_dataset"] is None
    url = f"/base-models/{ready.base_model}/policy"
    reader = make_key(ready.tenant.name, ["read"])
    assert api_client.put(url, headers=headers(reader), json={"reason": "x"}).status_code == 403
    bad = api_client.put(url, headers=h, json={"reason": "x", "policy": {"max_forget_rouge": 2}})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "policy.max_forget_rouge"
    missing = api_client.put(url, headers=h, json={"reason": "x", "canary_dataset": "ds_nope"})
    assert missing.status_code == 422 and missing.json()["error"]["field"] == "canary_dataset"
    ok = api_client.put(
        url,
        headers=h,
        json={"reason": "stricter", "policy": {"max_forget_rouge": 0.3}, "canary_dataset": ready.retain},
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["policy"]["max_forget_rouge"] == 0.3 and ok.json()["canary_dataset"] == ready.retain
    log = api_client.get("/audit-log", headers=h, params={"action": "base_model.policy"}).json()["items"]
    assert (
        log and log[0]["reason"] == "stricter" and log[0]["data"]["new"]["policy"]["max_forget_rouge"] == 0.3
    )

    # nothing to compact yet; unknown export formats are refused before any worker is asked
    empty = api_client.post(f"/base-models/{ready.base_model}/compact", headers=h, json={"reason": "x"})
    assert empty.status_code == 409 and empty.json()["error"]["code"] == "empty_stack"
    fmt = api_client.get(f"/base-models/{ready.base_model}/export", headers=h, params={"format": "gguf"})
    assert fmt.status_code == 422


def test_dashboard_shows_the_gate_and_the_policy(api_client, api_app, ready):
    rid = api_client.post("/unlearn-requests", headers=headers(ready.tenant.admin), json=ready.body()).json()[
        "id"
    ]
    verdict = policy.evaluate(
        policy.parse(None),
        canary_before={"Prob": 0.8, "ROUGE": 0.9},
        canary_after={"Prob": 0.2, "ROUGE": 0.9},
        forget_after={"Prob": 0.0, "ROUGE": 0.0},
        canary_source="retain_sample",
    )
    with api_app.state.session_factory() as s, s.begin():
        req = s.get(UnlearnRequest, rid)
        req.status, req.gate = RequestStatus.REJECTED, verdict
        req.error_code, req.error_message = "policy_rejected", policy.failure_message(verdict)
    client = signed_in(api_client, ready.tenant.admin)
    page = client.get(f"/dashboard/requests/{rid}").text
    assert 'id="gate"' in page and "min_retain_prob_ratio" in page and "fails" in page
    assert (
        client.get(f"/unlearn-requests/{rid}", headers=headers(ready.tenant.admin)).json()["status"]
        == "rejected"
    )
    model = client.get(f"/dashboard/models/{ready.base_model}").text
    assert 'id="policy"' in model and "each request&#39;s retain sample" in model


def test_reconciler_republishes_lost_compactions_and_fails_dead_ones(
    api_app, service_settings, world, monkeypatch
):
    from datetime import timedelta

    from blade_service.broker import dispatch
    from blade_service.persistence.models import StackOperation, utcnow
    from blade_service.worker import stacks

    sent: list[str] = []
    monkeypatch.setattr(dispatch, "enqueue_compact", lambda op_id: sent.append(op_id) or True)
    long_ago = utcnow() - timedelta(hours=3)
    with world.factory() as s, s.begin():
        base_id = s.scalars(select(BaseModel.id).where(BaseModel.name == world.model)).one()
        lost = StackOperation(
            base_model_id=base_id, kind="compact", created_by="key:admin", created_at=long_ago
        )
        fresh = StackOperation(base_model_id=base_id, kind="compact", created_by="key:admin")
        dead = StackOperation(
            base_model_id=base_id,
            kind="compact",
            created_by="key:admin",
            status="running",
            params={"started_at": long_ago.isoformat()},
        )
        s.add_all([lost, fresh, dead])
        s.flush()
        ids = lost.id, fresh.id, dead.id
    first = stacks.reconcile_operations(service_settings, requeue_after_s=300)
    assert ids[0] in first and ids[1] not in first and ids[2] not in first
    assert ids[0] not in stacks.reconcile_operations(service_settings, requeue_after_s=300)  # just re-sent
    with world.factory() as s:
        assert s.get(StackOperation, ids[2]).status == "failed"
        assert s.get(StackOperation, ids[2]).error_code == "worker_lost"
    # a duplicate message for an operation that is no longer queued does nothing
    assert stacks._compact(service_settings, ids[2])["status"] == "failed"


def test_a_regressed_earlier_forget_set_fails_the_gate_with_a_readable_message():
    verdict = policy.evaluate(
        policy.parse(None),
        canary_before={"Prob": 0.8, "ROUGE": 0.9},
        canary_after={"Prob": 0.8, "ROUGE": 0.9},
        forget_after={"Prob": 0.0, "ROUGE": 0.0},
        canary_source="retain_sample",
    )
    verdict["rules"].append(
        {"rule": "earlier_forget_kept:ds_1", "passed": False, "value": None, "limit": [0.05, 0.1],
         "before": {"Prob": 0.01, "ROUGE": 0.02}, "after": {"Prob": 0.6, "ROUGE": 0.7}}
    )  # fmt: skip
    assert "earlier_forget_kept:ds_1: remembered again (Prob 0.010 -> 0.600" in policy.failure_message(
        verdict
    )


def _successors(world) -> dict[str, str]:
    """Each version of the world's stack that a later one carries the change of -> that later one."""
    with world.factory() as s:
        stack = registry.list_stack(s, world.model)
        return {a.id: after.id for a in stack if (after := registry.successor(stack, a)) is not None}


def test_a_retrained_version_and_the_one_it_replaced_are_never_active_together(world):
    old = world.adapter()
    new = world.adapter()
    with world.factory() as s, s.begin():  # what the worker records once a rebase's retrain succeeds
        s.get(AdapterVersion, new).lineage = {"retrain_of": old, "replaces_version": 1}
    world.disable(old, reason="replaced by v2, retrained on the new stack (rebase)")
    with pytest.raises(Conflict, match="v2 retrains v1") as busy:
        world.enable(old)
    assert busy.value.code == "replaced"
    assert _successors(world) == {old: new}
    with world.factory() as s:
        stack = registry.list_stack(s, world.model)
        assert registry.change_in_effect(stack, stack[0])  # disabled, but its retrain carries it
    world.disable(new, reason="back to the first")
    world.enable(old)
    with pytest.raises(Conflict, match="disable v1 first"):
        world.enable(new)
