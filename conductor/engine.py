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
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlmodel import Session

from conductor.budget import (
    BudgetExceeded,
    DeadlineExceeded,
    Spent,
    allowed_output_tokens,
    check_deadline,
    child_limits,
    deadline_of,
    estimate_tokens,
)
from conductor.context import turns_as_messages, worker_messages
from conductor.planning.base import PlanResult
from conductor.planning.planner import make_plan
from conductor.pool.base import CallOptions, Completion, Message
from conductor.pool.config import AgentConfig, PoolConfig
from conductor.pool.errors import FatalError, ProviderError
from conductor.pool.registry import provider_for
from conductor.ratelimit import get_limiter
from conductor.retry import RetryPolicy
from conductor.settings import Settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.jobs import WORKER_LOST
from conductor.store.models import Job, JobStatus, Step, StepStatus, utcnow
from conductor.workflow import CONDUCTOR_AGENT, WorkflowError, ready_steps

log = logging.getLogger(__name__)


@dataclass
class Dispatch:
    """Messages to send after a state change was committed."""

    plan: list[str] = field(default_factory=list)
    steps: list[tuple[str, int]] = field(default_factory=list)
    finalize: list[str] = field(default_factory=list)

    def __iadd__(self, other: Dispatch) -> Dispatch:
        self.plan += other.plan
        self.steps += other.steps
        self.finalize += other.finalize
        return self

    def __bool__(self) -> bool:
        return bool(self.plan or self.steps or self.finalize)


# --- planning -------------------------------------------------------------------------------------


def plan_job(job_id: str, *, settings: Settings) -> Dispatch:
    """queued -> planning -> running: asks the planner, writes one row per step, dispatches the roots.

    Each planning run holds a claim number; if the reconciler re-drove this job meanwhile (this worker
    looked dead), the newer claim wins and this one records nothing.
    """
    with session_scope() as s:
        claim = store.claim_planning(s, job_id=job_id)
        if claim is None:
            return Dispatch()  # already planned, planning elsewhere, or cancelled
        job = store.get_job(s, job_id=job_id)
        assert job is not None
    if claim > settings.step_max_attempts:
        return fail_job(job_id, error_type=WORKER_LOST, plan_claim=claim,
                        message=f"planning was started {claim - 1} times and its worker never finished it")
    try:
        check_deadline(job.limits, job.created_at, utcnow())
        result = make_plan(job, settings=settings)
    except DeadlineExceeded as exc:
        return fail_job(job_id, error_type="DeadlineExceeded", message=str(exc), plan_claim=claim)
    except (ProviderError, WorkflowError) as exc:
        kind = "planner_error" if isinstance(exc, ProviderError) else "invalid_workflow"
        return fail_job(job_id, error_type=kind, message=f"planning failed: {exc}", plan_claim=claim)
    except Exception as exc:  # a bug must end the job visibly, not leave it 'planning' forever
        log.exception("planning job %s crashed", job_id)
        return fail_job(job_id, error_type="internal_error", plan_claim=claim,
                        message=f"planning crashed ({type(exc).__name__}); see the planner worker's log")
    with session_scope() as s:
        if not store.transition_job(
            s,
            job_id=job_id,
            from_=[JobStatus.PLANNING],
            to=JobStatus.RUNNING,
            plan_claim=claim,
            **_plan_columns(result),
        ):
            return Dispatch()  # cancelled while the planner ran, or this claim was superseded
        wf = result.workflow
        store.insert_steps(
            s,
            steps=[
                Step(
                    job_id=job_id,
                    index=i,
                    agent=step.agent,
                    instruction=step.instruction,
                    access_list=wf.resolved_access(i),
                    access_all=step.access_list == "all",
                )
                for i, step in enumerate(wf.steps)
            ],
        )
        roots = ready_steps(wf.dependencies, done=(), started=())
        won = store.mark_steps_queued(s, job_id=job_id, indices=roots)
    return Dispatch(steps=[(job_id, i) for i in won])


def _plan_columns(result: PlanResult) -> dict[str, Any]:
    return {
        "planned_at": utcnow(),
        "workflow_source": result.source,
        "format_valid": result.format_valid,
        "planner_raw": result.raw_text,
        "planner_error": result.error,
        "planner_attempts": result.attempts,
        "planner_input_tokens": result.usage.input_tokens,
        "planner_output_tokens": result.usage.output_tokens,
        "planner_cost_usd": result.usage.cost_usd,
        "planner_calls": result.usage.calls,
    }


