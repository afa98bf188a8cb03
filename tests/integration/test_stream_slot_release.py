"""A stream gives its tenant's stream slot back however it ends: its client gone before the first byte,
gone while it runs, or the stream ended. A job events stream whose client left before the response
started kept its slot until it lapsed (``STREAM_TTL_S``, 60 s): the body's generator, which released it
in its ``finally``, was never started, so that ``finally`` never ran. Real Postgres and Redis; the API
as a real uvicorn process (``conductor serve``), and in process through its ASGI stack where the moment
of the disconnect must be exact. No workers: the streamed jobs stay queued, so a stream stays open until
its client leaves or the job is cancelled. The session's workers (started by earlier files) consume the
session's broker, so the jobs are made by an API of this module's own whose broker is a Redis db no
worker reads (``quiet``): on the session's API a job ran its 2.5 s step meanwhile, its stream ended by
itself and gave its slot back before the test looked (a flake of the whole suite, never of this file
alone)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from conductor.quotas import STREAM_TTL_S, STREAMS_KEY
from conductor.service.app import create_app
from conductor.settings import get_settings
from tests.integration.conftest import new_key
from tests.integration.harness import Proc, start_api

RELEASE_WAIT_S = 15.0
"""How long a released slot may take to be seen gone (the release is one Redis command after the
disconnect is noticed); well under ``STREAM_TTL_S``, so a slot left to lapse fails the test."""
assert RELEASE_WAIT_S < STREAM_TTL_S / 2

QUEUED = {"task": "t", "workflow": {"model_ids": ["slow"], "subtasks": ["wait"], "access_lists": [[]]}}


QUIET_DB = 12
"""The Redis db of ``quiet``'s broker (on the session broker's server): no worker of the suite reads it."""


@pytest.fixture(scope="module")
def slots() -> redis.Redis:
    """Where the in-process app counts stream slots: the session's broker."""
    return redis.Redis.from_url(get_settings().broker_url)


@dataclass(frozen=True)
class Quiet:
    api: str
    slots: redis.Redis
    """Where its stream slots are counted (its broker)."""
    proc: Proc


@pytest.fixture(scope="module")
def quiet(proc_env: dict[str, str]) -> Iterator[Quiet]:
    """A real API (``conductor serve``) whose broker is ``QUIET_DB``, which no worker consumes: its jobs stay
    queued, and its stream slots are counted there."""
    url = urlsplit(get_settings().broker_url)._replace(path=f"/{QUIET_DB}").geturl()
    broker = redis.Redis.from_url(url)
    broker.flushdb()
    proc, api = start_api({**proc_env, "CONDUCTOR_BROKER_URL": url})
    try:
        yield Quiet(api, broker, proc)
    finally:
        proc.stop()
        broker.flushdb()


def held(slots: redis.Redis, tenant: str) -> int:
    return int(slots.zcard(STREAMS_KEY + tenant))


def released_soon(slots: redis.Redis, tenant: str) -> bool:
    """Whether the tenant holds no slot within ``RELEASE_WAIT_S`` (a bounded wait, not a timing)."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while time.monotonic() < deadline:
        if held(slots, tenant) == 0:
            return True
        time.sleep(0.05)
    return False


def tenant_with_job(api: str, tenant: str) -> tuple[str, str]:
    """A new key of ``tenant`` and a job of it that stays queued."""
    key = new_key(tenant)
    r = httpx.post(f"{api}/v1/jobs", json=QUEUED, headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 202, r.text
    return key, r.json()["id"]


def raw_request(api: str, path: str, key: str) -> socket.socket:
    """A connection that has sent ``GET path`` and read nothing."""
    target = urlsplit(api)
    conn = socket.create_connection((target.hostname, target.port))
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {target.netloc}\r\nAuthorization: Bearer {key}\r\n"
                 "Accept: text/event-stream\r\n\r\n".encode())
    return conn


@contextmanager
def slot_commands(tenant: str) -> Iterator[list[str]]:
    """The commands Redis runs on ``tenant``'s stream slots while the block runs (``MONITOR``: a take's
    ``ZADD`` inside its script, a release's ``ZREM``), so a test knows the server took a slot it may
    release before any poll of the set could see it."""
    client = redis.Redis.from_url(get_settings().broker_url)
    stop = f"end-of-watch-{uuid.uuid4().hex}"
    seen: list[str] = []
    ready = threading.Event()

    def watch() -> None:
        with client.monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                if stop in command["command"]:
                    return
                if STREAMS_KEY + tenant in command["command"]:
                    seen.append(command["command"].split(" ", 1)[0])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert ready.wait(10)
    client.echo("monitor-started")  # MONITOR is on once a command after it is seen; this one is harmless
    try:
        yield seen
    finally:
        client.echo(stop)
        watcher.join(10)


def count_soon(seen: list[str], command: str, n: int) -> bool:
    """Whether ``command`` was seen ``n`` times within ``RELEASE_WAIT_S``."""
    deadline = time.monotonic() + RELEASE_WAIT_S
    while seen.count(command) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen.count(command) == n


def test_a_client_gone_before_the_first_byte_releases_its_slot(quiet: Quiet) -> None:
    """Clients that send their request and leave at once, having read nothing: each slot the server took
    (seen in Redis) is released, and the tenant holds none."""
    key, job_id = tenant_with_job(quiet.api, "leaves-at-once")
    with slot_commands("leaves-at-once") as seen:
        for _ in range(5):
            raw_request(quiet.api, f"/v1/jobs/{job_id}/events", key).close()
        assert count_soon(seen, "ZADD", 5), seen  # the server took a slot for each
        assert count_soon(seen, "ZREM", 5), seen  # and gave each back
    assert held(quiet.slots, "leaves-at-once") == 0


def first_event(lines: Iterator[str]) -> str:
    """The stream's first event, whole (its lines up to the blank one ending it)."""
    event: list[str] = []
    for line in lines:
        if not line and event:
            break
        if line:
            event.append(line)
    return "\n".join(event)


