"""The per-agent token bucket on the real Redis (the test broker db), shared by separate processes.

Rates are chosen so a token refills far slower than the test runs (6/min: one every 10 s): counts of
immediate grants are then exact however slow the machine is. No test asserts a duration beyond
"waited > 0".
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from conductor.pool.errors import RetryableError
from conductor.ratelimit import MAX_CONNECTIONS, RateLimiter, RateLimiterUnavailable, RateLimitTimeout, get_limiter
from conductor.settings import get_settings
from tests.integration.harness import free_port

pytestmark = pytest.mark.integration

SLOW_RPM = 6  # one token per 10 s: nothing refills while a test counts
WORKFLOW = '{"model_ids": ["coder"], "subtasks": ["Answer."], "access_lists": [[]]}'


@pytest.fixture
def agent() -> Iterator[str]:
    """A fresh bucket per test; removed afterwards."""
    name = f"test-agent-{uuid.uuid4().hex[:8]}"
    yield name
    r = redis.Redis.from_url(get_settings().broker_url)
    for key in r.scan_iter(f"{RateLimiter(r).key(name)}*"):
        r.delete(key)


@pytest.fixture
def limiter() -> RateLimiter:
    return RateLimiter(url=get_settings().broker_url)


def _grab(url: str, agent: str, rpm: int, burst: int, calls: int, start: Any, out: Any) -> None:
    """Child process: its own client and limiter; reports each call as ("granted", waited) or ("timeout", s)."""
    limiter = RateLimiter(url=url)
    start.wait(30)
    for _ in range(calls):
        try:
            out.put(("granted", limiter.acquire(agent, rpm, timeout_s=1.0, burst=burst)))
        except RateLimitTimeout as exc:
            out.put(("timeout", exc.retry_after))


def test_two_processes_share_one_bucket(agent: str) -> None:
    """Two limiters in different processes draw from one bucket: together they get exactly ``burst``
    immediate tokens, and every other call is refused (its slot is beyond the 1 s timeout)."""
    burst, calls_each = 5, 6
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    url = get_settings().broker_url
    procs = [ctx.Process(target=_grab, args=(url, agent, SLOW_RPM, burst, calls_each, start, out)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=60) for _ in range(2 * calls_each)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0

    granted = [w for kind, w in results if kind == "granted"]
    refused = [w for kind, w in results if kind == "timeout"]
    assert len(granted) == burst
    assert all(w == 0.0 for w in granted)
    assert len(refused) == 2 * calls_each - burst
    assert all(w is not None and w > 0 for w in refused)


def test_full_bucket_grants_capacity_then_makes_the_next_caller_wait(limiter: RateLimiter, agent: str) -> None:
    burst = 3
    waits = [limiter.acquire(agent, SLOW_RPM, timeout_s=0, burst=burst) for _ in range(burst)]
    assert waits == [0.0] * burst
    with pytest.raises(RateLimitTimeout) as info:
        limiter.acquire(agent, SLOW_RPM, timeout_s=0, burst=burst)
    assert info.value.retry_after is not None and info.value.retry_after > 0
    assert isinstance(info.value, RetryableError)
    assert agent in str(info.value)


def test_caller_sleeps_until_its_token_is_due(limiter: RateLimiter, agent: str) -> None:
    """120/min with a burst of 1: the second call waits for the refill (about half a second) and gets it."""
    assert limiter.acquire(agent, 120, timeout_s=5, burst=1) == 0.0
    assert limiter.acquire(agent, 120, timeout_s=5, burst=1) > 0


def _refused_after(limiter: RateLimiter, agent: str) -> float:
    with pytest.raises(RateLimitTimeout) as info:
        limiter.acquire(agent, SLOW_RPM, timeout_s=0, burst=1)
    assert info.value.retry_after is not None
    return info.value.retry_after


def test_refused_call_reserves_nothing(limiter: RateLimiter, agent: str) -> None:
    """A timeout leaves the bucket as it was: the refusal does not push later callers further back."""
    limiter.acquire(agent, SLOW_RPM, timeout_s=0, burst=1)
    first = _refused_after(limiter, agent)
    second = _refused_after(limiter, agent)
    assert second <= first


def test_agents_have_separate_namespaced_buckets(limiter: RateLimiter, agent: str) -> None:
    other = f"{agent}-other"
    try:
        limiter.acquire(agent, SLOW_RPM, timeout_s=0, burst=1)
        with pytest.raises(RateLimitTimeout):
            limiter.acquire(agent, SLOW_RPM, timeout_s=0, burst=1)
        assert limiter.acquire(other, SLOW_RPM, timeout_s=0, burst=1) == 0.0
        assert limiter.key(agent) == f"conductor:rl:{agent}"
        assert limiter.client.exists(limiter.key(agent))
        assert limiter.client.pttl(limiter.key(agent)) > 0  # idle buckets expire instead of piling up
    finally:
        limiter.client.delete(limiter.key(other))


def test_more_callers_than_connections_wait_for_one_instead_of_failing(agent: str) -> None:
    limiter = RateLimiter(url=get_settings().broker_url)
    pool = limiter.client.connection_pool
    held = [pool.get_connection() for _ in range(MAX_CONNECTIONS)]  # every connection busy
    done: list[Any] = []
    caller = threading.Thread(target=lambda: done.append(limiter.acquire(agent, 6000, timeout_s=5)))
    caller.start()
    caller.join(0.3)
    assert caller.is_alive() and not done  # waiting for a connection, not failed
    pool.release(held.pop())
    caller.join(10)
    assert done == [0.0]  # granted once a connection was free
    for connection in held:
        pool.release(connection)


def test_unreachable_redis_is_a_retryable_error_not_a_hang(agent: str) -> None:
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    with pytest.raises(RateLimiterUnavailable, match="cannot reach Redis") as info:
        RateLimiter(dead).acquire(agent, 60, timeout_s=30)
    assert isinstance(info.value, RetryableError)


def test_rejects_nonsense_limits(limiter: RateLimiter, agent: str) -> None:
    with pytest.raises(ValueError):
        limiter.acquire(agent, 0, timeout_s=1)
    with pytest.raises(ValueError):
        limiter.acquire(agent, 60, timeout_s=1, burst=0)


def test_process_wide_limiter_uses_the_broker_redis() -> None:
    limiter = get_limiter()
    assert limiter is get_limiter()
    expected = redis.Redis.from_url(get_settings().broker_url).connection_pool.connection_kwargs
    actual = limiter.client.connection_pool.connection_kwargs
    assert (actual["host"], actual["port"], actual["db"]) == (expected["host"], expected["port"], expected["db"])
    assert limiter.client.ping()


def _plan_with_the_bucket_spent(bucket: str, planner: str, agents: Callable[[dict[str, Any]], dict[str, Any]]
                                ) -> tuple[Any, list[Any]]:
    """Takes every slot of this minute from ``bucket`` (as its agent's steps would), then plans with agent
    ``planner`` of the pool whose ``agents`` are built around an OpenAI-compatible loopback server's entry;
    returns the plan and the requests that server received."""
    from types import SimpleNamespace

    from conductor.planning.planner import _plan_with_agent
    from conductor.pool.config import PoolConfig
    from conductor.settings import Settings
    from tests.fakes.openai_server import FakeOpenAIServer

    settings = Settings(broker_url=get_settings().broker_url, rate_limit_wait_s=0.2, step_max_attempts=1)
    limiter = get_limiter(settings.broker_url)
    for _ in range(SLOW_RPM):
        limiter.acquire(bucket, SLOW_RPM, timeout_s=0, tenant="t")
    job: Any = SimpleNamespace(task="t", context=None, depth=0, tenant="t", limits={}, planner_input_tokens=0,
                               planner_output_tokens=0, planner_cost_usd=0.0)
    with FakeOpenAIServer(reply=lambda _body: WORKFLOW) as server:
        model = {"provider": "openai_compatible", "model": "m", "base_url": server.base_url, "rpm": SLOW_RPM}
        pool = PoolConfig.model_validate({"planner": planner, "agents": agents(model)})
        result = _plan_with_agent(job, pool, planner, settings, max_steps=3, allow_conductor=False)
        return result, list(server.requests)


def test_a_planner_call_takes_a_slot_of_its_agents_limit_like_a_step(agent: str) -> None:
    """A job may name any agent of its pool as its planner: its calls share that agent's bucket (and the
    tenant's fair share of it) with the agent's steps, so planning never sends past the provider's rpm."""
    result, requests = _plan_with_the_bucket_spent(agent, agent, lambda model: {
        agent: model, "coder": {"provider": "sim"}})
    assert requests == []  # no slot within the wait: the planner was not called past the limit
    assert result.source == "fallback" and "rate limit" in (result.error or "")


def test_agents_in_one_bucket_share_its_slots(agent: str) -> None:
    """A planner agent on the same provider model as a worker (the hosted pool of ``conductor run``) names
    the worker's bucket: once the worker's steps took the minute's slots, the planner waits for them too,
    so the two together never send past the model's rpm."""
    planner = f"{agent}-planner"
    result, requests = _plan_with_the_bucket_spent(agent, planner, lambda model: {
        planner: {**model, "rpm_bucket": agent}, agent: model})
    assert requests == []  # the worker's bucket was empty: the planner was not called past it
    assert result.source == "fallback" and "rate limit" in (result.error or "")
    r = redis.Redis.from_url(get_settings().broker_url)
    assert not list(r.scan_iter(f"{RateLimiter(r).key(planner)}*"))  # no bucket of its own name was made


def test_a_step_takes_its_slot_from_its_agents_bucket(agent: str, pools_dir: Any) -> None:
    """The step path, as the planner's above: a step on an agent naming another agent's bucket waits for
    that bucket, and fails as rate limited when it stays empty past the wait."""
    from conductor.engine import plan_job, run_step
    from conductor.store import jobs as store
    from conductor.store.db import session_scope
    from conductor.submission import JobCreate, create_job

    (pools_dir / f"{agent}.yaml").write_text(
        f"agents:\n  {agent}: {{provider: sim, rpm: {SLOW_RPM}}}\n"
        f"  {agent}-twin: {{provider: sim, rpm: {SLOW_RPM}, rpm_bucket: {agent}}}\n")
    settings = get_settings().model_copy(update={"rate_limit_wait_s": 0.2, "step_max_attempts": 1})
    limiter = get_limiter(settings.broker_url)
    for _ in range(SLOW_RPM):  # the other agent's steps took every slot of this minute
        limiter.acquire(agent, SLOW_RPM, timeout_s=0, tenant="t")
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "t", "pool": agent, "workflow": {
            "model_ids": [f"{agent}-twin"], "subtasks": ["answer"], "access_lists": [[]]}}),
            tenant="t", settings=settings)
        job_id = job.id
    plan_job(job_id, settings=settings)
    run_step(job_id, 0, worker="w", task_id=None, settings=settings)
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.status == "failed" and step.error_type == "rate_limit_timeout", step
