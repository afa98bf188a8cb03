"""Jobs: submit, list, read, steps, server-sent events, cancel, replay."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from datetime import UTC, datetime
from functools import partial
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlmodel import Session

from conductor.engine import cancel_job
from conductor.quotas import admission, lapsed_stream_message, open_stream, refresh_stream
from conductor.replay import ReplayRequest, create_replay
from conductor.service.deps import (
    SessionDep,
    SettingsDep,
    TenantDep,
    bearer_key,
    job_id_or_404,
    job_or_404,
    resolve_tenant,
)
from conductor.service.problems import Problem, problems
from conductor.service.schemas import (
    JobAccepted,
    JobEvent,
    JobList,
    JobPublic,
    JobRef,
    ReplayAccepted,
    StepEvent,
    StepList,
)
from conductor.service.stream_polls import Pace, SlotStream, failure_reason, poll
from conductor.service.views import (
    MAX_TREE_DEPTH,
    job_event,
    job_links,
    job_ref,
    job_summary,
    job_view,
    step_event,
    steps_tree,
)
from conductor.settings import Settings
from conductor.store import jobs as store
from conductor.store.db import get_engine
from conductor.store.keys import tenant_for_key
from conductor.store.models import JobStatus
from conductor.submission import JobCreate, create_job

router = APIRouter()
MAX_LIST_LIMIT = 200
MAX_STEPS_LIMIT = 50
MAX_STEPS_OFFSET = 1000
MAX_META_CHARS = 256
NO_NUL = r"^[^\x00]*$"
JOB_ID_PATTERN = r"^[0-9a-f]{32}$"
BATCH_ID_PATTERN = r"^batch_[0-9a-f]{32}$"
# Date and time with an optional fraction and offset: what the store can compare, and nothing more
# (a bare number or a date alone is refused rather than guessed at).
ISO_TIME = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?(Z|[+-]\d{2}:\d{2})?$"


async def _bearer_given(settings: SettingsDep, authorization: Annotated[str | None, Header()] = None) -> None:
    """401 for a request without a bearer key before its body is validated (no database: the key itself
    is looked up with the insert, in ``_submit``)."""
    bearer_key(settings, authorization)


@router.post("/v1/jobs", status_code=202, response_model=JobAccepted, dependencies=[Depends(_bearer_given)],
             responses=problems(400, 401, 413, 422, 429, 503))
async def submit_job(
    body: JobCreate,
    settings: SettingsDep,
    authorization: Annotated[str | None, Header()] = None,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> Response:
    """The busiest route, so its blocking work (key lookup, quotas, insert, commit, publish) is one job on
    the thread pool rather than one per dependency (a session, the tenant, the endpoint: four hand-offs),
    and the answer is written directly instead of validated again through the response model."""
    accepted, created = await run_in_threadpool(_submit, body, settings, authorization, idempotency_key)
    headers = {"Location": f"/v1/jobs/{accepted.id}"}
    if not created:
        headers["Idempotent-Replayed"] = "true"
    return Response(accepted.model_dump_json(), status_code=202, headers=headers, media_type="application/json")


def _submit(
    body: JobCreate, settings: Settings, authorization: str | None, idempotency_key: str | None
) -> tuple[JobAccepted, bool]:
    from conductor.tasks.send import enqueue_plan

    with Session(get_engine(settings.database_url), expire_on_commit=False) as session:
        tenant = resolve_tenant(session, settings, authorization)
        job, created = create_job(  # per-tenant quotas first: 429 with Retry-After
            session, body, tenant=tenant, settings=settings, idempotency_key=idempotency_key,
            admit=admission(tenant, settings), publishing=True, commit=True,
        )
        session.commit()  # durable before any message is sent (committed with the insert: a no-op then)
    enqueued = enqueue_plan(job.id, recorded=True) if created else True
    return JobAccepted(id=job.id, status=JobStatus(job.status), enqueued=enqueued, links=job_links(job.id)), created


@router.get("/v1/jobs", responses=problems(401, 422, 503))
def list_jobs(
    request: Request,
    session: SessionDep,
    tenant: TenantDep,
    status: Annotated[list[JobStatus] | None, Query(max_length=len(JobStatus),
                                                    description="Repeat to match any of several.")] = None,
    batch_id: Annotated[str | None, Query(pattern=BATCH_ID_PATTERN,
                                          description="Only the jobs (one per line) of this batch.")] = None,
    meta_key: Annotated[str | None, Query(min_length=1, max_length=MAX_META_CHARS, pattern=NO_NUL,
                                          description="Jobs whose metadata has this key.")] = None,
    meta_value: Annotated[str | None, Query(max_length=MAX_META_CHARS, pattern=NO_NUL,
                                            description="With meta_key: its value, compared as text.")] = None,
    created_after: Annotated[str | None, Query(pattern=ISO_TIME, description="ISO 8601, inclusive; "
                                               "UTC when no offset is given.")] = None,
    created_before: Annotated[str | None, Query(pattern=ISO_TIME, description="ISO 8601, exclusive; "
                                                "UTC when no offset is given.")] = None,
    after: Annotated[str | None, Query(pattern=JOB_ID_PATTERN,
                                       description="Cursor: the id of the previous page's last job.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 50,
) -> JobList:
    """The tenant's top-level jobs, newest first (ordered by created_at, then id), a page at a time."""
    if meta_value is not None and meta_key is None:
        raise Problem(422, "Invalid filter", "meta_value needs meta_key",
                      [{"loc": ["query", "meta_value"], "msg": "give meta_key too"}])
    where = store.JobFilter(
        statuses=tuple(status or ()), batch_id=batch_id, meta_key=meta_key, meta_value=meta_value,
        created_after=_utc(created_after, "created_after"), created_before=_utc(created_before, "created_before"),
    )
    cursor = None
    if after is not None:
        cursor = store.get_job(session, job_id=after, tenant=tenant)
        if cursor is None:
            raise Problem(422, "Invalid cursor", f"no job {after} for this API key to continue after",
                          [{"loc": ["query", "after"], "msg": "not the id of one of your jobs"}])
    jobs = store.list_jobs(session, tenant=tenant, where=where, after=cursor, limit=limit + 1)
    page, has_more = jobs[:limit], len(jobs) > limit
    following = None
    if has_more:
        url = request.url.include_query_params(after=page[-1].id)
        following = f"{url.path}?{url.query}"
    return JobList(data=[job_summary(j) for j in page], count=len(page), has_more=has_more, next=following)


