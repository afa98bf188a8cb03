"""The engine in process, on a temporary SQLite file, with no services: the fast tier for workflow shapes.

The production engine functions (``plan_job``, ``run_step``, ``finalize_job``, ``cancel_job``) run
against the migrated schema exactly as the Celery tasks call them; only the broker is replaced, by a
FIFO of the messages each ``Dispatch`` names (what ``conductor.tasks.send`` would publish). Agents are
the deterministic ``sim`` provider. The same shapes run against Postgres, Redis and real workers in
tests/integration; this tier pins the engine's decisions in seconds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conductor.context import cache_scope
from conductor.engine import Dispatch, cancel_job, finalize_job, plan_job, run_step
from conductor.errors import ErrorType
from conductor.settings import Settings, get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope, transaction
from conductor.store.models import Job, JobStatus, Step, StepAttempt, StepStatus
from conductor.submission import JobCreate, create_job
from tests.hot_path_cases import CASES
from tests.sqlite_store import sqlite_store

POOL = """
planner: template:single
fallback: template:single
agents:
  a: {provider: sim, price: {input_per_mtok: 1.0, output_per_mtok: 2.0}}
  b: {provider: sim}
  c: {provider: sim}
  d: {provider: sim}
  flaky: {provider: sim, options: {fail_with: [rate_limit, server], retry_after_s: 0}}
  broken: {provider: sim, options: {always_fail: true, error: server}}
  refuses: {provider: sim, options: {always_fail: true, error: bad_request}}
  slow: {provider: sim, options: {latency_ms: 3000}}
"""


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    pool = tmp_path / "inprocess.yaml"
    pool.write_text(POOL)
    with sqlite_store(tmp_path, monkeypatch, CONDUCTOR_POOL_FILE=str(pool), CONDUCTOR_RETRY_BACKOFF_BASE_S="0",
                      CONDUCTOR_RETRY_BACKOFF_MAX_S="0") as settings:
        yield settings


def submit(settings: Settings, **body: Any) -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "the task", **body}), tenant="unit",
                            settings=settings)
        return job.id


def drain(first: Dispatch, settings: Settings, *, max_messages: int = 200) -> list[str]:
    """Delivers every message the engine asks for, in order, until none is left; returns what ran."""
    queue: deque[tuple[str, tuple[Any, ...]]] = deque()

    def enqueue(d: Dispatch) -> None:
        queue.extend(("plan", (job_id,)) for job_id in d.plan)
        queue.extend(("run_step", step) for step in d.steps)
        queue.extend(("finalize", (job_id,)) for job_id in d.finalize)

    enqueue(first)
    delivered: list[str] = []
    while queue:
        assert len(delivered) < max_messages, "the engine keeps asking for work"
        kind, args = queue.popleft()
        delivered.append(f"{kind}{args}")
        if kind == "plan":
            enqueue(plan_job(args[0], settings=settings))
        elif kind == "run_step":
            enqueue(run_step(args[0], args[1], worker="unit", task_id=None, settings=settings))
        else:
            enqueue(finalize_job(args[0]))
    return delivered


def run(settings: Settings, **body: Any) -> tuple[Job, list[Step]]:
    job_id = submit(settings, **body)
    drain(Dispatch(plan=[job_id]), settings)
    return load(job_id)


def load(job_id: str) -> tuple[Job, list[Step]]:
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None
        return job, store.get_steps(s, job_id=job_id)


def attempts(step: Step) -> list[StepAttempt]:
    with session_scope() as s:
        assert step.id is not None
        return store.get_attempts(s, step_ids=[step.id])


def workflow(agents: list[str], access: list[Any], subtasks: list[str] | None = None) -> dict[str, Any]:
    return {"model_ids": agents, "subtasks": subtasks or [f"part {i}" for i in range(len(agents))],
            "access_lists": access}


def test_a_chain_passes_each_answer_to_the_next_step(settings: Settings) -> None:
    job, steps = run(settings, workflow=workflow(["a", "b", "c"], [[], [0], [1]]))
    assert job.status == JobStatus.SUCCEEDED and job.answer == "[c] part 2"
    assert [st.status for st in steps] == [StepStatus.SUCCEEDED] * 3
    # Step 2 sees only step 1's turn (its access list), then its own subtask.
    assert [m["content"] for m in steps[2].messages or []][-3:] == ["part 1", "[b] part 1", "part 2"]
    assert all("part 0" not in m["content"] for m in steps[2].messages or [])
    assert job.workflow_source == "request" and job.calls == 3
    assert job.input_tokens == sum(st.input_tokens for st in steps) > 0


def test_each_prompt_carries_its_tenants_cache_scope_unless_caches_are_shared(settings: Settings) -> None:
    """Steps claimed by their own message, and roots a worker's planning claims with the plan alike."""
    from conductor.engine import Taker, run_taken

    _, steps = run(settings, workflow=workflow(["a", "b"], [[], [0]]))
    assert [(st.messages or [])[0]["content"].count(cache_scope("unit")) for st in steps] == [1, 1]
    job_id = submit(settings, workflow=workflow(["a", "b"], [[], []]))
    take = Taker(worker="host/w", task_id="task-x", settings=settings, runs=lambda *_: True, spare=lambda: 1,
                 beside="host/alongside")
    due = plan_job(job_id, settings=settings, take=take)
    assert due.taken is not None and len(due.alongside) == 1  # both roots claimed with the plan
    for taken in [due.taken, *due.alongside]:
        drain(run_taken(taken, settings=settings), settings)
    roots = load(job_id)[1]
    assert [(st.messages or [])[0]["content"].count(cache_scope("unit")) for st in roots] == [1, 1]
    _, plain = run(settings.model_copy(update={"prompt_cache_scope": "shared"}),
                   workflow=workflow(["a", "b"], [[], [0]]))
    assert [(st.messages or [])[0]["content"].count("[cache scope") for st in plain] == [0, 0]
    assert [(st.messages or [])[0]["content"] for st in plain] == [
        (st.messages or [])[0]["content"].replace(cache_scope("unit"), "") for st in steps]


