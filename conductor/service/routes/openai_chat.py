"""OpenAI-compatible chat: ``POST /v1/chat/completions`` runs a job and answers with it; ``GET /v1/models``.

The job runs through the normal pipeline (plan, steps on the Celery workers); the request waits for it
here, up to ``chat_max_wait_s``, polling the job's row with a short session per poll, so a waiting
request holds no database connection. A client that disconnects leaves the job running: its id is in
the ``Conductor-Job-Id`` header, and ``GET /v1/jobs/{id}`` has the answer.

The Responses API (``openai_responses.py``) submits, waits and streams with the public functions here
(``submit_conversation``, ``submit_holding_slot``, ``wait_for_job``, ``read_progress``, ``held_stream``, …).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.sql import Executable
from sqlmodel import Session

from conductor.chat import ChatJob, ChatRequestError, chat_job, completion, finish_reason, job_ref, model_list, usage
from conductor.openai_wire import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Delta,
    FinishReason,
    ModelList,
    ModelObject,
)
from conductor.quotas import (
    QuotaExceeded,
    admission,
    lapsed_stream_message,
    open_stream,
    refresh_stream,
)
from conductor.service.deps import SettingsDep, TenantDep, bearer_key, key_found, resolve_tenant
from conductor.service.openai_errors import NO_RETRY, OpenAIError, error_body, openai_errors
from conductor.service.problems import http_status
from conductor.service.stream_polls import Pace, SlotStream, failure_reason, poll, release_slot
from conductor.settings import Settings
from conductor.store import jobs as store
from conductor.store.db import get_engine
from conductor.store.keys import tenant_for_key
from conductor.store.models import Job, JobStatus
from conductor.submission import SubmissionError, create_job, resolve_pool

router = APIRouter(tags=["openai"])
log = logging.getLogger(__name__)


def tenant_briefly(request: Request, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
                   ) -> str:
    """The caller's tenant, looked up with a session closed at once (``TenantDep``'s session would stay
    open, holding a connection, for as long as the request waits for its job)."""
    with Session(get_engine(settings.database_url)) as session:
        tenant = resolve_tenant(session, settings, authorization)
    key_found(request)
    return tenant


BriefTenantDep = Annotated[str, Depends(tenant_briefly)]
JOB_HEADER = "Conductor-Job-Id"
POLL_MIN_S = 0.05
POLL_MAX_S = 1.0
POLL_FRACTION = 0.1
"""A waiting request polls every ``POLL_FRACTION`` of the time it has waited (within the bounds), so it
learns of the job's end at most ~10% late, and a long job costs a few queries a minute, not ten a second."""
HEARTBEAT_S = 15.0

STREAM_RESPONSE = {
    "description": "With `stream: true`: `chat.completion.chunk` events, then `data: [DONE]`.",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


@router.get("/v1/models", responses=openai_errors(401, 503))
def list_models(tenant: TenantDep, settings: SettingsDep) -> ModelList:
    return ModelList(data=model_list(resolve_pool(None, settings)))


@router.get("/v1/models/{model:path}", responses=openai_errors(401, 404, 503))
def get_model(model: str, tenant: TenantDep, settings: SettingsDep) -> ModelObject:
    for known in model_list(resolve_pool(None, settings)):
        if known.id == model:
            return known
    raise OpenAIError(404, f"The model '{model}' does not exist", code="model_not_found", param="model")


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={**openai_errors(400, 401, 404, 413, 422, 429, 500, 503, 504), 200: STREAM_RESPONSE},
)
async def chat_completions(
    body: ChatCompletionRequest,
    response: Response,
    settings: SettingsDep,
    tenant: BriefTenantDep,
    authorization: Annotated[str | None, Header()] = None,
) -> Any:
    """Runs the conversation as a job (the last user message is the task, earlier turns its context) and
    answers with its result: model `conductor` plans with the pool's planner, `conductor/<planner>` with
    that one. Extension: `conductor` (the job id, status, cost; on stream chunks, the step that changed)."""
    key = bearer_key(settings, authorization)  # looked up again every KEY_CHECK_S: revoking it ends the wait
    if not body.stream:
        return await _answer(body, response, settings, tenant, key)
    job_id, slot = await submit_holding_slot(partial(_submit, body, settings, tenant), tenant, settings)
    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    return SlotStream(
        held_stream(_stream(job_id, body.model, settings, key, include_usage=include_usage), job_id, tenant, slot,
                    settings),
        tenant=tenant, slot=slot, settings=settings, headers={JOB_HEADER: job_id},
    )


