"""The REST API. Errors are RFC 9457 problem+json; every read and write is scoped to the caller's tenant."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlmodel import Session
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from conductor.engine import cancel_job
from conductor.service.views import job_links, job_view, steps_tree
from conductor.settings import Settings, get_settings
from conductor.store import jobs as store
from conductor.store.db import get_engine
from conductor.store.keys import tenant_for_key
from conductor.store.models import JobStatus
from conductor.submission import IdempotencyConflict, JobCreate, SubmissionError, create_job

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"
DEFAULT_TENANT = "default"
MAX_LIST_LIMIT = 200


JobStatusName = Literal["queued", "planning", "running", "succeeded", "failed", "cancelled"]


class ProblemDocument(BaseModel):
    """RFC 9457 problem details, as every error response carries them."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str
    errors: list[dict[str, Any]] | None = None


def problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI declarations of the problem+json error responses a route can send."""
    schema = {"$ref": "#/components/schemas/ProblemDocument"}
    return {status: {"model": ProblemDocument, "content": {PROBLEM: {"schema": schema}}} for status in statuses}


class Problem(Exception):
    def __init__(self, status: int, title: str, detail: str = "", errors: list[dict[str, Any]] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(detail or title)
        self.status, self.title, self.detail, self.errors, self.headers = status, title, detail, errors, headers


def problem_response(status: int, title: str, detail: str = "", errors: list[dict[str, Any]] | None = None,
                     headers: dict[str, str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status, "detail": detail or title}
    if errors:
        body["errors"] = errors
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)


# --- dependencies ---------------------------------------------------------------------------------


def settings_dep() -> Settings:
    return get_settings()


SettingsDep = Annotated[Settings, Depends(settings_dep)]


def session_dep(settings: SettingsDep) -> Iterator[Session]:
    with Session(get_engine(settings.database_url), expire_on_commit=False) as session:
        yield session


SessionDep = Annotated[Session, Depends(session_dep)]


def resolve_tenant(session: Session, settings: Settings, authorization: str | None) -> str:
    if not settings.auth_required:
        return DEFAULT_TENANT
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        raise Problem(401, "Unauthorized", "send 'Authorization: Bearer <key>'; create one with "
                      "'conductor keys create --tenant NAME'", headers={"WWW-Authenticate": "Bearer"})
    tenant = tenant_for_key(session, key=key.strip(), pepper=settings.api_key_pepper)
    if tenant is None:
        raise Problem(401, "Unauthorized", "unknown or revoked API key", headers={"WWW-Authenticate": "Bearer"})
    return tenant


def tenant_dep(
    session: SessionDep, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> str:
    return resolve_tenant(session, settings, authorization)


TenantDep = Annotated[str, Depends(tenant_dep)]


# --- the app --------------------------------------------------------------------------------------


def create_app() -> FastAPI:
    app = FastAPI(title="Conductor Queue", version="0.1.0")
    _install_error_handlers(app)
    _install_body_limit(app)

    @app.get("/healthz", responses=problems(503))
    def healthz(session: SessionDep) -> dict[str, Any]:
        session.connection().exec_driver_sql("SELECT 1")
        return {"status": "ok"}

    @app.post("/v1/jobs", status_code=202, responses=problems(400, 401, 413, 422, 503))
    def submit_job(
        body: JobCreate,
        request: Request,
        response: Response,
        session: SessionDep,
        tenant: TenantDep,
        settings: SettingsDep,
        idempotency_key: Annotated[str | None, Header()] = None,
    ) -> dict[str, Any]:
        from conductor.tasks.send import enqueue_plan

        job, created = create_job(
            session, body, tenant=tenant, settings=settings, idempotency_key=idempotency_key
        )
        session.commit()  # durable before any message is sent: an accepted job is never lost
        enqueued = enqueue_plan(job.id) if created else True
        if not created:
            response.headers["Idempotent-Replayed"] = "true"
        response.headers["Location"] = f"/v1/jobs/{job.id}"
        return {"id": job.id, "status": job.status, "enqueued": enqueued, "links": job_links(job.id)}

    @app.get("/v1/jobs", responses=problems(401, 422, 503))
    def list_jobs(
        session: SessionDep,
        tenant: TenantDep,
        status: Annotated[JobStatusName | None, Query()] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 50,
    ) -> dict[str, Any]:
        jobs = store.list_jobs(session, tenant=tenant, status=status, limit=limit)
        data = [
            {"id": j.id, "status": j.status, "task": j.task[:200], "created_at": j.created_at.isoformat(),
             "finished_at": j.finished_at.isoformat() if j.finished_at else None, "links": job_links(j.id)}
            for j in jobs
        ]
        return {"data": data, "count": len(data)}

    @app.get("/v1/jobs/{job_id}", responses=problems(401, 404, 503))
    def get_job(job_id: str, session: SessionDep, tenant: TenantDep) -> dict[str, Any]:
        job = _job_or_404(session, job_id, tenant)
        return job_view(job, store.get_steps(session, job_id=job.id))

    @app.get("/v1/jobs/{job_id}/steps", responses=problems(401, 404, 503))
    def get_steps(job_id: str, session: SessionDep, tenant: TenantDep) -> dict[str, Any]:
        job = _job_or_404(session, job_id, tenant)
        data = steps_tree(session, job.id)
        return {"data": data, "count": len(data)}

    @app.get(
        "/v1/jobs/{job_id}/events",
        responses={**problems(401, 404, 503), 200: {"content": {"text/event-stream": {}}}},
        response_class=StreamingResponse,
    )
    def events(
        job_id: str, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
    ) -> StreamingResponse:
        """Server-sent events: ``job`` on each status change, ``step`` on each step status change; the
        stream ends when the job does (or after ``EVENTS_MAX_S``).

        Authorization and the lookup use a short session of their own: a stream may stay open for an
        hour and must not hold a pooled connection meanwhile (each poll takes one briefly).
        """
        with Session(get_engine(settings.database_url)) as session:
            job = _job_or_404(session, job_id, resolve_tenant(session, settings, authorization))
        return StreamingResponse(
            _event_stream(job.id, settings.database_url),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.post("/v1/jobs/{job_id}/cancel", status_code=202, responses=problems(401, 404, 409, 503))
    def cancel(job_id: str, session: SessionDep, tenant: TenantDep) -> dict[str, Any]:
        job = _job_or_404(session, job_id, tenant)
        if job.status in JobStatus.TERMINAL:
            raise Problem(409, "Job already finished", f"job {job.id} is {job.status}; nothing to cancel")
        cancel_job(job.id)
        session.expire_all()
        job = _job_or_404(session, job_id, tenant)
        return {"id": job.id, "status": job.status, "links": job_links(job.id)}

    return app


JOB_ID_RE = re.compile(r"[0-9a-f]{32}")


def _job_or_404(session: Session, job_id: str, tenant: str) -> Any:
    job = store.get_job(session, job_id=job_id, tenant=tenant) if JOB_ID_RE.fullmatch(job_id) else None
    if job is None:
        shown = job_id if JOB_ID_RE.fullmatch(job_id) else "(malformed id)"
        raise Problem(404, "Job not found", f"no job {shown} for this API key")
    return job


EVENTS_POLL_S = 0.25
EVENTS_HEARTBEAT_S = 15.0
EVENTS_MAX_S = 3600.0


async def _event_stream(job_id: str, database_url: str) -> AsyncIterator[str]:
    seen: dict[str, str] = {}
    started = last_sent = time.monotonic()
    while time.monotonic() - started < EVENTS_MAX_S:
        job, steps = await run_in_threadpool(_snapshot, job_id, database_url)
        for st in steps:
            key = f"step:{st['index']}"
            if seen.get(key) != st["status"]:
                seen[key] = st["status"]
                last_sent = time.monotonic()
                yield f"event: step\ndata: {json.dumps(st)}\n\n"
        if seen.get("job") != job["status"]:
            seen["job"] = job["status"]
            last_sent = time.monotonic()
            yield f"event: job\ndata: {json.dumps(job)}\n\n"
        if job["status"] in JobStatus.TERMINAL:
            return
        if time.monotonic() - last_sent > EVENTS_HEARTBEAT_S:
            last_sent = time.monotonic()
            yield ": keep-alive\n\n"
        await asyncio.sleep(EVENTS_POLL_S)


def _snapshot(job_id: str, database_url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with Session(get_engine(database_url)) as session:
        job = store.get_job(session, job_id=job_id)
        assert job is not None
        steps = store.get_steps(session, job_id=job_id)
        job_event = {"id": job.id, "status": job.status, "answer": job.answer,
                     "error": {"type": job.error_type, "message": job.error_message} if job.error_type else None}
        step_events = [
            {"index": st.index, "agent": st.agent, "status": st.status, "attempts": st.attempts,
             "latency_ms": st.latency_ms, "child_job_id": st.child_job_id}
            for st in steps
        ]
        return job_event, step_events


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(_: Request, exc: Problem) -> JSONResponse:
        return problem_response(exc.status, exc.title, exc.detail, exc.errors, exc.headers)

    @app.exception_handler(SubmissionError)
    async def _submission(_: Request, exc: SubmissionError) -> JSONResponse:
        return problem_response(exc.status, exc.title, str(exc), [e.as_dict() for e in exc.errors])

    @app.exception_handler(IdempotencyConflict)
    async def _idem(_: Request, exc: IdempotencyConflict) -> JSONResponse:
        return problem_response(422, "Idempotency-Key reused", str(exc),
                                [{"loc": ["header", "Idempotency-Key"], "msg": str(exc)}])

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        return problem_response(422, "Invalid request", "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors), errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return problem_response(exc.status_code, str(exc.detail), str(exc.detail))

    @app.exception_handler(DataError)
    async def _unstorable(_: Request, exc: DataError) -> JSONResponse:
        # Input the database refused to store: a client error, never a reason to retry.
        return problem_response(422, "Invalid input", "a value in the request cannot be stored")

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    async def _db_down(_: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", type(exc).__name__)
        return problem_response(503, "Database unavailable", "the job store cannot be reached; retry shortly",
                                headers={"Retry-After": "5"})

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return problem_response(500, "Internal error", "an unexpected error occurred; it has been logged")


def _install_body_limit(app: FastAPI) -> None:
    app.add_middleware(BodyLimit)


class BodyLimit:
    """413 for bodies over ``max_body_bytes``: by Content-Length up front, and by counting the bytes as
    they arrive (a chunked body has no length), so an oversize body is never buffered whole."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = get_settings().max_body_bytes
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
