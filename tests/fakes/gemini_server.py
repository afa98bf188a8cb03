"""A loopback Gemini API server (``POST /v1beta/models/{model}:generateContent``).

``base_url`` is the bare origin; the SDK adds the API version. By default ``usageMetadata`` has the prompt,
candidates and total counts only; a ``GeminiReply`` with ``thoughts_token_count`` or
``cached_content_token_count`` adds those, as a thinking model and context caching report them.
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

__all__ = [
    "FakeGeminiServer",
    "GeminiReply",
    "Reply",
    "drop",
    "error",
    "hang",
    "malformed",
    "ok",
    "rate_limited_with_retry_info",
]

_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def rate_limited_with_retry_info(delay: str = "7s") -> Reply:
    """A 429 the way Google sends it: the wait is a ``google.rpc.RetryInfo`` detail, not a header."""
    return Reply(
        status=429,
        body={
            "error": {
                "code": 429,
                "message": "Resource has been exhausted (e.g. check quota).",
                "status": "RESOURCE_EXHAUSTED",
                "details": [{"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": delay}],
            }
        },
    )


@dataclass(frozen=True)
class GeminiReply(Reply):
    """A success whose ``usageMetadata`` reports thinking and context caching. ``input_tokens`` is
    ``promptTokenCount`` (the cached tokens included); ``output_tokens`` is ``candidatesTokenCount`` (the
    thoughts left out: ``totalTokenCount`` adds them)."""

    thoughts_token_count: int | None = None
    """``usageMetadata.thoughtsTokenCount``; None: not sent."""
    cached_content_token_count: int | None = None
    """``usageMetadata.cachedContentTokenCount``; None: not sent."""


class FakeGeminiServer(FakeProviderServer):
    route = re.compile(r"^/v1beta/models/(?P<model>[^/:]+):generateContent$")

    def success_body(self, request: RecordedRequest, match: re.Match[str], reply: Reply, text: str) -> Any:
        body = request.body if isinstance(request.body, dict) else {}
        prompt_tokens = reply.input_tokens
        if prompt_tokens is None:
            prompt = [body.get("systemInstruction", {}), body.get("contents", [])]
            prompt_tokens = sum(count_words(t) for t in texts_in(prompt))
        output_tokens = reply.output_tokens if reply.output_tokens is not None else count_words(text)
        usage: dict[str, Any] = {"promptTokenCount": prompt_tokens, "candidatesTokenCount": output_tokens}
        thoughts = reply.thoughts_token_count if isinstance(reply, GeminiReply) else None
        cached = reply.cached_content_token_count if isinstance(reply, GeminiReply) else None
        if cached is not None:
            usage["cachedContentTokenCount"] = cached
        if thoughts is not None:
            usage["thoughtsTokenCount"] = thoughts
        usage["totalTokenCount"] = prompt_tokens + output_tokens + (thoughts or 0)
        return {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"text": text}]},
                    "finishReason": reply.finish_reason or "STOP",
                    "index": 0,
                }
            ],
            "usageMetadata": usage,
            "modelVersion": reply.model or match.group("model"),
            "responseId": self.next_id("gemini-fake"),
        }

    def error_body(self, status: int, message: str) -> Any:
        name = _STATUS_NAMES.get(status, "INTERNAL" if status >= 500 else "FAILED_PRECONDITION")
        return {"error": {"code": status, "message": message, "status": name}}

    def presented_key(self, request: RecordedRequest) -> str | None:
        header = request.headers.get("x-goog-api-key")
        if header is not None:
            return header
        keys = request.query.get("key")
        return keys[0] if keys else None

    def last_message_text(self, body: Any) -> str:
        contents = body.get("contents") if isinstance(body, dict) else None
        if isinstance(contents, list) and contents and isinstance(contents[-1], dict):
            return " ".join(texts_in(contents[-1].get("parts", [])))
        return ""