async def submit_holding_slot(submit: Callable[[], str], tenant: str, settings: Settings) -> tuple[str, str]:
    """A stream's submission: takes one of the tenant's stream slots (as job event streams do), then runs
    ``submit`` (in the thread pool: it commits the job); the job's id and the slot, which ``held_stream``
    then holds. The slot is taken first so that a tenant at its stream limit is refused before a job
    exists; a submission that fails (a quota, a refused request) gives the slot back at once."""
    slot = uuid.uuid4().hex
    await run_in_threadpool(open_stream, tenant, slot, settings)
    try:
        job_id = await run_in_threadpool(submit)
    except BaseException:
        await release_slot(tenant, slot, settings)
        raise
    return job_id, slot


async def _answer(body: ChatCompletionRequest, response: Response, settings: Settings, tenant: str,
                  key: str | None) -> ChatCompletion:
    job_id = await run_in_threadpool(_submit, body, settings, tenant)
    headers = {JOB_HEADER: job_id, **NO_RETRY}  # the job exists from here on: a retry would start a second one
    job = await wait_for_job(job_id, settings, key, headers=headers, what="chat completion")
    reason: str | None = None
    if job is not None and job.status == JobStatus.SUCCEEDED:
        try:
            reason = await run_in_threadpool(answer_finish_reason_of, job_id, settings.database_url)
        except Exception as exc:
            raise _wait_error(job_id, exc, headers, "chat completion") from exc
    if job is None or job.status != JobStatus.SUCCEEDED:
        status, message, code = _not_answered(job_id, job, settings)
        raise OpenAIError(status, message, code=code, headers=headers)
    response.headers[JOB_HEADER] = job_id
    return completion(job, body.model, reason)


async def wait_for_job(job_id: str, settings: Settings, key: str | None, *, headers: dict[str, str],
                       what: str) -> Job | None:
    """The ended job, or None once ``chat_max_wait_s`` has passed; a revoked key or a failed wait as the
    OpenAI error that answers it (``headers`` on it: the job's id, no retry). ``what`` names the request in
    the log."""
    try:
        return await _wait_for_end(job_id, settings, key)
    except Exception as exc:
        raise _wait_error(job_id, exc, headers, what) from exc


def _wait_error(job_id: str, exc: Exception, headers: dict[str, str], what: str) -> OpenAIError:
    if isinstance(exc, KeyRevoked):
        return OpenAIError(401, str(exc), code="invalid_api_key", type="invalid_request_error", headers=headers)
    # a database outage while waiting (else 503 with Retry-After, which the SDK retries)
    log.warning("%s %s: its wait failed: %s", what, job_id, type(exc).__name__)
    return OpenAIError(503, wait_failed_message(job_id, type(exc).__name__), code="job_wait_failed", headers=headers)


def wait_failed_message(job_id: str, reason: str) -> str:
    return (f"job {job_id} was submitted but its end could not be read ({reason}); it goes on: "
            f"GET /v1/jobs/{job_id} has its answer when it ends")


def _submit(body: ChatCompletionRequest, settings: Settings, tenant: str) -> str:
    return submit_conversation(lambda: chat_job(body, settings), body.model, settings, tenant)


def submit_conversation(made: Callable[[], ChatJob], model: str, settings: Settings, tenant: str, *,
                        then: Callable[[Job], Sequence[tuple[Executable, Mapping[str, Any]]]] | None = None) -> str:
    """Creates the job ``made()`` describes under the tenant's quotas, commits it and sends its plan; the
    refusals as OpenAI errors. ``then(job)``: statements adding rows of the job's own, sent and committed with
    its insert (``create_job(then=...)``: the tenant's lock is never held across another round trip)."""
    from conductor.tasks.send import enqueue_plan

    with Session(get_engine(settings.database_url), expire_on_commit=False) as session:
        try:
            conversation = made()
            job, _ = create_job(session, conversation.body, tenant=tenant, settings=settings,
                                context=conversation.context, admit=admission(tenant, settings), publishing=True,
                                commit=True, then=then)
        except QuotaExceeded as exc:
            raise OpenAIError(429, str(exc), code="rate_limit_exceeded", type="rate_limit_error",
                              headers={"Retry-After": exc.retry_after}) from exc
        except ChatRequestError as exc:
            raise OpenAIError(http_status(exc.kind), str(exc), code=exc.code, param=exc.param) from exc
        except SubmissionError as exc:
            if exc.title == "Unknown planner":
                raise OpenAIError(404, f"The model '{model}' does not exist: {exc}", code="model_not_found",
                                  param="model") from exc
            raise
        session.commit()  # committed with the insert already (no round trip); durable before the message is sent
    enqueue_plan(job.id, recorded=True)
    return job.id


