"""The step hot path's round trips on Postgres: a step is claimed in two statements (its input with the
outputs it may see; the claim with its attempt) and recorded in three (the job-row lock; the outcome with
its attempt's close and the job's step heads; the steps it made ready). A step the worker runs next
itself is claimed inside that outcome's transaction: one transaction per hop of a chain. SQLite (embedded
mode) runs each folded statement as two or three: the store cases (tests/hot_path_cases.py) run on both."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from conductor import engine
from conductor.engine import plan_job, run_step, run_taken
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import get_engine, session_scope
from conductor.store.models import StepStatus
from conductor.submission import JobCreate, create_job
from tests.hot_path_cases import CASES, new_chain, new_dag, parent_with_a_spending_child, taker
from tests.integration.harness import backend_pid, wait_blocked_by


@pytest.fixture
def statements() -> Iterator[list[str]]:
    """Each statement this thread sends, flattened; one sent inside a psycopg pipeline is prefixed ``|``.
    (Not the heartbeat thread's: its lease renewal every ``step_lease_s / 3`` may land mid-test.)"""
    seen: list[str] = []
    mine = threading.get_ident()

    def capture(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if threading.get_ident() != mine:
            return
        piped = cursor.connection.pgconn.pipeline_status != 0  # libpq's PQ_PIPELINE_OFF
        seen.append(("|" if piped else "") + " ".join(statement.split()))

    engine = get_engine()
    sa.event.listen(engine, "before_cursor_execute", capture)
    yield seen
    sa.event.remove(engine, "before_cursor_execute", capture)


def test_a_batch_lines_middle_step_is_five_statements_too_and_its_limiter_call_knows(
        statements: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's line is told apart on the hot path without a statement more: the claim's read and the
    outcome's job-row lock carry it. Its ready step is sent at the batch priority (not claimed for the
    worker, though a taker is given), and its call waits at the rate limit as batch work."""
    settings = get_settings()
    job_id = new_chain(3)
    with session_scope() as s:
        s.execute(sa.update(store.JOB).where(store.JOB.c.id == job_id).values(batch_id="batch_round_trips"))
    asked: list[tuple[str, bool]] = []
    real = engine.wait_for_rate_limit

    def spy(agent: str, rpm: int | None, settings: Any, *, tenant: str, **kwargs: Any) -> None:
        asked.append((tenant, bool(kwargs.get("background"))))
        real(agent, rpm, settings, tenant=tenant, **kwargs)

    monkeypatch.setattr(engine, "wait_for_rate_limit", spy)
    plan_job(job_id, settings=settings)
    run_step(job_id, 0, worker="trips", task_id=None, settings=settings)
    statements.clear()

    ready = run_step(job_id, 1, worker="trips", task_id=None, settings=settings, take=taker())

    assert ready.steps == [(job_id, 2)] and ready.taken is None and ready.background == {job_id}
    assert [s.split(" ")[0] for s in statements] == ["SELECT", "WITH", "|SELECT", "|WITH", "|UPDATE"], statements
    assert asked == [("trips", True), ("trips", True)]


def test_a_middle_step_is_five_statements_in_two_transactions(statements: list[str]) -> None:
    settings = get_settings()
    job_id = new_chain(3)
    plan_job(job_id, settings=settings)
    run_step(job_id, 0, worker="trips", task_id=None, settings=settings)
    statements.clear()

    ready = run_step(job_id, 1, worker="trips", task_id=None, settings=settings)

    assert ready.steps == [(job_id, 2)]
    kinds = [s.split(" ")[0] for s in statements]
    assert len(statements) == 5, statements
    # The job-row lock and the outcome go in one pipeline, and so does the marking (with the COMMIT): the
    # lock is never held across a client round trip but the one that reads the outcome's step heads.
    assert kinds == ["SELECT", "WITH", "|SELECT", "|WITH", "|UPDATE"], statements
    assert "jsonb_agg" in statements[0]  # the visible outputs ride on the input's read
    # The unstarted count's status test is a FILTER, which no plan can turn into an index condition: as
    # a WHERE, Postgres's generic plan (the statement is prepared) once ANDed the job's index with the
    # status index and read every queued step's entries (2.6 ms at 45,000 steps, growing with the table).
    assert "count(*) FILTER (WHERE other.status" in statements[0], statements[0]
    assert "INSERT INTO step_attempt" in statements[1]  # the claim opens its attempt
    assert "FOR NO KEY UPDATE" in statements[2]
    assert "UPDATE step_attempt" in statements[3] and "UPDATE step SET" in statements[3]
    assert "UNION ALL" in statements[3]  # the step heads read back in the same statement
    assert "= ANY (" in statements[4]  # the ready steps as one array parameter
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=1)
        first = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.id is not None and first is not None
        attempts = store.get_attempts(s, step_ids=[step.id])
    assert step.status == StepStatus.SUCCEEDED and step.attempts == 1
    assert [(a.n, a.error_type) for a in attempts] == [(1, None)]
    assert attempts[0].finished_at is not None and attempts[0].latency_ms is not None
    assert attempts[0].worker == step.lease_owner  # the claim's owner opened it
    contents = [m["content"] for m in step.messages or []]
    assert contents[-3:] == ["part 0", first.output, "part 1"]  # step 0's turn, seen through the access list


@pytest.fixture
def commits() -> Iterator[list[str]]:
    """Each commit this thread makes (not the heartbeat thread's lease renewals, which may land mid-test:
    counted, they failed a run on a slow machine)."""
    seen: list[str] = []
    mine = threading.get_ident()

    def on_commit(conn: Any) -> None:
        if threading.get_ident() == mine:
            seen.append("COMMIT")

    engine_ = get_engine()
    sa.event.listen(engine_, "commit", on_commit)
    yield seen
    sa.event.remove(engine_, "commit", on_commit)


def test_a_step_run_next_by_the_same_slot_is_claimed_in_the_outcome_that_made_it_ready(
    statements: list[str], commits: list[str]
) -> None:
    settings = get_settings()
    job_id = new_chain(3)
    take = taker()
    due = plan_job(job_id, settings=settings, take=take)
    assert due.taken is not None
    statements.clear()
    commits.clear()

    due = run_taken(due.taken, settings=settings, take=take)  # step 0's call and outcome, claiming step 1

    assert due.steps == [] and due.taken is not None and due.taken.index == 1
    kinds = [s.split(" ")[0] for s in statements]
    assert kinds == ["|SELECT", "|WITH", "UPDATE", "SELECT", "WITH"], statements  # the claim follows the marking
    assert "FOR NO KEY UPDATE" in statements[0] and "= ANY (" in statements[2]
    assert "jsonb_agg" in statements[3] and "INSERT INTO step_attempt" in statements[4]
    assert commits == ["COMMIT"]  # one transaction for the outcome of one step and the claim of the next

    statements.clear()
    commits.clear()
    # A message for step 1 all the same (a redelivery): its lease is live, the claim matches no row.
    assert not run_step(job_id, 1, worker="other", task_id=None, settings=settings)
    assert len(statements) == 2 and commits == ["COMMIT"]
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=1)
    assert step is not None and step.status == StepStatus.RUNNING and str(step.lease_owner).startswith("taker#")


def test_a_claim_that_raises_inside_an_outcome_leaves_the_step_to_be_sent(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings = get_settings()
    job_id = new_chain(2)
    take = taker()
    due = plan_job(job_id, settings=settings, take=take)
    assert due.taken is not None
    real = engine._claim

    def broken(s: Any, job: str, index: int, **kw: Any) -> Any:
        if index == 1:
            raise RuntimeError("a bug in rendering step 1")
        return real(s, job, index, **kw)

    monkeypatch.setattr(engine, "_claim", broken)
    due = run_taken(due.taken, settings=settings, take=take)

    assert due.taken is None and due.steps == [(job_id, 1)]  # the outcome recorded again, without the claim
    assert "claiming a ready step with step 0's outcome raised RuntimeError" in caplog.text
    with session_scope() as s:
        steps = store.get_steps(s, job_id=job_id)
    assert [(st.status, st.lease_owner is None) for st in steps] == [("succeeded", False), ("queued", True)]


def test_of_two_parents_of_a_join_recording_together_the_second_sees_the_first() -> None:
    """The outcome's lock and record are pipelined; the record's snapshot still starts after the lock, so
    the parent that waited on the job row sees the other's outcome and is the one that marks the join."""
    settings = get_settings()
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "join", "workflow": {
            "model_ids": ["a"] * 3, "subtasks": ["x", "y", "z"], "access_lists": [[], [], [0, 1]]}}),
            tenant="trips", settings=settings)
    plan_job(job.id, settings=settings)
    claims = [transaction_claim(job.id, i, f"parent{i}#1") for i in (0, 1)]

    def record(s: Any, i: int) -> tuple[Any, bool, list[store.StepHead]]:
        step_id, attempt_id = claims[i]
        return store.lock_job_and_record(s, job_id=job.id, step_id=step_id, owner=f"parent{i}#1",
                                         to=StepStatus.SUCCEEDED, closing=store.AttemptEnd(attempt_id, 1),
                                         output=f"answer {i}")

    second: list[tuple[Any, bool, list[store.StepHead]]] = []
    with session_scope() as first:
        head, recorded, heads = record(first, 0)  # holds the job row's lock until this session commits
        assert head is not None and head.status == "running" and recorded
        assert [h.status for h in heads] == ["succeeded", "running", "pending"]

        def other() -> None:
            with session_scope() as s:
                second.append(record(s, 1))

        racer = threading.Thread(target=other)
        racer.start()
        racer.join(1.0)
        assert racer.is_alive() and second == []  # waiting on the lock, its record not yet run
    racer.join(30)
    (_, recorded, heads), = second
    assert recorded and [h.status for h in heads] == ["succeeded", "succeeded", "pending"]