def test_the_n_graph_runs_each_step_once_after_its_own_dependencies(settings: Settings) -> None:
    """0; 1; 2<-0; 3<-0,1: a DAG no chain/group/chord canvas expresses."""
    job_id = submit(settings, workflow=workflow(["a", "b", "c", "d"], [[], [], [0], [0, 1]]))
    delivered = drain(Dispatch(plan=[job_id]), settings)
    job, steps = load(job_id)
    assert job.status == JobStatus.SUCCEEDED
    runs = [m for m in delivered if m.startswith("run_step")]
    assert sorted(runs) == sorted(f"run_step{(job_id, i)}" for i in range(4))  # each step sent exactly once
    assert runs[:2] == [f"run_step{(job_id, 0)}", f"run_step{(job_id, 1)}"]  # the roots go out together
    assert steps[3].access_list == [0, 1] and steps[2].access_list == [0]


def test_access_all_resolves_to_every_earlier_step(settings: Settings) -> None:
    job, steps = run(settings, workflow=workflow(["a", "b", "c"], [[], [], "all"]))
    assert job.status == JobStatus.SUCCEEDED
    assert steps[2].access_list == [0, 1] and steps[2].access_all


def test_the_planner_template_writes_the_workflow(settings: Settings) -> None:
    job, steps = run(settings, planner="template:fanout")
    assert job.status == JobStatus.SUCCEEDED and job.workflow_source in ("planner", "template")
    assert len(steps) >= 2 and steps[-1].access_list == list(range(len(steps) - 1))


def test_retryable_errors_are_retried_and_every_attempt_recorded(settings: Settings) -> None:
    job, [step] = run(settings, workflow=workflow(["flaky"], [[]]))
    assert job.status == JobStatus.SUCCEEDED and step.output == "[flaky] part 0"
    assert [(a.n, a.error_type) for a in attempts(step)] == [
        (1, ErrorType.RATE_LIMITED), (2, ErrorType.SERVER_ERROR), (3, None)
    ]
    assert job.calls == 3


