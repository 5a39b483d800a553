"""End to end (real API and Celery worker processes, PostgreSQL, Redis): text unlearning requests.

A JSONL `text` request with `preset: muse` and QA probe datasets reports VerbMem and KnowMem (forget and
retain) before and after, in its metrics and its certificate; a `.txt` upload without probes reports
VerbMem on its forget text alone. A bad preset or probe set is a 4xx naming the field. The service's
torch-free copy of the presets matches the engine's."""

from __future__ import annotations

import io
import uuid

import pytest

from blade_service.client.http import ApiError
from tests.fixtures_worker import jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.services, pytest.mark.timeout(400)]

# A few steps with the convergence stop off; one micro-batch per step (the muse preset accumulates 8).
QUICK = {
    "max_steps": 3,
    "early_stop": False,
    "inner_steps": 1,
    "max_length": 96,
    "batch_size": 2,
    "grad_accum": 1,
}


def _texts(prefix: str, n: int) -> list[str]:
    return [
        f"{prefix} report {i}: the harbour of Velmora opened at dawn and the bell rang {i} times; "
        f"the fishermen sold {i + 3} baskets of trout and the mayor thanked the {prefix} crew for number {i}."
        for i in range(n)
    ]


def _qa(prefix: str, n: int) -> list[dict[str, str]]:
    return [
        {"question": f"How many baskets did the {prefix} crew sell on day {i}?", "answer": f"{i + 3}"}
        for i in range(n)
    ]


def test_request_presets_match_the_engine():
    from blade_core.methods import METHOD_NAMES
    from blade_core.unlearn import presets_of
    from blade_service.persistence.requests import PRESET_MAX_STEPS, REQUEST_PRESETS

    for method in METHOD_NAMES:
        assert set(REQUEST_PRESETS[method]) <= set(presets_of(method)), method
    blade = presets_of("blade")
    assert set(REQUEST_PRESETS["blade"]) == set(blade)
    for name, values in blade.items():
        assert PRESET_MAX_STEPS.get(name, 250) == values["max_steps"], name


def test_text_request_with_probes_reports_muse_metrics(e2e, tiny_model_dir):
    name = f"tiny-text-{uuid.uuid4().hex[:8]}"
    with e2e.client() as c:
        c.request("POST", "/base-models", json={"name": name, "source": str(tiny_model_dir)})
        forget = c.upload_dataset(io.BytesIO(jsonl([{"text": t} for t in _texts("north", 6)])), "f.jsonl")
        retain = c.upload_dataset(io.BytesIO(jsonl([{"text": t} for t in _texts("south", 8)])), "r.jsonl")
        probes = {
            kind: c.upload_dataset(io.BytesIO(jsonl(rows)), f"{kind}.jsonl")["id"]
            for kind, rows in (
                ("forget_qa", _qa("north", 4)),
                ("retain_qa", _qa("south", 4)),
                ("icl", _qa("west", 2)),
            )
        }

        with pytest.raises(ApiError) as bad:
            c.submit(name, forget["id"], retain["id"], preset="nope", params=QUICK)
        assert 400 <= bad.value.status < 500 and bad.value.field == "preset", bad.value
        with pytest.raises(ApiError) as bad:
            c.submit(name, forget["id"], retain["id"], probe_datasets={"answers": probes["icl"]})
        assert 400 <= bad.value.status < 500 and bad.value.field == "probe_datasets.answers", bad.value
        with pytest.raises(ApiError) as bad:
            c.submit(name, forget["id"], retain["id"], probe_datasets={"forget_qa": "ds_missing"})
        assert 400 <= bad.value.status < 500 and bad.value.field == "probe_datasets.forget_qa", bad.value

        req = c.submit(name, forget["id"], retain["id"], preset="muse", probe_datasets=probes, params=QUICK)
        assert req["params"]["preset"] == "muse" and req["params"]["probe_datasets"] == probes
        done = c.wait(req["id"], timeout=300, interval=0.5)
        assert done["status"] == "succeeded", done
        metrics = c.request("GET", f"/unlearn-requests/{req['id']}/metrics")
        for side in ("before", "after"):
            muse = metrics[side]["muse"]
            assert muse["source"] == "probes", muse
            for key in ("VerbMem", "KnowMem_forget", "KnowMem_retain"):
                assert 0.0 <= muse[key] <= 1.0, (side, key, muse)
            assert metrics[side]["forget"]["kind"] == "text"
        cert = c.request("GET", f"/unlearn-requests/{req['id']}/certificate")
        named = {m["name"]: m for m in _find_metrics(cert)}
        assert {"muse.VerbMem", "muse.KnowMem_forget", "muse.KnowMem_retain"} <= set(named), sorted(named)
        assert named["muse.VerbMem"]["before"] == pytest.approx(metrics["before"]["muse"]["VerbMem"])

        # a plain-text upload without probes: VerbMem alone, on its forget text
        txt = "\n\n".join(_texts("east", 5)).encode()  # one document per blank-line-separated paragraph
        forget_txt = c.upload_dataset(io.BytesIO(txt), "leak.txt")
        assert forget_txt["rows"] == 5
        req2 = c.submit(name, forget_txt["id"], retain["id"], preset="muse", params=QUICK)
        done2 = c.wait(req2["id"], timeout=300, interval=0.5)
        assert done2["status"] == "succeeded", done2
        after = c.request("GET", f"/unlearn-requests/{req2['id']}/metrics")["after"]["muse"]
        assert after["source"] == "forget-slice" and 0.0 <= after["VerbMem"] <= 1.0
        assert "KnowMem_forget" not in after


def _find_metrics(doc):
    """The certificate's list of interpreted metrics, wherever it sits in the document."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "metrics" and isinstance(value, list) and value and "name" in value[0]:
                return value
            found = _find_metrics(value)
            if found:
                return found
    return []
