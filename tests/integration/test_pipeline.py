"""The whole path over HTTP with real worker processes: submit -> plan -> dataflow -> Postgres -> poll."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import httpx
import pytest

from tests.integration.harness import wait_terminal

SHAPES: dict[str, dict[str, Any]] = {
    "single": {"model_ids": ["a"], "subtasks": ["answer directly"], "access_lists": [[]]},
    "fanout": {
        "model_ids": ["a", "b", "c", "d"],
        "subtasks": ["attempt one", "attempt two", "attempt three", "aggregate"],
        "access_lists": [[], [], [], "all"],
    },
    "pev": {
        "model_ids": ["a", "b", "c"],
        "subtasks": ["plan it", "execute the plan", "verify the result"],
        "access_lists": [[], [0], [0, 1]],
    },
    "diamond": {
        "model_ids": ["a", "b", "c", "d"],
        "subtasks": ["root", "left branch", "right branch", "join"],
        "access_lists": [[], [0], [0], [1, 2]],
    },
}
PARALLEL = {"fanout": [(0, 1), (0, 2), (1, 2)], "diamond": [(1, 2)]}


def _t(ts: str) -> datetime:
    return datetime.fromisoformat(ts)


def _overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _t(a["started_at"]) < _t(b["finished_at"]) and _t(b["started_at"]) < _t(a["finished_at"])


@pytest.mark.parametrize("shape", list(SHAPES))
def test_workflow_shapes_run_end_to_end(client: httpx.Client, shape: str) -> None:
    wf = SHAPES[shape]
    created = client.post("/v1/jobs", json={"task": f"shape {shape}", "workflow": wf})
    assert created.status_code == 202, created.text
    body = created.json()
    assert body["status"] == "queued" and body["links"]["self"] == f"/v1/jobs/{body['id']}"

    job = wait_terminal(client, body["id"])
    assert job["status"] == "succeeded", job
    steps = client.get(f"/v1/jobs/{body['id']}/steps").json()["data"]
    n = len(wf["model_ids"])
    assert [s["index"] for s in steps] == list(range(n))
    assert job["answer"] == steps[-1]["output"] == f"[{wf['model_ids'][-1]}] {wf['subtasks'][-1]}"
    assert job["workflow"]["source"] == "request"

    outputs = {s["index"]: s["output"] for s in steps}
    for s in steps:
        granted = list(range(s["index"])) if wf["access_lists"][s["index"]] == "all" else wf["access_lists"][s["index"]]
        assert s["access_list"] == granted
        seen = [m["content"] for m in s["messages"] if m["role"] == "assistant"]
        assert seen == [outputs[i] for i in granted], f"step {s['index']} saw {seen}"
        others = set(outputs.values()) - {outputs[i] for i in granted}
        text = "\n".join(m["content"] for m in s["messages"])
        assert not any(o in text for o in others if o != f"[{s['agent']}] {s['instruction']}")
        assert s["messages"][-1] == {"role": "user", "content": s["instruction"]}
        assert s["status"] == "succeeded" and len(s["attempts"]) == 1
        assert s["usage"]["input_tokens"] > 0 and s["usage"]["output_tokens"] > 0
        for dep in granted:
            assert _t(steps[dep]["finished_at"]) <= _t(s["started_at"]), f"{s['index']} started before {dep}"

    for i, j in PARALLEL.get(shape, []):
        assert _overlap(steps[i], steps[j]), f"steps {i} and {j} of {shape} did not overlap"
    assert job["usage"]["input_tokens"] == sum(s["usage"]["input_tokens"] for s in steps)
    assert job["usage"]["calls"] == n


def test_template_planner_fanout(client: httpx.Client) -> None:
    created = client.post("/v1/jobs", json={"task": "compare two sorting algorithms", "planner": "template:fanout"})
    job = wait_terminal(client, created.json()["id"])
    assert job["status"] == "succeeded"
    wf = job["workflow"]
    assert wf["source"] == "planner" and [s["access_list"] for s in wf["steps"]] == [[], [], [], [0, 1, 2]]
    assert job["answer"].startswith("[a] Compare the attempts above")


@pytest.mark.parametrize(
    ("body", "status", "loc"),
    [
        ({}, 422, ["body", "task"]),
        ({"task": ""}, 422, ["body", "task"]),
        ({"task": "x" * 100_001}, 413, ["body", "task"]),
        ({"task": "t", "workflow": {"model_ids": ["a"], "subtasks": ["s"]}}, 422, ["body", "workflow", "access_lists"]),
        (
            {"task": "t", "workflow": {"model_ids": ["zz"], "subtasks": ["s"], "access_lists": [[]]}},
            422,
            ["body", "workflow", "steps", 0, "agent"],
        ),
        (
            {"task": "t", "workflow": {"model_ids": ["a", "b"], "subtasks": ["s", "t"], "access_lists": [[1], []]}},
            422,
            ["body", "workflow", "steps", 0, "access_list", 0],
        ),
        ({"task": "t", "pool": "no-such-pool"}, 422, ["body", "pool"]),
        ({"task": "t", "pool": "research"}, 422, ["body", "pool"]),  # shipped, but not published to tenants
        ({"task": "t", "pool": "../pools/sim"}, 422, ["body", "pool"]),
        ({"task": "t", "webhook_url": "http://169.254.169.254/latest/meta-data/"}, 422, ["body", "webhook_url"]),
        ({"task": "t", "webhook_url": "http://10.0.0.1/hook"}, 422, ["body", "webhook_url"]),
        ({"task": "t", "webhook_url": "ftp://example.com/hook"}, 422, ["body", "webhook_url"]),
        ({"task": "t", "planner": "template:nope"}, 422, ["body", "planner"]),
        ({"task": "t", "surprise": 1}, 422, ["body", "surprise"]),
    ],
)
def test_bad_input_is_a_problem_with_a_field_reason(
    client: httpx.Client, body: dict[str, Any], status: int, loc: list[Any]
) -> None:
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["status"] == status and problem["title"] and problem["detail"]
    assert loc in [e["loc"] for e in problem["errors"]], problem


def test_unknown_job_is_404_problem(client: httpx.Client) -> None:
    r = client.get("/v1/jobs/does-not-exist")
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/problem+json")
    assert client.get("/v1/jobs/does-not-exist/steps").status_code == 404


def test_missing_or_wrong_key_is_401(api: str) -> None:
    assert httpx.get(f"{api}/v1/jobs/x").status_code == 401
    r = httpx.get(f"{api}/v1/jobs/x", headers={"Authorization": "Bearer cq_wrong"})
    assert r.status_code == 401 and r.json()["title"] == "Unauthorized"
