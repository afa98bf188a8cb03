"""Chooses how a job gets its workflow: the request's own, a template, or the conductor model."""

from __future__ import annotations

import time

from conductor.budget import Spent, allowed_output_tokens, estimate_tokens
from conductor.errors import BudgetExceeded
from conductor.planning.base import PlannerUsage, PlanningOverBudget, PlanResult
from conductor.planning.templates import template_workflow
from conductor.pool.base import Message
from conductor.pool.config import PoolConfig
from conductor.pool.errors import ProviderError
from conductor.pool.registry import provider_for
from conductor.ratelimit import wait_for_rate_limit
from conductor.retry import RetryPolicy
from conductor.settings import Settings
from conductor.store.models import Job
from conductor.workflow import CONDUCTOR_AGENT, Workflow, parse_workflow, used_fields


def job_limits(job: Job, settings: Settings) -> tuple[int, int]:
    """(max_steps, max_depth) for this job: the request's limits, never above the server's."""
    return effective_limits(job.limits.get("max_steps"), job.limits.get("max_depth"), settings)


def effective_limits(max_steps: int | None, max_depth: int | None, settings: Settings) -> tuple[int, int]:
    steps = min(max_steps or settings.max_steps, settings.max_steps)
    depth = min(max_depth if max_depth is not None else settings.max_depth, settings.max_depth)
    return steps, depth


def longest_planning_s(job: Job, settings: Settings) -> float:
    """The longest the job's planning may run while its worker lives: each planner call (a first one and
    a re-ask) as long as a step's longest run -- every retry at the planner agent's own timeout (else
    ``provider_timeout_s``) and waits."""
    from conductor.planning.conductor_planner import MAX_PLANNER_ATTEMPTS

    pool = job.pool_config or {}
    planner = pool.get("planner") if job.planner == CONDUCTOR_AGENT else job.planner
    agent = (pool.get("agents") or {}).get(planner) if isinstance(planner, str) else None
    timeout = agent.get("timeout_s") if isinstance(agent, dict) else None
    return MAX_PLANNER_ATTEMPTS * settings.step_max_duration_s(timeout if isinstance(timeout, int | float) else None)


def make_plan(job: Job, *, settings: Settings, background: bool = False) -> PlanResult:
    """The job's workflow: the request's, a template's, or its planner model's. ``background``: the job is
    batch work (a batch's line or a child job in a line's tree): its planner calls wait behind its tenant's
    live ones at the agent's rate limit."""
    pool = PoolConfig.model_validate(job.pool_config)
    max_steps, max_depth = job_limits(job, settings)
    allow_conductor = job.depth < max_depth
    if job.request_workflow is not None:
        raw = used_fields(job.request_workflow)
        max_chars = settings.max_instruction_chars
        if job.replay_of is not None and not job.replay_replan:
            # the original's workflow, accepted by the replay under the limits it ran with: limits lowered
            # since (CONDUCTOR_MAX_STEPS, the instruction length) must not fail the replay after its 202
            steps = raw.get("steps") if isinstance(raw, dict) else None
            if isinstance(steps, list):
                max_steps = max(max_steps, len(steps))
                max_chars = max([max_chars, *(len(st.get("instruction") or "") for st in steps
                                              if isinstance(st, dict) and isinstance(st.get("instruction"), str))])
        wf = parse_workflow(
            raw,
            agents=pool.worker_names,
            max_steps=max_steps,
            max_instruction_chars=max_chars,
            allow_conductor=allow_conductor,
        )
        return PlanResult(workflow=wf, source="request", format_valid=True, planner="request")
    planner = pool.planner if job.planner == CONDUCTOR_AGENT else job.planner
    if planner.startswith("template:"):
        wf = template_workflow(planner, pool.worker_names, max_steps)
        return PlanResult(workflow=wf, source="planner", format_valid=True, planner=planner)
    return _plan_with_agent(job, pool, planner, settings, max_steps=max_steps, allow_conductor=allow_conductor,
                            background=background)


def _plan_with_agent(
    job: Job, pool: PoolConfig, agent: str, settings: Settings, *, max_steps: int, allow_conductor: bool,
    background: bool = False,
) -> PlanResult:
    """The planner model's workflow. If the planner cannot be reached (after the retry policy) the job
    still runs, on the pool's fallback template, and the job records why (``source: fallback``)."""
    from conductor.planning.conductor_planner import plan_with_model

    config = pool.agents[agent]

    def fallback() -> Workflow:
        return template_workflow(pool.fallback, pool.worker_names, max_steps)

    context = [Message(m["role"], m["content"]) for m in (job.context or [])]
    policy = RetryPolicy.from_settings(settings)
    attempt = 1
    spent = PlannerUsage()  # every call's, across retries: a call that answered before one raised was paid
    cap = min(config.max_tokens, 4096)

    def before_call(messages: list[Message], _: PlannerUsage) -> int:
        """Each planner call waits for the agent's rate limit, as a step does, and writes at most what the
        job's budget has room for (earlier claims' planner spend and this planning's so far count)."""
        wait_for_rate_limit(config.bucket(agent), config.rpm, settings, tenant=job.tenant, background=background)
        before = Spent(tokens=(job.planner_input_tokens or 0) + (job.planner_output_tokens or 0)
                       + spent.input_tokens + spent.output_tokens,
                       cost_usd=(job.planner_cost_usd or 0.0) + spent.cost_usd)
        prompt = sum(estimate_tokens(m.content) for m in messages)
        return allowed_output_tokens(job.limits or {}, before, prompt_tokens=prompt, max_tokens=cap,
                                     price=config.billing)

    while True:
        try:
            return plan_with_model(
                job.task,
                pool,
                provider_for(agent, config),
                agent,
                max_steps=max_steps,
                max_instruction_chars=settings.max_instruction_chars,
                allow_conductor=allow_conductor,
                fallback=fallback,
                context=context or None,
                nested=job.depth > 0,
                max_tokens=cap,
                timeout_s=settings.provider_timeout_s,
                usage=spent,
                before_call=before_call,
                scope=settings.cache_scope(job.tenant),
            )
        except PlanningOverBudget:
            raise
        except BudgetExceeded as exc:  # paid for before the budget ran out: the job counts it when it fails
            raise PlanningOverBudget(f"planning: {exc}", spent) from exc
        except ProviderError as exc:
            if not policy.should_retry(attempt, exc):
                return PlanResult(
                    workflow=fallback(),
                    source="fallback",
                    format_valid=False,
                    planner=agent,
                    error=f"the planner could not be used ({exc.error_type}: {exc}); ran {pool.fallback}",
                    attempts=attempt,
                    usage=spent,
                )
            time.sleep(policy.delay(attempt, exc))
            attempt += 1


__all__ = ["PlanResult", "PlannerUsage", "job_limits", "make_plan"]
