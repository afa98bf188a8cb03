"""Rate-limit fairness on the real Redis: one tenant with many waiting steps cannot starve another
that uses the same agent. Counts of grants and the order of the slots the limiter hands out (their due
times on Redis's clock) are compared, never how long anything took."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest
import redis

from conductor import ratelimit
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


@dataclass
class Ledger:
    """Every ask a limiter sends for a tenant, and the slot each grant got: its due time on Redis's clock
    (the clock read just before the ask plus the wait the limiter answered)."""

    asks: Counter[str] = field(default_factory=Counter)
    dues: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    asked: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.asked = threading.Condition(self.lock)

    def tenant_dues(self, tenant: str) -> list[float]:
        return sorted(due for due, who in self.dues if who == tenant)

    def wait_for_asks(self, tenant: str, n: int) -> None:
        with self.asked:
            assert self.asked.wait_for(lambda: self.asks[tenant] >= n, timeout=30), self.asks


def redis_now_us(limiter: RateLimiter) -> int:
    seconds, micros = limiter.client.time()
    return int(seconds) * 1_000_000 + int(micros)


def recorded(limiter: RateLimiter) -> Ledger:
    """Wraps ``limiter``'s one call to Redis per ask (a spy: the real script runs)."""
    ledger = Ledger()
    take = limiter._take_fair

    def spy(agent: str, tenant: str, *args: Any, **kwargs: Any) -> Any:
        asked = redis_now_us(limiter) / 1e6
        reply = take(agent, tenant, *args, **kwargs)
        with ledger.asked:
            ledger.asks[tenant] += 1
            if reply[0]:
                ledger.dues.append((asked + reply[1], tenant))
            ledger.asked.notify_all()
        return reply

    limiter._take_fair = spy  # type: ignore[method-assign]
    return ledger


def callers(limiter: RateLimiter, agent: str, tenant: str, n: int, *, rpm: int, burst: int, timeout_s: float,
            background: bool = False) -> list[threading.Thread]:
    """``n`` threads of ``tenant``, each taking one slot (a step's call; ``background``: batch work); a refusal
    ends its thread."""

    def one() -> None:
        with contextlib.suppress(RateLimitTimeout):
            limiter.acquire(agent, rpm, timeout_s=timeout_s, burst=burst, tenant=tenant, background=background)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_a_tenant_arriving_behind_a_deep_queue_is_served_near_its_front(agent: str) -> None:
    """A tenant alone queues a batch as deep as its wait allows (3 s of slots here, 30 of them); another
    tenant's single step then arrives. It gets a slot within the batch's few front slots, not behind all
    of them (it was refused: its slot was 3.1 s away, past its wait, behind all 31 of the batch's)."""
    rpm, burst, wait_s = 600, 1, 3.0  # a slot every 0.1 s
    limiter = RateLimiter(url=get_settings().broker_url)
    ledger = recorded(limiter)
    batch = callers(limiter, agent, "batch", 40, rpm=rpm, burst=burst, timeout_s=wait_s)
    ledger.wait_for_asks("batch", 40)  # every step of the batch has asked (reserved, queued or been refused)
    try:
        limiter.acquire(agent, rpm, timeout_s=wait_s, burst=burst, tenant="single")
    except RateLimitTimeout as exc:
        pytest.fail(f"the newcomer was refused: {exc}; the batch held {len(ledger.tenant_dues('batch'))} slots")
    finally:
        for t in batch:
            t.join(30)
    (single,) = ledger.tenant_dues("single")
    ahead = [due for due in ledger.tenant_dues("batch") if due < single]
    # the batch's immediate grant and the slots it may hold reserved when another tenant comes (2)
    assert len(ahead) <= 3, f"{len(ahead)} of the batch's slots were due before the newcomer's"


def test_a_lone_tenants_queue_gets_every_slot_of_the_rate(agent: str) -> None:
    """A tenant alone with more steps than the bucket holds: after the burst its grants fall on every
    consecutive slot of the rate, none skipped (the run's throughput is the full rpm), and each step
    asks Redis a few times at most, not once per slot that passes while it waits."""
    rpm, burst, steps = 600, 2, 30  # a slot every 0.1 s
    limiter = RateLimiter(url=get_settings().broker_url)
    ledger = recorded(limiter)
    for t in callers(limiter, agent, "alone", steps, rpm=rpm, burst=burst, timeout_s=30.0):
        t.join(30)
    dues = ledger.tenant_dues("alone")
    assert len(dues) == steps
    slots_apart = [round((b - a) * rpm / 60) for a, b in pairwise(dues)]
    assert slots_apart == [0] * (burst - 1) + [1] * (steps - burst), slots_apart
    # a step of a tenant alone is told when its place opens and asks twice (once when granted at once);
    # one woken late may ask a third time. Asking at every slot that passes would be ~435 asks
    assert ledger.asks["alone"] <= 3 * steps, ledger.asks


