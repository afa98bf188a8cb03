"""Failed API-key lookups are limited per client address (``CONDUCTOR_AUTH_FAILURES_PER_MINUTE``), counted
in Redis once a lookup has failed: past the limit an unknown key is 429 with Retry-After instead of 401,
while a valid key from the same address is still served and another address is not affected. It tells such
a client to stop and logs it; each request is still looked up (a refusal before the lookup could lock out a
valid key behind the same address). Real Postgres and Redis; the app in process
(its whole ASGI stack, the client's address chosen per client), and a real uvicorn API for the address a
TCP connection has."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from fastapi.testclient import TestClient

from conductor import quotas
from conductor.quotas import AUTH_FAILURES_BUCKET
from conductor.ratelimit import KEY_PREFIX
from conductor.service.app import create_app
from conductor.settings import get_settings
from tests.integration.conftest import new_key
from tests.integration.harness import free_port, start_api

FAILURES = 3
ADDRESSES = ("10.1.2.3", "10.9.9.9", "2001:db8:1:2::/64", "2001:db8:1:3::/64")


def forget_failures(*addresses: str) -> None:
    client = redis.Redis.from_url(get_settings().broker_url)
    client.delete(*(KEY_PREFIX + AUTH_FAILURES_BUCKET + a for a in addresses))


@pytest.fixture
def limited(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("CONDUCTOR_AUTH_FAILURES_PER_MINUTE", str(FAILURES))
    get_settings.cache_clear()
    forget_failures(*ADDRESSES)
    yield
    monkeypatch.undo()  # (a test may have pointed the broker elsewhere)
    get_settings.cache_clear()
    forget_failures(*ADDRESSES)


def at(address: str, key: str) -> TestClient:
    return TestClient(create_app(), client=(address, 50000), headers={"Authorization": f"Bearer {key}"},
                      raise_server_exceptions=False)


def test_past_the_limit_an_unknown_key_is_429_and_a_valid_key_is_still_served(limited: None) -> None:
    valid = new_key("auth-failures")
    with at("10.1.2.3", "cq_unknown") as scanner, at("10.1.2.3", valid) as neighbour, \
            at("10.9.9.9", "cq_unknown") as elsewhere:
        for _ in range(FAILURES):
            assert scanner.get("/v1/jobs").status_code == 401
        refused = scanner.get("/v1/jobs")
        assert refused.status_code == 429 and refused.headers["content-type"] == "application/problem+json"
        assert int(refused.headers["retry-after"]) >= 1
        assert "CONDUCTOR_AUTH_FAILURES_PER_MINUTE" in refused.json()["detail"], refused.text
        # every way a key is looked up: an upload's (before its body), the OpenAI routes' (their shape: a
        # 401 the SDK does not retry, saying why), the viewer's sign-in (its page)
        upload = scanner.post("/v1/files", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"})
        assert upload.status_code == 401 and upload.headers["retry-after"], upload.text
        assert "too many failed key lookups" in upload.json()["error"]["message"], upload.text
        chat = scanner.post("/v1/chat/completions", json={"model": "conductor", "messages": []})
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key", chat.text
        assert chat.headers["x-should-retry"] == "false" and chat.headers["retry-after"], chat.text
        login = scanner.post("/ui/login", data={"key": "cq_unknown"}, headers={"Authorization": ""})
        assert login.status_code == 429 and "too many from here" in login.text and login.headers["retry-after"]
        # never a valid key, from the same address; never another address; never a request with no key
        assert neighbour.get("/v1/jobs").status_code == 200
        assert elsewhere.get("/v1/jobs").status_code == 401
        assert TestClient(create_app(), client=("10.1.2.3", 50000)).get("/v1/jobs").status_code == 401


def test_an_address_past_the_limit_is_logged_once_a_minute(limited: None, caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quotas, "_warned_at", {}, raising=False)  # (this process logged none yet)
    with at("10.1.2.3", "cq_unknown") as scanner, caplog.at_level(logging.WARNING, logger="conductor.quotas"):
        statuses = [scanner.get("/v1/jobs").status_code for _ in range(FAILURES + 3)]
    assert statuses == [401] * FAILURES + [429] * 3
    warned = [r.getMessage() for r in caplog.records if "too many failed key lookups" in r.getMessage()]
    assert len(warned) == 1 and "10.1.2.3" in warned[0], warned


def test_an_ipv6_64_is_one_bucket_and_an_ipv4_mapped_address_its_ipv4_one(limited: None) -> None:
    for n in range(FAILURES):  # each from another address of one /64
        with at(f"2001:db8:1:2::{n + 1:x}", "cq_unknown") as one:
            assert one.get("/v1/jobs").status_code == 401
    with at("2001:db8:1:2:ffff::9", "cq_unknown") as same_64, at("2001:db8:1:3::1", "cq_unknown") as next_64:
        assert same_64.get("/v1/jobs").status_code == 429
        assert next_64.get("/v1/jobs").status_code == 401
    with at("::ffff:10.1.2.3", "cq_unknown") as mapped, at("10.1.2.3", "cq_unknown") as plain:
        for _ in range(FAILURES):
            assert mapped.get("/v1/jobs").status_code == 401
        assert plain.get("/v1/jobs").status_code == 429


def test_with_redis_away_an_unknown_key_is_401_and_a_valid_key_served(limited: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONDUCTOR_BROKER_URL", f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    get_settings.cache_clear()
    valid = new_key("auth-failures-redis-away")
    with at("10.1.2.3", "cq_unknown") as scanner, at("10.1.2.3", valid) as neighbour:
        for _ in range(FAILURES + 2):
            assert scanner.get("/v1/jobs").status_code == 401  # not counted: no Redis, no 500
        assert neighbour.get("/v1/jobs").status_code == 200


def test_a_real_server_counts_the_connections_address(proc_env: dict[str, str]) -> None:
    forget_failures("127.0.0.1")
    proc, url = start_api({**proc_env, "CONDUCTOR_AUTH_FAILURES_PER_MINUTE": str(FAILURES)})
    try:
        valid = new_key("auth-failures-served")
        with httpx.Client(base_url=url, timeout=30) as http:
            statuses = [http.get("/v1/jobs", headers={"Authorization": "Bearer cq_unknown"}).status_code
                        for _ in range(FAILURES + 1)]
            assert statuses == [401] * FAILURES + [429]
            assert http.get("/v1/jobs", headers={"Authorization": f"Bearer {valid}"}).status_code == 200
        assert redis.Redis.from_url(get_settings().broker_url).exists(KEY_PREFIX + AUTH_FAILURES_BUCKET + "127.0.0.1")
    finally:
        proc.stop()
        forget_failures("127.0.0.1")


def test_the_openai_sdk_past_the_limit_gets_authentication_error_after_one_request(limited: None) -> None:
    """The official SDK retries a 429 (waiting for its Retry-After), so answering the OpenAI routes' failed
    lookups past the limit with 429 made a wrong key cost more failed lookups and end in RateLimitError:
    there it is 401 invalid_api_key (AuthenticationError, never retried) saying why and when."""
    sent: list[str] = []
    with at("10.1.2.3", "cq_unknown") as http:
        http.event_hooks["request"].append(lambda request: sent.append(request.url.path))
        # the SDK as a user has it: max_retries left at its default
        with openai.OpenAI(base_url="http://testserver/v1", api_key="cq_unknown", http_client=http) as client:
            for _ in range(FAILURES):
                with pytest.raises(openai.AuthenticationError):
                    client.models.list()
            sent.clear()
            with pytest.raises(openai.AuthenticationError) as refused:
                client.chat.completions.create(model="conductor", messages=[{"role": "user", "content": "hi"}])
    assert sent == ["/v1/chat/completions"]  # one request: not retried
    response = refused.value.response
    assert response.status_code == 401 and refused.value.code == "invalid_api_key", response.text
    assert response.headers["x-should-retry"] == "false" and int(response.headers["retry-after"]) >= 1
    message = response.json()["error"]["message"]
    assert "too many failed key lookups" in message.lower() and "CONDUCTOR_AUTH_FAILURES_PER_MINUTE" in message
    # the REST routes keep their 429 problem
    with at("10.1.2.3", "cq_unknown") as rest:
        assert rest.get("/v1/jobs").status_code == 429
