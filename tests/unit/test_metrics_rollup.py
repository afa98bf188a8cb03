"""The metrics rollup on a migrated SQLite store (embedded mode): a reconciler pass folds ended jobs and
webhook deliveries and no number of ``/metrics`` changes, per tenant and for all; a job whose rows may
still be written (ended within ``metrics_settle_s``, an attempt still open, a planning that may still run)
is not folded until they may not. On Postgres: tests/integration/test_metrics.py (real jobs) and
test_metrics_rollup.py (concurrent passes, the partial indexes)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import col, select

from conductor.metrics import exposition, store_families
from conductor.reconcile import reconcile_once, roll_up_metrics
from conductor.settings import Settings
from conductor.store.db import session_scope
from conductor.store.metrics import read_aggregates
from conductor.store.models import (
    LATENCY_BUCKETS_S,
    METRICS_ROLLUP,
    Job,
    Step,
    StepAttempt,
    WebhookAttempt,
    WebhookDelivery,
    latency_bucket_column,
    new_id,
    utcnow,
)
from tests.sqlite_store import sqlite_store

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
HOUR = 3600.0


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    with sqlite_store(tmp_path, monkeypatch) as store_settings:
        yield store_settings


def scrape(tenant: str | None = None) -> Samples:
    with session_scope() as s:
        text = exposition(store_families(read_aggregates(s, tenant=tenant))).decode()
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(text) for x in family.samples}


def assert_same(before: Samples, after: Samples) -> None:
    assert before.keys() == after.keys()
    differ = {k: (before[k], after[k]) for k in before if not math.isclose(before[k], after[k], rel_tol=1e-12)}
    assert not differ


def add_job(tenant: str, status: str, *, ended_ago_s: float | None = 2 * HOUR, planner: str = "template:single",
            plan_claims: int = 1, planned: bool = True, plan_resends: int = 0, parent: str | None = None,
            steps: tuple[tuple[str, str, int | None, tuple[str | None, ...]], ...] = (),
            open_attempt: bool = False, delivery: str | None = None,
            delivery_ended_ago_s: float | None = None, sends: tuple[int | None, ...] = ()) -> str:
    """A job and its rows: ``steps`` are (agent, status, latency ms, each finished attempt's error type or
    None), ``open_attempt`` one more attempt still open on the first step; ``delivery`` a webhook delivery
    in that status with ``sends`` (status codes, None: nothing answered)."""
    now = utcnow()
    ended = None if ended_ago_s is None else now - timedelta(seconds=ended_ago_s)
    job_id = new_id()
    with session_scope() as s:
        s.add(Job(id=job_id, tenant=tenant, status=status, task="t", pool="default", planner=planner,
                  plan_claims=plan_claims, plan_resends=plan_resends, parent_job_id=parent,
                  planner_input_tokens=100 + len(steps), planner_output_tokens=7, planner_cost_usd=0.001,
                  planner_cached_input_tokens=60 + len(steps), planner_reasoning_tokens=2,
                  planner_cache_write_tokens=5 + len(steps),
                  planned_at=now if planned else None, finished_at=ended))
        s.flush()
        for index, (agent, step_status, latency_ms, attempts) in enumerate(steps):
            step = Step(job_id=job_id, index=index, agent=agent, instruction="x", status=step_status,
                        input_tokens=10 * (index + 1), output_tokens=3, cost_usd=0.0001 * (index + 1),
                        cached_input_tokens=4 * (index + 1), reasoning_tokens=1, cache_write_tokens=index + 2,
                        latency_ms=latency_ms, attempts=len(attempts) + (open_attempt and index == 0),
                        resends=index % 2)
            s.add(step)
            s.flush()
            for n, error in enumerate(attempts, start=1):
                s.add(StepAttempt(step_id=step.id, n=n, finished_at=ended or now, latency_ms=latency_ms,
                                  error_type=error))
            if open_attempt and index == 0:
                s.add(StepAttempt(step_id=step.id, n=len(attempts) + 1))
        if delivery is not None:
            finished = None if delivery_ended_ago_s is None else now - timedelta(seconds=delivery_ended_ago_s)
            s.add(WebhookDelivery(id=f"msg_{job_id}", job_id=job_id, tenant=tenant, url="https://hooks.example/x",
                                  event_type=f"job.{status}", status=delivery, attempts=len(sends),
                                  finished_at=finished))
            s.flush()
            for n, code in enumerate(sends, start=1):
                s.add(WebhookAttempt(delivery_id=f"msg_{job_id}", n=n, finished_at=now, status_code=code,
                                     error=None if code else "refused"))
    return job_id


def history() -> dict[str, str]:
    """Two tenants' ended jobs of every kind (a recursive step and its child job, retries, failures,
    latencies in several buckets, webhooks), and work that is not settled yet."""
    ms = [int(b * 1000) for b in LATENCY_BUCKETS_S]
    jobs = {
        "diamond": add_job("tenant-a", "succeeded", planner="conductor", steps=(
            ("a", "succeeded", ms[0], (None,)), ("b", "succeeded", ms[3] + 1, ("rate_limited", None)),
            ("c", "succeeded", ms[-1] + 5, ("server_error", "rate_limited", None)),
            ("a", "succeeded", 7, (None,))), delivery="delivered", delivery_ended_ago_s=HOUR, sends=(500, 451, 200)),
        "fails": add_job("tenant-b", "failed", plan_resends=2, steps=(
            ("a", "succeeded", 300, (None,)), ("broken", "failed", 20, ("server_error",) * 2),
            ("c", "skipped", None, ())), delivery="failed", delivery_ended_ago_s=HOUR, sends=(None,)),
        "cancelled": add_job("tenant-b", "cancelled", plan_claims=0, planned=False,
                             steps=(("a", "cancelled", None, ()),)),
        "recursive": add_job("tenant-a", "succeeded", steps=(("conductor", "succeeded", 900, (None,)),)),
    }
    jobs["child"] = add_job("tenant-a", "succeeded", parent=jobs["recursive"], steps=(("b", "succeeded", 40, (None,)),))
    jobs["recent"] = add_job("tenant-a", "succeeded", ended_ago_s=10, steps=(("a", "succeeded", 5, (None,)),),
                             delivery="delivered", delivery_ended_ago_s=10, sends=(204,))
    jobs["running"] = add_job("tenant-b", "running", ended_ago_s=None, steps=(("a", "running", None, ()),),
                              open_attempt=True, delivery="pending", sends=(503,))
    jobs["redriven"] = add_job("tenant-a", "succeeded", ended_ago_s=HOUR, plan_claims=2,
                               steps=(("a", "succeeded", 60, (None,)),))
    jobs["cancelled_planning"] = add_job("tenant-b", "cancelled", ended_ago_s=HOUR, planned=False)
    jobs["call_in_flight"] = add_job("tenant-a", "cancelled", ended_ago_s=HOUR, open_attempt=True,
                                     steps=(("b", "cancelled", None, ("rate_limited",)),))
    return jobs


def rolled_up(job_ids: list[str]) -> set[str]:
    with session_scope() as s:
        return set(s.exec(select(Job.id).where(col(Job.id).in_(job_ids), col(Job.metrics_rolled_up_at).is_not(None))))


SETTLED = ("diamond", "fails", "cancelled", "recursive", "child")


def test_a_pass_folds_settled_jobs_and_no_number_changes(settings: Settings) -> None:
    jobs = history()
    scopes = (None, "tenant-a", "tenant-b")
    before = {t: scrape(t) for t in scopes}
    assert before[None][("conductor_step_latency_seconds_count", (("agent", "c"),))] == 1
    assert roll_up_metrics(settings, now=utcnow()) == {"metrics_rolled_up_jobs": len(SETTLED),
                                                       "metrics_rolled_up_deliveries": 2}
    assert rolled_up(list(jobs.values())) == {jobs[k] for k in SETTLED}
    with session_scope() as s:
        series = {row.series for row in s.execute(sa.select(METRICS_ROLLUP))}
    assert series == {"job", "step", "attempt", "webhook", "webhook_attempt"}
    for t in scopes:
        assert_same(before[t], scrape(t))
    # nothing more is settled: nothing is counted twice
    assert roll_up_metrics(settings, now=utcnow()) == {"metrics_rolled_up_jobs": 0, "metrics_rolled_up_deliveries": 0}
    for t in scopes:
        assert_same(before[t], scrape(t))


def test_a_reconciler_pass_rolls_up(settings: Settings) -> None:
    job_id = add_job("tenant-a", "succeeded", steps=(("a", "succeeded", 12, (None,)),), delivery="delivered",
                     delivery_ended_ago_s=HOUR, sends=(200,))
    before = scrape()
    report, _ = reconcile_once(settings)
    assert report["metrics_rolled_up_jobs"] == 1 and report["metrics_rolled_up_deliveries"] == 1
    assert rolled_up([job_id]) == {job_id}
    assert_same(before, scrape())


def test_work_that_may_still_be_written_is_not_folded_until_it_may_not(settings: Settings) -> None:
    jobs = history()
    held = {"recent", "running", "redriven", "cancelled_planning", "call_in_flight"}
    roll_up_metrics(settings, now=utcnow())
    assert not rolled_up([jobs[k] for k in held])

    # The cancelled job's call returns: its attempt is closed and its usage added (as the engine does)
    with session_scope() as s:
        step = s.exec(select(Step).where(Step.job_id == jobs["call_in_flight"])).one()
        s.execute(sa.update(StepAttempt).where(col(StepAttempt.step_id) == step.id,
                                               col(StepAttempt.finished_at).is_(None))
                  .values(finished_at=utcnow(), latency_ms=2000))
        s.execute(sa.update(Step).where(col(Step.id) == step.id)
                  .values(input_tokens=col(Step.input_tokens) + 500, cost_usd=col(Step.cost_usd) + 0.5))
    expected = {t: scrape(t) for t in (None, "tenant-a")}
    assert roll_up_metrics(settings, now=utcnow())["metrics_rolled_up_jobs"] == 1
    assert rolled_up([jobs["call_in_flight"]]) == {jobs["call_in_flight"]}
    for t, samples in expected.items():
        assert_same(samples, scrape(t))

    # Past metrics_settle_s the recent job is folded; past metrics_abandoned_s (78 min by default) the
    # re-driven one and the one cancelled while planning, whose planner may have been still running; the
    # running job never (nor its open attempt's job); the pending delivery neither.
    later = utcnow() + timedelta(seconds=settings.metrics_settle_s + 60)
    assert roll_up_metrics(settings, now=later) == {"metrics_rolled_up_jobs": 1, "metrics_rolled_up_deliveries": 1}
    much_later = utcnow() + timedelta(days=1)
    assert roll_up_metrics(settings, now=much_later) == {"metrics_rolled_up_jobs": 2,
                                                         "metrics_rolled_up_deliveries": 0}
    assert not rolled_up([jobs["running"]])
    for t, samples in expected.items():
        assert_same(samples, scrape(t))


def test_an_abandoned_open_attempt_lets_its_job_be_folded(settings: Settings) -> None:
    """A worker that died mid-call on a job that ended (cancelled) leaves its attempt open, not counted: the
    job is folded once ``metrics_abandoned_s`` has passed, and the attempt closed then as ``worker_lost``
    (counted so); nothing else changes."""
    job_id = add_job("tenant-a", "cancelled", ended_ago_s=HOUR, open_attempt=True,
                     steps=(("b", "cancelled", None, ("rate_limited",)),))
    before = scrape()
    assert roll_up_metrics(settings, now=utcnow())["metrics_rolled_up_jobs"] == 0
    assert roll_up_metrics(settings.model_copy(update={"metrics_abandoned_s": 1800.0}), now=utcnow()) == {
        "metrics_rolled_up_jobs": 1, "metrics_rolled_up_deliveries": 0}
    assert rolled_up([job_id]) == {job_id}
    with session_scope() as s:
        outcomes = s.exec(select(StepAttempt.n, StepAttempt.error_type).join(Step).where(Step.job_id == job_id)
                          .order_by(col(StepAttempt.n))).all()
    assert [tuple(o) for o in outcomes] == [(1, "rate_limited"), (2, "worker_lost")]
    lost = ("conductor_step_attempts_total", (("agent", "b"), ("outcome", "worker_lost"), ("tenant", "tenant-a")))
    assert lost not in before
    assert_same({**before, lost: 1.0}, scrape())


def test_a_pass_folds_in_batches_within_its_budget(settings: Settings) -> None:
    for i in range(7):
        add_job(f"tenant-{i % 2}", "succeeded", steps=(("a", "succeeded", 10 * i, (None,)),))
    before = scrape()
    assert roll_up_metrics(settings, now=utcnow(), batch=3) == {"metrics_rolled_up_jobs": 7,
                                                                "metrics_rolled_up_deliveries": 0}
    assert_same(before, scrape())
    add_job("tenant-0", "succeeded")
    assert roll_up_metrics(settings, now=utcnow(), batch=3, budget_s=0) == {"metrics_rolled_up_jobs": 0,
                                                                            "metrics_rolled_up_deliveries": 0}


def test_the_rollup_has_a_column_per_latency_bucket() -> None:
    import importlib

    migration = importlib.import_module("conductor.migrations.versions.0019_metrics_rollup")
    columns = tuple(latency_bucket_column(b) for b in LATENCY_BUCKETS_S)
    assert columns == migration.LATENCY_BUCKET_COLUMNS
    assert all(c in METRICS_ROLLUP.c for c in columns)


def test_usage_paid_after_its_job_was_folded_reaches_the_scrape(settings: Settings) -> None:
    """A worker that lost its lease finishes its call after another took the step over (its attempt closed
    ``worker_lost``), and a re-driven planning's call past ``metrics_abandoned_s``: their usage lands on rows
    the rollup already took, which the scrape no longer reads (it was lost from /metrics)."""
    from conductor.store import jobs as store

    job_id = add_job("tenant-a", "succeeded", steps=(("b", "succeeded", 40, ("worker_lost", None)),))
    assert roll_up_metrics(settings, now=utcnow())["metrics_rolled_up_jobs"] == 1
    before = scrape("tenant-a")
    with session_scope() as s:
        step_id = s.exec(select(Step.id).where(Step.job_id == job_id)).one()
        assert store.add_unrecorded_usage(s, step_id=step_id, job_id=job_id, input_tokens=1000, output_tokens=50,
                                          cost_usd=0.25, cached_input_tokens=600, reasoning_tokens=30,
                                          cache_write_tokens=200)
        assert store.add_lost_planner_usage(s, job_id=job_id, claim=7, usage={
            "planner_input_tokens": 400, "planner_output_tokens": 20, "planner_cost_usd": 0.5,
            "planner_calls": 1, "planner_cached_input_tokens": 300, "planner_reasoning_tokens": 9,
            "planner_cache_write_tokens": 50}).added
    after = scrape("tenant-a")
    worker = ("conductor_tokens_total", (("agent", "b"), ("direction", "input"), ("role", "worker"),
                                         ("tenant", "tenant-a")))
    planner = ("conductor_tokens_total", (("agent", "template:single"), ("direction", "input"), ("role", "planner"),
                                          ("tenant", "tenant-a")))
    assert after[worker] == before[worker] + 1000
    assert after[planner] == before[planner] + 400
    for name, worker_added, planner_added in (("conductor_cached_input_tokens_total", 600, 300),
                                              ("conductor_reasoning_tokens_total", 30, 9),
                                              ("conductor_cache_write_tokens_total", 200, 50)):
        worker_series = (name, (("agent", "b"), ("role", "worker"), ("tenant", "tenant-a")))
        planner_series = (name, (("agent", "template:single"), ("role", "planner"), ("tenant", "tenant-a")))
        assert after[worker_series] == before[worker_series] + worker_added
        assert after[planner_series] == before[planner_series] + planner_added
    cost = ("conductor_cost_usd_total", (("agent", "b"), ("role", "worker"), ("tenant", "tenant-a")))
    assert math.isclose(after[cost], before[cost] + 0.25)
