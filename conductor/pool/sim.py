"""``sim``: a deterministic simulated model for tests and benchmarks (never a user's default).

Besides echoing, a sim agent can play a model with known skills on an evaluation dataset
(``dataset``): it recognises which item a call is about (the item's question appears in the
messages) and answers it with a scripted reply -- per item, per category, or the item's reference
answer for the categories in ``skills`` -- so an evaluation's scores are known by construction.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from conductor.budget import estimate_tokens
from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.errors import BadRequest, ProviderError, ProviderTimeout, RateLimited, ServerError

if TYPE_CHECKING:
    from conductor.evaluation.dataset import Item

SimErrorKind = Literal["rate_limit", "server", "timeout", "bad_request"]


class SimOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    latency_ms: int = Field(default=0, ge=0, le=600_000)
    reply: str | None = None
    fail_times: int = Field(default=0, ge=0)
    """Fail the first N attempts of each step (by attempt number, so it holds across processes)."""
    error: SimErrorKind = "server"
    fail_with: list[SimErrorKind] = Field(default_factory=list, max_length=20)
    """Attempt n fails with ``fail_with[n-1]`` while n <= len(fail_with): scripts mixed failures."""
    always_fail: bool = False
    retry_after_s: float | None = Field(default=None, ge=0)
    dataset: str | None = Field(default=None, max_length=4096)
    """An evaluation dataset (JSONL path, or ``shipped``) whose items this agent recognises."""
    skills: list[str] = Field(default_factory=list, max_length=100)
    """Categories of ``dataset`` this agent answers correctly (with each item's ``reference``)."""
    item_replies: dict[str, str] = Field(default_factory=dict)
    """Item id -> the reply for that item (wins over everything else)."""
    category_replies: dict[str, str] = Field(default_factory=dict)
    """Category -> the reply for every item of that category (wins over ``skills``)."""
    unknown_reply: str = "I do not know."
    """The reply for a recognised item outside ``skills`` and the scripted replies."""
    cached_input_tokens: int = Field(default=0, ge=0)
    """Of each call's input tokens, this many are reported read from a prompt cache (at most all of them)."""
    cache_write_tokens: int = Field(default=0, ge=0)
    """Of each call's input tokens, this many are reported written to a prompt cache (at most those not read)."""


class SimProvider(Provider):
    name = "sim"
    supports_json_schema = False

    def __init__(self, agent: str, options: SimOptions):
        self.agent = agent
        self.options = options

    def complete(self, messages: list[Message], options: CallOptions) -> Completion:
        started = time.monotonic()
        if self.options.latency_ms:
            time.sleep(self.options.latency_ms / 1000)
        if options.attempt <= len(self.options.fail_with):
            raise self._error(self.options.fail_with[options.attempt - 1])
        if self.options.always_fail or options.attempt <= self.options.fail_times:
            raise self._error(self.options.error)
        instruction = messages[-1].content if messages else ""
        text = self._scripted(messages)
        if text is None:
            text = self.options.reply if self.options.reply is not None else f"[{self.agent}] {instruction}"
        finish_reason = "stop"
        if estimate_tokens(text) > options.max_tokens:  # cut off at max_tokens, as a real model is
            text, finish_reason = text[: options.max_tokens * 4], "length"
        input_tokens = sum(estimate_tokens(m.content) for m in messages)
        cached = min(self.options.cached_input_tokens, input_tokens)
        return Completion(
            text=text,
            input_tokens=input_tokens,
            output_tokens=estimate_tokens(text),
            cached_input_tokens=cached,
            cache_write_tokens=min(self.options.cache_write_tokens, input_tokens - cached),
            finish_reason=finish_reason,
            model=f"sim-{self.agent}",
            latency_ms=int((time.monotonic() - started) * 1000),
        )

    def _scripted(self, messages: list[Message]) -> str | None:
        """The dataset-driven reply, when this agent has a dataset and the call is about one of its items."""
        if self.options.dataset is None:
            return None
        from conductor.evaluation.dataset import find_item

        item = find_item(_dataset(self.options.dataset), "\n".join(m.content for m in messages))
        if item is None:
            return None
        if item.id in self.options.item_replies:
            return self.options.item_replies[item.id]
        if item.category in self.options.category_replies:
            return self.options.category_replies[item.category]
        if item.category in self.options.skills:
            return item.reference or item.answer or ""
        return self.options.unknown_reply

    def _error(self, kind: SimErrorKind) -> ProviderError:
        if kind == "rate_limit":
            return RateLimited("sim: rate limited", retry_after=self.options.retry_after_s)
        if kind == "timeout":
            return ProviderTimeout("sim: timed out")
        if kind == "bad_request":
            return BadRequest("sim: bad request", status=400)
        return ServerError("sim: internal server error", status=500)


@lru_cache(maxsize=8)
def _dataset(name_or_path: str) -> tuple[Item, ...]:
    from conductor.evaluation.dataset import load_dataset

    return tuple(load_dataset(name_or_path))