# --- running one step -----------------------------------------------------------------------------


@dataclass
class _Claimed:
    step_id: int
    agent: str
    messages: list[Message]
    config: AgentConfig
    max_tokens: int
    deadline: datetime | None
    owner: str


@dataclass
class _Refused:
    """Claimed, but it must not run (limits exhausted, re-driven too often): it fails without a call."""

    step_id: int
    error: FatalError
    owner: str


class StepAbandoned(FatalError):
    """The step's worker died mid-call more often than the attempt limit allows."""


class InternalError(FatalError):
    """An unexpected exception around a provider call: a bug, recorded instead of looping."""


def run_step(job_id: str, index: int, *, worker: str, task_id: str | None, settings: Settings) -> Dispatch:
    """Claims the step, renders its messages, calls its agent with retries, records the one outcome."""
    owner = f"{worker[:100]}#{uuid.uuid4().hex[:12]}"  # unique per claim; fits the 128-char columns
    claimed = _claim(job_id, index, owner=owner, task_id=task_id, settings=settings)
    if isinstance(claimed, Dispatch):
        return claimed
    if isinstance(claimed, _Refused):
        return _fail_step(job_id, claimed.step_id, claimed.error, attempts=0, owner=claimed.owner)
    policy = RetryPolicy.from_settings(settings)
    timeout = claimed.config.timeout_s or settings.provider_timeout_s
    while True:
        with session_scope() as s:
            step = store.get_step(s, job_id=job_id, index=index)
            job = store.get_job(s, job_id=job_id)
            assert step is not None and job is not None
            if step.status != StepStatus.RUNNING or step.lease_owner != owner or job.status != JobStatus.RUNNING:
                return Dispatch()  # cancelled, the job failed, or another worker took the step over
            attempt = store.start_attempt(s, step=step, worker=owner, lease_s=settings.step_lease_s)
        options = CallOptions(
            temperature=claimed.config.temperature,
            max_tokens=claimed.max_tokens,
            timeout_s=timeout,
            attempt=attempt.n,
        )
        started = time.monotonic()
        try:
            provider = provider_for(claimed.agent, claimed.config)
            _wait_for_rate_limit(claimed.agent, claimed.config, settings)
            completion = provider.complete(claimed.messages, options)
        except Exception as raised:
            exc = raised if isinstance(raised, ProviderError) else _internal(raised, job_id, index)
            elapsed = int((time.monotonic() - started) * 1000)
            with session_scope() as s:
                assert attempt.id is not None
                store.finish_attempt(
                    s, attempt_id=attempt.id, latency_ms=elapsed, error_type=type(exc).__name__, error=str(exc)
                )
            if policy.should_retry(attempt.n, exc):
                delay = policy.delay(attempt.n, exc)
                if claimed.deadline is not None and utcnow() + timedelta(seconds=delay) >= claimed.deadline:
                    late = DeadlineExceeded(f"{exc}; no time left for another attempt before the job's deadline")
                    return _fail_step(job_id, claimed.step_id, late, attempts=attempt.n, owner=owner)
                log.info("step %s/%s attempt %s: %s; retrying in %.2fs", job_id, index, attempt.n, exc, delay)
                with session_scope() as s:
                    store.renew_lease(s, step_id=claimed.step_id, lease_owner=owner,
                                      seconds=settings.step_lease_s + delay)
                time.sleep(delay)
                continue
            return _fail_step(job_id, claimed.step_id, exc, attempts=attempt.n, owner=owner)
        columns = _completion_columns(completion, claimed.config)
        with session_scope() as s:
            assert attempt.id is not None
            store.finish_attempt(s, attempt_id=attempt.id, latency_ms=completion.latency_ms)
            recorded = store.finish_step(
                s,
                step_id=claimed.step_id,
                from_=[StepStatus.RUNNING],
                to=StepStatus.SUCCEEDED,
                lease_owner=owner,
                **columns,
            )
            if not recorded:  # cancelled or taken over meanwhile: the answer is dropped, its cost is not
                store.add_unrecorded_usage(
                    s,
                    step_id=claimed.step_id,
                    job_id=job_id,
                    input_tokens=completion.input_tokens,
                    output_tokens=completion.output_tokens,
                    cost_usd=columns["cost_usd"],
                )
        if not recorded:
            return Dispatch()
        return advance(job_id)


