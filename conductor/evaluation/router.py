"""The lookup-table baseline: for each category, the single agent that scored best on the fit split.

This is the comparison the research never made: if a table "category -> best agent" matches the
conductor, the conductor's planning buys nothing on that data.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from conductor.evaluation.dataset import Item
from conductor.evaluation.results import JobResult
from conductor.evaluation.stats import mean


@dataclass(frozen=True)
class RouteChoice:
    agent: str
    accuracy: float
    """On the fit split, for this category."""
    n: int


@dataclass(frozen=True)
class Router:
    table: dict[str, RouteChoice]
    default: RouteChoice
    """For a category the fit split never saw: the agent best over all fit items."""

    def agent_for(self, category: str) -> str:
        return self.table.get(category, self.default).agent


def split_items(items: list[Item], fit_fraction: float) -> tuple[list[Item], list[Item]]:
    """(fit, eval), split per category so both halves see every category; deterministic: the first
    ``fit_fraction`` of each category's items in file order are the fit split."""
    by_category: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        by_category[item.category].append(item)
    fit_ids: set[str] = set()
    for group in by_category.values():
        count = round(len(group) * fit_fraction)
        if len(group) > 1:
            count = min(max(count, 1), len(group) - 1)  # each side keeps at least one item
        fit_ids.update(item.id for item in group[:count])
    return [i for i in items if i.id in fit_ids], [i for i in items if i.id not in fit_ids]


def fit_router(results: list[JobResult], agents: list[str]) -> Router:
    """Fits on ``single:AGENT`` results. Ties go to the cheaper agent, then to the earlier in the pool."""
    per: dict[tuple[str, str], list[JobResult]] = defaultdict(list)
    for r in results:
        per[(r.category, r.planner.removeprefix("single:"))].append(r)
    categories = sorted({r.category for r in results})
    table = {c: _best([(a, per[(c, a)]) for a in agents]) for c in categories}
    overall = _best([(a, [r for c in categories for r in per[(c, a)]]) for a in agents])
    return Router(table=table, default=overall)


def _best(candidates: list[tuple[str, list[JobResult]]]) -> RouteChoice:
    def key(entry: tuple[int, tuple[str, list[JobResult]]]) -> tuple[float, float, int]:
        order, (_, rs) = entry
        return (-mean([float(r.correct) for r in rs]), mean([r.cost_usd for r in rs]), order)

    _, (agent, rs) = min(enumerate(candidates), key=key)
    return RouteChoice(agent=agent, accuracy=mean([float(r.correct) for r in rs]), n=len(rs))
