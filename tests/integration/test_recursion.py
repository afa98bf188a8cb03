"""The LLM conductor over the wire: an openai_compatible planner on loopback scripts a workflow whose
parallel group holds a recursive ``conductor`` step; the child job plans (depth-capped), runs, and its
answer flows into the parent."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.fakes.openai_server import FakeOpenAIServer
from tests.integration.harness import wait_terminal

PARENT_PLAN = {
    "model_ids": ["a", "conductor", "b"],
    "subtasks": ["Draft an answer.", "Independently re-plan and solve the task.", "Combine both answers."],
    "access_lists": [[], [], [0, 1]],
}
CHILD_PLAN_WITH_RECURSION = {"model_ids": ["conductor"], "subtasks": ["Recurse again."], "access_lists": [[]]}
CHILD_PLAN = {"model_ids": ["c"], "subtasks": ["Solve it carefully."], "access_lists": [[]]}


class ScriptedPlanner:
    """Answers the parent's planning call with PARENT_PLAN; the child's first call tries to recurse past
    the depth cap (and must be refused), its re-ask gets a valid plan."""

    def __init__(self) -> None:
        self.child_calls = 0
        self.lock = threading.Lock()

    def __call__(self, body: Any) -> str:
        first_user = next(m["content"] for m in body["messages"] if m["role"] == "user")
        if "Subtask from the parent workflow" not in first_user:
            return "<think>fan out, recurse on one branch</think>\n" + json.dumps(PARENT_PLAN)
        with self.lock:
            self.child_calls += 1
            n = self.child_calls
        # what the re-ask says is checked in the test body: an assert here would only drop the connection
        return json.dumps(CHILD_PLAN_WITH_RECURSION if n == 1 else CHILD_PLAN)


def write_pool(pools_dir: Path, name: str, base_url: str) -> None:
    pool = {
        "planner": "planner",
        "fallback": "template:single",
        "agents": {
            "planner": {"provider": "openai_compatible", "model": "conductor", "base_url": base_url,
                        "price": {"input_per_mtok": 0.5, "output_per_mtok": 1.0}},
            "a": {"provider": "sim", "options": {"latency_ms": 400}},
            "b": {"provider": "sim", "options": {"latency_ms": 50}},
            "c": {"provider": "sim", "options": {"latency_ms": 50}},
        },
    }
    (pools_dir / f"{name}.yaml").write_text(yaml.safe_dump(pool))


def test_recursive_step_inside_a_parallel_group(client: httpx.Client, pools_dir: Path) -> None:
    planner = ScriptedPlanner()
    with FakeOpenAIServer(reply=planner) as srv:
        write_pool(pools_dir, "recursive", srv.base_url)
        created = client.post(
            "/v1/jobs", json={"task": "Is 2^61-1 prime?", "pool": "recursive", "limits": {"max_depth": 1}}
        )
        assert created.status_code == 202, created.text
        job = wait_terminal(client, created.json()["id"])
        bodies = srv.bodies

    assert job["status"] == "succeeded", job
    assert job["workflow"]["source"] == "planner" and job["workflow"]["format_valid"] is True
    assert [s["agent"] for s in job["workflow"]["steps"]] == ["a", "conductor", "b"]

    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    recursive = steps[1]
    child = recursive["child"]
    assert recursive["child_job_id"] == child["job_id"] and child["depth"] == 1 and child["status"] == "succeeded"
    assert [s["agent"] for s in child["steps"]] == ["c"]
    assert recursive["output"] == child["answer"] == child["steps"][-1]["output"]
    assert child["answer"].startswith("[c] Solve it carefully.")

    # The child's answer reached the aggregator exactly as a (subtask, answer) turn.
    seen = [m["content"] for m in steps[2]["messages"] if m["role"] == "assistant"]
    assert seen == [steps[0]["output"], child["answer"]]
    assert job["answer"] == steps[2]["output"]

    # The recursive branch ran beside step 0, not after it.
    t = datetime.fromisoformat
    assert t(steps[0]["started_at"]) < t(recursive["finished_at"])
    assert t(recursive["started_at"]) < t(steps[0]["finished_at"])

    # Depth is enforced: the child planner was told it may not recurse, its schema excludes "conductor",
    # its first (recursive) answer was refused, and the re-ask produced the accepted plan.
    child_job = client.get(f"/v1/jobs/{child['job_id']}").json()
    assert child_job["parent"] == {"job_id": job["id"], "step_index": 1}
    assert child_job["workflow"]["planner_attempts"] == 2
    child_calls = [b for b in bodies if "Subtask from the parent workflow" in json.dumps(b)]
    assert len(child_calls) == 2
    assert 'Do not choose "conductor"' in child_calls[0]["messages"][-1]["content"]
    assert "recursion depth limit" in child_calls[1]["messages"][-1]["content"]  # the re-ask quotes the error
    enum = child_calls[0]["response_format"]["json_schema"]["schema"]["properties"]["model_ids"]["items"]["enum"]
    assert "conductor" not in enum and "c" in enum
    parent_call = next(b for b in bodies if b not in child_calls)
    assert "conductor" in parent_call["response_format"]["json_schema"]["schema"]["properties"]["model_ids"][
        "items"]["enum"]

    # Usage: the recursive step carries its child's tokens, the job the planner's too.
    assert recursive["usage"]["input_tokens"] == child_job["usage"]["input_tokens"] > 0
    assert job["usage"]["planner"]["calls"] == 1 and job["usage"]["planner"]["input_tokens"] > 0
    assert job["usage"]["input_tokens"] == job["usage"]["planner"]["input_tokens"] + sum(
        s["usage"]["input_tokens"] for s in steps
    )


def test_invalid_planner_output_falls_back_and_is_recorded(client: httpx.Client, pools_dir: Path) -> None:
    with FakeOpenAIServer(reply=lambda body: "model_ids = [0\nI cannot plan this") as srv:
        write_pool(pools_dir, "broken-planner", srv.base_url)
        created = client.post("/v1/jobs", json={"task": "anything", "pool": "broken-planner"})
        job = wait_terminal(client, created.json()["id"])
        assert len(srv.requests) == 2  # the first answer and one re-ask
    assert job["status"] == "succeeded"
    wf = job["workflow"]
    assert wf["source"] == "fallback" and wf["format_valid"] is False and wf["planner_error"]
    assert [s["agent"] for s in wf["steps"]] == ["a"]  # template:single over the pool's first worker


def test_cancelling_a_child_job_fails_its_parent_instead_of_stranding_it(client: httpx.Client, pools_dir: Path) -> None:
    pool = {"planner": "template:single", "agents": {"slow": {"provider": "sim", "options": {"latency_ms": 3000}}}}
    (pools_dir / "slow-child.yaml").write_text(yaml.safe_dump(pool))
    body = {"task": "t", "pool": "slow-child",
            "workflow": {"model_ids": ["conductor", "slow"], "subtasks": ["recurse", "after"],
                         "access_lists": [[], [0]]}}
    job_id = client.post("/v1/jobs", json=body).json()["id"]
    deadline = time.monotonic() + 30
    while True:
        steps = client.get(f"/v1/jobs/{job_id}/steps").json()["data"]
        if steps and (child_id := steps[0]["child_job_id"]):
            break
        assert time.monotonic() < deadline, "the recursive step never started its child"
        time.sleep(0.05)
    assert client.post(f"/v1/jobs/{child_id}/cancel").status_code == 202
    job = wait_terminal(client, job_id)
    assert job["status"] == "failed" and job["error"]["step"] == 0, job
    assert f"child job {child_id} failed: it was cancelled" in job["error"]["message"]
    steps = client.get(f"/v1/jobs/{job_id}/steps").json()["data"]
    assert [s["status"] for s in steps] == ["failed", "skipped"]


def test_an_unreachable_planner_falls_back_and_says_why(client: httpx.Client, pools_dir: Path) -> None:
    write_pool(pools_dir, "dead-planner", "http://127.0.0.1:1/v1")
    created = client.post("/v1/jobs", json={"task": "anything", "pool": "dead-planner"})
    job = wait_terminal(client, created.json()["id"])
    assert job["status"] == "succeeded", job
    wf = job["workflow"]
    assert wf["source"] == "fallback" and wf["format_valid"] is False
    assert "could not be used" in wf["planner_error"] and "template:single" in wf["planner_error"]
    assert wf["planner_attempts"] == 4  # the retry policy ran its course first
