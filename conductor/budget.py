"""Per-job limits checked before every step call: the deadline and the token and cost budgets.

A step that would exceed a budget fails clearly instead of running: its output budget is capped to
what is left, and when nothing is left (or its prompt alone would not fit) it is refused. "What is
left" counts what finished steps spent *and* what running steps hold reserved: a step reserves its
prompt plus its whole output allowance when it is claimed (under its job's row lock) and releases
the unused part when its outcome is recorded, so parallel steps cannot together pass the budget. A
recursive step reserves its child job's whole allowance, an equal share of what is left among the
job's steps not yet started, and the child spends within it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from conductor.errors import BudgetExceeded, DeadlineExceeded
from conductor.pool.config import Price

__all__ = ["BudgetExceeded", "DeadlineExceeded", "Spent", "allowed_output_tokens", "check_deadline",
           "child_limits", "deadline_of", "estimate_tokens"]


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
    limits: dict[str, Any], spent: Spent, *, prompt_tokens: int, max_tokens: int, price: Price,
    cache_write_tokens: int = 0, cache_write_1h: bool = False,
) -> int:
    """The output tokens this step may use, or BudgetExceeded when the budget has no room for it.
    ``cache_write_tokens``: of the prompt, how much the call may write to the provider's cache;
    ``cache_write_1h``: to its one-hour cache, at that price."""
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
        prompt_usd = _prompt_bound(price, prompt_tokens, 0, cache_write_tokens, cache_write_1h)
        left_usd = float(cost_budget) - spent.cost_usd - prompt_usd
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


@dataclass(frozen=True)
class Reservation:
    tokens: int
    cost_usd: float


def step_reservation(limits: dict[str, Any], *, prompt_tokens: int, max_tokens: int, price: Price,
                     cache_write_tokens: int = 0, cache_write_1h: bool = False) -> Reservation:
    """What a step holds against its job's budgets while it runs: its prompt (the part it may write to the
    provider's cache, ``cache_write_tokens``, at the write price: the one-hour cache's with
    ``cache_write_1h``) and its whole allowance."""
    return Reservation(
        tokens=prompt_tokens + max_tokens if limits.get("max_tokens") is not None else 0,
        cost_usd=(_prompt_bound(price, prompt_tokens, max_tokens, cache_write_tokens, cache_write_1h)
                  if limits.get("max_cost_usd") is not None else 0.0),
    )


def _prompt_bound(price: Price, prompt_tokens: int, output_tokens: int, cache_write_tokens: int,
                  cache_write_1h: bool = False) -> float:
    """The most a call of this prompt and output can cost: the tokens it may write to the cache at the highest
    of the input price and the write prices it may be billed (a call asking for the one-hour cache may be
    billed either), the rest at the input price (a read costs no more than input)."""
    plain = price.cost(prompt_tokens, output_tokens)
    if cache_write_tokens <= 0:
        return plain
    bounds = [plain, price.cost(prompt_tokens, output_tokens, cache_write_tokens=cache_write_tokens)]
    if cache_write_1h:
        bounds.append(price.cost(prompt_tokens, output_tokens, cache_write_tokens=cache_write_tokens,
                                 cache_write_1h_tokens=cache_write_tokens))
    return max(bounds)


def child_reservation(limits: dict[str, Any]) -> Reservation:
    """What a recursive step holds: its child job's whole allowance (``child_limits``)."""
    return Reservation(tokens=int(limits.get("max_tokens") or 0), cost_usd=float(limits.get("max_cost_usd") or 0.0))


def child_limits(
    limits: dict[str, Any], created_at: datetime, spent: Spent, now: datetime, *, shares: int = 1
) -> dict[str, Any]:
    """A recursive step's child job gets what is left of its parent's deadline, and of its budgets an
    equal share among ``shares`` steps not yet started (this one included), so a tree of jobs never
    spends more, or runs longer, than the request allowed, and parallel children cannot each take it all."""
    out = dict(limits)
    deadline = deadline_of(limits, created_at)
    if deadline is not None:
        out["deadline_s"] = max((deadline - now).total_seconds(), 0.001)
    if limits.get("max_tokens") is not None:
        left = int(limits["max_tokens"]) - spent.tokens
        if left < 1:
            raise BudgetExceeded(f"token budget {limits['max_tokens']} exhausted before this recursive step")
        out["max_tokens"] = max(1, left // max(1, shares))
    if limits.get("max_cost_usd") is not None:
        left_usd = float(limits["max_cost_usd"]) - spent.cost_usd
        if left_usd <= 0:
            raise BudgetExceeded(f"cost budget ${limits['max_cost_usd']} exhausted before this recursive step")
        out["max_cost_usd"] = left_usd / max(1, shares)
    return out
