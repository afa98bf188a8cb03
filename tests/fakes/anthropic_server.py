"""A loopback Anthropic Messages server (``POST /v1/messages``); ``base_url`` is the bare origin.

By default ``usage`` has ``input_tokens`` and ``output_tokens`` only; an ``AnthropicReply`` with
``cache_read_input_tokens`` or ``cache_creation_input_tokens`` adds those, as the API reports prompt caching.
"""

from __future__ import annotations

import re
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

__all__ = ["AnthropicReply", "FakeAnthropicServer", "Reply", "drop", "error", "hang", "malformed", "ok"]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


@dataclass(frozen=True)
class AnthropicReply(Reply):
    """A success whose ``usage`` reports prompt caching. ``input_tokens`` is the wire's ``input_tokens``,
    which leaves out the cache reads and writes (Anthropic reports them apart)."""

    cache_read_input_tokens: int | None = None
    """``usage.cache_read_input_tokens``; None: not sent."""
    cache_creation_input_tokens: int | None = None
    """``usage.cache_creation_input_tokens``; None: not sent."""
    thinking_tokens: int | None = None
    """``usage.output_tokens_details.thinking_tokens`` (part of ``output_tokens``); None: no details sent."""


class FakeAnthropicServer(FakeProviderServer):
    route = re.compile(r"^/v1/messages$")

    def success_body(self, request: RecordedRequest, match: re.Match[str], reply: Reply, text: str) -> Any:
        body = request.body if isinstance(request.body, dict) else {}
        input_tokens = reply.input_tokens
        if input_tokens is None:
            prompt = [body.get("system", ""), body.get("messages", [])]
            input_tokens = sum(count_words(t) for t in texts_in(prompt))
        usage: dict[str, Any] = {
            "input_tokens": input_tokens,
            "output_tokens": reply.output_tokens if reply.output_tokens is not None else count_words(text),
        }
        if isinstance(reply, AnthropicReply):
            for name in ("cache_creation_input_tokens", "cache_read_input_tokens"):
                if getattr(reply, name) is not None:
                    usage[name] = getattr(reply, name)
            if reply.thinking_tokens is not None:
                usage["output_tokens_details"] = {"thinking_tokens": reply.thinking_tokens}
        return {
            "id": self.next_id("msg_fake"),
            "type": "message",
            "role": "assistant",
            "model": reply.model or body.get("model", "fake-model"),
            "content": [{"type": "text", "text": text}],
            "stop_reason": reply.finish_reason or "end_turn",
            "stop_sequence": None,
            "usage": usage,
        }

    def error_body(self, status: int, message: str) -> Any:
        kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": message}}

    def presented_key(self, request: RecordedRequest) -> str | None:
        # SDK 2.x sends ``Authorization: Bearer``; older clients send ``x-api-key`` (which wins).
        if "x-api-key" in request.headers:
            return request.headers["x-api-key"]
        auth = request.headers.get("authorization", "")
        return auth.removeprefix("Bearer ") if auth.startswith("Bearer ") else None

    def invalid(self, body: Any) -> str | None:
        found = body.get("messages") if isinstance(body, dict) else None
        messages: list[Any] = found if isinstance(found, list) else []
        for i, message in enumerate(messages):
            final_assistant = i == len(messages) - 1 and message.get("role") == "assistant"
            if not "".join(texts_in(message.get("content", ""))).strip() and not final_assistant:
                return f"messages.{i}: all messages must have non-empty content except for the optional final " \
                       "assistant message"
        return None

    def last_message_text(self, body: Any) -> str:
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            return " ".join(texts_in(messages[-1].get("content", "")))
        return ""
