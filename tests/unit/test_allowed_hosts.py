"""The Host allowlist (``CONDUCTOR_ALLOWED_HOSTS``, ``app.HostAllowed``): without keys a local API was
reachable from any web page by DNS rebinding (the page's name re-resolved to 127.0.0.1), since nothing
checked the Host header. The app's real ASGI stack, no database: an allowed request is one to a route
that needs none (the stylesheet, ``/openapi.json``), a refused one never reaches a route."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from conductor.service.app import HostAllowed, create_app
from conductor.settings import Settings, get_settings, host_allowed, host_name


@pytest.fixture
def configure(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """``configure(auth=..., hosts=...)`` sets the environment the app's settings are read from."""

    def apply(*, auth: bool, hosts: str | None = None) -> None:
        monkeypatch.setenv("CONDUCTOR_AUTH_REQUIRED", "true" if auth else "false")
        if hosts is None:
            monkeypatch.delenv("CONDUCTOR_ALLOWED_HOSTS", raising=False)
        else:
            monkeypatch.setenv("CONDUCTOR_ALLOWED_HOSTS", hosts)
        get_settings.cache_clear()

    yield apply
    monkeypatch.undo()
    get_settings.cache_clear()


def get(host: str | None, path: str = "/ui/viewer.css") -> tuple[int, dict[str, str], bytes]:
    """``GET path`` through the app with exactly this Host header (None: no Host header at all)."""
    return asyncio.run(call(create_app(), host, "GET", path))


