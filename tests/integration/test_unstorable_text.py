"""Text Postgres cannot store, sent by a planner model or a provider, ends in a clear outcome, not a stuck
job. A NUL or an unpaired surrogate (a JSON escape ``\\u0000``, half of an escaped surrogate pair) in a
planner's step instruction, in a refusal quoting the planner's output, in a provider's error message or in
the model name a server reports made the write that recorded it fail: the planning or step was re-run
until it failed as a lost worker, minutes later and for the wrong reason, or a paid answer was lost. The
planner and the workers are openai_compatible agents on a loopback server; the API, the Celery workers
and Postgres are real."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes.http_base import Reply, error, ok
from tests.fakes.openai_server import FakeOpenAIServer
from tests.integration.harness import wait_terminal

LONG_MODEL = "m" * 300 + "\u0000"
"""A model name no ``step.model`` (VARCHAR 256) holds, with a NUL besides."""


def plan(*subtasks: str, agent: str = "a") -> str:
    return json.dumps({"model_ids": [agent] * len(subtasks), "subtasks": list(subtasks),
                       "access_lists": [[] for _ in subtasks]})


def reply(body: Any) -> Reply:
    messages = body.get("messages", [])
    if body.get("response_format"):  # a planning call
        task = json.dumps(messages)
        reasked = any(m.get("role") == "assistant" for m in messages)
        if "unknown-agent" in task:  # every attempt names an agent that is not there, NUL included
            return ok(plan("Solve it.", agent="b\u0000"))
        if "nul-instruction" in task and not reasked:
            return ok(plan("Fix \u0000 handling"))  # sent escaped: the NUL appears once the JSON is read
        return ok(plan("Fix the handling"))
    if body.get("model") == "worker-bad":
        return error(400, "invalid prompt: \u0000 / \ud83d")
    return ok("an answer", model=LONG_MODEL)


def write_pool(pools_dir: Path, base_url: str) -> None:
    agent = {"provider": "openai_compatible", "base_url": base_url}
    pool = {"planner": "planner", "fallback": "template:single",
            "agents": {"a": {**agent, "model": "worker-a"}, "planner": {**agent, "model": "conductor"},
                       "bad": {**agent, "model": "worker-bad"}}}
    (pools_dir / "unstorable.yaml").write_text(yaml.safe_dump(pool))


def run(client: httpx.Client, **body: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    created = client.post("/v1/jobs", json={"pool": "unstorable", **body})
    assert created.status_code == 202, created.text
    job = wait_terminal(client, created.json()["id"])
    return job, client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]


@pytest.fixture(scope="module")
def loopback(pools_dir: Path) -> Iterator[None]:
    with FakeOpenAIServer(reply=reply) as srv:
        write_pool(pools_dir, srv.base_url)
        yield


def test_a_planned_instruction_with_a_nul_is_refused_and_the_planner_asked_again(
        client: httpx.Client, loopback: None) -> None:
    job, steps = run(client, task="nul-instruction")
    assert job["status"] == "succeeded", job
    assert job["workflow"]["planner_attempts"] == 2 and job["workflow"]["source"] == "planner", job
    assert [st["instruction"] for st in steps] == ["Fix the handling"]
    # the answer is kept; the server's model name as the column holds it
    assert job["answer"] == "an answer" and steps[0]["model"] == "m" * 256


def test_the_planners_refusals_quoting_its_output_are_stored_escaped(client: httpx.Client, loopback: None) -> None:
    job, _ = run(client, task="unknown-agent")
    assert job["status"] == "succeeded" and job["workflow"]["source"] == "fallback", job
    assert "unknown agent 'b\\u0000'" in job["workflow"]["planner_error"], job["workflow"]


def test_a_providers_error_message_fails_the_step_at_once_stored_escaped(client: httpx.Client, loopback: None) -> None:
    job, steps = run(client, task="t", workflow={"model_ids": ["bad"], "subtasks": ["x"], "access_lists": [[]]})
    assert job["status"] == "failed", job
    assert steps[0]["status"] == "failed" and len(steps[0]["attempts"]) == 1, steps
    assert steps[0]["error"]["type"] == "bad_request", steps
    assert "invalid prompt: \\u0000 / \\ud83d" in steps[0]["error"]["message"], steps
