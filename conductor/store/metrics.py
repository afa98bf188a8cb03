"""Aggregates for ``/metrics``: the rollup's sums plus a ``GROUP BY`` over the rows not rolled up yet.

Every number is read from the store, so it is the same whichever API process answers and whichever worker
did the work, and it survives restarts. Aggregating every row ever written at each scrape grows with the
history (17.8 s at 1.66M jobs and 6M attempts), so ended work is folded once into ``metrics_rollup``:

- a job, with its steps and their attempts, once it ended ``settle`` ago and none of its provider calls is
  still open (``roll_up_jobs``): a cancelled or failed job's call in flight still closes its attempt and adds
  its usage when it returns, and a superseded planning its planner's usage, so a job with an open attempt
  or a planning that may still run waits ``abandoned`` (the longest a live worker may still write) instead,
  and an attempt still open then (its worker died) is closed as ``worker_lost`` as the job is folded;
- a webhook delivery, with its attempts, once it ended (``roll_up_deliveries``): deliveries go on after
  their job ended, so they are folded by their own state.

Each fold takes a bounded batch (``FOR NO KEY UPDATE SKIP LOCKED`` on Postgres, so concurrent passes take
different rows), adds its sums to the rollup and marks the rows (``metrics_rolled_up_at``) in one
transaction: a worker dying midway folds nothing, and no row is counted twice. A scrape reads, per
series, one statement: the rollup's rows UNION ALL the ``GROUP BY`` over the rows not rolled up (found by
the partial indexes ``ix_job_metrics_unrolled`` and ``ix_webhook_delivery_metrics_unrolled``), so a fold
committing meanwhile is counted once, in one or the other. Nothing deletes jobs; a retention that did
would leave their sums in the rollup (counters must not go down).

Usage of a recursive step (agent ``conductor``) is its child job's total, so it is left out here: the child
job's own planner and steps are counted where they happened.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col

from conductor.errors import ErrorType
from conductor.store.models import (
    LATENCY_BUCKETS_S,
    METRICS_ROLLUP,
    DeliveryStatus,
    Job,
    JobStatus,
    Step,
    StepAttempt,
    WebhookAttempt,
    WebhookDelivery,
    latency_bucket_column,
    utcnow,
)

CONDUCTOR_AGENT = "conductor"  # the reserved agent (conductor.workflow's constant; the store imports no domain)
ATTEMPT_OK = "ok"
ENDED_DELIVERIES = (DeliveryStatus.DELIVERED, DeliveryStatus.FAILED, DeliveryStatus.DISABLED)

__all__ = ["LATENCY_BUCKETS_S", "LatencyHistogram", "StoreAggregates", "add_late_usage", "close_abandoned_attempts",
           "read_aggregates", "roll_up_deliveries", "roll_up_jobs", "scrape_statements", "settled_jobs"]


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
    usage: list[tuple[str, str, str, int, int, float, int, int, int]] = field(default_factory=list)
    """(tenant, role 'planner' | 'worker', agent, input tokens, output tokens, cost USD, cached input tokens,
    reasoning tokens, cache-write tokens)."""
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


@dataclass(frozen=True)
class _Series:
    """One scan's rows in ``metrics_rollup``: ``labels`` label columns after the tenant (``label_a``, then
    ``label_b``), then ``values``, the rollup columns in the order the scan aggregates them."""

    name: str
    labels: int
    values: tuple[str, ...]


LATENCY_COLUMNS = tuple(latency_bucket_column(b) for b in LATENCY_BUCKETS_S)
USAGE_VALUES = ("input_tokens", "output_tokens", "cost_usd", "cached_input_tokens", "reasoning_tokens",
                "cache_write_tokens")
JOBS = _Series("job", 2, ("n", *USAGE_VALUES, "resends", "redrives"))
"""(tenant, status, planner): jobs, planner usage, plan re-sends, plannings re-driven."""
STEPS = _Series("step", 2, ("n", *USAGE_VALUES, "retries", "resends", "latency_count", "latency_ms", *LATENCY_COLUMNS))
"""(tenant, agent, status): steps, usage, retries, re-sends, timed steps, their latency sum and buckets."""
ATTEMPTS = _Series("attempt", 2, ("n",))
"""(tenant, agent, outcome): finished attempts."""
WEBHOOKS = _Series("webhook", 1, ("n",))
"""(tenant, status): deliveries."""
WEBHOOK_ATTEMPTS = _Series("webhook_attempt", 1, ("n",))
"""(tenant, outcome): finished sends."""
ROLLUP_VALUES = ("n", *USAGE_VALUES, "retries", "resends", "redrives", "latency_count", "latency_ms", *LATENCY_COLUMNS)


# --- the scrape ----------------------------------------------------------------------------------


def read_aggregates(session: Session, *, tenant: str | None = None) -> StoreAggregates:
    """Everything ``/metrics`` reports from the store, in five statements (jobs, steps, attempts, webhook
    deliveries, their attempts), each the rollup's rows and the rows not rolled up; with ``tenant``, only
    that tenant's."""
    statements = scrape_statements(tenant)

    def read(series: _Series) -> list[Any]:
        return _merge(session.execute(statements[series.name]), keys=1 + series.labels)

    agg = StoreAggregates(attempts=read(ATTEMPTS))
    _add_jobs(agg, read(JOBS))
    _add_steps(agg, read(STEPS))
    agg.webhooks = read(WEBHOOKS)
    agg.webhook_attempts = read(WEBHOOK_ATTEMPTS)
    return agg