def _internal(exc: Exception, job_id: str, index: int) -> InternalError:
    log.exception("step %s/%s: unexpected %s", job_id, index, type(exc).__name__, exc_info=exc)
    return InternalError(f"unexpected {type(exc).__name__} around the provider call; see the worker's log")


def _claim(
    job_id: str, index: int, *, owner: str, task_id: str | None, settings: Settings
) -> _Claimed | _Refused | Dispatch:
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return Dispatch()
        step = store.claim_step(
            s, job_id=job_id, index=index, worker=owner, lease_s=settings.step_lease_s, task_id=task_id
        )
        if step is None or step.id is None:
            return Dispatch()
        store.close_lost_attempts(s, step_id=step.id)
        if step.attempts >= settings.step_max_attempts:
            return _Refused(step.id, StepAbandoned(
                f"the worker running this step stopped mid-call; gave up after {step.attempts} attempts"), owner)
        steps = store.get_steps(s, job_id=job_id)
        visible = [(steps[d].instruction, steps[d].output or "") for d in step.access_list]
        inherited = [Message(m["role"], m["content"]) for m in (job.context or [])]
        messages = worker_messages(
            task=job.task, visible=visible, instruction=step.instruction, inherited=inherited
        )
        spent = Spent(
            tokens=job.planner_input_tokens + job.planner_output_tokens
            + sum(st.input_tokens + st.output_tokens for st in steps),
            cost_usd=job.planner_cost_usd + sum(st.cost_usd for st in steps),
        )
        try:
            check_deadline(job.limits, job.created_at, utcnow())
            if step.agent == CONDUCTOR_AGENT:
                remaining_limits = child_limits(job.limits, job.created_at, spent, utcnow())
                return _start_child(s, job, step, visible=visible, inherited=inherited, messages=messages,
                                    limits=remaining_limits)
            pool = PoolConfig.model_validate(job.pool_config)
            config = pool.agents[step.agent]
            store.update_step(
                s,
                step_id=step.id,
                messages=[m.as_dict() for m in messages],
                provider=config.provider,
                model=config.model or f"sim-{step.agent}",
            )
            max_tokens = allowed_output_tokens(
                job.limits,
                spent,
                prompt_tokens=sum(estimate_tokens(m.content) for m in messages),
                max_tokens=config.max_tokens,
                price=config.price,
            )
        except (BudgetExceeded, DeadlineExceeded) as exc:
            return _Refused(step.id, exc, owner)
        deadline = deadline_of(job.limits, job.created_at)
        return _Claimed(step.id, step.agent, messages, config, max_tokens, deadline, owner)


def _start_child(
    s: Session,
    job: Job,
    step: Step,
    *,
    visible: list[tuple[str, str]],
    inherited: list[Message],
    messages: list[Message],
    limits: dict[str, Any],
) -> Dispatch:
    """A recursive step: a child job plans and runs with this step's subtask and visible context, within
    what is left of its parent's deadline and budgets."""
    assert step.id is not None
    child = Job(
        tenant=job.tenant,
        task=f"{job.task}\n\n---\nSubtask from the parent workflow (step {step.index}):\n{step.instruction}",
        pool=job.pool,
        pool_config=job.pool_config,
        planner=job.planner,
        depth=job.depth + 1,
        parent_job_id=job.id,
        parent_step_index=step.index,
        root_job_id=job.root_job_id or job.id,
        context=[m.as_dict() for m in [*inherited, *turns_as_messages(visible)]],
        limits=limits,
        meta={},
    )
    s.add(child)
    s.flush()
    store.update_step(
        s,
        step_id=step.id,
        messages=[m.as_dict() for m in messages],
        provider="conductor",
        model=job.planner,
        child_job_id=child.id,
        lease_expires_at=None,
    )
    return Dispatch(plan=[child.id])


def _wait_for_rate_limit(agent: str, config: AgentConfig, settings: Settings) -> None:
    """Takes a token from the agent's bucket shared by every worker (Redis). Embedded mode (one process,
    in-memory broker) has no Redis and runs unlimited."""
    if config.rpm is None or not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return
    get_limiter(settings.broker_url).acquire(agent, config.rpm, timeout_s=settings.rate_limit_wait_s)


