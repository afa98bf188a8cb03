"""Cases of the step hot path's store functions, run on Postgres (tests/integration/test_round_trips.py),
where each folded statement is one round trip, and on SQLite (tests/unit/test_engine_inprocess.py), where
it is two: both must leave the same rows. Each runs against the database the settings point at, with a
pool that has a ``sim`` agent ``a``."""

from __future__ import annotations

from typing import Any

from conductor.engine import plan_job, run_step
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope, transaction
from conductor.store.models import StepStatus, utcnow
from conductor.submission import JobCreate, create_job


def new_chain(steps: int, agent: str = "a") -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "round trips", "workflow": {
            "model_ids": [agent] * steps, "subtasks": [f"part {i}" for i in range(steps)],
            "access_lists": [[i - 1] if i else [] for i in range(steps)]}}), tenant="trips",
            settings=get_settings())
        return job.id


def the_read_returns_what_the_separate_outputs_query_returns() -> None:
    settings = get_settings()
    job_id = new_chain(3)
    plan_job(job_id, settings=settings)
    run_step(job_id, 0, worker="trips", task_id=None, settings=settings)
    run_step(job_id, 1, worker="trips", task_id=None, settings=settings)
    with session_scope() as s:  # step 2 may see both; step 0's answer is emptied to check NULL handling
        first_step, last_step = store.get_step(s, job_id=job_id, index=0), store.get_step(s, job_id=job_id, index=2)
        assert first_step is not None and first_step.id is not None
        assert last_step is not None and last_step.id is not None
        store.update_step(s, step_id=first_step.id, output=None)
        store.update_step(s, step_id=last_step.id, access_list=[1, 0])

    def read(s: Any) -> tuple[Any, Any]:
        row = store.read_step_input(s, job_id=job_id, index=2)
        assert row is not None
        return row.visible, store.visible_outputs(s, job_id=job_id, indices=row.access_list)

    folded, separate = transaction(read)
    assert folded == separate == [("part 0", ""), ("part 1", "[a] part 1")]

    def read_first(s: Any) -> Any:
        return store.read_step_input(s, job_id=job_id, index=0)

    first = transaction(read_first)
    assert first is not None and first.visible == [] and first.access_list == []


def the_claim_opens_no_attempt_at_the_cap_and_keeps_its_own_when_closing_lost_ones() -> None:
    settings = get_settings()
    job_id = new_chain(1)
    plan_job(job_id, settings=settings)

    def claim(owner: str, lease_s: float, below: int) -> Any:
        return transaction(lambda s: store.claim_step_row(
            s, job_id=job_id, index=0, owner=owner, lease_s=lease_s, task_id=None, count_attempt=True,
            open_below=below))

    first = claim("dies#1", 0.0, 2)  # a lease that lapses at once: the worker "died"
    assert first is not None and first.attempts == 0 and first.attempt_id is not None
    second = claim("rescuer#1", 60.0, 2)
    assert second is not None and second.attempts == 1 and second.attempt_id is not None
    assert transaction(lambda s: store.close_lost_attempts(s, step_id=second.step_id, keep=second.attempt_id)) == 1
    with session_scope() as s:
        attempts = store.get_attempts(s, step_ids=[second.step_id])
    assert [(a.n, a.error_type, a.finished_at is None) for a in attempts] == [(1, "worker_lost", False),
                                                                             (2, None, True)]
    with session_scope() as s:  # the rescuer's lease lapses too; a third claim is past a cap of 2
        store.update_step(s, step_id=second.step_id, lease_expires_at=utcnow())
    third = claim("late#1", 60.0, 2)
    assert third is not None and third.attempts == 2 and third.attempt_id is None
    with session_scope() as s:
        assert len(store.get_attempts(s, step_ids=[second.step_id])) == 2


def recording_closes_the_attempt_only_if_still_open() -> None:
    settings = get_settings()
    job_id = new_chain(1)
    plan_job(job_id, settings=settings)
    claimed = transaction(lambda s: store.claim_step_row(
        s, job_id=job_id, index=0, owner="rec#1", lease_s=60.0, task_id=None, count_attempt=True, open_below=4))
    assert claimed is not None and claimed.attempt_id is not None
    attempt_id = claimed.attempt_id
    end = store.AttemptEnd(attempt_id, 17, error_type="server_error", error="boom")
    # Another claim's owner records nothing, but the attempt is still closed (as finish_attempt did).
    assert not transaction(lambda s: store.record_step(s, step_id=claimed.step_id, owner="other#1",
                                                       to=StepStatus.FAILED, closing=end, error="x"))
    again = store.AttemptEnd(attempt_id, 99)
    assert transaction(lambda s: store.record_step(s, step_id=claimed.step_id, owner="rec#1",
                                                   to=StepStatus.FAILED, closing=again, error="boom"))
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        (attempt,) = store.get_attempts(s, step_ids=[claimed.step_id])
    assert step is not None and step.status == StepStatus.FAILED and step.error == "boom"
    assert (attempt.latency_ms, attempt.error_type, attempt.error) == (17, "server_error", "boom")  # first close kept


def recording_returns_the_heads_with_this_step_as_recorded() -> None:
    settings = get_settings()
    job_id = new_chain(3)
    plan_job(job_id, settings=settings)
    run_step(job_id, 0, worker="trips", task_id=None, settings=settings)
    claimed = transaction(lambda s: store.claim_step_row(
        s, job_id=job_id, index=1, owner="heads#1", lease_s=60.0, task_id=None, count_attempt=True, open_below=4))
    assert claimed is not None and claimed.attempt_id is not None
    end = store.AttemptEnd(claimed.attempt_id, 5)

    def record(owner: str) -> Any:
        def body(s: Any) -> Any:
            assert store.lock_job(s, job_id=job_id) is not None
            return store.record_step_and_heads(s, job_id=job_id, step_id=claimed.step_id, owner=owner,
                                               to=StepStatus.SUCCEEDED, closing=end, output="one",
                                               input_tokens=7, output_tokens=3, cost_usd=0.5)
        return transaction(body)

    assert record("someone-else#1") == (False, [])  # taken over: nothing recorded, no heads
    recorded, heads = record("heads#1")
    assert recorded
    assert [(h.index, h.status) for h in heads] == [(0, "succeeded"), (1, "succeeded"), (2, "pending")]
    with session_scope() as s:
        expected = store.step_heads(s, job_id=job_id)  # what a separate read after the commit sees
        (attempt,) = store.get_attempts(s, step_ids=[claimed.step_id])
    assert heads == expected
    assert (heads[1].input_tokens, heads[1].output_tokens, heads[1].cost_usd) == (7, 3, 0.5)
    assert attempt.finished_at is not None and attempt.latency_ms == 5
    again, heads = record("heads#1")  # a retried transaction whose first commit landed: usage added once
    assert again and heads == expected


CASES = (
    the_read_returns_what_the_separate_outputs_query_returns,
    the_claim_opens_no_attempt_at_the_cap_and_keeps_its_own_when_closing_lost_ones,
    recording_closes_the_attempt_only_if_still_open,
    recording_returns_the_heads_with_this_step_as_recorded,
)
