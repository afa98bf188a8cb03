"""The reconciler re-sends a waiting message a logarithmic number of times, not once per pass."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from conductor.reconcile import due

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
