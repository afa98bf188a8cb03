"""RFC 9457 problem details: the one error shape of the REST API, and the handlers that produce it.

HTTP status codes for domain errors are chosen here and nowhere else."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import DEFAULT_MAX_HEADER_SIZE
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import MultiPartException

from conductor.errors import Rejection
from conductor.quotas import QuotaExceeded, check_failed_lookup
from conductor.settings import get_settings
from conductor.store.db import DATABASE_AWAY, driver_reason
from conductor.submission import MAX_JSON_DEPTH, IdempotencyConflict, SubmissionError
from conductor.workflow import MAX_REPORTED_ERRORS

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"
REF = "#/components/schemas/"
OPENAI_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/files", "/v1/batches")
"""The OpenAI-compatible routes, answered in OpenAI's error shape (``openai_errors``)."""
NO_RETRY = {"x-should-retry": "false"}
"""The official clients retry 408, 409, 429 and 5xx unless told not to; a retried chat completion would
start a second job."""


KEY_FOUND = "conductor_key_found"
"""``request.state`` attribute a tenant dependency sets once the request's key is found (``deps.key_found``):
FastAPI runs dependencies before it validates the body and parameters, so a refusal after it need not look
the key up again."""


def is_openai_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in OPENAI_PATHS)


class FieldProblem(BaseModel):
    """One invalid input: where it is (``["body", "workflow", "subtasks", 1]``) and what is wrong."""

    loc: list[str | int]
    msg: str


class ProblemDocument(BaseModel):
    """RFC 9457 problem details, as every error response carries them."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[FieldProblem] | None = None


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of the problem+json error responses a route can send."""
    schema = {"$ref": f"{REF}ProblemDocument"}
    return {status: {"model": ProblemDocument, "content": {PROBLEM: {"schema": schema}}} for status in statuses}


