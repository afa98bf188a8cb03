"""Batches through the official ``openai`` client, unchanged: files.create -> batches.create ->
batches.retrieve -> files.content, with real jobs on the Celery workers (sim pool). Bad lines fail alone,
duplicate custom_ids are refused with their line, another tenant sees 404, cancel ends a batch, the
reconciler ends a batch no one reads, and ``conductor submit --batch --wait`` writes the results file."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import sqlalchemy as sa
from sqlmodel import select

from conductor.reconcile import reconcile_once
from conductor.settings import get_settings
from conductor.store import batches as store
from conductor.store.db import session_scope
from conductor.store.models import Batch, Job, utcnow
from tests.integration.conftest import new_key
from tests.integration.harness import sent_statements, start_api

SIM_ANSWER = "[a] Solve the task and give the final answer."
FINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def key(api: str) -> str:
    return new_key("tenant-batch")


@pytest.fixture(scope="module")
def oai(api: str, key: str, workers: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def stranger(api: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api}/v1", api_key=new_key("tenant-other"), max_retries=0) as client:
        yield client


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, text: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "conductor", "messages": [{"role": "user", "content": text}]}}


def job_line(custom_id: str, body: dict[str, Any], url: str = "/v1/jobs") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def results_of(client: openai.OpenAI, batch_id: str) -> httpx.Response:
    """GET /v1/batches/{id}/results (not in the OpenAI SDK), with the SDK client's key and address."""
    with httpx.Client(base_url=str(client.base_url), timeout=30,
                      headers={"Authorization": f"Bearer {client.api_key}"}) as http:
        return http.get(f"batches/{batch_id}/results")


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 180) -> Any:
    """Polls until the batch ends; the timeout only keeps a broken run from hanging."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} did not end: {batch}")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_of_50_chat_completions(oai: openai.OpenAI, tmp_path: Path) -> None:
    ids = [f"request-{n}" for n in range(50)]
    uploaded = oai.files.create(file=("questions.jsonl", jsonl([chat_line(i, f"question {i}") for i in ids])),
                                purpose="batch")
    assert uploaded.object == "file" and uploaded.purpose == "batch" and uploaded.filename == "questions.jsonl"
    assert oai.files.retrieve(uploaded.id).bytes == uploaded.bytes
    created = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"run": "nightly"})
    assert created.status == "in_progress" and created.request_counts is not None
    assert created.request_counts.total == 50 and created.metadata == {"run": "nightly"}
    assert created.usage is None  # summed when the batch ends

    batch = wait_batch(oai, created.id)
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (50, 0)
    results = tmp_path / "results.jsonl"
    oai.files.content(batch.output_file_id).write_to_file(results)
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(lines) == 50 and [line["custom_id"] for line in lines] == ids
    with session_scope() as s:
        jobs = {j.id: j for j in s.exec(select(Job).where(Job.batch_id == created.id))}
    assert len(jobs) == 50
    for line in lines:
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == SIM_ANSWER
        job = jobs[body["id"]]
        assert job.status == "succeeded" and job.task == f"question {line['custom_id']}"
        assert body["usage"]["prompt_tokens"] == job.input_tokens
    assert batch.usage is not None  # the SDK's BatchUsage: every line's job, its planner's calls too
    assert batch.usage.input_tokens == sum(j.input_tokens for j in jobs.values()) > 0
    assert batch.usage.output_tokens == sum(j.output_tokens for j in jobs.values()) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert created.id in [b.id for b in oai.batches.list(limit=100)]
    listed = [f.id for f in oai.files.list(limit=1)]  # auto-paging: one file per request
    assert {uploaded.id, batch.output_file_id} <= set(listed) and len(listed) == len(set(listed))
    assert uploaded.id not in [f.id for f in oai.files.list(purpose="batch_output")]


def test_a_batchs_usage_sums_its_jobs_with_their_cached_and_reasoning_parts(oai: openai.OpenAI) -> None:
    """Agent d of the test pool reports a prompt-cache read: the batch's usage carries its jobs' cached input;
    a refused line has no job and adds nothing."""
    workflow = {"model_ids": ["a", "d"], "subtasks": ["draft", "check"], "access_lists": [[], [0]]}
    lines = [job_line(f"j{n}", {"task": f"task {n}", "workflow": workflow}) for n in range(3)]
    lines.append(job_line("refused", {"task": ""}))
    uploaded = oai.files.create(file=("jobs.jsonl", jsonl(lines)), purpose="batch")
    created = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    batch = wait_batch(oai, created.id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 1)
    with session_scope() as s:
        jobs = list(s.exec(select(Job).where(Job.batch_id == created.id)))
    assert len(jobs) == 3 and all(j.status == "succeeded" for j in jobs)
    usage = batch.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens) == (sum(j.input_tokens for j in jobs),
                                                         sum(j.output_tokens for j in jobs))
    assert usage.input_tokens_details.cached_tokens == sum(j.cached_input_tokens for j in jobs) == 3 * 4
    assert usage.output_tokens_details.reasoning_tokens == sum(j.reasoning_tokens for j in jobs) == 0
    assert oai.batches.retrieve(created.id).usage == usage  # stored: every later read tells the same


def response_line(custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": body}


def test_a_batch_of_responses(oai: openai.OpenAI) -> None:
    """``/v1/responses`` lines: each a response (the body of its output line a ``response`` object, as the
    route answers; its job readable with ``responses.retrieve``); ``max_output_tokens`` makes a cut answer
    an ``incomplete`` response; ``stream``, ``previous_response_id``, an unknown model and a bad body fail
    alone in the error file."""
    lines = [
        response_line("plain", {"model": "conductor", "input": "What is 6 x 7?", "instructions": "Be brief.",
                                "metadata": {"n": "1"}}),
        response_line("cut", {"model": "conductor", "input": "Say hello at length. " * 5, "max_output_tokens": 4}),
        response_line("streamed", {"model": "conductor", "input": "x", "stream": True}),
        response_line("continued", {"model": "conductor", "input": "x", "previous_response_id": "resp_1"}),
        response_line("unknown", {"model": "conductor/no-such-planner", "input": "x"}),
        response_line("bad", {"model": "conductor"}),
        response_line("cancelled", {"model": "conductor/slow", "input": "cancel me", "background": True}),
        chat_line("wrong-url", "x"),
    ]
    uploaded = oai.files.create(file=("responses.jsonl", jsonl(lines)), purpose="batch")
    created = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h")
    assert created.endpoint == "/v1/responses"
    with httpx.Client(base_url=str(oai.base_url), timeout=30, headers={"Authorization": f"Bearer {oai.api_key}"}) as h:
        jobs = h.get("jobs", params={"batch_id": created.id, "limit": 100}).json()["data"]
    [slow] = [j["id"] for j in jobs if j["task"] == "cancel me"]
    assert oai.responses.cancel(slow).status == "cancelled"  # (its 2.5 s planner still running)
    batch = wait_batch(oai, created.id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 6)
    output = {line["custom_id"]: line for line in lines_of(oai, batch.output_file_id)}
    error_lines = {line["custom_id"]: line for line in lines_of(oai, batch.error_file_id)}
    errors = {custom_id: line["error"]["code"] for custom_id, line in error_lines.items()}
    assert errors == {"streamed": "invalid_body", "continued": "invalid_body", "unknown": "model_not_found",
                      "bad": "invalid_body", "wrong-url": "invalid_url", "cancelled": "job_cancelled"}
    stopped = error_lines["cancelled"]["response"]  # the response, as GET /v1/responses/{id} has it
    assert stopped["status_code"] == 409 and stopped["body"]["object"] == "response"
    assert stopped["body"]["status"] == "cancelled" and stopped["body"]["output"] == []
    assert stopped["body"]["background"] is False  # a line is not a background request
    assert oai.responses.retrieve(stopped["request_id"]).status == "cancelled"
    plain = output["plain"]["response"]
    assert plain["status_code"] == 200 and plain["body"]["object"] == "response"
    body = plain["body"]
    assert body["status"] == "completed" and body["id"] == plain["request_id"]
    assert body["instructions"] == "Be brief." and body["metadata"] == {"n": "1"}
    retrieved = oai.responses.retrieve(body["id"])  # a batch line's response is a response
    assert retrieved.output_text == body["output"][0]["content"][0]["text"] == SIM_ANSWER
    assert retrieved.usage is not None and retrieved.usage.input_tokens == body["usage"]["input_tokens"] > 0
    cut = output["cut"]["response"]["body"]
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["max_output_tokens"] == 4 and 0 < len(cut["output"][0]["content"][0]["text"]) <= 16


def test_a_chat_line_naming_an_unknown_planner_is_model_not_found(oai: openai.OpenAI) -> None:
    """As the live route answers 404 model_not_found for it, not invalid_request."""
    unknown = chat_line("unknown", "q")
    unknown["body"]["model"] = "conductor/no-such-planner"
    uploaded = oai.files.create(file=("chat.jsonl", jsonl([chat_line("fine", "q"), unknown])), purpose="batch")
    batch = wait_batch(oai, oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    [error] = lines_of(oai, batch.error_file_id)
    assert error["custom_id"] == "unknown" and error["error"]["code"] == "model_not_found", error


def test_bad_lines_fail_alone_and_land_in_the_error_file(oai: openai.OpenAI) -> None:
    good = {"task": "fine", "workflow": {"model_ids": ["b"], "subtasks": ["do it"], "access_lists": [[]]},
            "metadata": {"k": "v"}}
    lines = [
        job_line("good", good),
        job_line("no-task", {"pool": "sim"}),
        job_line("wrong-url", good, url="/v1/chat/completions"),
        job_line("unknown-agent", {"task": "t", "workflow": {"model_ids": ["zz"], "subtasks": ["x"],
                                                              "access_lists": [[]]}}),
        job_line("refused-by-provider", {"task": "t", "workflow": {"model_ids": ["refuses"], "subtasks": ["x"],
                                                                    "access_lists": [[]]}}),
    ]
    uploaded = oai.files.create(file=("mixed.jsonl", jsonl(lines)), purpose="batch")
    batch = wait_batch(oai, oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs",
                                               completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (5, 1, 4)
    [ok] = lines_of(oai, batch.output_file_id)
    assert ok["custom_id"] == "good" and ok["response"]["body"]["answer"] == "[b] do it"
    assert ok["response"]["body"]["metadata"] == {"k": "v"}
    errors = {e["custom_id"]: e for e in lines_of(oai, batch.error_file_id)}
    assert list(errors) == ["no-task", "wrong-url", "unknown-agent", "refused-by-provider"]
    assert errors["no-task"]["response"] is None and errors["no-task"]["error"]["message"].startswith("line 2:")
    assert "task" in errors["no-task"]["error"]["message"]
    assert errors["wrong-url"]["error"]["code"] == "invalid_url"
    assert "line 4" in errors["unknown-agent"]["error"]["message"]
    failed = errors["refused-by-provider"]
    assert failed["error"]["code"] == "job_failed" and failed["response"]["status_code"] == 500

    merged = results_of(oai, batch.id)  # the output and error lines in one download, in input order
    assert merged.status_code == 200 and merged.headers["content-type"].startswith("application/jsonl")
    rows = [json.loads(line) for line in merged.text.splitlines()]
    assert [r["custom_id"] for r in rows] == ["good", "no-task", "wrong-url", "unknown-agent", "refused-by-provider"]
    assert rows[0] == ok and rows[1:] == list(errors.values())
    oai.files.delete(batch.output_file_id)  # the results went with it: said, not half-answered
    gone = results_of(oai, batch.id)
    assert gone.status_code == 410 and gone.json()["error"]["code"] == "file_deleted", gone.text


def test_a_line_whose_keys_postgres_cannot_store_fails_alone(oai: openai.OpenAI) -> None:
    """A refused line's error names its own keys (an unknown field, a body field the request does not
    have): a NUL or a lone surrogate there made the stored error unstorable, and the flush of the next line
    failed the whole batch (500, or 400 without a line number when it was the last line). Each such line
    fails alone now, its error naming the key escaped; the lines around it run."""
    good = {"task": "fine", "workflow": {"model_ids": ["b"], "subtasks": ["do it"], "access_lists": [[]]}}
    lines = [
        job_line("first", good),
        {**job_line("nul-field", good), "\u0000": 1},
        job_line("nul-body-field", {**good, "\u0000": 1}),
        {**job_line("surrogate-field", good), "\ud800": 1},
        job_line("last", good),
    ]
    uploaded = oai.files.create(file=("keys.jsonl", jsonl(lines)), purpose="batch")
    batch = wait_batch(oai, oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs",
                                               completion_window="24h").id)
    assert batch.request_counts is not None
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 2, 3)
    assert [ok["custom_id"] for ok in lines_of(oai, batch.output_file_id)] == ["first", "last"]
    errors = {e["custom_id"]: e["error"] for e in lines_of(oai, batch.error_file_id)}
    assert errors["nul-field"] == {"code": "invalid_request", "message": "line 2: unknown field(s) \\u0000"}
    assert errors["nul-body-field"]["code"] == "invalid_body"
    assert errors["nul-body-field"]["message"].startswith("line 3: invalid body: \\u0000:"), errors
    assert errors["surrogate-field"] == {"code": "invalid_request", "message": "line 4: unknown field(s) \\ud800"}


def test_the_file_is_refused_whole_for_duplicates_and_malformed_lines(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as dup:
        oai.files.create(file=("d.jsonl", jsonl([chat_line("a", "x"), chat_line("b", "y"), chat_line("a", "z")])),
                         purpose="batch")
    assert dup.value.code == "duplicate_custom_id" and "line 3" in dup.value.message
    assert "first on line 1" in dup.value.message
    with pytest.raises(openai.BadRequestError) as broken:
        oai.files.create(file=("b.jsonl", b'{"custom_id": "a"}\nnot json\n'), purpose="batch")
    assert broken.value.code == "invalid_json" and "line 2" in broken.value.message
    with pytest.raises(openai.BadRequestError) as purpose:
        oai.files.create(file=("p.jsonl", jsonl([chat_line("a", "x")])), purpose="fine-tune")
    assert purpose.value.param == "purpose"
    with pytest.raises(openai.BadRequestError):
        oai.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/embeddings",  # type: ignore[arg-type]
                           completion_window="24h")
    before = {f.id for f in oai.files.list(limit=100)}
    with pytest.raises(openai.BadRequestError) as expiring:  # before: accepted, and the file never expired
        oai.files.create(file=("e.jsonl", jsonl([chat_line("a", "x")])), purpose="batch",
                         expires_after={"anchor": "created_at", "seconds": 3600})
    assert expiring.value.param == "expires_after" and "kept until deleted" in expiring.value.message
    with pytest.raises(openai.BadRequestError) as flat:  # as a client writing the form by hand might send it
        oai.files.create(file=("e.jsonl", jsonl([chat_line("a", "x")])), purpose="batch",
                         extra_body={"expires_after": '{"anchor": "created_at", "seconds": 3600}'})
    assert flat.value.param == "expires_after"
    assert {f.id for f in oai.files.list(limit=100)} == before  # nothing stored


def test_another_tenant_sees_404(oai: openai.OpenAI, stranger: openai.OpenAI) -> None:
    uploaded = oai.files.create(file=("t.jsonl", jsonl([chat_line("only", "x")])), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    for attempt in (
        lambda: stranger.files.retrieve(uploaded.id),
        lambda: stranger.files.content(uploaded.id),
        lambda: stranger.batches.retrieve(batch.id),
        lambda: stranger.batches.cancel(batch.id),
        lambda: stranger.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            attempt()
        assert missing.value.code == "not_found"
    with pytest.raises(openai.NotFoundError):
        stranger.files.delete(uploaded.id)
    assert batch.id not in [b.id for b in stranger.batches.list()]
    assert uploaded.id not in [f.id for f in stranger.files.list()]
    ended = wait_batch(oai, batch.id)
    with pytest.raises(openai.NotFoundError):
        stranger.files.content(ended.output_file_id or "")
    theirs = results_of(stranger, batch.id)
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "not_found", theirs.text
    assert results_of(oai, batch.id).status_code == 200
    assert oai.files.retrieve(uploaded.id).id == uploaded.id  # the stranger's delete deleted nothing


def test_a_deleted_file_is_gone_and_the_batch_made_from_it_still_ends(oai: openai.OpenAI) -> None:
    uploaded = oai.files.create(file=("d.jsonl", jsonl([chat_line("one", "x")])), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deleted = oai.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted) == (uploaded.id, True)
    for attempt in (lambda: oai.files.retrieve(uploaded.id), lambda: oai.files.content(uploaded.id),
                    lambda: oai.files.delete(uploaded.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert uploaded.id not in [f.id for f in oai.files.list(limit=100)]
    ended = wait_batch(oai, batch.id)  # its lines were read when it was created
    assert ended.status == "completed" and [line["custom_id"] for line in lines_of(oai, ended.output_file_id)] == [
        "one"]


def test_uploads_past_the_tenants_file_quota_are_refused_until_files_are_deleted(
    proc_env: dict[str, str], workers: Any
) -> None:
    proc, url = start_api({**proc_env, "CONDUCTOR_TENANT_MAX_FILES": "2"})
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=new_key("tenant-files-quota"), max_retries=0) as client:
            kept = [client.files.create(file=(f"{n}.jsonl", jsonl([chat_line("a", "x")])), purpose="batch")
                    for n in range(2)]
            with pytest.raises(openai.BadRequestError) as refused:
                client.files.create(file=("3.jsonl", jsonl([chat_line("a", "x")])), purpose="batch")
            assert refused.value.code == "quota_exceeded" and "DELETE /v1/files" in refused.value.message
            assert [f.id for f in client.files.list()] == [f.id for f in reversed(kept)]  # nothing stored
            client.files.delete(kept[0].id)
            assert client.files.create(file=("3.jsonl", jsonl([chat_line("a", "x")])), purpose="batch").bytes > 0

            # One slot left, ten uploads at once: the quota check and the insert are one serialized step
            # per tenant, so exactly one takes it.
            client.files.delete(kept[1].id)
            outcomes: list[str] = []

            def upload(n: int) -> None:
                try:
                    client.files.create(file=(f"race{n}.jsonl", jsonl([chat_line("a", "y" * 200_000)])),
                                        purpose="batch")
                    outcomes.append("stored")
                except openai.BadRequestError as exc:
                    outcomes.append(str(exc.code))

            racers = [threading.Thread(target=upload, args=(n,)) for n in range(10)]
            for t in racers:
                t.start()
            for t in racers:
                t.join(30)
            assert sorted(outcomes) == ["quota_exceeded"] * 9 + ["stored"], outcomes
            held = client.files.list().data
            assert len(held) == 2

            # A batch writes its output and error files when it ends: it is refused while they would not fit.
            with pytest.raises(openai.BadRequestError) as no_room:
                client.batches.create(input_file_id=held[0].id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
            assert no_room.value.code == "quota_exceeded" and "output and error files" in no_room.value.message
            assert client.batches.list().data == []
    finally:
        proc.stop()


def test_a_running_batch_keeps_room_for_the_files_it_will_write(proc_env: dict[str, str], workers: Any) -> None:
    """Output and error files are written when a batch ends: each batch still running counts two files
    against the quota, so batches created one after another cannot promise more files than it allows."""
    proc, url = start_api({**proc_env, "CONDUCTOR_TENANT_MAX_FILES": "4"})
    slow = {"task": "t", "workflow": {"model_ids": ["slow"], "subtasks": ["x"], "access_lists": [[]]}}
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=new_key("tenant-batch-room"), max_retries=0) as client:
            uploaded = client.files.create(file=("s.jsonl", jsonl([job_line("s", slow)])), purpose="batch")
            running = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
            with pytest.raises(openai.BadRequestError) as no_room:  # 1 file + 2 to come + 2 asked > 4
                client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
            assert no_room.value.code == "quota_exceeded"
            ended = client.batches.cancel(running.id)
            assert ended.status == "cancelled"
            held = client.files.list().data  # the input and the cancelled batch's error file
            assert len(held) == 2 and sum(f.purpose == "batch_output" for f in held) == 1
            again = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
            assert client.batches.cancel(again.id).status == "cancelled"
    finally:
        proc.stop()


def test_a_page_of_files_does_not_read_their_content(oai: openai.OpenAI) -> None:
    oai.files.create(file=("big.jsonl", jsonl([chat_line("big", "x" * 50_000)])), purpose="batch")
    with sent_statements() as statements, session_scope() as s:
        page = store.list_files(s, tenant="tenant-batch", purpose=None, after=None, limit=100)
        one = store.get_file(s, file_id=page[0].id, tenant="tenant-batch")
        assert one is not None and one.size_bytes > 50_000
        reads = [st for st in statements if "FROM stored_file" in st]
        assert len(reads) == 2 and not any("stored_file.content" in st for st in reads), reads
        assert len(one.content) == one.size_bytes  # read when used


def test_cancel_ends_the_batch_with_what_finished(oai: openai.OpenAI) -> None:
    slow = {"task": "t", "workflow": {"model_ids": ["slow", "slow"], "subtasks": ["x", "y"], "access_lists": [[], [0]]}}
    uploaded = oai.files.create(file=("c.jsonl", jsonl([job_line(f"s{n}", slow) for n in range(3)])), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    running = results_of(oai, batch.id)
    assert running.status_code == 409 and running.json()["error"]["code"] == "batch_not_ended", running.text
    cancelled = oai.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    assert cancelled.request_counts is not None and cancelled.request_counts.failed == 3
    errors = lines_of(oai, cancelled.error_file_id)
    assert [e["custom_id"] for e in errors] == ["s0", "s1", "s2"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}  # as OpenAI's: no response, the error
    assert all(e["response"] is None and "GET /v1/jobs/" in e["error"]["message"] for e in errors)
    with pytest.raises(openai.ConflictError):
        oai.batches.cancel(batch.id)


def test_a_job_cancelled_on_its_own_before_the_batch_keeps_its_409_line(oai: openai.OpenAI) -> None:
    slow = {"task": "t", "workflow": {"model_ids": ["slow", "slow"], "subtasks": ["x", "y"], "access_lists": [[], [0]]}}
    uploaded = oai.files.create(file=("o.jsonl", jsonl([job_line(f"o{n}", slow) for n in range(2)])), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    with session_scope() as s:
        first = s.exec(select(Job.id).where(Job.batch_id == batch.id).order_by(Job.created_at, Job.id)).first()
    with httpx.Client(base_url=str(oai.base_url), timeout=30, headers={"Authorization": f"Bearer {oai.api_key}"}) as h:
        assert h.post(f"jobs/{first}/cancel").status_code == 202
    cancelled = oai.batches.cancel(batch.id)
    errors = {e["custom_id"]: e for e in lines_of(oai, cancelled.error_file_id)}
    own = next(e for e in errors.values() if e["response"] is not None)
    assert own["error"]["code"] == "job_cancelled" and own["response"]["status_code"] == 409
    assert own["response"]["request_id"] == first
    (other,) = [e for e in errors.values() if e is not own]
    assert other["error"]["code"] == "batch_cancelled" and other["response"] is None


def test_the_reconciler_ends_a_batch_no_one_reads(api: str, key: str, workers: Any) -> None:
    """No GET of the batch: the reconciler's pass writes its output once its job has ended."""
    line = job_line("r", {"task": "t", "workflow": {"model_ids": ["a"], "subtasks": ["x"], "access_lists": [[]]}})
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        upload = c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("r.jsonl", jsonl([line]))})
        file_id = upload.json()["id"]
        batch_id = c.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/jobs",
                                               "completion_window": "24h"}).json()["id"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with session_scope() as s:
            job = s.exec(select(Job).where(Job.batch_id == batch_id)).one()
            batch = s.exec(select(Batch).where(Batch.id == batch_id)).one()
        if job.status == "succeeded":
            break
        time.sleep(0.2)
    assert batch.status == "in_progress" and batch.output_file_id is None  # nobody read it
    report, _ = reconcile_once(get_settings())
    assert report["batches_ended"] >= 1
    with session_scope() as s:
        batch = s.exec(select(Batch).where(Batch.id == batch_id)).one()
    assert batch.status == "completed" and batch.output_file_id is not None and batch.completed_at is not None
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        assert c.get(f"/v1/jobs/{job.id}").json()["batch_id"] == batch_id


def test_the_reconciler_expires_a_batch_past_its_window(oai: openai.OpenAI) -> None:
    slow = {"task": "t", "workflow": {"model_ids": ["slow", "slow"], "subtasks": ["x", "y"], "access_lists": [[], [0]]}}
    uploaded = oai.files.create(file=("e.jsonl", jsonl([job_line("e0", slow), job_line("e1", slow)])),
                                purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    with session_scope() as s:  # its 24 hours are up
        s.execute(sa.update(Batch).where(Batch.id == batch.id).values(expires_at=utcnow() - timedelta(seconds=1)))
    report, _ = reconcile_once(get_settings())
    assert report["batches_expired"] == 1
    expired = oai.batches.retrieve(batch.id)
    assert expired.status == "expired" and expired.expired_at is not None
    assert expired.request_counts is not None and expired.request_counts.failed == 2
    errors = lines_of(oai, expired.error_file_id)
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("e0", "batch_expired"), ("e1", "batch_expired")]
    assert all(e["response"] is None for e in errors)


def test_a_batch_whose_jobs_all_ended_completes_even_when_first_looked_at_past_its_window(
        oai: openai.OpenAI) -> None:
    line = job_line("d", {"task": "t", "workflow": {"model_ids": ["a"], "subtasks": ["x"], "access_lists": [[]]}})
    uploaded = oai.files.create(file=("d.jsonl", jsonl([line])), purpose="batch")
    batch = oai.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with session_scope() as s:
            job = s.exec(select(Job).where(Job.batch_id == batch.id)).one()
        if job.status == "succeeded":
            break
        time.sleep(0.2)
    with session_scope() as s:  # nobody read it, and now its 24 hours are up
        s.execute(sa.update(Batch).where(Batch.id == batch.id).values(expires_at=utcnow() - timedelta(seconds=1)))
    report, _ = reconcile_once(get_settings())
    assert report["batches_expired"] == 0 and report["batches_ended"] >= 1
    ended = oai.batches.retrieve(batch.id)
    assert ended.status == "completed" and ended.expired_at is None
    assert ended.request_counts is not None and ended.request_counts.completed == 1
    assert [o["custom_id"] for o in lines_of(oai, ended.output_file_id)] == ["d"]


def test_cli_submit_batch_wait_writes_the_results(proc_env: dict[str, str], api: str, key: str, workers: Any,
                                                  tmp_path: Path) -> None:
    source = tmp_path / "jobs.jsonl"
    # unescaped U+2028 in a question (as JSON.stringify writes it) stays inside its line, on both sides
    requests = [chat_line(f"c{n}", f"q{n}\u2028line two") for n in range(5)] + [
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-5"}}]
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in requests), encoding="utf-8")
    results = tmp_path / "out.jsonl"
    env = {**proc_env, "CONDUCTOR_API_URL": api, "CONDUCTOR_API_KEY": key}
    done = subprocess.run([sys.executable, "-m", "conductor.cli", "submit", "--batch", str(source), "--wait",
                           "--output", str(results)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr  # one line failed: said on stderr, results still written
    assert done.stdout.splitlines()[0].startswith("batch_")
    assert "6/6 (1 failed) completed" in done.stderr and "1 of 6 requests failed" in done.stderr
    with session_scope() as s:
        jobs = list(s.exec(select(Job).where(Job.batch_id == done.stdout.splitlines()[0])))
    used = (f"used {sum(j.input_tokens for j in jobs):,} input tokens (0 cached) and "
            f"{sum(j.output_tokens for j in jobs):,} output tokens (0 reasoning)")
    assert len(jobs) == 5 and used in done.stderr, done.stderr
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == [f"c{n}" for n in range(5)] + ["bad"]
    assert all(line["response"]["body"]["choices"][0]["message"]["content"] == SIM_ANSWER for line in lines[:5])
    assert lines[5]["error"]["code"] == "invalid_body"
    # a wait that was interrupted is taken up again by the batch's id: the same results, nothing re-run
    again = tmp_path / "again.jsonl"
    resumed = subprocess.run([sys.executable, "-m", "conductor.cli", "submit", "--batch-id",
                              done.stdout.splitlines()[0], "--wait", "--output", str(again)],
                             env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 1 and "1 of 6 requests failed" in resumed.stderr, resumed.stderr
    assert again.read_text() == results.read_text()


def test_files_deleted_while_the_sdk_pages_through_them_are_all_deleted(api: str) -> None:
    """``for f in client.files.list(): client.files.delete(f.id)``: each next page is asked for after the
    previous page's last file, deleted by then; the list goes on from where it stood (before: an empty page,
    and the loop ended with a page's worth deleted and the rest left). A cursor that never was one of the
    tenant's files is refused, naming ``after``."""
    with openai.OpenAI(base_url=f"{api}/v1", api_key=new_key("tenant-file-cleanup"), max_retries=0) as client:
        made = {client.files.create(file=(f"f{n}.jsonl", jsonl([chat_line("a", "x")])), purpose="batch").id
                for n in range(7)}
        deleted = set()
        for file in client.files.list(limit=3):  # the SDK's auto-paging: three pages
            assert client.files.delete(file.id).deleted
            deleted.add(file.id)
        assert deleted == made and client.files.list().data == []
        for order in ("desc", "asc"):  # from a deleted file, either way: what stood after it (none left)
            assert client.files.list(after=sorted(made)[0], order=order).data == []  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as unknown:
            client.files.list(after="file-" + "0" * 32)
        assert unknown.value.param == "after" and unknown.value.code == "invalid_cursor"
        with (openai.OpenAI(base_url=f"{api}/v1", api_key=new_key("tenant-file-other"), max_retries=0) as other,
              pytest.raises(openai.BadRequestError)):  # another tenant's deleted file is no cursor of its own
            other.files.list(after=sorted(made)[0])