def _utc(text: str | None, name: str) -> datetime | None:
    """An ISO 8601 time (the pattern has vetted its shape); offsets are honoured, none means UTC."""
    if text is None:
        return None
    try:
        value = datetime.fromisoformat(text)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (ValueError, OverflowError) as exc:
        raise Problem(422, "Invalid filter", f"{name}: {exc}", [{"loc": ["query", name], "msg": str(exc)}]) from None


@router.post("/v1/jobs/{job_id}/replay", status_code=202,
             responses=problems(400, 401, 404, 409, 413, 422, 429, 503))
def replay(
    job_id: str,
    response: Response,
    session: SessionDep,
    tenant: TenantDep,
    settings: SettingsDep,
    body: Annotated[ReplayRequest | None, Body()] = None,
) -> ReplayAccepted:
    """A new job that runs this one again, linked to it by ``replay_of``; see ``conductor/replay.py``
    for which steps keep their stored outputs."""
    from conductor.tasks.send import enqueue_plan

    original = job_or_404(session, job_id, tenant)
    job = create_replay(session, original, body or ReplayRequest(), settings=settings,
                        admit=admission(tenant, settings))
    session.commit()  # durable before any message is sent
    enqueued = enqueue_plan(job.id)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return ReplayAccepted(id=job.id, status=JobStatus(job.status), replay_of=original.id, enqueued=enqueued,
                          links=job_links(job.id))


@router.get("/v1/jobs/{job_id}", responses=problems(401, 404, 503))
def get_job(job_id: str, session: SessionDep, tenant: TenantDep) -> JobPublic:
    job = job_or_404(session, job_id, tenant)
    return job_view(job, store.get_steps(session, job_id=job.id))


@router.get("/v1/jobs/{job_id}/steps", responses=problems(401, 404, 422, 503))
def get_steps(
    job_id: str,
    session: SessionDep,
    tenant: TenantDep,
    offset: Annotated[int, Query(ge=0, le=MAX_STEPS_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_STEPS_LIMIT)] = MAX_STEPS_LIMIT,
    depth: Annotated[int, Query(ge=0, le=MAX_TREE_DEPTH)] = MAX_TREE_DEPTH,
    messages: bool = True,
) -> StepList:
    """This job's steps from ``offset`` (at most ``limit``), child jobs nested ``depth`` levels deep
    (``MAX_TREE_STEPS`` steps in all; a child not expanded links to its own steps); ``messages=false``
    leaves out what each worker was sent."""
    job = job_or_404(session, job_id, tenant)
    data = steps_tree(session, job.id, offset=offset, limit=limit, max_depth=depth, messages=messages)
    total = len(store.get_steps(session, job_id=job.id, light=True))
    after = offset + len(data)
    # The next page is asked for the way this one was (depth, messages), not with the defaults.
    query = urlencode({"offset": after, "limit": limit, **({"depth": depth} if depth != MAX_TREE_DEPTH else {}),
                       **({} if messages else {"messages": "false"})})
    following = f"/v1/jobs/{job.id}/steps?{query}" if after < total else None
    return StepList(data=data, count=len(data), total=total, next=following)


