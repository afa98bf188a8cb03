"""GET /v1/jobs/{id}/steps as a tenant sees it: paged and bounded, and never naming worker hosts."""

from __future__ import annotations

import socket

import httpx

from tests.integration.harness import wait_terminal

FOUR = {"model_ids": ["a", "b", "c", "d"], "subtasks": ["s0", "s1", "s2", "s3"], "access_lists": [[], [0], [1], [2]]}


def test_steps_are_paged(client: httpx.Client) -> None:
    job = wait_terminal(client, client.post("/v1/jobs", json={"task": "t", "workflow": FOUR}).json()["id"])
    first = client.get(f"/v1/jobs/{job['id']}/steps", params={"limit": 2}).json()
    assert [s["index"] for s in first["data"]] == [0, 1] and first["count"] == 2 and first["total"] == 4
    rest = client.get(first["next"]).json()
    assert [s["index"] for s in rest["data"]] == [2, 3] and rest["next"] is None
    lean = client.get(f"/v1/jobs/{job['id']}/steps", params={"messages": "false"}).json()["data"]
    assert all(s["messages"] is None for s in lean) and lean[3]["output"]
    assert client.get(f"/v1/jobs/{job['id']}/steps").json()["data"][3]["messages"]  # included by default
    lean_page = client.get(f"/v1/jobs/{job['id']}/steps", params={"limit": 2, "messages": "false", "depth": 0}).json()
    lean_rest = client.get(lean_page["next"]).json()  # the next page is asked for the same way
    assert "messages=false" in lean_page["next"] and "depth=0" in lean_page["next"]
    assert [s["index"] for s in lean_rest["data"]] == [2, 3] and all(s["messages"] is None for s in lean_rest["data"])
    for bad in ({"limit": 0}, {"limit": 51}, {"offset": -1}, {"depth": 7}):
        r = client.get(f"/v1/jobs/{job['id']}/steps", params=bad)
        assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), bad


def test_worker_hosts_and_celery_ids_are_not_shown_to_tenants(client: httpx.Client) -> None:
    job = wait_terminal(client, client.post("/v1/jobs", json={"task": "t", "workflow": FOUR}).json()["id"])
    r = client.get(f"/v1/jobs/{job['id']}/steps")
    steps = r.json()["data"]
    assert all(s["attempts"] for s in steps)
    assert all("worker" not in a for s in steps for a in s["attempts"])
    assert all("celery_task_id" not in s for s in steps)
    assert socket.gethostname() not in r.text and "w1@" not in r.text