def transaction_claim(job_id: str, index: int, owner: str) -> tuple[int, int]:
    with session_scope() as s:
        claim = store.claim_step_row(s, job_id=job_id, index=index, owner=owner, lease_s=60.0, task_id=None,
                                     count_attempt=True, open_below=4)
    assert claim is not None and claim.attempt_id is not None
    return claim.step_id, claim.attempt_id


def test_marking_with_the_commit_ends_the_transaction_at_once() -> None:
    settings = get_settings()
    job_id = new_chain(2)
    plan_job(job_id, settings=settings)
    run_step(job_id, 0, worker="w", task_id=None, settings=settings)
    with session_scope() as s:
        store.update_step(s, step_id=_step_id(job_id, 1), status=StepStatus.PENDING, queued_at=None)
    with session_scope() as holder:
        assert store.lock_job(holder, job_id=job_id) is not None
        assert store.mark_steps_queued(holder, job_id=job_id, indices=[1], commit=True) == [1]
        with session_scope() as other:  # before the holder's session ends: committed, the lock released
            other.execute(sa.text("SET LOCAL lock_timeout = '2s'"))  # held still, this fails instead of hanging
            assert store.lock_job(other, job_id=job_id) is not None
            step = store.get_step(other, job_id=job_id, index=1)
            assert step is not None and step.status == StepStatus.QUEUED


