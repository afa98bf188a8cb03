"""Finding 8 and the timeout story, on a real Postgres: a worker that lost its step can neither erase
the new owner's usage nor rewrite its closed attempt; a claim that raises fails its step instead of
being re-sent forever; a step stuck past its longest possible duration stops being kept alive."""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa

from conductor.engine import _record_success, cancel_job, plan_job, run_step
from conductor.lease import Heartbeat
from conductor.pool.base import Completion
from conductor.pool.errors import RateLimited
from conductor.retry import RetryPolicy
from conductor.settings import MAX_RETRY_AFTER_S, get_settings
from conductor.store import jobs as store
from conductor.store.db import get_engine, session_scope, transaction
from conductor.store.metrics import read_aggregates, roll_up_jobs
from conductor.store.models import JobStatus, StepAttempt, StepStatus, utcnow
from conductor.submission import JobCreate, create_job
from conductor.tasks.app import celery_config


def new_job(agent: str) -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "stale test", "workflow": {
            "model_ids": [agent], "subtasks": ["s"], "access_lists": [[]]}}), tenant="stale", settings=get_settings())
        return job.id


def test_a_worker_that_lost_its_step_adds_its_usage_and_cannot_rewrite_its_attempt() -> None:
    settings = get_settings()
    job_id = new_job("slowish")  # 1.2 s per call
    plan_job(job_id, settings=settings)

    def claim_as_stale(s: sa.orm.Session) -> tuple[int, int]:
        claim = store.claim_step_row(s, job_id=job_id, index=0, owner="stale#1", lease_s=0.01, task_id=None,
                                     count_attempt=True)
        assert claim is not None
        return claim.step_id, store.open_attempt(s, step_id=claim.step_id, n=1, worker="stale#1")

    step_id, stale_attempt = transaction(claim_as_stale)
    time.sleep(0.05)  # the stale worker's lease lapses; a new worker takes the step over
    successor = threading.Thread(target=run_step, args=(job_id, 0),
                                 kwargs={"worker": "new", "task_id": None, "settings": settings})
    successor.start()
    deadline = time.monotonic() + 30
    while True:
        with session_scope() as s:
            step = store.get_step(s, job_id=job_id, index=0)
            assert step is not None
            if (step.lease_owner or "").startswith("new#"):
                break
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # The stale worker's call returns while the new owner's is in flight: its answer is dropped, its
    # usage counted, and its attempt (closed as WorkerLost by the takeover) left as it is.
    stale = Completion(text="late", input_tokens=1000, output_tokens=500, finish_reason="stop", model="m",
                       latency_ms=5, cached_input_tokens=700, reasoning_tokens=200, cache_write_tokens=150)
    _record_success(job_id, 0, step_id, "stale#1", stale_attempt, stale,
                    {"output": "late", "input_tokens": 1000, "output_tokens": 500, "cost_usd": 0.0,
                     "cached_input_tokens": 700, "reasoning_tokens": 200, "cache_write_tokens": 150})
    successor.join(30)

    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        attempts = store.get_attempts(s, step_ids=[step_id])
        job = store.get_job(s, job_id=job_id)
    assert step is not None and job is not None
    assert step.status == StepStatus.SUCCEEDED and step.output != "late"
    own = [a for a in attempts if a.worker and a.worker.startswith("new#")]
    assert own and own[-1].error_type is None
    assert step.input_tokens > 1000 and step.output_tokens > 500  # both calls' usage: neither overwrote
    assert job.status == JobStatus.SUCCEEDED and job.input_tokens == step.input_tokens
    # ... their details too (the successor's sim call reports none): the stale call's, on the step and the job
    assert (step.cached_input_tokens, step.reasoning_tokens, step.cache_write_tokens) == (
        job.cached_input_tokens, job.reasoning_tokens, job.cache_write_tokens) == (700, 200, 150)
    first = next(a for a in attempts if a.id == stale_attempt)
    assert first.error_type == "worker_lost" and first.latency_ms is None  # not rewritten by the stale worker


def test_the_open_attempt_of_a_worker_that_died_on_an_ended_job_is_closed_when_the_job_is_folded() -> None:
    """A worker dies mid-call and its job is cancelled (before its lease lapsed or after: the chaos soak,
    bench/soak.py, met both): no re-claim closes its attempt, since the step ended with the job, and it was
    left open for ever (the API showed it running; /metrics counted it nowhere). The rollup, which folds
    such a job once ``metrics_abandoned_s`` has passed (its worker is gone), closes it as ``worker_lost``."""
    settings = get_settings()
    tenant = "stale-abandoned"
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "dies mid-call", "workflow": {
            "model_ids": ["slowish"], "subtasks": ["s"], "access_lists": [[]]}}), tenant=tenant, settings=settings)
        job_id = job.id
    plan_job(job_id, settings=settings)

    def claim_and_die(s: sa.orm.Session) -> int:
        claim = store.claim_step_row(s, job_id=job_id, index=0, owner="doomed#1", lease_s=30, task_id=None,
                                     count_attempt=True)
        assert claim is not None
        return store.open_attempt(s, step_id=claim.step_id, n=1, worker="doomed#1")

    attempt_id = transaction(claim_and_die)  # ... and the worker is SIGKILLed: nothing of it returns
    assert cancel_job(job_id)

    def attempt() -> StepAttempt:
        with session_scope() as s:
            found = s.get(StepAttempt, attempt_id)
            assert found is not None
            s.expunge(found)
            return found

    assert attempt().finished_at is None
    with session_scope() as s:  # past metrics_abandoned_s: the fold takes the job (and the suite's ended ones)
        while roll_up_jobs(s, settled_before=utcnow(), abandoned_before=utcnow(), limit=1000) == 1000:
            pass
    closed = attempt()
    assert closed.finished_at is not None and closed.error_type == "worker_lost"
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        aggregates = read_aggregates(s, tenant=tenant)
    assert job is not None and job.metrics_rolled_up_at is not None
    assert aggregates.attempts == [(tenant, "slowish", "worker_lost", 1)]