class KeyRevoked(Exception):
    def __init__(self, job_id: str):
        super().__init__(f"the API key was revoked while this request waited; job {job_id} goes on: "
                         f"GET /v1/jobs/{job_id} with another key of the tenant has its answer when it ends")


def read_progress(job_id: str, settings: Settings, key: str | None, *, key_due: bool = True,
                  steps: bool = True) -> tuple[Job, list[dict[str, Any]]]:
    """The job, and (``steps``) each step's index, agent and status: a stream's progress. Of a job still
    running only its id and status are read; once it has ended, what the answer needs
    (``store.job_outcome``). ``KeyRevoked`` when ``key`` is no longer active, looked up when ``key_due``
    and always before the job's end is told."""
    with Session(get_engine(settings.database_url), expire_on_commit=False) as session:
        progress = store.job_progress(session, job_id=job_id, steps=steps)
        assert progress is not None
        status, step_progress = progress
        ended = status in JobStatus.TERMINAL
        if key is not None and (key_due or ended) and tenant_for_key(
                session, key=key, pepper=settings.api_key_pepper) is None:
            raise KeyRevoked(job_id)
        job = (store.job_outcome(session, job_id=job_id) if ended
               else Job.model_construct(id=job_id, status=status, finished_at=None, cost_usd=0.0, calls=0))
        assert job is not None
        return job, [{"index": st.index, "agent": st.agent, "status": st.status} for st in step_progress]


def answer_finish_reason_of(job_id: str, database_url: str) -> str | None:
    with Session(get_engine(database_url), expire_on_commit=False) as session:
        return store.answer_finish_reasons(session, job_ids=[job_id]).get(job_id)


async def _wait_for_end(job_id: str, settings: Settings, key: str | None) -> Job | None:
    """The ended job, or None once ``chat_max_wait_s`` has passed."""
    started = time.monotonic()
    deadline = started + settings.chat_max_wait_s
    pace = Pace()
    while True:
        job, _ = await run_in_threadpool(partial(read_progress, job_id, settings, key, key_due=pace.key_due(),
                                                 steps=False))
        if job.status in JobStatus.TERMINAL:
            return job
        now = time.monotonic()
        if now >= deadline:
            return None
        delay = min(max(POLL_MIN_S, (now - started) * POLL_FRACTION), POLL_MAX_S)
        await asyncio.sleep(min(delay, deadline - now))


def _not_answered(job_id: str, job: Job | None, settings: Settings) -> tuple[int, str, str]:
    if job is None:
        return (504, f"job {job_id} is still running after {settings.chat_max_wait_s:g}s; it goes on: "
                f"GET /v1/jobs/{job_id} has its answer when it ends", "job_timeout")
    reason = f"{job.error_type}: {job.error_message}" if job.error_type else job.status
    if job.status == JobStatus.CANCELLED:
        return 409, f"job {job_id} was cancelled", "job_cancelled"
    return 500, f"job {job_id} failed ({reason})", "job_failed"


async def held_stream(events: AsyncGenerator[str, None], job_id: str, tenant: str, slot: str,
                      settings: Settings, lapsed: Callable[[str], list[str]] | None = None,
                      noting_lapse: Callable[[], Awaitable[None]] | None = None) -> AsyncGenerator[str, None]:
    """The stream, holding its slot: refreshed while it runs (its response, a ``SlotStream``, releases it
    when it ends or the client leaves). A slot that lapsed meanwhile and cannot be taken again (the tenant
    holds its limit of streams) ends the stream with a ``rate_limit_exceeded`` error, as a new stream would
    be refused: ``lapsed(message)`` renders its last events (by default a chat completion stream's error
    event and ``[DONE]``), sent in place of the item ``events`` had just yielded, which is dropped."""
    last_held = time.monotonic()
    async with aclosing(events):
        async for event in events:
            if time.monotonic() - last_held > HEARTBEAT_S:
                last_held = time.monotonic()
                if not await run_in_threadpool(refresh_stream, tenant, slot, settings):
                    message = (f"{lapsed_stream_message(settings)}; job {job_id} goes on: "
                               f"GET /v1/jobs/{job_id} has its answer when it ends")
                    ending = (lapsed or _chat_lapsed)(message)
                    if noting_lapse is not None:  # (a response's stream records the number its error took)
                        await noting_lapse()
                    for last in ending:
                        yield last
                    return
            yield event


