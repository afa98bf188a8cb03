"""Per-tenant quotas on a real API process (its own, with small quotas) and the shared workers: a
tenant over a quota gets 429 problem+json with Retry-After while another tenant's jobs run normally.
Also: an event stream ends when its key is revoked, and deeply nested JSON is a 422, not a 500."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
import sqlalchemy as sa

from conductor.quotas import (
    ENDING_AT_KEY,
    ENDING_AT_TTL_S,
    SENT_UP_TO_KEY,
    STREAMS_KEY,
    close_stream,
    ending_at,
    note_ending_at,
    note_sent_up_to,
    open_stream,
    refresh_stream,
)
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import get_engine, session_scope
from conductor.store.keys import revoke_key
from conductor.store.models import Job, utcnow
from tests.integration.conftest import new_key
from tests.integration.harness import Proc, start_api, wait_terminal

SUBMITS_PER_MINUTE = 6  # one refill every 10 s: nothing refills while a test counts
IN_FLIGHT = 2


def wf(agents: list[str]) -> dict[str, Any]:
    return {"model_ids": agents, "subtasks": [f"part {i}" for i in range(len(agents))],
            "access_lists": [[i - 1] if i else [] for i in range(len(agents))]}


@pytest.fixture(scope="module")
def quota_api(proc_env: dict[str, str], workers: list[Proc]) -> Iterator[str]:
    env = {**proc_env, "CONDUCTOR_TENANT_SUBMITS_PER_MINUTE": str(SUBMITS_PER_MINUTE),
           "CONDUCTOR_TENANT_MAX_JOBS_IN_FLIGHT": str(IN_FLIGHT), "CONDUCTOR_TENANT_MAX_STREAMS": "1",
           "CONDUCTOR_TENANT_MAX_BATCH_JOBS_IN_FLIGHT": str(IN_FLIGHT + 1)}
    proc, url = start_api(env)
    yield url
    proc.stop()


def tenant_client(url: str, tenant: str) -> httpx.Client:
    return tenant_client_for_key(url, new_key(tenant))


def test_a_batch_larger_than_the_batch_quota_is_refused_as_a_400_saying_to_split_it(quota_api: str) -> None:
    lines = "".join(json.dumps({"custom_id": f"s{n}", "method": "POST", "url": "/v1/jobs",
                                "body": {"task": "t", "workflow": wf(["a"])}}) + "\n" for n in range(IN_FLIGHT + 2))
    with openai.OpenAI(base_url=f"{quota_api}/v1", api_key=new_key("batcher-big"), max_retries=0) as client:
        uploaded = client.files.create(file=("big.jsonl", lines.encode()), purpose="batch")
        with pytest.raises(openai.BadRequestError) as refused:  # waiting would never admit it: not a 429
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
        assert refused.value.code == "invalid_file"
        assert f"has {IN_FLIGHT + 2} lines; a tenant may have at most {IN_FLIGHT + 1}" in str(refused.value)
        assert "split the file" in str(refused.value)
        assert client.batches.list().data == []


def tenant_client_for_key(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def assert_429(r: httpx.Response, title: str) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert int(r.headers["Retry-After"]) >= 1
    body = r.json()
    assert body["status"] == 429 and body["title"] == title and body["detail"]


def test_jobs_in_flight_quota_refuses_one_tenant_and_not_another(quota_api: str) -> None:
    with tenant_client(quota_api, "greedy-inflight") as greedy, tenant_client(quota_api, "polite-inflight") as polite:
        slow = [greedy.post("/v1/jobs", json={"task": "t", "workflow": wf(["slow", "slow"])}) for _ in range(IN_FLIGHT)]
        assert [r.status_code for r in slow] == [202] * IN_FLIGHT
        refused = greedy.post("/v1/jobs", json={"task": "t", "workflow": wf(["a"])})
        assert_429(refused, "Too many jobs in flight")
        assert f"the limit is {IN_FLIGHT}" in refused.json()["detail"]
        chat = greedy.post("/v1/chat/completions", json={"model": "conductor", "messages": [
            {"role": "user", "content": "hi"}]})  # the OpenAI-compatible route counts too, in its own shape
        assert chat.status_code == 429 and int(chat.headers["Retry-After"]) >= 1, chat.text
        assert chat.json()["error"]["type"] == "rate_limit_error"

        other = polite.post("/v1/jobs", json={"task": "t", "workflow": wf(["a", "b"])})
        assert other.status_code == 202, other.text
        assert wait_terminal(polite, other.json()["id"])["status"] == "succeeded"

        for r in slow:  # once greedy's jobs end, it may submit again
            assert wait_terminal(greedy, r.json()["id"])["status"] == "succeeded"
        again = greedy.post("/v1/jobs", json={"task": "t", "workflow": wf(["a"])})
        assert again.status_code == 202, again.text
        assert wait_terminal(greedy, again.json()["id"])["status"] == "succeeded"


def test_a_batch_runs_apart_from_the_live_jobs_in_flight_quota(quota_api: str) -> None:
    """A batch with more lines than the tenant's jobs-in-flight limit leaves its live submissions alone (they
    were all refused until the batch had nearly ended); batches are bounded by their own quota."""
    key = new_key("batcher")
    slow = {"task": "t", "workflow": wf(["slow", "slow"])}
    lines = "".join(json.dumps({"custom_id": f"s{n}", "method": "POST", "url": "/v1/jobs", "body": slow}) + "\n"
                    for n in range(IN_FLIGHT + 1))
    with openai.OpenAI(base_url=f"{quota_api}/v1", api_key=key, max_retries=0) as client, \
            tenant_client_for_key(quota_api, key) as http:
        uploaded = client.files.create(file=("s.jsonl", lines.encode()), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
        live = [http.post("/v1/jobs", json={"task": "t", "workflow": wf(["slow"])}) for _ in range(IN_FLIGHT)]
        assert [r.status_code for r in live] == [202] * IN_FLIGHT, [r.text for r in live]
        assert_429(http.post("/v1/jobs", json={"task": "t", "workflow": wf(["a"])}), "Too many jobs in flight")

        with pytest.raises(openai.RateLimitError) as refused:  # its lines and these would pass the batch quota
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
        assert f"has {IN_FLIGHT + 1} unfinished batch lines and this batch has {IN_FLIGHT + 1}" in str(refused.value)
        assert client.batches.cancel(batch.id).status == "cancelled"
        again = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
        assert client.batches.cancel(again.id).status == "cancelled"
        for r in live:
            assert wait_terminal(http, r.json()["id"])["status"] == "succeeded"


def test_concurrent_submissions_cannot_both_take_the_last_place(quota_api: str) -> None:
    with tenant_client(quota_api, "racer") as racer:
        results: list[int] = []

        def submit() -> None:
            results.append(racer.post("/v1/jobs", json={"task": "t", "workflow": wf(["slow"])}).status_code)

        threads = [threading.Thread(target=submit) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(results) == [202] * IN_FLIGHT + [429] * (4 - IN_FLIGHT)


def test_submit_rate_quota_refuses_one_tenant_and_not_another(quota_api: str) -> None:
    with tenant_client(quota_api, "bursty") as bursty, tenant_client(quota_api, "steady") as steady:
        for _ in range(SUBMITS_PER_MINUTE):  # each job is cancelled at once: only the rate counts here
            created = bursty.post("/v1/jobs", json={"task": "t", "workflow": wf(["a"])})
            assert created.status_code == 202, created.text
            bursty.post(f"/v1/jobs/{created.json()['id']}/cancel")
        refused = bursty.post("/v1/jobs", json={"task": "t", "workflow": wf(["a"])})
        assert_429(refused, "Too many submissions")
        assert int(refused.headers["Retry-After"]) <= 60 // SUBMITS_PER_MINUTE

        other = steady.post("/v1/jobs", json={"task": "t", "workflow": wf(["a"])})
        assert other.status_code == 202, other.text
        assert wait_terminal(steady, other.json()["id"])["status"] == "succeeded"


def read_events(stream: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = ""
    for line in stream.iter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield kind, json.loads(line.removeprefix("data: "))


def test_event_streams_per_tenant_are_capped(quota_api: str) -> None:
    with tenant_client(quota_api, "watcher") as watcher, tenant_client(quota_api, "other-watcher") as other:
        job_id = watcher.post("/v1/jobs", json={"task": "t", "workflow": wf(["slow", "slow"])}).json()["id"]
        other_id = other.post("/v1/jobs", json={"task": "t", "workflow": wf(["a"])}).json()["id"]
        with watcher.stream("GET", f"/v1/jobs/{job_id}/events") as first:
            assert first.status_code == 200
            events = read_events(first)
            next(events)  # the stream is open and serving
            assert_429(watcher.get(f"/v1/jobs/{job_id}/events"), "Too many event streams")
            with other.stream("GET", f"/v1/jobs/{other_id}/events") as theirs:
                assert theirs.status_code == 200
                got = list(read_events(theirs))
                assert [e for k, e in got if k == "job"][-1]["status"] == "succeeded", got
            assert [e for k, e in events if k == "job"][-1]["status"] == "succeeded"
        # The first stream ended with its job: its slot is free again.
        with watcher.stream("GET", f"/v1/jobs/{job_id}/events") as again:
            assert again.status_code == 200
            assert [e for k, e in read_events(again) if k == "job"][-1]["status"] == "succeeded"


def test_an_event_stream_ends_when_its_key_is_revoked(quota_api: str) -> None:
    key = new_key("revoked-watcher")
    with httpx.Client(base_url=quota_api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        job_id = c.post("/v1/jobs", json={"task": "t", "workflow": wf(["slow", "slow", "slow"])}).json()["id"]
        seen: list[tuple[str, dict[str, Any]]] = []
        with c.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
            for kind, event in read_events(stream):
                seen.append((kind, event))
                if len(seen) == 1:
                    with session_scope() as s:
                        assert revoke_key(s, prefix=key[:10]) == 1
        assert seen[-1] == ("error", {"type": "key_revoked", "message": "the API key of this stream was revoked"})
        assert not any(k == "job" and e["status"] == "succeeded" for k, e in seen)  # it ended before the job did
        assert c.get(f"/v1/jobs/{job_id}").status_code == 401


def test_a_lapsed_stream_slot_is_taken_again_only_under_the_limit() -> None:
    """A stream refreshes its slot; one not refreshed within STREAM_TTL_S (its API process stalled) lapses
    and its place can go to a new stream. Its next refresh then counts against the limit like a new
    stream: refused (the stream must end) while the tenant holds its limit, taken once a place is free."""
    settings = get_settings().model_copy(update={"tenant_max_streams": 2})
    tenant, slots = "lapsing-streams", redis.Redis.from_url(get_settings().broker_url)
    zset = STREAMS_KEY + tenant
    open_stream(tenant, "a", settings)
    open_stream(tenant, "b", settings)
    refresh_stream(tenant, "a", settings)  # held: extended
    slots.zadd(zset, {"a": 0})  # a's refresher stalled: its expiry passed
    open_stream(tenant, "c", settings)  # a's place went to c
    refreshed = refresh_stream(tenant, "a", settings)
    assert sorted(slots.zrange(zset, 0, -1)) == [b"b", b"c"]  # not three open where two may be
    assert refreshed is False
    close_stream(tenant, "c", settings)
    assert refresh_stream(tenant, "a", settings) is True  # a place is free: taken again
    assert sorted(slots.zrange(zset, 0, -1)) == [b"a", b"b"]
    slots.delete(zset)


def test_deeply_nested_json_is_a_422_not_a_500(client: httpx.Client) -> None:
    deep = "[" * 300 + "]" * 300
    for body in (f'{{"task": "t", "metadata": {{"x": {deep}}}}}',
                 f'{{"task": "t", "workflow": {{"model_ids": ["a"], "subtasks": ["s"], "access_lists": [[]], '
                 f'"x": {deep}}}}}'):
        r = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert "nested more than" in r.json()["detail"]


def test_a_submission_waits_for_the_one_taking_the_last_place_and_then_sees_it() -> None:
    """The in-flight check is the insert's own condition, sent in one pipeline after the tenant's lock:
    a second submission blocks on that lock until the first commits, then counts its job."""

    def job_of(tenant: str) -> Job:
        return Job.model_construct(tenant=tenant, task="t", pool="default", pool_config={}, planner="x",
                                   limits={}, meta={}, request_hash="h")

    first, second = job_of("lastplace"), job_of("lastplace")
    outcome: list[bool] = []
    with session_scope() as holder:
        assert store.insert_job_admitted(holder, job=first, max_in_flight=1)  # the last place, not committed

        def race() -> None:
            with session_scope() as s:
                outcome.append(store.insert_job_admitted(s, job=second, max_in_flight=1))

        racer = threading.Thread(target=race)
        racer.start()
        racer.join(1.0)
        assert racer.is_alive() and outcome == []  # waiting on the tenant's lock, not counting past it
    racer.join(30)
    assert outcome == [False]  # it counted the first job once that committed: nothing inserted
    with session_scope() as s:
        assert store.count_jobs_in_flight(s, tenant="lastplace") == 1
        assert store.get_job(s, job_id=second.id) is None
    with session_scope() as s:  # a higher limit admits it
        assert store.insert_job_admitted(s, job=second, max_in_flight=2)
    third = job_of("lastplace")
    with session_scope() as s:  # the count stops at the limit: 2 in flight is "not under 2" however counted
        assert not store.insert_job_admitted(s, job=third, max_in_flight=2)
        assert not store.insert_job_admitted(s, job=third, max_in_flight=1)
        assert store.insert_job_admitted(s, job=third, max_in_flight=3)


def test_committing_with_the_insert_releases_the_tenant_at_once() -> None:
    first = Job.model_construct(tenant="onetrip", task="t", pool="default", pool_config={}, planner="x", limits={},
                                meta={}, request_hash="h")
    with session_scope() as holder:
        assert store.insert_job_admitted(holder, job=first, max_in_flight=2, commit=True)
        with session_scope() as other:  # before the holder's session ends: committed, lock released
            assert store.get_job(other, job_id=first.id) is not None
            second = Job.model_construct(tenant="onetrip", task="t", pool="default", pool_config={}, planner="x",
                                         limits={}, meta={}, request_hash="h")
            assert store.insert_job_admitted(other, job=second, max_in_flight=2)
    with session_scope() as s:
        assert store.count_jobs_in_flight(s, tenant="onetrip") == 2


def test_a_jobs_companion_rows_go_in_its_insert_pipeline_and_only_with_an_admitted_job() -> None:
    """``then`` statements (a Responses API job's ``openai_response`` row) are sent after the job's insert in
    its pipeline and committed with it: the tenant's lock is released with no round trip of the client's in
    between (before, the route added the row with an ORM flush and then committed: two round trips more
    under that lock). A job the quota refuses gets no companion row."""
    from conductor.store.models import OpenAIResponse
    from conductor.store.responses import response_insert

    def job() -> Job:
        return Job.model_construct(tenant="companion", task="t", pool="default", pool_config={}, planner="x",
                                   limits={}, meta={}, request_hash="h")

    def row(job_id: str) -> OpenAIResponse:
        return OpenAIResponse(job_id=job_id, model="conductor", background=True, instructions=False)

    sent: list[str] = []

    def capture(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        sent.append(("|" if cursor.connection.pgconn.pipeline_status != 0 else "") + statement.split()[0])

    first, refused = job(), job()
    engine = get_engine()
    sa.event.listen(engine, "before_cursor_execute", capture)
    try:
        with session_scope() as holder:
            assert store.insert_job_admitted(holder, job=first, max_in_flight=1, commit=True,
                                             then=[response_insert(row(first.id))])
            with session_scope() as other:  # committed, the tenant's lock released, before the holder's end
                found = other.get(OpenAIResponse, first.id)
                assert found is not None and found.background
                assert not store.insert_job_admitted(other, job=refused, max_in_flight=1, commit=True,
                                                     then=[response_insert(row(refused.id))])
    finally:
        sa.event.remove(engine, "before_cursor_execute", capture)
    assert sent[:3] == ["|SELECT", "|INSERT", "|INSERT"], sent  # the lock, the job, its row: one pipeline
    with session_scope() as s:
        assert store.get_job(s, job_id=refused.id) is None and s.get(OpenAIResponse, refused.id) is None


def test_a_duplicate_idempotency_key_in_the_pipelined_insert_raises_and_rolls_back() -> None:
    def job() -> Job:
        return Job.model_construct(tenant="dupkey", task="t", pool="default", pool_config={}, planner="x",
                                   limits={}, meta={}, request_hash="h", idempotency_key="same-key")

    first, second = job(), job()
    with session_scope() as s:
        assert store.insert_job_admitted(s, job=first, max_in_flight=5, commit=True)
    with session_scope() as s:  # what create_job does on the race: roll back, then read the winner
        with pytest.raises(sa.exc.IntegrityError):
            store.insert_job_admitted(s, job=second, max_in_flight=5, commit=True)
        s.rollback()
        winner = store.get_job_by_idempotency_key(s, tenant="dupkey", key="same-key")
        assert winner is not None and winner.id == first.id
    with session_scope() as s:
        assert store.count_jobs_in_flight(s, tenant="dupkey") == 1


def test_the_tenants_in_flight_row_follows_every_change_of_its_jobs() -> None:
    """On Postgres the quota reads ``tenant_in_flight`` (one row per tenant), kept by triggers on ``job``
    in the transaction of each change; after every kind of change it equals a count of the jobs."""
    tenant = "counted"

    def job(**extra: Any) -> Job:  # marked as sent, so that no reconciler pass sends it meanwhile
        return Job.model_construct(tenant=tenant, task="t", pool="default", pool_config={}, planner="x",
                                   limits={}, meta={}, request_hash="h", enqueued_at=utcnow(), **extra)

    def counts() -> tuple[int, int]:
        with session_scope() as s:
            counted = s.execute(sa.text(
                "SELECT count(*) FROM job WHERE tenant = :t AND parent_job_id IS NULL AND batch_id IS NULL "
                "AND status IN ('queued', 'planning', 'running')"), {"t": tenant}).scalar_one()
            return store.count_jobs_in_flight(s, tenant=tenant), int(counted)

    def set_status(job_id: str, status: str) -> None:
        with session_scope() as s:
            s.execute(sa.text("UPDATE job SET status = :s WHERE id = :id"), {"s": status, "id": job_id})
            s.commit()

    jobs = [job() for _ in range(4)]
    with session_scope() as s:
        for j in jobs:
            assert store.insert_job_admitted(s, job=j, max_in_flight=10)
        s.commit()
    try:
        _follow(jobs, job, counts, set_status)
    finally:  # rows no worker or reconciler should ever meet (a made-up pool, a child of no step)
        with session_scope() as s:
            s.execute(sa.text("DELETE FROM job WHERE tenant = :t AND parent_job_id IS NOT NULL"), {"t": tenant})
            s.execute(sa.text("DELETE FROM job WHERE tenant = :t"), {"t": tenant})
            s.commit()
    assert counts() == (0, 0)


def _follow(jobs: list[Job], job: Any, counts: Any, set_status: Any) -> None:
    assert counts() == (4, 4)
    set_status(jobs[0].id, "planning")  # still in flight
    set_status(jobs[0].id, "running")
    assert counts() == (4, 4)
    set_status(jobs[0].id, "succeeded")
    set_status(jobs[1].id, "cancelled")
    assert counts() == (2, 2)
    set_status(jobs[1].id, "queued")  # a replayed or re-queued job counts again
    assert counts() == (3, 3)
    child = job(parent_job_id=jobs[2].id, status="queued")  # a nested run is its parent's step, not a job
    with session_scope() as s:
        store.insert_job(s, job=child)
        s.commit()
    set_status(child.id, "running")
    assert counts() == (3, 3)
    line = job(batch_id="batch_counted", status="queued")  # a batch's line: bounded by the batches quota
    with session_scope() as s:
        store.insert_job(s, job=line)
        s.commit()
    assert counts() == (3, 3)
    set_status(line.id, "succeeded")
    set_status(line.id, "queued")
    assert counts() == (3, 3)
    with session_scope() as s:  # rolled back: nothing changes
        s.execute(sa.text("UPDATE job SET status = 'failed' WHERE tenant = :t"), {"t": jobs[0].tenant})
        assert store.count_jobs_in_flight(s, tenant=jobs[0].tenant) == 0  # its own transaction sees its change
        s.rollback()
    assert counts() == (3, 3)
    with session_scope() as s:
        s.execute(sa.text("DELETE FROM job WHERE id = :id"), {"id": jobs[3].id})
        s.commit()
    assert counts() == (2, 2)
    with session_scope() as s:  # TRUNCATE fires no row trigger: a statement trigger empties the rows
        s.execute(sa.text("TRUNCATE job CASCADE"))
        assert store.count_jobs_in_flight(s, tenant=jobs[0].tenant) == 0
        s.rollback()
    assert counts() == (2, 2)


def test_a_responses_ending_number_is_kept_for_streams_below_it_and_replaced_by_one_past_it() -> None:
    """``note_ending_at`` (real Redis): a stream about to send a response's ending at a number not above the
    recorded one takes the recorded one (its ending keeps the numbers a resume uses, a gap before them); a
    stream already past it (the resume of a stream whose client dropped) records its own, with the key's
    week-long expiry."""
    settings = get_settings()
    job_id = uuid.uuid4().hex
    assert ending_at(job_id, settings) is None
    assert note_ending_at(job_id, 10, settings) == 10
    assert note_ending_at(job_id, 4, settings) == 10 and ending_at(job_id, settings) == 10
    assert note_ending_at(job_id, 10, settings) == 10
    assert note_ending_at(job_id, 15, settings) == 15 and ending_at(job_id, settings) == 15
    ttl = redis.Redis.from_url(settings.broker_url).ttl(ENDING_AT_KEY + job_id)
    assert ENDING_AT_TTL_S - 60 < ttl <= ENDING_AT_TTL_S


def test_a_responses_ending_is_first_recorded_after_every_number_its_streams_sent() -> None:
    """``note_sent_up_to`` keeps the highest number any stream of a response is about to send; the ending's
    first record is past it (a fresh stream numbering from 0 again still puts its ending after what a dropped
    client saw), and then kept for streams not past it: two streams agree."""
    settings = get_settings()
    job_id = uuid.uuid4().hex
    note_sent_up_to(job_id, 9, settings)
    note_sent_up_to(job_id, 5, settings)  # another stream, behind: the highest is kept
    assert redis.Redis.from_url(settings.broker_url).get(SENT_UP_TO_KEY + job_id) == b"9"
    assert note_ending_at(job_id, 4, settings) == 10  # a fresh stream at 4: after the 9 a client may have seen
    assert note_ending_at(job_id, 10, settings) == 10  # the stream that sent 9 reaches its end: the same numbers
    assert note_ending_at(job_id, 7, settings) == 10
    other = uuid.uuid4().hex
    note_sent_up_to(other, 3, settings)
    assert note_ending_at(other, 4, settings) == 4  # one stream, its numbers in a row: no gap
