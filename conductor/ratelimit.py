"""Per-agent requests-per-minute limits shared by every worker process: a token bucket kept in Redis.

Each agent has one bucket (``conductor:rl:<agent>``) holding up to ``capacity`` tokens (by default the
agent's ``rpm``) and refilling at ``rpm / 60`` tokens per second. One Lua script refills, decides and takes
a token atomically, on Redis's clock, so processes on different hosts agree on time and never both spend
the last token.

A caller that finds the bucket empty *reserves* the next free token (the bucket goes below zero) and sleeps
until that token's time, so waiting callers are served in arrival order and nobody polls (a caller naming
its tenant may first wait in its tenant's queue: below). If that time is
further away than the caller's ``timeout_s``, nothing is reserved and :class:`RateLimitTimeout` says when
to try again.

A token bucket bounds any window of ``T`` seconds to ``capacity + rpm * T / 60`` requests: with the default
capacity a provider may see up to ``2 * rpm`` requests in one minute after an idle spell. Pass a smaller
``burst`` where a provider enforces a strict sliding minute.

Fairness between tenants: a step names its tenant. A reserved slot cannot be taken back, so whoever
reserves far ahead makes everyone after it wait: a tenant alone that filled the queue (``rate_limit_wait_s``
deep, 30 slots at 60/min with a 30 s wait) made a tenant arriving next wait all of it, or refused it when
its slot lay past its own wait. So reservations stay near the front: a tenant may hold ``QUEUE_SLOTS``
(2) reserved slots divided by the tenants *backlogged* on the agent (holding a reservation or a queued
caller), at least 1: a tenant alone 2, each of several 1. A caller whose tenant holds its share waits in its
tenant's queue (arrival order) and is told when its place should open: as the tenant's reservations come
due, then one place every ``backlogged tenants`` slots. It sleeps until then and asks again, with the same
caller id. Alone, the estimate is exact (a tenant arriving can only make it early) and a waiting call asks
twice; shared, it asks again halfway to its estimate (the count of tenants changes as they come and go),
about ``1 + log2(its place)`` asks. Waiters never ask at every slot: this bounded wait is the only polling.
A caller whose estimate, plus the bucket's current wait, lies past its ``timeout_s`` is refused at once,
reserving nothing.

So a tenant arriving finds about ``max(QUEUE_SLOTS, tenants backlogged)`` slots reserved ahead of it (one
more in the moment a second tenant arrives, while the first still holds the two it took alone) and waits
that many slots plus one, where it waited the whole queue before; backlogged tenants are then served in
turn, a slot each. A tenant alone still gets every slot: its queued callers take them as they open, and
the bucket keeps any a late caller missed (up to ``capacity``, a minute's by default), so its throughput is
the bucket's, as without tenants. A caller that dies while queued keeps its place ``LEASE_GRACE_S`` past
the time it was to ask again, then the next ask drops it; one cancelled (a gevent kill) leaves at once.
Measured (``tests/integration/test_fair_ratelimit.py``, 600/min, a 30-slot queue): the newcomer's slot
came 3rd, after the queued tenant's free one and its two reserved (before: behind all 31, past its wait,
so refused).

Batch work (a batch's lines and their child jobs) waits behind its own tenant's live work: a caller marked
``background`` queues in its tenant's queue behind the live callers of that tenant that come up to half its
wait after it (its place is its arrival plus ``BATCH_BEHIND_SHARE`` of its wait), so a tenant's live step
arriving behind its thousand just-queued batch steps takes the tenant's next place, after at most the slots
the tenant already holds reserved, while a batch step that has waited that long is not overtaken again. The
tenant stays one party: it does not get a second share for its batch (a party of its own, ``"{tenant}/batch"``,
would have given a tenant with a batch and live work two turns to every other tenant's one). Between tenants
nothing changes: another tenant's batch keeps its share against this tenant's live steps (a waiting caller
holds a worker's slot and has a ``timeout_s``: batch work that always yielded to everyone's live work could
wait out its attempts and fail). A batch caller's estimate counts the live callers queued when it asks; one
arriving later (within the offset) pushes it back, and it learns so when it asks again.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from functools import lru_cache
from typing import Any

import redis

from conductor.errors import ErrorType
from conductor.pool.errors import RateLimited, RetryableError
from conductor.settings import Settings, get_settings

KEY_PREFIX = "conductor:rl:"
REDIS_TIMEOUT_S = 2.0
"""Connect and read timeout for the limiter's Redis: an unreachable limiter fails the attempt, not the worker."""
MAX_CONNECTIONS = 64
"""Connections a process's limiter opens at most; more callers at once wait for one (a call is one script)."""