def _completion_columns(c: Completion, config: AgentConfig) -> dict[str, Any]:
    return {
        "output": c.text,
        "finish_reason": c.finish_reason,
        "model": c.model,
        "input_tokens": c.input_tokens,
        "output_tokens": c.output_tokens,
        "cost_usd": config.price.cost(c.input_tokens, c.output_tokens),
        "latency_ms": c.latency_ms,
        "error": None,
        "error_type": None,
    }


def _fail_step(job_id: str, step_id: int, exc: ProviderError, *, attempts: int, owner: str) -> Dispatch:
    reason = "gave up after" if exc.retryable else "not retryable, after"
    message = f"{exc} ({reason} {attempts} attempt{'s' if attempts != 1 else ''})" if attempts else str(exc)
    with session_scope() as s:
        store.finish_step(
            s,
            step_id=step_id,
            from_=[StepStatus.RUNNING],
            to=StepStatus.FAILED,
            lease_owner=owner,
            error_type=type(exc).__name__,
            error=message,
        )
    return advance(job_id)


# --- progress, completion and failure -------------------------------------------------------------


def advance(job_id: str) -> Dispatch:
    """After any step finished: fail the job, finalize it, or dispatch the steps that became ready."""
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return Dispatch()
        steps = store.get_steps(s, job_id=job_id)
        failed = [st for st in steps if st.status == StepStatus.FAILED]
        if failed:
            first = failed[0]
            error_type, message, index = first.error_type or "step_failed", first.error or "", first.index
        elif all(st.status == StepStatus.SUCCEEDED for st in steps):
            return Dispatch(finalize=[job_id])
        else:
            done = [st.index for st in steps if st.status == StepStatus.SUCCEEDED]
            started = [st.index for st in steps if st.status != StepStatus.PENDING]
            ready = ready_steps([st.access_list for st in steps], done=done, started=started)
            won = store.mark_steps_queued(s, job_id=job_id, indices=ready)
            return Dispatch(steps=[(job_id, i) for i in won])
    return fail_job(job_id, error_type=error_type, message=f"step {index} failed: {message}", step=index)


def finalize_job(job_id: str) -> Dispatch:
    """running -> succeeded with the last step's output as the answer; then resumes a parent job."""
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        if job is None or job.status != JobStatus.RUNNING:
            return Dispatch()
        steps = store.get_steps(s, job_id=job_id)
        if not steps or any(st.status != StepStatus.SUCCEEDED for st in steps):
            return Dispatch()
        totals = _totals(job, steps)
        if not store.transition_job(
            s,
            job_id=job_id,
            from_=[JobStatus.RUNNING],
            to=JobStatus.SUCCEEDED,
            answer=steps[-1].output,
            finished_at=utcnow(),
            **totals,
        ):
            return Dispatch()
        parent = (job.parent_job_id, job.parent_step_index)
        if parent[0] is not None:
            _settle_parent_step(s, job, succeeded=True, answer=steps[-1].output, totals=totals)
    return advance(parent[0]) if parent[0] is not None else Dispatch()


def fail_job(
    job_id: str, *, error_type: str, message: str, step: int | None = None, plan_claim: int | None = None
) -> Dispatch:
    """Fails the job with a readable error; its unfinished steps become ``skipped``; a parent step fails.

    From planning (``plan_claim`` given) only a job still in that planning claim can be failed, so a
    superseded planner cannot fail a job another planner already started.
    """
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        if job is None:
            return Dispatch()
        totals = _totals(job, store.get_steps(s, job_id=job_id))
        if not store.transition_job(
            s,
            job_id=job_id,
            from_=[JobStatus.PLANNING] if plan_claim is not None else [JobStatus.QUEUED, JobStatus.PLANNING,
                                                                          JobStatus.RUNNING],
            to=JobStatus.FAILED,
            plan_claim=plan_claim,
            error_type=error_type,
            error_message=message,
            error_step=step,
            finished_at=utcnow(),
            **totals,
        ):
            return Dispatch()
        store.close_open_steps(s, job_id=job_id, to=StepStatus.SKIPPED, include_waiting=True)
        children = [c.id for c in store.get_children(s, job_id=job_id) if c.status not in JobStatus.TERMINAL]
        parent_id = job.parent_job_id
        if parent_id is not None:
            _settle_parent_step(s, job, succeeded=False, answer=None, totals=totals, error=message)
    for child in children:
        cancel_job(child)  # a failed parent's running sub-workflows are stopped, not left to spend
    return advance(parent_id) if parent_id is not None else Dispatch()




