"""How long a delivery put off for its tenant's cap of attempts in flight waits (store.webhooks.defer_for)."""

from __future__ import annotations

import pytest

from conductor.store.webhooks import DEFER_FIRST_S, defer_for


def test_the_wait_doubles_with_each_deferral_of_the_delivery() -> None:
    waits = [defer_for(n, waiting=10_000, cap=4, attempt_s=15.0, jitter=1.0) for n in range(6)]
    assert waits == [DEFER_FIRST_S * 2**n for n in range(6)]


def test_the_wait_stops_at_the_time_the_tenants_waiting_deliveries_take_at_its_cap() -> None:
    # 1,000 waiting, 4 at a time, each attempt up to 15 s: about 3,750 s before this one's turn
    assert defer_for(40, waiting=1000, cap=4, attempt_s=15.0, jitter=1.0) == pytest.approx(3750.0)
    # a few waiting: at least two attempts' time, so it does not come back before a slot can have freed
    assert defer_for(40, waiting=3, cap=4, attempt_s=15.0, jitter=1.0) == pytest.approx(30.0)


@pytest.mark.parametrize("jitter", [0.5, 1.5])
def test_jitter_spreads_the_wait(jitter: float) -> None:
    assert defer_for(2, waiting=100, cap=4, attempt_s=15.0, jitter=jitter) == pytest.approx(4.0 * jitter)
    assert defer_for(10_000, waiting=100, cap=4, attempt_s=15.0, jitter=jitter) == pytest.approx(375.0 * jitter)
