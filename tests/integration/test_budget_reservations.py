"""Budgets hold across parallel work (real API, workers, Postgres): each step reserves its allowance
under its job's row lock before it runs and releases the unused part after, so five parallel recursive
steps never spend more than the job's max_cost_usd (each child job gets a share, not the whole
remainder), and parallel plain steps cannot overshoot either."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlmodel import select

from conductor.store.db import session_scope
from conductor.store.models import Job, Step
from tests.integration.harness import wait_terminal

PRICE_PER_MTOK = 1000.0  # $0.001 per token, in and out
BUDGET_USD = 1.0
FIVE = 5


@pytest.fixture(scope="module")
def priced_pool(pools_dir: Path) -> str:
    pool = {"planner": "template:single", "fallback": "template:single", "agents": {
        "pricey": {"provider": "sim", "options": {"latency_ms": 300, "reply": "x" * 2000},  # 500 tokens
                   "price": {"input_per_mtok": PRICE_PER_MTOK, "output_per_mtok": PRICE_PER_MTOK}}}}
    (pools_dir / "priced.yaml").write_text(yaml.safe_dump(pool))
    return "priced"


def tree_rows(root_id: str) -> tuple[list[Job], list[Step]]:
    with session_scope() as s:
        jobs = list(s.exec(select(Job).where((Job.id == root_id) | (Job.root_job_id == root_id))))
        steps = list(s.exec(select(Step).where(Step.job_id.in_([j.id for j in jobs]))))  # type: ignore[attr-defined]
        return jobs, steps


def parallel(agent: str) -> dict[str, Any]:
    return {"model_ids": [agent] * FIVE, "subtasks": [f"part {i}" for i in range(FIVE)],
            "access_lists": [[] for _ in range(FIVE)]}


def test_five_parallel_recursive_steps_never_spend_more_than_the_budget(client: httpx.Client, priced_pool: str) -> None:
    body = {"task": "t", "pool": priced_pool, "workflow": parallel("conductor"),
            "limits": {"max_cost_usd": BUDGET_USD, "max_depth": 1}}
    job = wait_terminal(client, client.post("/v1/jobs", json=body).json()["id"])

    jobs, steps = tree_rows(job["id"])
    children = [j for j in jobs if j.parent_job_id == job["id"]]
    assert len(children) == FIVE
    assert all(c.limits["max_cost_usd"] <= BUDGET_USD / FIVE + 1e-9 for c in children)  # a share each
    spent = sum(st.cost_usd for st in steps if st.agent != "conductor") + sum(j.planner_cost_usd for j in jobs)
    assert spent <= BUDGET_USD + 1e-9, (spent, job)
    assert job["usage"]["cost_usd"] <= BUDGET_USD + 1e-6
    assert spent > BUDGET_USD / 2  # the children really ran, each within its share (answers were cut short)
    assert job["status"] == "succeeded", job
    assert all(st.reserved_usd == 0 and st.reserved_tokens == 0 for st in steps)  # everything was released


def test_parallel_plain_steps_cannot_overshoot_the_budget(client: httpx.Client, priced_pool: str) -> None:
    body = {"task": "t", "pool": priced_pool, "workflow": parallel("pricey"),
            "limits": {"max_cost_usd": 0.3}}
    job = wait_terminal(client, client.post("/v1/jobs", json=body).json()["id"])
    # The job fails as soon as one step is refused; siblings still mid-call release their reservation
    # when they record their outcome, so wait for every step to end before reading the reservations.
    deadline = time.monotonic() + 60
    _, steps = tree_rows(job["id"])
    while any(st.status in ("queued", "running") for st in steps) and time.monotonic() < deadline:
        time.sleep(0.2)
        _, steps = tree_rows(job["id"])
    assert sum(st.cost_usd for st in steps) <= 0.3 + 1e-9, [(st.status, st.cost_usd) for st in steps]
    assert any(st.error_type == "budget_exceeded" for st in steps)  # refused while the others held the budget
    assert all(st.reserved_usd == 0 for st in steps), [(st.status, st.reserved_usd) for st in steps]
