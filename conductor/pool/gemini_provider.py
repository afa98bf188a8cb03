"""``gemini``: ``generateContent`` through the ``google-genai`` SDK (Gemini API, not Vertex AI)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import httpx
import httpx2
import pydantic
from google import genai
from google.genai import errors as genai_errors
from google.genai import types
from pydantic import BaseModel, ConfigDict

from conductor.pool.api_keys import read_api_key
from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.chat_turns import to_conversation
from conductor.pool.config import AgentConfig
from conductor.pool.errors import BadRequest, ConfigError, ProviderError, ServerError
from conductor.pool.http_errors import (
    connection_failed,
    error_for_status,
    malformed_response,
    scrub,
    timed_out,
)

DEFAULT_GEMINI_KEY_ENV = "GEMINI_API_KEY"
API_KEY_HEADER = "x-goog-api-key"
_CLIENT_PLACEHOLDER_KEY = "unset"
"""The shared client holds no real key: each call sends the key in its own request headers."""
_NO_RETRIES = types.HttpRetryOptions(attempts=1)
"""The SDK's tenacity retries, explicitly off: retries are ours."""

# The SDK may be configured (GOOGLE_GENAI_HTTP_CLIENT) to use either httpx or httpx2.
_TIMEOUTS = (httpx.TimeoutException, httpx2.TimeoutException)
_TRANSPORT_ERRORS = (httpx.TransportError, httpx2.TransportError)

FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
    "IMAGE_SAFETY": "content_filter",
    "IMAGE_PROHIBITED_CONTENT": "content_filter",
    "IMAGE_RECITATION": "content_filter",
    "MALFORMED_FUNCTION_CALL": "tool_calls",
}
"""Gemini's ``finishReason`` in the vocabulary every provider reports (OpenAI's)."""

NO_ANSWER_REASONS = frozenset({"OTHER", "LANGUAGE", "FINISH_REASON_UNSPECIFIED"})
"""Reasons that, with no text, are no answer: ``LANGUAGE`` a bad request, the others retried."""

_RETRY_DELAY = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")


class GeminiOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_version: str = "v1beta"
    """``systemInstruction`` and ``responseJsonSchema`` are served under v1beta."""


