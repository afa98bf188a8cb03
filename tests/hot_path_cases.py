"""Cases of the step hot path's store functions, run on Postgres (tests/integration/test_round_trips.py),
where each folded statement is one round trip, and on SQLite (tests/unit/test_engine_inprocess.py), where
it is two: both must leave the same rows. Each runs against the database the settings point at, with a
pool that has a ``sim`` agent ``a``."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from conductor import engine
from conductor.engine import Taker, plan_job, run_step, run_taken
from conductor.planning.planner import make_plan
from conductor.replay import step_rows
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope, transaction
from conductor.store.models import JobStatus, StepStatus, utcnow
from conductor.submission import JobCreate, create_job


def new_chain(steps: int, agent: str = "a", **extra: Any) -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "round trips", "workflow": {
            "model_ids": [agent] * steps, "subtasks": [f"part {i}" for i in range(steps)],
            "access_lists": [[i - 1] if i else [] for i in range(steps)]}, **extra}), tenant="trips",
            settings=get_settings())
        return job.id


def new_dag(access_lists: list[list[int]], agent: str = "a", **extra: Any) -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "round trips", "workflow": {
            "model_ids": [agent] * len(access_lists), "subtasks": [f"part {i}" for i in range(len(access_lists))],
            "access_lists": access_lists}, **extra}), tenant="trips", settings=get_settings())
        return job.id


def taker(runs: bool = True, spare: int = 0) -> Taker:
    """A worker slot that takes every step of agent ``a`` (or, with ``runs=False``, none), with ``spare``
    local slots for steps beside it."""
    return Taker(worker="taker", task_id="task-1", settings=get_settings(),
                 runs=lambda _job, _index, agent: runs and agent == "a", spare=lambda: spare, beside="side")


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


def the_read_returns_every_steps_agent_and_access_list() -> None:
    """``StepInput.workflow`` (where prompt prefixes are shared: ``context.cache_points``): folded into the
    read on Postgres, a query of its own on SQLite; by index."""
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "workflow", "workflow": {
            "model_ids": ["a", "b", "a", "a"], "subtasks": ["p0", "p1", "p2", "p3"],
            "access_lists": [[], [], [0], [1, 0, 2]]}}), tenant="trips", settings=get_settings())
    plan_job(job.id, settings=get_settings())

    def read(s: Any, index: int) -> tuple[int, list[tuple[str, list[int], bool]]]:
        row = store.read_step_input(s, job_id=job.id, index=index)
        assert row is not None
        return row.index, [(step.agent, sorted(step.access_list), step.reused) for step in row.workflow]

    expected = [("a", [], False), ("b", [], False), ("a", [0], False), ("a", [0, 1, 2], False)]
    assert transaction(lambda s: read(s, 2)) == (2, expected)
    assert transaction(lambda s: read(s, 1)) == (1, expected)


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


def an_outcome_claims_the_step_it_made_ready_for_its_taker() -> None:
    settings = get_settings()
    job_id = new_chain(3)
    take = taker()
    due = plan_job(job_id, settings=settings, take=take)
    assert due.steps == [] and due.taken is not None and due.taken.index == 0  # claimed by the plan, not sent
    with session_scope() as s:
        first = store.get_step(s, job_id=job_id, index=0)
        assert first is not None and first.id is not None
        (attempt,) = store.get_attempts(s, step_ids=[first.id])
    assert first.status == StepStatus.RUNNING and first.attempts == 1
    assert first.lease_owner is not None and first.lease_owner.startswith("taker#")
    assert first.celery_task_id == "task-1" and attempt.worker == first.lease_owner and attempt.finished_at is None
    for index in (1, 2):
        due = run_taken(due.taken, settings=settings, take=take)
        assert due.steps == [] and due.taken is not None and due.taken.index == index
        with session_scope() as s:  # the claim read the step's input after the outcome, in its transaction
            step = store.get_step(s, job_id=job_id, index=index)
            before = store.get_step(s, job_id=job_id, index=index - 1)
        assert step is not None and before is not None and before.status == StepStatus.SUCCEEDED
        assert step.status == StepStatus.RUNNING and step.started_at is not None
        assert [m["content"] for m in step.messages or []][-3:] == [f"part {index - 1}", before.output,
                                                                     f"part {index}"]
    ended = run_taken(due.taken, settings=settings, take=take)
    assert ended.taken is None and ended.steps == []
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        steps = store.get_steps(s, job_id=job_id)
        attempts = store.get_attempts(s, step_ids=[st.id for st in steps if st.id is not None])
    assert job is not None and job.status == JobStatus.SUCCEEDED and job.answer == steps[-1].output
    assert [(st.status, st.attempts) for st in steps] == [(StepStatus.SUCCEEDED, 1)] * 3
    assert [(a.n, a.error_type, a.finished_at is not None) for a in attempts] == [(1, None, True)] * 3


def a_taker_that_does_not_run_the_step_leaves_it_to_be_sent() -> None:
    settings = get_settings()
    job_id = new_chain(2)
    due = plan_job(job_id, settings=settings, take=taker(runs=False))
    assert due.taken is None and due.steps == [(job_id, 0)]
    due = run_step(job_id, 0, worker="w", task_id=None, settings=settings, take=taker(runs=False))
    assert due.taken is None and due.steps == [(job_id, 1)]
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=1)
    assert step is not None and step.status == StepStatus.QUEUED and step.lease_owner is None


def a_step_refused_at_its_taking_fails_the_job_when_run() -> None:
    settings = get_settings()
    job_id = new_chain(2, limits={"deadline_s": 60})
    take = taker()
    due = plan_job(job_id, settings=settings, take=take)
    assert due.taken is not None
    with session_scope() as s:  # the deadline passes while step 0 runs
        store.update_job(s, job_id=job_id, created_at=utcnow() - timedelta(seconds=120))
    due = run_taken(due.taken, settings=settings, take=take)
    assert due.taken is not None and due.taken.index == 1  # claimed, to be failed without a call
    assert run_taken(due.taken, settings=settings, take=take).taken is None
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        second = store.get_step(s, job_id=job_id, index=1)
    assert job is not None and job.status == JobStatus.FAILED and job.error_type == "deadline_exceeded"
    assert second is not None and second.status == StepStatus.FAILED and second.attempts == 0


def parallel_steps_are_claimed_for_the_takers_spare_slots_and_the_rest_sent() -> None:
    settings = get_settings()
    job_id = new_dag([[], [], [], [], [0, 1, 2, 3]])  # a fan-out of four roots and their aggregator
    due = plan_job(job_id, settings=settings, take=taker(spare=2))
    assert due.taken is not None and [t.index for t in due.alongside] == [1, 2]
    assert due.steps == [(job_id, 3)]  # no spare slot left for it: sent, and still queued
    with session_scope() as s:
        steps = store.get_steps(s, job_id=job_id)
    assert [st.status for st in steps] == [StepStatus.RUNNING] * 3 + [StepStatus.QUEUED, StepStatus.PENDING]
    assert {st.celery_task_id for st in steps[:3]} == {"task-1"} and steps[3].lease_owner is None
    assert len({st.lease_owner for st in steps[:3]}) == 3  # a claim each: each outcome is fenced by its own
    assert [(st.lease_owner or "").split("#")[0] for st in steps[:3]] == ["taker", "side", "side"]

    take = taker(spare=2)
    for claimed in (due.taken, *due.alongside):
        assert not run_taken(claimed, settings=settings, take=take)  # the aggregator waits for step 3
    due = run_step(job_id, 3, worker="w", task_id=None, settings=settings, take=take)
    assert due.taken is not None and due.taken.index == 4 and due.alongside == [] and due.steps == []
    assert not run_taken(due.taken, settings=settings, take=take)
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        steps = store.get_steps(s, job_id=job_id)
    assert job is not None and job.status == JobStatus.SUCCEEDED
    assert [(st.status, st.attempts) for st in steps] == [(StepStatus.SUCCEEDED, 1)] * 5
    assert [m["content"] for m in steps[4].messages or []][-1] == "part 4"

    job_id = new_dag([[], [0], [0], [1, 2]])  # a diamond: the root's outcome makes two steps ready
    due = plan_job(job_id, settings=settings, take=taker(spare=3))
    assert due.taken is not None and due.alongside == []  # one root
    due = run_taken(due.taken, settings=settings, take=taker(spare=3))
    assert due.taken is not None and [t.index for t in due.alongside] == [2] and due.steps == []
    assert not run_taken(due.alongside[0], settings=settings, take=taker(spare=3))
    last = run_taken(due.taken, settings=settings, take=taker(spare=3))
    assert last.taken is not None and last.taken.index == 3
    run_taken(last.taken, settings=settings)
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
    assert job is not None and job.status == JobStatus.SUCCEEDED


def _claimed_roots(limits: dict[str, Any], with_plan: bool) -> list[tuple[Any, ...]]:
    """A fan-out's three roots claimed with its plan (``with_plan``), or planned queued and then claimed
    one after another by the claim a brokered step runs: what each row holds after its claim."""
    settings = get_settings()
    job_id = new_dag([[], [], [], [0, 1, 2]], limits=limits)
    if with_plan:
        due = plan_job(job_id, settings=settings, take=taker(spare=2))
        claims = [due.taken, *due.alongside]
        assert len(claims) == 3 and due.steps == []
        kinds = [type(c.claim).__name__ for c in claims if c is not None]
    else:
        assert plan_job(job_id, settings=settings, take=taker(runs=False)).steps == [(job_id, i) for i in range(3)]
        kinds = [type(transaction(lambda s, i=i: engine._claim(s, job_id, i, owner=f"taker#{i}", task_id="task-1",
                                                                settings=settings))).__name__ for i in range(3)]
    with session_scope() as s:
        steps = store.get_steps(s, job_id=job_id)
        attempts = store.get_attempts(s, step_ids=[st.id for st in steps if st.id is not None])
    return [(kinds[st.index], st.status, st.attempts, st.messages, st.provider, st.model, st.reserved_tokens,
             round(st.reserved_usd, 9), st.celery_task_id, [a.n for a in attempts if a.step_id == st.id])
            for st in steps[:3]]


def roots_claimed_with_the_plan_are_what_their_own_claims_would_write() -> None:
    free = _claimed_roots({}, with_plan=True)
    assert free == _claimed_roots({}, with_plan=False)
    assert [row[:3] for row in free] == [("_Claimed", StepStatus.RUNNING, 1)] * 3
    assert [row[6] for row in free] == [0, 0, 0]  # no budget: nothing held
    loose = _claimed_roots({"max_tokens": 10**6, "max_cost_usd": 100.0}, with_plan=True)
    assert loose == _claimed_roots({"max_tokens": 10**6, "max_cost_usd": 100.0}, with_plan=False)
    reserved = loose[0][6]
    assert reserved > 0 and [row[6] for row in loose] == [reserved] * 3
    # A token budget for one root and a half: each claim counts the reservations before it, so the first
    # root gets its tokens, the second what is left, and so on; both ways the same.
    tight = _claimed_roots({"max_tokens": reserved + reserved // 2}, with_plan=True)
    assert tight == _claimed_roots({"max_tokens": reserved + reserved // 2}, with_plan=False)
    assert tight[0][6] == reserved and tight[1][6] < reserved
    assert any(row[0] == "_Refused" and row[2] == 0 and row[9] == [] for row in tight), tight


def a_step_reclaimed_after_its_worker_died_does_not_count_its_own_reservation() -> None:
    """The dead claim's reservation is still on the row when the step is claimed again: the budget left
    for the new claim is what the other steps spent or hold, not that as well (it held the whole budget)."""
    settings = get_settings()
    job_id = new_chain(1, limits={"max_tokens": 400})
    assert plan_job(job_id, settings=settings, take=taker(runs=False)).steps == [(job_id, 0)]
    first = transaction(lambda s: engine._claim(s, job_id, 0, owner="dead", task_id=None, settings=settings))
    assert type(first).__name__ == "_Claimed"
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.id is not None and step.reserved_tokens == 400  # all of it
        store.update_step(s, step_id=step.id, lease_expires_at=utcnow() - timedelta(seconds=1))
    run_step(job_id, 0, worker="survivor", task_id=None, settings=settings)
    with session_scope() as s:
        job, step = store.get_job(s, job_id=job_id), store.get_step(s, job_id=job_id, index=0)
    assert job is not None and step is not None
    assert (job.status, step.status, step.attempts, step.error_type) == (
        JobStatus.SUCCEEDED, StepStatus.SUCCEEDED, 2, None), (job.error_message, step.error)
    assert step.reserved_tokens == 0 and 0 < job.input_tokens + job.output_tokens <= 400


def a_claim_re_run_after_its_commit_landed_returns_its_attempt_and_counts_none() -> None:
    """``transaction`` runs a body once more when the connection died; if it died after COMMIT reached the
    database, the claim runs again with the same owner. It must not count a second attempt or open one
    (the first would be closed later as ``worker_lost``)."""
    settings = get_settings()
    job_id = new_chain(1)
    plan_job(job_id, settings=settings)

    def claim(owner: str, lease_s: float) -> Any:
        return transaction(lambda s: store.claim_step_row(
            s, job_id=job_id, index=0, owner=owner, lease_s=lease_s, task_id=None, count_attempt=True,
            open_below=settings.step_max_attempts))

    first = claim("once#1", 60.0)
    again = claim("once#1", 60.0)
    assert first is not None and again == first and first.attempts == 0 and first.attempt_id is not None
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        attempts = store.get_attempts(s, step_ids=[first.step_id])
    assert step is not None and step.attempts == 1 and step.lease_owner == "once#1"
    assert [(a.id, a.n, a.worker, a.finished_at) for a in attempts] == [(first.attempt_id, 1, "once#1", None)]
    assert claim("other#1", 60.0) is None  # a live lease: another owner still cannot take it

    with session_scope() as s:  # the worker dies; a rescuer claims, and its claim is re-run as well
        store.update_step(s, step_id=first.step_id, lease_expires_at=utcnow() - timedelta(seconds=1))
    rescued = claim("rescuer#1", 60.0)
    rerun = claim("rescuer#1", 60.0)
    assert rescued is not None and rerun == rescued and rescued.attempts == 1 and rescued.attempt_id is not None
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        attempts = store.get_attempts(s, step_ids=[first.step_id])
    assert step is not None and step.attempts == 2
    assert [(a.n, a.worker) for a in attempts] == [(1, "once#1"), (2, "rescuer#1")]
    assert attempts[1].id == rescued.attempt_id

    # Through the engine's claim transaction, re-run by the same owner: the step runs as its attempt 2.
    with session_scope() as s:
        store.update_step(s, step_id=first.step_id, lease_expires_at=utcnow() - timedelta(seconds=1))
    owner = engine._owner("engine")
    claims = [transaction(lambda s: engine._claim(s, job_id, 0, owner=owner, task_id=None, settings=settings))
              for _ in range(2)]
    assert all(isinstance(c, engine._Claimed) for c in claims)
    assert [(c.attempt, c.attempt_id) for c in claims] == [(3, claims[0].attempt_id)] * 2
    with session_scope() as s:
        attempts = store.get_attempts(s, step_ids=[first.step_id])
    assert [(a.n, a.finished_at is None) for a in attempts] == [(1, False), (2, False), (3, True)]


def usage_of(job_id: str) -> tuple[int, int, float]:
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None
        return job.input_tokens, job.output_tokens, job.cost_usd


def parent_with_a_spending_child() -> tuple[str, str, tuple[int, int, float]]:
    """(parent, child, what the child spent so far): a parent whose one recursive step runs a child job
    (a 3-step pev) that has run its first step."""
    settings = get_settings()
    parent_id = new_chain(1, "conductor", planner="template:pev")
    plan_job(parent_id, settings=settings)
    started = run_step(parent_id, 0, worker="trips", task_id=None, settings=settings)
    [child_id] = started.plan
    child_steps = plan_job(child_id, settings=settings).steps
    run_step(child_id, child_steps[0][1], worker="trips", task_id=None, settings=settings)  # the child spends
    with session_scope() as s:  # a running job's totals are summed from its steps when it ends
        done = [st for st in store.get_steps(s, job_id=child_id) if st.status == StepStatus.SUCCEEDED]
    spent = (sum(st.input_tokens for st in done), sum(st.output_tokens for st in done), sum(st.cost_usd for st in done))
    assert len(done) == 1 and spent[0] > 0 and spent[2] > 0
    return parent_id, child_id, spent


def a_child_ending_after_its_parent_carries_its_usage_up() -> None:
    """A parent that ends (cancelled, or failed by another step) while its child job runs closes the
    recursive step first; the child's spend, and usage it gains after it ended, still reach the step and
    the parent's totals."""
    parent_id, child_id, spent = parent_with_a_spending_child()

    assert engine.cancel_job(parent_id)  # closes the recursive step, then cancels the child
    with session_scope() as s:
        child = store.get_job(s, job_id=child_id)
        step = store.get_step(s, job_id=parent_id, index=0)
    assert child is not None and child.status == JobStatus.CANCELLED and usage_of(child_id) == spent
    assert step is not None and step.status == StepStatus.CANCELLED
    assert (step.input_tokens, step.output_tokens, step.cost_usd) == spent  # the step took the child's spend
    assert usage_of(parent_id) == spent  # and so did the parent's totals

    late: dict[str, Any] = {"input_tokens": 7, "output_tokens": 3, "cost_usd": 0.5}  # a child call ending late
    with session_scope() as s:
        child_step = store.get_step(s, job_id=child_id, index=1)
        assert child_step is not None and child_step.id is not None
        assert store.add_unrecorded_usage(s, step_id=child_step.id, job_id=child_id, **late)  # the child ended
    engine._carry_up([(child_id, late)])
    total = (spent[0] + 7, spent[1] + 3, spent[2] + 0.5)
    assert usage_of(child_id) == total and usage_of(parent_id) == total
    with session_scope() as s:  # the top of the tree: nothing further up
        assert store.add_usage_to_parent(s, job_id=parent_id, usage=late) is None


