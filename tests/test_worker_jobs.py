"""The worker's state machine on the real PostgreSQL: claiming under a lease, serialisation per base model,
crash takeover, the crash-loop guard, progress events and what the reconciler re-enqueues.

Calls `persistence.jobs` directly (no Celery, no torch).
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import select, text

from blade_service.persistence import jobs
from blade_service.persistence.db import session_scope
from blade_service.persistence.models import (
    BaseModel,
    Dataset,
    RequestStatus,
    Tenant,
    TrainingEvent,
    UnlearnRequest,
    utcnow,
)

pytestmark = pytest.mark.services

LEASE = 30


def _claim(settings, request_id: str, owner: str, max_attempts: int = 5) -> jobs.Claim:
    with session_scope(settings) as s:
        return jobs.claim_request(
            s, request_id=request_id, owner=owner, lease_seconds=LEASE, max_attempts=max_attempts
        )


def _get(settings, request_id: str) -> UnlearnRequest:
    with session_scope(settings) as s:
        return jobs.get_request(s, request_id=request_id)


def _base(settings, request_id: str) -> str:
    return _get(settings, request_id).base_model_id


def test_claim_takes_the_lease_once(worker_settings, make_request):
    rid = make_request()
    first = _claim(worker_settings, rid, "w1")
    assert first.claimed and first.attempt == 1 and not first.resumed
    req = _get(worker_settings, rid)
    assert req.status == RequestStatus.RUNNING and req.lease_owner == "w1" and req.started_at is not None
    assert _claim(worker_settings, rid, "w2").outcome is jobs.ClaimOutcome.BUSY
    with session_scope(worker_settings) as s:
        state = jobs.renew_lease(s, request_id=rid, owner="w1", lease_seconds=LEASE)
    assert state.owned and not state.cancel_requested


def test_concurrent_claims_have_one_winner(worker_settings, make_request):
    rid = make_request()
    outcomes: list[jobs.ClaimOutcome] = []
    barrier = threading.Barrier(4)

    def claim(owner: str) -> None:
        barrier.wait()
        outcomes.append(_claim(worker_settings, rid, owner).outcome)

    threads = [threading.Thread(target=claim, args=(f"racer{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count(jobs.ClaimOutcome.CLAIMED) == 1
    assert _get(worker_settings, rid).attempts == 1


def test_expired_lease_is_taken_over_and_the_old_owner_is_locked_out(worker_settings, make_request):
    rid = make_request()
    assert _claim(worker_settings, rid, "dead-worker").claimed
    with session_scope(worker_settings) as s:
        jobs.expire_lease_now(s, request_id=rid)
    second = _claim(worker_settings, rid, "new-worker")
    assert second.claimed and second.attempt == 2 and second.resumed
    with session_scope(worker_settings) as s:
        assert not jobs.renew_lease(s, request_id=rid, owner="dead-worker", lease_seconds=LEASE).owned
    with pytest.raises(jobs.LeaseLost), session_scope(worker_settings) as s:
        jobs.record_step(s, request_id=rid, owner="dead-worker", record={"step": 1})


def test_requests_of_one_base_model_run_in_submission_order(worker_settings, make_request):
    r1 = make_request()
    r2 = make_request(_base(worker_settings, r1))
    other = make_request()  # another base model: not held back
    waiting = _claim(worker_settings, r2, "w")
    assert waiting.outcome is jobs.ClaimOutcome.WAITING and waiting.blocked_by == r1
    assert _get(worker_settings, r2).status == RequestStatus.QUEUED
    assert _claim(worker_settings, other, "w-other").claimed
    assert _claim(worker_settings, r1, "w1").claimed
    with session_scope(worker_settings) as s:
        assert jobs.next_in_line(s, base_model_id=_base(worker_settings, r1)) == r1
        assert jobs.mark_failed(s, request_id=r1, owner="w1", code="boom", message="test failure")
    failed = _get(worker_settings, r1)
    assert (
        failed.status == RequestStatus.FAILED and failed.error_code == "boom" and failed.lease_owner is None
    )
    assert _claim(worker_settings, r2, "w2").claimed


def test_terminal_requests_never_change(worker_settings, make_request):
    rid = make_request()
    assert _claim(worker_settings, rid, "w").claimed
    with session_scope(worker_settings) as s:
        jobs.mark_cancelled(s, request_id=rid, owner="w")
    assert _claim(worker_settings, rid, "w2").outcome is jobs.ClaimOutcome.TERMINAL
    with session_scope(worker_settings) as s:
        assert not jobs.mark_failed(s, request_id=rid, code="late", message="too late")
    assert _get(worker_settings, rid).status == RequestStatus.CANCELLED


def test_cancel_of_a_request_whose_worker_died_completes_on_redelivery(worker_settings, make_request):
    rid = make_request()
    assert _claim(worker_settings, rid, "w").claimed
    with session_scope(worker_settings) as s:
        req = jobs.get_request(s, request_id=rid)
        req.status, req.cancel_requested_at = RequestStatus.CANCELLING, utcnow()
        jobs.expire_lease_now(s, request_id=rid)
    claim = _claim(worker_settings, rid, "w2")
    assert claim.outcome is jobs.ClaimOutcome.CANCELLED
    assert _get(worker_settings, rid).status == RequestStatus.CANCELLED


def test_a_crash_loop_ends_as_failed(worker_settings, make_request):
    rid = make_request()
    for i in range(2):
        assert _claim(worker_settings, rid, f"w{i}", max_attempts=2).claimed
        with session_scope(worker_settings) as s:
            jobs.expire_lease_now(s, request_id=rid)
    claim = _claim(worker_settings, rid, "w-last", max_attempts=2)
    assert claim.outcome is jobs.ClaimOutcome.EXHAUSTED
    req = _get(worker_settings, rid)
    assert req.status == RequestStatus.FAILED and req.error_code == "too_many_attempts"
    assert "2 times" in req.error_message


def test_step_events_are_upserted_and_trimmed_on_resume(worker_settings, make_request):
    rid = make_request()
    assert _claim(worker_settings, rid, "w").claimed
    with session_scope(worker_settings) as s:
        for step in (1, 2, 3, 4):
            jobs.record_step(
                s,
                request_id=rid,
                owner="w",
                record={"step": step, "L_fgt": 1.0 / step, "nan": float("nan")},
                total_steps=10,
            )
    with session_scope(worker_settings) as s:
        assert jobs.drop_steps_after(s, request_id=rid, step=2) == 2
        jobs.record_step(s, request_id=rid, owner="w", record={"step": 3, "L_fgt": 9.0, "resumed_from": 2})
    with session_scope(worker_settings) as s:
        events = list(
            s.scalars(
                select(TrainingEvent).where(TrainingEvent.request_id == rid).order_by(TrainingEvent.step)
            )
        )
        assert [e.step for e in events] == [1, 2, 3]
        assert events[2].record == {"step": 3, "L_fgt": 9.0, "resumed_from": 2}
        assert events[0].record["nan"] is None  # JSON-safe
        assert jobs.last_step(s, request_id=rid) == 3
    req = _get(worker_settings, rid)
    assert req.step == 3 and req.total_steps == 10


def test_reconciler_candidates(worker_settings, make_request):
    never_sent = make_request()
    behind = make_request(_base(worker_settings, never_sent))  # not the head of its queue: never a candidate
    sent = make_request()
    crashed = make_request()
    alive = make_request()
    with session_scope(worker_settings) as s:
        jobs.mark_enqueued(s, request_ids=[sent, behind, crashed, alive])
    assert _claim(worker_settings, crashed, "dead").claimed
    assert _claim(worker_settings, alive, "alive").claimed
    with session_scope(worker_settings) as s:
        jobs.expire_lease_now(s, request_id=crashed)
        found = set(jobs.reconcile_candidates(s, requeue_after_s=300))
        soon = set(jobs.reconcile_candidates(s, now=utcnow() + timedelta(seconds=11), requeue_after_s=300))
    # Just submitted and not yet published: the API is about to publish it, the reconciler leaves it alone.
    assert crashed in found and never_sent not in found
    assert not found & {behind, sent, alive}
    assert never_sent in soon and not soon & {behind, sent, alive}
    # A queued head whose message is older than the threshold is sent again.
    with session_scope(worker_settings) as s:
        later = jobs.reconcile_candidates(s, now=utcnow() + timedelta(seconds=301), requeue_after_s=300)
    assert sent in later


def test_a_head_is_published_once_whoever_finishes_before_it(worker_settings, make_request):
    """The finishing worker publishes the next head only when no relay or reconciler has (`head_to_publish`):
    a duplicate task is consumed as a no-op, and a no-op's own finish used to publish the head again, so
    every request of a backlog ran behind more no-ops than the one before it."""
    first = make_request()
    model_id = _base(worker_settings, first)
    second = make_request(model_id)
    assert _claim(worker_settings, first, "w1").claimed
    with session_scope(worker_settings) as s:
        assert jobs.head_to_publish(s, base_model_id=model_id) is None  # `first` runs: nothing to publish
        assert jobs.mark_failed(s, request_id=first, owner="w1", code="boom", message="test failure")
    with session_scope(worker_settings) as s:
        assert jobs.head_to_publish(s, base_model_id=model_id) == second
        jobs.mark_enqueued(s, request_ids=[second])  # a relay published it first
    with session_scope(worker_settings) as s:
        assert jobs.head_to_publish(s, base_model_id=model_id) is None
        assert second not in [rid for rid, _ in jobs.unpublished_heads(s)]


def test_a_head_being_published_is_skipped_by_the_other_publishers(worker_settings, make_request):
    """While one publisher holds a head's row (the relay, the reconciler or a finishing worker, each between
    its publish and its commit), the others skip it instead of publishing it too."""
    head = make_request()
    model_id = _base(worker_settings, head)
    with session_scope(worker_settings) as relay:
        assert head in [rid for rid, _ in jobs.unpublished_heads(relay)]  # locked until this commits
        with session_scope(worker_settings) as s:
            assert jobs.head_to_publish(s, base_model_id=model_id) is None
            later = utcnow() + timedelta(seconds=60)  # past the publish grace
            assert head not in jobs.reconcile_candidates(s, now=later, requeue_after_s=300)
    with session_scope(worker_settings) as s:
        assert head in jobs.reconcile_candidates(s, now=utcnow() + timedelta(seconds=60), requeue_after_s=300)


def test_a_task_spent_while_its_request_waits_leaves_it_to_be_published_again(worker_settings, make_request):
    """A task delivered while an older request of its base model is active is spent without running
    (WAITING): the request is marked unpublished, so the next finish or relay publishes it afresh instead
    of leaving it to the reconciler's `requeue_after_s`."""
    first = make_request()
    model_id = _base(worker_settings, first)
    second = make_request(model_id)
    with session_scope(worker_settings) as s:
        jobs.mark_enqueued(s, request_ids=[second])
    assert _claim(worker_settings, first, "w1").claimed
    assert _claim(worker_settings, second, "w2").outcome is jobs.ClaimOutcome.WAITING
    with session_scope(worker_settings) as s:
        jobs.mark_unpublished(s, request_id=second)
    assert _get(worker_settings, second).enqueued_at is None
    with session_scope(worker_settings) as s:
        assert jobs.mark_failed(s, request_id=first, owner="w1", code="boom", message="test failure")
    with session_scope(worker_settings) as s:
        assert jobs.head_to_publish(s, base_model_id=model_id) == second


