"""A loopback OpenAI Chat Completions server (``POST /v1/chat/completions``).

Used by the provider tests and, through ``base_url``, as a scripted planner endpoint that Celery
worker processes call::

    with FakeOpenAIServer() as srv:
        srv.script(ok("hello"), error(429, retry_after="7"))
        srv.reply_with(lambda body: '{"steps": []}')   # after the script runs out
        ... srv.base_url ...                          # http://127.0.0.1:PORT/v1
        srv.bodies[0]["response_format"]
        srv.script(OpenAIReply("hi", input_tokens=1000, cached_tokens=800, reasoning_tokens=64))

By default ``usage`` has no ``prompt_tokens_details`` / ``completion_tokens_details`` (as vLLM sends it);
an ``OpenAIReply`` with ``cached_tokens`` or ``reasoning_tokens`` adds them, as OpenAI does.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from tests.fakes.http_base import (
    FakeProviderServer,
    RecordedRequest,
    Reply,
    count_words,
    drop,
    error,
    hang,
    malformed,
    ok,
    texts_in,
)

__all__ = ["FakeOpenAIServer", "OpenAIReply", "Reply", "drop", "error", "hang", "malformed", "ok"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_denied",
    404: "not_found_error",
    429: "rate_limit_exceeded",
}


@dataclass(frozen=True)
class OpenAIReply(Reply):
    """A success whose ``usage`` carries OpenAI's details objects. ``input_tokens`` is ``prompt_tokens``,
    the cached tokens included; ``output_tokens`` is ``completion_tokens``, the reasoning included."""

    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens``; None: no ``prompt_tokens_details``."""
    reasoning_tokens: int | None = None
    """``usage.completion_tokens_details.reasoning_tokens``; None: no ``completion_tokens_details``."""


class FakeOpenAIServer(FakeProviderServer):
    route = re.compile(r"^/v1/chat/completions$")
    base_path = "/v1"

    def success_body(self, request: RecordedRequest, match: re.Match[str], reply: Reply, text: str) -> Any:
        body = request.body if isinstance(request.body, dict) else {}
        prompt_tokens = reply.input_tokens
        if prompt_tokens is None:
            prompt_tokens = sum(count_words(t) for t in texts_in(body.get("messages", [])))
        completion_tokens = reply.output_tokens if reply.output_tokens is not None else count_words(text)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if isinstance(reply, OpenAIReply) and reply.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens, "audio_tokens": 0}
        if isinstance(reply, OpenAIReply) and reply.reasoning_tokens is not None:
            usage["completion_tokens_details"] = {
                "reasoning_tokens": reply.reasoning_tokens,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            }
        return {
            "id": self.next_id("chatcmpl-fake"),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": reply.model or body.get("model", "fake-model"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reply.finish_reason or "stop",
                    "logprobs": None,
                }
            ],
            "usage": usage,
        }

    def error_body(self, status: int, message: str) -> Any:
        kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return {"error": {"message": message, "type": kind, "param": None, "code": None}}

    def presented_key(self, request: RecordedRequest) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

    def last_message_text(self, body: Any) -> str:
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            return str(messages[-1].get("content", ""))
        return ""
