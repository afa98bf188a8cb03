"""OpenAI's Responses API over jobs: ``POST /v1/responses`` (waiting, in the background, or streamed),
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, ``GET /v1/responses/{id}/input_items``;
``DELETE`` is refused (jobs are kept).

A response is one job (``conductor/responses.py`` maps the two) submitted, waited for and streamed by the
chat endpoint's machinery (``routes/openai_chat.py``): the same quotas, wait bound (``chat_max_wait_s``),
key checks, stream slots and error bodies. Its id is the job's, so ``GET /v1/jobs/{id}/steps`` shows its
steps; another tenant's response, or a job not made by this route, is 404.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Response
from fastapi.concurrency import run_in_threadpool
from sqlmodel import Session

from conductor.openai_wire import InputItemList, ResponseCreateRequest, ResponseObject
from conductor.quotas import ending_at, note_ending_at, note_sent_up_to, open_stream
from conductor.responses import input_items, response_job, response_object, response_row, response_status
from conductor.service.deps import JOB_ID_RE, SettingsDep, bearer_key
from conductor.service.openai_errors import NO_RETRY, OpenAIError, openai_errors
from conductor.service.routes.openai_chat import (
    HEARTBEAT_S,
    JOB_HEADER,
    BriefTenantDep,
    KeyRevoked,
    answer_finish_reason_of,
    held_stream,
    read_progress,
    submit_conversation,
    submit_holding_slot,
    wait_failed_message,
    wait_for_job,
)
from conductor.service.stream_polls import Pace, SlotStream, failure_reason, poll, release_slot
from conductor.settings import Settings
from conductor.store.db import get_engine
from conductor.store.models import Job, JobStatus, OpenAIResponse
from conductor.store.responses import get_response, get_response_state, response_insert

router = APIRouter(tags=["openai"])

MAX_INPUT_ITEMS_PAGE = 100
DEFAULT_INPUT_ITEMS_PAGE = 20
"""``GET /v1/responses/{id}/input_items``'s ``limit``, as OpenAI's (1-100, default 20)."""

MAX_SEQUENCE_NUMBER = 1_000_000_000
"""The largest ``starting_after`` taken (a stream numbers a few events per step and status change)."""

RESUMED_STREAM_RESPONSE = {
    "description": "With `stream=true`: the response's server-sent events, as `POST /v1/responses` streams "
                   "them; with `starting_after`, numbered after it, starting from the response's current state.",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}

STREAM_RESPONSE = {
    "description": "With `stream: true`: the Responses API's server-sent events (`response.created`, …, "
                   "`response.completed` or `response.failed`/`response.incomplete`, or an `error` event).",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={**openai_errors(400, 401, 404, 413, 429, 503, 504), 200: STREAM_RESPONSE},
)
async def create_response(
    body: ResponseCreateRequest,
    response: Response,
    settings: SettingsDep,
    tenant: BriefTenantDep,
    authorization: Annotated[str | None, Header()] = None,
) -> Any:
    """Runs the input as a job (its last user message the task, the instructions and earlier messages its
    context). `background: true` answers at once (`queued`); poll `GET /v1/responses/{id}`. Otherwise
    the request waits for the job's end, up to `CONDUCTOR_CHAT_MAX_WAIT_S`, and answers the response
    whatever its status (`completed`, `incomplete`, `failed`, `cancelled`); `stream: true` sends the
    Responses API's events. Extension: `conductor` (the job id, status, cost)."""
    key = bearer_key(settings, authorization)  # looked up again every KEY_CHECK_S: revoking it ends the wait
    if not body.stream:
        job_id = await run_in_threadpool(_submit, body, settings, tenant)
        headers = {JOB_HEADER: job_id, **NO_RETRY}  # the job exists from here on: a retry would start a second one
        if not body.background:
            ended = await wait_for_job(job_id, settings, key, headers=headers, what="response")
            if ended is None:
                raise OpenAIError(504, f"response {job_id} is still running after {settings.chat_max_wait_s:g}s; "
                                  f"it goes on: GET /v1/responses/{job_id} has it when it ends (or create it "
                                  f"with background=true and poll)", code="job_timeout", headers=headers)
        try:
            answer = await run_in_threadpool(_read, job_id, tenant, settings)
        except OpenAIError:
            raise
        except Exception as exc:
            raise OpenAIError(503, wait_failed_message(job_id, type(exc).__name__), code="job_wait_failed",
                              headers=headers) from exc
        response.headers[JOB_HEADER] = job_id
        return answer
    job_id, slot = await submit_holding_slot(partial(_submit, body, settings, tenant), tenant, settings)
    events = ResponseEvents(job_id, tenant, settings, key)
    return SlotStream(held_stream(events.stream(), job_id, tenant, slot, settings, lapsed=events.lapsed,
                                  noting_lapse=events.noting_lapse),
                      tenant=tenant, slot=slot, settings=settings, headers={JOB_HEADER: job_id})