class GeminiProvider(Provider):
    name = "gemini"
    supports_json_schema = True

    def __init__(self, agent: str, config: AgentConfig):
        if config.provider != "gemini":
            raise ConfigError(f"agent '{agent}': GeminiProvider cannot serve provider '{config.provider}'")
        self.agent = agent
        self.config = config
        self.options = GeminiOptions.model_validate(config.options)
        self.where = f"gemini agent '{agent}'"

    @cached_property
    def _client(self) -> genai.Client:
        # Built on first use (after any worker fork). vertexai=False so GOOGLE_GENAI_USE_VERTEXAI in
        # the environment cannot reroute an agent configured for the Gemini API.
        return genai.Client(
            vertexai=False,
            api_key=_CLIENT_PLACEHOLDER_KEY,
            http_options=types.HttpOptions(
                base_url=self.config.base_url,
                api_version=self.options.api_version,
                retry_options=_NO_RETRIES,
            ),
        )

    def complete(self, messages: list[Message], options: CallOptions) -> Completion:
        api_key = read_api_key(self.config.api_key_env or DEFAULT_GEMINI_KEY_ENV, where=self.where)
        conversation = to_conversation(messages)
        contents = [
            types.Content(role="user" if t.role == "user" else "model", parts=[types.Part(text=t.text)])
            for t in conversation.turns
        ]
        request_config = self._request_config(conversation.system, options, api_key)
        started = time.monotonic()
        try:
            response = self._client.models.generate_content(
                model=self.config.model, contents=contents, config=request_config
            )
        except (genai_errors.APIError, ValueError, *_TRANSPORT_ERRORS) as exc:
            raise self._error(exc, options, api_key) from None
        latency_ms = int((time.monotonic() - started) * 1000)
        return self._completion(response, latency_ms, api_key)

    def _request_config(
        self, system: str | None, options: CallOptions, api_key: str
    ) -> types.GenerateContentConfig:
        schema = options.json_schema if self.config.structured_output else None
        return types.GenerateContentConfig(
            system_instruction=system,
            temperature=options.temperature,
            max_output_tokens=options.max_tokens,
            response_mime_type="application/json" if schema is not None else None,
            response_json_schema=schema,
            http_options=types.HttpOptions(
                headers={API_KEY_HEADER: api_key},
                timeout=max(1, int(options.timeout_s * 1000)),  # milliseconds
                retry_options=_NO_RETRIES,
            ),
        )

    def _completion(
        self, response: types.GenerateContentResponse, latency_ms: int, api_key: str
    ) -> Completion:
        if not response.candidates:
            feedback = response.prompt_feedback
            if feedback is not None and feedback.block_reason is not None:
                reason = _enum_value(feedback.block_reason)
                raise BadRequest(f"{self.where}: the prompt was blocked ({reason})")
            raise malformed_response(self.where, "no candidates in the response", secret=api_key)
        candidate = response.candidates[0]
        if candidate.content is None and candidate.finish_reason is None:
            raise malformed_response(
                self.where, "a candidate with neither content nor finishReason", secret=api_key
            )
        parts = candidate.content.parts if candidate.content is not None else None
        text = "".join(p.text for p in parts or [] if p.text and not p.thought)
        usage = response.usage_metadata
        # promptTokenCount includes the tokens read from the context cache (cachedContentTokenCount).
        input_tokens = (usage.prompt_token_count or 0) if usage is not None else 0
        cached_tokens = (usage.cached_content_token_count or 0) if usage is not None else 0
        # Thinking tokens are billed as output, so they count toward output_tokens (and cost);
        # candidatesTokenCount leaves them out.
        thoughts_tokens = (usage.thoughts_token_count or 0) if usage is not None else 0
        output_tokens = ((usage.candidates_token_count or 0) if usage is not None else 0) + thoughts_tokens
        raw_reason = (
            _enum_value(candidate.finish_reason) if candidate.finish_reason is not None else "unknown"
        )
        if not text and raw_reason in NO_ANSWER_REASONS:
            # nothing written and no reason a caller could act on: an error, not an empty answer (a step
            # would succeed with no output, and a chat client would read an empty reply that "stopped")
            if raw_reason == "LANGUAGE":
                raise BadRequest(f"{self.where}: the model does not support the language of the request "
                                 "(finishReason LANGUAGE, no text)")
            raise ServerError(f"{self.where}: the model stopped with no text (finishReason {raw_reason})")
        return Completion(
            text=text,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            cached_input_tokens=max(0, min(cached_tokens, input_tokens)),
            reasoning_tokens=max(0, min(thoughts_tokens, output_tokens)),
            finish_reason=FINISH_REASONS.get(raw_reason, raw_reason.lower()),
            model=response.model_version or self.config.model,
            latency_ms=latency_ms,
            extra={"id": response.response_id, "finish_reason": raw_reason},
        )

    def _error(self, exc: Exception, options: CallOptions, api_key: str) -> ProviderError:
        if isinstance(exc, _TIMEOUTS):  # before the transport errors: they are subclasses
            return timed_out(self.where, options.timeout_s)
        if isinstance(exc, _TRANSPORT_ERRORS):
            return connection_failed(self.where, f"{type(exc).__name__}: {exc}", secret=api_key)
        if isinstance(exc, genai_errors.APIError):
            headers = getattr(exc.response, "headers", None)
            return error_for_status(
                exc.code,
                exc.message or str(exc.status or ""),
                where=self.where,
                headers=headers if isinstance(headers, Mapping) else None,
                fallback_retry_after=_retry_info_delay(exc.details),
                secret=api_key,
            )
        if isinstance(
            exc, genai_errors.UnknownApiResponseError | json.JSONDecodeError | pydantic.ValidationError
        ):
            return malformed_response(self.where, f"{type(exc).__name__}: {exc}", secret=api_key)
        if isinstance(exc, ValueError):
            return BadRequest(f"{self.where}: the SDK refused the request: {scrub(str(exc), api_key)}")
        return ProviderError(f"{self.where}: {type(exc).__name__}: {scrub(str(exc), api_key)}")


def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))


def _retry_info_delay(details: Any) -> float | None:
    """Google's 429s carry the wait as a ``google.rpc.RetryInfo`` detail (``"retryDelay": "7s"``)."""
    error = details.get("error", details) if isinstance(details, dict) else None
    entries = error.get("details") if isinstance(error, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and str(entry.get("@type", "")).endswith("google.rpc.RetryInfo"):
            match = _RETRY_DELAY.match(str(entry.get("retryDelay", "")))
            if match:
                return float(match.group(1))
    return None
