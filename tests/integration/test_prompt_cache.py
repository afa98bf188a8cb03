"""Anthropic prompt caching through the whole service: a planner writes a plan → execute → verify workflow on
one Claude agent, real Celery workers run it against a loopback Anthropic server that models the prompt
cache by its documented rules (``FakeAnthropicServer(prompt_cache_min_tokens=…)``), and each step's usage and
cost show what the cache saved: the later steps read the prefixes the earlier ones marked and wrote."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from conductor import responses
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.trace import render_trace
from tests.fakes.anthropic_server import FakeAnthropicServer, Reply, _blocks, ok
from tests.fakes.http_base import RecordedRequest, count_words
from tests.fakes.openai_server import FakeOpenAIServer, OpenAIReply
from tests.integration.conftest import ANTHROPIC_KEY_ENV, ANTHROPIC_TEST_KEY, new_key
from tests.integration.harness import wait_terminal

PLAN = {
    "model_ids": ["claude", "claude", "claude"],
    "subtasks": ["Plan how to answer.", "Carry out the plan.", "Check the answer against the plan."],
    "access_lists": [[], [0], [0, 1]],
}
ANSWERS = ["First list the facts, then weigh them, then answer in two sentences.",
           "The facts point one way: the answer is yes, for the two reasons the plan names.",
           "Checked: the answer follows the plan."]
PRICE = {"input_per_mtok": 3.0, "output_per_mtok": 15.0}  # unset: a read at 0.1 x input, a write at 1.25 x


def planner(body: Any) -> OpenAIReply:
    return OpenAIReply(text=json.dumps(PLAN), input_tokens=100, output_tokens=30)


def worker_reply(srv: FakeAnthropicServer) -> Any:
    def reply(body: Any) -> Reply:
        subtask = srv.last_message_text(body)
        return ok(ANSWERS[PLAN["subtasks"].index(subtask)], output_tokens=10)
    return reply


def words(messages: list[dict[str, str]]) -> int:
    return sum(count_words(m["content"]) for m in messages if m["content"].strip())


class SlowClock:
    """The loopback server's clock, ``step_s`` later at each request: as if each step ran that long."""

    def __init__(self, step_s: float) -> None:
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def run_job(client: httpx.Client, pools_dir: Path, plan: Any, pool_name: str,
            limits: dict[str, Any] | None = None, options: dict[str, Any] | None = None,
            clock: SlowClock | None = None, price: dict[str, float] | None = None,
            ) -> tuple[dict[str, Any], list[RecordedRequest]]:
    """A job on a pool whose planner (a loopback OpenAI-compatible server answering ``plan``) plans for one
    Claude agent (``options``) on the loopback Anthropic server with its cache model: the ended job and the
    requests the Claude agent was sent."""
    with FakeOpenAIServer(reply=plan) as plans, \
            FakeAnthropicServer(api_key=ANTHROPIC_TEST_KEY, prompt_cache_min_tokens=10,
                                clock=clock or time.monotonic) as claude:
        claude.reply_with(worker_reply(claude))
        pool = {"planner": "planner", "fallback": "template:single", "agents": {
            "planner": {"provider": "openai_compatible", "model": "conductor", "base_url": plans.base_url},
            "claude": {"provider": "anthropic", "model": "claude-test", "base_url": claude.base_url,
                       "api_key_env": ANTHROPIC_KEY_ENV, "price": price or PRICE, "options": options or {}}}}
        (pools_dir / f"{pool_name}.yaml").write_text(yaml.safe_dump(pool))
        created = client.post("/v1/jobs", json={"task": "Is it wise to sleep before an exam rather than study?",
                                                "pool": pool_name, "limits": limits or {}})
        assert created.status_code == 202, created.text
        job = wait_terminal(client, created.json()["id"])
        return job, claude.requests


