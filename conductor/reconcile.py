"""The reconciler: Postgres says what is done; this re-drives whatever is due but stalled.

Celery is the fast path. Messages can still be lost (Redis restarted, a SIGKILLed worker whose message
waits out the visibility timeout, a send that failed after the commit). Each pass looks for:
- jobs accepted but never enqueued (broker down at submit) or whose plan message vanished;
- jobs ``planning`` whose planner's heartbeat has been silent for ``planning_stale_s`` (its worker died;
  a slow planner keeps beating and is left alone);
- child jobs still going after their parent ended (the parent's worker died between ending the parent
  and cancelling its children): they are cancelled now, and their children at the next pass;
- running jobs: steps queued long ago but never claimed, running steps whose lease expired (their
  worker died), recursive steps whose child job ended without resuming them, steps whose
  dependencies are done but were never dispatched, and jobs whose steps are all done but were never
  finalized;
- batches whose jobs have all ended but whose output was never written (ended here, so a batch no one
  reads still gets its output file), batches past their completion window (expired), and cancellations
  interrupted midway;
- trace-viewer sessions past their expiry (up to 1,000 a pass), whose keys may never sign in again;
- deleted files' places in their tenants' lists kept past 7 days (up to 1,000 a pass);
- jobs and webhook deliveries that ended and settled, folded into ``metrics_rollup`` in batches for up to
  ``METRICS_ROLLUP_BUDGET_S`` a pass (``roll_up_metrics``), so a ``/metrics`` scrape aggregates only
  the rows not folded yet.
A step re-claimed after its worker died, or a planning re-driven, more than ``step_max_attempts``
times fails instead of running again.
Every re-send is safe to duplicate: plan, claim and finalize are conditional updates.

Recovery bound: stalled work is first re-sent within ``reconcile_stale_s + reconcile_interval_s`` of
stalling (later re-sends of the same message back off exponentially); a crashed worker's step within
``step_lease_s + reconcile_interval_s`` (its lease is renewed by a heartbeat only while its worker lives;
while no worker claims it, its later re-sends back off the same way);
a job stuck planning within ``planning_stale_s + reconcile_interval_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from kombu.exceptions import OperationalError as BrokerAway
from sqlmodel import Session

from conductor.batches import reconcile_batches
from conductor.engine import Dispatch, advance, cancel_job, settle_from_children
from conductor.settings import Settings
from conductor.store import jobs as store
from conductor.store import webhooks as webhook_store
from conductor.store.batches import purge_deleted_files
from conductor.store.db import driver_reason, session_scope, unreachable
from conductor.store.keys import delete_expired_sessions
from conductor.store.metrics import roll_up_deliveries, roll_up_jobs
from conductor.store.models import JobStatus, StepStatus, utcnow

log = logging.getLogger(__name__)

ENQUEUE_GRACE_S = 2.0
WEBHOOK_BACKFILL_S = 600.0
"""How far back a pass looks for ended jobs whose webhook delivery was never written: 40 passes' worth at
the default 15 s interval, and further when passes were missed (``backfill_since``). The look is a range of
``ix_job_status_updated`` plus an anti-join, so it costs what this window holds, not a day of jobs."""
WEBHOOK_BACKFILL_MAX_S = 24 * 3600.0
"""How far back the first pass of a process looks, and the most any pass does."""
WEBHOOK_FULL_LOOK_EVERY_S = 3600.0
"""How often a process's pass looks the whole ``WEBHOOK_BACKFILL_MAX_S`` back anyway: an end committed
more than ``WEBHOOK_BACKFILL_S`` after the time it recorded (a worker whose clock is behind the
reconciler's, a long transaction) falls behind every short look, and is found by the next full one."""
_backfilled_at: datetime | None = None
"""When the last pass of this process that wrote every delivery it found owed had started."""
_full_look_at: datetime | None = None
"""When the last such pass that looked the whole day back had started."""
MAX_BACKOFF_DOUBLINGS = 6
METRICS_ROLLUP_BATCH = 1000
"""Jobs (and webhook deliveries) folded into ``metrics_rollup`` per transaction."""
METRICS_ROLLUP_BUDGET_S = 5.0
"""How long one pass keeps folding batches: after an upgrade the history is folded over the first passes,
oldest first, without holding up the pass behind it (a third of the default interval)."""
METRICS_ROLLUP_ANALYZE_AFTER = 10 * METRICS_ROLLUP_BATCH
"""A pass that folded this many rows of a table (the history, after an upgrade) has Postgres ANALYZE it:
the scrape finds the rows not rolled up through a partial index only once the statistics say they are
few, and autovacuum's analyze may come minutes after the history is folded."""


def reconcile_once(settings: Settings, send: Callable[[Dispatch], Any] | None = None
                   ) -> tuple[dict[str, Any], Dispatch]:
    """One pass; returns its report and the messages it gathered. With ``send``, they are sent as soon as
    they are gathered, before the pass's batch and housekeeping work (expiring batches cancels their
    jobs one by one): re-sends of lost steps, plans and webhooks do not wait behind it."""
    now = utcnow()
    stale_s = settings.reconcile_stale_s
    dispatch = Dispatch()
    report: dict[str, Any] = {}
    with session_scope() as s:
        orphans = store.orphaned_children(s)
    orphans_failed = 0
    for orphan in orphans:
        try:
            cancel_job(orphan)
        except Exception as exc:  # one orphan's fault must not cost the whole pass (every re-send below)
            if unreachable(exc):
                raise  # the database is away: so is the rest of the pass (the task logs it in one line)
            orphans_failed += 1
            log.exception("cancelling orphaned child job %s failed; retrying at the next pass", orphan)
    with session_scope() as s:
        # Touched (so passes rotate through them) and committed at once: each touch locks a job row that
        # its steps' outcomes need, so none is held while the rest of the pass reads and writes.
        running = store.running_job_ids(s, older_than=now)
    with session_scope() as s:
        # A job committed this instant is being published by the API right now: give it a moment.
        never = store.jobs_never_enqueued(s, older_than=now - timedelta(seconds=ENQUEUE_GRACE_S))
        lost = []
        for job in store.jobs_stuck_queued(s, older_than=now - timedelta(seconds=stale_s)):
            if due(job.enqueued_at, job.plan_resends, stale_s, now):
                lost.append(job.id)
                store.update_job(s, job_id=job.id, plan_resends=job.plan_resends + 1)
        silent_s = max(settings.planning_stale_s, settings.step_lease_s)  # a few missed heartbeats
        stuck = store.jobs_stuck_planning(s, older_than=now - timedelta(seconds=silent_s))
        for job_id in stuck:
            store.transition_job(s, job_id=job_id, from_=[JobStatus.PLANNING], to=JobStatus.QUEUED)
        # batch work (a batch's lines and their child jobs) is re-sent at the batch priority too, plans and
        # steps: a message still waiting behind live ones after stale_s (any batch larger than the workers
        # take in that time) would otherwise jump them
        dispatch.background |= store.batch_work(s, job_ids=[*never, *lost, *stuck, *running])
    with session_scope() as s:
        open_steps = store.open_steps(s, job_ids=running)
    resend: list[tuple[str, int]] = []
    for step in open_steps:
        if not resend_due(step, now=now, stale_s=stale_s):
            continue
        with session_scope() as s:  # one short transaction per re-send; a claim meanwhile wins
            noted = (store.note_step_resent(s, step_id=step.id, resends=step.resends, now=now)
                     if step.status == StepStatus.QUEUED
                     else store.note_lease_resent(s, step_id=step.id, resends=step.resends, now=now))
        if not noted:
            continue
        resend.append((step.job_id, step.index))
        dispatch.agents[(step.job_id, step.index)] = step.agent
    since = backfill_since(now)
    with session_scope() as s:
        webhooks, backfilled = _webhooks_due(s, now=now, stale_s=stale_s, since=since)
    if backfilled:  # committed: later passes look back from this one
        _note_backfilled(now, full=since <= now - timedelta(seconds=WEBHOOK_BACKFILL_MAX_S))
    dispatch.plan += [*never, *lost, *stuck]
    dispatch.webhooks += webhooks
    dispatch.steps += resend
    failed = 0
    away = False
    for job_id in running:
        try:
            dispatch += settle_from_children(job_id)
            dispatch += advance(job_id)
        except Exception as exc:  # one job's fault must not cost the others their re-sends (sent by the caller)
            failed += 1
            if unreachable(exc):  # the database went away: the jobs after it wait for the next pass too
                away = _database_away("reconciling running jobs", exc)
                break
            log.exception("reconciling job %s failed; retrying at the next pass", job_id)
    report.update(
        never_enqueued=len(never),
        lost_plan=len(lost),
        stuck_planning=len(stuck),
        orphans_cancelled=len(orphans) - orphans_failed,
        orphans_failed_to_cancel=orphans_failed,
        running_jobs=len(running),
        resent_steps=len(resend),
        jobs_failed_to_reconcile=failed,
        webhooks=len(webhooks),
        dispatched=len(dispatch.plan) + len(dispatch.steps) + len(dispatch.finalize) + len(dispatch.webhooks),
    )
    if send is not None:
        try:
            send(dispatch)
        except BrokerAway as exc:  # Redis away: one line (kombu's OperationalError says why), no traceback
            log.warning("the reconciler's re-sends are not sent (broker away: %s); a later pass sends them again",
                        exc)
            report["send_failed"] = True
        except Exception:  # these are re-sent at a later pass (their backoff noted)
            log.exception("sending the reconciler's re-sends failed; a later pass sends them again")
            report["send_failed"] = True
    if away:  # the housekeeping below would meet it too, each part after its own wait for a connection
        report["database_away"] = True
        return report, dispatch
    try:
        with session_scope() as s:
            report["expired_viewer_sessions"] = delete_expired_sessions(s, now=now)
    except Exception as exc:  # housekeeping: never worth the pass's re-sends
        _failed("deleting expired viewer sessions", exc)
    try:
        with session_scope() as s:
            report["forgotten_deleted_files"] = purge_deleted_files(s, now=now)
    except Exception as exc:  # housekeeping: a place kept longer serves a cursor longer
        _failed("forgetting deleted files' places", exc)
    try:
        report.update(reconcile_batches())
    except Exception as exc:  # the dispatch gathered above must still be sent; the batches are retried next pass
        _failed("reconciling batches", exc)
        report["batches_error"] = True
    try:
        report.update(roll_up_metrics(settings, now=now))
    except Exception as exc:  # housekeeping: a batch not folded stays in the scrape's live rows until a later pass
        _failed("rolling up metrics", exc)
        report["metrics_rollup_error"] = True
    return report, dispatch


def _failed(what: str, exc: Exception) -> None:
    """Logs a part of the pass that raised: in one line when the database is away (``unreachable``: the next
    pass does it again), with its traceback otherwise."""
    if unreachable(exc):
        _database_away(what, exc)
    else:
        log.exception("%s failed; retrying at the next pass", what)


def _database_away(what: str, exc: Exception) -> bool:
    log.warning("%s: the database is away (%s: %s); the next pass does it", what, type(exc).__name__,
                driver_reason(exc))
    return True


def roll_up_metrics(settings: Settings, *, now: datetime, budget_s: float = METRICS_ROLLUP_BUDGET_S,
                    batch: int = METRICS_ROLLUP_BATCH) -> dict[str, int]:
    """Folds settled jobs and webhook deliveries into ``metrics_rollup``, a batch of each per transaction,
    until none is left or ``budget_s`` has passed (a batch that started finishes)."""
    from conductor.webhooks.deliver import LEASE_MARGIN_S

    settled = now - timedelta(seconds=settings.metrics_settle_s)
    abandoned = now - timedelta(seconds=metrics_abandoned_s(settings))
    # an attempt that outlived its lease (webhook_timeout_s + LEASE_MARGIN_S) may be recorded after its delivery ended
    delivered = settled - timedelta(seconds=settings.webhook_timeout_s + LEASE_MARGIN_S)
    deadline = time.monotonic() + budget_s
    jobs = deliveries = 0
    more_jobs = more_deliveries = True
    while (more_jobs or more_deliveries) and time.monotonic() < deadline:
        if more_jobs:
            with session_scope() as s:
                n = roll_up_jobs(s, settled_before=settled, abandoned_before=abandoned, limit=batch)
            jobs, more_jobs = jobs + n, n == batch
        if more_deliveries:
            with session_scope() as s:
                n = roll_up_deliveries(s, settled_before=delivered, limit=batch)
            deliveries, more_deliveries = deliveries + n, n == batch
    for table, folded in (("job", jobs), ("webhook_delivery", deliveries)):
        if folded >= METRICS_ROLLUP_ANALYZE_AFTER:
            analyze(table)
    return {"metrics_rolled_up_jobs": jobs, "metrics_rolled_up_deliveries": deliveries}


def analyze(table: str) -> None:
    """``ANALYZE table`` on Postgres (its statistics; SQLite plans without them)."""
    with session_scope() as s:
        if s.get_bind().dialect.name == "postgresql":
            s.execute(sa.text(f"ANALYZE {table}"))


def metrics_abandoned_s(settings: Settings) -> float:
    """``metrics_abandoned_s``, or by default the longest a planning may run while its worker lives."""
    if settings.metrics_abandoned_s is not None:
        return settings.metrics_abandoned_s
    from conductor.planning.conductor_planner import MAX_PLANNER_ATTEMPTS

    return MAX_PLANNER_ATTEMPTS * settings.step_max_duration_s()


def _webhooks_due(s: Session, *, now: datetime, stale_s: float, since: datetime) -> tuple[list[str], bool]:
    """Webhook deliveries to send: ended jobs' deliveries never written (backfilled here), attempts due
    with no message sent (a lost send, or a backoff too long for a broker countdown), and messages sent
    but never consumed (re-sent with the same exponential backoff as steps). Also whether every owed
    delivery found was written (fewer than a pass's limit were owed)."""
    owed = webhook_store.ended_jobs_without_delivery(s, since=since, limit=BACKFILL_LIMIT)
    # One transaction writes or notes many rows, one statement each: by id, so that an overlapping pass
    # (or its marking of what it sent, store.webhooks.mark_sent) waits for this one's rows in the same order.
    for job_id in sorted(owed):
        webhook_store.backfill_job_end(s, job_id=job_id)
    due_now = []
    due_rows = webhook_store.deliveries_due(s, now=now, grace_s=ENQUEUE_GRACE_S)  # the oldest due first
    for delivery in sorted(due_rows, key=lambda d: d.id):
        if delivery.sent_at is None:
            due_now.append(delivery.id)
        elif due(delivery.sent_at, delivery.resends, stale_s, now):
            due_now.append(delivery.id)
            webhook_store.note_resend(s, delivery_id=delivery.id, resends=delivery.resends + 1, sent_at=now)
    return due_now, len(owed) < BACKFILL_LIMIT


BACKFILL_LIMIT = 100
"""Ended jobs given their missing delivery row in one pass; more wait for the next, which looks back as far."""


def backfill_since(now: datetime) -> datetime:
    """Where a pass starts looking for ended jobs without a delivery row: ``WEBHOOK_BACKFILL_S`` before the
    start of this process's last pass that wrote every one it found (at most a day back; a day at the
    process's first pass). So whatever kept passes from running (beat stopped, no ``maintenance``
    consumer) or from finishing their look (more owed than ``BACKFILL_LIMIT``) is looked through by the
    next pass, and the overlap takes in an end committed up to ten minutes after the time it recorded (a
    long transaction, another host's clock); later than that, by the next whole day's look, which a
    process takes every ``WEBHOOK_FULL_LOOK_EVERY_S``."""
    oldest = now - timedelta(seconds=WEBHOOK_BACKFILL_MAX_S)
    if _backfilled_at is None or _full_look_at is None or not (
            timedelta(0) <= now - _full_look_at < timedelta(seconds=WEBHOOK_FULL_LOOK_EVERY_S)):
        return oldest
    return max(oldest, min(_backfilled_at, now) - timedelta(seconds=WEBHOOK_BACKFILL_S))


def _note_backfilled(at: datetime, *, full: bool) -> None:
    global _backfilled_at, _full_look_at
    if _backfilled_at is None or at > _backfilled_at:  # (a slower pass that started earlier ends later)
        _backfilled_at = at
    if full and (_full_look_at is None or at > _full_look_at):
        _full_look_at = at


def resend_due(step: store.OpenStep, *, now: datetime, stale_s: float) -> bool:
    """Whether a queued or running step's message should be re-sent now. A queued one: when it has waited
    ``due``. A running one only once its worker's lease expired (a recursive step waiting on its child
    has none): at once after each expiry, then backing off like a queued one while no worker claims it."""
    if step.status == StepStatus.QUEUED:
        return step.queued_at is not None and due(step.queued_at, step.resends, stale_s, now)
    if step.child_job_id is not None or step.lease_expires_at is None or step.lease_expires_at >= now:
        return False
    if step.resent_at is None or step.resent_at < step.lease_expires_at:
        return True  # not re-sent since this lease expired
    # Wait as long as the lease had been expired at the last re-send (at least stale_s, at most 64x): the
    # waits double from this expiry on, whatever the step's earlier re-sends.
    since_expiry = (step.resent_at - step.lease_expires_at).total_seconds()
    wait = min(max(stale_s, since_expiry), stale_s * 2**MAX_BACKOFF_DOUBLINGS)
    return now - step.resent_at >= timedelta(seconds=wait)


def due(last_sent: datetime, resends: int, stale_s: float, now: datetime) -> bool:
    """Whether a message sent at ``last_sent`` and already re-sent ``resends`` times should go again.

    The wait doubles with each re-send (capped at 64x): a message lost outright is re-sent after
    ``stale_s``, while one that is only waiting behind a long backlog is duplicated a logarithmic
    number of times, not once per pass (duplicates are harmless, a flooded queue is not).
    """
    return now - last_sent >= timedelta(seconds=stale_s * 2 ** min(resends, MAX_BACKOFF_DOUBLINGS))
