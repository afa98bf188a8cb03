"""Per-job limits checked before every step call: the deadline and the token and cost budgets.

A step that would exceed a budget fails clearly instead of running: its output budget is capped to
what is left, and when nothing is left (or its prompt alone would not fit) it is refused. Usage of
steps still running in parallel is not yet known, so two parallel steps may together overshoot by
at most one step's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from conductor.pool.config import Price
from conductor.pool.errors import FatalError


class BudgetExceeded(FatalError):
    """The job's max_tokens or max_cost_usd leaves no room for this step."""


class DeadlineExceeded(FatalError):
    """The job's deadline_s has passed."""


def estimate_tokens(text: str) -> int:
    """About four characters per token: the estimate used before a call (providers report exact usage)."""
    return max(1, (len(text) + 3) // 4)


@dataclass(frozen=True)
class Spent:
    tokens: int
    cost_usd: float


def deadline_of(limits: dict[str, Any], created_at: datetime) -> datetime | None:
    seconds = limits.get("deadline_s")
    return created_at + timedelta(seconds=float(seconds)) if seconds else None


def check_deadline(limits: dict[str, Any], created_at: datetime, now: datetime) -> None:
    deadline = deadline_of(limits, created_at)
    if deadline is not None and now >= deadline:
        raise DeadlineExceeded(f"the job's deadline of {limits['deadline_s']} s has passed")


def allowed_output_tokens(
    limits: dict[str, Any], spent: Spent, *, prompt_tokens: int, max_tokens: int, price: Price
) -> int:
    """The output tokens this step may use, or BudgetExceeded when the budget has no room for it."""
    allowed = max_tokens
    token_budget = limits.get("max_tokens")
    if token_budget is not None:
        left = int(token_budget) - spent.tokens - prompt_tokens
        if left < 1:
            raise BudgetExceeded(
                f"token budget {token_budget} exhausted: {spent.tokens} spent, this step's prompt needs "
                f"about {prompt_tokens}"
            )
        allowed = min(allowed, left)
    cost_budget = limits.get("max_cost_usd")
    if cost_budget is not None:
        left_usd = float(cost_budget) - spent.cost_usd - price.cost(prompt_tokens, 0)
        if left_usd <= 0:
            raise BudgetExceeded(
                f"cost budget ${cost_budget} exhausted: ${spent.cost_usd:.6f} spent before this step"
            )
        if price.output_per_mtok > 0:
            affordable = int(left_usd * 1_000_000 / price.output_per_mtok)
            if affordable < 1:
                raise BudgetExceeded(f"cost budget ${cost_budget} leaves no room for this step's output")
            allowed = min(allowed, affordable)
    return allowed


def child_limits(limits: dict[str, Any], created_at: datetime, spent: Spent, now: datetime) -> dict[str, Any]:
    """A recursive step's child job gets what is left of its parent's deadline and budgets, so a tree
    of jobs never spends more, or runs longer, than the request allowed."""
    out = dict(limits)
    deadline = deadline_of(limits, created_at)
    if deadline is not None:
        out["deadline_s"] = max((deadline - now).total_seconds(), 0.001)
    if limits.get("max_tokens") is not None:
        left = int(limits["max_tokens"]) - spent.tokens
        if left < 1:
            raise BudgetExceeded(f"token budget {limits['max_tokens']} exhausted before this recursive step")
        out["max_tokens"] = left
    if limits.get("max_cost_usd") is not None:
        left_usd = float(limits["max_cost_usd"]) - spent.cost_usd
        if left_usd <= 0:
            raise BudgetExceeded(f"cost budget ${limits['max_cost_usd']} exhausted before this recursive step")
        out["max_cost_usd"] = left_usd
    return out
