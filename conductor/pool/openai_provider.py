"""``openai`` and ``openai_compatible``: Chat Completions through the ``openai`` SDK.

A compatible server (vLLM, llama.cpp server, ...) is configuration, a ``base_url``, not another class.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import Any, Literal, cast

import openai
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from pydantic import BaseModel, ConfigDict, Field

from conductor.pool.api_keys import read_api_key
from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.chat_turns import fold_system
from conductor.pool.config import AgentConfig
from conductor.pool.errors import ConfigError, ProviderError
from conductor.pool.grammar import grammar_schema
from conductor.pool.http_errors import malformed_response, map_sdk_error

DEFAULT_OPENAI_KEY_ENV = "OPENAI_API_KEY"
NO_KEY_PLACEHOLDER = "not-needed"
"""Sent to compatible servers that take no key; the SDK insists on having one."""
SCHEMA_NAME = "workflow"


class OpenAIOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    extra_body: dict[str, Any] = Field(default_factory=dict)
    """Extra JSON fields for the request body (e.g. vLLM's ``chat_template_kwargs``)."""
    fold_system: bool = False
    """Send system text inside the first user turn, for servers whose chat template drops system
    messages (e.g. llama-cpp-python serving Gemma with ``--chat_format gemma``)."""
    schema_format: Literal["json_schema", "json_object"] = "json_schema"
    """How to ask for schema-constrained output: OpenAI and vLLM take ``{"type": "json_schema", ...}``;
    the llama-cpp-python server takes ``{"type": "json_object", "schema": ...}`` (it compiles a grammar)."""


class OpenAIProvider(Provider):
    name = "openai"
    supports_json_schema = True

    def __init__(self, agent: str, config: AgentConfig):
        if config.provider not in ("openai", "openai_compatible"):
            raise ConfigError(f"agent '{agent}': OpenAIProvider cannot serve provider '{config.provider}'")
        if config.provider == "openai_compatible" and not config.base_url:
            raise ConfigError(f"agent '{agent}': provider 'openai_compatible' needs 'base_url'")
        self.agent = agent
        self.config = config
        self.name = config.provider
        self.options = OpenAIOptions.model_validate(config.options)
        self.where = f"{config.provider} agent '{agent}'"

    @cached_property
    def _client(self) -> openai.OpenAI:
        # Built on first use (after any worker fork). It holds a placeholder key only: each call
        # gets a cheap copy carrying the key read at that moment. Retries are ours, not the SDK's.
        return openai.OpenAI(api_key=NO_KEY_PLACEHOLDER, base_url=self.config.base_url, max_retries=0)

    def _api_key(self) -> str:
        env_name = self.config.api_key_env
        if env_name is None and self._is_openai:
            env_name = DEFAULT_OPENAI_KEY_ENV
        if env_name is None:
            return NO_KEY_PLACEHOLDER
        return read_api_key(env_name, where=self.where)

    def complete(self, messages: list[Message], options: CallOptions) -> Completion:
        api_key = self._api_key()
        client = self._client.with_options(api_key=api_key)
        started = time.monotonic()
        try:
            response = client.chat.completions.create(
                model=self.config.model,
                messages=cast("list[ChatCompletionMessageParam]", self._wire_messages(messages)),
                temperature=openai.omit if options.temperature is None else options.temperature,
                # OpenAI's reasoning models reject max_tokens; many compatible servers only know it.
                max_completion_tokens=options.max_tokens if self._is_openai else openai.omit,
                max_tokens=openai.omit if self._is_openai else options.max_tokens,
                response_format=self._response_format(options),
                extra_body=self.options.extra_body or None,
                timeout=options.timeout_s,
            )
        except (openai.OpenAIError, ValueError) as exc:
            raise self._error(exc, options, api_key) from None
        latency_ms = int((time.monotonic() - started) * 1000)
        return self._completion(response, latency_ms, api_key)

    @property
    def _is_openai(self) -> bool:
        return self.config.provider == "openai"

    def _wire_messages(self, messages: list[Message]) -> list[dict[str, str]]:
        return fold_system(messages) if self.options.fold_system else [m.as_dict() for m in messages]

    def _response_format(self, options: CallOptions) -> Any:
        if options.json_schema is None or not self.config.structured_output:
            return openai.omit
        if self.options.schema_format == "json_object":
            return {"type": "json_object", "schema": grammar_schema(options.json_schema)}
        return {
            "type": "json_schema",
            "json_schema": {"name": SCHEMA_NAME, "schema": options.json_schema, "strict": True},
        }

    def _completion(self, response: object, latency_ms: int, api_key: str) -> Completion:
        if not isinstance(response, ChatCompletion):
            raise malformed_response(self.where, "expected a JSON chat.completion object", secret=api_key)
        try:
            choice = response.choices[0]
            message = choice.message
            text = message.content if message.content is not None else (message.refusal or "")
            usage = response.usage
            input_tokens = usage.prompt_tokens if usage is not None else 0
            output_tokens = usage.completion_tokens if usage is not None else 0
            cached_tokens = _detail(usage.prompt_tokens_details, "cached_tokens") if usage is not None else 0
            reasoning_tokens = (
                _detail(usage.completion_tokens_details, "reasoning_tokens") if usage is not None else 0
            )
            finish_reason = choice.finish_reason or "unknown"
            if message.content is None and message.refusal:  # the model declined: as Anthropic's "refusal"
                finish_reason = "content_filter"
            model = response.model or self.config.model
        except (AttributeError, IndexError, TypeError) as exc:
            raise malformed_response(self.where, f"missing field ({exc})", secret=api_key) from None
        if not (isinstance(text, str) and isinstance(input_tokens, int) and isinstance(output_tokens, int)):
            raise malformed_response(self.where, "content or usage has the wrong type", secret=api_key)
        return Completion(
            text=text,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            # parts of the totals (OpenAI's prompt_tokens counts the cached ones, completion_tokens the reasoning)
            cached_input_tokens=max(0, min(cached_tokens, input_tokens)),
            reasoning_tokens=max(0, min(reasoning_tokens, output_tokens)),
            finish_reason=str(finish_reason),
            model=str(model),
            latency_ms=latency_ms,
            extra={"id": getattr(response, "id", None), "usage_reported": usage is not None},
        )

    def _error(self, exc: Exception, options: CallOptions, api_key: str) -> ProviderError:
        return map_sdk_error(
            exc, openai, where=self.where, timeout_s=options.timeout_s, secret=api_key,
            detail=lambda e: _error_detail(e.body, e.message),
        )


def _detail(details: object, name: str) -> int:
    """A count of ``usage.prompt_tokens_details`` or ``usage.completion_tokens_details``; 0 when the object or
    the count is absent, null or not a whole number (vLLM and llama.cpp's server may send neither, a compatible
    server something else): a detail never fails a call that answered and was paid for."""
    value = getattr(details, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _error_detail(body: object, fallback: str) -> str:
    """The server's own message: OpenAI-style bodies put it at ``error.message``."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
    if isinstance(body, str) and body:
        return body
    return fallback