def open_and_serving(quiet: Quiet, tenant: str, lines: Iterator[str]) -> None:
    """The stream's first event tells its job still queued (a stream that ended at once, its job ended or
    its read failed, would have given its slot back already), and the stream holds its slot; else the
    API's log says why."""
    event = first_event(lines)
    kind, _, data = event.partition("\n")
    assert kind == "event: job" and json.loads(data.removeprefix("data: "))["status"] == "queued", (
        f"{event}\n-- the API's log:\n{quiet.proc.tail()}")
    assert held(quiet.slots, tenant) == 1, f"the stream holds no slot; the API's log:\n{quiet.proc.tail()}"


def test_a_client_gone_mid_stream_releases_its_slot(quiet: Quiet) -> None:
    key, job_id = tenant_with_job(quiet.api, "leaves-mid-stream")
    with (httpx.Client(base_url=quiet.api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client,
          client.stream("GET", f"/v1/jobs/{job_id}/events") as stream):
        assert stream.status_code == 200
        open_and_serving(quiet, "leaves-mid-stream", stream.iter_lines())
    assert released_soon(quiet.slots, "leaves-mid-stream"), "a slot was left to lapse"


def test_a_stream_that_ends_releases_its_slot(quiet: Quiet) -> None:
    key, job_id = tenant_with_job(quiet.api, "stream-ends")
    with (httpx.Client(base_url=quiet.api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client,
          client.stream("GET", f"/v1/jobs/{job_id}/events") as stream):
        lines = stream.iter_lines()
        open_and_serving(quiet, "stream-ends", lines)
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        assert any('"cancelled"' in line for line in lines)  # then the stream ends
    assert released_soon(quiet.slots, "stream-ends"), "a slot was left to lapse"


def asgi_leaving(method: str, path: str, key: str, body: bytes, *, leaves_at: str,
                 on_leave: Callable[[], None]) -> list[dict[str, Any]]:
    """``method path`` through the app's ASGI stack (as uvicorn calls it), its client leaving while the
    server sends its first message of type ``leaves_at``: that ``send`` does not return (as uvicorn's waits
    while a connection takes no more writes) and the next ``receive()`` says the client left, after
    ``on_leave()``. Returns when the app has (the event loop still running: ended, it closes every
    generator left open, which would hide one the response did not close)."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query.encode(),
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"authorization", f"Bearer {key}".encode()),
                         (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        gone = asyncio.Event()
        unread = [body]

        async def receive() -> dict[str, Any]:
            if unread:
                return {"type": "http.request", "body": unread.pop(), "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == leaves_at and not gone.is_set():
                on_leave()
                gone.set()
                await asyncio.Event().wait()  # never sent: the client left

        await create_app()(scope, receive, send)

    asyncio.run(run())
    return sent


@pytest.fixture
def in_process() -> Iterator[None]:
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.mark.parametrize("leaves_at", ["http.response.start", "http.response.body"])
@pytest.mark.parametrize("route", ["events", "chat", "responses", "responses-get"])
def test_a_stream_whose_client_left_while_a_message_was_sent_releases_its_slot_at_once(
    quiet: Quiet, slots: redis.Redis, in_process: None, leaves_at: str, route: str
) -> None:
    """A client gone while the response's head was being sent: the body's generator never started, and
    the slot stayed held until it lapsed (60 s). Gone while an event was being sent: the generator stayed
    suspended at its ``yield``, closed (and the slot released) only when garbage-collected. The slot is
    seen held when the client leaves, and free when the app has returned."""
    tenant = f"gone-{route}-{leaves_at.rsplit('.', 1)[1]}"
    key, job_id = tenant_with_job(quiet.api, tenant)  # (its slots: the in-process app's, on ``slots``)
    if route == "events":
        method, path, body = "GET", f"/v1/jobs/{job_id}/events", b""
    elif route == "chat":
        method, path = "POST", "/v1/chat/completions"
        body = b'{"model": "conductor", "stream": true, "messages": [{"role": "user", "content": "t"}]}'
    elif route == "responses":
        method, path, body = "POST", "/v1/responses", b'{"model": "conductor", "stream": true, "input": "t"}'
    else:  # a stored response streamed (GET ...?stream=true): a background one, queued on the quiet API
        r = httpx.post(f"{quiet.api}/v1/responses", json={"model": "conductor", "input": "t", "background": True},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "queued", r.text
        method, path, body = "GET", f"/v1/responses/{r.json()['id']}?stream=true", b""
    seen: list[int] = []
    sent = asgi_leaving(method, path, key, body, leaves_at=leaves_at, on_leave=lambda: seen.append(held(slots, tenant)))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200, sent
    assert seen == [1]  # the stream held its slot when the client left
    assert held(slots, tenant) == 0, "the slot was left to lapse"
