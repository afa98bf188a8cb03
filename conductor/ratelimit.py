"""Per-agent requests-per-minute limits shared by every worker process: a token bucket kept in Redis.

Each agent has one bucket (``conductor:rl:<agent>``) holding up to ``capacity`` tokens (by default the
agent's ``rpm``) and refilling at ``rpm / 60`` tokens per second. One Lua script refills, decides and takes
a token atomically, on Redis's clock, so processes on different hosts agree on time and never both spend
the last token.

A caller that finds the bucket empty *reserves* the next free token (the bucket goes below zero) and sleeps
until that token's time, so waiting callers are served in arrival order and nobody polls. If that time is
further away than the caller's ``timeout_s``, nothing is reserved and :class:`RateLimitTimeout` says when
to try again.

A token bucket bounds any window of ``T`` seconds to ``capacity + rpm * T / 60`` requests: with the default
capacity a provider may see up to ``2 * rpm`` requests in one minute after an idle spell. Pass a smaller
``burst`` where a provider enforces a strict sliding minute.

Fairness between tenants: a step names its tenant, and while several tenants use one agent each may
hold at most ``capacity / active tenants`` reserved (waiting) slots of it. A tenant at its share waits
for its own earliest slot to come due before it may reserve another, so another tenant's request
queues behind at most that share of someone else's backlog instead of all of it: one tenant's thousand
queued steps cannot starve the others. With one tenant active, nothing changes.
"""

from __future__ import annotations

import random
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
FAIRNESS_JITTER_S = 0.05
"""At most this much is added to a fairness wait, so waiters woken by the same slot do not ask at once."""

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


ACTIVE_WINDOW_S = 60.0
"""A tenant that used an agent within this window counts as active on it (and shares its slots)."""

# KEYS[1] bucket, KEYS[2] the agent's active tenants (zset: last seen), KEYS[3] this tenant's reserved
# slots (zset: due time). ARGV: capacity, refill per second, max wait (s), tenant, slot id, window (s).
# Returns {granted (0/1), wait in microseconds, refused for fairness (0/1)}.
FAIR_TOKEN_BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local window = tonumber(ARGV[6]) * 1000000
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
redis.call('ZADD', KEYS[2], now, ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window)
redis.call('PEXPIRE', KEYS[2], math.ceil(window / 1000) + 1000)
local active = redis.call('ZCARD', KEYS[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local reserved = redis.call('ZCARD', KEYS[3])
if active > 1 and reserved >= math.max(1, math.floor(capacity / active)) then
  local first = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  return {0, math.max(1, tonumber(first[2]) - now), 1}
end
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
  return {0, math.ceil(wait * 1000000), 0}
end
tokens = tokens - 1
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', ts)
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) / rate * 1000) + 1000)
if wait > 0 then
  redis.call('ZADD', KEYS[3], now + math.ceil(wait * 1000000), ARGV[5])
  redis.call('PEXPIRE', KEYS[3], math.ceil(wait * 1000) + 1000)
end
return {1, math.ceil(wait * 1000000), 0}
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
        self, agent: str, rpm: int, *, timeout_s: float, burst: int | None = None, tenant: str | None = None
    ) -> float:
        """Takes one request slot for ``agent``, sleeping until it is due. Returns the seconds waited
        (0.0 when a token was free). Raises :class:`RateLimitTimeout` when the slot is more than
        ``timeout_s`` away and :class:`RateLimiterUnavailable` when Redis cannot be reached. With
        ``tenant``, the slot counts against that tenant's fair share of the agent (module docstring)."""
        if rpm < 1:
            raise ValueError(f"rpm must be at least 1, got {rpm}")
        capacity = rpm if burst is None else burst
        if capacity < 1:
            raise ValueError(f"burst must be at least 1, got {burst}")
        waited = 0.0
        while True:
            left = max(0.0, timeout_s - waited)
            if tenant is None:
                granted, wait = self._take(agent, capacity=capacity, per_second=rpm / 60.0, max_wait=left)
                fairness = False
            else:
                granted, wait, fairness = self._take_fair(
                    agent, tenant, capacity=capacity, per_second=rpm / 60.0, max_wait=left
                )
            if granted:
                if wait > 0:
                    time.sleep(wait)
                return waited + wait
            if not fairness or wait > left:
                raise RateLimitTimeout(agent, rpm, waited_needed=wait, timeout_s=timeout_s)
            # this tenant is at its share: its own next slot comes due, then it asks again; a little jitter
            # keeps its waiters (all woken by the same slot) from asking at the same instant
            pause = wait + random.uniform(0, min(FAIRNESS_JITTER_S, wait))
            time.sleep(pause)
            waited += pause

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

    def _take_fair(
        self, agent: str, tenant: str, *, capacity: int, per_second: float, max_wait: float
    ) -> tuple[bool, float, bool]:
        keys = [self.key(agent), f"{self.key(agent)}:tenants", f"{self.key(agent)}:t:{tenant}"]
        args = [capacity, repr(per_second), repr(max_wait), tenant, uuid.uuid4().hex, repr(ACTIVE_WINDOW_S)]
        try:
            reply: Any = self._fair(keys=keys, args=args)
        except redis.RedisError as exc:
            raise _unavailable(agent, exc) from exc
        granted, wait_us, fairness = reply
        return bool(int(granted)), int(wait_us) / 1_000_000, bool(int(fairness))


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


def wait_for_rate_limit(agent: str, rpm: int | None, settings: Settings, *, tenant: str) -> None:
    """Takes a token from the agent's bucket shared by every worker (Redis), within the tenant's fair
    share of it: before every provider call, a step's or a planner's. Embedded mode (one process,
    in-memory broker) has no Redis and runs unlimited."""
    if rpm is None or not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return
    get_limiter(settings.broker_url).acquire(agent, rpm, timeout_s=settings.rate_limit_wait_s, tenant=tenant)
