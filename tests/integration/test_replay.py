"""Replay (POST /v1/jobs/{id}/replay, `conductor replay`) against the API, Celery workers, Postgres, Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import sqlalchemy as sa
from sqlmodel import select

from conductor.store.db import session_scope
from conductor.store.models import Job, Step
from tests.integration.conftest import new_key
from tests.integration.harness import wait_terminal


def submit(client: httpx.Client, agents: list[str], access: list[Any], task: str = "replay me") -> dict[str, Any]:
    workflow = {"model_ids": agents, "subtasks": [f"part {i}" for i in range(len(agents))], "access_lists": access}
    created = client.post("/v1/jobs", json={"task": task, "workflow": workflow})
    assert created.status_code == 202, created.text
    return wait_terminal(client, created.json()["id"])


def replay(client: httpx.Client, job_id: str, **body: Any) -> dict[str, Any]:
    r = client.post(f"/v1/jobs/{job_id}/replay", json=body)
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted["replay_of"] == job_id and r.headers["Location"] == f"/v1/jobs/{accepted['id']}"
    return wait_terminal(client, accepted["id"])


def steps(client: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/steps").json()["data"]


def rows(job_id: str) -> list[Step]:
    with session_scope() as s:
        return list(s.exec(select(Step).where(Step.job_id == job_id).order_by(Step.index)))  # type: ignore[arg-type]


# 0 <- 1 <- 2 <- 4 and 0 <- 3 <- 4: step 3 comes after step 2 but does not read it.
AGENTS = ["a", "b", "c", "d", "a"]
ACCESS: list[Any] = [[], [0], [0, 1], [0], [2, 3]]


def test_replay_from_step_2_with_an_agent_swapped_reuses_0_1_and_reruns_what_depends_on_2(
    client: httpx.Client,
) -> None:
    original = submit(client, AGENTS, ACCESS)
    assert original["status"] == "succeeded"
    before_steps, before_rows = steps(client, original["id"]), rows(original["id"])

    job = replay(client, original["id"], from_step=2, agents={"2": "d"})

    assert job["status"] == "succeeded" and job["replay_of"] == original["id"]
    assert job["replay"] == {"from_step": 2, "agents": {"2": "d"}, "replan": False}
    assert job["workflow"]["source"] == "replay"
    assert [s["agent"] for s in job["workflow"]["steps"]] == ["a", "b", "d", "d", "a"]
    after = steps(client, job["id"])
    assert [s["reused"] for s in after] == [True, True, False, True, False]
    assert all(s["status"] == "succeeded" for s in after)
    for i in (0, 1, 3):  # copied, not run: the same messages and output, no attempt, no new usage
        assert after[i]["reused_from"] == {"job_id": original["id"], "index": i}
        assert after[i]["messages"] == before_steps[i]["messages"] and after[i]["output"] == before_steps[i]["output"]
        assert after[i]["attempts"] == [] and after[i]["usage"] == {"input_tokens": 0, "output_tokens": 0,
                                                                    "cost_usd": 0.0, "cached_input_tokens": 0,
                                                                    "reasoning_tokens": 0, "cache_write_tokens": 0}
    # Step 2 ran on the swapped agent, seeing the reused outputs of 0 and 1.
    assert after[2]["reused_from"] is None and len(after[2]["attempts"]) == 1
    assert after[2]["output"] == "[d] part 2" != before_steps[2]["output"]
    assert after[2]["messages"] == before_steps[2]["messages"]
    # Step 4 reads step 2, so it ran again and saw the new answer.
    assert after[4]["reused_from"] is None and len(after[4]["attempts"]) == 1
    assert {"role": "assistant", "content": "[d] part 2"} in after[4]["messages"]
    assert {"role": "assistant", "content": "[c] part 2"} in before_steps[4]["messages"]
    assert job["usage"]["calls"] == 2 and job["usage"]["input_tokens"] == sum(
        s["usage"]["input_tokens"] for s in after)
    # The rows: reused_from points at the original's rows; the original is untouched.
    new_rows = rows(job["id"])
    assert [r.reused_from for r in new_rows] == [before_rows[0].id, before_rows[1].id, None, before_rows[3].id, None]
    assert [r.model_dump() for r in rows(original["id"])] == [r.model_dump() for r in before_rows]
    assert steps(client, original["id"]) == before_steps
    assert client.get(f"/v1/jobs/{original['id']}").json() == original


def test_a_replay_without_changes_reproduces_every_message_byte_for_byte(client: httpx.Client) -> None:
    original = submit(client, ["a", "b", "c", "d"], [[], [], [0, 1], "all"], task="fan out, then gather")
    job = replay(client, original["id"])
    assert job["status"] == "succeeded" and job["answer"] == original["answer"]
    before, after = steps(client, original["id"]), steps(client, job["id"])
    assert len(after) == 4 and not any(s["reused"] for s in after)
    for old, new in zip(before, after, strict=True):
        assert json.dumps(new["messages"]).encode() == json.dumps(old["messages"]).encode()
        assert new["output"] == old["output"] and len(new["attempts"]) == 1
    with session_scope() as s:
        new_job = s.get(Job, job["id"])
        assert new_job is not None and new_job.replay_of == original["id"] and new_job.replay_from_step is None


def test_replan_asks_the_planner_again(client: httpx.Client) -> None:
    original = submit(client, ["a", "b"], [[], [0]])
    job = replay(client, original["id"], replan=True)
    # The test pool's planner is template:single: one step, on its first worker.
    assert job["status"] == "succeeded" and job["workflow"]["source"] == "planner"
    assert [s["agent"] for s in job["workflow"]["steps"]] == ["a"]
    assert job["replay"]["replan"] is True and job["replay_of"] == original["id"]


def test_replay_input_is_checked_and_tenant_scoped(client: httpx.Client, api: str) -> None:
    original = submit(client, ["a", "b"], [[], [0]])
    url = f"/v1/jobs/{original['id']}/replay"
    bad = {
        "from_step": {"from_step": 2},
        "agents": {"agents": {"1": "no-such-agent"}},
        "pool": {"pool": "no-such-pool"},
    }
    for field, body in bad.items():
        r = client.post(url, json=body)
        assert r.status_code == 422, (field, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["errors"][0]["loc"][:2] == ["body", field]
    assert client.post(url, json={"agents": {"x": "a"}}).status_code == 422
    assert client.post(url, json={"from_step": 0, "extra": 1}).status_code == 422
    assert client.post(f"/v1/jobs/{'0' * 32}/replay").status_code == 404
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key('replay-other')}"}) as other:
        r = other.post(url, json={})
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")
    slow = {"steps": [{"agent": "slow", "instruction": "x"}]}
    running = client.post("/v1/jobs", json={"task": "t", "workflow": slow})
    running_id = running.json()["id"]
    r = client.post(f"/v1/jobs/{running_id}/replay")
    assert r.status_code == 409 and "replay it once it has ended" in r.json()["detail"]
    client.post(f"/v1/jobs/{running_id}/cancel")


def test_conductor_replay_cli(proc_env: dict[str, str], api: str, client: httpx.Client) -> None:
    original = submit(client, ["a", "b"], [[], [0]])
    key = client.headers["Authorization"].removeprefix("Bearer ")
    env = {**proc_env, "CONDUCTOR_API_URL": api, "CONDUCTOR_API_KEY": key}
    done = subprocess.run(
        [sys.executable, "-m", "conductor.cli", "replay", original["id"], "--from-step", "1", "--agent", "1=c",
         "--wait"], env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    job_id, answer = done.stdout.strip().splitlines()[0], done.stdout.strip().splitlines()[-1]
    assert answer == "[c] part 1" and "succeeded" in done.stderr
    assert [s["reused"] for s in steps(client, job_id)] == [True, False]
    wrong = subprocess.run([sys.executable, "-m", "conductor.cli", "replay", original["id"], "--agent", "one=c"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "STEP_INDEX=AGENT_NAME" in wrong.stderr


def test_a_replanned_workflow_refused_still_counts_its_planner(client: httpx.Client) -> None:
    """The replay asks the planner again (a model this time: two paid calls, then the fallback's one
    step); overriding an agent beyond its steps refuses the plan, and the planner's calls still count."""
    workflow = {"model_ids": ["a", "b"], "subtasks": ["part 0", "part 1"], "access_lists": [[], [0]]}
    created = client.post("/v1/jobs", json={"task": "replay me", "planner": "a", "workflow": workflow})
    original = wait_terminal(client, created.json()["id"])
    job = replay(client, original["id"], replan=True, agents={"1": "c"})
    assert job["status"] == "failed" and job["error"]["type"] == "invalid_workflow", job
    with session_scope() as s:
        row = s.get(Job, job["id"])
        assert row is not None and row.planner_calls == 2 and row.planner_input_tokens > 0
        assert (row.input_tokens, row.output_tokens, row.calls) == (
            row.planner_input_tokens, row.planner_output_tokens, 2)  # its totals too


