"""What the official ``openai`` client sends is a request the chat route accepts: the bodies are captured
from the SDK itself (its transport is the only fake), then validated as the route validates them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from conductor.chat import ChatRequestError, chat_job
from conductor.errors import Rejection
from conductor.openai_wire import MAX_MODEL_CHARS, ChatCompletionRequest
from conductor.settings import Settings
from conductor.submission import MAX_PLANNER_CHARS


def sent_by_sdk(**kwargs: Any) -> dict[str, Any]:
    bodies: list[dict[str, Any]] = []

    def capture(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "captured", "type": "x", "param": None, "code": None}})

    with httpx.Client(transport=httpx.MockTransport(capture)) as http:
        client = openai.OpenAI(base_url="http://capture/v1", api_key="k", http_client=http, max_retries=0)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="conductor", messages=[{"role": "user", "content": "hi"}], **kwargs)
    (body,) = bodies
    return body


def test_stream_none_is_sent_as_null_and_means_not_streamed() -> None:
    body = sent_by_sdk(stream=None, stream_options=None)
    assert body["stream"] is None  # the SDK's types admit it (stream: Optional[Literal[False]])
    request = ChatCompletionRequest.model_validate(body)
    assert not request.stream and request.stream_options is None


def test_include_usage_null_is_false() -> None:
    body = sent_by_sdk(stream=True, stream_options={"include_usage": None})
    request = ChatCompletionRequest.model_validate(body)
    assert request.stream is True
    assert request.stream_options is not None and not request.stream_options.include_usage


def test_a_model_naming_a_planner_longer_than_any_is_model_not_found() -> None:
    # the model field admits more than a job's planner does: refused as an unknown model, not a 500
    model = "conductor/" + "x" * (MAX_PLANNER_CHARS + 1)
    assert len(model) <= MAX_MODEL_CHARS
    request = ChatCompletionRequest.model_validate({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ChatRequestError) as refused:
        chat_job(request, Settings())
    assert (refused.value.code, refused.value.param, refused.value.kind) == ("model_not_found", "model",
                                                                             Rejection.NOT_FOUND)