def _step_id(job_id: str, index: int) -> int:
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=index)
    assert step is not None and step.id is not None
    return step.id


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_store_case_on_postgres(case: Callable[[], None]) -> None:
    case()


def test_planning_is_three_statements_and_inserts_its_roots_queued(statements: list[str]) -> None:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "plan trips", "workflow": {
            "model_ids": ["a", "a", "a"], "subtasks": ["x", "y", "z"], "access_lists": [[], [], [0, 1]]}}),
            tenant="trips", settings=get_settings())
    statements.clear()

    dispatch = plan_job(job.id, settings=get_settings())

    assert dispatch.steps == [(job.id, 0), (job.id, 1)] and dispatch.agents == {(job.id, 0): "a", (job.id, 1): "a"}
    assert [s.split(" ")[0] for s in statements] == ["UPDATE", "UPDATE", "INSERT"], statements
    assert "RETURNING job.plan_claims, job.id, job.tenant" in statements[0]  # the claim reads the job back
    with session_scope() as s:
        steps = store.get_steps(s, job_id=job.id)
        stored = store.get_job(s, job_id=job.id)
    assert stored is not None and stored.status == "running" and stored.plan_claims == 1
    assert [(st.status, st.queued_at is not None) for st in steps] == [("queued", True), ("queued", True),
                                                                       ("pending", False)]



def test_roots_claimed_with_the_plan_cost_one_statement_in_all(statements: list[str], commits: list[str]) -> None:
    job_id = new_dag([[], [], [], [0, 1, 2]])
    statements.clear()
    commits.clear()

    due = plan_job(job_id, settings=get_settings(), take=taker(spare=1))

    assert due.taken is not None and [t.index for t in due.alongside] == [1] and due.steps == [(job_id, 2)]
    kinds = [" ".join(s.split(" ")[:3]) for s in statements]
    assert kinds == ["UPDATE job SET", "UPDATE job SET", "INSERT INTO step", "INSERT INTO step_attempt"], statements
    assert commits == ["COMMIT", "COMMIT"]  # the planning claim's, then the plan's with its roots' claims
    with session_scope() as s:
        steps = store.get_steps(s, job_id=job_id)
        attempts = store.get_attempts(s, step_ids=[st.id for st in steps if st.id is not None])
    assert [st.status for st in steps] == ["running", "running", "queued", "pending"]
    assert [(a.step_id, a.n, a.worker) for a in attempts] == [(st.id, 1, st.lease_owner) for st in steps[:2]]
    assert [a.attempt_id for a in (due.taken.claim, due.alongside[0].claim)] == [a.id for a in attempts]  # type: ignore[union-attr]


