"""The reconciler re-sends a waiting message a logarithmic number of times, not once per pass: a queued
step's, and a running step's whose worker died and that no worker claims."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from conductor.reconcile import due, resend_due
from conductor.store.jobs import OpenStep

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_first_resend_after_the_stale_period_then_doubling() -> None:
    assert not due(T0, 0, 30, T0 + timedelta(seconds=29))
    assert due(T0, 0, 30, T0 + timedelta(seconds=30))
    assert not due(T0, 1, 30, T0 + timedelta(seconds=59))
    assert due(T0, 1, 30, T0 + timedelta(seconds=60))
    assert due(T0, 3, 30, T0 + timedelta(seconds=240)) and not due(T0, 3, 30, T0 + timedelta(seconds=239))


def test_backoff_is_capped() -> None:
    assert due(T0, 50, 30, T0 + timedelta(seconds=30 * 64))


def test_a_ten_minute_backlog_costs_few_duplicates() -> None:
    sent, resends, now = T0, 0, T0
    while now < T0 + timedelta(minutes=10):
        now += timedelta(seconds=15)  # one reconcile pass every 15 s
        if due(sent, resends, 30, now):
            sent, resends = now, resends + 1
    assert resends == 4  # at 30 s, 90 s, 210 s, 450 s -- not 20 (one per 30 s)


def step(status: str = "running", *, lease: datetime | None = T0, resent: datetime | None = None,
         resends: int = 0, child: str | None = None, queued: datetime | None = T0) -> OpenStep:
    return OpenStep(id=1, job_id="j", index=0, agent="a", status=status, queued_at=queued, resends=resends,
                    lease_expires_at=lease, resent_at=resent, child_job_id=child)


def test_a_dead_workers_step_is_re_sent_at_once_then_backs_off() -> None:
    later = T0 + timedelta(seconds=1)
    assert not resend_due(step(lease=T0 + timedelta(seconds=5)), now=later, stale_s=30)  # its worker lives
    assert resend_due(step(), now=later, stale_s=30)  # the lease expired: at once
    # Re-sent at `later` and still unclaimed: the next re-send waits 30 s from then, the one after that as
    # long as the lease had been expired at the last re-send (the waits double), however often the step
    # was re-sent before this expiry (here 6 times, while it waited queued behind a backlog).
    waiting = step(resent=later, resends=7)
    assert not resend_due(waiting, now=later + timedelta(seconds=29), stale_s=30)
    assert resend_due(waiting, now=later + timedelta(seconds=30), stale_s=30)
    second = later + timedelta(seconds=30)
    third = second + timedelta(seconds=31)  # waited 31 s: the lease had been expired 31 s at `second`
    assert not resend_due(step(resent=second, resends=8), now=third - timedelta(seconds=1), stale_s=30)
    assert resend_due(step(resent=second, resends=8), now=third, stale_s=30)
    long_ago = step(resent=T0 + timedelta(hours=5), resends=20)  # capped at 64 x 30 s
    assert resend_due(long_ago, now=T0 + timedelta(hours=5, seconds=30 * 64), stale_s=30)
    # Claimed again and that worker died too (a newer lease, expired): at once again.
    again = step(lease=later + timedelta(seconds=300), resent=later, resends=1)
    assert resend_due(again, now=later + timedelta(seconds=301), stale_s=30)
    # A recursive step waits on its child job: never re-sent.
    assert not resend_due(step(child="child-job"), now=later, stale_s=30)


def test_a_queued_step_is_re_sent_when_it_has_waited() -> None:
    assert not resend_due(step("queued", lease=None), now=T0 + timedelta(seconds=29), stale_s=30)
    assert resend_due(step("queued", lease=None), now=T0 + timedelta(seconds=30), stale_s=30)
