"""A loopback Anthropic Messages server (``POST /v1/messages``); ``base_url`` is the bare origin.

By default ``usage`` has ``input_tokens`` and ``output_tokens`` only; an ``AnthropicReply`` with
``cache_read_input_tokens`` or ``cache_creation_input_tokens`` adds those, as the API reports prompt caching.

``FakeAnthropicServer(prompt_cache_min_tokens=N)`` models the prompt cache by the documented rules instead: a
block marked ``cache_control`` writes the prefix up to it (system blocks, then each message's blocks, in
order; the markers are not part of the prefix) when it holds at least N tokens; a request reads the longest
prefix written before that ends at a block boundary at or before one of its markers, at most 20 blocks
before it; the tokens between what it read and its last marker are written, the rest are ``input_tokens``.
More than 4 markers are refused, as the API does. Tokens are the fakes' word counts, or what ``count``
returns. Inside ``held_writes()`` a request's writes are readable only after the block ends: calls sent
together (a workflow's parallel steps) do not read each other's, as Anthropic's cache is readable only once
a response has begun.

Lifetimes: a prefix lives 5 minutes from its write, or one hour when its marker says ``"ttl": "1h"`` and the
request sends the ``anthropic-beta`` value that introduced it (without it this fake keeps it 5 minutes, one
of the two behaviours reported of the API; the other is a 400); each read renews it. Time is ``clock()``
(``time.monotonic`` unless given), read once per request. A ``ttl`` other than ``5m``/``1h``, or a ``1h``
marker after a ``5m`` one, is refused as the API does. ``usage.cache_creation`` splits the writes by
lifetime.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    ephemeral_1h_input_tokens: int | None = None
    """Of ``cache_creation_input_tokens``, those written to the one-hour cache: ``usage.cache_creation``
    splits the writes by lifetime; None: no split sent."""


MAX_CACHE_MARKERS = 4
LOOKBACK_BLOCKS = 20
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
EXTENDED_CACHE_TTL_BETA = "extended-cache-ttl-2025-04-11"


def _ttl(block: dict[str, Any]) -> str | None:
    """A block's cache lifetime as its marker asks (``5m`` unless it says), None when unmarked."""
    control = block.get("cache_control")
    if control is None:
        return None
    return str(control.get("ttl", "5m")) if isinstance(control, dict) else "5m"


def _blocks(body: dict[str, Any]) -> list[tuple[str, str, str | None]]:
    """(role, text, the marker's ttl or None) of every prompt block in order: the system's, then each
    message's."""
    out: list[tuple[str, str, str | None]] = []

    def add(role: str, content: Any) -> None:
        if isinstance(content, str):
            out.append((role, content, None))
        elif isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "text":
                    out.append((role, str(block.get("text", "")), _ttl(block)))

    add("system", body.get("system"))
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            add(str(message.get("role")), message.get("content"))
    return out


