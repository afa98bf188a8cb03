"""Replaying a job: a new job linked to its original (``replay_of``) that re-runs only what changed.

The rule, applied when the replay's workflow is written (``step_rows``):

- Without ``from_step`` every step runs again.
- With ``from_step`` N, a step of the new workflow is **reused** -- recorded as succeeded with the
  original step's messages and output, ``reused_from`` pointing at the original row, and no new
  usage -- when all of these hold:
  it is not step N; the original has a succeeded step at the same index with the same agent,
  instruction and access list; that agent's pool entry is unchanged (for the recursive agent
  ``conductor``: the whole pool); and every step it reads was itself reused.
  Everything else runs again. So steps before N are reused unless an ``agents`` override changed
  them, step N and every step that (transitively) reads it or a changed step run again, and a step
  after N that reads neither is reused.
  With the job limit ``max_answer_tokens`` (a replay keeps the original's limits) one more condition:
  the step is the last one (the answering step, whose output alone is cut to that cap) in both
  workflows or in neither. Only ``replan`` can change that (a new plan of another length): the
  original's uncapped middle step is not reused as the answer, nor its cut answer as a middle step's
  output; the step runs again, and so does what reads it.

Without ``replan`` the workflow is the original's with the ``agents`` overrides applied (source
``replay``); with ``replan`` the planner is asked again and the overrides are applied to its
workflow, so reuse happens only where the new plan matches the original step for step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from sqlmodel import Session

from conductor.errors import Rejection
from conductor.planning.base import PlanResult
from conductor.planning.planner import effective_limits
from conductor.pool.config import PoolConfig, PoolError, check_planner_ref
from conductor.settings import Settings
from conductor.store import jobs as store
from conductor.store.models import Job, JobStatus, Step, StepStatus, utcnow
from conductor.store.webhooks import default_webhook_url
from conductor.submission import SubmissionError, resolve_pool
from conductor.workflow import CONDUCTOR_AGENT, FieldError, Workflow, WorkflowError, parse_workflow
from conductor.workflow import Step as WorkflowStep

MAX_STEP_INDEX = 49  # the highest index any workflow may have (Limits.max_steps is at most 50)

StepKey = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]?)$")]
AgentName = Annotated[str, StringConstraints(min_length=1, max_length=128)]


class ReplayRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    from_step: int | None = Field(
        default=None, ge=0, le=MAX_STEP_INDEX, strict=True,
        description="Re-run this step and what depends on it; reuse the original's other outputs. "
        "Omitted: every step runs again.",
    )
    agents: dict[StepKey, AgentName] = Field(
        default_factory=dict, max_length=MAX_STEP_INDEX + 1,
        description='Step index -> agent of the pool, e.g. {"2": "gpt-5"}.',
        json_schema_extra={"additionalProperties": False},
    )
    pool: str | None = Field(default=None, max_length=64, description="Run on this pool instead of the "
                             "original's snapshot of its pool.")
    replan: bool = Field(default=False, strict=True,
                         description="Ask the planner again instead of reusing the workflow.")


def create_replay(
    session: Session, original: Job, body: ReplayRequest, *, settings: Settings,
    admit: Callable[[Session], None] | None = None,
) -> Job:
    """Validates the replay against the original and its pool and inserts the new job (not committed).
    ``admit`` (the API's per-tenant quotas) runs once the replay is known to be valid."""
    if original.status not in JobStatus.TERMINAL:
        raise SubmissionError(Rejection.CONFLICT, "Job not finished", [FieldError(
            ("path", "job_id"), f"job {original.id} is {original.status}; replay it once it has ended")])
    pool = _replay_pool(original, body.pool, settings)
    _, max_depth = effective_limits(original.limits.get("max_steps"), original.limits.get("max_depth"), settings)
    allow_conductor = original.depth < max_depth
    agents = set(pool.worker_names) | ({CONDUCTOR_AGENT} if allow_conductor else set())
    errors = [
        FieldError(("body", "agents", key), f"unknown agent '{name}'; known agents: {', '.join(sorted(agents))}")
        for key, name in body.agents.items()
        if name not in agents
    ]
    if errors:
        raise SubmissionError(Rejection.INVALID, "Unknown agent", errors)
    if body.replan and body.pool is not None:
        try:  # the original named an agent of its own pool as its planner: the new pool must have it too
            check_planner_ref(original.planner, pool.agents)
        except ValueError as exc:
            raise SubmissionError(Rejection.INVALID, "Unknown planner", [FieldError(
                ("body", "pool"), f"the original's planner is not in pool '{pool.name}': {exc}")]) from exc
    overrides = {str(int(k)): v for k, v in body.agents.items()}
    workflow = None if body.replan else _original_workflow(session, original, body, overrides, pool, settings)
    if admit is not None:
        admit(session)
    job = Job(
        tenant=original.tenant,
        task=original.task,
        pool=pool.name,
        pool_config=pool.model_dump(mode="json"),
        planner=original.planner,
        depth=original.depth,
        context=original.context,
        request_workflow=workflow,
        limits=original.limits,
        meta=original.meta,
        # the tenant's default as it is now when the original used the default (the operator may have
        # changed or cleared it since); a URL the original named itself, as it was
        webhook_url=default_webhook_url(session, tenant=original.tenant) if original.webhook_url_from_default
        else original.webhook_url,
        webhook_url_from_default=original.webhook_url_from_default,
        replay_of=original.id,
        replay_from_step=body.from_step,
        replay_agents=overrides or None,
        replay_replan=body.replan,
    )
    session.add(job)
    session.flush()
    return job


def _replay_pool(original: Job, name: str | None, settings: Settings) -> PoolConfig:
    if name is None:
        return PoolConfig.model_validate(original.pool_config)
    try:
        return resolve_pool(name, settings)
    except PoolError as exc:
        raise SubmissionError(Rejection.INVALID, "Unknown pool", [FieldError(("body", "pool"), str(exc))]) from exc


def _original_workflow(
    session: Session, original: Job, body: ReplayRequest, overrides: dict[str, str], pool: PoolConfig,
    settings: Settings,
) -> dict[str, Any]:
    """The original's workflow with the overrides applied, checked against the replay's pool."""
    steps = store.get_steps(session, job_id=original.id)
    if not steps:
        raise SubmissionError(Rejection.CONFLICT, "No workflow to replay", [FieldError(
            ("body", "replan"), f"job {original.id} ended before it had a workflow; replay it with replan: true")])
    beyond: list[tuple[str, ...]] = [("agents", key) for key in overrides if int(key) >= len(steps)]
    if body.from_step is not None and body.from_step >= len(steps):
        beyond.insert(0, ("from_step",))
    if beyond:
        raise SubmissionError(Rejection.INVALID, "No such step", [
            FieldError(("body", *loc), f"the workflow has steps 0-{len(steps) - 1}") for loc in beyond])
    workflow = {"steps": [
        {"agent": overrides.get(str(st.index), st.agent), "instruction": st.instruction,
         "access_list": "all" if st.access_all else st.access_list}
        for st in steps
    ]}
    max_steps, max_depth = effective_limits(original.limits.get("max_steps"), original.limits.get("max_depth"),
                                            settings)
    try:
        parse_workflow(workflow, agents=pool.worker_names, max_steps=max(max_steps, len(steps)),
                       max_instruction_chars=max(settings.max_instruction_chars,
                                                 *(len(st.instruction) for st in steps)),
                       allow_conductor=original.depth < max_depth, loc=("body", "workflow"))
    except WorkflowError as exc:
        raise SubmissionError(Rejection.INVALID, "Workflow does not fit the pool", exc.errors) from exc
    return workflow


# --- at planning time -----------------------------------------------------------------------------


def replay_plan(result: PlanResult, job: Job) -> PlanResult:
    """A replay's workflow: the original's (source ``replay``), or the planner's with the overrides applied."""
    if job.replay_of is None:
        return result
    if not job.replay_replan:
        result.source = "replay"
        return result
    overrides = {int(k): v for k, v in (job.replay_agents or {}).items()}
    steps = result.workflow.steps
    beyond = sorted(i for i in overrides if i >= len(steps))
    if beyond:
        raise WorkflowError([FieldError(("agents", str(i)), f"the replanned workflow has only {len(steps)} steps")
                             for i in beyond])
    result.workflow = Workflow(steps=[
        WorkflowStep(agent=overrides.get(i, st.agent), instruction=st.instruction, access_list=st.access_list)
        for i, st in enumerate(steps)
    ])
    return result


def step_rows(session: Session, job: Job, wf: Workflow) -> list[dict[str, Any]]:
    """One row per step of the job's workflow (``store.new_step_row``); a replay's reusable steps come
    already succeeded."""
    reuse = _reusable(session, job, wf)
    now = utcnow()
    rows = []
    for i, step in enumerate(wf.steps):
        values: dict[str, Any] = {"job_id": job.id, "index": i, "agent": step.agent, "instruction": step.instruction,
                                  "access_list": wf.resolved_access(i), "access_all": step.access_list == "all"}
        original = reuse.get(i)
        if original is not None:
            values.update(status=StepStatus.SUCCEEDED, reused_from=original.id, provider=original.provider,
                          model=original.model, finish_reason=original.finish_reason, messages=original.messages,
                          output=original.output, started_at=now, finished_at=now)
        rows.append(store.new_step_row(**values))
    return rows


def _reusable(session: Session, job: Job, wf: Workflow) -> dict[int, Step]:
    """Index -> the original step whose outputs this replay step reuses (the module docstring's rule)."""
    if job.replay_of is None or job.replay_from_step is None:
        return {}
    original_job = store.get_job(session, job_id=job.replay_of)
    if original_job is None:
        return {}
    original = {st.index: st for st in store.get_steps(session, job_id=original_job.id)}
    before, now = PoolConfig.model_validate(original_job.pool_config), PoolConfig.model_validate(job.pool_config)
    return reusable(wf, original, from_step=job.replay_from_step,
                    unchanged_agent=lambda agent: _same_agent(before, now, agent),
                    answer_capped=(job.limits or {}).get("max_answer_tokens") is not None)


def reusable(
    wf: Workflow, original: Mapping[int, Step], *, from_step: int, unchanged_agent: Callable[[str], bool],
    answer_capped: bool = False,
) -> dict[int, Step]:
    """The reuse rule on its own: index -> original step, for the steps of ``wf`` that need not run again.
    ``answer_capped`` (the job has ``max_answer_tokens``): a step is reused only if it is the last step
    of both workflows or of neither."""
    reused: dict[int, Step] = {}
    last_now, last_was = len(wf.steps) - 1, max(original, default=-1)
    for i, step in enumerate(wf.steps):
        was = original.get(i)
        access = wf.resolved_access(i)
        if (
            was is not None
            and i != from_step
            and was.status == StepStatus.SUCCEEDED
            and (was.agent, was.instruction, was.access_list) == (step.agent, step.instruction, access)
            and unchanged_agent(step.agent)
            and all(d in reused for d in access)
            and (not answer_capped or (i == last_now) == (i == last_was))
        ):
            reused[i] = was
    return reused


def _same_agent(before: PoolConfig, now: PoolConfig, agent: str) -> bool:
    """Whether ``agent`` would answer as it did: its pool entry unchanged but for its cached-input price, which
    changes what a call costs, not what it may say (setting one re-ran every step of the agent). Its other
    prices count: under a job's ``max_cost_usd`` they set how long a step's answer may be."""
    if agent == CONDUCTOR_AGENT:  # a recursive step plans with the whole pool
        return _answering(before) == _answering(now)
    old, new = before.agents.get(agent), now.agents.get(agent)
    return old is not None and new is not None and old.model_dump(exclude=CACHED_PRICE) == new.model_dump(
        exclude=CACHED_PRICE)


CACHED_PRICE: dict[str, Any] = {"price": {"cached_input_per_mtok"}}


def _answering(pool: PoolConfig) -> dict[str, Any]:
    return pool.model_dump(exclude={"agents": {"__all__": CACHED_PRICE}})