@router.get("/v1/responses/{response_id}", response_model=ResponseObject,
            responses={**openai_errors(400, 401, 404, 429, 503), 200: RESUMED_STREAM_RESPONSE})
async def retrieve_response(
    response_id: str,
    response: Response,
    settings: SettingsDep,
    tenant: BriefTenantDep,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0, le=MAX_SEQUENCE_NUMBER)] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> Any:
    """The response as it stands (poll it until `status` is `completed`, `incomplete`, `failed` or
    `cancelled`). `stream=true` streams it instead, as `POST /v1/responses` with `stream: true` does, from
    `response.created` on; with `starting_after`, resumes a stream that ended early (a dropped connection,
    the wait bound's `error` event): its events are numbered from `starting_after` + 1, and what happened
    meanwhile comes as the response's current state (a `response.in_progress` for the job and one per
    step while it runs), not event by event. The ending (the answer's events, or `response.failed`) keeps
    the numbers recorded when a stream sent it: a resume sends only the part of it after `starting_after`,
    nothing once the client has it all. `starting_after` alone (without `stream=true`) is refused."""
    if not stream:
        if starting_after is not None:
            raise OpenAIError(400, "starting_after resumes a stream: send it with stream=true (without it, this "
                              "answers the response as it stands)", param="starting_after",
                              code="unsupported_parameter")
        answer = await run_in_threadpool(_read, response_id, tenant, settings)
        response.headers[JOB_HEADER] = answer.id  # (the id checked: a header cannot hold every path's characters)
        return answer
    key = bearer_key(settings, authorization)  # looked up again every KEY_CHECK_S, as on a created stream
    found = await run_in_threadpool(_read, response_id, tenant, settings)  # 404 before a slot is taken
    slot = uuid.uuid4().hex
    await run_in_threadpool(open_stream, tenant, slot, settings)
    try:
        events = ResponseEvents(found.id, tenant, settings, key, after=starting_after)
        return SlotStream(held_stream(events.stream(), found.id, tenant, slot, settings, lapsed=events.lapsed,
                                      noting_lapse=events.noting_lapse),
                          tenant=tenant, slot=slot, settings=settings, headers={JOB_HEADER: found.id})
    except BaseException:  # (the response, once made, gives the slot back however it ends)
        await release_slot(tenant, slot, settings)
        raise


@router.post("/v1/responses/{response_id}/cancel", response_model=ResponseObject,
             responses=openai_errors(401, 404, 409, 503))
def cancel_response(response_id: str, response: Response, settings: SettingsDep,
                    tenant: BriefTenantDep) -> ResponseObject:
    """Cancels the response's job (background or not: a request waiting for it then answers it
    `cancelled`). A response already cancelled is answered as it is; one that ended otherwise is 409."""
    from conductor.engine import cancel_job
    from conductor.tasks.send import send_webhooks_of

    current = _read(response_id, tenant, settings)
    if current.status in ("completed", "incomplete", "failed"):
        raise OpenAIError(409, f"response {response_id} is {current.status}; nothing to cancel",
                          code="response_already_ended", headers=dict(NO_RETRY))
    if current.status != "cancelled" and cancel_job(current.id):
        send_webhooks_of(current.id)
    response.headers[JOB_HEADER] = current.id
    return _read(current.id, tenant, settings)


@router.delete("/v1/responses/{response_id}", status_code=204, responses=openai_errors(400, 401, 404, 503))
def delete_response(response_id: str, settings: SettingsDep, tenant: BriefTenantDep) -> None:
    """Always refused (400 `response_not_deletable`; never 204): a response is a job, and jobs are kept
    with their steps for audit."""
    _found(response_id, tenant, settings)
    raise OpenAIError(400, f"response {response_id} is job {response_id}, kept with its steps for audit as every "
                      f"job is: it cannot be deleted. POST /v1/responses/{response_id}/cancel stops it while it "
                      f"runs", code="response_not_deletable")


