"""A task whose send of what its step made due fails (the broker away) still runs the step it continues
with: the rows say what is due, and the reconciler sends the rest once the broker is back.

Run in this process against the test database, the Celery app's broker pointed at a loopback port that
nothing listens on (a Redis that is down: kombu's connection is refused), as a worker's task would run.
Found by the chaos soak with Redis restarts (bench/soak.py --service-chaos).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from conductor.engine import plan_job, run_step
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.submission import JobCreate, create_job
from conductor.tasks.app import STEPS_QUEUE, app
from conductor.tasks.jobs import _run_on, _Slot
from tests.integration.harness import free_port


@contextmanager
def broker_away() -> Iterator[str]:
    """The app's broker is a port nothing listens on until the block ends (its connection pools rebuilt)."""
    saved = app.conf.broker_url
    dead = f"redis://127.0.0.1:{free_port()}/0"

    def rebuild() -> None:
        app._pool = None
        app.amqp._producer_pool = None

    app.conf.broker_url = dead
    rebuild()
    try:
        yield dead
    finally:
        app.conf.broker_url = saved
        rebuild()


@pytest.fixture
def no_local_slots(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No step runs beside the task: a second ready step must be sent."""
    monkeypatch.setenv("CONDUCTOR_WORKER_LOCAL_SLOTS", "0")
    get_settings.cache_clear()
    yield
    monkeypatch.delenv("CONDUCTOR_WORKER_LOCAL_SLOTS")
    get_settings.cache_clear()


def test_the_step_a_task_continues_with_runs_while_the_broker_is_away(no_local_slots: None) -> None:
    settings = get_settings()
    assert settings.worker_local_slots == 0 and settings.worker_continue_steps
    body = {"task": "broker away", "workflow": {"model_ids": ["a", "a", "a"], "subtasks": ["s0", "s1", "s2"],
                                                "access_lists": [[], [0], [0]]}}
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate(body), tenant="broker-away", settings=settings)
    due = plan_job(job.id, settings=settings)  # as the planner worker would; step 0 is due (not sent)
    assert due.steps == [(job.id, 0)]
    slot = _Slot(hostname="broker-away@test", task_id=None, consumed=frozenset({STEPS_QUEUE}))
    take = slot.taker(settings)
    with broker_away():
        # step 0's outcome makes steps 1 and 2 ready: one is claimed to continue here, the other must be
        # sent, and cannot be
        _run_on(slot, run_step(job.id, 0, worker=slot.worker(), task_id=None, settings=settings, take=take), take)
    with session_scope() as s:
        statuses = [st.status for st in store.get_steps(s, job_id=job.id)]
    assert statuses[0] == "succeeded"
    # the one claimed here ran; the other waits, queued, for the reconciler to send it
    assert sorted(statuses[1:]) == ["queued", "succeeded"], statuses


def test_the_submit_rate_warning_with_redis_away_says_the_submission_is_accepted(
        caplog: pytest.LogCaptureFixture) -> None:
    """The submit-rate quota lives in the broker's Redis; away, the submission is accepted unmetered and the
    warning says that (it repeated the step rate limiter's 'the step will be retried')."""
    from conductor.quotas import check_submit_rate
    from conductor.settings import Settings

    dead = f"redis://127.0.0.1:{free_port()}/0"
    with caplog.at_level("WARNING", logger="conductor.quotas"):
        check_submit_rate("broker-away", Settings(broker_url=dead))  # no quota error: accepted
    (record,) = [r for r in caplog.records if r.name == "conductor.quotas"]
    message = record.getMessage()
    assert "submission is accepted" in message and "Connection refused" in message, message
    assert "step" not in message, message


def test_a_failed_webhook_attempt_with_the_broker_away_is_left_to_the_reconciler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempt failed (500) and its retry cannot be sent: the task ends without raising, and the row says
    the retry is due with no message sent, which is what the reconciler sends."""
    from datetime import timedelta

    from conductor.engine import Dispatch
    from conductor.reconcile import ENQUEUE_GRACE_S
    from conductor.store import webhooks as webhook_store
    from conductor.store.models import utcnow
    from conductor.tasks.webhooks import deliver_webhook
    from tests.integration.webhook_receiver import serve_receiver

    monkeypatch.setenv("CONDUCTOR_WEBHOOK_ALLOW_LOOPBACK", "true")
    monkeypatch.setenv("CONDUCTOR_WEBHOOK_BACKOFF_S", "[0.5, 1]")
    get_settings.cache_clear()
    try:
        settings = get_settings()
        with serve_receiver() as receiver:
            url = receiver.on("/away", 500)
            body = {"task": "hook", "workflow": {"model_ids": ["a"], "subtasks": ["s"], "access_lists": [[]]},
                    "webhook_url": url}
            with session_scope() as s:
                job, _ = create_job(s, JobCreate.model_validate(body), tenant="broker-away", settings=settings)
            plan_job(job.id, settings=settings)
            ended: Dispatch = run_step(job.id, 0, worker="test", task_id=None, settings=settings)
            (delivery_id,) = ended.webhooks
            with broker_away():
                deliver_webhook.run(delivery_id)  # the attempt gets its 500; its retry's send is refused
            assert [r.answered for r in receiver.at("/away")] == [500]
        with session_scope() as s:
            due = webhook_store.deliveries_due(s, now=utcnow() + timedelta(seconds=ENQUEUE_GRACE_S + 5), grace_s=0)
        assert delivery_id in {d.id for d in due if d.sent_at is None}
    finally:
        get_settings.cache_clear()


def test_a_finalize_message_whose_sends_find_the_broker_away_does_not_raise() -> None:
    """A ``finalize`` message (left on the broker, or a replay's) advances its job; what that made due cannot
    be sent with the broker away: the task logs and ends (it raised kombu's OperationalError, a traceback for
    a state the reconciler recovers), and the step it made ready waits queued for the reconciler."""
    import sqlalchemy as sa

    from conductor.tasks.jobs import finalize

    settings = get_settings()
    body = {"task": "finalize away", "workflow": {"model_ids": ["a", "a"], "subtasks": ["s0", "s1"],
                                                  "access_lists": [[], [0]]}}
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate(body), tenant="broker-away", settings=settings)
    plan_job(job.id, settings=settings)
    run_step(job.id, 0, worker="test", task_id=None, settings=settings)  # step 1 marked ready with the outcome
    with session_scope() as s:  # staged: a job whose step 1 a finalize message has still to make ready
        s.execute(sa.text("UPDATE step SET status = 'pending', queued_at = NULL WHERE job_id = :j AND index = 1"),
                  {"j": job.id})
    with broker_away():
        finalize.run(job.id)  # advances: step 1 ready, its send refused
    with session_scope() as s:
        statuses = [st.status for st in store.get_steps(s, job_id=job.id)]
    assert statuses == ["succeeded", "queued"], statuses


def test_a_reconciler_pass_whose_resends_find_the_broker_away_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """The pass gathers a plan never sent and cannot send it: one warning line, no traceback (it logged one at
    every pass while Redis was away); the job stays owed, and a later pass sends it."""
    import logging

    import sqlalchemy as sa

    from conductor.reconcile import reconcile_once
    from conductor.tasks.send import send

    settings = get_settings()
    body = {"task": "reconcile away", "workflow": {"model_ids": ["a"], "subtasks": ["s"], "access_lists": [[]]}}
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate(body), tenant="broker-away", settings=settings)
        # as the API leaves a submission whose publish failed: never enqueued, and past the pass's grace
        s.execute(sa.text("UPDATE job SET enqueued_at = NULL, created_at = created_at - interval '1 minute' "
                          "WHERE id = :j"), {"j": job.id})
    with broker_away(), caplog.at_level(logging.WARNING, logger="conductor.reconcile"):
        report, dispatch = reconcile_once(settings, send=send)
    assert job.id in dispatch.plan and report["send_failed"]
    records = [r for r in caplog.records if r.name == "conductor.reconcile"]
    assert not [r for r in records if r.exc_info], "a traceback for the broker away"
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]
    assert "broker away" in records[0].getMessage() and "Connection refused" in records[0].getMessage()
    with session_scope() as s:  # still owed: the next pass finds it again
        assert s.execute(sa.text("SELECT enqueued_at FROM job WHERE id = :j"), {"j": job.id}).scalar_one() is None
