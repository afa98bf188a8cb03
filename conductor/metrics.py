"""Prometheus metrics, built at scrape time from what the store and the broker say.

Nothing is counted in process memory: a scrape reads aggregates from Postgres (jobs, steps, usage,
attempts, reconciler re-sends, latency) and queue depths from the broker, so any number of API
processes on any number of hosts answer the same, and no count is lost when a worker restarts.
(Hence no ``PROMETHEUS_MULTIPROC_DIR``: there is no per-process state to merge.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from conductor.store.metrics import LATENCY_BUCKETS_S, StoreAggregates

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class QueueDepth:
    queue: str
    ready: int
    """Messages waiting in the queue."""


@dataclass(frozen=True)
class BrokerState:
    up: bool
    queues: Sequence[QueueDepth] = ()
    unacked: int = 0
    """Messages delivered to a worker and not yet acknowledged (running, or waiting to be redelivered)."""


def store_families(agg: StoreAggregates) -> Iterator[Metric]:
    jobs = GaugeMetricFamily("conductor_jobs", "Jobs in each status (child jobs included).",
                             labels=["tenant", "status"])
    created = CounterMetricFamily("conductor_jobs_created", "Jobs accepted, child jobs included.", labels=["tenant"])
    per_tenant: dict[str, int] = {}
    for tenant, status, n in agg.jobs:
        jobs.add_metric([tenant, status], n)
        per_tenant[tenant] = per_tenant.get(tenant, 0) + int(n)
    for tenant, n in sorted(per_tenant.items()):
        created.add_metric([tenant], n)
    yield jobs
    yield created

    steps = GaugeMetricFamily("conductor_steps", "Steps in each status.", labels=["tenant", "agent", "status"])
    for tenant, agent, status, n in agg.steps:
        steps.add_metric([tenant, agent, status], n)
    yield steps

    labels = ["tenant", "role", "agent"]
    tokens = CounterMetricFamily("conductor_tokens", "Tokens used by the planner and by worker steps.",
                                 labels=[*labels, "direction"])
    cost = CounterMetricFamily("conductor_cost_usd", "Cost in USD of planner and worker calls.", labels=labels)
    cached = CounterMetricFamily("conductor_cached_input_tokens", "Of the input tokens, those the providers read "
                                 "from their prompt caches.", labels=labels)
    reasoning = CounterMetricFamily("conductor_reasoning_tokens", "Of the output tokens, the models' reasoning.",
                                    labels=labels)
    written = CounterMetricFamily("conductor_cache_write_tokens", "Of the input tokens, those the providers wrote "
                                  "to their prompt caches.", labels=labels)
    for tenant, role, agent, tokens_in, tokens_out, usd, tokens_cached, tokens_reasoning, tokens_written in agg.usage:
        tokens.add_metric([tenant, role, agent, "input"], int(tokens_in))
        tokens.add_metric([tenant, role, agent, "output"], int(tokens_out))
        cost.add_metric([tenant, role, agent], float(usd))
        cached.add_metric([tenant, role, agent], int(tokens_cached))
        reasoning.add_metric([tenant, role, agent], int(tokens_reasoning))
        written.add_metric([tenant, role, agent], int(tokens_written))
    yield tokens
    yield cost
    yield cached
    yield reasoning
    yield written

    retries = CounterMetricFamily("conductor_step_retries", "Provider calls beyond each step's first attempt.",
                                  labels=["tenant", "agent"])
    for tenant, agent, n in agg.retries:
        retries.add_metric([tenant, agent], int(n))
    yield retries

    attempts = CounterMetricFamily("conductor_step_attempts", "Finished provider-call attempts by outcome "
                                   "('ok', or the error type such as rate_limited or worker_lost).",
                                   labels=["tenant", "agent", "outcome"])
    for tenant, agent, outcome, n in agg.attempts:
        attempts.add_metric([tenant, agent, outcome], int(n))
    yield attempts

    actions = CounterMetricFamily("conductor_reconciler_actions", "Work the reconciler re-drove: plan and step "
                                  "messages re-sent, plannings restarted after their worker died.",
                                  labels=["tenant", "action"])
    for tenant, action, n in agg.resends:
        actions.add_metric([tenant, action], int(n or 0))
    yield actions

    deliveries = GaugeMetricFamily("conductor_webhook_deliveries", "Webhook deliveries in each status.",
                                   labels=["tenant", "status"])
    for tenant, status, n in agg.webhooks:
        deliveries.add_metric([tenant, status], n)
    yield deliveries
    sends = CounterMetricFamily("conductor_webhook_attempts", "Finished webhook sends by answer class "
                                "('2xx', '4xx', …, or 'error' when nothing answered).", labels=["tenant", "outcome"])
    for tenant, outcome, n in agg.webhook_attempts:
        sends.add_metric([tenant, outcome], n)
    yield sends

    latency = HistogramMetricFamily("conductor_step_latency_seconds", "Latency of finished worker calls.",
                                    labels=["agent"])
    for h in agg.latency:
        buckets = [(_le(b), c) for b, c in zip(LATENCY_BUCKETS_S, h.cumulative, strict=True)]
        latency.add_metric([h.agent], [*buckets, ("+Inf", h.count)], sum_value=h.sum_s)
    yield latency


def broker_families(state: BrokerState) -> Iterator[Metric]:
    yield GaugeMetricFamily("conductor_broker_up", "1 when the broker answered this scrape.", value=int(state.up))
    depth = GaugeMetricFamily("conductor_queue_depth", "Messages waiting in each Celery queue.", labels=["queue"])
    for q in state.queues:
        depth.add_metric([q.queue], q.ready)
    yield depth
    if state.up:
        yield GaugeMetricFamily("conductor_queue_unacked", "Messages taken by a worker, not yet acknowledged.",
                                value=state.unacked)


def exposition(families: Iterable[Metric]) -> bytes:
    """The Prometheus text format of ``families`` (a registry built for this one scrape)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families)))
    return generate_latest(registry)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _le(bound: float) -> str:
    return repr(float(bound))
