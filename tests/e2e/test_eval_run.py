"""``conductor eval`` and ``export-rollouts`` as a user runs them, on the shipped dataset, with simulated
specialists whose skills are known (tests/pools/eval_sim.yaml): mathbot answers arithmetic, sciencebot
science, codebot code, each with the dataset's reference answers, and "I do not know." otherwise.

So every expected score follows from the dataset alone, and a planner that routes each category to
its specialist must beat any single agent: that is what the assertions check, from the files the
command writes and from the rows it stored.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conductor.evaluation.dataset import load_dataset
from conductor.evaluation.router import split_items
from conductor.evaluation.stats import wilson_interval
from tests.e2e.test_embedded_run import conductor

POOL = Path(__file__).parents[1] / "pools" / "eval_sim.yaml"
SHIPPED = load_dataset("shipped")
SPECIALIST = {"arithmetic": "mathbot", "science": "sciencebot", "code": "codebot"}
UNPARSEABLE, MISROUTED = "arith-20", "sci-15"  # scripted in the pool file


@pytest.fixture(scope="module")
def eval_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("eval")
    out = base / "out"
    result = conductor(
        "eval", "shipped", "--pool", str(POOL), "--planners", "conductor,single:mathbot,router,fanout",
        "--data-dir", str(base / "data"), "--out", str(out), cwd=base, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {"result": result, "out": out, "data": base / "data", "results": results,
            "summary": json.loads((out / "summary.json").read_text())}


def by_planner(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["planner"]: row for row in run["summary"]["by_planner"]}


def test_every_item_of_the_held_out_split_ran_once_per_planner(eval_run: dict[str, Any]) -> None:
    fit, held_out = split_items(SHIPPED, 0.5)
    evaluated = [r for r in eval_run["results"] if r["phase"] == "eval"]
    assert Counter(r["planner"] for r in evaluated) == {p: len(held_out) for p in
                                                        ["conductor", "single:mathbot", "router", "fanout"]}
    assert {r["item_id"] for r in evaluated} == {i.id for i in held_out}
    fitted = [r for r in eval_run["results"] if r["phase"] == "fit"]
    assert {(r["item_id"], r["planner"]) for r in fitted} == {
        (i.id, f"single:{a}") for i in fit for a in SPECIALIST.values()
    }
    assert all(r["status"] == "succeeded" for r in eval_run["results"])


def test_the_router_learns_category_to_specialist_and_scores_everything(eval_run: dict[str, Any]) -> None:
    table = eval_run["summary"]["router"]["table"]
    assert {c: choice["agent"] for c, choice in table.items()} == SPECIALIST
    router = [r for r in eval_run["results"] if r["planner"] == "router"]
    assert all(r["agents"] == [SPECIALIST[r["category"]]] for r in router)
    assert by_planner(eval_run)["router"]["accuracy"] == 1.0


def test_a_single_agent_scores_exactly_its_share_of_the_data(eval_run: dict[str, Any]) -> None:
    _, held_out = split_items(SHIPPED, 0.5)
    arithmetic = sum(i.category == "arithmetic" for i in held_out)
    row = by_planner(eval_run)["single:mathbot"]
    assert row["n"] == len(held_out)
    assert row["correct"] == arithmetic
    low, high = wilson_interval(arithmetic, len(held_out))
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((low, high))
    # a valid workflow with a wrong answer earns 0.5, a correct one 1
    assert row["mean_reward"] == pytest.approx((arithmetic + 0.5 * (len(held_out) - arithmetic)) / len(held_out))
    # fanout's aggregator is the pool's first worker (mathbot): no better than it alone
    assert by_planner(eval_run)["fanout"]["correct"] == arithmetic


def test_the_routing_conductor_beats_every_single_agent_and_rewards_follow_grpo(eval_run: dict[str, Any]) -> None:
    rows = by_planner(eval_run)
    _, held_out = split_items(SHIPPED, 0.5)
    conductor_rows = {r["item_id"]: r for r in eval_run["results"] if r["planner"] == "conductor"}
    # The unparseable plan fell back to template:single (mathbot): right answer, yet reward 0.
    assert conductor_rows[UNPARSEABLE]["format_valid"] is False
    assert conductor_rows[UNPARSEABLE]["correct"] is True
    assert conductor_rows[UNPARSEABLE]["reward"] == 0.0
    # The misrouted science item went to codebot: a valid workflow, a wrong answer.
    assert conductor_rows[MISROUTED]["agents"] == ["codebot"]
    assert (conductor_rows[MISROUTED]["correct"], conductor_rows[MISROUTED]["reward"]) == (False, 0.5)
    others = [r for i, r in conductor_rows.items() if i not in (UNPARSEABLE, MISROUTED)]
    assert all(r["correct"] and r["reward"] == 1.0 and r["format_valid"] for r in others)
    assert rows["conductor"]["correct"] == len(held_out) - 1
    assert rows["conductor"]["invalid_workflows"] == 1
    assert rows["conductor"]["accuracy"] > rows["single:mathbot"]["accuracy"]
    assert rows["conductor"]["ci_low"] > rows["single:mathbot"]["ci_high"]  # not a fluke of the sample


def test_rewards_are_stored_on_the_job_rows(eval_run: dict[str, Any]) -> None:
    con = sqlite3.connect(eval_run["data"] / "conductor.sqlite3")
    try:
        stored = dict(con.execute("SELECT id, reward FROM job WHERE eval_run IS NOT NULL").fetchall())
    finally:
        con.close()
    assert stored == {r["job_id"]: r["reward"] for r in eval_run["results"]}


def test_the_table_is_printed_and_written_with_progress_on_stderr(eval_run: dict[str, Any]) -> None:
    result = eval_run["result"]
    table = (eval_run["out"] / "table.md").read_text()
    assert result.stdout == table
    assert "| router | 33 | 100.0 (89.6-100.0) | 1.00 |" in table
    assert "### Accuracy % by category (95% CI)" in table
    assert "| arithmetic | mathbot | 100.0 |" in table
    assert "[##############################] 99/99 fit jobs 100%" in result.stderr
    assert "132/132 jobs 100%" in result.stderr


def test_export_rollouts_writes_grpo_groups(tmp_path: Path) -> None:
    dataset = tmp_path / "slice.jsonl"
    picked = [i for i in SHIPPED if i.id in (UNPARSEABLE, MISROUTED, "code-01")]
    dataset.write_text("".join(i.model_dump_json(exclude_none=True) + "\n" for i in picked))
    out = tmp_path / "rollouts.jsonl"
    result = conductor("export-rollouts", str(dataset), "--pool", str(POOL), "--samples", "3", "--temperature",
                       "1.0", "--data-dir", str(tmp_path / "data"), "--out", str(out), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 9
    assert [r["item_id"] for r in rows] == [i.id for i in picked for _ in range(3)]  # groups are contiguous
    assert len({r["prompt_id"] for r in rows}) == 3
    assert {r["item_id"]: r["reward"] for r in rows} == {UNPARSEABLE: 0.0, MISROUTED: 0.5, "code-01": 1.0}
    first = rows[0]
    assert [m["role"] for m in first["prompt"]] == ["system", "user"]
    assert picked[0].prompt in first["prompt"][1]["content"]
    assert first["completion"] == [{"role": "assistant", "content": "I would rather not plan this one."}]
    assert rows[-1]["completion"][0]["content"].startswith('{"model_ids": ["codebot"]')
    # the pool copy the jobs ran with samples the planner at the requested temperature
    con = sqlite3.connect(tmp_path / "data" / "conductor.sqlite3")
    try:
        configs = [json.loads(c) for (c,) in con.execute("SELECT pool_config FROM job WHERE eval_run IS NOT NULL")]
    finally:
        con.close()
    assert {c["agents"]["sim-conductor"]["temperature"] for c in configs} == {1.0}