def test_a_claim_that_raises_fails_its_step_instead_of_looping() -> None:
    settings = get_settings()
    job_id = new_job("a")
    plan_job(job_id, settings=settings)
    with get_engine(settings.database_url).begin() as conn:  # a snapshot the engine cannot use
        conn.execute(sa.text("UPDATE job SET pool_config = jsonb_set(pool_config, '{agents}', "
                             "(pool_config->'agents') - 'a') WHERE id = :id"), {"id": job_id})

    run_step(job_id, 0, worker="w", task_id=None, settings=settings)  # does not raise

    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        job = store.get_job(s, job_id=job_id)
    assert step is not None and job is not None
    assert step.status == StepStatus.FAILED and step.error_type == "internal_error"
    assert job.status == JobStatus.FAILED and job.error_step == 0
    # A re-sent message finds the step ended: nothing runs again.
    assert run_step(job_id, 0, worker="w2", task_id=None, settings=settings).steps == []


def test_a_stuck_step_stops_being_renewed_after_its_longest_duration() -> None:
    settings = get_settings()
    job_id = new_job("a")
    plan_job(job_id, settings=settings)

    def claim(s: sa.orm.Session) -> int:
        got = store.claim_step_row(s, job_id=job_id, index=0, owner="stuck#1", lease_s=1.0, task_id=None,
                                   count_attempt=True)
        assert got is not None
        store.open_attempt(s, step_id=got.step_id, n=1, worker="stuck#1")
        return got.step_id

    step_id = transaction(claim)
    beat = Heartbeat(lease_s=1.0)
    with beat.holding(step_id, "stuck#1", for_s=1.5):  # the call never returns within its bound
        deadline = time.monotonic() + 30
        while (step_id, "stuck#1") in beat.held():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.2)  # one lease after the last renewal
        with session_scope() as s:
            step = store.get_step(s, job_id=job_id, index=0)
            assert step is not None and step.lease_expires_at is not None
            assert step.lease_expires_at < utcnow()  # re-claimable: the reconciler hands it on
        run_step(job_id, 0, worker="rescuer", task_id=None, settings=settings)  # what the reconciler's re-send does
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        attempts = store.get_attempts(s, step_ids=[step_id])
    assert step is not None and step.status == StepStatus.SUCCEEDED
    assert [a.error_type for a in attempts] == ["worker_lost", None]


def test_a_stuck_planning_stops_being_renewed_after_its_longest_duration() -> None:
    """A planner call that ignores its timeout must not hold its job in ``planning`` for ever: past its
    longest possible run the heartbeat leaves it, and it looks silent to the reconciler."""
    job_id = new_job("a")
    claimed = transaction(lambda s: store.claim_planning_job(s, job_id=job_id))
    assert claimed is not None
    claim = claimed[0]
    beat = Heartbeat(lease_s=0.3)
    with beat.planning(job_id, claim, for_s=1.0):  # the planner never returns within its bound
        assert beat.beat() == 1  # renewed while within it
        deadline = time.monotonic() + 30
        while (job_id, claim) in beat.plannings():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert beat.beat() == 0  # no longer renewed
        time.sleep(0.5)  # beyond the heartbeat thread's last beat (every 0.1 s)
        silent_since = utcnow()
        time.sleep(0.3)
        with session_scope() as s:  # what the reconciler looks for: it re-drives this planning
            assert job_id in store.jobs_stuck_planning(s, older_than=silent_since)
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.status == JobStatus.PLANNING and job.plan_claims == claim


def test_no_celery_time_limits_one_bound_in_the_engine() -> None:
    settings = get_settings()
    config = celery_config(settings)
    assert "task_soft_time_limit" not in config and "task_time_limit" not in config
    longest = settings.step_max_duration_s()
    attempts, policy = settings.step_max_attempts, RetryPolicy.from_settings(settings)
    # Every attempt's call and rate-limit wait, and between attempts the longest wait the policy takes: a
    # provider's 429 asking for the longest Retry-After it still honours.
    slow_down = RateLimited("429", retry_after=MAX_RETRY_AFTER_S)
    assert all(policy.should_retry(n, slow_down) for n in range(1, attempts))
    between = max(policy.delay(1, slow_down), settings.retry_backoff_max_s)
    assert longest >= attempts * (settings.provider_timeout_s + settings.rate_limit_wait_s) + (attempts - 1) * between
    assert config["broker_transport_options"]["visibility_timeout"] > longest  # type: ignore[index]
    assert settings.step_max_duration_s(900) > longest  # an agent's own longer timeout widens it

