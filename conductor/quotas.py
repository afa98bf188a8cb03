"""Per-tenant quotas: how fast a tenant may submit, how many jobs it may have in flight (and batch lines
unfinished), how many event streams it may hold open. Over a quota the caller gets :class:`QuotaExceeded`
with the seconds after which trying again can succeed (the API answers 429 with ``Retry-After``); other
tenants are unaffected.

The submit rate and the open streams are counted in Redis (the broker's), so every API process agrees.
If Redis cannot be reached those two quotas are not enforced (logged): the API keeps accepting work,
as it does when the broker is down. Jobs in flight are checked in Postgres under a per-tenant lock,
against one row per tenant that triggers on ``job`` keep (``store.count_jobs_in_flight``).

One limit here is per client address, not per tenant: failed API-key lookups (``check_failed_lookup``),
counted after the lookup, so it tells a client to stop sending wrong keys without saving the server
anything per request.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from dataclasses import dataclass
from functools import lru_cache

import redis
from sqlmodel import Session

from conductor.errors import ConductorError, ErrorType
from conductor.ratelimit import REDIS_TIMEOUT_S, RateLimiterUnavailable, get_limiter
from conductor.settings import Settings
from conductor.store import batches
from conductor.store import jobs as store

log = logging.getLogger(__name__)
SUBMIT_BUCKET = "submit:"
STREAMS_KEY = "conductor:quota:streams:"
STREAM_TTL_S = 60.0
"""An open stream refreshes its slot at least this often; a slot not refreshed (its API process died)
frees itself after this long."""
IN_FLIGHT_RETRY_AFTER_S = 5


@dataclass
class QuotaExceeded(ConductorError):
    title: str
    detail: str
    retry_after_s: float
    error_type = ErrorType.QUOTA_EXCEEDED

    def __str__(self) -> str:
        return self.detail

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` header value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after_s)))


def _uses_redis(settings: Settings) -> bool:
    return settings.broker_url.startswith(("redis://", "rediss://", "unix://"))


def check_submit_rate(tenant: str, settings: Settings) -> None:
    """Takes one submission from the tenant's bucket (``tenant_submits_per_minute``)."""
    if not _uses_redis(settings):
        return
    try:
        wait = get_limiter(settings.broker_url).try_take(
            SUBMIT_BUCKET + tenant, per_minute=settings.tenant_submits_per_minute, burst=settings.tenant_submit_burst
        )
    except RateLimiterUnavailable as exc:  # Redis is down: accept (the outbox copes), and say so
        cause = exc.__cause__ or exc  # (the limiter's own message speaks of a step to retry)
        log.warning("submit-rate quota not enforced: its Redis cannot be reached (%s: %s); the submission is "
                    "accepted", type(cause).__name__, cause)
        return
    if wait > 0:
        raise QuotaExceeded(
            "Too many submissions",
            f"this tenant may submit {settings.tenant_submits_per_minute} jobs per minute; try again in "
            f"{math.ceil(wait)} s",
            wait,
        )


AUTH_FAILURES_BUCKET = "authfail:"
_warned_at: dict[str, float] = {}
"""When this process last logged an address past ``auth_failures_per_minute`` (one line a minute each)."""
MAX_WARNED_ADDRESSES = 10_000


