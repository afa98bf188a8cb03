"""One delivery attempt: claim it, sign the frozen body, check the target (SSRF) after resolving it,
POST to the address that was checked, record the attempt, and decide what comes next.

Every attempt of one delivery carries the same ``webhook-id`` and the same body (frozen at the first
attempt); each is signed with a fresh ``webhook-timestamp``. A 2xx delivers; a 410 disables the URL for
the tenant (this delivery and every later one to it are recorded, not sent); anything else is retried
after ``webhook_backoff_s[n-1]`` — or the receiver's ``Retry-After`` when that is longer — until the
schedule is spent. Nothing here runs on a step worker: the task lives on the ``webhooks`` queue.

A tenant has at most ``webhook_tenant_max_in_flight`` attempts in flight: a due attempt past that is put
off (``store.webhooks.Deferred``) without counting as an attempt and parked in the tenant's line, so that
one tenant's silent receivers hold a few worker slots, not every one; each attempt's end wakes the oldest
parked delivery of its tenant (``Outcome.wake``).
"""

from __future__ import annotations

import json
import logging
import random
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import httpcore
import httpx
from sqlmodel import Session

from conductor.sealed import SealError
from conductor.settings import Settings
from conductor.store import jobs as job_store
from conductor.store import webhooks as store
from conductor.store.db import session_scope
from conductor.store.models import DeliveryStatus, Job, Step, WebhookDelivery, utcnow
from conductor.webhooks.signing import headers as signed_headers
from conductor.webhooks.signing import new_secret
from conductor.webhooks.targets import Target, Unresolvable, UnsafeTarget, denied_of, resolve

log = logging.getLogger(__name__)
USER_AGENT = "conductor-queue-webhooks/0.1"
LEASE_MARGIN_S = 30.0
"""An attempt holds its claim for the request timeout plus this; a worker that died mid-attempt is
re-driven by the reconciler after it."""
MAX_ERROR_CHARS = 500

RenderJob = Callable[[Job, list[Step]], dict[str, Any]]
"""The job's public shape (``GET /v1/jobs/{id}``), which the API defines: the task layer passes it in."""


@dataclass(frozen=True)
class Outcome:
    retry_in: float | None = None
    """Seconds until the next attempt is due; None when the delivery is settled (or was not ours)."""
    wake: str | None = None
    """A parked delivery of the same tenant made due now (this attempt's place under the cap is free): the
    caller sends its message (if it cannot, the reconciler does)."""


@dataclass(frozen=True)
class _Answer:
    status_code: int | None
    retry_after: float | None
    error: str | None


UNSEALABLE = ("not sent: the worker could not open the tenant's signing secret (the operator must give "
              "every webhooks worker the CONDUCTOR_SECRETS_KEY it was sealed with)")


def deliver(delivery_id: str, *, settings: Settings, render: RenderJob) -> Outcome:
    """Makes the attempt that is due now; a duplicate message (none due, or one in flight) does nothing."""
    with session_scope() as s:
        row = store.claim_delivery(
            s, delivery_id=delivery_id, lease_s=settings.webhook_timeout_s + LEASE_MARGIN_S,
            tenant_max_in_flight=settings.webhook_tenant_max_in_flight, attempt_s=settings.webhook_timeout_s,
            jitter=random.uniform(0.5, 1.5),
        )
        if row is None:
            return Outcome()
        if isinstance(row, store.Deferred):
            log.info("webhook %s parked (back in %.1f s at the latest): its tenant has %d attempts in flight "
                     "(its cap, CONDUCTOR_WEBHOOK_TENANT_MAX_IN_FLIGHT) and %d waiting", delivery_id, row.in_s,
                     row.in_flight, row.waiting)
            return Outcome(retry_in=row.in_s)
    # The claim is committed on its own: its tenant's lock (held by a claim until it commits) is not held
    # while the body is rendered, so one tenant's claims wait for each other only as long as a claim takes.
    # What fails after it is settled as an attempt that failed inside the service (recorded, retried on the
    # schedule, its place freed), not left holding the claim until its lease ends.
    try:
        prepared = _prepare(row, render)
    except Exception as exc:
        log.exception("webhook %s (tenant %s): the attempt failed inside the worker before sending", row.id,
                      row.tenant)
        return _settle(row, utcnow(), _Answer(None, None, _inside(exc)), settings)
    if isinstance(prepared, Outcome):
        return prepared
    body, secret, also = prepared
    started = utcnow()
    if secret is None:
        return _settle(row, started, _Answer(None, None, UNSEALABLE), settings)
    clock = time.monotonic()
    try:
        # the attempt's whole time, the name's lookup included (a resolver that does not answer would
        # otherwise hold the worker slot, and the tenant's place under its cap, for its own timeouts)
        target = resolve(row.url, allow_loopback=settings.webhook_allow_loopback, denied=denied_of(settings),
                         within_s=settings.webhook_timeout_s)
        timestamp = int(time.time())
        left = max(0.001, settings.webhook_timeout_s - (time.monotonic() - clock))
        answer = _post(row.url, target, signed_headers(secret, row.id, timestamp, body.encode(), also=also),
                       body.encode(), timeout=left)
    except UnsafeTarget as exc:
        return _settle(row, started, _Answer(None, None, str(exc)), settings, refused=True)
    except Unresolvable as exc:
        return _settle(row, started, _Answer(None, None, str(exc)), settings)
    except Exception as exc:  # a fault of ours or a library's: the attempt is still settled, so its schedule
        # ends; unsettled, the reconciler would re-send it after every lease, for ever
        log.exception("webhook %s (tenant %s): the attempt failed inside the worker", row.id, row.tenant)
        answer = _Answer(None, None, _inside(exc))
    latency_ms = int((time.monotonic() - clock) * 1000)
    return _settle(row, started, answer, settings, latency_ms=latency_ms)


