"""``/metrics`` scraped after real jobs ran through the API and a Celery worker: every counter equals
what the store says, tenants see only their own series, and queue depths come from the broker."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import timedelta

import httpx
import pytest
import redis
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import col, select

from conductor.settings import get_settings
from conductor.store.db import session_scope
from conductor.store.metrics import LATENCY_BUCKETS_S
from conductor.store.models import Job, Step, StepAttempt, utcnow
from conductor.tasks.queue_depth import broker_state
from tests.integration.conftest import new_key
from tests.integration.harness import wait_terminal

TOKEN = "test-metrics-token"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(api: str, auth: str | None) -> Samples:
    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    r = httpx.get(f"{api}/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def series(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def store_numbers(samples: Samples) -> Samples:
    """``samples`` but the broker's (queue depths, up), which no rollup touches."""
    return {k: v for k, v in samples.items() if not k[0].startswith(("conductor_queue", "conductor_broker"))}


def L(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


@pytest.fixture(scope="module")
def ran(client: httpx.Client, api: str) -> Iterator[None]:
    """Jobs of two tenants: a diamond, a step that needs retries, a step that fails for good."""
    other = httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key('tenant-m')}"}, timeout=30)
    submitted = [
        (client, {"task": "diamond", "workflow": {"model_ids": ["a", "b", "c", "d"],
                                                   "subtasks": ["r", "left", "right", "join"],
                                                   "access_lists": [[], [0], [0], [1, 2]]}}),
        (client, {"task": "retries", "workflow": {"model_ids": ["flaky"], "subtasks": ["x"], "access_lists": [[]]}}),
        (other, {"task": "fails", "workflow": {"model_ids": ["a", "broken"], "subtasks": ["ok", "no"],
                                                "access_lists": [[], [0]]}}),
        (other, {"task": "planned", "planner": "template:single"}),
    ]
    for c, body in submitted:
        created = c.post("/v1/jobs", json=body)
        assert created.status_code == 202, created.text
        wait_terminal(c, created.json()["id"])
    yield
    other.close()


def test_metrics_equal_what_the_store_says(ran: None, api: str) -> None:
    got = scrape(api, TOKEN)
    assert_store_series(got)

    broker = redis.Redis.from_url(get_settings().broker_url)
    assert got[("conductor_broker_up", ())] == 1
    for queue in ("planner", "steps"):
        assert got[("conductor_queue_depth", L(queue=queue))] == broker.llen(queue)


