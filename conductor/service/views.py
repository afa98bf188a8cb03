"""Builds the public shapes (``schemas.py``) from table rows. Table rows are never returned as they are."""

from __future__ import annotations

from sqlmodel import Session

from conductor.service.schemas import (
    AttemptPublic,
    ChildJob,
    ErrorInfo,
    JobError,
    JobEvent,
    JobPublic,
    JobRef,
    JobSummary,
    JobUsage,
    Links,
    MessagePublic,
    ParentRef,
    PlannerUsage,
    ReplaySettings,
    StepEvent,
    StepPublic,
    StepRef,
    StepUsage,
    WorkflowPublic,
    WorkflowStep,
)
from conductor.store import jobs as store
from conductor.store.models import Job, JobStatus, Step, StepAttempt, StepStatus

MAX_TREE_DEPTH = 6
MAX_TREE_STEPS = 200
"""At most this many steps are rendered in one steps tree; deeper child jobs are then summarized with
a link to their own steps (each page of which is bounded again)."""
LIST_TASK_CHARS = 200


def job_links(job_id: str, base_url: str = "") -> Links:
    root = f"{base_url}/v1/jobs/{job_id}"
    return Links(self=root, steps=f"{root}/steps", events=f"{root}/events", trace=f"{base_url}/ui/jobs/{job_id}")


def _error(error_type: str | None, message: str | None) -> ErrorInfo | None:
    return ErrorInfo(type=error_type, message=message) if error_type else None


def job_view(job: Job, steps: list[Step], *, base_url: str = "") -> JobPublic:
    return JobPublic(
        id=job.id,
        status=JobStatus(job.status),
        task=job.task,
        pool=job.pool,
        planner=job.planner,
        depth=job.depth,
        parent=ParentRef(job_id=job.parent_job_id, step_index=job.parent_step_index) if job.parent_job_id else None,
        workflow=_workflow(job, steps),
        answer=job.answer,
        error=(
            JobError(type=job.error_type, message=job.error_message, step=job.error_step) if job.error_type else None
        ),
        usage=JobUsage(
            input_tokens=job.input_tokens,
            output_tokens=job.output_tokens,
            cost_usd=round(job.cost_usd, 8),
            calls=job.calls,
            cached_input_tokens=job.cached_input_tokens,
            reasoning_tokens=job.reasoning_tokens,
            cache_write_tokens=job.cache_write_tokens,
            planner=PlannerUsage(
                input_tokens=job.planner_input_tokens,
                output_tokens=job.planner_output_tokens,
                cost_usd=round(job.planner_cost_usd, 8),
                calls=job.planner_calls,
                cached_input_tokens=job.planner_cached_input_tokens,
                reasoning_tokens=job.planner_reasoning_tokens,
                cache_write_tokens=job.planner_cache_write_tokens,
            ),
        ),
        replay_of=job.replay_of,
        replay=(
            ReplaySettings(from_step=job.replay_from_step, agents=job.replay_agents or {}, replan=job.replay_replan)
            if job.replay_of
            else None
        ),
        limits=job.limits,
        metadata=job.meta,
        batch_id=job.batch_id,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        links=job_links(job.id, base_url),
    )


def _workflow(job: Job, steps: list[Step]) -> WorkflowPublic | None:
    if not job.workflow_source:
        return None
    return WorkflowPublic(
        steps=[
            WorkflowStep(index=st.index, agent=st.agent, instruction=st.instruction, access_list=st.access_list)
            for st in steps
        ],
        source=job.workflow_source,
        format_valid=job.format_valid,
        planner_error=job.planner_error,
        planner_attempts=job.planner_attempts,
    )


def job_ref(job: Job) -> JobRef:
    return JobRef(id=job.id, status=JobStatus(job.status), links=job_links(job.id))


def job_summary(job: Job) -> JobSummary:
    return JobSummary(
        id=job.id,
        status=JobStatus(job.status),
        task=job.task[:LIST_TASK_CHARS],
        pool=job.pool,
        batch_id=job.batch_id,
        replay_of=job.replay_of,
        metadata=job.meta,
        created_at=job.created_at,
        finished_at=job.finished_at,
        links=job_links(job.id),
    )