# KEYS[1] bucket; ARGV: capacity, refill tokens per second, the longest wait the caller accepts (seconds).
# Returns {granted (0/1), wait in microseconds}. Time is kept in integer microseconds, exact in a double.
TOKEN_BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = capacity
  ts = now
end
if now > ts then
  tokens = tokens + (now - ts) / 1000000 * rate
  ts = now
end
tokens = math.min(capacity, tokens)
local wait = 0
if tokens < 1 then
  wait = (1 - tokens) / rate
end
if wait > max_wait then
  return {0, math.ceil(wait * 1000000)}
end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', ts)
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) / rate * 1000) + 1000)
return {1, math.ceil(wait * 1000000)}
"""


QUEUE_SLOTS = 2
"""Reserved slots a tenant may hold on an agent before its callers queue, divided by the tenants backlogged on
it (at least 1): a tenant alone holds 2, each of several 1. Small, so a tenant arriving finds few reserved."""
LEASE_GRACE_S = 2.0
"""A queued caller keeps its place this long past the time it was told to ask again; one that has not asked
by then (its process died, it was cancelled) is dropped from the queue, and one late past it queues anew."""
BATCH_BEHIND_SHARE = 0.5
"""A batch caller queues in its tenant's queue as if it had come this share of its wait (``timeout_s``,
``CONDUCTOR_RATE_LIMIT_WAIT_S`` for a step) later than it did: the tenant's live callers arriving up to then
go before it, later ones after it, and batch callers keep their arrival order among themselves. Finite, so a
batch caller ages to the front: with an unbounded offset, a tenant whose live calls kept its share busy pushed
its batch callers back at every arrival until each was refused, used up its step's attempts and failed the
line; with half its wait, a batch caller still has the other half to be served from the place it reached."""

# KEYS[1] bucket; KEYS[2] the agent's backlogged tenants (zset: until when their reservations or queued
# callers last); KEYS[3] this tenant's reserved slots (zset: due time); KEYS[4] this tenant's queued
# callers (zset: arrival, plus an offset for batch work); KEYS[5] their leases (zset: lease end). ARGV:
# capacity, refill per second, max wait (s), tenant, caller id, QUEUE_SLOTS, LEASE_GRACE_S, the offset of
# this caller's place (0 live, BATCH_BEHIND_SHARE of its wait for batch work). Times are integer µs on Redis's
# clock. Returns {granted (0/1), wait in microseconds, queued (0/1)}: granted, sleep the wait and call;
# queued, sleep the wait and ask again with the same caller id; neither, refused (the wait is past the max).
FAIR_TOKEN_BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3]) * 1000000
local tenant = ARGV[4]
local id = ARGV[5]
local queue_slots = tonumber(ARGV[6])
local grace = tonumber(ARGV[7]) * 1000000
local behind = tonumber(ARGV[8])
local per_slot = 1000000 / rate
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])

local function expire_with(key, times)
  local last = redis.call('ZRANGE', times, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIRE', key, math.ceil((tonumber(last[2]) - now) / 1000) + 1000)
  end
end
local function backlogged_until(t)
  local held = tonumber(redis.call('ZSCORE', KEYS[2], tenant) or 0)
  if t > held then
    redis.call('ZADD', KEYS[2], t, tenant)
    expire_with(KEYS[2], KEYS[2])
  end
end
local function leave()
  redis.call('ZREM', KEYS[4], id)
  redis.call('ZREM', KEYS[5], id)
end

-- the bucket, refilled to now; written only when a token is taken
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts = tonumber(state[2])
if tokens == nil or ts == nil then
  tokens = capacity
  ts = now
end
if now > ts then
  tokens = tokens + (now - ts) / 1000000 * rate
  ts = now
end
tokens = math.min(capacity, tokens)
local debt = 0
if tokens < 1 then
  debt = (1 - tokens) * per_slot
end

-- this tenant's share of the reserved slots, among the tenants with slots reserved or callers queued
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local tenants = redis.call('ZCARD', KEYS[2])
if not redis.call('ZSCORE', KEYS[2], tenant) then
  tenants = tenants + 1
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local reserved = redis.call('ZCARD', KEYS[3])
local room = math.max(1, math.floor(queue_slots / tenants)) - reserved

-- this tenant's queue, in arrival order, without the callers whose lease lapsed
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)
for _, gone in ipairs(lapsed) do
  redis.call('ZREM', KEYS[4], gone)
end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
local pos = redis.call('ZRANK', KEYS[4], id)
if not pos then
  if room > 0 and redis.call('ZCARD', KEYS[4]) == 0 then
    pos = -1
  else
    redis.call('ZADD', KEYS[4], now + behind, id)
    pos = redis.call('ZRANK', KEYS[4], id)
  end
end

if pos < room then
  leave()
  if debt > max_wait then
    return {0, math.ceil(debt), 0}
  end
  tokens = tokens - 1
  redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', ts)
  redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) * per_slot / 1000) + 1000)
  if debt > 0 then
    local due = now + math.ceil(debt)
    redis.call('ZADD', KEYS[3], due, id)
    redis.call('PEXPIRE', KEYS[3], math.ceil(debt / 1000) + 1000)
    backlogged_until(due)
  end
  return {1, math.ceil(debt), 0}
end

-- queued: a place opens as each reserved slot comes due, then about every `tenants` slots
local dues = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
local function opens(k)
  if k <= reserved then
    return tonumber(dues[2 * k])
  end
  local last = now
  if reserved > 0 then
    last = tonumber(dues[2 * reserved])
  end
  return last + (k - reserved) * tenants * per_slot
end
local k = pos - room + 1
local eta = opens(k) - now
if eta + debt > max_wait then
  leave()
  return {0, math.ceil(eta + debt), 0}
end
-- alone, a tenant's places open on its own slots: ask again then (a tenant arriving makes that early,
-- never late). Shared, ask again halfway to it, or when the first place opens if later: the estimate
-- counts the tenants backlogged now, and follows them as they come and go in a few asks
local wait = eta
if tenants > 1 then
  wait = math.max(opens(1) - now, eta / 2)
end
wait = math.ceil(wait)
redis.call('ZADD', KEYS[5], now + wait + grace, id)
expire_with(KEYS[4], KEYS[5])
expire_with(KEYS[5], KEYS[5])
backlogged_until(now + wait + grace)
return {0, wait, 1}
"""