async def call(app: object, host: str | None, method: str, path: str, body: bytes = b"",
               reads: list[int] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request through the ASGI app; ``reads`` counts the calls to ``receive``."""
    headers = [(b"content-type", b"application/x-www-form-urlencoded"), (b"content-length", str(len(body)).encode())]
    if host is not None:
        headers.append((b"host", host.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        if reads is not None:
            reads.append(1)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    await app(scope, receive, send)  # type: ignore[operator]
    start = next(m for m in sent if m["type"] == "http.response.start")
    response_headers = {k.decode(): v.decode() for k, v in start["headers"]}  # type: ignore[attr-defined]
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")  # type: ignore[misc]
    return int(start["status"]), response_headers, content  # type: ignore[call-overload]


def test_host_names_are_read_without_port_brackets_case_or_trailing_dot() -> None:
    assert host_name("localhost:8000") == "localhost"
    assert host_name("[::1]:8000") == host_name("[::1]") == host_name("::1") == "::1"
    assert host_name("LocalHost.") == "localhost"
    assert host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("") == ""


def test_without_keys_only_loopback_names_are_answered_by_default(configure) -> None:  # type: ignore[no-untyped-def]
    configure(auth=False)
    for host in ("localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "[::1]", "LOCALHOST"):
        status, _, _ = get(host)
        assert status == 200, host
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.2", "testserver",
                 "[::1]evil", "localhost:evil", None):
        status, headers, body = get(host)
        assert status == 400, host
        assert headers["content-type"] == "application/problem+json"
        assert b"CONDUCTOR_ALLOWED_HOSTS" in body, body
    assert b"'evil.example'" in get("evil.example")[2]
    assert b"no Host header" in get(None)[2]


def test_with_keys_any_host_is_answered_by_default(configure) -> None:  # type: ignore[no-untyped-def]
    configure(auth=True)
    for host in ("evil.example", "testserver", "10.0.0.7:8000", None):
        assert get(host)[0] == 200, host
    assert TestClient(create_app()).get("/openapi.json").status_code == 200  # Host: testserver


def test_the_setting_lists_names_ports_ignored_with_wildcards(configure) -> None:  # type: ignore[no-untyped-def]
    configure(auth=True, hosts=" api.example.com:443 , *.internal.example, [::1] ")
    for host in ("api.example.com", "api.example.com:8443", "a.internal.example", "b.a.internal.example:80",
                 "::1", "[::1]:8000"):
        assert get(host)[0] == 200, host
    for host in ("example.com", "internal.example", "evilinternal.example", "localhost", "127.0.0.1", None):
        assert get(host)[0] == 400, host
    configure(auth=False, hosts="*")
    assert get("anything.example:1234")[0] == 200
    assert get(None)[0] == 200


def test_the_openai_routes_refuse_in_their_own_error_shape(configure) -> None:  # type: ignore[no-untyped-def]
    configure(auth=False)
    status, headers, body = asyncio.run(call(create_app(), "evil.example", "GET", "/v1/models"))
    assert status == 400 and headers["content-type"] == "application/json"
    assert b'"error"' in body and b"CONDUCTOR_ALLOWED_HOSTS" in body, body
    # the client of the API's own tests talks to "testserver": allowed once listed
    configure(auth=False, hosts="testserver")
    assert TestClient(create_app()).get("/ui/viewer.css").status_code == 200


def test_a_refused_request_is_not_read(configure) -> None:  # type: ignore[no-untyped-def]
    configure(auth=False)
    app = create_app()
    body = b"key=cq_x&next=/ui/jobs"
    for path in ("/v1/jobs", "/ui/login", "/v1/chat/completions"):
        reads: list[int] = []
        status, _, _ = asyncio.run(call(app, "evil.example", "POST", path, body, reads))
        assert status == 400 and reads == [], path
    reads = []
    status, _, _ = asyncio.run(call(app, "localhost:8000", "POST", "/ui/login", body, reads))  # allowed: read
    assert status == 303
    assert reads, "the allowed request's body was not read: the check above proves nothing"


def test_a_host_with_anything_after_its_bracket_or_name_but_a_port_is_not_allowed() -> None:
    """host_name('[::1]evil') was '::1': what follows ']' must be ':port' (digits), as after a name."""
    for host in ("[::1]evil", "[::1]evil:80", "[::1].evil.example", "[::1]:80x", "[::1]:80:80", "localhost:evil",
                 "[::1", "[]"):
        assert not host_allowed(host_name(host), ("::1", "localhost")), host
    for host in ("[::1]", "[::1]:8000", "[::1]:", "localhost:8000", "localhost:"):
        assert host_allowed(host_name(host), ("::1", "localhost")), host


@pytest.mark.parametrize("entry", ["*.", "*..", "a.*.example", "*example.com", "**", "[]", "[::1]evil", ":80",
                                   "."])
def test_an_allowlist_entry_that_names_no_host_is_refused_at_start(entry: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """'*.' normalised to '*' and allowed every host; an entry naming nothing must stop the server, saying
    which and what to write."""
    monkeypatch.setenv("CONDUCTOR_ALLOWED_HOSTS", f"localhost,{entry}")
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert "CONDUCTOR_ALLOWED_HOSTS" in str(refused.value) and repr(entry) in str(refused.value), refused.value


def test_allowlist_entries_that_name_hosts_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONDUCTOR_ALLOWED_HOSTS", " * , *.example.com., [::1]:8000, ::1, LocalHost:80, 10.0.0.7 ,")
    assert Settings().host_allowlist() == ("*", "*.example.com", "::1", "::1", "localhost", "10.0.0.7")


def websocket(host: str) -> tuple[list[dict[str, object]], list[Scope]]:
    """A WebSocket handshake with this Host through HostAllowed around an app that records what reaches it."""
    reached: list[Scope] = []
    sent: list[dict[str, object]] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        reached.append(scope)

    async def receive() -> dict[str, object]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "ws",
             "path": "/v1/anything", "raw_path": b"/v1/anything", "query_string": b"", "root_path": "",
             "headers": [(b"host", host.encode())], "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "subprotocols": []}
    asyncio.run(HostAllowed(inner)(scope, receive, send))  # type: ignore[arg-type]
    return sent, reached


def test_a_websocket_handshake_is_checked_too(configure) -> None:  # type: ignore[no-untyped-def]
    """HostAllowed passed websocket scopes through unchecked: a rebinding page could open one."""
    configure(auth=False)
    sent, reached = websocket("evil.example")
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": "Host not allowed"}] and not reached
    sent, reached = websocket("localhost:8000")
    assert sent == [] and len(reached) == 1
