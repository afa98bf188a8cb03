"""Results -> the tables ``conductor eval`` prints and writes (Markdown, plus JSON for machines)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conductor.evaluation.results import JobResult
from conductor.evaluation.router import Router
from conductor.evaluation.stats import mean, wilson_interval
from conductor.statuses import JobStatus

RESULTS_FILE = "results.jsonl"
TABLE_FILE = "table.md"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class Row:
    planner: str
    category: str
    n: int
    """Jobs."""
    items: int
    """Distinct items: with several samples per item, the confidence interval is over these (samples of
    one item are not independent draws)."""
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float
    mean_reward: float
    tokens_per_job: float
    cost_per_job_usd: float
    latency_s: float
    steps_per_job: float
    invalid_workflows: int
    failed_jobs: int


def summarize(results: list[JobResult], *, by_category: bool, planners: list[str] | None = None) -> list[Row]:
    """Rows in ``planners`` order (else first-seen order), categories alphabetical."""
    groups: dict[tuple[str, str], list[JobResult]] = defaultdict(list)
    for r in results:
        groups[(r.planner, r.category if by_category else "all")].append(r)
    order = {p: i for i, p in enumerate(dict.fromkeys([*(planners or []), *(r.planner for r in results)]))}
    rows = [_row(planner, category, rs) for (planner, category), rs in groups.items()]
    return sorted(rows, key=lambda row: (order[row.planner], row.category))


def _row(planner: str, category: str, rs: list[JobResult]) -> Row:
    correct = sum(r.correct for r in rs)
    per_item: dict[str, list[float]] = defaultdict(list)
    for r in rs:
        per_item[r.item_id].append(float(r.correct))
    # each item counts once, at its share of correct samples: k samples of one item do not narrow the
    # interval k times (with one sample per item this is the plain interval over jobs)
    low, high = wilson_interval(sum(mean(v) for v in per_item.values()), len(per_item))
    return Row(
        planner=planner,
        category=category,
        n=len(rs),
        items=len(per_item),
        correct=correct,
        accuracy=correct / len(rs),
        ci_low=low,
        ci_high=high,
        mean_reward=mean([r.reward for r in rs]),
        tokens_per_job=mean([float(r.tokens) for r in rs]),
        cost_per_job_usd=mean([r.cost_usd for r in rs]),
        latency_s=mean([r.latency_s for r in rs]),
        steps_per_job=mean([float(r.steps) for r in rs]),
        invalid_workflows=sum(1 for r in rs if r.format_valid is False),
        failed_jobs=sum(1 for r in rs if r.status != JobStatus.SUCCEEDED),
    )


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _n(row: Row) -> str:
    return str(row.n) if row.items == row.n else f"{row.n} ({row.items} items)"


def planner_table(rows: list[Row]) -> str:
    lines = [
        "| planner | n | accuracy % (95% CI) | mean reward | tokens/job | cost/job $ | latency s | steps/job "
        "| invalid wf | failed |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.planner} | {_n(r)} | {_pct(r.accuracy)} ({_pct(r.ci_low)}-{_pct(r.ci_high)}) | "
            f"{r.mean_reward:.2f} | {r.tokens_per_job:.0f} | {r.cost_per_job_usd:.6f} | {r.latency_s:.1f} | "
            f"{r.steps_per_job:.1f} | {r.invalid_workflows} | {r.failed_jobs} |"
        )
    return "\n".join(lines)


def category_table(rows: list[Row]) -> str:
    categories = sorted({r.category for r in rows})
    planners = list(dict.fromkeys(r.planner for r in rows))
    cell = {(r.planner, r.category): r for r in rows}
    lines = ["| planner | " + " | ".join(categories) + " |", "|---|" + "---|" * len(categories)]
    for p in planners:
        cells = []
        for c in categories:
            r = cell.get((p, c))
            cells.append(
                f"{_pct(r.accuracy)} ({_pct(r.ci_low)}-{_pct(r.ci_high)}, n={_n(r)})" if r else "n/a"
            )
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def router_table(router: Router) -> str:
    lines = ["| category | agent | fit accuracy % | fit n |", "|---|---|---:|---:|"]
    for category, choice in sorted(router.table.items()):
        lines.append(f"| {category} | {choice.agent} | {_pct(choice.accuracy)} | {choice.n} |")
    lines.append(f"| (unseen) | {router.default.agent} | {_pct(router.default.accuracy)} | {router.default.n} |")
    return "\n".join(lines)


def render(
    results: list[JobResult], *, title: str, router: Router | None, notes: list[str], planners: list[str]
) -> str:
    evaluated = [r for r in results if r.phase == "eval"]
    by_planner = summarize(evaluated, by_category=False, planners=planners)
    by_category = summarize(evaluated, by_category=True, planners=planners)
    parts = [f"## {title}", "", *notes, "", "### By planner", "", planner_table(by_planner)]
    parts += ["", "### Accuracy % by category (95% CI)", "", category_table(by_category)]
    if router is not None:
        parts += ["", "### Router (lookup table fitted on the fit split)", "", router_table(router)]
    return "\n".join(parts) + "\n"


def write(
    directory: Path,
    results: list[JobResult],
    table: str,
    *,
    meta: dict[str, Any],
    router: Router | None,
    planners: list[str],
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / RESULTS_FILE).open("w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r.as_json(), ensure_ascii=False) + "\n")
    (directory / TABLE_FILE).write_text(table, encoding="utf-8")
    evaluated = [r for r in results if r.phase == "eval"]
    summary = {
        **meta,
        "by_planner": [asdict(r) for r in summarize(evaluated, by_category=False, planners=planners)],
        "by_planner_and_category": [asdict(r) for r in summarize(evaluated, by_category=True, planners=planners)],
        "router": None
        if router is None
        else {"table": {c: asdict(v) for c, v in router.table.items()}, "default": asdict(router.default)},
    }
    (directory / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
