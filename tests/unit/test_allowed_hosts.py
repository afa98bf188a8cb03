"""The Host allowlist (``CONDUCTOR_ALLOWED_HOSTS``, ``app.HostAllowed``): without keys a local API was
reachable from any web page by DNS rebinding (the page's name re-resolved to 127.0.0.1), since nothing
checked the Host header. The app's real ASGI stack, no database: an allowed request is one to a route
that needs none (the stylesheet, ``/openapi.json``), a refused one never reaches a route."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from conductor.service.app import create_app
from conductor.settings import get_settings, host_name


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
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.2", "testserver", None):
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
