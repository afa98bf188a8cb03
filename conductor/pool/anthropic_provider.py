"""``anthropic``: the Messages API through the ``anthropic`` SDK.

The SDK (2.x) speaks API version 2026-10-21, which rejects sampling parameters (``temperature``,
``top_p``, ``top_k``) on every model, so none are sent: ``CallOptions.temperature`` does not apply.

Prompt caching: Anthropic caches a prompt prefix only where a request marks one (``cache_control``). With the
agent option ``prompt_cache`` (on unless set to false) each call marks the ends of the prefixes another step of
its job on the same agent sends too (``CallOptions.cache_points``, from the workflow's access lists): the later
of two such calls reads at a tenth of the input price what the earlier one wrote at 1.25 times it (the
5-minute cache; a prefix shorter than the model's minimum, 1,024 tokens or more, is neither). With
``prompt_cache_ttl: 1h`` the marks ask for the one-hour cache (``"ttl": "1h"``, with the ``anthropic-beta``
header that introduced it), whose writes cost twice the input price. A prefix no other step sends is never
marked. A call that marks any sends all its content as text blocks (the form a marker needs), so every call
that reads or writes a prefix sends it alike.

Usage: Anthropic's ``usage.input_tokens`` counts only the prompt tokens after the last cache breakpoint;
the tokens read from the prompt cache (``cache_read_input_tokens``) and written to it
(``cache_creation_input_tokens``) are reported apart. ``Completion.input_tokens`` is every prompt token, as
OpenAI counts it: the three added. Of them, ``cached_input_tokens`` are the cache reads (priced at the
agent's ``cached_input_per_mtok``) and ``cache_write_tokens`` the writes: those ``usage.cache_creation``
reports as one-hour ones (``cache_write_1h_tokens``) at ``cache_write_1h_per_mtok`` (unset: twice the input
price), the rest at ``cache_write_per_mtok`` (unset: 1.25 times it), whatever lifetime was asked for; a
response without that split (``usage.cache_creation``) is taken to have written for as long as asked.
``reasoning_tokens`` are ``usage.output_tokens_details.thinking_tokens`` (part of ``output_tokens``), 0 when
not sent or not a count: a detail never fails a call that answered.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any, Literal, cast

import anthropic
from anthropic.types import Message as AnthropicMessage
from anthropic.types import MessageParam
from pydantic import BaseModel, ConfigDict, Field

from conductor.pool.api_keys import read_api_key
from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.chat_turns import to_conversation
from conductor.pool.config import AgentConfig
from conductor.pool.errors import ConfigError, ProviderError
from conductor.pool.http_errors import malformed_response, map_sdk_error

DEFAULT_ANTHROPIC_KEY_ENV = "ANTHROPIC_API_KEY"
_CLIENT_PLACEHOLDER_KEY = "unset"
"""The shared client never sends a request itself; each call uses a copy that carries the real key."""

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
"""Anthropic's ``stop_reason`` in the vocabulary every provider reports (OpenAI's)."""


class AnthropicOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_cache: bool = Field(default=True, strict=True)
    """Mark the prompt prefixes other steps of the job send too for Anthropic's prompt cache."""
    prompt_cache_ttl: Literal["5m", "1h"] = "5m"
    """How long Anthropic keeps a prefix a call writes (each read renews it): ``5m``, writes at
    ``cache_write_per_mtok`` (unset: 1.25 times the input price), or ``1h``, at ``cache_write_1h_per_mtok``
    (unset: twice it), for jobs whose steps start more than five minutes after the step
    that wrote what they read (a long step between them, a slow queue)."""


EXTENDED_CACHE_TTL_BETA = "extended-cache-ttl-2025-04-11"
"""The ``anthropic-beta`` value a request marking a one-hour cache sends, as the feature's beta required.
Reports differ on what the API does without it (a 400, or the prefix kept 5 minutes without a word); with it,
either way, the hour is asked for as documented. What was written for how long is read from the usage."""
MAX_CACHE_MARKERS = 4
"""The most ``cache_control`` markers a request may carry (the API refuses more): the longest are kept."""