def scrape_statements(tenant: str | None = None) -> dict[str, Any]:
    """The scrape's statement for each series (by name): the ``GROUP BY`` over the jobs (or deliveries)
    not rolled up, and their steps and attempts, UNION ALL the rollup's rows."""
    jobs = _for_tenant(col(Job.metrics_rolled_up_at).is_(None), col(Job.tenant), tenant)
    deliveries = _for_tenant(col(WebhookDelivery.metrics_rolled_up_at).is_(None), col(WebhookDelivery.tenant), tenant)
    return {
        JOBS.name: _with_rollup(JOBS, _job_scan(jobs), tenant),
        STEPS.name: _with_rollup(STEPS, _step_scan(jobs), tenant),
        ATTEMPTS.name: _with_rollup(ATTEMPTS, _attempt_scan(jobs), tenant),
        WEBHOOKS.name: _with_rollup(WEBHOOKS, _webhook_deliveries(deliveries), tenant),
        WEBHOOK_ATTEMPTS.name: _with_rollup(WEBHOOK_ATTEMPTS, _webhook_attempts(deliveries), tenant),
    }


def _for_tenant(condition: Any, tenant_column: Any, tenant: str | None) -> Any:
    return condition if tenant is None else sa.and_(condition, tenant_column == tenant)


def _with_rollup(series: _Series, live: Any, tenant: str | None) -> Any:
    """``live`` UNION ALL the rollup's rows of ``series``, in ``live``'s shape: one statement, one snapshot."""
    r = METRICS_ROLLUP.c
    labels = [r.label_a, r.label_b][: series.labels]
    rolled = sa.select(r.tenant, *labels, *(r[v] for v in series.values)).where(r.series == series.name)
    if tenant is not None:
        rolled = rolled.where(r.tenant == tenant)
    return sa.union_all(live, rolled)


def _merge(rows: Iterable[Sequence[Any]], *, keys: int) -> list[Any]:
    """Rows with the same key (the first ``keys`` columns: one from the rollup, one from the live rows)
    summed into one."""
    merged: dict[tuple[Any, ...], list[Any]] = {}
    for row in rows:
        key, values = tuple(row[:keys]), [_number(v) for v in row[keys:]]
        totals = merged.get(key)
        if totals is None:
            merged[key] = values
        else:
            merged[key] = [a + b for a, b in zip(totals, values, strict=True)]
    return [(*key, *values) for key, values in merged.items()]


