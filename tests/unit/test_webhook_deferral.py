"""How long a delivery parked for its tenant's cap of attempts in flight waits at most before it comes back
by itself (store.webhooks.park_for); it is normally woken sooner, when one of the tenant's attempts ends."""

from __future__ import annotations

import pytest

from conductor.store.webhooks import park_for


def test_the_wait_is_the_time_the_tenants_waiting_deliveries_take_at_its_cap() -> None:
    # 1,000 waiting, 4 at a time, each attempt up to 15 s: about 3,750 s before this one's turn
    assert park_for(waiting=1000, cap=4, attempt_s=15.0, jitter=1.0) == pytest.approx(3750.0)
    # however many wait, they come back at about cap per attempt_s at most
    for waiting in (100, 1000, 10_000):
        assert waiting / park_for(waiting=waiting, cap=4, attempt_s=15.0, jitter=1.0) == pytest.approx(4 / 15)


def test_a_few_waiting_come_back_after_two_attempts_time_at_least() -> None:
    assert park_for(waiting=3, cap=4, attempt_s=15.0, jitter=1.0) == pytest.approx(30.0)
    assert park_for(waiting=0, cap=4, attempt_s=15.0, jitter=1.0) == pytest.approx(30.0)


@pytest.mark.parametrize("jitter", [0.5, 1.5])
def test_jitter_spreads_the_wait(jitter: float) -> None:
    assert park_for(waiting=100, cap=4, attempt_s=15.0, jitter=jitter) == pytest.approx(375.0 * jitter)
