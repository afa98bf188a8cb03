"""How a chat completion stream and a job event stream end when something fails under them while they
are open, and what their polls read meanwhile. The API runs in-process (``TestClient`` is the HTTP
client, the official ``openai`` SDK's for chat) so a stream's timing constants can be shortened and a
failure staged at the right moment; Postgres, Redis and the workers are real."""

from __future__ import annotations

import json
import logging
import select
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import openai
import pytest
import redis
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from conductor.migrations.migrate import upgrade
from conductor.quotas import SENT_UP_TO_KEY, STREAMS_KEY
from conductor.service import stream_polls
from conductor.service.app import create_app
from conductor.service.routes import jobs as jobs_route
from conductor.service.routes import openai_chat, openai_responses
from conductor.settings import get_settings
from conductor.store.db import get_engine, session_scope
from conductor.store.keys import revoke_key
from tests.integration import harness
from tests.integration.conftest import new_key
from tests.integration.harness import Proc, sent_statements, wait_terminal

FAR_FUTURE_US = 2**52  # a slot expiry (microseconds) no test outlives


@pytest.fixture
def one_stream_each() -> Iterator[None]:
    """Each tenant may hold one open stream (``CONDUCTOR_TENANT_MAX_STREAMS``)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CONDUCTOR_TENANT_MAX_STREAMS", "1")
        get_settings.cache_clear()
        yield
    get_settings.cache_clear()


@pytest.fixture
def http(workers: list[Proc]) -> Iterator[TestClient]:
    with TestClient(create_app(), raise_server_exceptions=False) as client:
        yield client


def _sdk(http: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)


def _events(lines: Iterator[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    kind = ""
    for line in lines:
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            yield kind, json.loads(line.removeprefix("data: "))


def _lapse_and_give_away(tenant: str) -> None:
    """The tenant's one open stream stalled past ``STREAM_TTL_S`` (its slot's expiry passed) and another
    stream, say on another API process, took the place its slot left."""
    slots = redis.Redis.from_url(get_settings().broker_url)
    (slot,) = slots.zrange(STREAMS_KEY + tenant, 0, -1)
    slots.zadd(STREAMS_KEY + tenant, {slot: 0, "another-stream": FAR_FUTURE_US})


def _open_slots(tenant: str, *, forget: bool = True) -> list[bytes]:
    """The tenant's slots; ``forget``: then deletes them (the test is over)."""
    slots = redis.Redis.from_url(get_settings().broker_url)
    held = list(slots.zrange(STREAMS_KEY + tenant, 0, -1))
    if forget:
        slots.delete(STREAMS_KEY + tenant)
    return held


def test_a_chat_stream_whose_slot_lapsed_ends_rather_than_go_over_the_limit(
    http: TestClient, one_stream_each: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_chat, "HEARTBEAT_S", 0.0)  # the slot is refreshed at every event
    tenant = "lapsed-chat-stream"
    key = new_key(tenant)
    http.headers["Authorization"] = f"Bearer {key}"
    stream = _sdk(http, key).chat.completions.create(model="conductor/slow", stream=True,
                                                     messages=[{"role": "user", "content": "z"}])
    job_id = stream.response.headers["conductor-job-id"]
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"
    _lapse_and_give_away(tenant)
    answered = []
    with pytest.raises(openai.APIError) as ended:
        for chunk in chunks:
            answered += [c.delta.content for c in chunk.choices if c.delta.content]
    assert ended.value.code == "rate_limit_exceeded" and answered == []
    assert "slot lapsed" in ended.value.message and f"GET /v1/jobs/{job_id}" in ended.value.message
    assert _open_slots(tenant) == [b"another-stream"]  # the limit held; the stream's slot is gone
    assert wait_terminal(http, job_id)["status"] == "succeeded"  # the job went on without its stream