def _chat_lapsed(message: str) -> list[str]:
    return [_sse(error_body(429, message, code="rate_limit_exceeded", type="rate_limit_error")), _sse("[DONE]")]


def _sse(payload: dict[str, Any] | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _stream(job_id: str, model: str, settings: Settings, key: str | None, *,
                  include_usage: bool) -> AsyncGenerator[str, None]:
    """Chunks: the assistant role first; then, while the job runs, an empty-content chunk whose
    ``conductor`` field names each job or step status change; the answer; ``finish_reason`` (``stop``;
    ``length`` or ``content_filter`` when the answering step was cut or withheld); the
    usage (with ``stream_options.include_usage``); ``[DONE]``. A job that fails or outlasts the wait
    ends the stream with an OpenAI error event instead of the answer; so does a revoked key, and the
    database staying away (``job_wait_failed``, as the non-stream answer's 503)."""
    created = int(time.time())

    def chunk(delta: Delta, job: Job, *, step: dict[str, Any] | None = None,
              finish: FinishReason | None = None) -> str:
        message = ChatCompletionChunk(
            id=job_id, created=created, model=model,
            choices=[ChunkChoice(delta=delta, finish_reason=finish)],
            conductor=job_ref(job, step),
        )
        return _sse(_chunk_json(message))

    deadline = time.monotonic() + settings.chat_max_wait_s
    seen: dict[str, str] = {}
    last_sent = time.monotonic()
    pace = Pace()
    try:  # the key is looked up every KEY_CHECK_S and before the end is told: revoked, the stream ends with that error
        job, steps = await poll(partial(read_progress, job_id, settings, key, key_due=pace.key_due()), job_id=job_id)
        yield chunk(Delta(role="assistant", content=""), job)
        seen["job"] = job.status
        while True:
            changed = False
            for st in steps:
                name = f"step:{st['index']}"
                if seen.get(name) != st["status"]:
                    seen[name] = st["status"]
                    last_sent = time.monotonic()
                    changed = True
                    yield chunk(Delta(content=""), job, step=st)
            if job.status in JobStatus.TERMINAL:
                break
            if seen["job"] != job.status:
                seen["job"] = job.status
                last_sent = time.monotonic()
                changed = True
                yield chunk(Delta(content=""), job)
            if time.monotonic() >= deadline:
                break
            if time.monotonic() - last_sent > HEARTBEAT_S:
                last_sent = time.monotonic()
                yield ": keep-alive\n\n"
            await asyncio.sleep(min(pace.after(changed), max(0.0, deadline - time.monotonic())))
            job, steps = await poll(partial(read_progress, job_id, settings, key, key_due=pace.key_due()),
                                    job_id=job_id)
        reason = None
        if job.status == JobStatus.SUCCEEDED:  # read before the answer is sent: a failure ends the stream cleanly
            reason = await poll(lambda: answer_finish_reason_of(job_id, settings.database_url), job_id=job_id)
    except KeyRevoked as exc:
        yield _sse(error_body(401, str(exc), code="invalid_api_key"))
        yield _sse("[DONE]")
        return
    except Exception as exc:  # the database stayed away (or a bug): an error naming the job, not a dropped stream
        yield _sse(error_body(503, wait_failed_message(job_id, failure_reason(job_id, exc)), code="job_wait_failed"))
        yield _sse("[DONE]")
        return
    if job.status == JobStatus.SUCCEEDED:
        yield chunk(Delta(content=job.answer or ""), job)
        yield chunk(Delta(), job, finish=finish_reason(reason))
        if include_usage:
            final = ChatCompletionChunk(id=job_id, created=created, model=model, choices=[], usage=usage(job),
                                        conductor=job_ref(job))
            yield _sse(_chunk_json(final))
    else:
        status, message, code = _not_answered(job_id, job if job.status in JobStatus.TERMINAL else None, settings)
        yield _sse(error_body(status, message, code=code))
    yield _sse("[DONE]")


def _chunk_json(chunk: ChatCompletionChunk) -> dict[str, Any]:
    """As OpenAI sends chunks: a delta carries only the fields it sets; ``usage`` only on the usage chunk."""
    payload = chunk.model_dump(mode="json")
    for choice in payload["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if payload["usage"] is None:
        del payload["usage"]
    return payload
