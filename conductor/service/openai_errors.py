"""The OpenAI error shape, ``{"error": {"message", "type", "param", "code"}}``, on the OpenAI-compatible
routes only (``OPENAI_PATHS``); every other route keeps RFC 9457 problem+json.

Errors raised by the shared machinery (authentication, validation, the body limit, a database outage)
are rendered as problem+json by ``problems.py`` and converted here, on the way out, by one middleware:
the mapping of failures to statuses stays in one place. As the OpenAI API does, a request that fails
validation is answered 400 (not 422).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import MutableHeaders
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conductor.openai_wire import ErrorDetail, ErrorDocument
from conductor.service.problems import NO_RETRY, OPENAI_PATHS, PROBLEM, is_openai_path

__all__ = ["NO_RETRY", "OPENAI_PATHS", "is_openai_path"]  # (defined beside the problems, which need them)

_TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "rate_limit_error"}
_CODES = {
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error raised by an OpenAI-compatible route, already in that API's terms."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type or error_type(status)
        self.headers = headers


def error_type(status: int) -> str:
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    detail = ErrorDetail(message=message, type=type or error_type(status), param=param,
                         code=code or _CODES.get(status))
    return ErrorDocument(error=detail).model_dump()


def openai_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of the error responses an OpenAI-compatible route can send."""
    return {status: {"model": ErrorDocument} for status in statuses}


def from_problem(status: int, problem: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """A problem+json document as (status, OpenAI error body)."""
    param = None
    errors = problem.get("errors") or []
    if errors and isinstance(errors[0], dict):
        loc = [str(p) for p in errors[0].get("loc", []) if p not in ("body", "query", "path", "header")]
        param = ".".join(loc) or None
    message = str(problem.get("detail") or problem.get("title") or "error")
    status = 400 if status == 422 else status
    return status, error_body(status, message, param=param)


def install_openai_errors(app: FastAPI) -> None:
    """Call after ``install_error_handlers`` and after every other middleware is added."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        body = error_body(exc.status, exc.message, code=exc.code, param=exc.param, type=exc.type)
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    # Unhandled exceptions are answered by Starlette's outermost ServerErrorMiddleware, outside any
    # middleware of ours, so its handler converts for itself.
    original = app.exception_handlers.get(Exception)
    if original is not None:
        handler = cast(Callable[[Request, Exception], Awaitable[Response]], original)

        async def _unexpected(request: Request, exc: Exception) -> Response:
            response = await handler(request, exc)
            if not is_openai_path(request.url.path) or not isinstance(response, JSONResponse):
                return response
            status, body = from_problem(response.status_code, json.loads(bytes(response.body)))
            return JSONResponse(body, status_code=status)

        app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(OpenAIErrorShape)


class OpenAIErrorShape:
    """Rewrites problem+json responses on the OpenAI-compatible paths into the OpenAI error shape."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_openai_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        held: Message | None = None
        chunks: list[bytes] = []

        async def reshape(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                if MutableHeaders(raw=list(message["headers"])).get("content-type", "").startswith(PROBLEM):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                await _send_converted(send, held, b"".join(chunks))
                return
            await send(message)

        await self.app(scope, receive, reshape)


async def _send_converted(send: Send, start: Message, raw: bytes) -> None:
    try:
        problem = json.loads(raw)
    except ValueError:
        problem = {"detail": raw.decode(errors="replace")}
    status, body = from_problem(int(start["status"]), problem)
    content = json.dumps(body).encode()
    headers = MutableHeaders(raw=list(start["headers"]))
    headers["content-type"] = "application/json"
    headers["content-length"] = str(len(content))
    await send({"type": "http.response.start", "status": status, "headers": headers.raw})
    await send({"type": "http.response.body", "body": content})
