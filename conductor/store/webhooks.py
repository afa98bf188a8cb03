"""Data access for webhooks: tenant settings (default URL, signing secret), the delivery outbox, every
attempt, and endpoints disabled by a 410. Claims are conditional updates, so a duplicated message never
sends a second attempt while one is in flight."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from conductor.sealed import SealError, needs_sealing, seal, unseal
from conductor.store.db import in_id_order
from conductor.store.jobs import lock_tenant
from conductor.store.models import (
    DeliveryStatus,
    Job,
    JobStatus,
    TenantSettings,
    UTCDateTime,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    utcnow,
)

EVENT_TYPES: dict[str, str] = {
    JobStatus.SUCCEEDED: "job.succeeded",
    JobStatus.FAILED: "job.failed",
    JobStatus.CANCELLED: "job.cancelled",
}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# --- tenant settings ------------------------------------------------------------------------------


def get_tenant_settings(session: Session, *, tenant: str) -> TenantSettings | None:
    return session.get(TenantSettings, tenant)


def _tenant_row(session: Session, tenant: str) -> TenantSettings:
    row = session.get(TenantSettings, tenant)
    if row is None:
        row = TenantSettings(tenant=tenant)
        session.add(row)
    return row


def set_default_webhook_url(session: Session, *, tenant: str, url: str | None) -> None:
    row = _tenant_row(session, tenant)
    row.webhook_url = url
    row.updated_at = utcnow()
    session.flush()


def default_webhook_url(session: Session, *, tenant: str) -> str | None:
    """The tenant's default target (read on every submit: a prebuilt statement, one column)."""
    return session.connection().execute(_default_webhook_url_stmt(), {"p_tenant": tenant}).scalar_one_or_none()


@cache
def _default_webhook_url_stmt() -> sa.Select[Any]:
    t: sa.Table = TenantSettings.__table__  # type: ignore[attr-defined]
    return sa.select(t.c.webhook_url).where(t.c.tenant == sa.bindparam("p_tenant", type_=sa.String()))


def set_webhook_secret(session: Session, *, tenant: str, secret: str, keep_previous_s: float = 0) -> str:
    """Stores ``secret`` as the tenant's signing secret. ``keep_previous_s`` > 0 (a rotation): the secret it
    replaces keeps signing beside it for that long (receivers verify either; Standard Webhooks sends
    several ``v1,`` signatures), else it is dropped at once. A replaced secret that no configured key opens
    is dropped (it could sign nothing: rotating is how an operator replaces such a secret). Returns what
    became of the replaced secret: ``kept``, ``dropped`` (as asked), ``unopenable`` or ``none`` (there was
    none)."""
    row = session.get(TenantSettings, tenant, with_for_update=True)  # two rotations at once: one after the other
    if row is None:
        row = _tenant_row(session, tenant)
    now = utcnow()
    kept: str | None = None
    outcome = "none" if row.webhook_secret is None else "dropped"
    if keep_previous_s > 0 and row.webhook_secret is not None:
        try:
            kept = seal(unseal(row.webhook_secret))  # sealed with the first key, like the current one
            outcome = "kept"
        except SealError:
            outcome = "unopenable"
    row.previous_webhook_secret = kept
    row.previous_secret_expires_at = now + timedelta(seconds=keep_previous_s) if kept is not None else None
    row.webhook_secret = seal(secret)
    row.secret_created_at = row.updated_at = now
    session.flush()
    return outcome


def previous_secret_expires_at(session: Session, *, tenant: str) -> datetime | None:
    """When the secret a rotation replaced stops signing, while it still does; else None. Opens nothing."""
    found = session.execute(
        sa.select(col(TenantSettings.previous_secret_expires_at))
        .where(col(TenantSettings.tenant) == tenant, col(TenantSettings.previous_webhook_secret).is_not(None))
    ).scalar_one_or_none()
    return found if found is not None and found > utcnow() else None