def test_a_failing_step_fails_the_job_and_skips_the_rest(settings: Settings) -> None:
    job, steps = run(settings, workflow=workflow(["a", "broken", "c"], [[], [0], [1]]))
    assert job.status == JobStatus.FAILED
    assert (job.error_type, job.error_step) == (ErrorType.SERVER_ERROR, 1)
    assert [st.status for st in steps] == [StepStatus.SUCCEEDED, StepStatus.FAILED, StepStatus.SKIPPED]
    assert len(attempts(steps[1])) == settings.step_max_attempts  # retried up to the limit, then gave up
    assert "gave up after" in (steps[1].error or "")


def test_a_fatal_error_is_not_retried(settings: Settings) -> None:
    job, [step] = run(settings, workflow=workflow(["refuses"], [[]]))
    assert job.status == JobStatus.FAILED and job.error_type == ErrorType.BAD_REQUEST
    assert [a.error_type for a in attempts(step)] == [ErrorType.BAD_REQUEST]


def test_a_spent_budget_refuses_the_step_without_calling_its_agent(settings: Settings) -> None:
    job, [step] = run(settings, workflow=workflow(["a"], [[]], ["x" * 4000]), limits={"max_tokens": 50})
    assert job.status == JobStatus.FAILED and job.error_type == ErrorType.BUDGET_EXCEEDED
    assert step.error_type == ErrorType.BUDGET_EXCEEDED and attempts(step) == [] and job.calls == 0


def test_a_model_planner_the_budget_cannot_pay_for_fails_the_job_without_calling_it(settings: Settings) -> None:
    # the planner's prompt alone is over 50 tokens: the job ends budget_exceeded, not after a paid call
    job, steps = run(settings, planner="a", limits={"max_tokens": 50})
    assert job.status == JobStatus.FAILED and job.error_type == ErrorType.BUDGET_EXCEEDED
    assert "planning: token budget 50 exhausted" in (job.error_message or "")
    assert steps == [] and job.calls == 0 and job.planner_calls == 0


def test_a_recursive_step_runs_a_child_job_and_resumes_its_parent(settings: Settings) -> None:
    job, steps = run(settings, workflow=workflow(["a", "conductor", "b"], [[], [0], [1]]))
    assert job.status == JobStatus.SUCCEEDED, (job.error_type, job.error_message)
    child_id = steps[1].child_job_id
    assert child_id is not None
    child, child_steps = load(child_id)
    assert child.status == JobStatus.SUCCEEDED and child.parent_job_id == job.id and child.depth == 1
    assert steps[1].output == child.answer and child_steps
    # The child saw what its parent step could see: step 0's turn.
    assert any(m["content"] == "[a] part 0" for m in child.context or [])
    assert job.answer == "[b] part 2"


def test_max_answer_tokens_cuts_the_answering_step_only(settings: Settings) -> None:
    """The job's answer is its last step's output: that step's call gets the cap (the sim agent stops there
    with ``length``, as a provider does); the steps before it keep their agents' ``max_tokens``. A recursive
    step passes the cap to its child only when it is the answering step."""
    long = ["write this at some length, please " * 3] * 3
    job, steps = run(settings, workflow=workflow(["a", "b", "c"], [[], [0], [1]], long),
                     limits={"max_answer_tokens": 3})
    assert job.status == JobStatus.SUCCEEDED
    assert [st.finish_reason for st in steps] == ["stop", "stop", "length"]
    assert steps[0].output == f"[a] {long[0]}" and job.answer == steps[2].output == f"[c] {long[2]}"[:12]
    roots, _ = run(settings, workflow=workflow(["a", "b"], [[], []], long[:2]), limits={"max_answer_tokens": 3})
    assert roots.answer == f"[b] {long[1]}"[:12]  # each root's own claim reads the job's last index

    job, steps = run(settings, workflow=workflow(["conductor", "conductor"], [[], [0]], long[:2]),
                     limits={"max_answer_tokens": 3, "max_depth": 1})
    assert job.status == JobStatus.SUCCEEDED, (job.error_type, job.error_message)
    first, last = (load(st.child_job_id or "") for st in steps)
    assert first[0].limits.get("max_answer_tokens") is None and first[1][-1].finish_reason == "stop"
    assert last[0].limits["max_answer_tokens"] == 3 and last[1][-1].finish_reason == "length"
    assert job.answer == last[0].answer and len(job.answer or "") <= 12


