"""OpenAIProvider with the real ``openai`` SDK against a loopback server speaking Chat Completions."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from conductor.pool.base import MAX_OUTPUT_CHARS, CallOptions, Message, storable_escaped, storable_text
from conductor.pool.config import AgentConfig, load_pool
from conductor.pool.errors import (
    AuthError,
    BadRequest,
    ConfigError,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    ServerError,
)
from conductor.pool.grammar import grammar_schema
from conductor.pool.openai_provider import OpenAIProvider
from conductor.pool.registry import build_provider
from conductor.settings import SHIPPED_POOLS_DIR
from tests.fakes.openai_server import FakeOpenAIServer, OpenAIReply, Reply, drop, error, hang, malformed, ok

KEY_ENV = "CONDUCTOR_TEST_OPENAI_KEY"
SECRET = "sk-test-5ecret-0123456789"
MESSAGES = [
    Message("system", "You are terse."),
    Message("user", "Name a colour."),
    Message("assistant", "Blue."),
    Message("user", "Another one."),
]
SHORT_TIMEOUT = CallOptions(timeout_s=0.3)
WORKFLOW_SCHEMA = {
    "type": "object",
    "properties": {"steps": {"type": "array", "items": {"type": "string"}}},
    "required": ["steps"],
    "additionalProperties": False,
}


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)


@pytest.fixture
def server() -> Iterator[FakeOpenAIServer]:
    with FakeOpenAIServer(api_key=SECRET) as srv:
        yield srv


def make_provider(
    srv: FakeOpenAIServer, provider: str = "openai", api_key_env: str | None = KEY_ENV, **fields: object
) -> OpenAIProvider:
    config = AgentConfig.model_validate(
        {
            "provider": provider,
            "model": "gpt-test",
            "base_url": srv.base_url,
            "api_key_env": api_key_env,
            **fields,
        }
    )
    return OpenAIProvider("writer", config)


def raised_by(provider: OpenAIProvider, options: CallOptions = SHORT_TIMEOUT) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        provider.complete(MESSAGES, options)
    return info.value


# -- success -------------------------------------------------------------------------------------


def test_success_reports_text_usage_finish_reason_and_model(server: FakeOpenAIServer) -> None:
    server.script(
        ok("Green.", input_tokens=21, output_tokens=2, finish_reason="length", model="gpt-test-0613")
    )

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert completion.text == "Green."
    assert (completion.input_tokens, completion.output_tokens) == (21, 2)
    assert completion.finish_reason == "length"
    assert completion.model == "gpt-test-0613"
    assert completion.latency_ms >= 0


def test_a_refusal_is_its_text_with_finish_reason_content_filter(server: FakeOpenAIServer) -> None:
    # OpenAI puts a refusal in its own field with content null, and says "stop": reported as Anthropic's
    # stop_reason "refusal" is, so a chat client sees the answer was withheld whatever the provider.
    server.script(Reply(body={
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-test",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": None, "refusal": "I can't help with that."}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15},
    }))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert completion.text == "I can't help with that."
    assert completion.finish_reason == "content_filter"
    assert (completion.input_tokens, completion.output_tokens) == (9, 6)


def test_cached_and_reasoning_tokens_are_read_from_the_usage_details(server: FakeOpenAIServer) -> None:
    # prompt_tokens counts the cached tokens, completion_tokens the reasoning: they are parts, not additions
    server.script(OpenAIReply("Red.", input_tokens=1000, output_tokens=300, cached_tokens=768, reasoning_tokens=256))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.input_tokens, completion.output_tokens) == (1000, 300)
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (768, 256)


def usage_body(usage: dict[str, object]) -> dict[str, object]:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-test",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Red."}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 9, "total_tokens": 49, **usage},
    }


@pytest.mark.parametrize(
    "reply",
    [
        ok("Red.", input_tokens=40, output_tokens=9),  # the fake's default: no details objects, as vLLM sends it
        Reply(body=usage_body({"prompt_tokens_details": None, "completion_tokens_details": None})),
        Reply(body=usage_body({"prompt_tokens_details": {"cached_tokens": None, "audio_tokens": None},
                               "completion_tokens_details": {"reasoning_tokens": None}})),
        Reply(body=usage_body({"prompt_tokens_details": {"audio_tokens": 0}, "completion_tokens_details": {}})),
    ],
    ids=["absent", "null-objects", "null-counts", "counts-absent"],
)
def test_missing_usage_details_are_zero(server: FakeOpenAIServer, reply: Reply) -> None:
    server.script(reply)

    completion = make_provider(server, provider="openai_compatible").complete(MESSAGES, CallOptions())

    assert (completion.input_tokens, completion.output_tokens) == (40, 9)
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (0, 0)


def test_detail_counts_are_clamped_to_their_totals(server: FakeOpenAIServer) -> None:
    server.script(OpenAIReply("Red.", input_tokens=100, output_tokens=10, cached_tokens=500, reasoning_tokens=-3))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (100, 0)


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens_details": {"cached_tokens": "lots"}},  # the SDK itself turns "768" into 768
        {"completion_tokens_details": {"reasoning_tokens": 2.5}},
        {"prompt_tokens_details": 7},
        {"completion_tokens_details": ["reasoning_tokens"]},
    ],
    ids=["cached-string", "reasoning-float", "details-number", "details-list"],
)
def test_malformed_usage_details_count_as_none(server: FakeOpenAIServer, usage: dict[str, object]) -> None:
    """A detail is not worth failing (and paying again for) a call that answered: what is not a count is 0."""
    server.script(Reply(body=usage_body(usage)))

    completion = make_provider(server).complete([Message("user", "hi")], CallOptions())

    assert completion.text and completion.input_tokens > 0
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (0, 0)


def test_text_the_store_cannot_hold_is_made_storable(server: FakeOpenAIServer) -> None:
    # a model can emit NUL (and a compatible server an unpaired surrogate); Postgres text holds neither,
    # and recording the step failed at the database, re-running it until its job failed as a lost worker
    server.script(ok("a\u0000b"))
    assert make_provider(server).complete(MESSAGES, CallOptions()).text == "a\ufffdb"
    assert storable_text("x\ud83dy") == "x?y" and storable_text("plain \u00e9") == "plain \u00e9"


def test_what_a_server_names_and_its_errors_are_made_storable(server: FakeOpenAIServer) -> None:
    # the model name and finish reason go into VARCHAR 256 / 64 columns; an error message into the attempt's
    server.script(ok("fine", model="m" * 300 + "\u0000", finish_reason="stop"), error(400, "bad \u0000 \ud83d"))
    done = make_provider(server).complete(MESSAGES, CallOptions())
    assert done.model == "m" * 256 and done.finish_reason == "stop"
    with pytest.raises(BadRequest) as refused:
        make_provider(server).complete(MESSAGES, CallOptions())
    assert "bad \\u0000 \\ud83d" in str(refused.value)
    assert storable_escaped("a\u0000b\ud83dc") == "a\\u0000b\\ud83dc" and storable_escaped("é") == "é"


def test_messages_model_and_temperature_go_on_the_wire_unchanged(server: FakeOpenAIServer) -> None:
    make_provider(server).complete(MESSAGES, CallOptions(temperature=0.7))

    (body,) = server.bodies
    assert body["model"] == "gpt-test"
    assert body["messages"] == [m.as_dict() for m in MESSAGES]
    assert body["temperature"] == 0.7
    assert "response_format" not in body
    assert server.requests[0].path == "/v1/chat/completions"


def test_an_agent_without_a_temperature_sends_none(server: FakeOpenAIServer) -> None:
    # The research pool's gpt-5 is a reasoning model: the API refuses any temperature but its default.
    gpt5 = load_pool(SHIPPED_POOLS_DIR / "research.yaml").agents["gpt-5"]
    assert gpt5.temperature is None
    provider = make_provider(server, temperature=gpt5.temperature)
    provider.complete(MESSAGES, CallOptions(temperature=provider.config.temperature))

    (body,) = server.bodies
    assert "temperature" not in body and body["messages"] == [m.as_dict() for m in MESSAGES]


@pytest.mark.parametrize(
    ("provider", "sent", "not_sent"),
    [
        ("openai", "max_completion_tokens", "max_tokens"),
        ("openai_compatible", "max_tokens", "max_completion_tokens"),
    ],
)
def test_token_limit_field_depends_on_the_provider_kind(
    server: FakeOpenAIServer, provider: str, sent: str, not_sent: str
) -> None:
    make_provider(server, provider=provider).complete(MESSAGES, CallOptions(max_tokens=123))

    (body,) = server.bodies
    assert body[sent] == 123
    assert not_sent not in body


def test_json_schema_becomes_strict_response_format(server: FakeOpenAIServer) -> None:
    make_provider(server).complete(MESSAGES, CallOptions(json_schema=WORKFLOW_SCHEMA))

    assert server.bodies[0]["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "workflow", "schema": WORKFLOW_SCHEMA, "strict": True},
    }


def test_llama_cpp_server_style_schema_format(server: FakeOpenAIServer) -> None:
    provider = make_provider(server, provider="openai_compatible", options={"schema_format": "json_object"})

    provider.complete(MESSAGES, CallOptions(json_schema=WORKFLOW_SCHEMA))

    sent = server.bodies[0]["response_format"]
    assert sent["type"] == "json_object" and sent["schema"] == grammar_schema(WORKFLOW_SCHEMA)


def test_fold_system_option_moves_system_text_into_the_first_user_turn(server: FakeOpenAIServer) -> None:
    provider = make_provider(server, provider="openai_compatible", options={"fold_system": True})
    messages = [Message("system", "SYS"), Message("user", "Q1"), Message("assistant", "A1"), Message("user", "Q2")]

    provider.complete(messages, CallOptions())

    assert server.bodies[0]["messages"] == [
        {"role": "user", "content": "SYS\n\nQ1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
    ]


def test_no_response_format_when_structured_output_is_off(server: FakeOpenAIServer) -> None:
    provider = make_provider(server, provider="openai_compatible", structured_output=False)

    provider.complete(MESSAGES, CallOptions(json_schema=WORKFLOW_SCHEMA))

    assert "response_format" not in server.bodies[0]


def test_extra_body_option_is_merged_into_the_request(server: FakeOpenAIServer) -> None:
    provider = make_provider(
        server, provider="openai_compatible", options={"extra_body": {"chat_template_kwargs": {"x": 1}}}
    )

    provider.complete(MESSAGES, CallOptions())

    assert server.bodies[0]["chat_template_kwargs"] == {"x": 1}


def test_unknown_option_is_a_config_error() -> None:
    config = AgentConfig(provider="openai", model="m", options={"temprature": 1})
    with pytest.raises(ConfigError, match="agent 'w'"):
        build_provider("w", config)


def test_registry_serves_both_kinds_with_this_class() -> None:
    for kind in ("openai", "openai_compatible"):
        config = AgentConfig(provider=kind, model="m", base_url="http://127.0.0.1:9/v1")
        provider = build_provider("w", config)
        assert isinstance(provider, OpenAIProvider)
        assert provider.name == kind
        assert provider.supports_json_schema


def test_compatible_server_needs_a_base_url() -> None:
    with pytest.raises(ConfigError, match="base_url"):
        OpenAIProvider("w", AgentConfig(provider="openai_compatible", model="m"))


# -- API keys ------------------------------------------------------------------------------------


def test_key_is_read_from_the_environment_at_call_time(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = make_provider(server)
    provider.complete(MESSAGES, CallOptions())
    monkeypatch.setenv(KEY_ENV, "sk-rotated")

    err = raised_by(provider)

    assert isinstance(err, AuthError)
    assert err.status == 401
    assert [r.headers["authorization"] for r in server.requests] == [f"Bearer {SECRET}", "Bearer sk-rotated"]


def test_missing_key_for_openai_names_the_variable_and_sends_nothing(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEY_ENV)

    err = raised_by(make_provider(server))

    assert isinstance(err, AuthError)
    assert KEY_ENV in str(err)
    assert server.requests == []


def test_openai_without_api_key_env_uses_openai_api_key(
    server: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    err = raised_by(make_provider(server, api_key_env=None))
    assert isinstance(err, AuthError)
    assert "OPENAI_API_KEY" in str(err)

    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    assert make_provider(server, api_key_env=None).complete(MESSAGES, CallOptions()).text


def test_compatible_server_without_key_gets_a_placeholder() -> None:
    with FakeOpenAIServer() as srv:
        provider = make_provider(srv, provider="openai_compatible", api_key_env=None)
        provider.complete(MESSAGES, CallOptions())
        assert srv.requests[0].headers["authorization"] == "Bearer not-needed"


# -- failures map to our typed errors -------------------------------------------------------------


def test_429_carries_retry_after_and_is_not_retried_by_the_sdk(server: FakeOpenAIServer) -> None:
    server.script(error(429, "slow down", retry_after="7"))

    err = raised_by(make_provider(server))

    assert isinstance(err, RateLimited)
    assert err.retry_after == 7
    assert err.retryable
    assert len(server.requests) == 1


def test_429_without_retry_after_has_no_hint(server: FakeOpenAIServer) -> None:
    server.script(error(429))
    err = raised_by(make_provider(server))
    assert isinstance(err, RateLimited)
    assert err.retry_after is None


def test_429_out_of_quota_is_not_retried_and_says_what_to_fix(server: FakeOpenAIServer) -> None:
    # OpenAI's body for an account out of credit: a 429 that waiting does not cure.
    message = "You exceeded your current quota, please check your plan and billing details."
    server.script(Reply(status=429, body={"error": {"message": message, "type": "insufficient_quota",
                                                    "param": None, "code": "insufficient_quota"}}))
    err = raised_by(make_provider(server))
    assert not isinstance(err, RateLimited) and not err.retryable and err.error_type == "provider_quota_exhausted"
    assert message in str(err) and "billing" in str(err) and SECRET not in str(err)
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (500, ServerError),
        (503, ServerError),
        (400, BadRequest),
        (404, BadRequest),
        (422, BadRequest),
        (401, AuthError),
        (403, AuthError),
    ],
)
def test_http_status_maps_to_error_type(server: FakeOpenAIServer, status: int, expected: type) -> None:
    server.script(error(status, f"scripted {status}"))

    err = raised_by(make_provider(server))

    assert type(err) is expected
    assert err.status == status
    assert f"scripted {status}" in str(err)
    assert len(server.requests) == 1  # the SDK's own retries are off


def test_server_slower_than_timeout_is_a_provider_timeout(server: FakeOpenAIServer) -> None:
    server.script(hang(3))
    err = raised_by(make_provider(server), CallOptions(timeout_s=0.3))

    assert isinstance(err, ProviderTimeout)


@pytest.mark.parametrize(
    "reply",
    [
        malformed(),
        Reply(body={"unexpected": "shape"}),
        Reply(body={"choices": [], "model": "m"}),
        Reply(body="<html>gateway</html>", headers={"content-type": "text/html"}),
    ],
    ids=["truncated-json", "wrong-shape", "no-choices", "not-json"],
)
def test_malformed_body_is_a_retryable_server_error(server: FakeOpenAIServer, reply: Reply) -> None:
    server.script(reply)

    err = raised_by(make_provider(server))

    assert isinstance(err, ServerError)
    assert "malformed response" in str(err)


def test_dropped_connection_is_a_server_error(server: FakeOpenAIServer) -> None:
    server.script(drop())
    assert isinstance(raised_by(make_provider(server)), ServerError)


def test_refused_connection_is_a_server_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = AgentConfig(
        provider="openai_compatible", model="m", base_url=f"http://127.0.0.1:{port}/v1", api_key_env=KEY_ENV
    )

    err = raised_by(OpenAIProvider("w", config))

    assert isinstance(err, ServerError)
    assert "connection failed" in str(err)


@pytest.mark.parametrize(
    "reply",
    [
        error(400, f"invalid key {SECRET} supplied"),
        error(500, f"upstream said {SECRET}"),
        error(429, SECRET, retry_after="1"),
        hang(3),
        malformed(f'{{"echo": "{SECRET}"'.encode()),
        drop(),
    ],
    ids=["400-echo", "500-echo", "429-echo", "timeout", "malformed-echo", "drop"],
)
def test_api_key_never_appears_in_an_error(server: FakeOpenAIServer, reply: Reply) -> None:
    server.script(reply)

    err = raised_by(make_provider(server))

    assert SECRET not in str(err)
    assert SECRET not in repr(err)
    assert err.__cause__ is None and err.__suppress_context__


def test_text_past_the_output_cap_from_a_server_that_ignored_max_tokens_is_cut_as_length(
    server: FakeOpenAIServer,
) -> None:
    server.script(ok("x" * (MAX_OUTPUT_CHARS + 10), finish_reason="stop"), ok("y" * MAX_OUTPUT_CHARS))
    cut = make_provider(server).complete(MESSAGES, CallOptions(max_tokens=16))
    assert len(cut.text) == MAX_OUTPUT_CHARS and cut.finish_reason == "length"
    whole = make_provider(server).complete(MESSAGES, CallOptions(max_tokens=16))
    assert len(whole.text) == MAX_OUTPUT_CHARS and whole.finish_reason == "stop"  # at the cap: kept as sent
