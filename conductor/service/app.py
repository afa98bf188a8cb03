"""The REST API: the app factory. Routes live in ``routes/`` (one module per resource), shared
dependencies in ``deps.py``, the problem+json error shape in ``problems.py``."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from sqlmodel import Session
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conductor.sealed import SECRETS_KEY_WARNING
from conductor.service import api_docs
from conductor.service.deps import SessionDep, bearer_key, resolve_tenant
from conductor.service.openai_errors import install_openai_errors
from conductor.service.openapi import published_schema
from conductor.service.problems import (
    Problem,
    UnknownKey,
    database_unavailable,
    install_error_handlers,
    problem_response,
    problems,
    unknown_key_refusal,
)
from conductor.service.routes import batches, files, jobs, metrics, openai_chat, openai_responses, ui, webhooks
from conductor.service.schemas import Health
from conductor.settings import Settings, get_settings, host_allowed, host_name
from conductor.store.db import DATABASE_AWAY, get_engine
from conductor.store.keys import PEPPER_WARNING

log = logging.getLogger(__name__)


def create_app() -> FastAPI:
    app = FastAPI(title="Conductor Queue", version="0.1.0", docs_url=None, redoc_url=None)  # /docs: api_docs
    startup = get_settings()
    if startup.auth_required and not startup.api_key_pepper:
        log.warning(PEPPER_WARNING)
    if startup.auth_required and not startup.secrets_key:
        log.warning(SECRETS_KEY_WARNING)
    install_error_handlers(app, key_check=_key_check)
    app.add_middleware(KeyBeforeBody)
    app.add_middleware(BodyLimit)  # outside KeyBeforeBody: oversize headers and declared bodies first
    app.add_middleware(HostAllowed)  # outside both: a request to a name not ours is refused first

    @app.get("/healthz", responses=problems(503))
    def healthz(session: SessionDep) -> Health:
        session.connection().exec_driver_sql("SELECT 1")
        return Health()

    app.include_router(jobs.router)
    app.include_router(metrics.router)
    app.include_router(ui.router)
    app.include_router(openai_chat.router)
    app.include_router(openai_responses.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(webhooks.router)
    app.include_router(api_docs.router)
    install_openai_errors(app)  # last: its middleware must wrap BodyLimit
    app.openapi = lambda: published_schema(app)  # type: ignore[method-assign]
    return app


MULTIPART_OVERHEAD_BYTES = 64 * 1024


def body_limit(scope: Scope) -> int:
    """``max_body_bytes``, except for a batch file upload: that file may be ``batch_max_file_bytes``."""
    settings = get_settings()
    if is_upload(scope):
        return max(settings.max_body_bytes, settings.batch_max_file_bytes + MULTIPART_OVERHEAD_BYTES)
    return settings.max_body_bytes


def header_bytes(scope: Scope) -> int:
    """What a request's headers take, as ``max_header_bytes`` counts them: each name and value plus the
    4 bytes of ``": "`` and CRLF."""
    return sum(len(name) + len(value) + 4 for name, value in scope["headers"])


class BodyLimit:
    """431 for headers over ``max_header_bytes``. 413 for bodies over ``max_body_bytes``: by Content-Length
    up front, and by counting the bytes as they arrive (a chunked body has no length), so an oversize
    body is never buffered whole."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        most_headers = get_settings().max_header_bytes
        if (sent := header_bytes(scope)) > most_headers:
            await problem_response(
                431, "Request headers too large", f"the request's headers take {sent} bytes; the limit is "
                f"{most_headers} (CONDUCTOR_MAX_HEADER_BYTES): send fewer or shorter headers (a browser also "
                "sends every cookie it holds for this host)")(scope, receive, send)
            return
        limit = body_limit(scope)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await problem_response(413, "Request body too large", f"the limit is {limit} bytes")(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises an HTTPException from body reading as it is (our problem handler).
                    raise StarletteHTTPException(413, "Request body too large")
            return message

        await self.app(scope, counted, send)


MAX_SHOWN_HOST_CHARS = 255
"""A refused Host is named in the refusal up to this long (a DNS name's longest)."""


class HostAllowed:
    """400 for a request whose ``Host`` names a host not in ``CONDUCTOR_ALLOWED_HOSTS``
    (``Settings.host_allowlist``), before any other check and before its body is read. Against DNS
    rebinding: a web page whose name is re-resolved to this server's address (127.0.0.1) makes the
    browser send it the page's requests, same-origin for the page, with the page's name as ``Host``. With
    keys required the pages cannot send one and the default allows any host; without keys (local use) only
    the loopback names are allowed by default. Inside ``OpenAIErrorShape``: the OpenAI routes answer the
    refusal in their error shape. A WebSocket handshake is checked alike and refused by closing it (1008;
    the server answers the handshake 403)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        allowlist = get_settings().host_allowlist()
        if allowlist != ("*",):
            raw = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if not host_allowed(host_name(raw), allowlist):
                if scope["type"] == "websocket":  # (a page's script opens one as it sends a request)
                    # closed before it is accepted: the server answers the handshake 403 (ASGI)
                    await receive()  # websocket.connect
                    await send({"type": "websocket.close", "code": 1008, "reason": "Host not allowed"})
                    return
                shown = raw[:MAX_SHOWN_HOST_CHARS] + ("..." if len(raw) > MAX_SHOWN_HOST_CHARS else "")
                named = f"the Host header names {shown!r}" if raw else "the request has no Host header"
                await problem_response(
                    400, "Host not allowed", f"{named}, which this server does not answer to: add the name "
                    "clients reach it by to CONDUCTOR_ALLOWED_HOSTS (comma-separated names, a port is "
                    "ignored; '*' allows any). Without keys (CONDUCTOR_AUTH_REQUIRED=false) only localhost, "
                    "127.0.0.1 and ::1 are allowed by default")(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_upload(scope: Scope) -> bool:
    return scope["path"] == "/v1/files" and scope["method"] == "POST"


def _known_key(settings: Settings, authorization: str | None) -> None:
    """401 (a ``Problem``) unless ``authorization`` holds an active key; a short session of its own."""
    with Session(get_engine(settings.database_url)) as session:
        resolve_tenant(session, settings, authorization)


def _key_check(authorization: str | None) -> None:
    """401 (a ``Problem``) without a key, ``UnknownKey`` for a key no tenant holds: what a refused body
    is judged by first (``install_error_handlers``)."""
    settings = get_settings()
    if bearer_key(settings, authorization) is not None:
        _known_key(settings, authorization)


class KeyBeforeBody:
    """Every ``/v1/`` route needs a key, but FastAPI reads and parses a body before any dependency runs:
    a request without a bearer key is answered 401 here, its body unread. A batch upload (the one body
    allowed past ``max_body_bytes``: a file spooled to disk) also has its key looked up first; other
    routes look theirs up in the endpoint, as before."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            settings = get_settings()
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                bearer_key(settings, authorization)
                if is_upload(scope) and settings.auth_required:
                    await run_in_threadpool(_known_key, settings, authorization)
            except UnknownKey:
                client = scope.get("client")
                await (await run_in_threadpool(unknown_key_refusal, client[0] if client else None,
                                               scope["path"]))(scope, receive, send)
                return
            except Problem as refused:
                response = problem_response(refused.status, refused.title, refused.detail, headers=refused.headers)
                await response(scope, receive, send)
                return
            except DATABASE_AWAY as exc:  # outside the app's exception handlers: answered as they would
                await database_unavailable(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