def assert_store_series(got: Samples) -> None:
    """Every job, step and attempt series of ``got`` (an all-tenant scrape) equals what the rows say."""
    with session_scope() as s:
        jobs = list(s.exec(select(Job)))
        steps = list(s.exec(select(Step)))
        attempts = list(s.exec(select(StepAttempt)))
    tenant_of = {j.id: j.tenant for j in jobs}
    worker_steps = [st for st in steps if st.agent != "conductor"]

    assert series(got, "conductor_jobs") == {
        L(tenant=t, status=st): n for (t, st), n in Counter((j.tenant, j.status) for j in jobs).items()}
    assert {"failed", "succeeded"} <= {j.status for j in jobs}
    assert series(got, "conductor_jobs_created_total") == {
        L(tenant=t): n for t, n in Counter(j.tenant for j in jobs).items()}
    assert series(got, "conductor_steps") == {
        L(tenant=t, agent=a, status=x): n
        for (t, a, x), n in Counter((tenant_of[st.job_id], st.agent, st.status) for st in steps).items()}

    tokens: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
    cost: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
    for st in worker_steps:
        t = tenant_of[st.job_id]
        tokens[L(tenant=t, role="worker", agent=st.agent, direction="input")] += st.input_tokens
        tokens[L(tenant=t, role="worker", agent=st.agent, direction="output")] += st.output_tokens
        cost[L(tenant=t, role="worker", agent=st.agent)] += st.cost_usd
    for j in jobs:
        tokens[L(tenant=j.tenant, role="planner", agent=j.planner, direction="input")] += j.planner_input_tokens
        tokens[L(tenant=j.tenant, role="planner", agent=j.planner, direction="output")] += j.planner_output_tokens
        cost[L(tenant=j.tenant, role="planner", agent=j.planner)] += j.planner_cost_usd
    assert series(got, "conductor_tokens_total") == tokens
    for name, column in (("conductor_cached_input_tokens_total", "cached_input_tokens"),
                         ("conductor_reasoning_tokens_total", "reasoning_tokens"),
                         ("conductor_cache_write_tokens_total", "cache_write_tokens")):
        details: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
        for st in worker_steps:
            details[L(tenant=tenant_of[st.job_id], role="worker", agent=st.agent)] += getattr(st, column)
        for j in jobs:
            details[L(tenant=j.tenant, role="planner", agent=j.planner)] += getattr(j, f"planner_{column}")
        assert series(got, name) == details, name
    assert series(got, "conductor_cached_input_tokens_total")[L(tenant="tenant-a", role="worker", agent="d")] >= 4
    assert series(got, "conductor_cache_write_tokens_total")[L(tenant="tenant-a", role="worker", agent="d")] >= 2
    assert sum(tokens.values()) > 0
    assert series(got, "conductor_cost_usd_total") == pytest.approx(cost)
    assert sum(cost.values()) > 0

    retries: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)
    for st in worker_steps:
        retries[L(tenant=tenant_of[st.job_id], agent=st.agent)] += max(st.attempts - 1, 0)
    assert series(got, "conductor_step_retries_total") == retries
    # Other tests of the session also run `flaky` as tenant-a: pin this module's own job.
    retried = next(j for j in jobs if j.task == "retries" and j.tenant == "tenant-a")
    assert [st.attempts for st in steps if st.job_id == retried.id] == [3]  # fail_with: [rate_limit, server]
    assert retries[L(tenant="tenant-a", agent="flaky")] >= 2
    assert retries[L(tenant="tenant-m", agent="broken")] >= 1

    step_of = {st.id: st for st in steps}
    outcomes = Counter(
        (tenant_of[step_of[a.step_id].job_id], step_of[a.step_id].agent, a.error_type or "ok")
        for a in attempts if a.finished_at is not None)
    assert series(got, "conductor_step_attempts_total") == {
        L(tenant=t, agent=a, outcome=o): n for (t, a, o), n in outcomes.items()}
    retried_step = next(st for st in steps if st.job_id == retried.id)
    # Rows come back in no particular order (an UPDATE moves a row in Postgres): order by attempt number.
    mine = sorted((a for a in attempts if a.step_id == retried_step.id), key=lambda a: a.n)
    assert [a.error_type is None for a in mine] == [False, False, True]
    assert outcomes[("tenant-a", "flaky", "ok")] >= 1

    timed = [st for st in worker_steps if st.latency_ms is not None]
    for agent in {st.agent for st in timed}:
        mine = [st.latency_ms or 0 for st in timed if st.agent == agent]
        assert got[("conductor_step_latency_seconds_count", L(agent=agent))] == len(mine)
        assert got[("conductor_step_latency_seconds_sum", L(agent=agent))] == pytest.approx(sum(mine) / 1000)
        for b in LATENCY_BUCKETS_S:
            le = repr(float(b))
            assert got[("conductor_step_latency_seconds_bucket", L(agent=agent, le=le))] == sum(
                1 for ms in mine if ms <= b * 1000), (agent, b)

    actions = series(got, "conductor_reconciler_actions_total")
    for tenant in {j.tenant for j in jobs}:
        mine_jobs = [j for j in jobs if j.tenant == tenant]
        assert actions[L(tenant=tenant, action="plan")] == sum(j.plan_resends for j in mine_jobs)
        assert actions[L(tenant=tenant, action="planning_redrive")] == sum(
            max(j.plan_claims - 1, 0) for j in mine_jobs)


