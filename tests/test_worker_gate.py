"""The policy gate's own sets (a registered canary, a retrain's earlier forget sets) are measured on the
models the request's two evaluations load, with the figures a load of their own gives."""

from __future__ import annotations

import pytest

from blade_core import lora
from blade_service.persistence.settings import Settings
from blade_service.worker import stacks, unlearn_task
from tests.fixtures_worker import EVAL_MAX_NEW_TOKENS, forget_rows, retain_rows

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def loads(monkeypatch):
    """The adapter stacks `load_with_stack` was asked for, in order."""
    asked, real = [], lora.load_with_stack

    def counting(base_ref, dirs, device):
        asked.append(list(dirs))
        return real(base_ref, dirs, device)

    monkeypatch.setattr(lora, "load_with_stack", counting)
    return asked


@pytest.fixture
def settings(tmp_path):
    return Settings(data_dir=tmp_path, eval_max_new_tokens=EVAL_MAX_NEW_TOKENS)


def _earlier(dataset_id: str, *, purged: bool = False) -> dict:
    return {"adapter_id": f"ad_{dataset_id}", "id": dataset_id, "key": "-", "sha256": "-", "purged": purged}


def test_one_load_measures_the_request_and_the_gate_sets_as_separate_loads_do(
    tiny_model_dir, settings, loads
):
    gated = {stacks.CANARY: retain_rows(12), "ds_earlier": forget_rows(8)}
    metrics, sets = unlearn_task._measure(
        str(tiny_model_dir), [], forget_rows(), retain_rows(), settings, None, gated
    )
    assert loads == [[]] and set(metrics) >= {"forget", "retain"}
    assert sets == stacks._loaded_sets_metrics(str(tiny_model_dir), [], gated, settings)
    assert set(sets) == set(gated) and all(0 < s["Prob"] < 1 for s in sets.values())


def test_the_gate_loads_nothing_when_both_sides_are_measured_and_the_stack_once_when_resumed(
    tiny_model_dir, settings, loads
):
    gated = {stacks.CANARY: retain_rows(12), "ds_earlier": forget_rows(8)}
    before = {stacks.CANARY: {"Prob": 0.8, "ROUGE": 0.9}, "ds_earlier": {"Prob": 0.01, "ROUGE": 0.1}}
    after = {stacks.CANARY: {"Prob": 0.7, "ROUGE": 0.9}, "ds_earlier": {"Prob": 0.3, "ROUGE": 0.1}}
    common = {
        "settings": settings,
        "policy": {},
        "canary": {"id": "ds_canary", "key": "-", "sha256": "-"},
        "base_ref": str(tiny_model_dir),
        "stack_dirs": [],
        "sets": gated,
        "sets_after": after,
        "before": {"retain": {"Prob": 0.5, "ROUGE": 0.5}},
        "after": {"retain": {"Prob": 0.5, "ROUGE": 0.5}, "forget": {"Prob": 0.0, "ROUGE": 0.0}},
        "earlier": [_earlier("ds_earlier"), _earlier("ds_purged", purged=True)],
    }
    verdict = stacks.gate_verdict(sets_before=before, **common)
    assert loads == []
    assert verdict["canary"] == "dataset:ds_canary"
    assert verdict["canary_metrics"] == {"before": before[stacks.CANARY], "after": after[stacks.CANARY]}
    kept = {r["rule"]: r for r in verdict["rules"] if r["rule"].startswith("earlier_forget_kept:")}
    assert kept["earlier_forget_kept:ds_earlier"]["passed"] is False  # Prob 0.01 -> 0.3: no longer forgotten
    assert kept["earlier_forget_kept:ds_purged"]["passed"] is None
    assert verdict["failed"] == ["earlier_forget_kept:ds_earlier"] and not verdict["passed"]

    resumed = stacks.gate_verdict(
        sets_before=None, **common
    )  # the request's first evaluation: an earlier try
    assert loads == [[]]
    measured = stacks._loaded_sets_metrics(str(tiny_model_dir), [], gated, settings)
    assert resumed["canary_metrics"]["before"] == measured[stacks.CANARY]