def _inside(exc: Exception) -> str:
    return f"the attempt failed inside the service ({type(exc).__name__}); it is retried on the schedule"


def _prepare(row: WebhookDelivery, render: RenderJob) -> tuple[str, str | None, list[str]] | Outcome:
    """What the claimed attempt sends: its body (frozen at the first attempt), the signing secret (None when
    this worker cannot open it) and the previous one while it still signs; or the attempt's end when its URL
    is disabled (recorded, not sent)."""
    with session_scope() as s:
        disabled = store.endpoint_disabled(s, tenant=row.tenant, url=row.url)
        if disabled is not None:
            store.lock_tenant_deliveries(s, tenant=row.tenant)
            store.record_attempt(
                s, delivery_id=row.id, n=row.attempts, started_at=utcnow(), status_code=None, latency_ms=None,
                error=f"not sent: this URL answered 410 Gone at {disabled.disabled_at} and is disabled "
                      "for the tenant ('conductor webhooks enable' re-enables it)",
            )
            store.finish_delivery(s, delivery_id=row.id, status=DeliveryStatus.DISABLED)
            return Outcome(wake=store.wake_next_parked(s, tenant=row.tenant))
        body = row.payload or _freeze_payload(s, row, render)
        try:
            secret: str | None = store.ensure_webhook_secret(s, tenant=row.tenant, new=new_secret())
        except SealError as exc:  # this worker lacks the key: an attempt on record, retried with backoff
            log.error("webhook %s (tenant %s): %s", row.id, row.tenant, exc)
            secret = None
        also: list[str] = []
        if secret is not None:
            try:  # the secret a rotation replaced signs too while it lasts, so receivers can switch
                previous = store.previous_webhook_secret(s, tenant=row.tenant)
            except SealError as exc:  # the current one signs: a receiver already switched accepts it
                log.error("webhook %s (tenant %s): the previous secret cannot be opened: %s", row.id, row.tenant, exc)
                previous = None
            also = [previous] if previous is not None else []
    return body, secret, also


def event_body(event_type: str, data: dict[str, Any], timestamp: datetime | None) -> str:
    envelope = {"type": event_type, "timestamp": (timestamp or utcnow()).isoformat(), "data": data}
    return json.dumps(envelope, separators=(",", ":"))


def _freeze_payload(s: Session, row: WebhookDelivery, render: RenderJob) -> str:
    """The body of every attempt: the job as ``GET /v1/jobs/{id}`` shows it when the first attempt runs."""
    job = job_store.get_job(s, job_id=row.job_id)
    assert job is not None
    body = event_body(row.event_type, render(job, job_store.get_steps(s, job_id=job.id)), job.finished_at)
    store.freeze_payload(s, delivery_id=row.id, payload=body)
    return store.frozen_payload(s, delivery_id=row.id) or body


