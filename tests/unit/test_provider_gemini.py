"""GeminiProvider with the real ``google-genai`` SDK against a loopback server speaking generateContent."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conductor.pool.base import CallOptions, Message
from conductor.pool.config import AgentConfig
from conductor.pool.errors import (
    AuthError,
    BadRequest,
    ProviderError,
    ProviderTimeout,
    RateLimited,
    ServerError,
)
from conductor.pool.gemini_provider import GeminiProvider
from conductor.pool.registry import build_provider
from tests.fakes.gemini_server import (
    FakeGeminiServer,
    GeminiReply,
    Reply,
    drop,
    error,
    hang,
    malformed,
    ok,
    rate_limited_with_retry_info,
)

KEY_ENV = "CONDUCTOR_TEST_GEMINI_KEY"
SECRET = "AIza-test-5ecret-0123456789"
MESSAGES = [
    Message("system", "You are terse."),
    Message("user", "Earlier subtask."),
    Message("assistant", "Earlier answer."),
    Message("user", "Context block."),
    Message("user", "Your subtask."),
]
SHORT_TIMEOUT = CallOptions(timeout_s=0.3)


@pytest.fixture(autouse=True)
def api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)


@pytest.fixture
def server() -> Iterator[FakeGeminiServer]:
    with FakeGeminiServer(api_key=SECRET) as srv:
        yield srv


def make_provider(srv: FakeGeminiServer, **fields: object) -> GeminiProvider:
    config = AgentConfig.model_validate(
        {
            "provider": "gemini",
            "model": "gemini-test",
            "base_url": srv.base_url,
            "api_key_env": KEY_ENV,
            **fields,
        }
    )
    return GeminiProvider("researcher", config)


def raised_by(provider: GeminiProvider, options: CallOptions = SHORT_TIMEOUT) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        provider.complete(MESSAGES, options)
    return info.value


def test_success_reports_text_usage_finish_reason_and_model(server: FakeGeminiServer) -> None:
    server.script(ok("Done.", input_tokens=33, output_tokens=4, model="gemini-test-002"))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert completion.text == "Done."
    assert (completion.input_tokens, completion.output_tokens) == (33, 4)
    assert completion.finish_reason == "stop"
    assert completion.extra["finish_reason"] == "STOP"
    assert completion.model == "gemini-test-002"


def test_max_tokens_finish_reason_is_reported_as_length(server: FakeGeminiServer) -> None:
    server.script(ok("Trunc", finish_reason="MAX_TOKENS"))
    assert make_provider(server).complete(MESSAGES, CallOptions()).finish_reason == "length"


@pytest.mark.parametrize("reason", ["IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION", "SAFETY"])
def test_withheld_output_is_reported_as_content_filter(server: FakeGeminiServer, reason: str) -> None:
    server.script(ok("", finish_reason=reason))
    completion = make_provider(server).complete(MESSAGES, CallOptions())
    assert completion.finish_reason == "content_filter"
    assert completion.extra["finish_reason"] == reason


@pytest.mark.parametrize(("reason", "error"), [("OTHER", ServerError), ("LANGUAGE", BadRequest),
                                               ("FINISH_REASON_UNSPECIFIED", ServerError)])
def test_a_stop_with_no_text_and_no_reason_to_act_on_is_an_error(
    server: FakeGeminiServer, reason: str, error: type
) -> None:
    # before: an empty answer that "stopped" (a step succeeded with no output)
    server.script(ok("", finish_reason=reason))
    with pytest.raises(error, match=f"finishReason {reason}"):
        make_provider(server).complete(MESSAGES, CallOptions())
    server.script(ok("Partial", finish_reason="OTHER"))  # text written before it stopped is the answer
    assert make_provider(server).complete(MESSAGES, CallOptions()).text == "Partial"


def test_thinking_tokens_count_as_output_and_thoughts_are_not_text(server: FakeGeminiServer) -> None:
    server.script(
        Reply(
            body={
                "candidates": [
                    {
                        "content": {
                            "role": "model",
                            "parts": [{"text": "pondering", "thought": True}, {"text": "Answer."}],
                        },
                        "finishReason": "STOP",
                    }
                ],
                "usageMetadata": {
                    "promptTokenCount": 10,
                    "candidatesTokenCount": 2,
                    "thoughtsTokenCount": 50,
                },
                "modelVersion": "gemini-test",
            }
        )
    )

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert completion.text == "Answer."
    assert (completion.input_tokens, completion.output_tokens) == (10, 52)
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (0, 50)


def test_cached_content_and_thoughts_are_parts_of_the_input_and_output(server: FakeGeminiServer) -> None:
    # promptTokenCount includes cachedContentTokenCount; candidatesTokenCount leaves out thoughtsTokenCount
    server.script(GeminiReply("Done.", input_tokens=1000, output_tokens=20, cached_content_token_count=600,
                              thoughts_token_count=50))

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.input_tokens, completion.output_tokens) == (1000, 70)
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (600, 50)


def test_without_cache_or_thoughts_counts_both_are_zero(server: FakeGeminiServer) -> None:
    server.script(ok("Done.", input_tokens=33, output_tokens=4))  # the fake's default: neither count is sent

    completion = make_provider(server).complete(MESSAGES, CallOptions())

    assert (completion.input_tokens, completion.output_tokens) == (33, 4)
    assert (completion.cached_input_tokens, completion.reasoning_tokens) == (0, 0)


def test_a_cached_count_beyond_the_prompt_is_clamped_to_it(server: FakeGeminiServer) -> None:
    server.script(GeminiReply("Done.", input_tokens=100, output_tokens=4, cached_content_token_count=4096))

    assert make_provider(server).complete(MESSAGES, CallOptions()).cached_input_tokens == 100


def test_request_shape_on_the_wire(server: FakeGeminiServer) -> None:
    make_provider(server).complete(MESSAGES, CallOptions(temperature=0.4, max_tokens=222))

    (request,) = server.requests
    assert request.path == "/v1beta/models/gemini-test:generateContent"
    assert request.headers["x-goog-api-key"] == SECRET
    body = request.body
    assert body["systemInstruction"]["parts"] == [{"text": "You are terse."}]
    assert [(c["role"], c["parts"]) for c in body["contents"]] == [
        ("user", [{"text": "Earlier subtask."}]),
        ("model", [{"text": "Earlier answer."}]),
        ("user", [{"text": "Context block.\n\nYour subtask."}]),
    ]
    assert body["generationConfig"]["temperature"] == 0.4
    assert body["generationConfig"]["maxOutputTokens"] == 222
    assert "responseMimeType" not in body["generationConfig"]


def test_json_schema_becomes_json_mime_type_and_response_json_schema(server: FakeGeminiServer) -> None:
    schema = {"type": "object", "properties": {"steps": {"type": "array"}}, "required": ["steps"]}

    make_provider(server).complete(MESSAGES, CallOptions(json_schema=schema))

    generation = server.bodies[0]["generationConfig"]
    assert generation["responseMimeType"] == "application/json"
    assert generation["responseJsonSchema"] == schema


def test_registry_builds_this_class() -> None:
    assert isinstance(build_provider("g", AgentConfig(provider="gemini", model="m")), GeminiProvider)


def test_key_is_read_at_call_time_and_missing_key_names_the_variable(
    server: FakeGeminiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = make_provider(server)
    provider.complete(MESSAGES, CallOptions())
    monkeypatch.setenv(KEY_ENV, "AIza-rotated")
    assert isinstance(raised_by(provider), AuthError)
    monkeypatch.delenv(KEY_ENV)

    err = raised_by(provider)

    assert isinstance(err, AuthError)
    assert KEY_ENV in str(err)
    assert [r.headers["x-goog-api-key"] for r in server.requests] == [SECRET, "AIza-rotated"]


def test_429_carries_retry_after_header_and_is_not_retried_by_the_sdk(server: FakeGeminiServer) -> None:
    server.script(error(429, "quota", retry_after="7"))

    err = raised_by(make_provider(server))

    assert isinstance(err, RateLimited)
    assert err.retry_after == 7
    assert len(server.requests) == 1


def test_429_retry_info_detail_is_the_hint_when_there_is_no_header(server: FakeGeminiServer) -> None:
    server.script(rate_limited_with_retry_info("12.5s"))

    err = raised_by(make_provider(server))

    assert isinstance(err, RateLimited)
    assert err.retry_after == 12.5


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
def test_http_status_maps_to_error_type(server: FakeGeminiServer, status: int, expected: type) -> None:
    server.script(error(status, f"scripted {status}"))

    err = raised_by(make_provider(server))

    assert type(err) is expected
    assert err.status == status
    assert f"scripted {status}" in str(err)
    assert len(server.requests) == 1


def test_server_slower_than_timeout_is_a_provider_timeout(server: FakeGeminiServer) -> None:
    server.script(hang(3))
    err = raised_by(make_provider(server), CallOptions(timeout_s=0.3))

    assert isinstance(err, ProviderTimeout)


@pytest.mark.parametrize(
    "reply",
    [
        malformed(),
        Reply(body={"unexpected": "shape"}),
        Reply(body={"candidates": "not-a-list"}),
        Reply(body="<html>gateway</html>", headers={"content-type": "text/html"}),
    ],
    ids=["truncated-json", "no-candidates", "wrong-shape", "not-json"],
)
def test_malformed_body_is_a_retryable_server_error(server: FakeGeminiServer, reply: Reply) -> None:
    server.script(reply)

    err = raised_by(make_provider(server))

    assert isinstance(err, ServerError)
    assert "malformed response" in str(err)


def test_blocked_prompt_is_a_bad_request(server: FakeGeminiServer) -> None:
    server.script(Reply(body={"promptFeedback": {"blockReason": "SAFETY"}}))

    err = raised_by(make_provider(server))

    assert isinstance(err, BadRequest)
    assert "SAFETY" in str(err)


def test_dropped_connection_is_a_server_error(server: FakeGeminiServer) -> None:
    server.script(drop())
    assert isinstance(raised_by(make_provider(server)), ServerError)


@pytest.mark.parametrize(
    "reply",
    [
        error(400, f"API key not valid: {SECRET}"),
        error(500, SECRET),
        hang(3),
        malformed(SECRET.encode()),
        drop(),
    ],
    ids=["400-echo", "500-echo", "timeout", "malformed-echo", "drop"],
)
def test_api_key_never_appears_in_an_error(server: FakeGeminiServer, reply: Reply) -> None:
    server.script(reply)

    err = raised_by(make_provider(server))

    assert SECRET not in str(err)
    assert SECRET not in repr(err)
    assert err.__cause__ is None and err.__suppress_context__
