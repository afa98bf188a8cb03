"""``sim``: a deterministic simulated model for tests and benchmarks (never a user's default)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from conductor.budget import estimate_tokens
from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.errors import BadRequest, ProviderError, ProviderTimeout, RateLimited, ServerError

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
        text = self.options.reply if self.options.reply is not None else f"[{self.agent}] {instruction}"
        return Completion(
            text=text,
            input_tokens=sum(estimate_tokens(m.content) for m in messages),
            output_tokens=estimate_tokens(text),
            finish_reason="stop",
            model=f"sim-{self.agent}",
            latency_ms=int((time.monotonic() - started) * 1000),
        )

    def _error(self, kind: SimErrorKind) -> ProviderError:
        if kind == "rate_limit":
            return RateLimited("sim: rate limited", retry_after=self.options.retry_after_s)
        if kind == "timeout":
            return ProviderTimeout("sim: timed out")
        if kind == "bad_request":
            return BadRequest("sim: bad request", status=400)
        return ServerError("sim: internal server error", status=500)
