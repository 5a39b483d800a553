"""When the worker starts a run over. A redelivered request whose checkpoint was written under another method
config (a deploy changed it while the request was paused) starts over under the current config and succeeds:
the client's request is still valid, so it never fails as `invalid_request`, and nothing of the discarded run
stays behind. A BLADE run that collapses starts over at half its eta_out (`collapse_retries`), unless the
request chose eta_out."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from sqlalchemy import select

from blade_core.checkpoint import checkpoint_path
from blade_service.persistence import jobs
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import RequestStatus, TrainingEvent, UnlearnRequest
from blade_service.persistence.storage import get_storage
from blade_service.worker.artifacts import checkpoint_step
from blade_service.worker.lease import LeaseKeeper
from blade_service.worker.run_context import RunContext
from blade_service.worker.training import run_notes, train
from tests.fixtures_worker import forget_rows, jsonl, retain_rows

pytestmark = pytest.mark.services

OWNER = "worker-a"


@pytest.fixture
def claimed_request(worker_settings, make_request) -> str:
    """A blade request on a new base model, its lease held by OWNER."""
    request_id = make_request()
    with session_scope(worker_settings) as s:
        claim = jobs.claim_request(s, request_id=request_id, owner=OWNER, lease_seconds=600)
    assert claim.claimed
    return request_id


def _events(settings, request_id: str) -> list[dict]:
    with session_scope(settings) as s:
        rows = s.scalars(
            select(TrainingEvent).where(TrainingEvent.request_id == request_id).order_by(TrainingEvent.step)
        ).all()
        return [dict(e.record, step=e.step) for e in rows]


def _checkpoint_key(settings, request_id: str) -> str | None:
    with session_scope(settings) as s:
        return s.get(UnlearnRequest, request_id).checkpoint_key


def _context(worker_settings, request_id, tiny_model_dir, tmp_path, params) -> RunContext:
    """A first attempt at `request_id` with `params`, its forget and retain files written under tmp_path."""
    (tmp_path / "forget.jsonl").write_bytes(jsonl(forget_rows()))
    (tmp_path / "retain.jsonl").write_bytes(jsonl(retain_rows()))
    return RunContext(
        settings=worker_settings,
        storage=get_storage(worker_settings),
        owner=OWNER,
        request_id=request_id,
        tenant_id="t",
        base_model_id="b",
        base_model_name="bm",
        base_source=str(tiny_model_dir),
        method="blade",
        params=params,
        status=RequestStatus.RUNNING,
        attempt=1,
        forget={},
        retain={},
        metrics_before=None,
        checkpoint_key=None,
        workdir=tmp_path / "attempt-1",
    )


def test_a_checkpoint_of_another_config_is_discarded_and_the_run_starts_over(
    worker_settings, claimed_request, tiny_model_dir, tmp_path
):
    params = {"max_steps": 4, "checkpoint_every": 2, "tau": 0.7}
    first = _context(worker_settings, claimed_request, tiny_model_dir, tmp_path, params)
    forget, retain, storage = tmp_path / "forget.jsonl", tmp_path / "retain.jsonl", first.storage
    lease = LeaseKeeper(request_id=claimed_request, owner=OWNER, settings=worker_settings, worker_name="w")
    train(first, lease, str(tiny_model_dir), [], forget, retain, tmp_path / "out-1")
    stale = _checkpoint_key(worker_settings, claimed_request)
    assert stale is not None and storage.exists(stale)
    assert checkpoint_step(stale) == 2  # the last one saved before the record that uploads it

    # The same request redelivered after a deploy that changed tau: its checkpoint cannot continue this run.
    second = dataclasses.replace(
        first,
        params={**first.params, "tau": 0.5},
        attempt=2,
        checkpoint_key=stale,
        workdir=tmp_path / "attempt-2",
    )
    result = train(second, lease, str(tiny_model_dir), [], forget, retain, tmp_path / "out-2")

    assert len(result.history) == 4
    events = _events(worker_settings, claimed_request)
    assert [e["step"] for e in events] == [1, 2, 3, 4]
    assert all(e["attempt"] == 2 for e in events)  # nothing of the discarded run's steps remains
    restarted = events[0]["restarted"]
    assert restarted["because"] == ["tau: 0.7 -> 0.5"]
    assert restarted["discarded_checkpoint_step"] == 2
    assert "resumed_from" not in events[0]
    # The stored checkpoint is the new run's (the same step's key, written under the current config).
    stored = _checkpoint_key(worker_settings, claimed_request)
    storage.get_dir(stored, tmp_path / "stored")
    payload = torch.load(checkpoint_path(tmp_path / "stored"), weights_only=True)
    assert payload["state"]["config"]["tau"] == 0.5


def _collapsing_run(worker_settings, request_id, tiny_model_dir, tmp_path, **params) -> RunContext:
    """A context whose BLADE run collapses at step 1 whatever its learning rate: no retain loss is as low as
    its `collapse_loss`."""
    params = {"max_steps": 3, "inner_steps": 1, "batch_size": 4, "collapse_loss": 1e-9, **params}
    return _context(worker_settings, request_id, tiny_model_dir, tmp_path, params)


def test_a_collapsed_run_starts_over_at_half_its_eta_out(
    worker_settings, claimed_request, tiny_model_dir, tmp_path
):
    ctx = _collapsing_run(worker_settings, claimed_request, tiny_model_dir, tmp_path)
    lease = LeaseKeeper(request_id=claimed_request, owner=OWNER, settings=worker_settings, worker_name="w")
    out = tmp_path / "out"
    assert worker_settings.collapse_retries == 1
    result = train(
        ctx, lease, str(tiny_model_dir), [], tmp_path / "forget.jsonl", tmp_path / "retain.jsonl", out
    )

    assert result.status == "collapsed" and "started over 1 time(s)" in result.message
    retried_with = json.loads((out / "run.json").read_text())["config"]["eta_out"]
    events = _events(worker_settings, claimed_request)
    assert [e["step"] for e in events] == [1]  # the first run's step was dropped with it
    restarted = events[0]["restarted"]
    assert restarted["eta_out"] == retried_with and "collapsed at step 1" in restarted["collapsed"]
    assert f"it was {2 * retried_with:g}" in restarted["collapsed"]  # half the one the first run had
    assert f"it was {retried_with:g}" in result.message
    # What an adapter of the retry would store: eta_out is the worker's choice, so its value is recorded.
    rule = run_notes(out)["lr_rule"]
    assert "eta_out" in rule["explicit"] and rule["explicit_values"]["eta_out"] == retried_with


@pytest.mark.parametrize("why", ["eta_out set by the request", "collapse_retries 0"])
def test_a_collapse_is_final_when_the_request_chose_eta_out_or_retries_are_off(
    worker_settings, claimed_request, tiny_model_dir, tmp_path, why
):
    params = {"eta_out": 1e-4} if why.startswith("eta_out") else {}
    settings = worker_settings if params else worker_settings.model_copy(update={"collapse_retries": 0})
    ctx = dataclasses.replace(
        _collapsing_run(worker_settings, claimed_request, tiny_model_dir, tmp_path, **params),
        settings=settings,
    )
    lease = LeaseKeeper(request_id=claimed_request, owner=OWNER, settings=settings, worker_name="w")
    result = train(
        ctx,
        lease,
        str(tiny_model_dir),
        [],
        tmp_path / "forget.jsonl",
        tmp_path / "retain.jsonl",
        tmp_path / "o",
    )
    assert result.status == "collapsed" and "started over" not in result.message
    assert "restarted" not in _events(worker_settings, claimed_request)[0]