def failed_lookup_bucket(client: str) -> str:
    """The bucket an address's failed lookups count in: an IPv4 address itself (an IPv4-mapped IPv6 one,
    ``::ffff:a.b.c.d``, as that IPv4 address: a dual-stack socket reports IPv4 clients so), an IPv6 address
    by its /64 (one subscriber's usual allocation: a bucket per address would give its holder 2^64 of
    them), anything else (``unknown``, a name) as it is."""
    try:
        address = ipaddress.ip_address(client.strip("[]"))
    except ValueError:
        return client
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def check_failed_lookup(client: str, settings: Settings) -> None:
    """Counts one failed API-key lookup from the address ``client`` (``auth_failures_per_minute``) in its
    bucket (``failed_lookup_bucket``: an IPv6 address's /64); raises QuotaExceeded once that bucket has used
    its failures up, and logs a warning for it (once a minute per bucket and API process). Called only
    after the lookup has failed, never before one: a valid key is never refused (an address may be shared:
    a NAT, a proxy), and a client past the limit still costs the server a key lookup (one indexed query)
    per request, as it did before. What it does is tell a client that keeps sending a wrong key (a revoked
    key in a loop, a scan) to stop, with Retry-After, and show it in the logs; it is not what keeps keys
    from being guessed (they are 256-bit random: guessing is hopeless anyway). With Redis away the failure
    is not counted (logged): a plain 401, as before."""
    if not settings.auth_failures_per_minute or not _uses_redis(settings):
        return
    bucket = failed_lookup_bucket(client)
    try:
        wait = get_limiter(settings.broker_url).try_take(
            AUTH_FAILURES_BUCKET + bucket, per_minute=settings.auth_failures_per_minute)
    except RateLimiterUnavailable as exc:
        cause = exc.__cause__ or exc
        log.warning("failed key lookups not counted: their Redis cannot be reached (%s: %s); answered 401",
                    type(cause).__name__, cause)
        return
    if wait > 0:
        now = time.monotonic()
        if now - _warned_at.get(bucket, -math.inf) >= 60:
            if len(_warned_at) >= MAX_WARNED_ADDRESSES:
                _warned_at.clear()
            _warned_at[bucket] = now
            log.warning("too many failed key lookups from %s (over %d a minute, CONDUCTOR_AUTH_FAILURES_PER_MINUTE): "
                        "its unknown keys are refused with Retry-After (logged once a minute per address)",
                        bucket, settings.auth_failures_per_minute)
        raise QuotaExceeded(
            "Too many failed key lookups",
            f"this address sent an unknown or revoked API key more than {settings.auth_failures_per_minute} "
            f"times in a minute (CONDUCTOR_AUTH_FAILURES_PER_MINUTE), this one too: send a valid key "
            f"('conductor keys create --tenant NAME' prints one); an unknown one is refused like this for "
            f"{math.ceil(wait)} s more",
            wait,
        )


def check_jobs_in_flight(session: Session, tenant: str, settings: Settings) -> None:
    """Refuses a new job while the tenant already has ``tenant_max_jobs_in_flight`` unfinished ones.
    Holds a per-tenant lock until the caller's transaction ends, so concurrent submissions cannot
    both take the last place."""
    store.lock_tenant(session, tenant=tenant)
    running = store.count_jobs_in_flight(session, tenant=tenant)
    if running >= settings.tenant_max_jobs_in_flight:
        raise in_flight_refusal(running, settings)


def in_flight_refusal(running: int, settings: Settings) -> QuotaExceeded:
    return QuotaExceeded(
        "Too many jobs in flight",
        f"this tenant has {running} unfinished jobs; the limit is {settings.tenant_max_jobs_in_flight}. "
        "Wait for some to end (or cancel them)",
        IN_FLIGHT_RETRY_AFTER_S,
    )


class BatchTooLarge(ValueError):
    """A batch with more lines than a tenant may ever have unfinished: waiting cannot admit it."""


def check_batch_jobs_in_flight(session: Session, tenant: str, settings: Settings, *, lines: int) -> None:
    """Refuses a batch of ``lines`` lines while the tenant's unfinished batch lines plus these would pass
    ``tenant_max_batch_jobs_in_flight`` (QuotaExceeded, 429: wait); BatchTooLarge when ``lines`` alone
    would. The caller holds the tenant's ``files`` lock (``lock_tenant(scope="files")``), which every batch
    creation takes, so two batches cannot both take the last places."""
    limit = settings.tenant_max_batch_jobs_in_flight
    if lines > limit:
        raise BatchTooLarge(f"the batch has {lines} lines; a tenant may have at most {limit} batch lines "
                            "unfinished (CONDUCTOR_TENANT_MAX_BATCH_JOBS_IN_FLIGHT): split the file")
    running = batches.unfinished_lines(session, tenant=tenant)
    if running + lines > limit:
        raise QuotaExceeded(
            "Too many batch jobs in flight",
            f"this tenant has {running} unfinished batch lines and this batch has {lines}; the limit is "
            f"{limit}. Wait for some to end (or cancel a batch)",
            IN_FLIGHT_RETRY_AFTER_S,
        )