def _number(v: Any) -> int | float:
    """Counts come back as int or Decimal (a ``numeric`` sum), costs as float."""
    return v if isinstance(v, float) else int(v or 0)


def _sum(column: Any) -> Any:
    return sa.func.coalesce(sa.func.sum(column), 0)


def _job_scan(jobs: Any) -> Any:
    redrives = sa.case((col(Job.plan_claims) > 1, col(Job.plan_claims) - 1), else_=0)
    return sa.select(
        col(Job.tenant), col(Job.status), col(Job.planner), sa.func.count(),
        _sum(col(Job.planner_input_tokens)), _sum(col(Job.planner_output_tokens)), _sum(col(Job.planner_cost_usd)),
        _sum(col(Job.planner_cached_input_tokens)), _sum(col(Job.planner_reasoning_tokens)),
        _sum(col(Job.planner_cache_write_tokens)), _sum(col(Job.plan_resends)), _sum(redrives),
    ).where(jobs).group_by(col(Job.tenant), col(Job.status), col(Job.planner))


def _add_jobs(agg: StoreAggregates, rows: Any) -> None:
    by_status: dict[tuple[str, str], int] = defaultdict(int)
    planner: dict[tuple[str, str], list[float]] = defaultdict(_no_usage)
    actions: dict[tuple[str, str], int] = defaultdict(int)
    for tenant, status, planner_name, n, *usage, resends, redrives in rows:
        by_status[(tenant, status)] += int(n)
        _add_usage(planner[(tenant, planner_name)], usage)
        actions[(tenant, "plan")] += int(resends)
        actions[(tenant, "planning_redrive")] += int(redrives)
    agg.jobs = [(t, st, n) for (t, st), n in by_status.items()]
    agg.usage += [_usage_row(t, "planner", name, v) for (t, name), v in planner.items()]
    agg.resends += [(t, action, n) for (t, action), n in actions.items()]


def _step_scan(jobs: Any) -> Any:
    ms = col(Step.latency_ms)
    retries = sa.case((col(Step.attempts) > 1, col(Step.attempts) - 1), else_=0)
    buckets = [_sum(sa.case((ms <= int(b * 1000), 1), else_=0)) for b in LATENCY_BUCKETS_S]
    return (
        sa.select(
            col(Job.tenant), col(Step.agent), col(Step.status), sa.func.count(),
            _sum(col(Step.input_tokens)), _sum(col(Step.output_tokens)), _sum(col(Step.cost_usd)),
            _sum(col(Step.cached_input_tokens)), _sum(col(Step.reasoning_tokens)), _sum(col(Step.cache_write_tokens)),
            _sum(retries), _sum(col(Step.resends)), sa.func.count(ms), _sum(ms), *buckets,
        )
        .select_from(sa.join(Step, Job, col(Step.job_id) == col(Job.id)))
        .where(jobs)
        .group_by(col(Job.tenant), col(Step.agent), col(Step.status))
    )


def _add_steps(agg: StoreAggregates, rows: Any) -> None:
    """Per status rows folded into per agent series. A recursive step's usage, retries and latency are its
    child job's, counted there: only its status is counted here."""
    usage: dict[tuple[str, str], list[float]] = defaultdict(_no_usage)
    retries: dict[tuple[str, str], int] = defaultdict(int)
    resends: dict[str, int] = defaultdict(int)
    latency: dict[str, list[int]] = defaultdict(lambda: [0] * (len(LATENCY_BUCKETS_S) + 2))
    width = len(USAGE_VALUES)
    for row in rows:
        tenant, agent, status, n = row[:4]
        spent, (retried, resent, timed, total_ms, *cumulative) = row[4:4 + width], row[4 + width:]
        agg.steps.append((tenant, agent, status, int(n)))
        resends[tenant] += int(resent)
        if agent == CONDUCTOR_AGENT:
            continue
        _add_usage(usage[(tenant, agent)], spent)
        retries[(tenant, agent)] += int(retried)
        hist = latency[agent]
        for i, v in enumerate([int(timed), int(total_ms), *(int(c) for c in cumulative)]):
            hist[i] += v
    agg.usage += [_usage_row(t, "worker", agent, v) for (t, agent), v in usage.items()]
    agg.retries = [(t, agent, n) for (t, agent), n in retries.items()]
    agg.resends += [(t, "step", n) for t, n in resends.items()]
    agg.latency = [LatencyHistogram(agent, tuple(h[2:]), h[0], h[1] / 1000) for agent, h in latency.items() if h[0]]