@router.get(
    "/v1/jobs/{job_id}/events",
    responses={
        **problems(401, 404, 429, 503),
        200: {"description": "server-sent events: `job` (JobEvent) and `step` (StepEvent), as `data:` JSON",
              "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    },
    response_class=StreamingResponse,
)
def events(job_id: str, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
           ) -> StreamingResponse:
    """Server-sent events: ``job`` on each status change, ``step`` on each step status change; the
    stream ends when the job does, when the key is revoked (``event: error``), or after
    ``EVENTS_MAX_S``. A tenant holds at most ``CONDUCTOR_TENANT_MAX_STREAMS`` streams at once (429).

    Authorization and the lookup use a short session of their own: a stream may stay open for an
    hour and must not hold a pooled connection meanwhile (each poll takes one briefly).
    """
    with Session(get_engine(settings.database_url)) as session:
        tenant = resolve_tenant(session, settings, authorization)
        job_id = job_id_or_404(session, job_id, tenant)
    slot = uuid.uuid4().hex
    open_stream(tenant, slot, settings)
    return SlotStream(_events(job_id, settings, tenant=tenant, slot=slot, key=bearer_key(settings, authorization)),
                      tenant=tenant, slot=slot, settings=settings)


@router.post("/v1/jobs/{job_id}/cancel", status_code=202, responses=problems(401, 404, 409, 503))
def cancel(job_id: str, session: SessionDep, tenant: TenantDep) -> JobRef:
    job = job_or_404(session, job_id, tenant)
    if job.status in JobStatus.TERMINAL:
        raise Problem(409, "Job already finished", f"job {job.id} is {job.status}; nothing to cancel")
    from conductor.tasks.send import send_webhooks_of

    if cancel_job(job.id):
        send_webhooks_of(job.id)
    session.expire_all()
    job = job_or_404(session, job_id, tenant)
    return job_ref(job)


EVENTS_HEARTBEAT_S = 15.0
EVENTS_MAX_S = 3600.0


KEY_REVOKED = '{"type": "key_revoked", "message": "the API key of this stream was revoked"}'


def _error_event(kind: str, message: str) -> str:
    """``event: error`` ending a stream: ``{"type", "message"}``."""
    return f"event: error\ndata: {json.dumps({'type': kind, 'message': message})}\n\n"


async def _events(job_id: str, settings: Settings, *, tenant: str, slot: str,
                  key: str | None) -> AsyncGenerator[str, None]:
    """The stream's events; its slot is the response's (``SlotStream``), refreshed here while it runs."""
    seen: dict[str, str] = {}
    pace = Pace()  # the key is looked up every KEY_CHECK_S (and before the end is told), not at each poll
    started = last_sent = last_held = time.monotonic()
    while time.monotonic() - started < EVENTS_MAX_S:
        try:
            snapshot = await poll(partial(_snapshot, job_id, settings, key, seen.get("job"), key_due=pace.key_due()),
                                  job_id=job_id)
        except Exception as exc:  # the database stayed away (or a bug): an error event, not a dropped stream
            yield _error_event("job_read_failed", f"the state of job {job_id} could not be read "
                               f"({failure_reason(job_id, exc)}); it goes on: GET /v1/jobs/{job_id} has it")
            return
        if snapshot is None:
            yield f"event: error\ndata: {KEY_REVOKED}\n\n"
            return
        status, job, steps = snapshot
        changed = False
        for st in steps:
            name = f"step:{st.index}"
            if seen.get(name) != st.status:
                seen[name] = st.status
                last_sent = time.monotonic()
                changed = True
                yield f"event: step\ndata: {st.model_dump_json()}\n\n"
        if job is not None:
            seen["job"] = job.status
            last_sent = time.monotonic()
            changed = True
            yield f"event: job\ndata: {job.model_dump_json()}\n\n"
        if status in JobStatus.TERMINAL:
            return
        if time.monotonic() - last_sent > EVENTS_HEARTBEAT_S:
            last_sent = time.monotonic()
            yield ": keep-alive\n\n"
        if time.monotonic() - last_held > EVENTS_HEARTBEAT_S:
            last_held = time.monotonic()
            if not await run_in_threadpool(refresh_stream, tenant, slot, settings):
                yield _error_event("too_many_streams", f"{lapsed_stream_message(settings)}; job {job_id} goes on")
                return
        await asyncio.sleep(pace.after(changed))


def _snapshot(job_id: str, settings: Settings, key: str | None, known: str | None, *,
              key_due: bool) -> tuple[str, JobEvent | None, list[StepEvent]] | None:
    """The job's status, its ``job`` event when that status is not ``known`` (the last one sent), and its
    steps' events, reading only the columns they need (the job's answer and error only when its status
    changed). None when ``key`` has been revoked: looked up when ``key_due`` and before the end is told."""
    with Session(get_engine(settings.database_url)) as session:
        progress = store.job_progress(session, job_id=job_id)
        assert progress is not None
        status, steps = progress
        if key is not None and (key_due or status in JobStatus.TERMINAL) and tenant_for_key(
                session, key=key, pepper=settings.api_key_pepper) is None:
            return None
        job = None
        if status != known:
            outcome = store.job_outcome(session, job_id=job_id)
            assert outcome is not None
            job = job_event(outcome)
        return status, job, [step_event(st) for st in steps]