def test_max_answer_tokens_cuts_only_the_last_root_claimed_with_the_plan(settings: Settings) -> None:
    """Roots a worker's planning claims with the plan (``_claim_roots``, a ``Taker`` with a spare slot) are
    rendered from the plan in memory, not read back by the claim statement: only the last of them answers."""
    from conductor.engine import Taker, run_taken

    long = ["write this at some length, please " * 3] * 2
    job_id = submit(settings, workflow=workflow(["a", "b"], [[], []], long), limits={"max_answer_tokens": 3})
    take = Taker(worker="host/w", task_id="task-x", settings=settings, runs=lambda *_: True, spare=lambda: 1,
                 beside="host/alongside")
    due = plan_job(job_id, settings=settings, take=take)
    assert due.taken is not None and [due.taken.index, *(t.index for t in due.alongside)] == [0, 1]
    assert due.steps == []  # both roots were claimed with the plan, none sent
    for taken in [due.taken, *due.alongside]:
        drain(run_taken(taken, settings=settings), settings)
    job, steps = load(job_id)
    assert job.status == JobStatus.SUCCEEDED, (job.error_type, job.error_message)
    assert [st.finish_reason for st in steps] == ["stop", "length"]
    assert steps[0].output == f"[a] {long[0]}" and job.answer == steps[1].output == f"[b] {long[1]}"[:12]


def test_a_replanned_replay_runs_again_a_step_that_now_answers_under_max_answer_tokens(settings: Settings) -> None:
    """With ``max_answer_tokens`` the answering step's output is cut and the others' are not: a replan that
    makes the original's middle step the last one does not reuse its uncapped output as the answer."""
    from conductor.replay import ReplayRequest, create_replay

    solve = "Solve the task and give the final answer."  # template:single's one step, on the pool's first agent
    original, steps = run(settings, planner="template:single", limits={"max_answer_tokens": 3},
                          workflow=workflow(["a", "b"], [[], [0]], [solve, "and now at some length, please"]))
    assert original.status == JobStatus.SUCCEEDED
    assert [st.finish_reason for st in steps] == ["stop", "length"] and steps[0].output == f"[a] {solve}"
    with session_scope() as s:
        replay_id = create_replay(s, original, ReplayRequest(from_step=1, replan=True), settings=settings).id
    drain(Dispatch(plan=[replay_id]), settings)
    job, [step] = load(replay_id)  # the new plan: step 0 alone, the original's step 0 but now answering
    assert job.status == JobStatus.SUCCEEDED, (job.error_type, job.error_message)
    assert step.reused_from is None and step.finish_reason == "length"
    assert job.answer == f"[a] {solve}"[:12]


def test_a_failed_child_job_fails_its_parent_step(settings: Settings) -> None:
    """The child inherits what is left of the token budget; its own step does not fit in it."""
    job, steps = run(settings, task="x" * 4000, planner="template:single",
                     workflow=workflow(["conductor"], [[]]), limits={"max_tokens": 50})
    assert job.status == JobStatus.FAILED
    assert steps[0].error_type == ErrorType.CHILD_JOB_FAILED and job.error_type == ErrorType.CHILD_JOB_FAILED
    child, [child_step] = load(steps[0].child_job_id or "")
    assert child.status == JobStatus.FAILED and child_step.error_type == ErrorType.BUDGET_EXCEEDED