def previous_webhook_secret(session: Session, *, tenant: str) -> str | None:
    """The secret a rotation replaced, while it still signs; else None. Sealed again with the first key
    when it was sealed with another (as ``ensure_webhook_secret`` does for the current one)."""
    found = session.execute(
        sa.select(col(TenantSettings.previous_webhook_secret), col(TenantSettings.previous_secret_expires_at))
        .where(col(TenantSettings.tenant) == tenant)
    ).first()
    if found is None or found[0] is None or found[1] is None or found[1] <= utcnow():
        return None
    stored = str(found[0])
    plain = unseal(stored)
    if needs_sealing(stored):
        _reseal(session, tenant, stored, plain, column="previous_webhook_secret")
    return plain


def webhook_secret(session: Session, *, tenant: str) -> str | None:
    row = session.get(TenantSettings, tenant)
    return unseal(row.webhook_secret) if row and row.webhook_secret else None


# --- endpoints disabled by 410 --------------------------------------------------------------------


def url_hash(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()


def disable_endpoint(session: Session, *, tenant: str, url: str, reason: str) -> None:
    row = session.get(WebhookEndpoint, (tenant, url_hash(url)))
    if row is None:
        row = WebhookEndpoint(tenant=tenant, url_hash=url_hash(url), url=url)
    row.disabled_at, row.disabled_reason = utcnow(), reason
    session.add(row)
    session.flush()


def endpoint_disabled(session: Session, *, tenant: str, url: str) -> WebhookEndpoint | None:
    row = session.get(WebhookEndpoint, (tenant, url_hash(url)))
    return row if row is not None and row.disabled_at is not None else None


def enable_endpoint(session: Session, *, tenant: str, url: str) -> bool:
    """Re-enables a URL disabled by a 410; returns whether it was disabled."""
    row = endpoint_disabled(session, tenant=tenant, url=url)
    if row is None:
        return False
    row.disabled_at = row.disabled_reason = None
    session.add(row)
    return True


# --- the outbox -----------------------------------------------------------------------------------


def record_job_end(session: Session, *, job_id: str) -> str | None:
    """In the transaction that ended the job: writes the delivery its webhook is owed, if it has one
    (top-level jobs with a URL; one per job). One statement, on the hot path of every job's end.
    Returns the delivery id to send, or None."""
    inserted = session.connection().execute(
        _record_job_end_stmt(), {"p_id": new_message_id(), "p_job_id": job_id, "p_now": utcnow()}
    ).scalar_one_or_none()
    return str(inserted) if inserted is not None else None


@cache
def _record_job_end_stmt() -> sa.Insert:
    """Built once per process (building it cost more CPU than running it)."""
    j: sa.Table = Job.__table__  # type: ignore[attr-defined]
    d: sa.Table = WebhookDelivery.__table__  # type: ignore[attr-defined]
    now = sa.bindparam("p_now", type_=UTCDateTime())
    owed = sa.select(
        sa.bindparam("p_id", type_=sa.String()), j.c.id, j.c.tenant, j.c.webhook_url,
        sa.case(EVENT_TYPES, value=j.c.status),
        sa.literal(DeliveryStatus.PENDING.value), sa.literal(0), now, sa.literal(0), now,
    ).where(
        j.c.id == sa.bindparam("p_job_id", type_=sa.String()),
        j.c.parent_job_id.is_(None),
        j.c.webhook_url.is_not(None),
        sa.or_(*(j.c.status == status for status in EVENT_TYPES)),
        ~sa.exists().where(d.c.job_id == j.c.id),
    )
    columns = ["id", "job_id", "tenant", "url", "event_type", "status", "attempts", "next_attempt_at", "resends",
               "created_at"]
    return sa.insert(d).from_select(columns, owed).returning(d.c.id)


def backfill_job_end(session: Session, *, job_id: str) -> str | None:
    """``record_job_end`` for the reconciler, which may race another pass: the loser writes nothing."""
    try:
        with session.begin_nested():
            return record_job_end(session, job_id=job_id)
    except sa.exc.IntegrityError:
        return None


def get_delivery(session: Session, *, delivery_id: str) -> WebhookDelivery | None:
    return session.get(WebhookDelivery, delivery_id)


def deliveries_for_job(session: Session, *, job_id: str) -> list[WebhookDelivery]:
    stmt = select(WebhookDelivery).where(WebhookDelivery.job_id == job_id).order_by(col(WebhookDelivery.created_at))
    return list(session.exec(stmt))


def attempts_for(session: Session, *, delivery_ids: Sequence[str]) -> list[WebhookAttempt]:
    if not delivery_ids:
        return []
    stmt = select(WebhookAttempt).where(col(WebhookAttempt.delivery_id).in_(delivery_ids)).order_by(
        col(WebhookAttempt.delivery_id), col(WebhookAttempt.n)
    )
    return list(session.exec(stmt))


def pending_unsent(session: Session, *, job_id: str) -> list[str]:
    stmt = select(WebhookDelivery.id).where(
        WebhookDelivery.job_id == job_id,
        WebhookDelivery.status == DeliveryStatus.PENDING,
        col(WebhookDelivery.sent_at).is_(None),
    )
    return list(session.exec(stmt))


def mark_sent(session: Session, *, delivery_ids: Sequence[str], due_at: datetime) -> None:
    """Notes that the messages of these deliveries were sent, locking them by id (``in_id_order``): a
    reconciler pass notes its re-sends in the same order."""
    if delivery_ids:
        session.execute(
            sa.update(WebhookDelivery)
            .where(in_id_order(col(WebhookDelivery.id), col(WebhookDelivery.id).in_(list(delivery_ids))))
            .values(sent_at=due_at)
        )


CLAIM_EARLY_S = 1.0
"""A message may run this much before its attempt is due (the countdown and the row's clock differ)."""


WAKE_HOLD_S = 30.0
"""How long a parked delivery made due (woken, or back by itself) keeps its place from the tenant's newer
deliveries while its message comes: the line goes by age. Past it (its message lost), newer ones go on and
the reconciler sends it."""


@dataclass(frozen=True)
class Deferred:
    """A due attempt put off, not made: its tenant already had ``in_flight`` attempts in flight (its cap).
    The delivery is parked in the tenant's line, woken when one of those attempts ends
    (``wake_next_parked``), and at the latest comes back in ``in_s`` seconds; no attempt is counted."""

    in_s: float
    in_flight: int
    waiting: int


def park_for(*, waiting: int, cap: int, attempt_s: float, jitter: float) -> float:
    """The longest a parked delivery waits before it comes back by itself (it is normally woken sooner, when
    one of its tenant's attempts ends): about as long as the tenant's ``waiting`` deliveries take at ``cap``
    attempts of ``attempt_s`` (the attempt's timeout), at least two of them, so that however many wait they
    come back at about ``cap`` per ``attempt_s`` at most. ``jitter`` (0.5 to 1.5) spreads them."""
    return attempt_s * max(2.0, waiting / cap) * jitter


def claim_delivery(session: Session, *, delivery_id: str, lease_s: float, tenant_max_in_flight: int | None = None,
                   attempt_s: float = 15.0, jitter: float = 1.0) -> WebhookDelivery | Deferred | None:
    """Takes the next attempt if it is due and none is in flight; returns the row, or None. With
    ``tenant_max_in_flight``: when the tenant already has that many attempts in flight (leases not expired,
    across every worker: claims, and the ends of attempts that wake a parked delivery, take the tenant's
    lock in turn), the due attempt is put off instead: the delivery is parked in the tenant's line (kept in
    its place, by age, when it was parked already), its due time moves ``park_for`` later, no message is
    noted as sent (the caller sends one for then, or the reconciler does), and ``Deferred`` is returned. An
    older parked delivery that is due (woken, its message on the way) counts as in flight for a newer one:
    a place freed goes to the oldest waiting, whichever message comes first."""
    now = utcnow()
    found = session.execute(
        sa.select(col(WebhookDelivery.tenant), col(WebhookDelivery.created_at))
        .where(col(WebhookDelivery.id) == delivery_id, col(WebhookDelivery.status) == DeliveryStatus.PENDING)
    ).first()
    if found is None:
        return None
    tenant, created_at = str(found[0]), found[1]
    early = now + timedelta(seconds=CLAIM_EARLY_S)
    free = sa.or_(col(WebhookDelivery.lease_expires_at).is_(None), col(WebhookDelivery.lease_expires_at) < now)
    claimable = (col(WebhookDelivery.id) == delivery_id, col(WebhookDelivery.status) == DeliveryStatus.PENDING,
                 col(WebhookDelivery.next_attempt_at) <= early, free)
    if tenant_max_in_flight is not None:
        lock_tenant_deliveries(session, tenant=tenant)
        parked = col(WebhookDelivery.parked_at).is_not(None)
        waits = sa.or_(parked, col(WebhookDelivery.next_attempt_at) <= early)
        # older parked deliveries due now (woken, or back by themselves) hold their places until their
        # message comes, for WAKE_HOLD_S at most (a wake whose message was lost is sent by the reconciler)
        held_for_older = sa.and_(free, parked, col(WebhookDelivery.next_attempt_at) <= early,
                                 col(WebhookDelivery.next_attempt_at) >= now - timedelta(seconds=WAKE_HOLD_S),
                                 col(WebhookDelivery.created_at) < created_at)
        in_flight, waiting, held = session.execute(
            sa.select(sa.func.count().filter(col(WebhookDelivery.lease_expires_at) >= now),
                      sa.func.count().filter(sa.and_(free, waits)), sa.func.count().filter(held_for_older))
            .where(col(WebhookDelivery.tenant) == tenant, col(WebhookDelivery.status) == DeliveryStatus.PENDING)
        ).one()
        if in_flight + held >= tenant_max_in_flight:
            wait = park_for(waiting=waiting, cap=tenant_max_in_flight, attempt_s=attempt_s, jitter=jitter)
            put_off = session.execute(
                sa.update(WebhookDelivery).where(*claimable).values(
                    next_attempt_at=now + timedelta(seconds=wait), sent_at=None, resends=0,
                    deferrals=col(WebhookDelivery.deferrals) + 1,
                    parked_at=sa.func.coalesce(col(WebhookDelivery.parked_at), now))
            )
            return Deferred(in_s=wait, in_flight=in_flight, waiting=waiting) if _rowcount(put_off) == 1 else None
    stmt = (
        sa.update(WebhookDelivery)
        .where(*claimable)
        .values(lease_expires_at=now + timedelta(seconds=lease_s), attempts=col(WebhookDelivery.attempts) + 1,
                parked_at=None)
    )
    if _rowcount(session.execute(stmt)) != 1:
        return None
    row = session.get(WebhookDelivery, delivery_id)
    if row is not None:
        session.refresh(row)
    return row


def lock_tenant_deliveries(session: Session, *, tenant: str) -> None:
    """The tenant's lock over its places under the cap, until the transaction ends (Postgres)."""
    lock_tenant(session, tenant=tenant, scope="webhooks")


def wake_next_parked(session: Session, *, tenant: str) -> str | None:
    """Where one of ``tenant``'s attempts has just ended (its place under the cap is free): makes the oldest
    of the tenant's parked deliveries due now, with no message noted as sent (the caller sends one after the
    commit, or the reconciler does), and returns its id; None when none waits. Under the tenant's lock
    (``lock_tenant``, scope ``webhooks``: a claim parking a delivery meanwhile either sees the place free or
    is seen here). A row another transaction holds is passed over, not waited for (the reconciler locks
    deliveries in id order, this transaction holds the ended one's)."""
    now = utcnow()
    oldest = (
        sa.select(col(WebhookDelivery.id))
        .where(col(WebhookDelivery.tenant) == tenant, col(WebhookDelivery.status) == DeliveryStatus.PENDING,
               col(WebhookDelivery.parked_at).is_not(None), col(WebhookDelivery.next_attempt_at) > now)
        .order_by(col(WebhookDelivery.created_at))
        .limit(1)
    )
    if session.get_bind().dialect.name == "postgresql":
        oldest = oldest.with_for_update(skip_locked=True)
    woken = session.execute(
        sa.update(WebhookDelivery)
        .where(col(WebhookDelivery.id) == oldest.scalar_subquery())
        .values(next_attempt_at=now, sent_at=None, resends=0)
        .returning(col(WebhookDelivery.id))
    ).scalar_one_or_none()
    return None if woken is None else str(woken)


def freeze_payload(session: Session, *, delivery_id: str, payload: str) -> None:
    session.execute(
        sa.update(WebhookDelivery)
        .where(col(WebhookDelivery.id) == delivery_id, col(WebhookDelivery.payload).is_(None))
        .values(payload=payload)
    )


def frozen_payload(session: Session, *, delivery_id: str) -> str | None:
    return session.execute(
        sa.select(col(WebhookDelivery.payload)).where(col(WebhookDelivery.id) == delivery_id)
    ).scalar_one_or_none()


def record_attempt(
    session: Session,
    *,
    delivery_id: str,
    n: int,
    started_at: datetime,
    status_code: int | None,
    latency_ms: int | None,
    error: str | None,
) -> None:
    session.add(WebhookAttempt(delivery_id=delivery_id, n=n, started_at=started_at, finished_at=utcnow(),
                               status_code=status_code, latency_ms=latency_ms, error=error))
    session.flush()


def finish_delivery(session: Session, *, delivery_id: str, status: str, attempt: int | None = None) -> None:
    """Ends a pending delivery. ``attempt``: only while it is the delivery's latest claim (an attempt that
    outlived its lease, and was claimed again meanwhile, must not end the newer one's delivery)."""
    stmt = sa.update(WebhookDelivery).where(col(WebhookDelivery.id) == delivery_id,
                                            col(WebhookDelivery.status) == DeliveryStatus.PENDING)
    if attempt is not None:
        stmt = stmt.where(col(WebhookDelivery.attempts) == attempt)
    session.execute(stmt.values(status=status, finished_at=utcnow(), lease_expires_at=None))


def schedule_retry(session: Session, *, delivery_id: str, at: datetime, attempt: int) -> None:
    """The next attempt of a pending delivery at ``at``, while ``attempt`` is still its latest claim."""
    session.execute(
        sa.update(WebhookDelivery)
        .where(col(WebhookDelivery.id) == delivery_id, col(WebhookDelivery.status) == DeliveryStatus.PENDING,
               col(WebhookDelivery.attempts) == attempt)
        .values(next_attempt_at=at, lease_expires_at=None, sent_at=None, resends=0, parked_at=None)
    )


# --- what the reconciler looks for ----------------------------------------------------------------


def deliveries_due(session: Session, *, now: datetime, grace_s: float, limit: int = 500) -> list[WebhookDelivery]:
    """Pending deliveries whose attempt is due, none in flight: either no message was sent for it (lost
    before the send, or a long backoff the reconciler owns) or the message sent may have been lost."""
    stmt = select(WebhookDelivery).where(
        WebhookDelivery.status == DeliveryStatus.PENDING,
        col(WebhookDelivery.next_attempt_at) <= now - timedelta(seconds=grace_s),
        sa.or_(col(WebhookDelivery.lease_expires_at).is_(None), col(WebhookDelivery.lease_expires_at) < now),
    )
    return list(session.exec(stmt.order_by(col(WebhookDelivery.next_attempt_at)).limit(limit)))


def note_resend(session: Session, *, delivery_id: str, resends: int, sent_at: datetime) -> None:
    session.execute(
        sa.update(WebhookDelivery).where(col(WebhookDelivery.id) == delivery_id).values(
            resends=resends, sent_at=sent_at
        )
    )


def ended_jobs_without_delivery(session: Session, *, since: datetime, limit: int = 100) -> list[str]:
    """Top-level jobs that ended with a webhook URL but have no delivery row (a path that ended them
    without writing one): the reconciler writes it, so an ended job's webhook is never silently lost."""
    owed = (
        select(Job.id)
        .where(
            col(Job.status).in_(list(EVENT_TYPES)),
            col(Job.webhook_url).is_not(None),
            col(Job.parent_job_id).is_(None),
            col(Job.updated_at) >= since,  # (status, updated_at) is indexed; a job's end sets both
            col(Job.finished_at) >= since,
            ~sa.exists().where(col(WebhookDelivery.job_id) == col(Job.id)),
        )
        .limit(limit)
    )
    return list(session.exec(owed))


def ensure_webhook_secret(session: Session, *, tenant: str, new: str) -> str:
    """The tenant's secret, storing ``new`` first if it has none; two concurrent callers get the same one.
    Stored sealed when ``CONDUCTOR_SECRETS_KEY`` is set (``conductor.sealed``)."""
    now = utcnow()
    new_sealed = seal(new)
    session.execute(
        sa.update(TenantSettings)
        .where(col(TenantSettings.tenant) == tenant, col(TenantSettings.webhook_secret).is_(None))
        .values(webhook_secret=new_sealed, secret_created_at=now, updated_at=now)
    )
    current = session.execute(
        sa.select(col(TenantSettings.webhook_secret)).where(col(TenantSettings.tenant) == tenant)
    ).first()
    if current is None:
        try:
            with session.begin_nested():
                session.add(TenantSettings(tenant=tenant, webhook_secret=new_sealed, secret_created_at=now))
        except sa.exc.IntegrityError:
            pass
        current = session.execute(
            sa.select(col(TenantSettings.webhook_secret)).where(col(TenantSettings.tenant) == tenant)
        ).first()
    assert current is not None and current[0] is not None
    stored = str(current[0])
    plain = unseal(stored)
    if needs_sealing(stored):
        _reseal(session, tenant, stored, plain)
    return plain


def _reseal(session: Session, tenant: str, stored: str, plain: str, *, column: str = "webhook_secret") -> bool:
    """Writes ``plain`` sealed with the first key into ``column`` (the current secret, or the one a
    rotation replaced), unless the stored value changed meanwhile."""
    done = session.execute(
        sa.update(TenantSettings)
        .where(col(TenantSettings.tenant) == tenant, col(getattr(TenantSettings, column)) == stored)
        .values({column: seal(plain)})
    )
    return _rowcount(done) == 1


@dataclass(frozen=True)
class Resealed:
    resealed: int
    tenants: int
    unopened: list[str]
    """Tenants whose secret no configured key opens (sealed with a key that was dropped): left as they are."""
    unopened_previous: list[str] = field(default_factory=list)
    """Tenants whose replaced secret, still signing, no configured key opens: left as they are (their
    deliveries carry the current secret's signature only until the key is given back)."""


def reseal_secrets(session: Session, *, tenant: str | None = None) -> Resealed:
    """Seals every stored secret (or ``tenant``'s) that is plaintext or sealed with a key other than the
    first with the first (``conductor webhooks reseal``, after a key is added or rotated)."""
    stmt = (sa.select(col(TenantSettings.tenant), col(TenantSettings.webhook_secret))
            .where(col(TenantSettings.webhook_secret).is_not(None)))
    if tenant is not None:
        stmt = stmt.where(col(TenantSettings.tenant) == tenant)
    rows = session.execute(stmt).all()
    done, unopened = 0, []
    for name, stored in rows:
        if not needs_sealing(str(stored)):
            continue
        try:
            plain = unseal(str(stored))
        except SealError:
            unopened.append(str(name))
            continue
        done += _reseal(session, str(name), str(stored), plain)
    previous = _reseal_previous(session, tenant)
    return Resealed(done, len(rows), unopened, previous)


def _reseal_previous(session: Session, tenant: str | None) -> list[str]:
    """The secrets rotations replaced, still signing, sealed with the first key too; returns the tenants
    whose replaced secret no configured key opens (left as they are, like current ones). Expired ones are
    dropped."""
    stmt = (sa.select(col(TenantSettings.tenant), col(TenantSettings.previous_webhook_secret),
                      col(TenantSettings.previous_secret_expires_at))
            .where(col(TenantSettings.previous_webhook_secret).is_not(None)))
    if tenant is not None:
        stmt = stmt.where(col(TenantSettings.tenant) == tenant)
    unopened = []
    for name, stored, expires_at in session.execute(stmt).all():
        if expires_at is None or expires_at <= utcnow():
            session.execute(sa.update(TenantSettings)
                            .where(col(TenantSettings.tenant) == name,
                                   col(TenantSettings.previous_webhook_secret) == stored)
                            .values(previous_webhook_secret=None, previous_secret_expires_at=None))
            continue
        if not needs_sealing(str(stored)):
            continue
        try:
            plain = unseal(str(stored))
        except SealError:
            unopened.append(str(name))
            continue
        _reseal(session, str(name), str(stored), plain, column="previous_webhook_secret")
    return unopened


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)