def a_superseded_planning_adds_its_planner_usage_and_a_landed_plan_is_not_counted_twice() -> None:
    """Two planning claims of one job (the reconciler re-drove the first): the first, lost, adds what its
    planner cost; the second's plan adds its own instead of overwriting it. A re-run of the second's
    transaction after its commit landed (the plan is in: its claim, its steps) adds nothing more."""
    job_id = new_chain(1)
    first = transaction(lambda s: store.claim_planning_job(s, job_id=job_id))
    assert first is not None
    with session_scope() as s:  # what the reconciler does to a planning whose worker looks dead
        assert store.transition_job(s, job_id=job_id, from_=[JobStatus.PLANNING], to=JobStatus.QUEUED)
    second = transaction(lambda s: store.claim_planning_job(s, job_id=job_id))
    assert second is not None and second[0] == first[0] + 1
    u1 = {"planner_input_tokens": 10, "planner_output_tokens": 5, "planner_cost_usd": 0.25, "planner_calls": 2}
    u2 = {"planner_input_tokens": 100, "planner_output_tokens": 50, "planner_cost_usd": 1.0, "planner_calls": 1}

    def planner_usage() -> tuple[Any, ...]:
        with session_scope() as s:
            job = store.get_job(s, job_id=job_id)
            assert job is not None
            return (job.planner_input_tokens, job.planner_output_tokens, job.planner_cost_usd, job.planner_calls,
                    job.input_tokens)

    with session_scope() as s:
        assert store.add_lost_planner_usage(s, job_id=job_id, claim=first[0], usage=u1) == (True, False)
    assert planner_usage() == (10, 5, 0.25, 2, 0)  # the job is still planning: its totals come at its end
    settings = get_settings()
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None
        assert store.transition_job(s, job_id=job_id, from_=[JobStatus.PLANNING], to=JobStatus.RUNNING,
                                    plan_claim=second[0], added=store.PLANNER_USAGE, **u2)
        store.insert_steps(s, steps=step_rows(s, job, make_plan(job, settings=settings).workflow))
    assert planner_usage() == (110, 55, 1.25, 3, 0)
    with session_scope() as s:  # the second claim's body run again after its commit landed
        assert not store.add_lost_planner_usage(s, job_id=job_id, claim=second[0], usage=u2).added
    assert planner_usage() == (110, 55, 1.25, 3, 0)