def test_later_steps_read_the_prefixes_earlier_steps_wrote(client: httpx.Client, pools_dir: Path) -> None:
    job, requests = run_job(client, pools_dir, planner, "prompt-cache")
    bodies = [r.body for r in requests]
    assert job["status"] == "succeeded", job
    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    assert [s["output"] for s in steps] == ANSWERS

    system = words(steps[0]["messages"][:1])
    plan_turn = words(steps[1]["messages"][1:3])
    # (read, written) per step: the plan writes the system prefix it shares with both later steps; execute
    # reads it and writes its view of the plan, which verify shares; verify reads both and writes nothing
    expected = [(0, system), (system, plan_turn), (system + plan_turn, 0)]
    for step, (read, written), body in zip(steps, expected, bodies, strict=True):
        prompt = words(step["messages"])
        usage = step["usage"]
        assert (usage["input_tokens"], usage["cached_input_tokens"], usage["cache_write_tokens"]) == (
            prompt, read, written), step
        cost = ((prompt - read - written) * 3.0 + read * 0.3 + written * 3.75 + 10 * 15.0) / 1e6
        assert usage["cost_usd"] == pytest.approx(cost, abs=1e-8), step
        # the markers the worker sent: the system block, and from the second step on the plan's answer
        marked = [text for _, text, mark in _blocks(body) if mark]
        assert marked == [step["messages"][0]["content"], *([ANSWERS[0]] if step["index"] else [])]
    assert job["usage"]["cached_input_tokens"] == 2 * system + plan_turn
    assert job["usage"]["cache_write_tokens"] == system + plan_turn
    assert job["usage"]["planner"]["cache_write_tokens"] == 0  # an openai_compatible planner writes none

    # the operator's trace and the OpenAI-shaped usage tell the writes apart too
    with session_scope() as s:
        row = store.get_job(s, job_id=job["id"])
        assert row is not None
        trace = render_trace(s, row)
    assert f"({system} cached, {plan_turn} written to cache)" in trace, trace
    assert responses.usage(row).input_tokens_details.cache_write_tokens == system + plan_turn


CHILD_PLAN = {"model_ids": ["claude", "claude"], "subtasks": ["Plan how to answer.", "Carry out the plan."],
              "access_lists": [[], [0]]}
PARENT_PLAN = {"model_ids": ["conductor", "claude"], "subtasks": ["Re-plan and solve the task.",
                                                                 "Check the answer against the plan."],
               "access_lists": [[], [0]]}


def nested_planner(body: Any) -> OpenAIReply:
    child = "Subtask from the parent workflow" in json.dumps(body["messages"])
    return OpenAIReply(text=json.dumps(CHILD_PLAN if child else PARENT_PLAN), input_tokens=100, output_tokens=30)


def test_a_child_jobs_cache_writes_reach_its_recursive_step_and_the_job(client: httpx.Client,
                                                                        pools_dir: Path) -> None:
    job, _ = run_job(client, pools_dir, nested_planner, "prompt-cache-nested", limits={"max_depth": 1})
    assert job["status"] == "succeeded", job
    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    child_steps = client.get(f"/v1/jobs/{steps[0]['child_job_id']}/steps").json()["data"]
    # in the child, the plan writes the system prefix and the execution reads it
    child_system = words(child_steps[0]["messages"][:1])
    assert [(s["usage"]["cached_input_tokens"], s["usage"]["cache_write_tokens"]) for s in child_steps] == [
        (0, child_system), (child_system, 0)]
    # the recursive step carries the child's totals, the job adds its own last step (no peer: nothing cached)
    assert (steps[0]["usage"]["cached_input_tokens"], steps[0]["usage"]["cache_write_tokens"]) == (
        child_system, child_system)
    assert (steps[1]["usage"]["cached_input_tokens"], steps[1]["usage"]["cache_write_tokens"]) == (0, 0)
    assert (job["usage"]["cached_input_tokens"], job["usage"]["cache_write_tokens"]) == (child_system, child_system)


