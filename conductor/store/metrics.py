"""Aggregates for ``/metrics``, read from the store at scrape time.

Every number a scrape shows is a ``GROUP BY`` over the rows, so it is the same whichever API process
answers and whichever worker did the work, and it survives restarts. Usage of a recursive step (agent
``conductor``) is its child job's total, so it is left out here: the child job's own planner and steps
are counted where they happened.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col

from conductor.store.models import Job, Step, StepAttempt, WebhookAttempt, WebhookDelivery

CONDUCTOR_AGENT = "conductor"  # the reserved agent (conductor.workflow's constant; the store imports no domain)
ATTEMPT_OK = "ok"

# Step latency buckets, in seconds: provider calls run from tens of milliseconds to minutes.
LATENCY_BUCKETS_S: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class LatencyHistogram:
    agent: str
    cumulative: tuple[int, ...]
    """How many latencies are <= each of ``LATENCY_BUCKETS_S``, in that order."""
    count: int
    sum_s: float


@dataclass
class StoreAggregates:
    jobs: list[tuple[str, str, int]] = field(default_factory=list)
    """(tenant, status, jobs) for every job, child jobs included."""
    steps: list[tuple[str, str, str, int]] = field(default_factory=list)
    """(tenant, agent, status, steps)."""
    usage: list[tuple[str, str, str, int, int, float]] = field(default_factory=list)
    """(tenant, role 'planner' | 'worker', agent, input tokens, output tokens, cost USD)."""
    retries: list[tuple[str, str, int]] = field(default_factory=list)
    """(tenant, agent, attempts beyond each step's first)."""
    attempts: list[tuple[str, str, str, int]] = field(default_factory=list)
    """(tenant, agent, outcome: 'ok' or the error type, finished attempts)."""
    resends: list[tuple[str, str, int]] = field(default_factory=list)
    """(tenant, kind 'plan' | 'step' | 'planning_redrive', reconciler actions)."""
    latency: list[LatencyHistogram] = field(default_factory=list)
    webhooks: list[tuple[str, str, int]] = field(default_factory=list)
    """(tenant, delivery status, webhook deliveries)."""
    webhook_attempts: list[tuple[str, str, int]] = field(default_factory=list)
    """(tenant, outcome '2xx' | '3xx' | '4xx' | '5xx' | 'error', finished delivery attempts)."""


def read_aggregates(session: Session, *, tenant: str | None = None) -> StoreAggregates:
    """Everything ``/metrics`` reports from Postgres, in three scans (jobs, steps, attempts); with
    ``tenant``, only that tenant's rows."""
    agg = StoreAggregates(attempts=[tuple(r) for r in session.execute(_attempt_outcomes(tenant))])
    _add_jobs(agg, session.execute(_job_scan(tenant)))
    _add_steps(agg, session.execute(_step_scan(tenant)))
    agg.webhooks = [(t, st, int(n)) for t, st, n in session.execute(_webhook_deliveries(tenant))]
    agg.webhook_attempts = [(t, o, int(n)) for t, o, n in session.execute(_webhook_attempts(tenant))]
    return agg


def _for_tenant(stmt: Any, tenant: str | None) -> Any:
    return stmt if tenant is None else stmt.where(col(Job.tenant) == tenant)


def _sum(column: Any) -> Any:
    return sa.func.coalesce(sa.func.sum(column), 0)


def _job_scan(tenant: str | None) -> Any:
    redrives = sa.case((col(Job.plan_claims) > 1, col(Job.plan_claims) - 1), else_=0)
    stmt = sa.select(
        col(Job.tenant), col(Job.status), col(Job.planner), sa.func.count(),
        _sum(col(Job.planner_input_tokens)), _sum(col(Job.planner_output_tokens)), _sum(col(Job.planner_cost_usd)),
        _sum(col(Job.plan_resends)), _sum(redrives),
    ).group_by(col(Job.tenant), col(Job.status), col(Job.planner))
    return _for_tenant(stmt, tenant)


def _add_jobs(agg: StoreAggregates, rows: Any) -> None:
    by_status: dict[tuple[str, str], int] = defaultdict(int)
    planner: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    actions: dict[tuple[str, str], int] = defaultdict(int)
    for tenant, status, planner_name, n, tokens_in, tokens_out, usd, resends, redrives in rows:
        by_status[(tenant, status)] += int(n)
        totals = planner[(tenant, planner_name)]
        totals[0] += int(tokens_in)
        totals[1] += int(tokens_out)
        totals[2] += float(usd)
        actions[(tenant, "plan")] += int(resends)
        actions[(tenant, "planning_redrive")] += int(redrives)
    agg.jobs = [(t, st, n) for (t, st), n in by_status.items()]
    agg.usage += [(t, "planner", name, int(v[0]), int(v[1]), float(v[2])) for (t, name), v in planner.items()]
    agg.resends += [(t, action, n) for (t, action), n in actions.items()]


def _step_scan(tenant: str | None) -> Any:
    ms = col(Step.latency_ms)
    retries = sa.case((col(Step.attempts) > 1, col(Step.attempts) - 1), else_=0)
    buckets = [_sum(sa.case((ms <= int(b * 1000), 1), else_=0)) for b in LATENCY_BUCKETS_S]
    stmt = (
        sa.select(
            col(Job.tenant), col(Step.agent), col(Step.status), sa.func.count(),
            _sum(col(Step.input_tokens)), _sum(col(Step.output_tokens)), _sum(col(Step.cost_usd)),
            _sum(retries), _sum(col(Step.resends)), sa.func.count(ms), _sum(ms), *buckets,
        )
        .select_from(sa.join(Step, Job, col(Step.job_id) == col(Job.id)))
        .group_by(col(Job.tenant), col(Step.agent), col(Step.status))
    )
    return _for_tenant(stmt, tenant)


def _add_steps(agg: StoreAggregates, rows: Any) -> None:
    """Per status rows folded into per agent series. A recursive step's usage, retries and latency are its
    child job's, counted there: only its status is counted here."""
    usage: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    retries: dict[tuple[str, str], int] = defaultdict(int)
    resends: dict[str, int] = defaultdict(int)
    latency: dict[str, list[int]] = defaultdict(lambda: [0] * (len(LATENCY_BUCKETS_S) + 2))
    for tenant, agent, status, n, tokens_in, tokens_out, usd, retried, resent, timed, total_ms, *cumulative in rows:
        agg.steps.append((tenant, agent, status, int(n)))
        resends[tenant] += int(resent)
        if agent == CONDUCTOR_AGENT:
            continue
        totals = usage[(tenant, agent)]
        totals[0] += int(tokens_in)
        totals[1] += int(tokens_out)
        totals[2] += float(usd)
        retries[(tenant, agent)] += int(retried)
        hist = latency[agent]
        for i, v in enumerate([int(timed), int(total_ms), *(int(c) for c in cumulative)]):
            hist[i] += v
    agg.usage += [(t, "worker", agent, int(v[0]), int(v[1]), float(v[2])) for (t, agent), v in usage.items()]
    agg.retries = [(t, agent, n) for (t, agent), n in retries.items()]
    agg.resends += [(t, "step", n) for t, n in resends.items()]
    agg.latency = [LatencyHistogram(agent, tuple(h[2:]), h[0], h[1] / 1000) for agent, h in latency.items() if h[0]]


def _webhook_deliveries(tenant: str | None) -> Any:
    stmt = sa.select(col(WebhookDelivery.tenant), col(WebhookDelivery.status), sa.func.count()).group_by(
        col(WebhookDelivery.tenant), col(WebhookDelivery.status))
    return stmt if tenant is None else stmt.where(col(WebhookDelivery.tenant) == tenant)


def _webhook_attempts(tenant: str | None) -> Any:
    code = col(WebhookAttempt.status_code)
    # floor division: "/" is true division in SQLAlchemy 2 (a NUMERIC that Postgres rounds when cast: 451 -> 5xx)
    outcome = sa.case((code.is_(None), "error"), else_=sa.func.concat(code // 100, "xx"))
    stmt = (
        sa.select(col(WebhookDelivery.tenant), outcome, sa.func.count())
        .select_from(sa.join(WebhookAttempt, WebhookDelivery,
                             col(WebhookAttempt.delivery_id) == col(WebhookDelivery.id)))
        .where(col(WebhookAttempt.finished_at).is_not(None))
        .group_by(col(WebhookDelivery.tenant), outcome)
    )
    return stmt if tenant is None else stmt.where(col(WebhookDelivery.tenant) == tenant)


def _attempt_outcomes(tenant: str | None) -> Any:
    outcome = sa.func.coalesce(col(StepAttempt.error_type), ATTEMPT_OK)
    stmt = (
        sa.select(col(Job.tenant), col(Step.agent), outcome, sa.func.count())
        .select_from(
            sa.join(StepAttempt, Step, col(StepAttempt.step_id) == col(Step.id)).join(
                Job, col(Step.job_id) == col(Job.id)
            )
        )
        .where(col(StepAttempt.finished_at).is_not(None))
        .group_by(col(Job.tenant), col(Step.agent), outcome)
    )
    return _for_tenant(stmt, tenant)