class Problem(Exception):
    def __init__(self, status: int, title: str, detail: str = "", errors: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(detail or title)
        self.status, self.title, self.detail, self.errors, self.headers = status, title, detail, errors, headers


class UnknownKey(Problem):
    """401: the bearer key sent is unknown or revoked. The error handlers count it against the client's
    address (``unknown_key_refusal``)."""

    def __init__(self) -> None:
        super().__init__(401, "Unauthorized", "unknown or revoked API key", headers={"WWW-Authenticate": "Bearer"})


def unknown_key_refusal(client: str | None, path: str) -> JSONResponse:
    """The answer to an unknown key from ``client`` (an address; None when the server does not know it)
    to ``path``: 401, or once that address has failed ``auth_failures_per_minute`` lookups
    (``check_failed_lookup``, one Redis call: run it off the event loop) 429 with Retry-After. On the
    OpenAI routes that is still 401 (``invalid_api_key`` in their shape), saying why and for how long, with
    Retry-After and ``x-should-retry: false``: the official SDK retries every 429, so a 429 made a wrong key
    cost more failed lookups and a wait, and ended in RateLimitError instead of AuthenticationError."""
    refused = UnknownKey()
    try:
        check_failed_lookup(client or "unknown", get_settings())
    except QuotaExceeded as over:
        if is_openai_path(path):
            return problem_response(refused.status, over.title, f"{refused.detail}, and too many failed key "
                                    f"lookups from this address: {over.detail}", headers={
                                        **(refused.headers or {}), "Retry-After": over.retry_after, **NO_RETRY})
        return problem_response(429, over.title, over.detail, headers={"Retry-After": over.retry_after})
    return problem_response(refused.status, refused.title, refused.detail, headers=refused.headers)


HTTP_STATUS: dict[Rejection, int] = {
    Rejection.MALFORMED: 400,
    Rejection.NOT_FOUND: 404,
    Rejection.CONFLICT: 409,
    Rejection.TOO_LARGE: 413,
    Rejection.INVALID: 422,
}
"""The one place a domain refusal becomes an HTTP status."""


def http_status(kind: Rejection) -> int:
    return HTTP_STATUS[kind]


def problem_response(status: int, title: str, detail: str = "", errors: list[dict[str, Any]] | None = None,
                     headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status, "detail": detail or title}
    if errors:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


MAX_ERROR_PART_CHARS = 200
UNPARSED_BODY = "There was an error parsing the body"
"""FastAPI's 400 for a JSON body whose parse raised something other than a syntax error (its cause)."""


def unreadable_json(cause: BaseException | None) -> str:
    """What to do about a JSON body the parser could not read (FastAPI's ``UNPARSED_BODY``)."""
    if isinstance(cause, RecursionError):
        return (f"the JSON body is nested too deeply to parse: workflow and metadata may nest at most "
                f"{MAX_JSON_DEPTH} levels")
    if isinstance(cause, UnicodeError):
        return "the JSON body is not valid UTF-8: send it encoded as UTF-8 (RFC 8259)"
    return "the body could not be read as JSON: send one JSON object, encoded as UTF-8"


MISSING_BOUNDARY = "Missing boundary in multipart."
"""Starlette's 400 for a multipart body whose Content-Type names no boundary."""
HEADER_TOO_LONG = "Maximum header size exceeded"
"""python-multipart's refusal of a part's header line past its limit (Starlette: "Invalid multipart data.")."""
MAX_PART_HEADER_LINE_BYTES = DEFAULT_MAX_HEADER_SIZE
"""python-multipart's limit on one header line of a part (4,224 bytes; Starlette keeps its default). Any
line past it is refused, whichever it is: a long file name in ``Content-Disposition`` (an RFC 2231
``filename*`` percent-encodes each byte in three: ~350 characters), a long field name, a long
``Content-Type``; the parser does not say which part."""


def unreadable_form(exc: StarletteHTTPException) -> tuple[tuple[str, ...], str] | None:
    """Where and why a multipart or form body could not be parsed, from the parser's error behind Starlette's
    400 (its ``MultiPartException``, and python-multipart's own error behind that), saying what to send
    instead; None for a 400 that is not a form parser's."""
    causes: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(causes) < 8:
        causes.append(seen)
        seen = seen.__cause__ or seen.__context__
    if not any(isinstance(c, MultiPartException) for c in causes):
        return None
    if exc.detail == MISSING_BOUNDARY:
        return ("body",), ("the multipart body names no boundary: its Content-Type must be "
                           "'multipart/form-data; boundary=...' as the body's parts use it (an HTTP client's "
                           "files=/data= builds both; a Content-Type header set by hand loses the boundary)")
    if any(isinstance(c, FormParserError) and HEADER_TOO_LONG in str(c) for c in causes):
        return ("body",), (f"a part's header line is over {MAX_PART_HEADER_LINE_BYTES:,} bytes (for instance the "
                           "file's name): the multipart parser reads no longer line; shorten the part's name, "
                           "file name or Content-Type")
    return ("body",), (f"the multipart body could not be parsed ({exc.detail}): send multipart/form-data as an "
                       "HTTP client's files=/data= builds it")


def validation_errors(raw: Sequence[Any]) -> list[dict[str, Any]]:
    """At most ``MAX_REPORTED_ERRORS`` of a request's validation errors, each location part and message
    cut at ``MAX_ERROR_PART_CHARS``, then one saying how many more: a body built to fail on every item
    (or with megabyte-long keys) gets a short answer, not one larger than itself."""

    def cut(value: Any) -> Any:
        text = value if isinstance(value, str) else None
        return text[:MAX_ERROR_PART_CHARS] + "..." if text is not None and len(text) > MAX_ERROR_PART_CHARS else value

    errors = [{"loc": [cut(p) for p in e.get("loc", ())], "msg": cut(e.get("msg", ""))}
              for e in raw[:MAX_REPORTED_ERRORS]]
    if len(raw) > MAX_REPORTED_ERRORS:
        errors.append({"loc": [], "msg": f"... and {len(raw) - MAX_REPORTED_ERRORS} more errors like these"})
    return errors


def database_unavailable(exc: Exception) -> JSONResponse:
    # the driver's own message (never the statement's parameters) says which it is: the server down, a
    # refused password, too many connections; check CONDUCTOR_DATABASE_URL and the database's log
    log.warning("database unavailable: %s: %s", type(exc).__name__, driver_reason(exc))
    return problem_response(503, "Database unavailable", "the job store cannot be reached; retry shortly",
                            headers={"Retry-After": "5"})


def install_error_handlers(app: FastAPI, key_check: Callable[[str | None], object] | None = None) -> None:
    """``key_check(authorization)`` raises a 401 ``Problem`` for a request without a key and ``UnknownKey``
    for a key no tenant holds (blocking: it may look the key up); a request to ``/v1/`` whose body fails
    validation is judged by it first."""

    @app.exception_handler(QuotaExceeded)
    async def _quota(_: Request, exc: QuotaExceeded) -> JSONResponse:
        return problem_response(429, exc.title, exc.detail, headers={"Retry-After": exc.retry_after})

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        if isinstance(exc, UnknownKey):
            return await run_in_threadpool(unknown_key_refusal, request.client.host if request.client else None,
                                           request.url.path)
        return problem_response(exc.status, exc.title, exc.detail, exc.errors, exc.headers)

    @app.exception_handler(SubmissionError)
    async def _submission(_: Request, exc: SubmissionError) -> JSONResponse:
        return problem_response(http_status(exc.kind), exc.title, str(exc), [e.as_dict() for e in exc.errors])

    @app.exception_handler(IdempotencyConflict)
    async def _idem(_: Request, exc: IdempotencyConflict) -> JSONResponse:
        return problem_response(422, "Idempotency-Key reused", str(exc),
                                [{"loc": ["header", "Idempotency-Key"], "msg": str(exc)}])

    async def refused_key(request: Request) -> JSONResponse | None:
        """The 401 for a request to ``/v1/`` without a key or with one no tenant holds (every /v1/ route
        needs one), else None. FastAPI parses and validates a body before the endpoint runs (and parses it
        before any dependency), and ``POST /v1/jobs`` looks its key up inside the endpoint: a body refused
        there would otherwise be described field by field to a caller who sent no key, or a wrong one. Only
        a refusal pays the lookup, and not one whose key a tenant dependency already found (``KEY_FOUND``);
        an unknown key is counted as every failed lookup is."""
        if key_check is None or not request.url.path.startswith("/v1/") or getattr(request.state, KEY_FOUND, False):
            return None
        try:
            await run_in_threadpool(key_check, request.headers.get("authorization"))
        except UnknownKey:
            return await run_in_threadpool(unknown_key_refusal, request.client.host if request.client else None,
                                           request.url.path)
        except Problem as missing:
            return problem_response(missing.status, missing.title, missing.detail, headers=missing.headers)
        except DATABASE_AWAY as exc:
            return database_unavailable(exc)
        return None

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        if (refused := await refused_key(request)) is not None:
            return refused
        errors = validation_errors(exc.errors())
        return problem_response(422, "Invalid request", "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors), errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # a body FastAPI could not parse: the key first (in _validation), as for every refused body
        if exc.status_code == 400 and exc.detail == UNPARSED_BODY:
            return await _validation(request, RequestValidationError(
                [{"loc": ("body",), "msg": unreadable_json(exc.__cause__), "type": "json_invalid"}]))
        if exc.status_code == 400 and (form := unreadable_form(exc)) is not None:
            return await _validation(request, RequestValidationError(
                [{"loc": form[0], "msg": form[1], "type": "form_invalid"}]))
        if exc.status_code == 400 and (refused := await refused_key(request)) is not None:
            return refused
        return problem_response(exc.status_code, str(exc.detail), str(exc.detail))

    @app.exception_handler(DataError)
    async def _unstorable(_: Request, exc: DataError) -> JSONResponse:
        # Input the database refused to store: a client error, never a reason to retry.
        return problem_response(422, "Invalid input", "a value in the request cannot be stored")

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)  # every pooled connection busy past the pool's timeout: a stall
    async def _db_down(_: Request, exc: Exception) -> JSONResponse:
        return database_unavailable(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return problem_response(500, "Internal error", "an unexpected error occurred; it has been logged")