class FakeAnthropicServer(FakeProviderServer):
    route = re.compile(r"^/v1/messages$")

    def __init__(self, *args: Any, prompt_cache_min_tokens: int | None = None,
                 count: Callable[[str], int] = count_words, clock: Callable[[], float] = time.monotonic,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prompt_cache_min_tokens = prompt_cache_min_tokens
        self.count = count
        self.clock = clock
        self._cache: dict[str, float] = {}
        """Prefix key -> its lifetime in seconds, counted from ``_touched[key]``."""
        self._touched: dict[str, float] = {}
        """Prefix key -> when it was last written or read (``clock()``)."""
        self._held: dict[str, tuple[float, float]] | None = None
        """Inside ``held_writes()``: prefix key -> (lifetime, when its request wrote it)."""
        self._cache_lock = threading.Lock()

    def clear_cache(self) -> None:
        with self._cache_lock:
            self._cache.clear()
            self._touched.clear()

    @contextmanager
    def held_writes(self) -> Iterator[None]:
        with self._cache_lock:
            self._held = {}
        try:
            yield
        finally:
            with self._cache_lock:
                for key, (lifetime, written_at) in (self._held or {}).items():
                    self._cache[key], self._touched[key] = lifetime, written_at
                self._held = None

    def _live(self, key: str, now: float) -> bool:
        return key in self._cache and now - self._touched[key] < self._cache[key]

    def _cached_usage(self, request: RecordedRequest, body: dict[str, Any]) -> dict[str, Any]:
        """Reads, writes and the rest of the prompt, by the module docstring's rules."""
        assert self.prompt_cache_min_tokens is not None
        betas = {beta.strip() for beta in request.headers.get("anthropic-beta", "").split(",")}
        extended = EXTENDED_CACHE_TTL_BETA in betas
        blocks = _blocks(body)
        sizes = [self.count(text) if text.strip() else 0 for _, text, _ in blocks]
        keys, digest = [], hashlib.sha256()
        for role, text, _ in blocks:
            digest.update(json.dumps([role, text]).encode())
            keys.append(digest.copy().hexdigest())
        marks = [(i, ttl if ttl == "1h" and extended else "5m") for i, (_, _, ttl) in enumerate(blocks) if ttl]
        total = sum(sizes)
        with self._cache_lock:
            now = self.clock()
            read_to = -1
            for mark, _ in marks:
                for i in range(mark, max(-1, mark - LOOKBACK_BLOCKS), -1):
                    if self._live(keys[i], now):
                        read_to = max(read_to, i)
                        break
            if read_to >= 0:
                self._touched[keys[read_to]] = now
            read = sum(sizes[:read_to + 1])
            written = {"5m": 0, "1h": 0}
            for mark, ttl in marks:
                prefix = sum(sizes[:mark + 1])
                if mark > read_to and prefix >= self.prompt_cache_min_tokens:
                    if self._held is None:
                        self._cache[keys[mark]], self._touched[keys[mark]] = TTL_SECONDS[ttl], now
                    else:
                        self._held[keys[mark]] = (TTL_SECONDS[ttl], now)
                    written[ttl] += prefix - read - sum(written.values())
        creation = sum(written.values())
        return {"input_tokens": total - read - creation, "cache_read_input_tokens": read,
                "cache_creation_input_tokens": creation,
                "cache_creation": {"ephemeral_5m_input_tokens": written["5m"],
                                   "ephemeral_1h_input_tokens": written["1h"]}}

    def success_body(self, request: RecordedRequest, match: re.Match[str], reply: Reply, text: str) -> Any:
        body = request.body if isinstance(request.body, dict) else {}
        input_tokens = reply.input_tokens
        cached: dict[str, Any] = {}
        if self.prompt_cache_min_tokens is not None and input_tokens is None:
            cached = self._cached_usage(request, body)
            input_tokens = cached.pop("input_tokens")
        if input_tokens is None:
            input_tokens = sum(self.count(t) for _, t, _ in _blocks(body) if t.strip())
        usage: dict[str, Any] = {
            "input_tokens": input_tokens,
            "output_tokens": reply.output_tokens if reply.output_tokens is not None else count_words(text),
            **cached,
        }
        if isinstance(reply, AnthropicReply):
            for name in ("cache_creation_input_tokens", "cache_read_input_tokens"):
                if getattr(reply, name) is not None:
                    usage[name] = getattr(reply, name)
            if reply.cache_creation_input_tokens is not None:
                usage.pop("cache_creation", None)  # the cache model's split no longer adds up to the total
            if reply.ephemeral_1h_input_tokens is not None:
                hour, all_writes = reply.ephemeral_1h_input_tokens, reply.cache_creation_input_tokens or 0
                assert 0 <= hour <= all_writes, "a scripted split needs its total (cache_creation_input_tokens)"
                usage["cache_creation"] = {"ephemeral_5m_input_tokens": all_writes - hour,
                                           "ephemeral_1h_input_tokens": hour}
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
        blocks = _blocks(body) if isinstance(body, dict) else []
        ttls = [ttl for _, _, ttl in blocks if ttl is not None]
        if len(ttls) > MAX_CACHE_MARKERS:
            return f"A maximum of {MAX_CACHE_MARKERS} blocks with cache_control may be provided."
        if any(ttl is not None and not text for _, text, ttl in blocks):
            return "cache_control cannot be set for empty text blocks"
        if any(ttl not in TTL_SECONDS for ttl in ttls):
            return "cache_control.ttl: Input should be '5m' or '1h'"
        if any(a == "5m" and b == "1h" for i, a in enumerate(ttls) for b in ttls[i + 1:]):
            return "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block"
        for i, message in enumerate(messages):
            final_assistant = i == len(messages) - 1 and message.get("role") == "assistant"
            texts = [t for _, t, _ in _blocks({"messages": [message]})]
            if not "".join(texts).strip() and not final_assistant:
                return f"messages.{i}: all messages must have non-empty content except for the optional final " \
                       "assistant message"
        return None

    def last_message_text(self, body: Any) -> str:
        messages = body.get("messages") if isinstance(body, dict) else None
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
            return " ".join(t for _, t, _ in _blocks({"messages": [messages[-1]]}))
        return ""
