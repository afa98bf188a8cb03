"""Job execution as state transitions on Postgres rows. No Celery here: every function returns a
``Dispatch`` naming the messages the caller must send next, and the task layer sends them.

Scheduling is dataflow: when a step finishes, the steps whose every dependency is now done move
from ``pending`` to ``queued`` (a conditional update, so exactly one caller dispatches each) and are
sent at once. A step therefore waits for its own access list and nothing else, for any DAG — which a
static tree of chains and chords cannot promise (see docs/architecture.md). Because the decision
reads only Postgres, the reconciler re-drives lost work with the very same functions.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlmodel import Session

from conductor import telemetry
from conductor.budget import (
    Spent,
    allowed_output_tokens,
    check_deadline,
    child_limits,
    child_reservation,
    deadline_of,
    estimate_tokens,
    step_reservation,
)
from conductor.context import PlannedStep, cache_points, turns_as_messages, worker_messages
from conductor.errors import (
    BudgetExceeded,
    ConductorError,
    DeadlineExceeded,
    ErrorType,
    InternalError,
    StepAbandoned,
)
from conductor.lease import heartbeat
from conductor.planning.base import PlannerUsage, PlanningOverBudget, PlanResult
from conductor.planning.planner import longest_planning_s, make_plan
from conductor.pool.base import CallOptions, Completion, Message
from conductor.pool.config import AgentConfig, PoolConfig
from conductor.pool.errors import ProviderError
from conductor.pool.registry import caches_for_an_hour, caches_on_request, provider_for
from conductor.ratelimit import wait_for_rate_limit
from conductor.replay import replay_plan, step_rows
from conductor.retry import RetryPolicy
from conductor.settings import Settings, get_settings
from conductor.store import jobs as store
from conductor.store import webhooks as webhook_store
from conductor.store.db import DATABASE_AWAY, patiently, session_scope, transaction
from conductor.store.jobs import RELEASED, WORKER_LOST
from conductor.store.models import Job, JobStatus, StepStatus, utcnow
from conductor.workflow import CONDUCTOR_AGENT, WorkflowError, ready_steps

log = logging.getLogger(__name__)


@dataclass
class Dispatch:
    """Messages to send after a state change was committed."""

    plan: list[str] = field(default_factory=list)
    background: set[str] = field(default_factory=set)
    """Jobs that are batch work (a batch's lines and their child jobs): their messages here (plan, steps,
    finalize) go at the broker's lowest priority, so that a worker takes every live job's message waiting
    before them (``tasks.send.BATCH_PRIORITY``)."""
    steps: list[tuple[str, int]] = field(default_factory=list)
    finalize: list[str] = field(default_factory=list)
    agents: dict[tuple[str, int], str] = field(default_factory=dict)
    """The agent of each step in ``steps`` where known: only for display (Flower, logs)."""
    webhooks: list[str] = field(default_factory=list)
    """Webhook deliveries (outbox rows written with the job's end) to send on the ``webhooks`` queue."""
    taken: Taken | None = None
    """A ready step already claimed for the worker that asked (``Taker``): no message; that worker runs
    it next (``run_taken``). Only an outcome given a ``Taker`` sets it."""
    alongside: list[Taken] = field(default_factory=list)
    """More ready steps claimed for that worker with ``taken`` (up to ``Taker.spare()``): no messages;
    it runs them at once beside ``taken``, on its process's local slots."""

    def __iadd__(self, other: Dispatch) -> Dispatch:
        if self.taken is not None and other.taken is not None:
            raise ValueError("two claimed steps in one dispatch: one would never run")
        self.plan += other.plan
        self.background |= other.background
        self.steps += other.steps
        self.finalize += other.finalize
        self.agents.update(other.agents)
        self.webhooks += other.webhooks
        self.taken = self.taken or other.taken
        self.alongside += other.alongside
        return self

    def __bool__(self) -> bool:
        return bool(self.plan or self.steps or self.finalize or self.webhooks or self.taken or self.alongside)


@dataclass(frozen=True)
class Taker:
    """A worker slot that will run one of the steps an outcome makes ready. That step is claimed in the
    outcome's own transaction, which holds the job row's lock already: one transaction (and one ``COMMIT``,
    the WAL flush) fewer per hop of a chain. ``runs(job_id, index, agent)`` says whether this worker takes
    such a step at all (a queue it consumes); ``spare()`` how many more of the steps that became ready
    together it can start at once beside that one (its process's free local slots): those are claimed in
    the same transaction too (``Dispatch.alongside``) instead of a message and a claim transaction each."""

    worker: str
    task_id: str | None
    settings: Settings
    runs: Callable[[str, int, str], bool]
    spare: Callable[[], int] = field(default=lambda: 0)
    beside: str | None = None
    """The worker name the steps claimed to run beside are recorded under (their thread is not known at
    the claim); ``worker`` when None."""


@dataclass(frozen=True)
class Taken:
    """A step claimed for a ``Taker`` (or refused at that claim): what ``run_taken`` runs."""

    job_id: str
    index: int
    agent: str
    claim: _Claimed | _Refused


class _TakeFailed(Exception):
    """Claiming a ready step inside an outcome's transaction raised: the outcome is recorded again
    without it, and the step goes the usual way (its own claim transaction, which fails it visibly)."""


# --- planning -------------------------------------------------------------------------------------


def plan_job(job_id: str, *, settings: Settings, take: Taker | None = None) -> Dispatch:
    """queued -> planning -> running: asks the planner, writes one row per step, dispatches the roots
    (with ``take``, claiming one of them for that worker in the same transaction: ``Dispatch.taken``).

    Each planning run holds a claim number; if the reconciler re-drove this job meanwhile (this worker
    looked dead), the newer claim wins and this one records nothing.
    """
    claimed = transaction(lambda s: _claim_planning(s, job_id))
    if claimed is None:
        return Dispatch()  # already planned, planning elsewhere, or cancelled
    claim, job, background = claimed
    if claim > settings.step_max_attempts:
        return fail_job(job_id, error_type=WORKER_LOST, plan_claim=claim,
                        message=f"planning was started {claim - 1} times and its worker never finished it")
    planned: list[PlanResult] = []  # the planner's result, once it has one: paid for, even if refused after
    try:
        check_deadline(job.limits, job.created_at, utcnow())
        # A slow planner is alive, not lost -- up to its longest possible run; past that it is stuck.
        with heartbeat(settings.step_lease_s).planning(job_id, claim, for_s=longest_planning_s(job, settings)):
            planned.append(make_plan(job, settings=settings, background=background))
            result = replay_plan(planned[0], job)
    except DeadlineExceeded as exc:
        return fail_job(job_id, error_type=ErrorType.DEADLINE_EXCEEDED, message=str(exc), plan_claim=claim)
    except PlanningOverBudget as exc:  # the budget has no room for a planner call
        return fail_job(job_id, error_type=ErrorType.BUDGET_EXCEEDED, message=str(exc), plan_claim=claim,
                        planner_usage=_usage_columns(exc.usage))
    except (ProviderError, WorkflowError) as exc:
        kind = ErrorType.PLANNER_ERROR if isinstance(exc, ProviderError) else ErrorType.INVALID_WORKFLOW
        return fail_job(job_id, error_type=kind, message=f"planning failed: {exc}", plan_claim=claim,
                        planner_usage=_planner_usage(planned))
    except Exception as exc:  # a bug must end the job visibly, not leave it 'planning' forever
        log.exception("planning job %s crashed", job_id)
        return fail_job(job_id, error_type=ErrorType.INTERNAL_ERROR, plan_claim=claim,
                        message=f"planning crashed ({type(exc).__name__}); see the planner worker's log",
                        planner_usage=_planner_usage(planned))
    wf = result.workflow
    over: list[str] = []
    lost: list[bool] = []
    taker = [take]

    def record(s: Session) -> Dispatch:
        over.clear()
        lost.clear()
        root_id = job.root_job_id
        # A top-level job has no steps and no children before its plan: only a child's tree is counted,
        # under its root's row lock (a tree's step count is checked and grown one plan at a time).
        in_tree = 0
        if root_id is not None:
            store.lock_job(s, job_id=root_id)
            in_tree = store.count_tree_steps(s, root_job_id=root_id)
        quiet = {job_id} if background else set()  # batch work: its messages go at the batch priority
        if in_tree + len(wf.steps) > settings.max_tree_steps:
            over.append(f"this job tree already has {in_tree} steps; {len(wf.steps)} more would pass the limit "
                        f"of {settings.max_tree_steps} (CONDUCTOR_MAX_TREE_STEPS)")
            return Dispatch()  # failed below, with the planner's usage (it was paid for)
        if not store.transition_job(s, job_id=job_id, from_=[JobStatus.PLANNING], to=JobStatus.RUNNING,
                                    plan_claim=claim, added=store.PLANNER_USAGE, **_plan_columns(result)):
            lost.append(True)  # cancelled while the planner ran, or this claim was superseded
            return Dispatch()
        rows = step_rows(s, job, wf)  # a replay's reusable steps arrive already succeeded
        done = [row["index"] for row in rows if row["status"] == StepStatus.SUCCEEDED]
        if len(done) == len(rows):
            store.insert_steps(s, steps=rows)
            return Dispatch(finalize=[job_id], background=quiet)
        roots = ready_steps(wf.dependencies, done=done, started=done)
        now = utcnow()
        for i in roots:  # inserted queued: no second statement to mark them
            rows[i].update(status=StepStatus.QUEUED, queued_at=now)
        agents = {i: wf.steps[i].agent for i in roots}
        take = None if background else taker[0]  # batch work goes through the broker, behind live work
        claims = _claim_roots(job, result, rows, roots, agents, take, now) if take else []
        ids = store.insert_steps(s, steps=rows, ids=bool(claims))
        taken = _opened_roots(s, job, claims, ids, agents, now)
        sent = [i for i in roots if i not in {t.index for t in taken}]
        return Dispatch(steps=[(job_id, i) for i in sent], agents={(job_id, i): agents[i] for i in sent},
                        taken=taken[0] if taken else None, alongside=taken[1:], background=quiet)

    patience = _recording_patience(settings)
    try:
        dispatch = patiently(record, within_s=patience)
    except _TakeFailed as exc:
        log.warning("job %s: claiming a root step with the plan raised %s; recording the plan without it",
                    job_id, type(exc.__cause__).__name__)
        taker[0] = None
        dispatch = patiently(record, within_s=patience)
    usage = _planner_usage([result])
    if lost:
        # The plan is dropped, what the planner cost is not. Outside ``record``, which runs again after a
        # commit whose reply was lost: this add must run once (a lost reply here under-counts instead).
        with session_scope() as s:
            added = store.add_lost_planner_usage(s, job_id=job_id, claim=claim, usage=usage)
        if added.carry_up:
            _carry_up([(job_id, _as_totals(usage))])
    if over:
        return fail_job(job_id, error_type=ErrorType.QUOTA_EXCEEDED, message=over[0], plan_claim=claim,
                        planner_usage=usage)
    return dispatch


def _claim_planning(s: Session, job_id: str) -> tuple[int, Job, bool] | None:
    """The planning's claim (``store.claim_planning_job``) and whether the job is batch work: a top-level job
    by its own ``batch_id``; a child job by its root's (``store.batch_work``), one statement more in the claim's
    transaction, for child jobs only."""
    claimed = store.claim_planning_job(s, job_id=job_id)
    if claimed is None:
        return None
    claim, job = claimed
    background = job.batch_id is not None or (
        job.root_job_id is not None and bool(store.batch_work(s, job_ids=[job_id])))
    return claim, job, background


@dataclass
class _RootClaim:
    index: int
    owner: str
    rendered: _Rendered


def _claim_roots(job: Job, result: PlanResult, rows: list[dict[str, Any]], roots: list[int], agents: dict[int, str],
                 take: Taker, now: datetime) -> list[_RootClaim]:
    """Claims the roots ``take`` takes (``_to_take``) before their rows are inserted: what ``_claim`` would
    read back for each (the job, what its planner and steps spent or hold, the outputs a root may see — a
    replay's reused steps) is in memory here, so each root is inserted ``running`` under its claim, with
    its messages and reservation, instead of inserted ``queued`` and then read and claimed by two more
    statements. One after another, as those claims would: each root's reservation counts against the
    next one's budget."""
    claims: list[_RootClaim] = []
    limits = job.limits or {}
    try:
        for i in _to_take(take, job.id, roots, agents, _pool(job.id, job.pool_config or {})):
            row = rows[i]
            # What the job's planners spent: this claim's, and any earlier superseded claim's on the row.
            tokens = (job.planner_input_tokens + job.planner_output_tokens + result.usage.input_tokens
                      + result.usage.output_tokens
                      + sum(r["input_tokens"] + r["output_tokens"] + r["reserved_tokens"] for r in rows))
            cost = job.planner_cost_usd + result.usage.cost_usd + sum(r["cost_usd"] + r["reserved_usd"] for r in rows)
            unstarted = sum(r["status"] in (StepStatus.PENDING, StepStatus.QUEUED) for r in rows)
            visible = [(rows[d]["instruction"], rows[d]["output"] or "") for d in sorted(row["access_list"])]
            step_input = store.StepInput(
                JobStatus.RUNNING, job.task, job.context, limits, job.pool_config or {}, job.created_at, tokens, cost,
                row["agent"], row["instruction"], list(row["access_list"]), job.tenant, unstarted, visible,
                answers=i == len(rows) - 1, index=i,
                workflow=[PlannedStep(r["agent"], list(r["access_list"]), r.get("reused_from") is not None)
                          for r in rows])
            rendered = _render(step_input, job.id, now, scope=take.settings.cache_scope(job.tenant))
            owner = _owner(take.worker if not claims else take.beside or take.worker)
            row.update(status=StepStatus.RUNNING, lease_owner=owner, started_at=now, celery_task_id=take.task_id,
                       lease_expires_at=now + timedelta(seconds=take.settings.step_lease_s),
                       attempts=1 if rendered.runs else 0, **rendered.values)
            claims.append(_RootClaim(i, owner, rendered))
    except Exception as exc:
        raise _TakeFailed from exc
    return claims


def _opened_roots(s: Session, job: Job, claims: list[_RootClaim], ids: dict[int, int], agents: dict[int, str],
                  now: datetime) -> list[Taken]:
    """The first attempts of the roots ``_claim_roots`` claimed (one statement), as ``Taken`` steps."""
    opened = store.open_attempts(s, attempts=[(ids[c.index], c.owner, now) for c in claims if c.rendered.runs])
    deadline = deadline_of(job.limits or {}, job.created_at)
    taken: list[Taken] = []
    for c in claims:
        step_id, r = ids[c.index], c.rendered
        claim: _Claimed | _Refused
        if r.refusal is not None:
            claim = _Refused(step_id, r.refusal, c.owner, 0)
        else:
            assert r.config is not None  # a recursive step is never taken
            claim = _Claimed(step_id, opened[step_id], 1, agents[c.index], r.messages, r.config, r.max_tokens,
                             deadline, c.owner, job.tenant, cache_points=r.cache_points)
        taken.append(Taken(job.id, c.index, agents[c.index], claim))
    return taken


def _planner_usage(planned: list[PlanResult]) -> dict[str, Any]:
    """The planner usage columns of a planning's result (none without one)."""
    return _usage_columns(planned[0].usage) if planned else {}


def _usage_columns(usage: PlannerUsage) -> dict[str, Any]:
    """A planning's usage as the job's planner columns (``store.PLANNER_USAGE``)."""
    return {"planner_input_tokens": usage.input_tokens, "planner_output_tokens": usage.output_tokens,
            "planner_cost_usd": usage.cost_usd, "planner_calls": usage.calls,
            "planner_cached_input_tokens": usage.cached_input_tokens,
            "planner_reasoning_tokens": usage.reasoning_tokens,
            "planner_cache_write_tokens": usage.cache_write_tokens}


def _plan_columns(result: PlanResult) -> dict[str, Any]:
    return {
        "planned_at": utcnow(),
        "workflow_source": result.source,
        "format_valid": result.format_valid,
        "planner_raw": result.raw_text,
        "planner_error": result.error,
        "planner_attempts": result.attempts,
        **_usage_columns(result.usage),
    }


# --- running one step -----------------------------------------------------------------------------
# Two transactions per step on the happy path: ``_claim`` (read what the step needs, claim it, open its
# attempt) and ``_record`` (lock the job row, record the outcome, close the attempt, and mark the steps
# that became ready, or finalize the job when this was its last step). A retry adds one transaction
# that closes the failed attempt and opens the next.


@dataclass
class _Claimed:
    step_id: int
    attempt_id: int
    attempt: int
    agent: str
    messages: list[Message]
    config: AgentConfig
    max_tokens: int
    deadline: datetime | None
    owner: str
    tenant: str
    background: bool = False
    """The job is batch work: its calls wait behind the tenant's live ones at the agent's rate limit."""
    cache_points: tuple[int, ...] = ()
    """Where its messages end a prefix another step of the job on its agent sends (``CallOptions``)."""


@dataclass
class _Refused:
    """Claimed, but it must not run (limits exhausted, re-driven too often): it fails without a call."""

    step_id: int
    error: ConductorError
    owner: str
    attempts: int


def _owner(worker: str) -> str:
    return f"{worker[:100]}#{uuid.uuid4().hex[:12]}"  # unique per claim; fits the 128-char columns


def run_step(
    job_id: str, index: int, *, worker: str, task_id: str | None, settings: Settings, take: Taker | None = None
) -> Dispatch:
    """Claims the step, renders its messages, calls its agent with retries, records the one outcome.
    With ``take``, the outcome may claim one of the steps it makes ready for that worker
    (``Dispatch.taken``)."""
    owner = _owner(worker)
    try:
        claimed = transaction(lambda s: _claim(s, job_id, index, owner=owner, task_id=task_id, settings=settings))
    except DATABASE_AWAY:
        raise  # the database is away: nothing was claimed, and the reconciler re-sends the step later
    except Exception as exc:  # a bug or a bad row: every re-send would fail the same way
        return _fail_unclaimable(job_id, index, owner, _internal(exc, job_id, index), settings)
    if isinstance(claimed, Dispatch):
        return claimed
    return _run_claimed(job_id, index, claimed, settings, take)


def run_taken(taken: Taken, *, settings: Settings, take: Taker | None = None) -> Dispatch:
    """Runs the step an outcome claimed for this worker (``Dispatch.taken``): what ``run_step`` does
    after its claim transaction."""
    return _run_claimed(taken.job_id, taken.index, taken.claim, settings, take)


def holding_taken(taken: Taken, settings: Settings) -> AbstractContextManager[None]:
    """Keeps the lease of a step claimed for this worker while it waits to be run: one claimed to run
    beside a task that found no local slot free waits for the task's own chain, and the reconciler must
    not hand it to another worker meanwhile (this one would still run it: two calls). At most
    ``max_steps`` steps' longest durations: past that the task is stuck and the lease is left to lapse."""
    longest = settings.step_max_duration_s(
        taken.claim.config.timeout_s if isinstance(taken.claim, _Claimed) else None)
    return heartbeat(settings.step_lease_s).holding(taken.claim.step_id, taken.claim.owner,
                                                    for_s=settings.max_steps * longest)


def _run_claimed(job_id: str, index: int, claimed: _Claimed | _Refused, settings: Settings,
                 take: Taker | None) -> Dispatch:
    if isinstance(claimed, _Refused):
        return _fail_step(job_id, claimed.step_id, claimed.error, attempts=0, owner=claimed.owner,
                          attempt_id=None, attempts_column=claimed.attempts)
    longest = settings.step_max_duration_s(claimed.config.timeout_s)
    with heartbeat(settings.step_lease_s).holding(claimed.step_id, claimed.owner, for_s=longest):
        return _call_and_record(job_id, index, claimed, settings, take)


def _fail_unclaimable(job_id: str, index: int, owner: str, error: InternalError, settings: Settings) -> Dispatch:
    """The claim transaction raised (and rolled back): claims the step bare and fails it, instead of
    leaving it queued for the reconciler to re-send forever."""

    def fail(s: Session) -> bool:
        claim = store.claim_step_row(s, job_id=job_id, index=index, owner=owner, lease_s=settings.step_lease_s,
                                     task_id=None, count_attempt=False)
        if claim is None:
            return False
        return store.record_step(s, step_id=claim.step_id, owner=owner, to=StepStatus.FAILED,
                                 error_type=error.error_type, error=str(error))

    return advance(job_id) if transaction(fail) else Dispatch()


def _call_and_record(job_id: str, index: int, claimed: _Claimed, settings: Settings, take: Taker | None) -> Dispatch:
    policy = RetryPolicy.from_settings(settings)
    timeout = claimed.config.timeout_s or settings.provider_timeout_s
    owner = claimed.owner
    attempt_id, n = claimed.attempt_id, claimed.attempt
    while True:
        options = CallOptions(
            temperature=claimed.config.temperature,
            max_tokens=claimed.max_tokens,
            timeout_s=timeout,
            attempt=n,
            cache_points=claimed.cache_points,
        )
        started = time.monotonic()
        try:
            provider = provider_for(claimed.agent, claimed.config)
            wait_for_rate_limit(claimed.config.bucket(claimed.agent), claimed.config.rpm, settings,
                                tenant=claimed.tenant, background=claimed.background)
            completion = provider.complete(claimed.messages, options)
        except Exception as raised:
            exc: ProviderError | ConductorError = (
                raised if isinstance(raised, ProviderError) else _internal(raised, job_id, index)
            )
            elapsed = int((time.monotonic() - started) * 1000)
            if isinstance(exc, ProviderError) and policy.should_retry(n, exc):
                delay = policy.delay(n, exc)
                if claimed.deadline is not None and utcnow() + timedelta(seconds=delay) >= claimed.deadline:
                    late = DeadlineExceeded(f"{exc}; no time left for another attempt before the job's deadline")
                    return _fail_step(job_id, claimed.step_id, late, attempts=n, owner=owner,
                                      attempt_id=attempt_id, latency_ms=elapsed, attempt_error=exc)
                log.info("step %s/%s attempt %s: %s; retrying in %.2fs", job_id, index, n, exc, delay)

                def close_failed(s: Session, attempt_id: int = attempt_id, exc: ProviderError = exc,
                                 elapsed: int = elapsed) -> None:
                    store.finish_attempt(s, attempt_id=attempt_id, latency_ms=elapsed,
                                         error_type=exc.error_type, error=str(exc))

                transaction(close_failed)
                time.sleep(delay)  # the heartbeat keeps the lease meanwhile

                def open_next(s: Session, following: int = n + 1) -> int | None:
                    return store.next_attempt(s, step_id=claimed.step_id, owner=owner, n=following,
                                              lease_s=settings.step_lease_s)

                opened = transaction(open_next)
                if opened is None:
                    return Dispatch()  # cancelled, the job failed, or another worker took the step over
                attempt_id, n = opened, n + 1
                continue
            return _fail_step(job_id, claimed.step_id, exc, attempts=n, owner=owner, attempt_id=attempt_id,
                              latency_ms=elapsed, attempt_error=exc)
        columns = _completion_columns(completion, claimed.config)
        return _record_success(job_id, index, claimed.step_id, owner, attempt_id, completion, columns, take)


def _internal(exc: Exception, job_id: str, index: int) -> InternalError:
    log.exception("step %s/%s: unexpected %s", job_id, index, type(exc).__name__, exc_info=exc)
    return InternalError(f"unexpected {type(exc).__name__} around the provider call; see the worker's log")


@dataclass
class _Rendered:
    """What claiming a step writes (``values``: its messages, model and budget reservation) and what its
    run needs, decided from its input alone."""

    recursive: bool
    visible: list[tuple[str, str]]
    inherited: list[Message]
    messages: list[Message]
    values: dict[str, Any]
    config: AgentConfig | None
    max_tokens: int
    limits: dict[str, Any]
    """A recursive step's child limits (what is left of its parent's)."""
    refusal: BudgetExceeded | DeadlineExceeded | None
    cache_points: tuple[int, ...] = ()
    """Where its messages end a prefix another step of the job on its agent sends, for an agent that caches
    prompts on request (``caches_on_request``); none otherwise."""

    @property
    def runs(self) -> bool:
        """It calls its agent: an attempt is counted and opened with the claim."""
        return self.refusal is None and not self.recursive


def _render(row: store.StepInput, job_id: str, now: datetime, *, scope: str) -> _Rendered:
    """``scope``: the tenant's prompt cache scope (``Settings.cache_scope``)."""
    visible = row.visible
    inherited = [Message(m["role"], m["content"]) for m in (row.context or [])]
    messages = worker_messages(task=row.task, visible=visible, instruction=row.instruction, inherited=inherited,
                               scope=scope)
    spent = Spent(tokens=row.spent_tokens, cost_usd=row.spent_cost_usd)
    recursive = row.agent == CONDUCTOR_AGENT
    refusal: BudgetExceeded | DeadlineExceeded | None = None
    max_tokens = 0
    values: dict[str, Any] = {"messages": [m.as_dict() for m in messages]}
    config: AgentConfig | None = None
    remaining_limits: dict[str, Any] = {}
    points: tuple[int, ...] = ()
    try:
        check_deadline(row.limits, row.created_at, now)
        if recursive:
            remaining_limits = child_limits(row.limits, row.created_at, spent, now, shares=row.unstarted)
            if not row.answers:  # the child's answer is not the job's: its last step keeps its agent's cap
                remaining_limits.pop("max_answer_tokens", None)
            held = child_reservation(remaining_limits)
            values.update(reserved_usd=held.cost_usd, reserved_tokens=held.tokens)
        else:
            config = _pool(job_id, row.pool_config).agents[row.agent]
            values.update(provider=config.provider, model=config.model or f"sim-{row.agent}")
            if caches_on_request(config) and 0 <= row.index < len(row.workflow):
                points = cache_points(row.index, row.workflow, inherited=len(inherited))
            sizes = [estimate_tokens(m.content) for m in messages]
            prompt_tokens = sum(sizes)
            writable = sum(sizes[:points[-1] + 1]) if points else 0  # the prefix up to its last cache point
            price = config.billing
            hour = caches_for_an_hour(config)
            max_tokens = allowed_output_tokens(
                row.limits, spent, prompt_tokens=prompt_tokens, max_tokens=_step_cap(row, config), price=price,
                cache_write_tokens=writable, cache_write_1h=hour,
            )
            held = step_reservation(row.limits, prompt_tokens=prompt_tokens, max_tokens=max_tokens, price=price,
                                    cache_write_tokens=writable, cache_write_1h=hour)
            values.update(reserved_usd=held.cost_usd, reserved_tokens=held.tokens)
    except (BudgetExceeded, DeadlineExceeded) as exc:
        refusal = exc
        values.update(RELEASED)
    return _Rendered(recursive, visible, inherited, messages, values, config, max_tokens, remaining_limits, refusal,
                     points)


def _step_cap(row: store.StepInput, config: AgentConfig) -> int:
    """The most a step may write before the job's budgets: its agent's ``max_tokens``, and for the answering
    step the job's ``max_answer_tokens`` if lower (a client's cap on the answer: the OpenAI routes'
    ``max_output_tokens``). A cut answer stops with ``length``, which the routes tell (incomplete)."""
    cap = row.limits.get("max_answer_tokens")
    return min(config.max_tokens, int(cap)) if row.answers and cap is not None else config.max_tokens


def _claim(
    s: Session, job_id: str, index: int, *, owner: str, task_id: str | None, settings: Settings
) -> _Claimed | _Refused | Dispatch:
    """The claim transaction: one read of the job and this step, one of the visible outputs, the claim
    (``UPDATE … RETURNING``, with the step's budget reservation) and the attempt's insert. A job with a
    budget is read again under its row lock, so its steps reserve one at a time and none spends what
    another holds."""
    row = store.read_step_input(s, job_id=job_id, index=index)
    if row is not None and (row.limits.get("max_cost_usd") is not None or row.limits.get("max_tokens") is not None):
        store.lock_job(s, job_id=job_id)
        row = store.read_step_input(s, job_id=job_id, index=index)
    if row is None or row.job_status != JobStatus.RUNNING:
        return Dispatch()
    r = _render(row, job_id, utcnow(), scope=settings.cache_scope(row.tenant))
    claim = store.claim_step_row(
        s, job_id=job_id, index=index, owner=owner, lease_s=settings.step_lease_s, task_id=task_id,
        count_attempt=r.runs, open_below=settings.step_max_attempts, **r.values,
    )
    if claim is None:
        return Dispatch()  # finished, running under a live lease elsewhere, not due, or the job ended
    if claim.attempts:
        store.close_lost_attempts(s, step_id=claim.step_id, keep=claim.attempt_id)
    if claim.attempts >= settings.step_max_attempts and not r.recursive:
        return _Refused(claim.step_id, StepAbandoned(
            f"the worker running this step stopped mid-call; gave up after {claim.attempts} attempts"), owner,
            claim.attempts)
    if r.refusal is not None:
        return _Refused(claim.step_id, r.refusal, owner, claim.attempts)
    if r.recursive:
        job = store.get_job(s, job_id=job_id)
        assert job is not None
        return _start_child(s, job, claim.step_id, index, row.instruction, visible=r.visible, inherited=r.inherited,
                            messages=r.messages, limits=r.limits, background=row.background)
    assert r.config is not None and claim.attempt_id is not None  # opened with the claim: it runs, below the cap
    return _Claimed(claim.step_id, claim.attempt_id, claim.attempts + 1, row.agent, r.messages, r.config,
                    r.max_tokens, deadline_of(row.limits, row.created_at), owner, row.tenant, row.background,
                    r.cache_points)


_POOLS: dict[str, PoolConfig] = {}
_POOLS_MAX = 256


def _pool(job_id: str, snapshot: dict[str, Any]) -> PoolConfig:
    """A job's pool snapshot never changes: it is validated once per job per process, not once per step."""
    pool = _POOLS.get(job_id)
    if pool is None:
        pool = PoolConfig.model_validate(snapshot)
        if len(_POOLS) >= _POOLS_MAX:
            _POOLS.clear()
        _POOLS[job_id] = pool
    return pool


def _start_child(
    s: Session,
    job: Job,
    step_id: int,
    index: int,
    instruction: str,
    *,
    visible: list[tuple[str, str]],
    inherited: list[Message],
    messages: list[Message],
    limits: dict[str, Any],
    background: bool = False,
) -> Dispatch:
    """A recursive step: a child job plans and runs with this step's subtask and visible context, within
    what is left of its parent's deadline and budgets. A child of batch work (``background``) is batch work:
    its plan goes at the batch priority, as its steps will (its ``batch_id`` stays unset: it is not a line)."""
    child = Job(
        tenant=job.tenant,
        task=f"{job.task}\n\n---\nSubtask from the parent workflow (step {index}):\n{instruction}",
        pool=job.pool,
        pool_config=job.pool_config,
        planner=job.planner,
        depth=job.depth + 1,
        parent_job_id=job.id,
        parent_step_index=index,
        root_job_id=job.root_job_id or job.id,
        context=[m.as_dict() for m in [*inherited, *turns_as_messages(visible)]],
        limits=limits,
        meta={},
    )
    s.add(child)
    s.flush()
    store.update_step(
        s,
        step_id=step_id,
        messages=[m.as_dict() for m in messages],
        provider="conductor",
        model=job.planner,
        child_job_id=child.id,
        lease_expires_at=None,
    )
    return Dispatch(plan=[child.id], background={child.id} if background else set())


def _completion_columns(c: Completion, config: AgentConfig) -> dict[str, Any]:
    return {
        "output": c.text,
        "finish_reason": c.finish_reason,
        "model": c.model,
        "input_tokens": c.input_tokens,
        "output_tokens": c.output_tokens,
        "cost_usd": config.billing.cost(c.input_tokens, c.output_tokens, c.cached_input_tokens, c.cache_write_tokens,
                                        c.cache_write_1h_tokens),
        "cached_input_tokens": c.cached_input_tokens,
        "reasoning_tokens": c.reasoning_tokens,
        "cache_write_tokens": c.cache_write_tokens,
        "latency_ms": c.latency_ms,
        "error": None,
        "error_type": None,
    }


def _fail_step(
    job_id: str,
    step_id: int,
    exc: ProviderError | ConductorError,
    *,
    attempts: int,
    owner: str,
    attempt_id: int | None,
    latency_ms: int = 0,
    attempt_error: ProviderError | ConductorError | None = None,
    attempts_column: int | None = None,
) -> Dispatch:
    """The outcome transaction of a step that failed: closes its attempt, records the failure; the job
    then fails (its other steps are skipped)."""
    reason = "gave up after" if exc.retryable else "not retryable, after"
    message = f"{exc} ({reason} {attempts} attempt{'s' if attempts != 1 else ''})" if attempts else str(exc)
    extra: dict[str, Any] = {} if attempts_column is None else {"attempts": attempts_column}

    def record(s: Session) -> bool:
        store.lock_job(s, job_id=job_id)
        failed = attempt_error or exc
        closing = None if attempt_id is None else store.AttemptEnd(
            attempt_id, latency_ms, error_type=failed.error_type, error=str(failed))
        return store.record_step(s, step_id=step_id, owner=owner, to=StepStatus.FAILED, closing=closing,
                                 error_type=exc.error_type, error=message, **extra)

    if not patiently(record, within_s=_recording_patience(get_settings())):
        return Dispatch()
    return advance(job_id)


def _recording_patience(settings: Settings) -> float:
    """How long recording a paid call's outcome (or a plan) keeps trying while the database is away: two
    leases. The heartbeat holds the claim meanwhile if it can; a try after the lease lapsed is fenced off
    and only adds the call's usage. Given up, the work is re-run (and paid again) after its lease."""
    return 2 * settings.step_lease_s


def _record_success(
    job_id: str, index: int, step_id: int, owner: str, attempt_id: int, completion: Completion,
    columns: dict[str, Any], take: Taker | None = None,
) -> Dispatch:
    """The outcome transaction: locks the job row, records the answer, closes the attempt, and then
    either marks the steps that became ready (one ``UPDATE … RETURNING``), claiming one of them for
    ``take``, or finalizes the job."""
    parent: list[str] = []
    ended: list[str] = []
    carry: list[tuple[str, dict[str, Any]]] = []
    taker = [take]

    def record(s: Session) -> Dispatch | None:
        parent.clear()
        ended.clear()
        carry.clear()
        closing = store.AttemptEnd(attempt_id, completion.latency_ms)
        head, recorded, steps = store.lock_job_and_record(s, job_id=job_id, step_id=step_id, owner=owner,
                                                          to=StepStatus.SUCCEEDED, closing=closing, **columns)
        if not recorded:
            # Cancelled or taken over meanwhile: the answer is dropped, its cost is not.
            usage = {"input_tokens": completion.input_tokens, "output_tokens": completion.output_tokens,
                     "cost_usd": columns["cost_usd"], "cached_input_tokens": completion.cached_input_tokens,
                     "reasoning_tokens": completion.reasoning_tokens,
                     "cache_write_tokens": completion.cache_write_tokens}
            if store.add_unrecorded_usage(s, step_id=step_id, job_id=job_id, **usage):
                carry.append((job_id, usage))  # the job had ended: a parent it has needs it too
            return Dispatch()
        if head is None or head.status != JobStatus.RUNNING:
            return Dispatch()
        if any(st.status == StepStatus.FAILED for st in steps):
            return None  # another step failed: the job fails, after this commit
        if all(st.status == StepStatus.SUCCEEDED for st in steps):
            answer = columns["output"] if index == steps[-1].index else store.step_output(
                s, job_id=job_id, index=steps[-1].index)
            if _finalize(s, head, steps, answer, carry):
                ended.append(job_id)
                parent.extend([head.parent_job_id] if head.parent_job_id is not None else [])
            return Dispatch(webhooks=_webhooks_owed(s, job_id, head) if ended else [])
        return _dispatch_ready(s, job_id, steps, taker[0], background=head.background)

    patience = _recording_patience(get_settings())
    try:
        outcome = patiently(record, within_s=patience)
    except _TakeFailed as exc:
        log.warning("job %s: claiming a ready step with step %s's outcome raised %s; recording the outcome "
                    "without it", job_id, index, type(exc.__cause__).__name__)
        taker[0] = None
        outcome = patiently(record, within_s=patience)
    _carry_up(carry)
    if outcome is None:
        return advance(job_id)
    for done in ended:
        telemetry.job_ended(done)
    for parent_id in parent:
        outcome += advance(parent_id)
    return outcome


def _dispatch_ready(s: Session, job_id: str, steps: list[store.StepHead], take: Taker | None = None, *,
                    background: bool = False) -> Dispatch:
    """Marks the steps that became ready and names them (claiming one for ``take``). The caller's last
    statement: unless a step is claimed, the transaction is committed with the marking.

    ``background``: the job is batch work (``JobHead.background``). Its ready steps are all sent, at the batch
    priority, and none is claimed for ``take``: a worker that continued a batch's chain (or started its
    parallel steps beside it) would run batch work while live messages waited on the broker for its slot."""
    if background:
        take = None
    done = [st.index for st in steps if st.status == StepStatus.SUCCEEDED]
    started = [st.index for st in steps if st.status != StepStatus.PENDING]
    ready = ready_steps([st.access_list for st in steps], done=done, started=started)
    agent = {st.index: st.agent for st in steps}
    takes = take is not None and any(_takes(take, job_id, i, agent[i]) for i in ready)
    # The marking is the transaction's last statement unless a step is claimed after it: its COMMIT then
    # goes in the same round trip (the caller's own commit finds nothing left to do).
    won = store.mark_steps_queued(s, job_id=job_id, indices=ready, commit=not takes)
    taken, alongside = _take(s, job_id, won, agent, take) if take is not None and takes else (None, [])
    claimed = {t.index for t in alongside} | ({taken.index} if taken is not None else set())
    sent = [i for i in won if i not in claimed]
    return Dispatch(steps=[(job_id, i) for i in sent], agents={(job_id, i): agent[i] for i in sent}, taken=taken,
                    alongside=alongside, background={job_id} if background else set())


def _takes(take: Taker, job_id: str, index: int, agent: str) -> bool:
    return agent != CONDUCTOR_AGENT and take.runs(job_id, index, agent)


def _to_take(take: Taker | None, job_id: str, ready: list[int], agents: dict[int, str],
             pool: PoolConfig | None) -> list[int]:
    """Of ``ready``, the steps ``take`` claims: the first it runs, and up to ``take.spare()`` more that
    may run beside it (``_runs_beside``; none when the job's pool is not known here)."""
    if take is None:
        return []
    mine = [i for i in ready if _takes(take, job_id, i, agents[i])]
    if len(mine) <= 1:
        return mine
    beside = [i for i in mine[1:] if pool is not None and _runs_beside(pool, agents[i])]
    return [mine[0], *beside[:max(0, take.spare())]]


def _runs_beside(pool: PoolConfig, agent: str) -> bool:
    """A step may run on a local slot beside its task unless its agent is a model loaded in this process
    (provider ``local``): its calls run one at a time per loaded model, so on a slot it would only wait
    for the model's lock (and could time out there), where sent, another worker process — with its own
    copy of the model — can run it."""
    config = pool.agents.get(agent)
    return config is not None and config.provider != "local"


def _take(s: Session, job_id: str, ready: list[int], agents: dict[int, str],
          take: Taker) -> tuple[Taken | None, list[Taken]]:
    """Claims the first of ``ready`` that ``take`` runs, and up to ``take.spare()`` more to run beside it,
    in the caller's transaction (``_claim``, as each step's own claim transaction would). A nested
    conductor step is left to its own claim: it starts a child job. A step that cannot be claimed here is
    simply sent."""
    claims: list[Taken] = []
    for i in _to_take(take, job_id, ready, agents, _POOLS.get(job_id)):  # known here after running a step of it
        worker = take.worker if not claims else take.beside or take.worker
        try:
            claimed = _claim(s, job_id, i, owner=_owner(worker), task_id=take.task_id, settings=take.settings)
        except DATABASE_AWAY:
            raise  # the database is away: the whole outcome is retried or left to the reconciler, as before
        except Exception as exc:
            raise _TakeFailed from exc
        if isinstance(claimed, Dispatch):
            break  # the job is no longer running (or the step is not due): send the rest, which finds out
        claims.append(Taken(job_id, i, agents[i], claimed))
    return (claims[0], claims[1:]) if claims else (None, [])


def _finalize(s: Session, head: store.JobHead, steps: list[store.StepHead], answer: str | None,
              carry: list[tuple[str, dict[str, Any]]]) -> bool:
    """running -> succeeded with the last step's output as the answer and the totals; a child job also
    settles its parent's recursive step (the caller then advances the parent; if the parent had already
    closed the step, the caller carries the totals up after commit: ``carry``)."""
    totals = _totals(head, steps)
    finished = utcnow()
    if not store.transition_job(s, job_id=head.id, from_=[JobStatus.RUNNING], to=JobStatus.SUCCEEDED,
                                answer=answer, finished_at=finished, **totals):
        return False
    if head.parent_job_id is not None and not _settle_parent_step(
            s, head, succeeded=True, answer=answer, totals=totals, finished_at=finished):
        carry.append((head.id, totals))
    return True


# --- progress, completion and failure -------------------------------------------------------------


def advance(job_id: str) -> Dispatch:
    """After any step finished (and for the reconciler): fail the job, finalize it, or dispatch the
    steps that became ready. Locks the job row like the outcome transaction."""
    parent: list[str] = []
    ended: list[str] = []
    carry: list[tuple[str, dict[str, Any]]] = []

    def decide(s: Session) -> Dispatch | tuple[ErrorType, str, int]:
        parent.clear()
        ended.clear()
        carry.clear()
        head = store.lock_job(s, job_id=job_id)
        if head is None or head.status != JobStatus.RUNNING:
            return Dispatch()
        steps = store.step_heads(s, job_id=job_id)
        failed = [st for st in steps if st.status == StepStatus.FAILED]
        if failed:
            first = failed[0]
            return ErrorType(first.error_type or ErrorType.STEP_FAILED), first.error or "", first.index
        if steps and all(st.status == StepStatus.SUCCEEDED for st in steps):
            answer = store.step_output(s, job_id=job_id, index=steps[-1].index)
            if _finalize(s, head, steps, answer, carry):
                ended.append(job_id)
                parent.extend([head.parent_job_id] if head.parent_job_id is not None else [])
            return Dispatch(webhooks=_webhooks_owed(s, job_id, head) if ended else [])
        return _dispatch_ready(s, job_id, steps, background=head.background)

    outcome = transaction(decide)
    _carry_up(carry)
    if isinstance(outcome, tuple):
        error_type, message, index = outcome
        return fail_job(job_id, error_type=error_type, message=f"step {index} failed: {message}", step=index)
    for done in ended:
        telemetry.job_ended(done)
    for parent_id in parent:
        outcome += advance(parent_id)
    return outcome


def finalize_job(job_id: str) -> Dispatch:
    """running -> succeeded when every step succeeded (the engine finalizes inline; this remains for a
    ``finalize`` message already on the broker)."""
    return advance(job_id)


def fail_job(
    job_id: str, *, error_type: ErrorType, message: str, step: int | None = None, plan_claim: int | None = None,
    planner_usage: dict[str, Any] | None = None,
) -> Dispatch:
    """Fails the job with a readable error; its unfinished steps (running ones too) become ``skipped``; a
    parent step fails.

    From planning (``plan_claim`` given) only a job still in that planning claim can be failed, so a
    superseded planner cannot fail a job another planner already started; ``planner_usage`` (that
    planning's calls, whose plan is not recorded) is added to the job's either way.
    """
    planning = {k: v for k, v in (planner_usage or {}).items() if k in store.PLANNER_USAGE}
    failing = [JobStatus.PLANNING] if plan_claim is not None else [JobStatus.QUEUED, JobStatus.PLANNING,
                                                                    JobStatus.RUNNING]
    carry: list[tuple[str, dict[str, Any]]] = []
    with session_scope() as s:
        # Under the job row's lock, like every outcome: one committing meanwhile is in the totals.
        job = store.get_job(s, job_id=job_id) if store.lock_job(s, job_id=job_id) is not None else None
        if job is None or job.status not in failing or (plan_claim is not None and job.plan_claims != plan_claim):
            # Cancelled or re-claimed while this planning ran: its planner's calls still count.
            if job is not None and plan_claim is not None and planning and store.add_lost_planner_usage(
                    s, job_id=job_id, claim=plan_claim, usage=planning).carry_up:
                carry.append((job_id, _as_totals(planning)))
            job = None
        else:
            if plan_claim is None:  # a job still planning has no steps yet
                # Steps are closed before they are summed: closing one that a child job is settling
                # meanwhile (under the child's lock, not this one) waits for it, so the sum below sees the
                # child's spend. A step mid-call is closed too: its answer is dropped when the call ends
                # and its usage joins the job's totals (``add_unrecorded_usage``), and a retryable error
                # of it is not retried.
                store.close_open_steps(s, job_id=job_id, to=StepStatus.SKIPPED)
            totals = _totals(job, store.get_steps(s, job_id=job_id, light=True))
            for column, total in store.PLANNER_TOTALS.items():
                totals[total] += planning.get(column, 0)
            if not store.transition_job(
                s,
                job_id=job_id,
                from_=failing,
                to=JobStatus.FAILED,
                plan_claim=plan_claim,
                added=tuple(planning),
                error_type=error_type,
                error_message=message,
                error_step=step,
                finished_at=utcnow(),
                **planning,
                **totals,
            ):
                # Only on SQLite, whose read above takes no lock: the job ended meanwhile (its steps were
                # closed already, so the close above changed nothing).
                return Dispatch()
            hooks = _webhooks_owed(s, job_id)
            children = [c.id for c in store.get_children(s, job_id=job_id) if c.status not in JobStatus.TERMINAL]
            parent_id = job.parent_job_id
            if parent_id is not None and not _settle_parent_step(s, job, succeeded=False, answer=None,
                                                                 totals=totals, error=message):
                carry.append((job_id, totals))
    _carry_up(carry)
    if job is None:
        return Dispatch()
    for child in children:
        cancel_job(child)  # a failed parent's running sub-workflows are stopped, not left to spend
    telemetry.job_ended(job_id)
    return advance(parent_id) if parent_id is not None else Dispatch(webhooks=hooks)


def _as_totals(planner_usage: dict[str, Any]) -> dict[str, Any]:
    """Planner usage as the usage columns of a job's totals (what carrying up adds)."""
    return {total: planner_usage.get(column, 0) for column, total in store.PLANNER_TOTALS.items()}


class _JobUsage(Protocol):
    @property
    def planner_input_tokens(self) -> int: ...
    @property
    def planner_output_tokens(self) -> int: ...
    @property
    def planner_cost_usd(self) -> float: ...
    @property
    def planner_calls(self) -> int: ...
    @property
    def planner_cached_input_tokens(self) -> int: ...
    @property
    def planner_reasoning_tokens(self) -> int: ...
    @property
    def planner_cache_write_tokens(self) -> int: ...


class _ChildJob(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def parent_job_id(self) -> str | None: ...
    @property
    def parent_step_index(self) -> int | None: ...


class _StepUsage(Protocol):
    @property
    def agent(self) -> str: ...
    @property
    def attempts(self) -> int: ...
    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def cost_usd(self) -> float: ...
    @property
    def cached_input_tokens(self) -> int: ...
    @property
    def reasoning_tokens(self) -> int: ...
    @property
    def cache_write_tokens(self) -> int: ...


def _webhooks_owed(s: Session, job_id: str, head: store.JobHead | None = None) -> list[str]:
    """In the transaction that ended the job: the webhook delivery it is owed (an outbox row). With the
    job's ``head`` (read under its lock) a job without a webhook URL skips the insert."""
    if head is not None and not head.has_webhook:
        return []
    delivery = webhook_store.record_job_end(s, job_id=job_id)
    return [delivery] if delivery else []


def _settle_parent_step(
    s: Session,
    child: _ChildJob,
    *,
    succeeded: bool,
    answer: str | None,
    totals: dict[str, Any],
    error: str | None = None,
    finished_at: datetime | None = None,
) -> bool:
    """Records a child job's end on its parent's recursive step; False when the step no longer takes it
    (the parent ended first and closed it): the caller then carries the child's usage up (``_carry_up``)."""
    assert child.parent_job_id is not None and child.parent_step_index is not None
    step = store.get_step(s, job_id=child.parent_job_id, index=child.parent_step_index)
    if step is None or step.id is None:
        return True  # nothing to settle
    latency = int(((finished_at or utcnow()) - child.created_at).total_seconds() * 1000)
    values: dict[str, Any] = {
        "input_tokens": totals["input_tokens"],
        "output_tokens": totals["output_tokens"],
        "cost_usd": totals["cost_usd"],
        "cached_input_tokens": totals["cached_input_tokens"],
        "reasoning_tokens": totals["reasoning_tokens"],
        "cache_write_tokens": totals["cache_write_tokens"],
        "latency_ms": latency,
    }
    if succeeded:
        values.update(output=answer, finish_reason=store.CHILD_SUCCEEDED)
        return store.finish_step(s, step_id=step.id, from_=[StepStatus.RUNNING], to=StepStatus.SUCCEEDED, **values)
    values.update(error_type=ErrorType.CHILD_JOB_FAILED, error=f"child job {child.id} failed: {error}")
    return store.finish_step(s, step_id=step.id, from_=[StepStatus.RUNNING], to=StepStatus.FAILED, **values)


def _carry_up(carry: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """After commit: usage a child job gained that its parent's recursive step did not take (the parent
    ended first, or the usage came after the child ended) is added to that step and, level by level, to
    every ancestor that has ended too -- one short transaction per level, each under one job row's lock
    (a transaction holding a child's and then its parent's lock could deadlock with a plan, which locks
    the root and then the child). Each level's add runs once (not in a ``transaction`` that runs its body
    again after a commit whose reply was lost): best effort, a failure leaves the totals short, never the
    job stuck nor counted twice."""
    for job_id, usage in carry:
        current: str | None = job_id
        try:
            while current is not None:
                with session_scope() as s:
                    current = store.add_usage_to_parent(s, job_id=current, usage=usage)
        except Exception:
            log.exception("carrying job %s's late usage to its ancestors failed; their totals are short by it",
                          job_id)


def _totals(job: _JobUsage, steps: Sequence[_StepUsage]) -> dict[str, Any]:
    return {
        "input_tokens": job.planner_input_tokens + sum(st.input_tokens for st in steps),
        "output_tokens": job.planner_output_tokens + sum(st.output_tokens for st in steps),
        "cost_usd": job.planner_cost_usd + sum(st.cost_usd for st in steps),
        "calls": job.planner_calls + sum(st.attempts for st in steps if st.agent != CONDUCTOR_AGENT),
        "cached_input_tokens": job.planner_cached_input_tokens + sum(st.cached_input_tokens for st in steps),
        "reasoning_tokens": job.planner_reasoning_tokens + sum(st.reasoning_tokens for st in steps),
        "cache_write_tokens": job.planner_cache_write_tokens + sum(st.cache_write_tokens for st in steps),
    }


# --- cancellation ---------------------------------------------------------------------------------


def cancel_job(job_id: str) -> bool:
    """Queued steps never start; running ones finish their current call and their answer is dropped.

    Child jobs are cancelled too. A child cancelled on its own fails its parent's recursive step, so
    the parent ends (failed) instead of waiting forever. Returns False when the job had already ended.
    """
    with session_scope() as s:
        # Under the job row's lock, like every outcome: one committing meanwhile is in the totals.
        before = store.get_job(s, job_id=job_id) if store.lock_job(s, job_id=job_id) is not None else None
        if before is None:
            return False
        won, totals = False, {}
        if before.status not in JobStatus.TERMINAL:
            # Closed before summed (as in ``fail_job``): a child settling one of these steps meanwhile is
            # waited for, so its spend is in the totals.
            store.close_open_steps(s, job_id=job_id, to=StepStatus.CANCELLED)
            totals = _totals(before, store.get_steps(s, job_id=job_id, light=True))
            won = store.transition_job(
                s,
                job_id=job_id,
                from_=[JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING],
                to=JobStatus.CANCELLED,
                cancel_requested=True,
                finished_at=utcnow(),
                error_type=ErrorType.CANCELLED,
                error_message="the job was cancelled",
                **totals,
            )
        if won:
            _webhooks_owed(s, job_id)  # sent by the caller (send_webhooks_of) or the reconciler
        children = [c.id for c in store.get_children(s, job_id=job_id)]
        parent_id = before.parent_job_id if won else None
        settled = parent_id is None or _settle_parent_step(s, before, succeeded=False, answer=None, totals=totals,
                                                           error="it was cancelled")
    if not settled:
        _carry_up([(job_id, totals)])
    for child in children:
        cancel_job(child)
    if won:
        telemetry.job_ended(job_id)
    if parent_id is not None:
        # The parent's recursive step just failed, so advancing it fails the parent: that sends no
        # message (anything else due would be re-sent by the reconciler from the rows).
        advance(parent_id)
    return won


def settle_from_children(job_id: str) -> Dispatch:
    """For the reconciler: recursive steps whose child job already ended but never resumed this job
    (the child's finalize was lost) are settled now. Under the job row's lock, like every transaction that
    writes several of a job's steps: a cancel or failure of the job closing them meanwhile (which holds
    that lock) waits for it, or it for them, instead of each holding a step the other needs. The lock is
    taken only when such a step exists (most running jobs have none, and a pass reaches up to 500 of them:
    each lock would wait for, and hold up, that job's step outcomes); the steps are read again under it."""
    dispatch = Dispatch()
    with session_scope() as s:
        if not store.running_steps_with_children(s, job_id=job_id):
            return dispatch
    with session_scope() as s:
        store.lock_job(s, job_id=job_id)
        waiting = store.running_steps_with_children(s, job_id=job_id)  # by id
        ended = []
        for step in waiting:
            child = store.get_job(s, job_id=step.child_job_id or "")
            if child is not None and child.status in JobStatus.TERMINAL:
                ended.append(child)
        for child in ended:
            totals = _totals(child, store.get_steps(s, job_id=child.id))
            reason = child.error_message or child.status
            _settle_parent_step(s, child, succeeded=child.status == JobStatus.SUCCEEDED, answer=child.answer,
                                totals=totals, error=reason, finished_at=child.finished_at)
    if ended:
        dispatch += advance(job_id)
    return dispatch