def _block(text: str, cache_control: dict[str, str] | None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": text}
    if cache_control is not None:
        block["cache_control"] = dict(cache_control)
    return block


class AnthropicProvider(Provider):
    name = "anthropic"
    supports_json_schema = True

    def __init__(self, agent: str, config: AgentConfig):
        if config.provider != "anthropic":
            raise ConfigError(f"agent '{agent}': AnthropicProvider cannot serve provider '{config.provider}'")
        self.agent = agent
        self.config = config
        self.options = AnthropicOptions.model_validate(config.options)
        self.where = f"anthropic agent '{agent}'"

    @cached_property
    def _client(self) -> anthropic.Anthropic:
        # Built on first use (after any worker fork); retries are ours, not the SDK's.
        return anthropic.Anthropic(
            api_key=_CLIENT_PLACEHOLDER_KEY, base_url=self.config.base_url, max_retries=0
        )

    def complete(self, messages: list[Message], options: CallOptions) -> Completion:
        api_key = read_api_key(self.config.api_key_env or DEFAULT_ANTHROPIC_KEY_ENV, where=self.where)
        client = self._client.with_options(api_key=api_key)
        conversation = to_conversation(messages)
        system: Any = conversation.system if conversation.system is not None else anthropic.omit
        turns: list[dict[str, Any]] = [{"role": t.role, "content": t.text} for t in conversation.turns]
        ends = {conversation.ending_at(p, messages) for p in options.cache_points if p < len(messages)}
        marks = set(sorted(end for end in ends if end is not None)[-MAX_CACHE_MARKERS:])
        headers: dict[str, str] = {}
        marking = bool(self.options.prompt_cache and marks)  # a call with no marker neither reads nor writes
        ttl = self.options.prompt_cache_ttl
        asked_hour = marking and ttl == "1h"
        if marking:
            mark = {"type": "ephemeral"} if ttl == "5m" else {"type": "ephemeral", "ttl": ttl}
            if ttl == "1h":
                headers["anthropic-beta"] = EXTENDED_CACHE_TTL_BETA
            if conversation.system is not None:
                system = [_block(conversation.system, mark if -1 in marks else None)]
            turns = [{"role": t.role, "content": [_block(t.text, mark if n in marks else None)]}
                     for n, t in enumerate(conversation.turns)]
        started = time.monotonic()
        try:
            response = client.messages.create(
                model=self.config.model,
                max_tokens=options.max_tokens,
                messages=cast("list[MessageParam]", turns),
                system=system,
                output_config=self._output_config(options),
                timeout=options.timeout_s,
                extra_headers=headers or None,
            )
        except (anthropic.AnthropicError, ValueError) as exc:
            raise self._error(exc, options, api_key) from None
        latency_ms = int((time.monotonic() - started) * 1000)
        return self._completion(response, latency_ms, api_key, asked_hour=asked_hour)

    def _output_config(self, options: CallOptions) -> Any:
        if options.json_schema is None or not self.config.structured_output:
            return anthropic.omit
        return {"format": {"type": "json_schema", "schema": options.json_schema}}

    def _completion(self, response: object, latency_ms: int, api_key: str, *, asked_hour: bool = False) -> Completion:
        if not isinstance(response, AnthropicMessage):
            raise malformed_response(self.where, "expected a JSON message object", secret=api_key)
        try:
            text = "".join(block.text for block in response.content if block.type == "text")
            usage = response.usage
            input_tokens = usage.input_tokens
            output_tokens = usage.output_tokens
            # absent or null: no cache was used (older API versions, compatible servers)
            cache_writes = usage.cache_creation_input_tokens or 0
            cache_reads = usage.cache_read_input_tokens or 0
            details = getattr(usage, "output_tokens_details", None)
            thinking = getattr(details, "thinking_tokens", None)
            hour = getattr(getattr(usage, "cache_creation", None), "ephemeral_1h_input_tokens", None)
            stop_reason = response.stop_reason
            model = response.model or self.config.model
        except (AttributeError, TypeError) as exc:
            raise malformed_response(self.where, f"missing field ({exc})", secret=api_key) from None
        if not all(isinstance(n, int) for n in (input_tokens, output_tokens, cache_writes, cache_reads)):
            raise malformed_response(self.where, "usage has the wrong type", secret=api_key)
        raw_reason = str(stop_reason) if stop_reason is not None else "unknown"
        prompt_tokens = input_tokens + max(0, cache_writes) + max(0, cache_reads)  # the module docstring: Usage
        if type(hour) is not int:  # no split by lifetime (a compatible server): as long as the call asked
            hour = cache_writes if asked_hour else 0
        return Completion(
            text=text,
            input_tokens=prompt_tokens,
            output_tokens=output_tokens,
            cached_input_tokens=max(0, min(cache_reads, prompt_tokens)),
            cache_write_tokens=max(0, min(cache_writes, prompt_tokens)),
            cache_write_1h_tokens=max(0, min(hour, cache_writes, prompt_tokens)),
            reasoning_tokens=max(0, min(thinking, output_tokens)) if type(thinking) is int else 0,
            finish_reason=FINISH_REASONS.get(raw_reason, raw_reason),
            model=str(model),
            latency_ms=latency_ms,
            extra={"id": getattr(response, "id", None), "stop_reason": raw_reason},
        )

    def _error(self, exc: Exception, options: CallOptions, api_key: str) -> ProviderError:
        return map_sdk_error(
            exc, anthropic, where=self.where, timeout_s=options.timeout_s, secret=api_key,
            detail=lambda e: e.api_message or e.message,
        )
