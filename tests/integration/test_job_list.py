"""GET /v1/jobs: cursor pagination and filters, over HTTP against Postgres (jobs run by real workers)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import openai
import pytest

from conductor.store import jobs as store
from conductor.store.db import session_scope
from tests.integration.conftest import new_key
from tests.integration.harness import sent_statements, wait_terminal
from tests.list_cases import (
    check_a_common_value_past_the_probe,
    check_metadata_filter,
    check_several_statuses_across_pages,
)

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def lister(api: str, workers: Any) -> Iterator[httpx.Client]:
    """A tenant of its own, so the other tests' jobs never show up in these lists."""
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key('lister')}"}, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def jobs(lister: httpx.Client) -> list[dict[str, Any]]:
    """Nine finished jobs: six succeeded and three failed, in groups x/y, two tagged ``vip``; newest first."""
    ids = []
    for n in range(9):
        agent = "refuses" if n % 3 == 2 else "a"
        metadata: dict[str, Any] = {"group": "x" if n % 2 else "y", "n": n}
        if n in (4, 7):
            metadata["vip"] = True
        workflow = {"steps": [{"agent": agent, "instruction": "go"}]}
        body = {"task": f"job {n}", "metadata": metadata, "workflow": workflow}
        r = lister.post("/v1/jobs", json=body)
        assert r.status_code == 202, r.text
        ids.append(r.json()["id"])
    finished = [wait_terminal(lister, job_id) for job_id in ids]
    return sorted(finished, key=lambda j: (created(j), j["id"]), reverse=True)


def created(job: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(job["created_at"])


def walk(client: httpx.Client, url: str) -> tuple[list[dict[str, Any]], int]:
    """Follows ``next`` links to the end; returns every job seen and the number of pages."""
    seen: list[dict[str, Any]] = []
    pages = 0
    next_url: str | None = url
    while next_url is not None:
        r = client.get(next_url)
        assert r.status_code == 200, r.text
        page = r.json()
        pages += 1
        assert page["count"] == len(page["data"]) and page["has_more"] == (page["next"] is not None)
        seen += page["data"]
        next_url = page["next"]
        assert pages <= 20, "next links never ended"
    return seen, pages


def ids(items: list[dict[str, Any]]) -> list[str]:
    return [j["id"] for j in items]


def test_pages_walk_every_job_exactly_once_in_a_stable_order(lister: httpx.Client, jobs: list[dict[str, Any]]) -> None:
    seen, pages = walk(lister, "/v1/jobs?limit=2")
    assert ids(seen) == ids(jobs) and pages == 5
    assert all(j["links"]["self"] == f"/v1/jobs/{j['id']}" for j in seen)
    assert seen[0]["metadata"]["n"] == 8 and seen[0]["replay_of"] is None


def test_filters_hold_across_pages(lister: httpx.Client, jobs: list[dict[str, Any]]) -> None:
    failed = [j for j in jobs if j["status"] == "failed"]
    seen, pages = walk(lister, "/v1/jobs?status=failed&limit=1")
    assert len(failed) == 3 and ids(seen) == ids(failed) and pages == 3
    first = lister.get("/v1/jobs?status=failed&limit=1").json()
    assert first["next"].startswith("/v1/jobs?") and "status=failed" in first["next"] and "limit=1" in first["next"]

    both, _ = walk(lister, "/v1/jobs?status=failed&status=succeeded&limit=4")
    assert ids(both) == ids(jobs)

    group_x = [j for j in jobs if j["metadata"]["group"] == "x"]
    seen, pages = walk(lister, "/v1/jobs?meta_key=group&meta_value=x&limit=3")
    assert len(group_x) == 4 and ids(seen) == ids(group_x) and pages == 2

    vip, _ = walk(lister, "/v1/jobs?meta_key=vip&limit=1")
    assert [j["metadata"]["n"] for j in vip] == [7, 4]
    assert ids(walk(lister, "/v1/jobs?meta_key=vip&meta_value=true")[0]) == ids(vip)
    assert ids(walk(lister, "/v1/jobs?meta_key=n&meta_value=5")[0]) == [j["id"] for j in jobs
                                                                         if j["metadata"]["n"] == 5]

    start, end = created(jobs[6]), created(jobs[2])  # newest first: jobs[6] is older than jobs[2]
    window, _ = walk(lister, "/v1/jobs?" + str(httpx.QueryParams(
        {"created_after": start.isoformat(), "created_before": end.isoformat(), "status": "succeeded", "limit": 1})))
    expected = [j for j in jobs if start <= created(j) < end and j["status"] == "succeeded"]
    assert ids(window) == ids(expected) and len(expected) >= 2
    # A time without an offset is UTC.
    naive = start.replace(tzinfo=None).isoformat()
    assert ids(walk(lister, "/v1/jobs?" + str(httpx.QueryParams({"created_after": naive})))[0]) == ids(jobs[:7])


def test_bad_cursors_and_filters_are_problems(lister: httpx.Client, jobs: list[dict[str, Any]], api: str) -> None:
    for query in ("after=not-a-cursor", f"after={'0' * 32}", "meta_value=x", "limit=0", "limit=201",
                  "status=nope", "created_after=yesterday"):
        r = lister.get(f"/v1/jobs?{query}")
        assert r.status_code == 422, (query, r.text)
        assert r.headers["content-type"].startswith(PROBLEM)
    assert lister.get(f"/v1/jobs?after={'0' * 32}").json()["title"] == "Invalid cursor"
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key('lister-2')}"}) as other:
        # Another tenant's job is no cursor of yours, and its list holds none of your jobs.
        assert other.get(f"/v1/jobs?after={jobs[0]['id']}").status_code == 422
        assert other.get("/v1/jobs").json() == {"data": [], "count": 0, "has_more": False, "next": None}