def test_a_tenant_key_sees_only_its_own_series(ran: None, api: str) -> None:
    mine = scrape(api, new_key("tenant-m"))
    tenants = {dict(labels).get("tenant") for (_, labels) in mine} - {None}
    assert tenants == {"tenant-m"}
    assert not series(mine, "conductor_queue_depth")  # the broker is everyone's: operators only
    assert httpx.get(f"{api}/metrics", timeout=10).status_code == 401
    wrong = httpx.get(f"{api}/metrics", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and wrong.headers["content-type"] == "application/problem+json"


def test_queue_depth_counts_every_priority_level_of_a_queue() -> None:
    """Messages published by Celery to a queue nobody consumes, at two priorities, are all counted."""
    from conductor.tasks.app import app

    queue = "obs-depth-probe"
    settings = get_settings()
    broker = redis.Redis.from_url(settings.broker_url)
    try:
        app.send_task("conductor.finalize", args=["0" * 32], queue=queue)
        app.send_task("conductor.finalize", args=["0" * 32], queue=queue, priority=6)
        state = broker_state(settings, queues=(queue,))
        assert state is not None and state.up
        assert [(q.queue, q.ready) for q in state.queues] == [(queue, 2)]
    finally:
        broker.delete(*[k for k in broker.keys(f"{queue}*")])


def test_webhook_deliveries_and_sends_equal_their_rows(ran: None, api: str) -> None:
    from conductor.store.models import WebhookAttempt, WebhookDelivery

    # one delivery that took answers at the edges of their classes (a rounding division once put 451 in
    # 5xx and 299 in 3xx) before a 200, and one refused outright
    with session_scope() as s:
        job_ids = [j.id for j in s.exec(select(Job).where(Job.tenant == "tenant-m"))]
        taken = set(s.exec(select(WebhookDelivery.job_id)))
        free = [j for j in job_ids if j not in taken][:2]
        assert len(free) == 2
        for job_id, status, codes in ((free[0], "delivered", [500, 451, 299, 250, 200]), (free[1], "failed", [None])):
            delivery = WebhookDelivery(id=f"msg_{job_id}", job_id=job_id, tenant="tenant-m",
                                       url="https://hooks.example/x", event_type="job.succeeded", status=status,
                                       attempts=len(codes), finished_at=utcnow())
            s.add(delivery)
            s.flush()
            for n, code in enumerate(codes, start=1):
                s.add(WebhookAttempt(delivery_id=delivery.id, n=n, finished_at=utcnow(), status_code=code,
                                     error=None if code else "connection refused"))
    got = scrape(api, TOKEN)
    assert_webhook_series(got)
    assert got[("conductor_webhook_attempts_total", L(tenant="tenant-m", outcome="5xx"))] >= 1


def assert_webhook_series(got: Samples) -> None:
    from conductor.store.models import WebhookAttempt, WebhookDelivery

    with session_scope() as s:
        deliveries = list(s.exec(select(WebhookDelivery)))
        sends = list(s.exec(select(WebhookAttempt)))
    tenant_of = {d.id: d.tenant for d in deliveries}
    assert series(got, "conductor_webhook_deliveries") == {
        L(tenant=t, status=st): n for (t, st), n in Counter((d.tenant, d.status) for d in deliveries).items()}
    assert series(got, "conductor_webhook_attempts_total") == {
        L(tenant=t, outcome=o): n for (t, o), n in Counter(
            (tenant_of[a.delivery_id], f"{a.status_code // 100}xx" if a.status_code else "error")
            for a in sends if a.finished_at is not None).items()}


def test_a_rollup_pass_changes_no_number(ran: None, api: str) -> None:
    """The jobs above (and the deliveries the test above added) folded into the rollup by a reconciler
    pass's ``roll_up_metrics``: every series of an all-tenant scrape and of each tenant's is what it was,
    and still what the rows say. Whatever other modules left settled is folded too."""
    from conductor.reconcile import roll_up_metrics
    from conductor.store.models import METRICS_ROLLUP, WebhookDelivery

    keys = {"tenant-a": new_key("tenant-a"), "tenant-m": new_key("tenant-m")}
    before = {None: scrape(api, TOKEN), **{t: scrape(api, key) for t, key in keys.items()}}
    settings = get_settings().model_copy(update={"metrics_settle_s": 0.0, "metrics_abandoned_s": 86400.0})
    # a minute on, for the deliveries: an attempt that outlived its lease may be recorded after one ended
    folded = roll_up_metrics(settings, now=utcnow() + timedelta(seconds=60))
    assert folded["metrics_rolled_up_jobs"] >= 4 and folded["metrics_rolled_up_deliveries"] >= 2
    with session_scope() as s:
        assert not s.exec(select(Job.id).where(col(Job.task).in_(["diamond", "retries", "fails", "planned"]),
                                               col(Job.metrics_rolled_up_at).is_(None))).all()
        assert not s.exec(select(WebhookDelivery.id).where(col(WebhookDelivery.id).startswith("msg_"),
                                                           col(WebhookDelivery.metrics_rolled_up_at).is_(None),
                                                           WebhookDelivery.tenant == "tenant-m",
                                                           WebhookDelivery.status != "pending")).all()
        series = {row.series for row in s.execute(sa.select(METRICS_ROLLUP))}
    assert series == {"job", "step", "attempt", "webhook", "webhook_attempt"}
    after = {None: scrape(api, TOKEN), **{t: scrape(api, key) for t, key in keys.items()}}
    for tenant, samples in before.items():
        assert store_numbers(after[tenant]) == pytest.approx(store_numbers(samples), rel=1e-12), tenant
    assert_store_series(after[None])
    assert_webhook_series(after[None])