def test_a_replan_on_a_pool_without_the_originals_planner_is_refused(client: httpx.Client, pools_dir: Any) -> None:
    """The original named an agent of its pool as its planner; a replanning replay on a pool without that
    agent was accepted (202) and then failed its planning with an internal error (KeyError)."""
    (pools_dir / "replay-other.yaml").write_text("agents:\n  z: {provider: sim}\n")
    created = client.post("/v1/jobs", json={"task": "plan me", "planner": "a"})
    assert created.status_code == 202, created.text
    original = wait_terminal(client, created.json()["id"])
    r = client.post(f"/v1/jobs/{original['id']}/replay", json={"pool": "replay-other", "replan": True})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["loc"] == ["body", "pool"] and "'a'" in r.json()["errors"][0]["msg"]
    # without replanning the planner is not asked: the original's workflow is checked against the pool
    r = client.post(f"/v1/jobs/{original['id']}/replay", json={"pool": "replay-other", "agents": {"0": "z"}})
    assert r.status_code == 202, r.text
    assert wait_terminal(client, r.json()["id"])["status"] == "succeeded"


def test_a_replay_sends_to_the_tenants_default_webhook_as_it_is_now(client: httpx.Client) -> None:
    """A job that named no webhook URL used its tenant's default; once the operator changed or cleared the
    default (a compromised endpoint, say), a replay sent the signed result to the old one all the same.
    A URL the job named itself is kept."""
    from conductor.store import webhooks

    workflow = {"model_ids": ["a"], "subtasks": ["x"], "access_lists": [[]]}
    own = client.post("/v1/jobs", json={"task": "t", "workflow": workflow,
                                        "webhook_url": "https://hooks.example.com/mine"}).json()["id"]
    with session_scope() as s:
        name = s.get(Job, own).tenant  # type: ignore[union-attr]
        webhooks.set_default_webhook_url(s, tenant=name, url="https://hooks.example.com/old-default")
    try:
        defaulted = client.post("/v1/jobs", json={"task": "t", "workflow": workflow}).json()["id"]
        for job_id in (own, defaulted):
            wait_terminal(client, job_id)
        with session_scope() as s:
            webhooks.set_default_webhook_url(s, tenant=name, url=None)  # cleared since
        replays = {job_id: client.post(f"/v1/jobs/{job_id}/replay", json={}).json()["id"]
                   for job_id in (own, defaulted)}
        for replayed in replays.values():
            wait_terminal(client, replayed)
        with session_scope() as s:
            urls = {job_id: s.get(Job, replays[job_id]).webhook_url for job_id in replays}  # type: ignore[union-attr]
            original = s.get(Job, defaulted)
            assert original is not None and original.webhook_url == "https://hooks.example.com/old-default"
        assert urls == {own: "https://hooks.example.com/mine", defaulted: None}
    finally:
        with session_scope() as s:
            webhooks.set_default_webhook_url(s, tenant=name, url=None)
            # (example.com hooks: no delivery left retrying for later modules' workers)
            s.execute(sa.text("UPDATE webhook_delivery SET status = 'failed' WHERE tenant = :t AND status = "
                              "'pending'"), {"t": name})