@dataclass(frozen=True)
class Admission:
    """The quotas a route that creates jobs applies: the tenant's submit rate, checked before the insert
    (``check_rate``), and its jobs in flight, checked by the insert itself (``create_job(admit=...)`` calls
    ``store.insert_job_admitted`` with ``max_in_flight``). Called with a session, it runs both checks
    up front and holds the tenant's lock until commit (a batch: one admission for all its jobs)."""

    tenant: str
    settings: Settings

    @property
    def max_in_flight(self) -> int:
        return self.settings.tenant_max_jobs_in_flight

    def check_rate(self) -> None:
        check_submit_rate(self.tenant, self.settings)

    def refused(self, session: Session) -> QuotaExceeded:
        """The refusal when the insert found the tenant at its limit (counted again for the message)."""
        return in_flight_refusal(store.count_jobs_in_flight(session, tenant=self.tenant), self.settings)

    def __call__(self, session: Session) -> None:
        self.check_rate()
        check_jobs_in_flight(session, self.tenant, self.settings)


def admission(tenant: str, settings: Settings) -> Admission:
    """The quotas every route that creates a job applies (``create_job(admit=...)``)."""
    return Admission(tenant, settings)


# KEYS[1] the tenant's open streams (zset: slot -> expiry, microseconds). ARGV: slot, limit, ttl (s).
# Returns EXTENDED (2) when the slot was held and is extended, TAKEN (1) when it is taken now (a new slot,
# or one that lapsed, counted against the limit like a new one), REFUSED (0) when the tenant holds ``limit``.
TAKE_STREAM_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000000 + tonumber(clock[2])
local ttl = tonumber(ARGV[3]) * 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = 1
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  held = 2
elseif redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl / 1000) + 1000)
return held
"""
REFUSED, TAKEN, EXTENDED = 0, 1, 2


class StreamSlots:
    """Open event streams per tenant, shared by every API process."""

    def __init__(self, url: str):
        self.client = redis.Redis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S)
        self._take = self.client.register_script(TAKE_STREAM_LUA)
        self.note_ending = self.client.register_script(NOTE_ENDING_LUA)
        self.keep_highest = self.client.register_script(KEEP_HIGHEST_LUA)

    def hold(self, tenant: str, slot: str, *, limit: int) -> int:
        """Extends ``slot`` while it is held (``EXTENDED``), else takes it (``TAKEN``) unless the tenant
        already holds ``limit`` slots (``REFUSED``)."""
        return int(self._take(keys=[STREAMS_KEY + tenant], args=[slot, limit, repr(STREAM_TTL_S)]))

    def release(self, tenant: str, slot: str) -> None:
        self.client.zrem(STREAMS_KEY + tenant, slot)


@lru_cache(maxsize=4)
def stream_slots(url: str) -> StreamSlots:
    return StreamSlots(url)


ENDING_AT_KEY = "conductor:response-ending-at:"
SENT_UP_TO_KEY = "conductor:response-sent-up-to:"
ENDING_AT_TTL_S = 7 * 24 * 3600
"""How long a response's stream remembers the number its ending (the answer's events) was sent at: a resume
later than this gets the ending again, numbered after ``starting_after``."""


NOTE_ENDING_LUA = """
local own = tonumber(ARGV[1])
local sent = redis.call('GET', KEYS[2])
if sent and tonumber(sent) >= own then
  own = tonumber(sent) + 1
end
local recorded = redis.call('GET', KEYS[1])
if recorded and tonumber(recorded) >= own then
  return tonumber(recorded)