def test_batch_filter_lists_exactly_one_batchs_jobs(api: str, workers: Any) -> None:
    key = new_key("lister-batch")
    lines = [{"custom_id": f"line-{n}", "method": "POST", "url": "/v1/jobs",
              "body": {"task": f"batch line {n}", "workflow": {"steps": [{"agent": "a", "instruction": "go"}]}}}
             for n in range(3)]
    with openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0) as oai, \
            httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        outside = c.post("/v1/jobs", json={"task": "not in the batch", "workflow": lines[0]["body"]["workflow"]})
        uploaded = oai.files.create(file=("lines.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()),
                                    purpose="batch")
        batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
        deadline = time.monotonic() + 120  # only keeps a broken run from hanging
        while oai.batches.retrieve(batch.id).status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, "the batch did not end"
            time.sleep(0.3)
        seen, pages = walk(c, f"/v1/jobs?batch_id={batch.id}&limit=2")
        assert pages == 2 and sorted(j["task"] for j in seen) == ["batch line 0", "batch line 1", "batch line 2"]
        assert {j["batch_id"] for j in seen} == {batch.id} and outside.json()["id"] not in ids(seen)
        assert len(walk(c, "/v1/jobs")[0]) == 4
        with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key('lister-3')}"}) as other:
            assert other.get(f"/v1/jobs?batch_id={batch.id}").json()["data"] == []
        assert c.get("/v1/jobs?batch_id=not-a-batch").status_code == 422


def test_a_page_of_jobs_and_a_status_poll_read_no_texts_they_do_not_show(lister: httpx.Client,
                                                                          jobs: list[dict[str, Any]]) -> None:
    """A summary shows a 200-character task: the page must not read every job's workflow, context and
    answer; an event stream's poll reads its steps' statuses, not their messages and outputs."""
    with sent_statements() as statements, session_scope() as s:
        page = store.list_jobs(s, tenant="lister", limit=200)
        done = next(j for j in page if j.status == "succeeded")
        steps = store.get_steps(s, job_id=done.id, light=True)
        heavy = r"job\.(request_workflow|pool_config|planner_raw|answer|context)\b"
        assert len(page) >= 9 and not re.search(heavy, statements[0]), statements[0]
        assert steps and not re.search(r"step\.(messages|output|instruction)\b", statements[1]), statements[1]
        assert done.answer and steps[0].output  # still there when asked for
    listed = lister.get("/v1/jobs", params={"limit": 200}).json()["data"]
    assert [j["id"] for j in listed][:len(page)] == [j.id for j in page]


def test_the_metadata_filter_finds_every_job_the_exact_comparison_matches() -> None:
    """Postgres adds ``?`` / ``@>`` conditions (the GIN index's) to the text comparison: numbers, strings
    spelling them, quotes in keys and values, JSON null, booleans and objects still match as text."""
    check_metadata_filter(postgres=True)


def test_a_page_is_completed_past_the_probe_of_the_newest_jobs() -> None:
    check_a_common_value_past_the_probe()


def test_several_statuses_are_listed_newest_first_across_pages() -> None:
    check_several_statuses_across_pages()