def _post(url: str, target: Target, headers: dict[str, str], body: bytes, *, timeout: float) -> _Answer:
    """POSTs to the checked address itself; the Host header and the TLS server name stay the URL's host,
    so certificates are verified against the name. No redirects, no proxies from the environment. The
    whole attempt — connect, TLS, sending, the answer's status line and headers — ends within ``timeout``
    seconds (``_Deadline``); the answer's body is never read."""
    original = httpx.URL(url)
    pinned = original.copy_with(host=str(target.address))
    extensions: dict[str, Any] = {"timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout}}
    if target.scheme == "https":
        extensions["sni_hostname"] = target.host
    request_headers = {
        **headers,
        "Host": original.netloc.decode("ascii"),
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
    }
    try:
        with (
            httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(), max_connections=1,
                                    network_backend=_Deadline(timeout)) as pool,
            pool.stream("POST", str(pinned), headers=list(request_headers.items()), content=body,
                        extensions=extensions) as response,
        ):
            code = response.status
            retry_after = _retry_after(_header(response.headers, b"retry-after"))
    except _TRANSPORT_ERRORS as exc:
        return _Answer(None, None, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS] or type(exc).__name__)
    error = None if 200 <= code < 300 else f"HTTP {code}"
    return _Answer(code, retry_after, error)


_TRANSPORT_ERRORS = (httpcore.TimeoutException, httpcore.NetworkError, httpcore.ProtocolError,
                     httpcore.UnsupportedProtocol, httpcore.ProxyError)


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class _Deadline(httpcore.NetworkBackend):
    """One attempt's connection, whose every socket operation gets at most what is left of the attempt's
    ``seconds``. A per-operation timeout alone (httpx's) would let a receiver that sends its answer a
    byte at a time hold a delivery worker for as long as it likes."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.until = time.monotonic() + seconds
        self.backend = httpcore.SyncBackend()

    def left(self, timeout: float | None) -> float:
        left = self.until - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout(f"the receiver did not answer within {self.seconds:g} s")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self.backend.connect_tcp(host, port, self.left(timeout), local_address,
                                                        socket_options), self)

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        raise httpcore.UnsupportedProtocol("webhooks are sent over TCP only")

    def sleep(self, seconds: float) -> None:
        self.backend.sleep(min(seconds, self.left(None)))


class _DeadlineStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream, deadline: _Deadline):
        self.stream, self.deadline = stream, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.stream.read(max_bytes, self.deadline.left(timeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, self.deadline.left(timeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _DeadlineStream(self.stream.start_tls(ssl_context, server_hostname, self.deadline.left(timeout)),
                               self.deadline)

    def get_extra_info(self, info: str) -> Any:
        return self.stream.get_extra_info(info)


def _retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # str.isdigit() is true of "²", which float() refuses
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - utcnow()).total_seconds())


def _settle(
    row: WebhookDelivery,
    started: datetime,
    answer: _Answer,
    settings: Settings,
    *,
    latency_ms: int | None = None,
    refused: bool = False,
) -> Outcome:
    n = row.attempts
    retry_in: float | None = None
    with session_scope() as s:
        store.lock_tenant_deliveries(s, tenant=row.tenant)  # (first: the tenant's lock, then the rows)
        store.record_attempt(s, delivery_id=row.id, n=n, started_at=started, status_code=answer.status_code,
                             latency_ms=latency_ms, error=answer.error)
        # An attempt that outlived its lease may have been claimed again meanwhile: a 2xx still ends the
        # delivery (it arrived), anything else settles it only while this attempt is its latest claim.
        if answer.status_code is not None and 200 <= answer.status_code < 300:
            store.finish_delivery(s, delivery_id=row.id, status=DeliveryStatus.DELIVERED)
        elif answer.status_code == 410:
            store.disable_endpoint(s, tenant=row.tenant, url=row.url,
                                   reason=f"answered 410 Gone to delivery {row.id} (job {row.job_id})")
            store.finish_delivery(s, delivery_id=row.id, status=DeliveryStatus.DISABLED)
        elif refused or n > len(settings.webhook_backoff_s):
            store.finish_delivery(s, delivery_id=row.id, status=DeliveryStatus.FAILED, attempt=n)
        else:
            retry_in = settings.webhook_backoff_s[n - 1]
            if answer.retry_after is not None:
                retry_in = max(retry_in, min(answer.retry_after, settings.webhook_retry_after_max_s))
            store.schedule_retry(s, delivery_id=row.id, at=utcnow() + timedelta(seconds=retry_in), attempt=n)
        wake = store.wake_next_parked(s, tenant=row.tenant)  # this attempt's place under the cap is free
    log.info("webhook %s (job %s) attempt %s: %s", row.id, row.job_id, n,
             answer.error or f"HTTP {answer.status_code}")
    return Outcome(retry_in=retry_in, wake=wake)