def test_cancel_stops_queued_steps_and_drops_later_work(settings: Settings) -> None:
    job_id = submit(settings, workflow=workflow(["a", "b"], [[], [0]]))
    first = plan_job(job_id, settings=settings)
    assert first.steps == [(job_id, 0)]
    assert cancel_job(job_id)
    drain(first, settings)  # the message already sent for step 0 arrives after the cancel
    job, steps = load(job_id)
    assert job.status == JobStatus.CANCELLED and job.error_type == ErrorType.CANCELLED
    assert [st.status for st in steps] == [StepStatus.CANCELLED, StepStatus.CANCELLED]
    assert attempts(steps[0]) == [] and job.answer is None


def test_a_duplicated_message_records_one_outcome(settings: Settings) -> None:
    job_id = submit(settings, workflow=workflow(["a"], [[]]))
    first = plan_job(job_id, settings=settings)
    drain(Dispatch(steps=first.steps * 2), settings)  # the broker delivered the step twice
    job, [step] = load(job_id)
    assert job.status == JobStatus.SUCCEEDED and len(attempts(step)) == 1 and job.calls == 1


def test_a_new_step_row_is_what_the_model_would_insert() -> None:
    from conductor.store import jobs as store
    from conductor.store.models import Step, StepStatus

    values = {"job_id": "j" * 32, "index": 2, "agent": "a", "instruction": "do it", "access_list": [0, 1],
              "access_all": False}
    model = Step(**values)  # type: ignore[arg-type]
    expected = {attr: getattr(model, attr) for attr, _ in store._columns(Step, ("id",))}
    assert store.new_step_row(**values) == expected
    assert store.new_step_row(**values)["status"] == StepStatus.PENDING and expected["reserved_usd"] == 0.0
    with pytest.raises(TypeError, match="not a step column"):
        store.new_step_row(**values, outptu="typo")
    with pytest.raises(TypeError, match="a step needs"):
        store.new_step_row(index=0, agent="a", instruction="x", access_list=[])
    bare = {k: v for k, v in values.items() if k != "access_list"}
    first, second = store.new_step_row(**bare), store.new_step_row(**bare)
    assert first["access_list"] == [] and first["access_list"] is not second["access_list"]  # a factory per row


def test_a_constructed_job_has_the_models_defaults() -> None:
    """``create_job`` builds its Job with ``model_construct`` (it is inserted by Core, never by the ORM):
    every column must come out as the model's own constructor makes it."""
    from conductor.store import jobs as store
    from conductor.store.models import Job

    values = {"tenant": "t", "task": "x", "pool": "p", "pool_config": {}, "planner": "conductor", "limits": {},
              "meta": {"k": 1}, "webhook_url": None}
    built, constructed = Job(**values), Job.model_construct(**values)  # type: ignore[arg-type]
    differ = [a for a, _ in store._columns(Job) if getattr(built, a) != getattr(constructed, a)]
    assert differ == ["id", "created_at", "updated_at"]  # fresh per instance
    assert len(constructed.id) == 32 and constructed.created_at.tzinfo is not None