def test_a_response_stream_whose_slot_lapsed_ends_rather_than_go_over_the_limit(
    http: TestClient, one_stream_each: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a chat stream's, in the Responses API's words: an ``error`` event with the next sequence number."""
    monkeypatch.setattr(openai_chat, "HEARTBEAT_S", 0.0)  # the slot is refreshed at every event
    tenant = "lapsed-response-stream"
    key = new_key(tenant)
    http.headers["Authorization"] = f"Bearer {key}"
    stream = _sdk(http, key).responses.create(model="conductor/slow", input="z", stream=True)
    job_id = stream.response.headers["conductor-job-id"]
    events = iter(stream)
    assert next(events).type == "response.created"
    _lapse_and_give_away(tenant)
    rest = list(events)
    ended = rest[-1]
    assert ended.type == "error" and ended.code == "rate_limit_exceeded", rest
    assert "slot lapsed" in ended.message and job_id in ended.message
    assert [e.sequence_number for e in rest] == list(range(1, len(rest) + 1))
    assert not any(e.type.startswith("response.output") for e in rest)  # it ended before the job did
    assert _open_slots(tenant) == [b"another-stream"]
    assert wait_terminal(http, job_id)["status"] == "succeeded"
    # the error's number was recorded as sent: the ending a later stream sends is numbered after it, so the
    # SDK's resume (a fresh stream, every number up to the error's dropped on the client) gets all of it
    sent = redis.Redis.from_url(get_settings().broker_url).get(SENT_UP_TO_KEY + job_id)
    assert sent is not None and int(sent) >= ended.sequence_number


def test_a_response_stream_whose_slot_lapsed_at_a_keep_alive_records_its_errors_number(
    http: TestClient, one_stream_each: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lapse noticed at a keep-alive (nothing numbered to give back) ends the stream with an error numbered
    next: that number is recorded as sent, so a later stream's ending comes after it (the SDK's resume)."""
    monkeypatch.setattr(openai_chat, "HEARTBEAT_S", 0.0)  # the slot is refreshed at every item sent
    monkeypatch.setattr(openai_responses, "HEARTBEAT_S", 0.0)  # a keep-alive whenever a poll finds nothing
    tenant = "lapsed-response-keep-alive"
    key = new_key(tenant)
    http.headers["Authorization"] = f"Bearer {key}"
    stream = _sdk(http, key).responses.create(model="conductor/slow", input="z", stream=True)
    job_id = stream.response.headers["conductor-job-id"]
    events = iter(stream)
    assert [next(events).type, next(events).type] == ["response.created", "response.in_progress"]  # planning
    _lapse_and_give_away(tenant)  # while the slow planner runs: the next item sent is a keep-alive
    [ended] = list(events)
    assert ended.type == "error" and ended.code == "rate_limit_exceeded" and ended.sequence_number == 2
    sent = redis.Redis.from_url(get_settings().broker_url).get(SENT_UP_TO_KEY + job_id)
    assert sent is not None and int(sent) == 2  # before: 1, and a fresh stream's ending could take 2
    assert _open_slots(tenant) == [b"another-stream"]
    assert wait_terminal(http, job_id)["status"] == "succeeded"


def test_an_event_stream_whose_slot_lapsed_ends_rather_than_go_over_the_limit(
    http: TestClient, one_stream_each: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs_route, "EVENTS_HEARTBEAT_S", 0.0)  # the slot is refreshed at every poll
    tenant = "lapsed-event-stream"
    http.headers["Authorization"] = f"Bearer {new_key(tenant)}"
    workflow = {"model_ids": ["slow", "slow"], "subtasks": ["a", "b"], "access_lists": [[], [0]]}
    job_id = http.post("/v1/jobs", json={"task": "t", "workflow": workflow}).json()["id"]
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        assert stream.status_code == 200
        events = _events(stream.iter_lines())
        next(events)
        _lapse_and_give_away(tenant)
        seen = list(events)
    kind, error = seen[-1]
    assert kind == "error" and error["type"] == "too_many_streams", seen
    assert "slot lapsed" in error["message"] and job_id in error["message"]
    assert not any(k == "job" and e["status"] == "succeeded" for k, e in seen)  # it ended before the job did
    assert _open_slots(tenant) == [b"another-stream"]
    assert wait_terminal(http, job_id)["status"] == "succeeded"


@pytest.fixture(scope="module")
def scratch_database() -> Iterator[str]:
    """A database of the module's own (the test database's name + ``_outage``), migrated: it can be taken
    away from the app mid-stream without disturbing anything else."""
    with harness.scratch_database("outage") as scratch:
        upgrade(scratch)
        try:
            yield scratch
        finally:
            get_engine(scratch).dispose()


@pytest.fixture
def on_scratch(scratch_database: str) -> Iterator[TestClient]:
    """The API in-process on the scratch database (no worker runs its jobs: they stay queued)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CONDUCTOR_DATABASE_URL", scratch_database)
        get_settings.cache_clear()
        with TestClient(create_app(), raise_server_exceptions=False) as client:
            yield client
    get_settings.cache_clear()


@contextmanager
def database_away(url: str) -> Iterator[None]:
    """The database refuses connections and those open are cut: what the app meets when Postgres goes down."""
    name = make_url(url).database
    admin = sa.create_engine(make_url(url).set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :n"),
                         {"n": name})
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()


def test_a_chat_stream_whose_database_stays_away_ends_with_an_error_naming_its_job(
    on_scratch: TestClient, scratch_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the non-stream answer's 503: ``job_wait_failed``, naming the job, then ``[DONE]`` (the SDK
    raises ``APIError`` with the job's id rather than ``APIConnectionError``)."""
    monkeypatch.setattr(stream_polls, "DATABASE_PATIENCE_S", 1.0)
    stream = _sdk(on_scratch, new_key("chat-database-away")).chat.completions.create(
        model="conductor", stream=True, messages=[{"role": "user", "content": "What is 2+2?"}])
    job_id = stream.response.headers["conductor-job-id"]
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"
    with database_away(scratch_database), pytest.raises(openai.APIError) as ended:
        list(chunks)
    assert ended.value.code == "job_wait_failed", ended.value
    assert f"job {job_id} " in ended.value.message and f"GET /v1/jobs/{job_id}" in ended.value.message
    assert "OperationalError" in ended.value.message


def test_a_response_stream_whose_database_stays_away_ends_with_an_error_event_naming_it(
    on_scratch: TestClient, scratch_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a chat stream: ``job_wait_failed``, naming the response's job, as the Responses API's ``error``
    event (the SDK yields it; the stream then ends)."""
    monkeypatch.setattr(stream_polls, "DATABASE_PATIENCE_S", 1.0)
    stream = _sdk(on_scratch, new_key("response-database-away")).responses.create(
        model="conductor", input="What is 2+2?", stream=True)
    job_id = stream.response.headers["conductor-job-id"]
    events = iter(stream)
    assert next(events).type == "response.created"
    with database_away(scratch_database):
        rest = list(events)
    ended = rest[-1]
    assert ended.type == "error" and ended.code == "job_wait_failed", rest
    assert f"job {job_id} " in ended.message and "OperationalError" in ended.message
    assert [e.sequence_number for e in rest] == list(range(1, len(rest) + 1))


def test_an_event_stream_whose_database_stays_away_ends_with_an_error_event(
    on_scratch: TestClient, scratch_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream_polls, "DATABASE_PATIENCE_S", 1.0)
    on_scratch.headers["Authorization"] = f"Bearer {new_key('events-database-away')}"
    job_id = on_scratch.post("/v1/jobs", json={"task": "t"}).json()["id"]
    with on_scratch.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        assert stream.status_code == 200
        events = _events(stream.iter_lines())
        assert next(events) == ("job", {"id": job_id, "status": "queued", "answer": None, "error": None})
        with database_away(scratch_database):
            seen = list(events)
    assert [kind for kind, _ in seen] == ["error"], seen
    assert seen[0][1]["type"] == "job_read_failed" and f"GET /v1/jobs/{job_id}" in seen[0][1]["message"]


def test_an_event_stream_rides_out_a_short_outage(
    on_scratch: TestClient, scratch_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A poll that meets the database away is tried again for a while (``DATABASE_PATIENCE_S``): a
    restart within that goes unnoticed by the client, which then sees the job's next change."""
    caplog.set_level(logging.WARNING, logger=stream_polls.__name__)
    on_scratch.headers["Authorization"] = f"Bearer {new_key('events-database-back')}"
    job_id = on_scratch.post("/v1/jobs", json={"task": "t"}).json()["id"]
    with on_scratch.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        events = _events(stream.iter_lines())
        assert next(events)[1]["status"] == "queued"
        with database_away(scratch_database):
            for _ in range(400):  # until a poll has met the outage (a bound, not a deadline)
                if any("database away" in r.getMessage() for r in caplog.records):
                    break
                threading.Event().wait(0.025)
        with get_engine(scratch_database).begin() as conn:
            conn.execute(sa.text("UPDATE job SET status = 'running' WHERE id = :id"), {"id": job_id})
        assert next(events) == ("job", {"id": job_id, "status": "running", "answer": None, "error": None})
    assert any("database away" in r.getMessage() for r in caplog.records)


class StallingRelay:
    """A TCP relay to the test Redis that can stop passing requests on (``stall``): to the app, Redis
    stops answering, as when it hangs or the network drops its packets, its connections staying open."""

    def __init__(self, url: str):
        target = make_url(url)
        self.target = (target.host or "127.0.0.1", target.port or 6379)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/{target.database or 0}"
        self.flowing = threading.Event()
        self.flowing.set()
        self.held = threading.Event()
        """Set when a request reached the relay while it was stalled."""
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self.resume()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._relay, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._relay, args=(server, client, False), daemon=True).start()

    def _relay(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        try:
            while True:
                if requests:
                    select.select([source], [], [])
                    if not self.flowing.is_set():
                        self.held.set()
                        self.flowing.wait()
                data = source.recv(65536)
                if not data:
                    return
                sink.sendall(data)
        except OSError:
            return
        finally:
            for end in (source, sink):
                end.close()


@pytest.fixture
def relay() -> Iterator[StallingRelay]:
    relay = StallingRelay(get_settings().broker_url)
    yield relay
    relay.close()


@pytest.fixture
def http_via_relay(relay: StallingRelay, workers: list[Proc]) -> Iterator[TestClient]:
    """The API in-process, its Redis (the stream slots') reached through ``relay``."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CONDUCTOR_BROKER_URL", relay.url)
        get_settings.cache_clear()
        with TestClient(create_app(), raise_server_exceptions=False) as client:
            yield client
    get_settings.cache_clear()


def _chat_stream(http: TestClient) -> Callable[[], None]:
    """Opens a chat completion stream and reads its first chunk; returns what reads the rest."""
    chunks = iter(_sdk(http, new_key("stream-end-chat")).chat.completions.create(
        model="conductor", stream=True, messages=[{"role": "user", "content": "What is 2+2?"}]))
    assert next(chunks).choices[0].delta.role == "assistant"

    def rest() -> None:
        assert list(chunks)[-1].choices[0].finish_reason == "stop"

    return rest


def _event_stream(http: TestClient) -> Callable[[], None]:
    http.headers["Authorization"] = f"Bearer {new_key('stream-end-events')}"
    job_id = http.post("/v1/jobs", json={"task": "t"}).json()["id"]
    stream = http.send(http.build_request("GET", f"/v1/jobs/{job_id}/events"), stream=True)
    events = _events(stream.iter_lines())
    next(events)

    def rest() -> None:
        list(events)
        stream.close()

    return rest


@pytest.mark.parametrize("open_stream", [_chat_stream, _event_stream], ids=["chat", "events"])
def test_a_stream_ending_while_redis_does_not_answer_holds_up_no_other_request(
    open_stream: Callable[[TestClient], Callable[[], None]], http_via_relay: TestClient, relay: StallingRelay,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ending stream gives its slot back from a worker thread: with Redis not answering that takes
    its timeouts (then gives up, logged), and meanwhile the process serves other requests. On the event
    loop, as before, every request of the process waited for it."""
    caplog.set_level(logging.WARNING, logger="conductor.quotas")
    read_the_rest = open_stream(http_via_relay)
    relay.stall()
    failed: list[BaseException] = []

    def read() -> None:  # returns once the slot's release has
        try:
            read_the_rest()
        except BaseException as exc:
            failed.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert relay.held.wait(60)  # the stream ended: its release waits for Redis
    assert http_via_relay.get("/healthz").status_code == 200
    assert not [r for r in caplog.records if "not released" in r.getMessage()]  # it was served meanwhile
    relay.resume()
    reader.join(60)
    assert not reader.is_alive() and failed == []


def test_a_stream_whose_client_leaves_gives_its_slot_back(on_scratch: TestClient) -> None:
    """The client leaving cancels the stream while it waits between polls (its job, queued on the scratch
    database, does not change); the slot's release, on a worker thread, is shielded from that
    cancellation (unshielded, it was cancelled too, and the slot held a place until it expired)."""
    tenant = "stream-client-left"
    on_scratch.headers["Authorization"] = f"Bearer {new_key(tenant)}"
    job_id = on_scratch.post("/v1/jobs", json={"task": "t"}).json()["id"]
    with on_scratch.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        events = _events(stream.iter_lines())
        next(events)
        assert len(_open_slots(tenant, forget=False)) == 1
    assert _open_slots(tenant) == []  # left before the job ended: released all the same


def test_a_revoked_key_ends_streams_whose_jobs_are_still_running(
    on_scratch: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream looks its key up again every ``KEY_CHECK_S`` (1 s here), not at each poll: revoked, each
    stream ends with that error though its job (queued on the scratch database, which no worker serves)
    never ends. The stream's own limits, shortened, only keep a broken stream from hanging."""
    monkeypatch.setattr(stream_polls, "KEY_CHECK_S", 1.0)
    monkeypatch.setattr(jobs_route, "EVENTS_MAX_S", 60.0)
    monkeypatch.setenv("CONDUCTOR_CHAT_MAX_WAIT_S", "60")
    get_settings.cache_clear()
    key = new_key("revoked-while-queued")
    chunks = iter(_sdk(on_scratch, key).chat.completions.create(
        model="conductor", stream=True, messages=[{"role": "user", "content": "What is 2+2?"}]))
    assert next(chunks).choices[0].delta.role == "assistant"
    on_scratch.headers["Authorization"] = f"Bearer {key}"
    job_id = on_scratch.post("/v1/jobs", json={"task": "t"}).json()["id"]
    with on_scratch.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        events = _events(stream.iter_lines())
        assert next(events)[1]["status"] == "queued"
        with session_scope() as s:
            assert revoke_key(s, prefix=key[:10]) == 1
        with pytest.raises(openai.APIError) as ended:
            list(chunks)
        assert ended.value.code == "invalid_api_key"
        assert list(events) == [("error", {"type": "key_revoked", "message": "the API key of this stream was revoked"})]


LONG_COLUMNS = ("job.task", "job.context", "job.pool_config", "job.planner_raw", "job.request_workflow",
                "job.metadata", "step.instruction", "step.messages", "step.output")


def _check_polls(statements: list[str]) -> None:
    """While the job ran the stream's polls read its statuses and none of its long texts (the answer was
    read once it had ended); the key was looked up again every few seconds, not at each poll."""
    reads = [st for st in statements if st.lstrip().upper().startswith("SELECT")]
    assert [(column, st) for st in reads for column in LONG_COLUMNS if column in st] == []
    polls = [st for st in reads if "FROM job" in st]
    key_lookups = [st for st in reads if "FROM api_key" in st]
    assert len(polls) >= 3, reads  # a slow planner or slow steps: several polls
    assert len(key_lookups) < len(polls)


def test_a_chat_stream_polls_statuses_and_reads_the_answer_once(http: TestClient) -> None:
    key = new_key("stream-polls-chat")
    with sent_statements() as sent:
        chunks = iter(_sdk(http, key).chat.completions.create(
            model="conductor/slow", stream=True, messages=[{"role": "user", "content": "x" * 5000}]))
        assert next(chunks).choices[0].delta.role == "assistant"
        opened = len(sent)  # the key's lookup and the job's insert came before
        rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in rest).startswith("[a]")
    _check_polls(sent[opened:])


def test_an_event_stream_polls_statuses_and_reads_the_answer_once(http: TestClient) -> None:
    http.headers["Authorization"] = f"Bearer {new_key('stream-polls-events')}"
    workflow = {"model_ids": ["slow", "slow"], "subtasks": ["a", "b"], "access_lists": [[], [0]]}
    job_id = http.post("/v1/jobs", json={"task": "x" * 5000, "workflow": workflow}).json()["id"]
    with sent_statements() as sent, http.stream("GET", f"/v1/jobs/{job_id}/events") as stream:
        events = _events(stream.iter_lines())
        seen = list(events)
    assert seen[-1] == ("job", {"id": job_id, "status": "succeeded", "answer": "[slow] b", "error": None}), seen
    _check_polls(sent)  # opening the stream too: its lookup of the job read the id only
