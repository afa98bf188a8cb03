"""The one small contract every provider implements: messages + options -> a Completion."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Message:
    role: Role
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class CallOptions:
    """Per-call options. ``json_schema`` asks the backend to constrain output to that schema when it can."""

    temperature: float | None = 0.2
    """None: not sent (the backend's default)."""
    max_tokens: int = 4096
    timeout_s: float = 300.0
    json_schema: dict[str, Any] | None = None
    attempt: int = 1
    """1-based attempt number of the step this call serves (the sim provider scripts failures on it)."""
    cache_points: tuple[int, ...] = ()
    """Indices of the messages that end a prefix another call of this job sends too
    (``context.cache_points``): a provider that caches prompt prefixes only on request (Anthropic) asks
    for these; the others cache on their own and ignore it."""


@dataclass(frozen=True)
class Completion:
    text: str
    """As Postgres can store it (``storable_text``), whatever the provider sent."""
    input_tokens: int
    """Every prompt token, the cached ones too (as OpenAI counts; Anthropic's cache reads and writes added)."""
    output_tokens: int
    """Every generated token, reasoning (thinking) included."""
    finish_reason: str
    model: str
    latency_ms: int
    extra: dict[str, Any] = field(default_factory=dict)
    cached_input_tokens: int = 0
    """Of ``input_tokens``, those the provider read from its prompt cache (billed at the cached price)."""
    reasoning_tokens: int = 0
    """Of ``output_tokens``, the model's reasoning (OpenAI's reasoning tokens, Gemini's thoughts)."""
    cache_write_tokens: int = 0
    """Of ``input_tokens``, those the provider wrote to its prompt cache (Anthropic's cache writes, billed
    above the input price: ``Price.cache_write_per_mtok``, the one-hour ones below at their own)."""
    cache_write_1h_tokens: int = 0
    """Of ``cache_write_tokens``, those written to Anthropic's one-hour cache (``Price.cache_write_1h_per_mtok``),
    as its ``usage.cache_creation`` reports them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", storable_text(self.text))
        if len(self.text) > MAX_OUTPUT_CHARS:  # a server that ignored max_tokens: cut, as a cut answer reads
            object.__setattr__(self, "text", self.text[:MAX_OUTPUT_CHARS])
            object.__setattr__(self, "finish_reason", "length")
        # as the server named them, into step.model and step.finish_reason (VARCHAR 256, 64): one a server
        # sent that the columns could not hold failed the step's record, and the paid answer was lost
        object.__setattr__(self, "model", storable_text(self.model)[:MAX_MODEL_CHARS])
        object.__setattr__(self, "finish_reason", storable_text(self.finish_reason)[:MAX_FINISH_REASON_CHARS])


MAX_OUTPUT_CHARS = 4_000_000
"""The longest text a completion keeps (16 characters a token at the pool's largest ``max_tokens``, 200,000):
past it the text is cut and its finish reason is ``length``. Only a server that ignores ``max_tokens``
sends more; kept whole, it would be stored and copied into every later step's prompt, the answer and its
files."""
MAX_MODEL_CHARS = 256
"""The longest model name a completion reports as stored (``step.model``)."""
MAX_FINISH_REASON_CHARS = 64
"""The longest finish reason a completion reports as stored (``step.finish_reason``)."""


def storable_text(text: str) -> str:
    """``text`` with what Postgres text cannot hold replaced: NUL by U+FFFD, an unpaired surrogate by "?".
    A model can emit either; stored as sent, the step's (or plan's) record failed at the database and its
    job was re-run until it failed as a lost worker."""
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def storable_escaped(text: str) -> str:
    """``text`` with what Postgres text cannot hold written as its escape: NUL as ``\\u0000``, an unpaired
    surrogate as ``\\ud83d``. For messages (errors, refusals) that quote what a client, a model or a
    provider sent, where the reader wants to see what was there."""
    if "\x00" in text:
        text = text.replace("\x00", "\\u0000")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


class Provider(ABC):
    """A configured model endpoint. Implementations raise only ``conductor.pool.errors`` types."""

    name: str = "base"
    supports_json_schema: bool = False

    @abstractmethod
    def complete(self, messages: list[Message], options: CallOptions) -> Completion: ...
