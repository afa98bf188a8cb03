"""A scriptable loopback HTTP server: the shared half of every fake LLM provider.

A real socket server on 127.0.0.1 (port chosen by the OS) in a background thread, so the real SDKs
(and other processes, through ``base_url``) talk to it exactly as they would to the provider. Each
subclass speaks one wire format: which paths it serves, how a success and an error body look, and
where the API key travels.

For every request, the server answers with the first scripted ``Reply`` (FIFO), else with the reply
function's result, else with a default success echoing the last message. Every request is recorded.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Reply:
    """One scripted answer. By default a 200 success in the provider's format."""

    text: str | None = None
    """Success text; None means "echo the last message"."""
    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None
    """An error message, sent in the provider's error body format with ``status``."""
    body: Any = None
    """An explicit body that replaces the generated one: bytes/str are sent raw, anything else as JSON."""
    delay_s: float = 0.0
    """Wait this long before answering (longer than the client's timeout = a hang)."""
    drop: bool = False
    """Close the connection without answering."""
    input_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    """In the provider's own vocabulary (``stop`` / ``end_turn`` / ``STOP``)."""
    model: str | None = None


def ok(text: str, **kwargs: Any) -> Reply:
    return Reply(text=text, **kwargs)


def error(status: int, message: str = "scripted error", *, retry_after: str | None = None) -> Reply:
    headers = {"retry-after": retry_after} if retry_after is not None else {}
    return Reply(status=status, error=message, headers=headers)


def hang(seconds: float) -> Reply:
    """Answer (a normal success) only after ``seconds``: a client with a shorter timeout gives up."""
    return Reply(delay_s=seconds)


def malformed(body: bytes = b'{"id": "truncated", "choices": [') -> Reply:
    """A 200 that claims JSON but is not parseable."""
    return Reply(body=body)


def drop() -> Reply:
    return Reply(drop=True)


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    """Lower-cased header names."""
    body: Any
    """Parsed JSON body, or None when it was empty or not JSON."""
    raw: bytes


ReplyFunction = Callable[[Any], "str | Reply"]
"""Request JSON body -> reply text (or a full Reply)."""