def test_worker_heartbeat_rows(worker_settings):
    name = f"hb-{uuid.uuid4().hex[:6]}@test"
    with session_scope(worker_settings) as s:
        jobs.beat_worker(s, worker_name=name, queues=["unlearn"], hostname="h", pid=1, info={"device": "cpu"})
    with session_scope(worker_settings) as s:
        jobs.beat_worker(s, worker_name=name, current_request_id="req_x", alive=True)
        jobs.beat_worker(s, worker_name=name, alive=False)
    from blade_service.persistence.models import WorkerHeartbeat

    with session_scope(worker_settings) as s:
        row = s.get(WorkerHeartbeat, name)
        assert row.queues == ["unlearn"] and row.info == {"device": "cpu"} and row.alive is False


def test_a_request_submitted_as_the_head_finishes_is_seen_by_the_finishing_worker(worker_settings):
    """The relay publishes heads only; a request submitted while the head finishes is seen by the finishing
    worker's `next_in_line` at once, because it waits on the base model's row lock."""
    from blade_service.persistence import requests
    from blade_service.persistence.db import session_factory
    from tests.fixtures_worker import wait_until

    with session_scope(worker_settings) as s:
        tenant = Tenant(name=f"race-{uuid.uuid4().hex[:8]}")
        model = BaseModel(name=f"bm-{uuid.uuid4().hex[:8]}", source="/nowhere")
        s.add_all([tenant, model])
        s.flush()
        datasets = [
            Dataset(
                tenant_id=tenant.id,
                name=f"{kind}.jsonl",
                sha256=str(i) * 64,
                rows=3,
                format="jsonl",
                kind="qa",
                size_bytes=1,
                storage_key=f"datasets/{kind}.jsonl",
            )
            for i, kind in enumerate(("forget", "retain"))
        ]
        s.add_all(datasets)
        s.flush()
        tenant_id, model_id, model_name = tenant.id, model.id, model.name
        forget_id, retain_id = (d.id for d in datasets)

    def submit(session) -> tuple[str, int | None]:
        request, _, position = requests.submit_request(
            session,
            tenant_id=tenant_id,
            base_model=model_name,
            forget_dataset=forget_id,
            retain_dataset=retain_id,
            params={"max_steps": 5},
            actor="test",
        )
        return request.id, position

    with session_scope(worker_settings) as s:
        head, position = submit(s)
    assert position == 0 and _get(worker_settings, head).enqueued_at is None  # the relay's to publish
    with session_scope(worker_settings) as s:
        assert head in [rid for rid, _ in jobs.unpublished_heads(s)]
    assert _claim(worker_settings, head, "w1").claimed

    def blocked_on(fragment: str) -> int:
        with session_scope(worker_settings) as s:  # a new transaction: the view is read once per one
            return s.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE :q"
                ),
                {"q": f"%{fragment}%"},
            ).scalar_one()

    # The race: the submission locks the base model while the head finishes, and the worker looks for the
    # next request before the submission commits.
    submitted: list[tuple[str, int | None]] = []
    may_commit = threading.Event()

    def submit_and_wait() -> None:
        with session_factory(worker_settings)() as session:
            submitted.append(submit(session))
            may_commit.wait(timeout=60)
            session.commit()

    with session_factory(worker_settings)() as finishing:
        assert jobs.mark_failed(finishing, request_id=head, owner="w1", code="boom", message="test")
        submitter = threading.Thread(target=submit_and_wait)
        submitter.start()  # its claim locks the base model, then waits for the chain (the head holds it)
        wait_until(lambda: blocked_on("pg_advisory_xact_lock"), timeout=30, what="the submission")
        finishing.commit()
    wait_until(lambda: submitted, timeout=30, what="the submission's statements")
    (new, position), found = submitted[0], []
    assert position == 0  # its INSERT's snapshot was taken once the head's end had committed

    def kick() -> None:
        with session_scope(worker_settings) as s:
            found.append(jobs.next_in_line(s, base_model_id=model_id))

    kicker = threading.Thread(target=kick)
    kicker.start()
    wait_until(lambda: blocked_on("FOR SHARE"), timeout=30, what="next_in_line to wait for the submission")
    assert not found
    may_commit.set()
    submitter.join(timeout=30)
    kicker.join(timeout=30)
    assert found == [new]  # so the finishing worker sees it, and publishes it
    with session_scope(worker_settings) as s:
        assert new in [rid for rid, _ in jobs.unpublished_heads(s)]  # and so would the relay, next pass