def attempt_view(attempt: StepAttempt) -> AttemptPublic:
    """Which worker host ran the attempt is the operator's business (``step_attempt.worker``), never
    shown to tenants; so is the Celery task id."""
    return AttemptPublic(
        n=attempt.n,
        started_at=attempt.started_at,
        finished_at=attempt.finished_at,
        latency_ms=attempt.latency_ms,
        error=_error(attempt.error_type, attempt.error),
    )


def step_view(
    step: Step, attempts: list[StepAttempt], *, messages: bool = True, reused_from: Step | None = None
) -> StepPublic:
    return StepPublic(
        index=step.index,
        agent=step.agent,
        instruction=step.instruction,
        access_list=step.access_list,
        access_all=step.access_all,
        status=StepStatus(step.status),
        provider=step.provider,
        model=step.model,
        messages=(
            [MessagePublic.model_validate(m) for m in step.messages] if messages and step.messages is not None else None
        ),
        output=step.output,
        finish_reason=step.finish_reason,
        usage=StepUsage(
            input_tokens=step.input_tokens, output_tokens=step.output_tokens, cost_usd=round(step.cost_usd, 8),
            cached_input_tokens=step.cached_input_tokens, reasoning_tokens=step.reasoning_tokens,
            cache_write_tokens=step.cache_write_tokens,
        ),
        latency_ms=step.latency_ms,
        attempts=[attempt_view(a) for a in attempts],
        error=_error(step.error_type, step.error),
        child_job_id=step.child_job_id,
        reused=step.reused_from is not None,
        reused_from=StepRef(job_id=reused_from.job_id, index=reused_from.index) if reused_from is not None else None,
        queued_at=step.queued_at,
        started_at=step.started_at,
        finished_at=step.finished_at,
    )


def steps_tree(
    session: Session,
    job_id: str,
    depth: int = 0,
    *,
    max_depth: int = MAX_TREE_DEPTH,
    offset: int = 0,
    limit: int | None = None,
    messages: bool = True,
    budget: list[int] | None = None,
) -> list[StepPublic]:
    """Steps (``offset``/``limit`` of this job's) with each recursive step's child job nested under it,
    down to ``max_depth`` levels and ``MAX_TREE_STEPS`` steps in all; a child not expanded carries
    ``steps: null`` and a link to its own steps."""
    left = budget if budget is not None else [MAX_TREE_STEPS]
    steps = store.get_steps(session, job_id=job_id)[offset:]
    steps = steps[: min(limit if limit is not None else len(steps), left[0])]
    left[0] -= len(steps)
    attempts = store.get_attempts(session, step_ids=[s.id for s in steps if s.id is not None])
    originals = {o.id: o for o in store.get_steps_by_id(
        session, step_ids=[s.reused_from for s in steps if s.reused_from is not None])}
    out = []
    for st in steps:
        original = originals.get(st.reused_from) if st.reused_from is not None else None
        view = step_view(st, [a for a in attempts if a.step_id == st.id], messages=messages, reused_from=original)
        child = store.get_job(session, job_id=st.child_job_id) if st.child_job_id else None
        if child is not None:
            expand = depth < max_depth and left[0] > 0
            view.child = ChildJob(
                job_id=child.id,
                status=JobStatus(child.status),
                depth=child.depth,
                workflow_source=child.workflow_source,
                answer=child.answer,
                steps=steps_tree(session, child.id, depth + 1, max_depth=max_depth, messages=messages,
                                 budget=left) if expand else None,
                links=job_links(child.id),
            )
        out.append(view)
    return out


def job_event(job: Job) -> JobEvent:
    return JobEvent(
        id=job.id, status=JobStatus(job.status), answer=job.answer, error=_error(job.error_type, job.error_message)
    )


def step_event(step: Step | store.StepProgress) -> StepEvent:
    return StepEvent(
        index=step.index,
        agent=step.agent,
        status=StepStatus(step.status),
        attempts=step.attempts,
        latency_ms=step.latency_ms,
        child_job_id=step.child_job_id,
    )