def _settle_parent_step(
    s: Session,
    child: Job,
    *,
    succeeded: bool,
    answer: str | None,
    totals: dict[str, Any],
    error: str | None = None,
) -> None:
    assert child.parent_job_id is not None and child.parent_step_index is not None
    step = store.get_step(s, job_id=child.parent_job_id, index=child.parent_step_index)
    if step is None or step.id is None:
        return
    latency = int(((child.finished_at or utcnow()) - (child.created_at)).total_seconds() * 1000)
    values: dict[str, Any] = {
        "input_tokens": totals["input_tokens"],
        "output_tokens": totals["output_tokens"],
        "cost_usd": totals["cost_usd"],
        "latency_ms": latency,
    }
    if succeeded:
        values.update(output=answer, finish_reason="child_succeeded")
        store.finish_step(s, step_id=step.id, from_=[StepStatus.RUNNING], to=StepStatus.SUCCEEDED, **values)
    else:
        values.update(error_type="child_job_failed", error=f"child job {child.id} failed: {error}")
        store.finish_step(s, step_id=step.id, from_=[StepStatus.RUNNING], to=StepStatus.FAILED, **values)


def _totals(job: Job, steps: list[Step]) -> dict[str, Any]:
    return {
        "input_tokens": job.planner_input_tokens + sum(st.input_tokens for st in steps),
        "output_tokens": job.planner_output_tokens + sum(st.output_tokens for st in steps),
        "cost_usd": job.planner_cost_usd + sum(st.cost_usd for st in steps),
        "calls": job.planner_calls + sum(st.attempts for st in steps if st.agent != CONDUCTOR_AGENT),
    }


# --- cancellation ---------------------------------------------------------------------------------


def cancel_job(job_id: str) -> bool:
    """Queued steps never start; running ones finish their current call and their answer is dropped.

    Child jobs are cancelled too. A child cancelled on its own fails its parent's recursive step, so
    the parent ends (failed) instead of waiting forever. Returns False when the job had already ended.
    """
    with session_scope() as s:
        before = store.get_job(s, job_id=job_id)
        if before is None:
            return False
        won = store.transition_job(
            s,
            job_id=job_id,
            from_=[JobStatus.QUEUED, JobStatus.PLANNING, JobStatus.RUNNING],
            to=JobStatus.CANCELLED,
            cancel_requested=True,
            finished_at=utcnow(),
            error_type="cancelled",
            error_message="the job was cancelled",
            **_totals(before, store.get_steps(s, job_id=job_id)),
        )
        if won:
            store.close_open_steps(s, job_id=job_id, to=StepStatus.CANCELLED, include_running=True)
        children = [c.id for c in store.get_children(s, job_id=job_id)]
        parent_id = before.parent_job_id if won else None
        if parent_id is not None:
            totals = _totals(before, store.get_steps(s, job_id=job_id))
            _settle_parent_step(s, before, succeeded=False, answer=None, totals=totals, error="it was cancelled")
    for child in children:
        cancel_job(child)
    if parent_id is not None:
        # The parent's recursive step just failed, so advancing it fails the parent: that sends no
        # message (anything else due would be re-sent by the reconciler from the rows).
        advance(parent_id)
    return won


def settle_from_children(job_id: str) -> Dispatch:
    """For the reconciler: recursive steps whose child job already ended but never resumed this job
    (the child's finalize was lost) are settled now."""
    dispatch = Dispatch()
    with session_scope() as s:
        waiting = store.running_steps_with_children(s, job_id=job_id)
        ended = []
        for step in waiting:
            child = store.get_job(s, job_id=step.child_job_id or "")
            if child is not None and child.status in JobStatus.TERMINAL:
                ended.append(child)
        for child in ended:
            totals = _totals(child, store.get_steps(s, job_id=child.id))
            reason = child.error_message or child.status
            _settle_parent_step(s, child, succeeded=child.status == JobStatus.SUCCEEDED, answer=child.answer,
                                totals=totals, error=reason)
    if ended:
        dispatch += advance(job_id)
    return dispatch
