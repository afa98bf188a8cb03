"""Rate-limit fairness on the real Redis: one tenant with many waiting steps cannot starve another
that uses the same agent. Counts of grants are compared, never durations."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from conductor.ratelimit import RateLimiter, RateLimitTimeout
from conductor.settings import get_settings

pytestmark = pytest.mark.integration

RPM = 1200  # a slot every 50 ms
BURST = 2
GRANTS = 40


@pytest.fixture
def agent() -> Iterator[str]:
    name = f"fair-agent-{uuid.uuid4().hex[:8]}"
    yield name
    r = redis.Redis.from_url(get_settings().broker_url)
    for key in r.scan_iter(f"{RateLimiter(r).key(name)}*"):
        r.delete(key)


def race(agent: str, callers: dict[str, int], *, fair: bool) -> Counter[str]:
    """Threads per tenant take slots back to back until GRANTS were granted in all; who got them."""
    limiter = RateLimiter(url=get_settings().broker_url)
    granted: Counter[str] = Counter()
    lock = threading.Lock()

    def caller(tenant: str) -> None:
        while True:
            with lock:
                if sum(granted.values()) >= GRANTS:
                    return
            try:
                limiter.acquire(agent, RPM, timeout_s=5.0, burst=BURST, tenant=tenant if fair else None)
            except RateLimitTimeout:
                continue
            with lock:
                granted[tenant] += 1

    threads = [threading.Thread(target=caller, args=(t,)) for t, n in callers.items() for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return granted


def test_a_tenant_with_one_waiting_step_gets_a_fair_share_against_six(agent: str) -> None:
    granted = race(agent, {"crowd": 6, "single": 1}, fair=True)
    # Arrival order alone would give the single caller about 1/7 of the slots; fairness about 1/2.
    assert granted["single"] >= GRANTS * 0.35, granted


def test_without_tenants_arrival_order_decides(agent: str) -> None:
    """The unfair baseline the test above improves on: the single caller gets far less than half."""
    granted = race(agent, {"crowd": 6, "single": 1}, fair=False)
    assert granted["single"] < GRANTS * 0.35, granted


def test_a_lone_tenant_keeps_the_whole_rate(agent: str) -> None:
    limiter = RateLimiter(url=get_settings().broker_url)
    for _ in range(BURST):  # the burst is granted at once, as without tenants
        assert limiter.acquire(agent, 6, timeout_s=0.0, burst=BURST, tenant="alone") == 0.0
    with pytest.raises(RateLimitTimeout):
        limiter.acquire(agent, 6, timeout_s=0.0, burst=BURST, tenant="alone")
