"""Deadline and budget arithmetic: what a step may spend, and what a recursive child inherits."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from conductor.budget import BudgetExceeded, Spent, allowed_output_tokens, check_deadline, child_limits
from conductor.pool.config import Price

T0 = datetime(2026, 1, 1, tzinfo=UTC)
FREE = Price()


def test_output_is_capped_to_the_token_budget_left() -> None:
    limits = {"max_tokens": 1000}
    assert allowed_output_tokens(limits, Spent(600, 0), prompt_tokens=100, max_tokens=4096, price=FREE) == 300
    with pytest.raises(BudgetExceeded, match="600 spent"):
        allowed_output_tokens(limits, Spent(600, 0), prompt_tokens=400, max_tokens=4096, price=FREE)


def test_output_is_capped_to_the_cost_budget_left() -> None:
    price = Price(input_per_mtok=1.0, output_per_mtok=10.0)
    allowed = allowed_output_tokens({"max_cost_usd": 0.01}, Spent(0, 0.005), prompt_tokens=1000, max_tokens=4096,
                                    price=price)
    assert allowed == 400  # $0.004 left after the $0.001 prompt buys 400 output tokens at $10/M
    with pytest.raises(BudgetExceeded):
        allowed_output_tokens({"max_cost_usd": 0.01}, Spent(0, 0.01), prompt_tokens=1, max_tokens=10, price=price)


def test_no_limits_means_the_agents_own_cap() -> None:
    assert allowed_output_tokens({}, Spent(10**9, 10**6), prompt_tokens=10, max_tokens=77, price=FREE) == 77


def test_deadline() -> None:
    check_deadline({"deadline_s": 10}, T0, T0 + timedelta(seconds=9))
    check_deadline({}, T0, T0 + timedelta(days=9))
    with pytest.raises(Exception, match="deadline of 10 s"):
        check_deadline({"deadline_s": 10}, T0, T0 + timedelta(seconds=10))


def test_a_child_inherits_only_what_is_left() -> None:
    limits = {"max_tokens": 1000, "max_cost_usd": 1.0, "deadline_s": 60, "max_steps": 3}
    out = child_limits(limits, T0, Spent(250, 0.4), T0 + timedelta(seconds=45))
    assert out == {"max_tokens": 750, "max_cost_usd": pytest.approx(0.6), "deadline_s": 15.0, "max_steps": 3}
    with pytest.raises(BudgetExceeded):
        child_limits(limits, T0, Spent(1000, 0), T0)


def test_a_jobs_budgets_are_finite_and_fit_the_stores_counters() -> None:
    from pydantic import ValidationError

    from conductor.submission import MAX_LIMIT_COST_USD, MAX_LIMIT_TOKENS, Limits

    at_most = Limits.model_validate({"max_cost_usd": MAX_LIMIT_COST_USD, "max_tokens": MAX_LIMIT_TOKENS})
    assert at_most.max_tokens is not None and at_most.max_tokens < 2**31  # a child's reservation fits int32
    for bad in ({"max_cost_usd": "inf"}, {"max_cost_usd": float("inf")}, {"max_cost_usd": MAX_LIMIT_COST_USD * 2},
                {"max_tokens": 3_000_000_000}, {"max_tokens": 0}):
        with pytest.raises(ValidationError):
            Limits.model_validate(bad)