class FakeProviderServer:
    """Subclasses set ``route`` and implement the three wire-format hooks below."""

    route: re.Pattern[str] = re.compile(r"^$")
    base_path: str = ""
    """Appended to ``http://127.0.0.1:PORT`` in ``base_url``."""

    def __init__(self, reply: ReplyFunction | None = None, *, api_key: str | None = None):
        """``api_key``: when given, requests that do not present it are answered 401."""
        self._reply_function = reply
        self._api_key = api_key
        self._script: deque[Reply] = deque()
        self._requests: list[RecordedRequest] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._counter = 0

    # -- wire-format hooks -------------------------------------------------------------------------
    def success_body(self, request: RecordedRequest, match: re.Match[str], reply: Reply, text: str) -> Any:
        raise NotImplementedError

    def error_body(self, status: int, message: str) -> Any:
        raise NotImplementedError

    def presented_key(self, request: RecordedRequest) -> str | None:
        raise NotImplementedError

    def last_message_text(self, body: Any) -> str:
        """The text the default reply echoes."""
        return ""

    def invalid(self, body: Any) -> str | None:
        """Why the real API would refuse this request body with a 400, where the fake checks it."""
        return None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> Self:
        handler = _handler_for(self)
        self._httpd = _QuietServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.02},  # how soon shutdown() is noticed
            name=type(self).__name__,
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._closing.set()  # wakes handlers that are "hanging"
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return int(self._httpd.server_address[1])

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.base_path}"

    # -- scripting ---------------------------------------------------------------------------------
    def script(self, *replies: Reply | str) -> None:
        """Queue replies (a bare string is a success with that text), answered first-in first-out."""
        with self._lock:
            self._script.extend(r if isinstance(r, Reply) else Reply(text=r) for r in replies)

    def reply_with(self, function: ReplyFunction | None) -> None:
        """Answer unscripted requests with ``function(request_body)``."""
        with self._lock:
            self._reply_function = function

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def bodies(self) -> list[Any]:
        return [r.body for r in self.requests]

    @property
    def pending(self) -> int:
        """Scripted replies not yet used."""
        with self._lock:
            return len(self._script)

    def wait_for_requests(self, count: int, timeout_s: float = 5.0) -> list[RecordedRequest]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            current = self.requests
            if len(current) >= count:
                return current
            time.sleep(0.01)
        raise TimeoutError(f"expected {count} requests, got {len(self.requests)}")

    # -- request handling (server threads) ---------------------------------------------------------
    def _next_reply(self, request: RecordedRequest) -> Reply:
        with self._lock:
            self._requests.append(request)
            self._counter += 1
            if self._script:
                return self._script.popleft()
            function = self._reply_function
        if function is None:
            return Reply()
        result = function(request.body)
        return result if isinstance(result, Reply) else Reply(text=result)

    def _respond(self, request: RecordedRequest) -> tuple[int, dict[str, str], bytes] | None:
        """(status, headers, body) to send, or None to close the connection without an answer."""
        match = self.route.match(request.path)
        if request.method != "POST" or match is None:
            with self._lock:
                self._requests.append(request)
            return 404, {}, _json(self.error_body(404, f"no route for {request.method} {request.path}"))
        if self._api_key is not None and self.presented_key(request) != self._api_key:
            with self._lock:
                self._requests.append(request)
            return 401, {}, _json(self.error_body(401, "invalid API key"))
        problem = self.invalid(request.body)
        if problem is not None:
            with self._lock:
                self._requests.append(request)
            return 400, {}, _json(self.error_body(400, problem))
        reply = self._next_reply(request)
        if reply.delay_s and self._closing.wait(reply.delay_s):
            return None
        if reply.drop:
            return None
        if reply.body is not None:
            raw = reply.body if isinstance(reply.body, bytes) else None
            if raw is None:
                raw = reply.body.encode() if isinstance(reply.body, str) else _json(reply.body)
            return reply.status, dict(reply.headers), raw
        if reply.error is not None or reply.status >= 400:
            body = self.error_body(reply.status, reply.error or "scripted error")
            return reply.status, dict(reply.headers), _json(body)
        text = reply.text if reply.text is not None else f"echo: {self.last_message_text(request.body)}"
        return reply.status, dict(reply.headers), _json(self.success_body(request, match, reply, text))

    def next_id(self, prefix: str) -> str:
        with self._lock:
            return f"{prefix}-{self._counter}"


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def count_words(text: str) -> int:
    """The fakes' stand-in for a tokenizer when a reply does not script token counts."""
    return max(1, len(text.split()))


def texts_in(value: Any) -> Iterable[str]:
    """Every string under ``value`` (for counting prompt "tokens" in any wire format)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from texts_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from texts_in(item)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # many workers connecting at once must not wait on SYN retransmits

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that time out and hang up mid-reply are expected here, not failures to report.
        pass


def _handler_for(server: FakeProviderServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self._handle()

        def do_GET(self) -> None:
            self._handle()

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _handle(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = None
            url = urlsplit(self.path)
            request = RecordedRequest(
                method=self.command,
                path=url.path,
                query=parse_qs(url.query),
                headers={k.lower(): v for k, v in self.headers.items()},
                body=body,
                raw=raw,
            )
            outcome = server._respond(request)
            if outcome is None:
                self.close_connection = True
                with contextlib.suppress(OSError):  # the client may have hung up already
                    self.connection.shutdown(socket.SHUT_RDWR)
                return
            status, headers, payload = outcome
            if not any(name.lower() == "content-type" for name in headers):
                headers["content-type"] = "application/json"
            try:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    return Handler
