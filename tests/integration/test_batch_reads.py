"""A batch's request counts come from its jobs by status plus its refused lines (no join of every line to
its job), once per read; right while lines have not started, as jobs end, and once the batch ends. The API
runs in-process (``TestClient``) so the statements it sends can be seen; no worker runs, so the lines stay
queued until this test ends them. Batches and files page by a (created_at, id) cursor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from conductor.service.app import create_app
from conductor.settings import get_settings
from conductor.store import batches as store
from conductor.store.db import get_engine, session_scope
from tests.integration.conftest import new_key
from tests.integration.harness import sent_statements
from tests.list_cases import check_batch_and_file_pages_with_equal_created_at


@pytest.fixture
def http() -> Iterator[TestClient]:
    with TestClient(create_app(), raise_server_exceptions=False) as client:
        yield client


def _sdk(http: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def _line(custom_id: str, good: bool = True) -> dict[str, Any]:
    body = {"task": custom_id, "workflow": {"steps": [{"agent": "a", "instruction": "go"}]}}
    return {"custom_id": custom_id, "method": "POST" if good else "GET", "url": "/v1/jobs", "body": body}


def _set_status(batch_id: str, custom_ids: list[str], status: str) -> None:
    with get_engine(get_settings().database_url).begin() as conn:
        conn.execute(sa.text(
            "UPDATE job SET status = :s WHERE id IN (SELECT job_id FROM batch_request WHERE batch_id = :b "
            "AND custom_id = ANY(:c))"), {"s": status, "b": batch_id, "c": custom_ids})


def _joined_counts(batch_id: str) -> tuple[int, int, int]:
    """(total, completed, failed) as the join of every line to its job counted them before."""
    with get_engine(get_settings().database_url).connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT job.status, count(*) FROM batch_request LEFT JOIN job ON job.id = batch_request.job_id "
            "WHERE batch_request.batch_id = :b GROUP BY job.status"), {"b": batch_id}).all()
    by = {status: n for status, n in rows}
    return (sum(by.values()), by.get("succeeded", 0),
            by.get(None, 0) + by.get("failed", 0) + by.get("cancelled", 0))


def _counting(statements: list[str]) -> list[str]:
    return [s for s in statements if "count(" in s and ("FROM job" in s or "FROM batch_request" in s)]


def test_counts_are_right_before_lines_start_as_jobs_end_and_once_the_batch_ends(http: TestClient) -> None:
    client = _sdk(http, new_key("tenant-batch-counts"))
    lines = [_line(f"r{n}") for n in range(4)] + [_line("bad", good=False)]
    uploaded = client.files.create(file=("c.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                   purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    assert created.request_counts is not None
    assert (created.request_counts.total, created.request_counts.completed, created.request_counts.failed) == (5, 0, 1)

    def read() -> tuple[Any, list[str]]:
        with sent_statements() as statements:
            batch = client.batches.retrieve(created.id)
        assert batch.request_counts is not None
        counts = (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed)
        assert counts == _joined_counts(created.id)
        with session_scope() as s:
            unfinished = store.batch_counts(s, batch_id=created.id).unfinished
            assert store.has_unfinished_jobs(s, batch_id=created.id) == (unfinished > 0)
        return batch, statements

    batch, statements = read()  # no line has started: four queued, one refused
    assert batch.status == "in_progress" and batch.request_counts.completed == 0
    assert batch.request_counts.failed == 1
    assert len(_counting(statements)) == 1, statements  # counted once per read, not twice
    assert not any("JOIN job" in s for s in statements), statements

    _set_status(created.id, ["r0"], "succeeded")
    _set_status(created.id, ["r1"], "failed")
    batch, statements = read()
    assert batch.status == "in_progress" and (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    assert len(_counting(statements)) == 1, statements

    _set_status(created.id, ["r2"], "cancelled")
    _set_status(created.id, ["r3"], "succeeded")
    batch, statements = read()  # the read that ends it
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
    assert batch.output_file_id is not None and batch.error_file_id is not None
    assert len(_counting(statements)) == 1, statements
    batch, statements = read()  # ended: the same counts
    assert batch.status == "completed" and (batch.request_counts.completed, batch.request_counts.failed) == (2, 3)
    assert len(_counting(statements)) == 1, statements


def test_batches_and_files_page_across_equal_created_at() -> None:
    check_batch_and_file_pages_with_equal_created_at()