def _no_usage() -> list[float]:
    """Sums of ``USAGE_VALUES``, none yet."""
    return [0.0 if name == "cost_usd" else 0 for name in USAGE_VALUES]


def _add_usage(totals: list[float], values: Sequence[Any]) -> None:
    """Adds a row's ``USAGE_VALUES`` to ``totals``."""
    for i, v in enumerate(values):
        totals[i] += float(v) if USAGE_VALUES[i] == "cost_usd" else int(v)


def _usage_row(tenant: str, role: str, agent: str,
               v: list[float]) -> tuple[str, str, str, int, int, float, int, int, int]:
    """A ``StoreAggregates.usage`` row from the sums of ``USAGE_VALUES``."""
    return (tenant, role, agent, int(v[0]), int(v[1]), float(v[2]), int(v[3]), int(v[4]), int(v[5]))


def _webhook_deliveries(deliveries: Any) -> Any:
    return sa.select(col(WebhookDelivery.tenant), col(WebhookDelivery.status), sa.func.count()).where(
        deliveries).group_by(col(WebhookDelivery.tenant), col(WebhookDelivery.status))


def _webhook_attempts(deliveries: Any) -> Any:
    code = col(WebhookAttempt.status_code)
    # floor division: "/" is true division in SQLAlchemy 2 (a NUMERIC that Postgres rounds when cast: 451 -> 5xx);
    # "||", not concat(), which SQLite lacks
    outcome = sa.case((code.is_(None), "error"), else_=sa.cast(code // 100, sa.String()) + "xx")
    return (
        sa.select(col(WebhookDelivery.tenant), outcome, sa.func.count())
        .select_from(sa.join(WebhookAttempt, WebhookDelivery,
                             col(WebhookAttempt.delivery_id) == col(WebhookDelivery.id)))
        .where(col(WebhookAttempt.finished_at).is_not(None), deliveries)
        .group_by(col(WebhookDelivery.tenant), outcome)
    )


def _attempt_scan(jobs: Any) -> Any:
    outcome = sa.func.coalesce(col(StepAttempt.error_type), ATTEMPT_OK)
    return (
        sa.select(col(Job.tenant), col(Step.agent), outcome, sa.func.count())
        .select_from(
            sa.join(StepAttempt, Step, col(StepAttempt.step_id) == col(Step.id)).join(
                Job, col(Step.job_id) == col(Job.id)
            )
        )
        .where(col(StepAttempt.finished_at).is_not(None), jobs)
        .group_by(col(Job.tenant), col(Step.agent), outcome)
    )


# --- the rollup ----------------------------------------------------------------------------------


def roll_up_jobs(session: Session, *, settled_before: datetime, abandoned_before: datetime, limit: int,
                 now: datetime | None = None) -> int:
    """Folds up to ``limit`` ended jobs (oldest first) into ``metrics_rollup`` and marks them, in the
    caller's transaction (commit it: the sums and the marks land together or not at all). A job is taken
    once it ended before ``settled_before`` with none of its attempts open and no planning that may still
    be running (one was re-driven, or the job ended before its plan was recorded), else once it ended
    before ``abandoned_before`` (the worker of what is still open is gone): its attempts still open are then
    closed as ``worker_lost`` (``close_abandoned_attempts``) and counted so. Returns how many were folded."""
    now = now or utcnow()
    ids = _mark(session, Job, list(session.execute(settled_jobs(settled_before, abandoned_before, limit)).scalars()),
                now)
    if ids:
        jobs = col(Job.id).in_(ids)
        close_abandoned_attempts(session, job_ids=ids, now=now)
        _fold(session, [(JOBS, _job_scan(jobs)), (STEPS, _step_scan(jobs)), (ATTEMPTS, _attempt_scan(jobs))])
    return len(ids)


def settled_jobs(settled_before: datetime, abandoned_before: datetime, limit: int) -> Any:
    """``roll_up_jobs``'s choice of jobs, oldest first through ``ix_job_metrics_unrolled``, each locked
    (``FOR NO KEY UPDATE SKIP LOCKED`` on Postgres: another pass's are skipped, never waited for)."""
    attempt, step = StepAttempt, Step
    open_attempt = sa.exists(
        sa.select(sa.literal(1))
        .select_from(sa.join(attempt, step, col(attempt.step_id) == col(step.id)))
        .where(col(step.job_id) == col(Job.id), col(attempt.finished_at).is_(None))
    )
    planning_may_write = sa.or_(col(Job.plan_claims) > 1,
                                sa.and_(col(Job.plan_claims) > 0, col(Job.planned_at).is_(None)))
    return (
        sa.select(col(Job.id))
        .where(
            col(Job.metrics_rolled_up_at).is_(None),
            col(Job.status).in_(sorted(JobStatus.TERMINAL)),
            col(Job.finished_at) < settled_before,
            sa.or_(col(Job.finished_at) < abandoned_before, sa.and_(~planning_may_write, ~open_attempt)),
        )
        .order_by(col(Job.finished_at))
        .limit(limit)
        .with_for_update(skip_locked=True, key_share=True)
    )


ABANDONED_ATTEMPT = ("its worker stopped before the call ended and nothing else closed the attempt (its step had "
                     "ended with its job); closed when the job's metrics were folded")


def close_abandoned_attempts(session: Session, *, job_ids: Sequence[str], now: datetime) -> int:
    """Closes, as ``worker_lost``, the attempts still open on ``job_ids`` (ended jobs the fold takes). Such an
    attempt's worker died mid-call after its step had ended with its job (the job was cancelled or failed
    meanwhile, before or after the death): no re-claim closes it (the step is not run again) and its
    worker never returns, so it stayed open for ever, shown running by the API and counted nowhere.
    Only jobs past ``abandoned_before`` have any (``settled_jobs``). A worker that does return after all
    (a call stuck past its timeout) finds it closed (``finish_attempt`` is fenced) and still adds its usage
    (``add_late_usage``)."""
    steps = sa.select(col(Step.id)).where(col(Step.job_id).in_(list(job_ids)))
    closed = session.execute(
        sa.update(StepAttempt)
        .where(col(StepAttempt.step_id).in_(steps), col(StepAttempt.finished_at).is_(None))
        .values(finished_at=now, error_type=ErrorType.WORKER_LOST, error=ABANDONED_ATTEMPT)
        .execution_options(synchronize_session=False)
    )
    return int(getattr(closed, "rowcount", 0) or 0)


def roll_up_deliveries(session: Session, *, settled_before: datetime, limit: int, now: datetime | None = None) -> int:
    """Folds up to ``limit`` webhook deliveries that ended before ``settled_before`` (delivered, failed or
    disabled: none is sent again) with their attempts, as ``roll_up_jobs`` does jobs. An attempt that
    outlived its lease may still be recorded after its delivery ended: ``settled_before`` must leave it
    that long (``webhook_timeout_s`` and the lease's margin)."""
    ended = (
        sa.select(col(WebhookDelivery.id))
        .where(
            col(WebhookDelivery.metrics_rolled_up_at).is_(None),
            col(WebhookDelivery.status).in_([s.value for s in ENDED_DELIVERIES]),
            col(WebhookDelivery.finished_at) < settled_before,
        )
        .order_by(col(WebhookDelivery.finished_at))
        .limit(limit)
        .with_for_update(skip_locked=True, key_share=True)
    )
    ids = _mark(session, WebhookDelivery, list(session.execute(ended).scalars()), now or utcnow())
    if ids:
        deliveries = col(WebhookDelivery.id).in_(ids)
        _fold(session, [(WEBHOOKS, _webhook_deliveries(deliveries)),
                        (WEBHOOK_ATTEMPTS, _webhook_attempts(deliveries))])
    return len(ids)


def _mark(session: Session, model: type[Job] | type[WebhookDelivery], ids: list[str], now: datetime) -> list[str]:
    """Marks the rows of ``ids`` still not rolled up; returns those, the rows this transaction folds. On
    Postgres they are all of ``ids`` (locked when chosen); on SQLite, which locks no row, the update takes
    the database's write lock until the commit, and a row another pass marked meanwhile is left out."""
    if not ids:
        return []
    marked = session.execute(
        sa.update(model)
        .where(col(model.id).in_(ids), col(model.metrics_rolled_up_at).is_(None))
        .values(metrics_rolled_up_at=now)
        .returning(col(model.id))
    )
    return list(marked.scalars())


def add_late_usage(session: Session, *, tenant: str, series: str, labels: tuple[str, str],
                   input_tokens: int, output_tokens: int, cost_usd: float, cached_input_tokens: int = 0,
                   reasoning_tokens: int = 0, cache_write_tokens: int = 0) -> None:
    """Usage written to a job already folded (a call that returned after the rollup took its job: a worker
    that lost its lease, a planning re-driven past ``metrics_abandoned_s``) is added to the rollup too, in
    the caller's transaction: the scrape no longer reads that job's rows. ``series`` is ``step`` (labels
    agent, status) or ``job`` (status, planner: the planner's usage)."""
    row = dict.fromkeys(ROLLUP_VALUES, 0) | {
        "input_tokens": int(input_tokens), "output_tokens": int(output_tokens), "cost_usd": float(cost_usd),
        "cached_input_tokens": int(cached_input_tokens), "reasoning_tokens": int(reasoning_tokens),
        "cache_write_tokens": int(cache_write_tokens)}
    _upsert(session, [{"tenant": tenant, "series": series, "label_a": labels[0], "label_b": labels[1], **row}])


def _fold(session: Session, scans: list[tuple[_Series, Any]]) -> None:
    """Adds the scans' rows to the rollup: one upsert per (tenant, series, labels), in key order, so two
    folds at once wait for each other's rows in the same order (no deadlock)."""
    sums: list[dict[str, Any]] = []
    for series, scan in scans:
        for row in session.execute(scan):
            labels = [str(v) for v in row[1:1 + series.labels]] + [""] * (2 - series.labels)
            values: dict[str, Any] = dict.fromkeys(ROLLUP_VALUES, 0) | dict(
                zip(series.values, (_number(v) for v in row[1 + series.labels:]), strict=True))
            values["cost_usd"] = float(values["cost_usd"])
            sums.append({"tenant": row[0], "series": series.name, "label_a": labels[0], "label_b": labels[1],
                         **values})
    if not sums:
        return
    sums.sort(key=lambda r: (r["tenant"], r["series"], r["label_a"], r["label_b"]))
    _upsert(session, sums)


def _upsert(session: Session, sums: list[dict[str, Any]]) -> None:
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(METRICS_ROLLUP)
    stmt = stmt.on_conflict_do_update(
        index_elements=["tenant", "series", "label_a", "label_b"],
        set_={v: METRICS_ROLLUP.c[v] + stmt.excluded[v] for v in ROLLUP_VALUES},
    )
    session.execute(stmt, sums)  # in list order: executemany runs them one after another
