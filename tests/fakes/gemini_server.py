"""A loopback Gemini API server (``POST /v1beta/models/{model}:generateContent``).

``base_url`` is the bare origin; the SDK adds the API version.
"""

from __future__ import annotations

import re
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


class FakeGeminiServer(FakeProviderServer):
    route = re.compile(r"^/v1beta/models/(?P<model>[^/:]+):generateContent$")

    def success_body(self, request: RecordedRequest, match: re.Match[str], reply: Reply, text: str) -> Any:
        body = request.body if isinstance(request.body, dict) else {}
        prompt_tokens = reply.input_tokens
        if prompt_tokens is None:
            prompt = [body.get("systemInstruction", {}), body.get("contents", [])]
            prompt_tokens = sum(count_words(t) for t in texts_in(prompt))
        output_tokens = reply.output_tokens if reply.output_tokens is not None else count_words(text)
        return {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"text": text}]},
                    "finishReason": reply.finish_reason or "STOP",
                    "index": 0,
                }
            ],
            "usageMetadata": {
                "promptTokenCount": prompt_tokens,
                "candidatesTokenCount": output_tokens,
                "totalTokenCount": prompt_tokens + output_tokens,
            },
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
