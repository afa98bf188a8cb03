"""Engine transitions on a real Postgres, driven directly (no broker): the cases a fault test cannot
stage on demand — a step whose worker keeps dying, a planner whose claim was superseded."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import sqlalchemy as sa

from conductor.chat import completion
from conductor.engine import cancel_job, fail_job, plan_job, run_step
from conductor.errors import ErrorType
from conductor.reconcile import reconcile_once
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import get_engine, session_scope
from conductor.store.models import JobStatus, StepAttempt, StepStatus, utcnow
from conductor.submission import JobCreate, create_job
from tests.integration.harness import backend_pid, wait_blocked_by


def new_job(**body: object) -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "engine test", **body}), tenant="engine",
                            settings=get_settings())
        return job.id


def test_a_step_whose_worker_keeps_dying_fails_instead_of_running_forever() -> None:
    settings = get_settings()
    job_id = new_job(workflow={"model_ids": ["a"], "subtasks": ["s"], "access_lists": [[]]})
    assert plan_job(job_id, settings=settings).steps == [(job_id, 0)]
    with session_scope() as s:  # what `step_max_attempts` crashed workers leave behind
        step = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.id is not None
        for n in range(1, settings.step_max_attempts + 1):
            s.add(StepAttempt(step_id=step.id, n=n, worker="dead", finished_at=None if n == 4 else utcnow(),
                              error_type=None if n == 4 else "worker_lost"))
        store.update_step(s, step_id=step.id, status=StepStatus.RUNNING, attempts=settings.step_max_attempts,
                          lease_owner="dead#1", lease_expires_at=utcnow() - timedelta(seconds=1))

    run_step(job_id, 0, worker="rescuer", task_id=None, settings=settings)

    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        step = store.get_step(s, job_id=job_id, index=0)
        assert job is not None and step is not None and step.id is not None
        attempts = store.get_attempts(s, step_ids=[step.id])
    assert step.status == StepStatus.FAILED and step.error_type == "step_abandoned"
    assert job.status == JobStatus.FAILED and "gave up after 4 attempts" in (job.error_message or "")
    assert len(attempts) == 4 and all(a.finished_at is not None for a in attempts)  # no new call was made
    assert attempts[-1].error_type == "worker_lost"


def test_a_superseded_planner_cannot_fail_the_job_its_successor_started() -> None:
    settings = get_settings()
    job_id = new_job(planner="template:single")
    with session_scope() as s:
        claimed = store.claim_planning_job(s, job_id=job_id)  # planner A takes it, then looks dead
        assert claimed is not None and claimed[1].id == job_id
        first = claimed[0]
        assert first == 1
        assert store.transition_job(s, job_id=job_id, from_=[JobStatus.PLANNING], to=JobStatus.QUEUED)
    assert plan_job(job_id, settings=settings).steps == [(job_id, 0)]  # planner B, claim 2
    fail_job(job_id, error_type=ErrorType.PLANNER_ERROR, message="A's late failure", plan_claim=first)
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.status == JobStatus.RUNNING and job.plan_claims == 2


def test_planning_that_never_finishes_is_capped() -> None:
    settings = get_settings()
    job_id = new_job(planner="template:single")
    with get_engine(settings.database_url).begin() as conn:
        conn.execute(sa.text("UPDATE job SET plan_claims = :n WHERE id = :id"),
                     {"n": settings.step_max_attempts, "id": job_id})
    plan_job(job_id, settings=settings)
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.status == JobStatus.FAILED and job.error_type == "worker_lost"
        assert store.get_steps(s, job_id=job_id) == []


def test_a_long_worker_name_still_fits_the_claim_columns() -> None:
    settings = get_settings()
    job_id = new_job(workflow={"model_ids": ["b"], "subtasks": ["s"], "access_lists": [[]]})
    plan_job(job_id, settings=settings)
    run_step(job_id, 0, worker="celery@" + "h" * 300, task_id=None, settings=settings)
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.status == StepStatus.SUCCEEDED and len(step.lease_owner or "") <= 128


def test_a_new_job_row_binds_few_enough_parameters_for_psycopg_to_cache_its_query() -> None:
    """The job insert leaves None columns out: psycopg re-parses a query of more than 50 parameters on
    every execution. The stored row is the job as built, null columns included."""
    seen: list[int] = []

    def capture(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if statement.startswith("INSERT INTO job "):
            seen.append(len(parameters))

    engine = get_engine()
    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        with session_scope() as s:
            job, _ = create_job(s, JobCreate.model_validate({
                "task": "a typical job", "metadata": {"k": "v"}, "webhook_url": "https://example.com/hook",
                "limits": {"max_cost_usd": 1.0}}), tenant="engine", settings=get_settings(),
                idempotency_key="params-1")
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)
    assert len(seen) == 1 and 0 < seen[0] <= 50
    with session_scope() as s:
        stored = store.get_job(s, job_id=job.id)
    assert stored is not None
    assert (stored.tenant, stored.task, stored.meta, stored.webhook_url, stored.idempotency_key) == (
        "engine", "a typical job", {"k": "v"}, "https://example.com/hook", "params-1")
    assert stored.limits["max_cost_usd"] == 1.0 and stored.answer is None and stored.batch_id is None
    assert stored.status == JobStatus.QUEUED and stored.plan_claims == 0 and stored.created_at == job.created_at


@pytest.mark.parametrize("end", ["cancel", "fail"])
def test_a_job_ended_while_an_outcome_commits_counts_that_outcomes_usage(end: str) -> None:
    """An outcome holds the job row's lock while it records a step's usage; a cancel (or a failure) ending
    the job meanwhile waits for it, so the job's totals include that step's tokens and cost."""
    settings = get_settings()
    job_id = new_job(workflow={"model_ids": ["a", "a"], "subtasks": ["x", "y"], "access_lists": [[], []]})
    assert len(plan_job(job_id, settings=settings).steps) == 2
    locked, release = threading.Event(), threading.Event()
    pids: list[int] = []

    def outcome() -> None:  # what an outcome transaction does first: lock the job row, record the step
        with session_scope() as s:
            store.lock_job(s, job_id=job_id)
            step = store.get_step(s, job_id=job_id, index=0)
            assert step is not None and step.id is not None
            store.update_step(s, step_id=step.id, status=StepStatus.SUCCEEDED, input_tokens=1000,
                              output_tokens=500, cost_usd=0.25, finished_at=utcnow())
            pids.append(backend_pid(s))
            locked.set()
            release.wait(30)

    def ending() -> None:
        if end == "cancel":
            cancel_job(job_id)
        else:
            fail_job(job_id, error_type=ErrorType.STEP_FAILED, message="step 1 failed", step=1)

    recording, ender = threading.Thread(target=outcome), threading.Thread(target=ending)
    recording.start()
    assert locked.wait(30)
    ender.start()
    wait_blocked_by(pids[0])  # it reached the job row's lock and waits there (the outcome holds it)
    release.set()
    recording.join()
    ender.join()
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
    assert job is not None and job.status in (JobStatus.CANCELLED, JobStatus.FAILED)
    assert (job.input_tokens - job.planner_input_tokens, job.output_tokens - job.planner_output_tokens) == (1000, 500)
    assert job.cost_usd == pytest.approx(job.planner_cost_usd + 0.25)


def test_a_dead_workers_step_is_re_sent_once_per_expiry_not_at_every_pass() -> None:
    settings = get_settings()
    job_id = new_job(workflow={"model_ids": ["a"], "subtasks": ["s"], "access_lists": [[]]})
    plan_job(job_id, settings=settings)

    def examined_first() -> None:  # the pass examines the least recently examined running jobs first
        with get_engine(settings.database_url).begin() as conn:
            conn.execute(sa.text("UPDATE job SET updated_at = :t WHERE id = :id"),
                         {"t": utcnow() - timedelta(days=3650), "id": job_id})

    with session_scope() as s:  # its worker claimed it, then died: the lease ran out
        step = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.id is not None
        store.update_step(s, step_id=step.id, status=StepStatus.RUNNING, lease_owner="dead#1",
                          lease_expires_at=utcnow() - timedelta(seconds=1))
    sent = []
    for _ in range(3):
        examined_first()
        _, dispatch = reconcile_once(settings)
        sent.append((job_id, 0) in dispatch.steps)
    assert sent == [True, False, False]  # at once, then not again before the backoff
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.resends == 1 and step.resent_at is not None
        assert step.lease_expires_at is not None
        back = timedelta(seconds=settings.reconcile_stale_s)  # its backoff has passed, still unclaimed
        store.update_step(s, step_id=step.id, resent_at=step.resent_at - back,
                          lease_expires_at=step.lease_expires_at - back)
    examined_first()
    assert (job_id, 0) in reconcile_once(settings)[1].steps


def test_an_answer_cut_at_its_token_limit_is_a_chat_completion_finishing_with_length() -> None:
    """The cost budget leaves the last step room for about 70 output tokens of the ~120 its answer
    needs: the sim agent stops there, as a provider does, with finish_reason ``length``."""
    settings = get_settings()
    ids = {}
    for name, limits in (("cut", {"max_cost_usd": 0.0003}), ("whole", {})):
        ids[name] = new_job(workflow={"model_ids": ["b", "a"], "subtasks": ["first", "Say hello at length. " * 20],
                                      "access_lists": [[], []]}, limits=limits)
        plan_job(ids[name], settings=settings)
        run_step(ids[name], 0, worker="w", task_id=None, settings=settings)
        run_step(ids[name], 1, worker="w", task_id=None, settings=settings)
    with session_scope() as s:
        reasons = store.answer_finish_reasons(s, job_ids=list(ids.values()))
        jobs = {name: store.get_job(s, job_id=job_id) for name, job_id in ids.items()}
    assert reasons == {ids["cut"]: "length", ids["whole"]: "stop"}
    batch_id = f"batch_reasons_{ids['cut']}"  # a batch's output file reads them for all its lines at once
    with get_engine(settings.database_url).begin() as conn:
        conn.execute(sa.text("UPDATE job SET batch_id = :b WHERE id IN (:c, :w)"),
                     {"b": batch_id, "c": ids["cut"], "w": ids["whole"]})
    with session_scope() as s:
        assert store.answer_finish_reasons(s, batch_id=batch_id) == reasons
    for name, job in jobs.items():
        assert job is not None and job.status == JobStatus.SUCCEEDED
        reply = completion(job, "conductor", reasons[job.id])
        assert reply.choices[0].finish_reason == ("length" if name == "cut" else "stop")
        assert reply.choices[0].message.content == job.answer
    assert len(jobs["cut"].answer or "") < len(jobs["whole"].answer or "")
    # A recursive last step answers with its child job's answer: the child's reason, two levels down.
    parents = []
    for child in (ids["cut"], None):
        parent = new_job(workflow={"model_ids": ["a"], "subtasks": ["delegate"], "access_lists": [[]]})
        plan_job(parent, settings=settings)
        with session_scope() as s:
            step = store.get_step(s, job_id=parent, index=0)
            assert step is not None and step.id is not None
            store.update_step(s, step_id=step.id, status=StepStatus.SUCCEEDED, finish_reason="child_succeeded",
                              child_job_id=child or parents[0])
        parents.append(parent)
    with session_scope() as s:
        assert store.answer_finish_reasons(s, job_ids=parents) == {parents[0]: "length", parents[1]: "length"}