def test_progress_names_the_planner_when_the_plan_commits_between_its_two_reads(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``conductor run``'s progress reads the job, then its steps; SQLite gives each SELECT its own
    snapshot, so a plan committed in between showed its steps beside a job row from before the plan:
    "? template:single: 1 step (source=?, …)". Seen once in CI under load; forced here."""
    import io

    from conductor.embedded import Progress

    job_id = submit(settings, task="t")
    real_get_steps = store.get_steps
    planned: list[bool] = []

    def plan_first(session: Any, *, job_id: str) -> list[Step]:
        if not planned:
            planned.append(True)
            plan_job(job_id, settings=settings)  # another transaction commits the plan now
        return real_get_steps(session, job_id=job_id)

    monkeypatch.setattr(store, "get_steps", plan_first)
    err = io.StringIO()
    Progress(job_id, err, started=0.0).update()
    assert planned and "planned by template:single: 1 step (source=planner, format_valid=True)" in err.getvalue()


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_store_case_on_sqlite(settings: Settings, case: Callable[[], None]) -> None:
    case()  # the folded Postgres statements run here as two each, leaving the same rows


def test_the_in_flight_quota_is_the_inserts_condition_on_sqlite(settings: Settings) -> None:
    def job() -> Job:
        return Job.model_construct(tenant="quota", task="t", pool="default", pool_config={}, planner="x", limits={},
                                   meta={}, request_hash="h")

    first, second = job(), job()
    with session_scope() as s:
        assert store.insert_job_admitted(s, job=first, max_in_flight=1, commit=True)
        with session_scope() as other:  # committed with the insert
            assert store.get_job(other, job_id=first.id) is not None
        assert not store.insert_job_admitted(s, job=second, max_in_flight=1)
    with session_scope() as s:
        assert store.count_jobs_in_flight(s, tenant="quota") == 1 and store.get_job(s, job_id=second.id) is None


def test_steps_claimed_beside_with_no_slot_left_run_in_the_claiming_task_after_its_own(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conductor.engine import Taker
    from conductor.tasks import jobs
    from conductor.tasks.app import STEPS_QUEUE

    monkeypatch.setenv("CONDUCTOR_WORKER_LOCAL_SLOTS", "0")  # every slot taken by the time they start
    get_settings.cache_clear()
    settings = get_settings()
    job_id = submit(settings, workflow={"model_ids": ["a"] * 4, "subtasks": ["x", "y", "z", "join"],
                                        "access_lists": [[], [], [], [0, 1, 2]]})
    slot = jobs._Slot("host", "task-x", frozenset({STEPS_QUEUE}))
    # The claim read two spare slots; another task took them before this one started its steps.
    take = Taker(worker=slot.worker(), task_id=slot.task_id, settings=settings, runs=lambda *_: True,
                 spare=lambda: 2, beside="host/alongside")
    due = plan_job(job_id, settings=settings, take=take)
    assert due.taken is not None and len(due.alongside) == 2 and due.steps == []

    jobs._run_on(slot, due, take)  # no thread to hand them to: this call runs all four steps itself

    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        steps = store.get_steps(s, job_id=job_id)
    assert job is not None and job.status == JobStatus.SUCCEEDED
    assert [(st.status, st.attempts, st.celery_task_id) for st in steps] == [(StepStatus.SUCCEEDED, 1, "task-x")] * 4


def test_steps_waiting_for_the_claiming_task_keep_their_leases(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps claimed beside a task that found no slot free wait for its own step; the heartbeat renews
    their leases meanwhile, or the reconciler would hand them to another worker while this one still runs
    them after its own (two calls)."""
    import threading
    import time

    from conductor.engine import Taker
    from conductor.tasks import jobs
    from conductor.tasks.app import STEPS_QUEUE

    monkeypatch.setenv("CONDUCTOR_WORKER_LOCAL_SLOTS", "0")
    monkeypatch.setenv("CONDUCTOR_STEP_LEASE_S", "0.3")  # renewed every 0.1 s while held
    get_settings.cache_clear()
    settings = get_settings()
    job_id = submit(settings, workflow={"model_ids": ["slow", "a", "a", "a"], "subtasks": ["x", "y", "z", "join"],
                                        "access_lists": [[], [], [], [0, 1, 2]]})
    slot = jobs._Slot("host", "task-x", frozenset({STEPS_QUEUE}))
    take = Taker(worker=slot.worker(), task_id=slot.task_id, settings=settings, runs=lambda *_: True,
                 spare=lambda: 2, beside="host/alongside")
    due = plan_job(job_id, settings=settings, take=take)
    assert due.taken is not None and due.taken.index == 0 and [t.index for t in due.alongside] == [1, 2]
    _, claimed = load(job_id)
    runner = threading.Thread(target=jobs._run_on, args=(slot, due, take))
    runner.start()
    renewed = False
    while not renewed:  # until the two waiting steps' leases move past their claims', or step 0's call ends
        _, steps = load(job_id)
        if steps[0].status != StepStatus.RUNNING:
            break
        renewed = all(steps[i].lease_expires_at > claimed[i].lease_expires_at for i in (1, 2))  # type: ignore[operator]
        time.sleep(0.02)
    runner.join()
    assert renewed, "the steps waiting for the task's own were not kept leased while its call ran"
    job, steps = load(job_id)
    assert job.status == JobStatus.SUCCEEDED
    assert [(st.status, st.attempts) for st in steps] == [(StepStatus.SUCCEEDED, 1)] * 4


@pytest.mark.parametrize("agent", ["a", "flaky"])
def test_a_step_mid_call_when_its_job_fails_ends_and_its_call_is_counted(settings: Settings, agent: str) -> None:
    """Root 1 is mid-call when root 0 fails the job. Its call then ends: answered (the answer is dropped,
    its tokens and cost join the failed job's totals) or with a retryable error (no retry for a failed
    job); either way the step is closed, not left ``running`` forever."""
    from conductor import engine

    job_id = submit(settings, workflow={"model_ids": ["refuses", agent, "b"], "subtasks": ["x", "y", "join"],
                                        "access_lists": [[], [], [0, 1]]})
    assert plan_job(job_id, settings=settings).steps == [(job_id, 0), (job_id, 1)]
    claim = transaction(lambda s: engine._claim(s, job_id, 1, owner="other", task_id=None, settings=settings))
    assert isinstance(claim, engine._Claimed)
    drain(Dispatch(steps=[(job_id, 0)]), settings)
    assert load(job_id)[0].status == JobStatus.FAILED
    engine.run_taken(engine.Taken(job_id, 1, agent, claim), settings=settings)  # the call ends now
    job, steps = load(job_id)
    assert [st.status for st in steps] == [StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.SKIPPED]
    assert steps[1].output is None
    assert [a.finished_at is not None for a in attempts(steps[1])] == [True]  # its attempt is closed
    if agent == "a":
        assert steps[1].output_tokens > 0 and steps[1].cost_usd > 0
    assert (job.input_tokens, job.output_tokens) == (
        job.planner_input_tokens + sum(st.input_tokens for st in steps),
        job.planner_output_tokens + sum(st.output_tokens for st in steps))
    assert job.cost_usd == pytest.approx(job.planner_cost_usd + sum(st.cost_usd for st in steps))


def test_a_planning_cancelled_while_its_planner_ran_still_counts_the_planner(settings: Settings) -> None:
    """The plan is dropped; what the planner's calls cost is added to the cancelled job."""
    import threading

    job_id = submit(settings, planner="slow")  # a sim agent as the planner: 3 s a call
    planned: list[Dispatch] = []
    planner = threading.Thread(target=lambda: planned.append(plan_job(job_id, settings=settings)))
    planner.start()
    deadline = time.monotonic() + 30
    while load(job_id)[0].status != JobStatus.PLANNING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert cancel_job(job_id)
    planner.join(timeout=60)
    assert planned == [Dispatch()]  # nothing dispatched
    job, steps = load(job_id)
    assert job.status == JobStatus.CANCELLED and steps == []
    assert job.planner_calls == 2 and job.planner_input_tokens > 0  # a first call and a re-ask, both paid
    assert (job.input_tokens, job.output_tokens, job.cost_usd, job.calls) == (
        job.planner_input_tokens, job.planner_output_tokens, job.planner_cost_usd, job.planner_calls)


def test_a_plannings_usage_fills_exactly_the_planner_columns_the_store_adds_to() -> None:
    from conductor.engine import _usage_columns
    from conductor.planning.base import PlannerUsage

    columns = _usage_columns(PlannerUsage(input_tokens=3, output_tokens=2, cost_usd=0.5, calls=1,
                                          cached_input_tokens=2, reasoning_tokens=1, cache_write_tokens=1))
    assert set(columns) == set(store.PLANNER_USAGE) and set(store.PLANNER_TOTALS) == set(store.PLANNER_USAGE)
    assert columns == {"planner_input_tokens": 3, "planner_output_tokens": 2, "planner_cost_usd": 0.5,
                       "planner_calls": 1, "planner_cached_input_tokens": 2, "planner_reasoning_tokens": 1,
                       "planner_cache_write_tokens": 1}