def test_a_root_whose_claim_raises_with_the_plan_is_sent_instead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = new_chain(2)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug in rendering a root")

    monkeypatch.setattr(engine, "_render", broken)
    due = plan_job(job_id, settings=get_settings(), take=taker())

    assert due.taken is None and due.steps == [(job_id, 0)]  # the plan recorded again, without the claim
    assert "claiming a root step with the plan raised RuntimeError" in caplog.text
    with session_scope() as s:
        steps = store.get_steps(s, job_id=job_id)
    assert [(st.status, st.attempts) for st in steps] == [("queued", 0), ("pending", 0)]


def test_sending_a_dispatch_whose_step_was_claimed_for_the_slot_says_it_was_not_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from conductor.tasks.send import send

    settings = get_settings()
    job_id = new_chain(1)
    due = plan_job(job_id, settings=settings, take=taker())
    assert due.taken is not None
    send(due)  # a caller that does not run it: nothing is published, and the log says what happens next
    assert f"step {job_id}/0 was claimed for this slot but is not run by it" in caplog.text
    assert "re-runs when its lease expires" in caplog.text


def test_the_end_of_a_job_without_a_webhook_writes_no_outbox_row(statements: list[str]) -> None:
    settings = get_settings()
    job_id = new_chain(1)
    plan_job(job_id, settings=settings)
    statements.clear()

    ended = run_step(job_id, 0, worker="w", task_id=None, settings=settings)  # the last step: finalizes inline

    assert ended.webhooks == []
    assert not [st for st in statements if "webhook_delivery" in st], statements  # not even a conditional insert
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.status == "succeeded" and job.webhook_url is None


def test_a_parent_ending_while_its_child_settles_its_step_sums_the_childs_spend() -> None:
    """The child's end settles the parent's recursive step under the child's row lock, not the parent's.
    A parent cancelled at that moment closes its steps before summing them: closing waits for the
    settling transaction, so the sum sees the child's spend (summing first read the step's old version,
    and the totals stayed short for good)."""
    parent_id, child_id, spent = parent_with_a_spending_child()
    cancelled: list[bool] = []
    with session_scope() as s:  # the child ends (as its last outcome would), not yet committed
        head = store.lock_job(s, job_id=child_id)
        assert head is not None
        carry: list[Any] = []
        assert engine._finalize(s, head, store.step_heads(s, job_id=child_id), "the child's answer", carry)
        assert carry == []  # the step was running: settled here
        canceller = threading.Thread(target=lambda: cancelled.append(engine.cancel_job(parent_id)))
        canceller.start()
        wait_blocked_by(backend_pid(s))  # the cancel is now waiting on the step row this transaction holds
    canceller.join(timeout=30)
    assert cancelled == [True]
    with session_scope() as s:
        parent = store.get_job(s, job_id=parent_id)
        step = store.get_step(s, job_id=parent_id, index=0)
    assert step is not None and step.status == StepStatus.SUCCEEDED and step.output == "the child's answer"
    assert parent is not None and parent.status == "cancelled"
    assert (parent.input_tokens, parent.output_tokens, parent.cost_usd) == spent


def test_a_cancel_and_a_recursive_steps_claim_do_not_deadlock() -> None:
    """A recursive step's claim holds its step row and inserts the child job, whose foreign key check
    takes a key-share lock on the parent's row; a cancel holds the parent's row and closes that step.
    With the job row locked ``FOR UPDATE`` the two waited on each other (Postgres aborted one as a
    deadlock); ``FOR NO KEY UPDATE`` lets the insert through."""
    settings = get_settings()
    parent_id = new_chain(1, "conductor")
    plan_job(parent_id, settings=settings)
    outcome: list[object] = []

    def cancel() -> None:
        try:
            outcome.append(engine.cancel_job(parent_id))
        except Exception as exc:  # a deadlock victim
            outcome.append(exc)

    with session_scope() as claim:
        claim.execute(sa.text("UPDATE step SET lease_owner = 'claimer' WHERE job_id = :j AND index = 0"),
                      {"j": parent_id})  # the claim's hold on the step row
        canceller = threading.Thread(target=cancel)
        canceller.start()
        wait_blocked_by(backend_pid(claim))  # the cancel holds the parent's row and waits for the step row
        # What inserting the child job runs (Postgres's foreign key check on job.parent_job_id):
        claim.execute(sa.text("SELECT 1 FROM job WHERE id = :j FOR KEY SHARE"), {"j": parent_id})
    canceller.join(timeout=30)
    assert outcome == [True]