def a_child_cancelled_while_planning_carries_its_planner_usage_to_its_parent() -> None:
    """The parent is cancelled while its child plans: the child ends at once (its totals without the
    planner), and when its planner returns, the dropped planning's usage goes to the child and up."""
    settings = get_settings()
    parent_id = new_chain(1, "conductor")
    plan_job(parent_id, settings=settings)
    [child_id] = run_step(parent_id, 0, worker="trips", task_id=None, settings=settings).plan
    claimed = transaction(lambda s: store.claim_planning_job(s, job_id=child_id))  # the child's planner runs
    assert claimed is not None
    assert engine.cancel_job(parent_id)
    assert usage_of(parent_id) == usage_of(child_id) == (0, 0, 0.0)
    planner = {"planner_input_tokens": 40, "planner_output_tokens": 60, "planner_cost_usd": 0.5, "planner_calls": 1}
    with session_scope() as s:  # what plan_job does when the planner returns and its plan is dropped
        lost = store.add_lost_planner_usage(s, job_id=child_id, claim=claimed[0], usage=planner)
    assert lost == (True, True)
    engine._carry_up([(child_id, engine._as_totals(planner))])
    assert usage_of(child_id) == usage_of(parent_id) == (40, 60, 0.5)


CASES = (
    the_read_returns_what_the_separate_outputs_query_returns,
    the_read_returns_every_steps_agent_and_access_list,
    the_claim_opens_no_attempt_at_the_cap_and_keeps_its_own_when_closing_lost_ones,
    recording_closes_the_attempt_only_if_still_open,
    recording_returns_the_heads_with_this_step_as_recorded,
    an_outcome_claims_the_step_it_made_ready_for_its_taker,
    a_taker_that_does_not_run_the_step_leaves_it_to_be_sent,
    a_step_refused_at_its_taking_fails_the_job_when_run,
    parallel_steps_are_claimed_for_the_takers_spare_slots_and_the_rest_sent,
    roots_claimed_with_the_plan_are_what_their_own_claims_would_write,
    a_step_reclaimed_after_its_worker_died_does_not_count_its_own_reservation,
    a_claim_re_run_after_its_commit_landed_returns_its_attempt_and_counts_none,
    a_child_ending_after_its_parent_carries_its_usage_up,
    a_superseded_planning_adds_its_planner_usage_and_a_landed_plan_is_not_counted_twice,
    a_child_cancelled_while_planning_carries_its_planner_usage_to_its_parent,
)