def test_two_batches_take_turns_slot_by_slot(agent: str) -> None:
    """A batch queued alone, then a second tenant's batch: from the second's first grant to its last the two
    alternate (each holds one reserved slot at a time), and their waiting steps ask Redis a few times each
    rather than all at every slot of their tenant."""
    rpm, burst, steps = 600, 1, 30
    limiter = RateLimiter(url=get_settings().broker_url)
    ledger = recorded(limiter)
    first = callers(limiter, agent, "first", steps, rpm=rpm, burst=burst, timeout_s=30.0)
    ledger.wait_for_asks("first", steps)
    second = callers(limiter, agent, "second", steps, rpm=rpm, burst=burst, timeout_s=30.0)
    for t in first + second:
        t.join(30)
    order = [who for _, who in sorted(ledger.dues)]
    assert len(order) == 2 * steps
    start = order.index("second")
    shared = order[start:start + steps]  # while both had steps waiting
    assert start <= 3 and abs(shared.count("first") - shared.count("second")) <= 2, order
    # sharing, a waiting step asks again halfway to its turn: about 1 + log2(its place) asks, not one
    # at every slot its tenant is granted (30 steps: 465 asks)
    assert max(ledger.asks.values()) <= 8 * steps, ledger.asks


def test_a_queued_caller_that_never_asks_again_loses_its_place(agent: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose process died while it waited in its tenant's queue keeps its place only until its lease
    (the time it was told to ask again, plus LEASE_GRACE_S) lapses; the next ask drops it, so the callers
    behind it do not queue behind a step that will never take its slot."""
    monkeypatch.setattr(ratelimit, "LEASE_GRACE_S", 0.2)
    limiter = RateLimiter(url=get_settings().broker_url)
    _, _, _, queue, leases = limiter._fair_keys(agent, "t")

    def ask(caller: str) -> tuple[bool, float, bool]:
        return limiter._take_fair(agent, "t", caller, capacity=1, per_second=10.0, max_wait=30.0)

    assert [ask(c)[0] for c in ("now", "reserved-1", "reserved-2")] == [True] * 3  # one free, two reserved
    granted, _, queued = ask("ghost")  # its share is held: it queues, and never asks again
    assert not granted and queued and limiter.client.zrank(queue, "ghost") == 0
    lease = limiter.client.zscore(leases, "ghost")
    assert lease is not None
    while redis_now_us(limiter) <= lease:  # until its lease lapsed on Redis's clock
        time.sleep(0.05)
    limiter.acquire(agent, 600, timeout_s=30.0, burst=1, tenant="t")  # the next ask: it drops the ghost
    assert limiter.client.zrank(queue, "ghost") is None



def labelled(limiter: RateLimiter, label: Any) -> Ledger:
    """``recorded``, each ask entered under ``label(tenant, background)`` instead of its tenant (the limiter
    itself still gets the tenant)."""
    ledger = Ledger()
    take = limiter._take_fair

    def spy(agent: str, tenant: str, *args: Any, **kwargs: Any) -> Any:
        asked = redis_now_us(limiter) / 1e6
        reply = take(agent, tenant, *args, **kwargs)
        who = label(tenant, bool(kwargs.get("background")))
        with ledger.asked:
            ledger.asks[who] += 1
            if reply[0]:
                ledger.dues.append((asked + reply[1], who))
            ledger.asked.notify_all()
        return reply

    limiter._take_fair = spy  # type: ignore[method-assign]
    return ledger


@pytest.mark.parametrize("background", [True, False], ids=["batch", "unmarked"])
def test_a_tenants_live_step_does_not_queue_behind_its_own_batch(agent: str, background: bool) -> None:
    """A tenant's batch queues 30 steps deep at an agent; then the same tenant's live step arrives. Marked as
    batch work (``background``), the batch waits behind it: after it arrived, only the slots the batch already
    held reserved (QUEUE_SLOTS) come before its own. Unmarked -- one FIFO per tenant, as before batch steps
    were told apart -- it waits behind the whole batch (this case pins that the order is the marking's doing,
    and that the test can fail)."""
    rpm, burst, wait_s, steps = 600, 1, 10.0, 30  # a slot every 0.1 s
    limiter = RateLimiter(url=get_settings().broker_url)
    main = threading.current_thread()
    ledger = labelled(limiter, lambda _tenant, _bg: "live" if threading.current_thread() is main else "batch")
    batch = callers(limiter, agent, "t", steps, rpm=rpm, burst=burst, timeout_s=wait_s, background=background)
    ledger.wait_for_asks("batch", steps)  # every batch step has asked (granted, reserved or queued)
    arrived = redis_now_us(limiter) / 1e6
    limiter.acquire(agent, rpm, timeout_s=wait_s, burst=burst, tenant="t")
    for t in batch:
        t.join(30)
    (live,) = ledger.tenant_dues("live")
    batch_dues = ledger.tenant_dues("batch")
    assert len(batch_dues) == steps
    overtook = [due for due in batch_dues if arrived <= due < live]
    if background:
        assert len(overtook) <= ratelimit.QUEUE_SLOTS, f"{len(overtook)} batch slots came after the live step asked"
    else:
        assert len(overtook) >= steps - 5, f"only {len(overtook)} batch slots came before the live step's"


def test_a_tenants_batch_does_not_double_its_share(agent: str) -> None:
    """Tenant A's batch queued first, then A's live steps, then tenant B's. A's batch is not a party of its own:
    while B has steps waiting, A and B take turns slot by slot (B about half the slots, where a party for the
    batch would leave it a third), and A's turns go to its live steps before its batch's."""
    rpm, burst = 600, 1
    limiter = RateLimiter(url=get_settings().broker_url)
    ledger = labelled(limiter, lambda tenant, background: f"{tenant}/batch" if background else tenant)
    threads = callers(limiter, agent, "A", 20, rpm=rpm, burst=burst, timeout_s=30.0, background=True)
    ledger.wait_for_asks("A/batch", 20)
    threads += callers(limiter, agent, "A", 8, rpm=rpm, burst=burst, timeout_s=30.0)
    ledger.wait_for_asks("A", 8)  # every live step of A is queued (or granted) before B comes
    threads += callers(limiter, agent, "B", 16, rpm=rpm, burst=burst, timeout_s=30.0)
    for t in threads:
        t.join(60)
    order = [who for _, who in sorted(ledger.dues)]
    assert len(order) == 44, order
    first_b, last_b = order.index("B"), len(order) - 1 - order[::-1].index("B")
    shared = order[first_b:last_b + 1]  # while B had steps waiting
    assert abs((len(shared) - shared.count("B")) - shared.count("B")) <= 3, order
    # A's live steps start before half its batch did (one FIFO per tenant: after all 20), and from the first
    # one's grant on, A's turns go to its live steps, all 8 of them, and only then to its batch
    assert order[:order.index("A")].count("A/batch") < 10, order
    a_turns = [who for who in order[order.index("A"):] if who != "B"]
    assert a_turns[:8] == ["A"] * 8 and "A" not in a_turns[8:], order


def test_a_batch_caller_is_overtaken_only_by_live_callers_arriving_within_half_its_wait(agent: str) -> None:
    """A batch caller's place is its arrival plus half its wait (``BATCH_BEHIND_SHARE``): the tenant's live
    callers arriving before that go ahead of it, later ones behind it. With an unbounded offset every live
    arrival went ahead, so a tenant's steady live calls pushed its batch steps back until they were refused
    and failed (this test's last caller ranked ahead of the batch caller)."""
    limiter = RateLimiter(url=get_settings().broker_url)
    _, _, _, queue, _ = limiter._fair_keys(agent, "t")
    patience_s = 0.6  # a batch caller's place: its arrival plus 0.3 s

    def ask(caller: str, *, background: bool = False) -> tuple[bool, float, bool]:
        return limiter._take_fair(agent, "t", caller, capacity=1, per_second=1.0, max_wait=30.0,
                                  background=background, patience_s=patience_s)

    assert [ask(c)[0] for c in ("now", "reserved-1", "reserved-2")] == [True] * 3  # one free, two reserved
    arrived = redis_now_us(limiter)
    granted, _, queued = ask("batch", background=True)
    assert not granted and queued
    place = limiter.client.zscore(queue, "batch")
    assert place is not None and place - arrived >= ratelimit.BATCH_BEHIND_SHARE * patience_s * 1e6
    assert ask("live-early")[2]  # queued, within the batch caller's offset: ahead of it
    offset_us = ratelimit.BATCH_BEHIND_SHARE * patience_s * 1e6
    while redis_now_us(limiter) <= arrived + offset_us + 50_000:  # past the batch caller's place, Redis's clock
        time.sleep(0.05)
    assert ask("live-late")[2]
    ranks = {c: limiter.client.zrank(queue, c) for c in ("live-early", "batch", "live-late")}
    assert ranks == {"live-early": 0, "batch": 1, "live-late": 2}, ranks