@router.get("/v1/responses/{response_id}/input_items", responses=openai_errors(400, 401, 404, 503))
def list_input_items(
    response_id: str,
    settings: SettingsDep,
    tenant: BriefTenantDep,
    limit: Annotated[int, Query(ge=1, le=MAX_INPUT_ITEMS_PAGE)] = DEFAULT_INPUT_ITEMS_PAGE,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> InputItemList:
    """The input's messages (not the instructions), newest first unless `order=asc`; `after` an item id."""
    job, row = _found(response_id, tenant, settings, whole=True)
    items = input_items(job, row)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise OpenAIError(400, f"no input item {after} in response {response_id}", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=len(items) > limit)


def _submit(body: ResponseCreateRequest, settings: Settings, tenant: str) -> str:
    previous = None if body.previous_response_id is None else _previous(body.previous_response_id, tenant, settings)
    return submit_conversation(lambda: response_job(body, settings, previous), body.model, settings, tenant,
                               then=lambda job: [response_insert(response_row(job.id, body))])


def _previous(response_id: str, tenant: str, settings: Settings) -> tuple[Job, OpenAIResponse]:
    """``previous_response_id``'s response (the whole rows: its input and answer are carried over), the
    tenant's and made by this API; 404 otherwise. One that has not ended completed (or incomplete) is
    400: it has no answer to continue from, yet or at all."""
    found = _found(response_id, tenant, settings, whole=True, previous=True)
    job, _ = found
    if job.status != JobStatus.SUCCEEDED:
        status = response_status(job)
        then = (f"wait for it to end (poll GET /v1/responses/{job.id}), then send this request again"
                if status in ("queued", "in_progress") else
                "it has no answer to continue from: continue from an earlier response, or send the conversation "
                "in input")
        raise OpenAIError(400, f"previous response {job.id} is {status}: only a completed (or incomplete) response "
                          f"can be continued; {then}", code="previous_response_not_completed",
                          param="previous_response_id")
    return found


def _found(response_id: str, tenant: str, settings: Settings, *, whole: bool = False,
           previous: bool = False) -> tuple[Job, OpenAIResponse]:
    """The response's job and row, or 404. Only what the response object tells is read
    (``get_response_state``), unless ``whole`` (the input items need the task and the whole context; a
    continued response, its input and answer). ``previous``: the id is a request's ``previous_response_id``
    (its 404 says so)."""
    found = None
    if JOB_ID_RE.fullmatch(response_id):
        read = get_response if whole else get_response_state
        with Session(get_engine(settings.database_url), expire_on_commit=False) as session:
            found = read(session, job_id=response_id, tenant=tenant)
    if found is None:
        shown = response_id if JOB_ID_RE.fullmatch(response_id) else "(malformed id)"
        if previous:
            raise OpenAIError(404, f"previous response {shown} not found for this API key (a job made by POST "
                              f"/v1/jobs, chat completions or a batch's chat or job line is not a response); send "
                              f"the conversation in input instead", code="previous_response_not_found",
                              param="previous_response_id")
        raise OpenAIError(404, f"no response {shown} for this API key (a job made by POST /v1/jobs, chat "
                          f"completions or a batch's chat or job line is not a response: GET /v1/jobs/{{id}} "
                          f"reads it)",
                          code="response_not_found", param="response_id")
    return found


def _read(response_id: str, tenant: str, settings: Settings) -> ResponseObject:
    job, row = _found(response_id, tenant, settings)
    reason = answer_finish_reason_of(job.id, settings.database_url) if job.status == JobStatus.SUCCEEDED else None
    return response_object(job, row, reason)


class ResponseEvents:
    """One response's stream: the Responses API's events, each with its ``sequence_number``.

    ``response.created``; ``response.in_progress`` when the job moves to planning and to running, and (with
    the extension ``conductor.step``) at each step's status change; then the answer as ``output_item.added``,
    ``content_part.added``, one ``output_text.delta``, ``output_text.done``, ``content_part.done``,
    ``output_item.done`` and ``response.completed`` (``response.incomplete`` when cut); a failed or
    cancelled job ends with ``response.failed`` (status ``failed`` or ``cancelled``). The wait bound, a
    revoked key, the database staying away and a lapsed stream slot end it with an ``error`` event naming
    the response, which goes on. ``: keep-alive`` comments every ``HEARTBEAT_S``.

    ``after``: a resumed stream (``GET /v1/responses/{id}?stream=true&starting_after=N``): numbered from
    ``after + 1``, without ``response.created``; the first poll's state comes as it stands (the job's
    ``in_progress`` and each step's), then the rest as on a new stream. The ending's first number is recorded
    (``quotas.note_ending_at``, in Redis for a week) by the stream that sends it (a stream whose own numbers
    are past a recorded one records its own instead); a later stream of the ended response sends the ending
    with those numbers, leaving out those up to ``after`` (so a client that resumes in or after it never gets
    the answer twice), and no progress events.

    Every stream records the highest number it is about to send (``quotas.note_sent_up_to``, before the
    events go, a lapse's error too), and an ending first recorded is numbered after it. The SDK's own resume
    (``client.responses.stream(response_id=…, starting_after=N)``) reads the stream afresh and drops every
    event numbered up to N on the client: numbered as the fresh stream went (from 1, a condensed replay), the
    answer's first events fell at or below N. Its progress events may still fall there (dropped by the SDK:
    each ``response.in_progress`` holds the whole state), never the ending."""

    def __init__(self, job_id: str, tenant: str, settings: Settings, key: str | None, *, after: int | None = None):
        self.job_id, self.tenant, self.settings, self.key = job_id, tenant, settings, key
        self.resumed = after is not None
        self.after = -1 if after is None else after
        self.sequence = self.after + 1
        self.numbered_last = False
        """Whether the last thing ``stream`` yielded was an event (it took a number), not a keep-alive."""
        self.unsent: list[str] = []
        """The ending's events not yet passed on (``_send_ending``)."""

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        self.numbered_last = True
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def error(self, code: str, message: str) -> str:
        return self.event("error", code=code, message=message, param=None)

    def lapsed(self, message: str) -> list[str]:
        """The stream's end when its slot lapsed: ``held_stream`` sends it in place of what ``stream`` had
        just yielded, so an event dropped gives its number back (the numbers the client sees have no gap).
        Inside the ending, the ending is finished instead (at most seven events, already numbered): its
        numbers are the response's for every later stream, so an error taking one of them would make a
        resume after it skip the event it replaced."""
        if self.unsent:
            return list(self.unsent)
        if self.numbered_last:
            self.sequence -= 1
        return [self.error("rate_limit_exceeded", message)]

    async def noting_lapse(self) -> None:
        """After ``lapsed``: records the number its error took (none inside the ending, already numbered)."""
        if not self.unsent:
            await run_in_threadpool(note_sent_up_to, self.job_id, self.sequence - 1, self.settings)

    def _send_ending(self, final: ResponseObject) -> Iterator[str]:
        """``_ending``'s events, each taken off ``unsent`` once ``held_stream`` has passed it on."""
        self.unsent = list(self._ending(final))
        while self.unsent:
            yield self.unsent[0]
            self.unsent.pop(0)

    async def stream(self) -> AsyncGenerator[str, None]:
        job_id, settings = self.job_id, self.settings
        deadline = time.monotonic() + settings.chat_max_wait_s
        seen: dict[str, str] = {}
        pace = Pace()
        last_sent = time.monotonic()
        try:  # the key is looked up every KEY_CHECK_S and before the end is told
            base = await poll(lambda: _read(job_id, self.tenant, settings), job_id=job_id)
            job, steps = await poll(partial(read_progress, job_id, settings, self.key, key_due=pace.key_due()),
                                    job_id=job_id)
            known = await run_in_threadpool(ending_at, job_id, settings) if job.status in JobStatus.TERMINAL else None
            if known is not None:
                # Its ending was sent before, by a stream that numbered it from ``known``: sent again with those
                # numbers, what the client already has of it left out (all of it: nothing is sent), and
                # without the progress of a job that has ended, which numbered what came between.
                if not self.resumed:
                    yield self.event("response.created", response=_progress(base, job))
                ended = await poll(lambda: _read(job_id, self.tenant, settings), job_id=job_id)
                self.sequence = known
                for event in self._send_ending(ended):
                    yield event
                return
            if not self.resumed:
                yield self.event("response.created", response=_progress(base, job))
            while True:
                changes: list[dict[str, Any] | None] = []  # None: the job's own change
                if job.status in (JobStatus.PLANNING, JobStatus.RUNNING) and seen.get("job") != job.status:
                    seen["job"] = job.status
                    changes.append(None)
                for st in steps:
                    name = f"step:{st['index']}"
                    if seen.get(name) != st["status"]:
                        seen[name] = st["status"]
                        changes.append(st)
                changed = bool(changes)
                if changed:  # recorded before they go: a client gone after any of them has it counted
                    await run_in_threadpool(note_sent_up_to, job_id, self.sequence + len(changes) - 1, settings)
                for change in changes:
                    yield self.event("response.in_progress", response=_progress(base, job, change))
                if job.status in JobStatus.TERMINAL or time.monotonic() >= deadline:
                    break
                if changed:
                    last_sent = time.monotonic()
                elif time.monotonic() - last_sent > HEARTBEAT_S:
                    last_sent = time.monotonic()
                    self.numbered_last = False
                    yield ": keep-alive\n\n"
                await asyncio.sleep(min(pace.after(changed), max(0.0, deadline - time.monotonic())))
                job, steps = await poll(partial(read_progress, job_id, settings, self.key, key_due=pace.key_due()),
                                        job_id=job_id)
            final = (await poll(lambda: _read(job_id, self.tenant, settings), job_id=job_id)
                     if job.status in JobStatus.TERMINAL else None)
        except KeyRevoked as exc:
            await self._noting_one()
            yield self.error("invalid_api_key", str(exc))
            return
        except Exception as exc:  # the database stayed away (or a bug): an error naming the response
            await self._noting_one()
            yield self.error("job_wait_failed", wait_failed_message(job_id, failure_reason(job_id, exc)))
            return
        if final is None:
            await self._noting_one()
            yield self.error("job_timeout", f"response {job_id} is still running after "
                                            f"{settings.chat_max_wait_s:g}s; it goes on: GET /v1/responses/{job_id} "
                                            f"has it when it ends, and GET /v1/responses/{job_id}?stream=true&"
                                            f"starting_after={self.sequence} resumes this stream")
            return
        recorded = await run_in_threadpool(note_ending_at, job_id, self.sequence, settings)
        if recorded is not None and recorded > self.sequence:
            self.sequence = recorded  # another stream of it sent the ending first, numbered from there
        for event in self._send_ending(final):
            yield event

    async def _noting_one(self) -> None:
        """Records the number the next event takes (an error ending the stream) before it is sent (Redis
        away: logged, and the error still goes out)."""
        await run_in_threadpool(note_sent_up_to, self.job_id, self.sequence, self.settings)

    def _ending(self, final: ResponseObject) -> Iterator[str]:
        """The stream's last events, numbered from ``self.sequence``: the answer's (``_answer``), or
        ``response.failed``; those numbered up to ``self.after`` are left out (a resumed stream's client
        has them)."""
        def failed() -> Iterator[str]:
            yield self.event("response.failed", response=_dump(final))

        for event in self._answer(final) if final.status in ("completed", "incomplete") else failed():
            if self.sequence - 1 > self.after:
                yield event

    def _answer(self, final: ResponseObject) -> Iterator[str]:
        """The answer's events, each numbered as it is taken (``lapsed`` relies on it)."""
        item = final.output[0]
        text = item.content[0].text
        at = {"item_id": item.id, "output_index": 0, "content_index": 0}
        added = {**item.model_dump(mode="json"), "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield self.event("response.output_item.added", output_index=0, item=added)
        yield self.event("response.content_part.added", **at, part={**part, "text": ""})
        yield self.event("response.output_text.delta", **at, delta=text, logprobs=[])
        yield self.event("response.output_text.done", **at, text=text, logprobs=[])
        yield self.event("response.content_part.done", **at, part=part)
        yield self.event("response.output_item.done", output_index=0, item=item.model_dump(mode="json"))
        yield self.event(f"response.{final.status}", response=_dump(final))


def _dump(response: ResponseObject) -> dict[str, Any]:
    return response.model_dump(mode="json")


def _progress(base: ResponseObject, job: Job, step: dict[str, Any] | None = None) -> dict[str, Any]:
    """The response as first read, still under way: ``queued`` or ``in_progress``, nothing of its end (no
    output, usage or error: those come with the answer's events and the last one, even when the job had
    ended by the first read, so that an accumulating client meets each output item once), its ``conductor``
    field as the job now stands."""
    ended: dict[str, Any] = {"output": [], "usage": None, "error": None, "incomplete_details": None,
                             "completed_at": None}
    status = "queued" if job.status == JobStatus.QUEUED else "in_progress"
    conductor = {**base.conductor.model_dump(mode="json"), "status": job.status, "step": step,
                 "cost_usd": None, "calls": None}
    return {**_dump(base), **ended, "status": status, "conductor": conductor}