@pytest.mark.parametrize("ttl", ["5m", "1h"])
def test_steps_seven_minutes_apart_read_an_hours_cache_and_miss_five_minutes(
        client: httpx.Client, pools_dir: Path, ttl: str) -> None:
    # each request reaches the loopback server 7 minutes after the one before (its clock), as if each step
    # ran that long: the 5-minute cache is gone by the next step, the one-hour one (the pool's option, through
    # the job's snapshot to the workers) is read, and its writes, reported as the hour's, cost twice the input
    # price, though the pool lists the 5-minute write price (as research.yaml does)
    job, requests = run_job(client, pools_dir, planner, f"prompt-cache-{ttl}", options={"prompt_cache_ttl": ttl},
                            clock=SlowClock(420.0), price={**PRICE, "cache_write_per_mtok": 3.75})
    assert job["status"] == "succeeded", job
    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    system = words(steps[0]["messages"][:1])
    plan_turn = words(steps[1]["messages"][1:3])
    if ttl == "1h":
        expected, write_price = [(0, system), (system, plan_turn), (system + plan_turn, 0)], 6.0
    else:  # nothing left to read: each step writes its whole shared prefix again
        expected, write_price = [(0, system), (0, system + plan_turn), (0, system + plan_turn)], 3.75
    for step, (read, written) in zip(steps, expected, strict=True):
        usage, prompt = step["usage"], words(step["messages"])
        assert (usage["cached_input_tokens"], usage["cache_write_tokens"]) == (read, written), step
        cost = ((prompt - read - written) * 3.0 + read * 0.3 + written * write_price + 10 * 15.0) / 1e6
        assert usage["cost_usd"] == pytest.approx(cost, abs=1e-8), step
    beta = "extended-cache-ttl-2025-04-11" if ttl == "1h" else None
    assert [r.headers.get("anthropic-beta") for r in requests] == [beta] * 3


def test_a_tenant_reads_nothing_another_tenant_wrote(client: httpx.Client, api: str, pools_dir: Path) -> None:
    """The provider's cache is the deployment's account's, shared by every tenant: the same job from two
    tenants sends prompts that differ from the tenant's cache scope on (``prompt_cache_scope: tenant``, the
    default), so the second tenant reads none of what the first wrote, while the first tenant's own next
    job reads its writes (the cache held them: the miss is the scope's doing)."""
    task = "Should a library keep its archive on tape or on disk for the next twenty years?"
    with FakeOpenAIServer(reply=planner) as plans, \
            FakeAnthropicServer(api_key=ANTHROPIC_TEST_KEY, prompt_cache_min_tokens=10) as claude, \
            httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key('tenant-cache-b')}"},
                         timeout=30) as other:
        claude.reply_with(worker_reply(claude))
        pool = {"planner": "planner", "fallback": "template:single", "agents": {
            "planner": {"provider": "openai_compatible", "model": "conductor", "base_url": plans.base_url},
            "claude": {"provider": "anthropic", "model": "claude-test", "base_url": claude.base_url,
                       "api_key_env": ANTHROPIC_KEY_ENV, "price": PRICE}}}
        (pools_dir / "prompt-cache-tenants.yaml").write_text(yaml.safe_dump(pool))

        def run(tenant: httpx.Client) -> list[dict[str, Any]]:
            created = tenant.post("/v1/jobs", json={"task": task, "pool": "prompt-cache-tenants"})
            assert created.status_code == 202, created.text
            job = wait_terminal(tenant, created.json()["id"])
            assert job["status"] == "succeeded", job
            steps: list[dict[str, Any]] = tenant.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
            assert [s["output"] for s in steps] == ANSWERS
            return steps

        a_first, b_only, a_again = run(client), run(other), run(client)
        planner_prompts = [r.body["messages"][1]["content"] for r in plans.requests]

    system = words(a_first[0]["messages"][:1])
    read = [s["usage"]["cached_input_tokens"] for s in a_first[:1] + b_only[:1] + a_again[:1]]
    assert read == [0, 0, system]  # b's plan step found nothing of a's first job; a's next job found it all
    assert b_only[0]["usage"]["cache_write_tokens"] == system  # b wrote its own
    system_a, system_b = a_first[0]["messages"][0]["content"], b_only[0]["messages"][0]["content"]
    assert system_a != system_b and a_again[0]["messages"][0]["content"] == system_a
    for text in (system_a, system_b):
        scope = text.index("[cache scope ")
        assert scope < text.index(task) and "tenant" not in text  # ahead of the task; no tenant's name
    # the planner's prompt (an openai_compatible server caches prefixes on its own): the same static system
    # prompt for both, then each tenant's scope ahead of the task
    assert len(planner_prompts) == 3 and planner_prompts[0] == planner_prompts[2] != planner_prompts[1]
    assert all(p.startswith("[cache scope ") and "tenant" not in p for p in planner_prompts)
