"""AnthropicProvider with the real ``anthropic`` SDK against a loopback server speaking Messages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conductor.pool.anthropic_provider import AnthropicProvider
from conductor.pool.base import CallOptions, Message
from conductor.pool.config import AgentConfig, Price
from conductor.pool.errors import (
    AuthError,
    BadRequest,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    ServerError,
)
from conductor.pool.registry import build_provider
from tests.fakes.anthropic_server import (
    AnthropicReply,
    FakeAnthropicServer,
    Reply,
    drop,
    error,
    hang,
    malformed,
    ok,
)

KEY_ENV = "CONDUCTOR_TEST_ANTHROPIC_KEY"
SECRET = "sk-ant-test-5ecret-0123456789"
MESSAGES = [
    Message("system", "You are terse."),
    Message("user", "Earlier subtask."),
    Message("assistant", "Earlier answer."),
    Message("user", "Context block."),
    Message("user", "Your subtask."),
]
MESSAGES_ON_WIRE = [{"role": "user", "content": "Earlier subtask."},
                    {"role": "assistant", "content": "Earlier answer."}]
SHORT_TIMEOUT = CallOptions(timeout_s=0.3)


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)


@pytest.fixture
def server() -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer(api_key=SECRET) as srv:
        yield srv


def make_provider(srv: FakeAnthropicServer, **fields: object) -> AnthropicProvider:
    config = AgentConfig.model_validate(
        {
            "provider": "anthropic",
            "model": "claude-test",
            "base_url": srv.base_url,
            "api_key_env": KEY_ENV,
            **fields,
        }
    )
    return AnthropicProvider("critic", config)


def raised_by(provider: AnthropicProvider, options: CallOptions = SHORT_TIMEOUT) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        provider.complete(MESSAGES, options)
    return info.value


def test_success_reports_text_usage_finish_reason_and_model(server: FakeAnthropicServer) -> None:
    server.script(ok("Fine.", input_tokens=40, output_tokens=2, model="claude-test-20260101"))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert completion.text == "Fine."
    assert (completion.input_tokens, completion.output_tokens) == (40, 2)
    assert completion.finish_reason == "stop"
    assert completion.extra["stop_reason"] == "end_turn"
    assert completion.model == "claude-test-20260101"


def test_cache_reads_and_writes_are_added_to_the_input_and_reads_are_its_cached_part(
    server: FakeAnthropicServer,
) -> None:
    # Anthropic's input_tokens leaves out what the prompt cache served (reads) and stored (writes); every
    # provider's input_tokens is the whole prompt, as OpenAI counts it
    server.script(AnthropicReply("Fine.", input_tokens=100, output_tokens=20, cache_read_input_tokens=900,
                                 cache_creation_input_tokens=50))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.input_tokens, completion.output_tokens) == (1050, 20)
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (900, 0)  # no thinking details sent
    assert completion.cache_write_tokens == 50
    # the reads at the cached price; the writes at 1.25x the input price (Anthropic's 5-minute cache)
    price = Price(input_per_mtok=3.0, cached_input_per_mtok=0.3, output_per_mtok=15.0)
    cost = price.cost(completion.input_tokens, completion.output_tokens, completion.cached_input_tokens,
                      completion.cache_write_tokens)
    assert cost == pytest.approx((100 * 3.0 + 50 * 3.75 + 900 * 0.3 + 20 * 15.0) / 1_000_000)


def usage_body(usage: dict[str, object]) -> dict[str, object]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test",
            "content": [{"type": "text", "text": "Fine."}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 40, "output_tokens": 2, **usage}}


@pytest.mark.parametrize(
    "reply",
    [
        ok("Fine.", input_tokens=40, output_tokens=2),  # the fake's default: no cache fields
        Reply(body=usage_body({"cache_creation_input_tokens": None, "cache_read_input_tokens": None})),
        AnthropicReply("Fine.", input_tokens=40, output_tokens=2, cache_read_input_tokens=0,
                       cache_creation_input_tokens=0),
    ],
    ids=["absent", "null", "zero"],
)
def test_no_cache_use_leaves_the_input_as_reported(server: FakeAnthropicServer, reply: Reply) -> None:
    server.script(reply)

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.input_tokens, completion.output_tokens) == (40, 2)
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (0, 0)


def test_cache_writes_alone_are_input_but_not_cached(server: FakeAnthropicServer) -> None:
    server.script(AnthropicReply("Fine.", input_tokens=10, output_tokens=2, cache_creation_input_tokens=2000))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.input_tokens, completion.cached_input_tokens, completion.cache_write_tokens) == (2010, 0, 2000)


@pytest.mark.parametrize("field", ["cache_read_input_tokens", "cache_creation_input_tokens"])
def test_a_cache_count_of_the_wrong_type_is_a_malformed_response(server: FakeAnthropicServer, field: str) -> None:
    server.script(Reply(body=usage_body({field: "lots"})))  # the SDK itself turns "900" into 900

    err = raised_by(make_provider(server))

    assert isinstance(err, ServerError)
    assert "malformed response" in str(err)


def test_max_tokens_stop_reason_is_reported_as_length(server: FakeAnthropicServer) -> None:
    server.script(ok("Trunc", finish_reason="max_tokens"))
    assert make_provider(server).complete(MESSAGES, CallOptions()).finish_reason == "length"


def test_system_goes_to_the_system_parameter_and_turns_alternate(server: FakeAnthropicServer) -> None:
    make_provider(server).complete(MESSAGES, CallOptions(max_tokens=321, temperature=0.9))

    (request,) = server.requests
    assert request.path == "/v1/messages"
    assert request.body["system"] == "You are terse."
    assert request.body["messages"] == [
        {"role": "user", "content": "Earlier subtask."},
        {"role": "assistant", "content": "Earlier answer."},
        {"role": "user", "content": "Context block.\n\nYour subtask."},
    ]
    assert request.body["max_tokens"] == 321
    assert request.body["model"] == "claude-test"
    # API version 2026-10-21 rejects sampling parameters, so none are sent.
    assert "temperature" not in request.body
    assert request.headers["anthropic-version"]


def test_an_earlier_step_that_answered_nothing_is_left_out(server: FakeAnthropicServer) -> None:
    # The Messages API refuses a turn with empty content: a blank earlier answer would fail every step
    # that may see it.
    messages = [Message("user", "Earlier subtask."), Message("assistant", "  \n"), Message("user", "Your subtask.")]
    make_provider(server).complete(messages, CallOptions())

    (request,) = server.requests
    assert request.body["messages"] == [{"role": "user", "content": "Earlier subtask.\n\nYour subtask."}]


def test_the_fake_refuses_an_empty_turn_as_the_api_does(server: FakeAnthropicServer) -> None:
    # The check above would pass vacuously if the fake accepted empty turns.
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": ""}]}
    assert server.invalid(body) is not None and server.invalid({**body, "messages": MESSAGES_ON_WIRE}) is None


def test_no_system_parameter_without_system_messages(server: FakeAnthropicServer) -> None:
    make_provider(server).complete([Message("user", "hi")], CallOptions())
    assert "system" not in server.bodies[0]


def test_json_schema_becomes_output_config_format(server: FakeAnthropicServer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    make_provider(server).complete(MESSAGES, CallOptions(json_schema=schema))
    assert server.bodies[0]["output_config"] == {"format": {"type": "json_schema", "schema": schema}}


def test_registry_builds_this_class() -> None:
    assert isinstance(build_provider("c", AgentConfig(provider="anthropic", model="m")), AnthropicProvider)


def test_key_is_read_at_call_time_and_missing_key_names_the_variable(
    server: FakeAnthropicServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = make_provider(server)
    provider.complete(MESSAGES, CallOptions())
    monkeypatch.delenv(KEY_ENV)

    err = raised_by(provider)

    assert isinstance(err, AuthError)
    assert KEY_ENV in str(err)
    assert len(server.requests) == 1


def test_wrong_key_is_an_auth_error(server: FakeAnthropicServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-ant-wrong")
    err = raised_by(make_provider(server))
    assert isinstance(err, AuthError)
    assert err.status == 401


def test_429_carries_retry_after_and_is_not_retried_by_the_sdk(server: FakeAnthropicServer) -> None:
    server.script(error(429, "rate limited", retry_after="7"))

    err = raised_by(make_provider(server))

    assert isinstance(err, RateLimited)
    assert err.retry_after == 7
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (500, ServerError),
        (529, ServerError),
        (400, BadRequest),
        (404, BadRequest),
        (422, BadRequest),
        (401, AuthError),
        (403, AuthError),
    ],
)
def test_http_status_maps_to_error_type(server: FakeAnthropicServer, status: int, expected: type) -> None:
    server.script(error(status, f"scripted {status}"))

    err = raised_by(make_provider(server))

    assert type(err) is expected
    assert err.status == status
    assert f"scripted {status}" in str(err)
    assert len(server.requests) == 1


def test_server_slower_than_timeout_is_a_provider_timeout(server: FakeAnthropicServer) -> None:
    server.script(hang(3))
    err = raised_by(make_provider(server), CallOptions(timeout_s=0.3))

    assert isinstance(err, ProviderTimeout)


@pytest.mark.parametrize(
    "reply",
    [
        malformed(),
        Reply(body={"unexpected": "shape"}),
        Reply(body="<html>gateway</html>", headers={"content-type": "text/html"}),
    ],
    ids=["truncated-json", "wrong-shape", "not-json"],
)
def test_malformed_body_is_a_retryable_server_error(server: FakeAnthropicServer, reply: Reply) -> None:
    server.script(reply)

    err = raised_by(make_provider(server))

    assert isinstance(err, ServerError)
    assert "malformed response" in str(err)


def test_dropped_connection_is_a_server_error(server: FakeAnthropicServer) -> None:
    server.script(drop())
    assert isinstance(raised_by(make_provider(server)), ServerError)


@pytest.mark.parametrize(
    "reply",
    [error(400, f"bad key {SECRET}"), error(529, SECRET), hang(3), malformed(SECRET.encode()), drop()],
    ids=["400-echo", "529-echo", "timeout", "malformed-echo", "drop"],
)
def test_api_key_never_appears_in_an_error(server: FakeAnthropicServer, reply: Reply) -> None:
    server.script(reply)

    err = raised_by(make_provider(server))

    assert SECRET not in str(err)
    assert SECRET not in repr(err)
    assert err.__cause__ is None and err.__suppress_context__


@pytest.mark.parametrize(("details", "reasoning"), [({"thinking_tokens": 15}, 15), ({"thinking_tokens": 99}, 20),
                                                    ({"thinking_tokens": "n/a"}, 0), (None, 0)])
def test_thinking_tokens_are_the_reasoning_part_of_the_output(
    server: FakeAnthropicServer, details: dict[str, object] | None, reasoning: int,
) -> None:
    server.script(Reply(body=usage_body({"output_tokens": 20, "output_tokens_details": details})))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.output_tokens, completion.reasoning_tokens) == (20, reasoning)  # at most the output


def test_the_fake_reports_thinking_as_the_api_does(server: FakeAnthropicServer) -> None:
    server.script(AnthropicReply("Fine.", input_tokens=10, output_tokens=40, thinking_tokens=25))
    assert make_provider(server).complete(MESSAGES, CallOptions()).reasoning_tokens == 25