end
redis.call('SET', KEYS[1], own, 'EX', ARGV[2])
return own
"""
"""A stream about to send a response's ending at ``ARGV[1]``: its own number, or past every number a stream
of the response recorded sending (``KEYS[2]``, ``note_sent_up_to``) when that is higher; it takes the number
recorded (``KEYS[1]``) when that is not below it (its ending then keeps the recorded numbers, a gap before
them); else it records it."""
KEEP_HIGHEST_LUA = """
local recorded = redis.call('GET', KEYS[1])
if recorded and tonumber(recorded) >= tonumber(ARGV[1]) then
  return tonumber(recorded)
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return tonumber(ARGV[1])
"""
"""Sets ``KEYS[1]`` to ``ARGV[1]`` unless it holds a number not below it; returns what it holds."""


def note_ending_at(job_id: str, sequence: int, settings: Settings) -> int | None:
    """Where the ending of response ``job_id``'s stream starts, for a stream about to send it at ``sequence``
    (or after the highest number any stream of it recorded sending, ``note_sent_up_to``, when that is not
    below ``sequence``: a client that resumes as the SDK does, reading the stream afresh and dropping every
    number up to the last it saw, still gets the whole ending): the number recorded by an earlier stream when
    it is not below that (the ending keeps the numbers a resume will use), else that, recorded in its place.
    Replaced rather than kept: a stream past the recorded number is most likely the resume of the one that
    recorded it, whose client has gone. None without Redis, or with Redis away (every stream then numbers its
    ending as it goes)."""
    if not _uses_redis(settings):
        return None
    slots = stream_slots(settings.broker_url)
    try:
        return int(slots.note_ending(keys=[ENDING_AT_KEY + job_id, SENT_UP_TO_KEY + job_id],
                                     args=[sequence, ENDING_AT_TTL_S]))
    except redis.RedisError as exc:
        log.warning("response %s: where its stream's ending starts is not recorded: %s", job_id, exc)
        return None


def ending_at(job_id: str, settings: Settings) -> int | None:
    """The number ``note_ending_at`` recorded for response ``job_id``, or None."""
    if not _uses_redis(settings):
        return None
    try:
        recorded = stream_slots(settings.broker_url).client.get(ENDING_AT_KEY + job_id)
    except redis.RedisError as exc:
        log.warning("response %s: where its stream's ending starts cannot be read: %s", job_id, exc)
        return None
    return None if recorded is None else int(recorded)


def note_sent_up_to(job_id: str, sequence: int, settings: Settings) -> None:
    """Records that a stream of response ``job_id`` is about to send events numbered up to ``sequence``
    (kept when a higher number is recorded; for ``ENDING_AT_TTL_S``), so that the ending of a stream read
    afresh is numbered after it (``note_ending_at``). Nothing without Redis, or with Redis away (logged)."""
    if not _uses_redis(settings):
        return
    try:
        stream_slots(settings.broker_url).keep_highest(keys=[SENT_UP_TO_KEY + job_id],
                                                       args=[sequence, ENDING_AT_TTL_S])
    except redis.RedisError as exc:
        log.warning("response %s: the numbers its stream sent are not recorded: %s", job_id, exc)


def open_stream(tenant: str, slot: str, settings: Settings) -> None:
    """Takes one of the tenant's ``tenant_max_streams`` stream slots, or raises QuotaExceeded."""
    if not _uses_redis(settings):
        return
    try:
        held = stream_slots(settings.broker_url).hold(tenant, slot, limit=settings.tenant_max_streams)
    except redis.RedisError as exc:
        log.warning("stream quota not enforced: %s", exc)
        return
    if held == REFUSED:
        raise QuotaExceeded(
            "Too many event streams",
            f"this tenant already has {settings.tenant_max_streams} event streams open; close one first",
            STREAM_TTL_S / 4,
        )


def refresh_stream(tenant: str, slot: str, settings: Settings) -> bool:
    """Extends an open stream's slot; False when the stream must end. A slot not refreshed within
    ``STREAM_TTL_S`` (its process stalled, or Redis was away) has lapsed and its place may have gone to
    another stream: it is taken again only under ``tenant_max_streams``, as a new stream would be."""
    if not _uses_redis(settings):
        return True
    try:
        held = stream_slots(settings.broker_url).hold(tenant, slot, limit=settings.tenant_max_streams)
    except redis.RedisError as exc:
        log.warning("stream slot not refreshed: %s", exc)
        return True
    if held == TAKEN:
        log.warning("stream slot of tenant %s had lapsed; taken again", tenant)
    return held != REFUSED


def lapsed_stream_message(settings: Settings) -> str:
    """Why a stream whose slot lapsed and could not be taken again ends (``refresh_stream`` said False)."""
    return (f"this stream's slot lapsed (not refreshed for {STREAM_TTL_S:g} s) and the tenant has "
            f"{settings.tenant_max_streams} event streams open meanwhile, its limit")


def close_stream(tenant: str, slot: str, settings: Settings) -> None:
    if _uses_redis(settings):
        try:
            stream_slots(settings.broker_url).release(tenant, slot)
        except redis.RedisError as exc:
            log.warning("stream slot not released (it expires by itself): %s", exc)


__all__ = [
    "Admission",
    "BatchTooLarge",
    "QuotaExceeded",
    "admission",
    "check_batch_jobs_in_flight",
    "check_failed_lookup",
    "check_jobs_in_flight",
    "check_submit_rate",
    "close_stream",
    "failed_lookup_bucket",
    "in_flight_refusal",
    "lapsed_stream_message",
    "open_stream",
    "refresh_stream",
]
