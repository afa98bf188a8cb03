"""Cached input and reasoning tokens, end to end: the planner and the workers are openai_compatible agents
on a loopback server that reports OpenAI's ``prompt_tokens_details.cached_tokens`` and
``completion_tokens_details.reasoning_tokens``; the Celery workers record them per step, a recursive
step carries its child job's, the job sums them with the planner's, and cached input is priced at the
agent's ``cached_input_per_mtok``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.trace import render_trace
from tests.fakes.openai_server import FakeOpenAIServer, OpenAIReply
from tests.integration.harness import wait_terminal

PARENT_PLAN = {
    "model_ids": ["a", "conductor", "a"],
    "subtasks": ["Draft an answer.", "Re-plan and solve the task.", "Combine both answers."],
    "access_lists": [[], [], [0, 1]],
}
CHILD_PLAN = {"model_ids": ["a"], "subtasks": ["Solve it carefully."], "access_lists": [[]]}

# per call: (input tokens, of them cached, output tokens, of them reasoning)
PLANNER_CALL = (500, 400, 50, 20)
WORKER_CALL = (1000, 800, 100, 60)


def reply(body: Any) -> OpenAIReply:
    if body.get("response_format"):  # a planning call (the schema-constrained one)
        child = "Subtask from the parent workflow" in json.dumps(body["messages"])
        tokens_in, cached, tokens_out, reasoning = PLANNER_CALL
        text = json.dumps(CHILD_PLAN if child else PARENT_PLAN)
    else:
        tokens_in, cached, tokens_out, reasoning = WORKER_CALL
        text = "an answer"
    return OpenAIReply(text=text, input_tokens=tokens_in, cached_tokens=cached, output_tokens=tokens_out,
                       reasoning_tokens=reasoning)


def write_pool(pools_dir: Path, base_url: str) -> None:
    pool = {
        "planner": "planner",
        "fallback": "template:single",
        "agents": {
            "planner": {"provider": "openai_compatible", "model": "conductor", "base_url": base_url,
                        "price": {"input_per_mtok": 0.5, "output_per_mtok": 1.0}},  # no cached price: input's
            "a": {"provider": "openai_compatible", "model": "worker", "base_url": base_url,
                  "price": {"input_per_mtok": 1.0, "cached_input_per_mtok": 0.1, "output_per_mtok": 2.0}},
        },
    }
    (pools_dir / "token-details.yaml").write_text(yaml.safe_dump(pool))


def test_cached_and_reasoning_tokens_are_recorded_summed_and_priced(client: httpx.Client, pools_dir: Path) -> None:
    with FakeOpenAIServer(reply=reply) as srv:
        write_pool(pools_dir, srv.base_url)
        created = client.post("/v1/jobs", json={"task": "Is 2^61-1 prime?", "pool": "token-details",
                                                "limits": {"max_depth": 1}})
        assert created.status_code == 202, created.text
        job = wait_terminal(client, created.json()["id"])
        calls = len(srv.bodies)
    assert job["status"] == "succeeded", job
    assert calls == 2 + 3  # two plans (parent, child), three worker calls (two steps and the child's one)
    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    child = client.get(f"/v1/jobs/{steps[1]['child_job_id']}").json()

    worker = {"input_tokens": 1000, "output_tokens": 100, "cached_input_tokens": 800, "reasoning_tokens": 60,
              "cache_write_tokens": 0,
              "cost_usd": round((200 * 1.0 + 800 * 0.1 + 100 * 2.0) / 1e6, 8)}  # cached input at its own price
    planner = {"input_tokens": 500, "output_tokens": 50, "cached_input_tokens": 400, "reasoning_tokens": 20,
               "cache_write_tokens": 0,
               "cost_usd": round((500 * 0.5 + 50 * 1.0) / 1e6, 8), "calls": 1}  # no cached price: the input's
    assert steps[0]["usage"] == steps[2]["usage"] == worker
    assert child["usage"]["planner"] == job["usage"]["planner"] == planner

    def total(*parts: dict[str, Any]) -> dict[str, Any]:
        return {k: sum(p[k] for p in parts) for k in ("input_tokens", "output_tokens", "cached_input_tokens",
                                                       "reasoning_tokens")}

    # The recursive step carries its child job's totals (planner and step), details included.
    assert {k: child["usage"][k] for k in total()} == total(planner, worker)
    assert {k: steps[1]["usage"][k] for k in total()} == total(planner, worker)
    assert steps[1]["usage"]["cost_usd"] == pytest.approx(planner["cost_usd"] + worker["cost_usd"])
    # The job's totals: its planner, its two steps and the child's.
    assert {k: job["usage"][k] for k in total()} == total(planner, worker, planner, worker, worker)
    assert job["usage"]["cost_usd"] == pytest.approx(2 * planner["cost_usd"] + 3 * worker["cost_usd"])

    # The operator's trace tells them apart too.
    with session_scope() as s:
        row = store.get_job(s, job_id=job["id"])
        assert row is not None
        trace = render_trace(s, row)
    assert "usage: 4000 in (3200 cached, 220 reasoning) / 400 out tokens" in trace, trace
    assert "1000 in (800 cached, 60 reasoning) / 100 out" in trace, trace