class RateLimitTimeout(RateLimited):
    """No token for this agent within the caller's timeout. ``retry_after``: seconds until one would be
    free if nobody else took it. A :class:`RetryableError` (via ``RateLimited``), so the step backs off."""

    error_type = ErrorType.RATE_LIMIT_TIMEOUT

    def __init__(self, agent: str, rpm: int, *, waited_needed: float, timeout_s: float):
        super().__init__(
            f"rate limit for agent '{agent}' ({rpm}/min): the next request slot is {waited_needed:.1f}s away, "
            f"longer than the {timeout_s:.1f}s this call may wait",
            retry_after=waited_needed,
            status=None,
        )
        self.agent = agent


class RateLimiterUnavailable(RetryableError):
    """The limiter's Redis cannot be reached; the attempt is retried later rather than run unthrottled."""

    error_type = ErrorType.RATE_LIMITER_UNAVAILABLE


class RateLimiter:
    """Shared per-agent token buckets. Thread-safe: one instance serves a whole worker process."""

    def __init__(self, client: redis.Redis | None = None, *, url: str | None = None, prefix: str = KEY_PREFIX):
        if client is None:
            # Blocking: past MAX_CONNECTIONS a caller waits for a free connection (up to REDIS_TIMEOUT_S)
            # instead of failing; redis-py's plain pool raised MaxConnectionsError past 100, and a gevent
            # worker has a thousand callers.
            client = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
                url or get_settings().broker_url,
                max_connections=MAX_CONNECTIONS,
                timeout=REDIS_TIMEOUT_S,
                socket_connect_timeout=REDIS_TIMEOUT_S,
                socket_timeout=REDIS_TIMEOUT_S,
            ))
        self.client = client
        self.prefix = prefix
        self._script = client.register_script(TOKEN_BUCKET_LUA)
        self._fair = client.register_script(FAIR_TOKEN_BUCKET_LUA)

    def key(self, agent: str) -> str:
        return f"{self.prefix}{agent}"

    def acquire(
        self, agent: str, rpm: int, *, timeout_s: float, burst: int | None = None, tenant: str | None = None,
        background: bool = False,
    ) -> float:
        """Takes one request slot for ``agent``, sleeping until it is due. Returns the seconds waited
        (0.0 when a token was free). Raises :class:`RateLimitTimeout` when the slot is more than
        ``timeout_s`` away and :class:`RateLimiterUnavailable` when Redis cannot be reached. With
        ``tenant``, the slot counts against that tenant's fair share of the agent (module docstring);
        ``background`` (batch work) queues behind the tenant's live callers."""
        if rpm < 1:
            raise ValueError(f"rpm must be at least 1, got {rpm}")
        capacity = rpm if burst is None else burst
        if capacity < 1:
            raise ValueError(f"burst must be at least 1, got {burst}")
        per_second = rpm / 60.0
        if tenant is None:
            granted, wait = self._take(agent, capacity=capacity, per_second=per_second, max_wait=timeout_s)
            if not granted:
                raise RateLimitTimeout(agent, rpm, waited_needed=wait, timeout_s=timeout_s)
            if wait > 0:
                time.sleep(wait)
            return wait
        caller = uuid.uuid4().hex
        waited = 0.0
        while True:
            left = max(0.0, timeout_s - waited)
            granted, wait, queued = self._take_fair(
                agent, tenant, caller, capacity=capacity, per_second=per_second, max_wait=left, background=background,
                patience_s=timeout_s,
            )
            if granted:
                if wait > 0:
                    time.sleep(wait)
                return waited + wait
            if not queued:
                raise RateLimitTimeout(agent, rpm, waited_needed=wait, timeout_s=timeout_s)
            # queued behind this tenant's other callers: ask again when the limiter said
            try:
                time.sleep(wait)
            except BaseException:
                self._leave(agent, tenant, caller)  # cancelled (gevent kill, interrupt): give the place up now
                raise
            waited += wait

    def try_take(self, name: str, *, per_minute: int, burst: int | None = None) -> float:
        """Takes a token from bucket ``name`` if one is free now, without waiting: returns 0.0 when
        taken, else the seconds until one would be (nothing is reserved)."""
        granted, wait = self._take(name, capacity=burst or per_minute, per_second=per_minute / 60.0, max_wait=0.0)
        return 0.0 if granted else max(wait, 0.001)

    def _take(self, agent: str, *, capacity: int, per_second: float, max_wait: float) -> tuple[bool, float]:
        try:
            reply: Any = self._script(keys=[self.key(agent)], args=[capacity, repr(per_second), repr(max_wait)])
        except redis.RedisError as exc:
            raise _unavailable(agent, exc) from exc
        granted, wait_us = reply
        return bool(int(granted)), int(wait_us) / 1_000_000

    def _fair_keys(self, agent: str, tenant: str) -> list[str]:
        bucket = self.key(agent)
        return [bucket, f"{bucket}:backlog", f"{bucket}:t:{tenant}", f"{bucket}:q:{tenant}", f"{bucket}:l:{tenant}"]

    def _take_fair(
        self, agent: str, tenant: str, caller: str, *, capacity: int, per_second: float, max_wait: float,
        background: bool = False, patience_s: float = 0.0,
    ) -> tuple[bool, float, bool]:
        """One ask. ``patience_s``: the caller's whole wait, from which a batch caller's place is set
        (``BATCH_BEHIND_SHARE``); ``max_wait`` is what is left of it."""
        behind_us = int(BATCH_BEHIND_SHARE * patience_s * 1_000_000) if background else 0
        args = [capacity, repr(per_second), repr(max_wait), tenant, caller, QUEUE_SLOTS, repr(LEASE_GRACE_S),
                behind_us]
        try:
            reply: Any = self._fair(keys=self._fair_keys(agent, tenant), args=args)
        except redis.RedisError as exc:
            raise _unavailable(agent, exc) from exc
        granted, wait_us, queued = reply
        return bool(int(granted)), int(wait_us) / 1_000_000, bool(int(queued))

    def _leave(self, agent: str, tenant: str, caller: str) -> None:
        """Best effort: a caller that stops waiting leaves its tenant's queue (else its lease lapses)."""
        _, _, _, queue, leases = self._fair_keys(agent, tenant)
        with contextlib.suppress(redis.RedisError):
            self.client.pipeline(transaction=False).zrem(queue, caller).zrem(leases, caller).execute()


def _unavailable(agent: str, exc: redis.RedisError) -> RateLimiterUnavailable:
    return RateLimiterUnavailable(
        f"rate limiter for agent '{agent}' cannot reach Redis ({type(exc).__name__}: {exc}); "
        "the step will be retried"
    )


@lru_cache(maxsize=4)
def get_limiter(url: str | None = None) -> RateLimiter:
    """One limiter (one connection pool) per Redis URL per process; the broker's Redis by default."""
    return _limiter_for(url or get_settings().broker_url)


@lru_cache(maxsize=8)
def _limiter_for(url: str) -> RateLimiter:
    return RateLimiter(url=url)


def wait_for_rate_limit(agent: str, rpm: int | None, settings: Settings, *, tenant: str,
                        background: bool = False) -> None:
    """Takes a token from the agent's bucket shared by every worker (Redis), within the tenant's fair
    share of it: before every provider call, a step's or a planner's; ``background`` (batch work) behind
    the tenant's live callers. Embedded mode (one process, in-memory broker) has no Redis and runs
    unlimited."""
    if rpm is None or not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return
    get_limiter(settings.broker_url).acquire(agent, rpm, timeout_s=settings.rate_limit_wait_s, tenant=tenant,
                                             background=background)
