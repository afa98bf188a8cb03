"""OpenAI-compatible Batches: create from an uploaded file, read, list, cancel.

A batch's jobs run as ordinary jobs. Reading an open batch also ends it when its last job has ended
(``finish_if_done``), so a client polling ``GET /v1/batches/{id}`` sees the output file as soon as it
exists; the reconciler does the same for batches no one reads.
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Query, Response
from sqlmodel import Session

from conductor.batches import BatchFileError, cancel_batch, create_batch, finish_if_done
from conductor.openai_wire import (
    BatchCreate,
    BatchInputTokensDetails,
    BatchList,
    BatchObject,
    BatchUsage,
    OutputTokensDetails,
    RequestCounts,
)
from conductor.quotas import BatchTooLarge, admission, check_batch_jobs_in_flight
from conductor.service.deps import SessionDep, SettingsDep, TenantDep
from conductor.service.openai_errors import NO_RETRY, OpenAIError, openai_errors
from conductor.service.routes.files import check_file_quota, file_or_404
from conductor.store import batches as store
from conductor.store.jobs import lock_tenant
from conductor.store.models import Batch, BatchStatus

router = APIRouter(tags=["openai"])
log = logging.getLogger(__name__)
JSONL = "application/jsonl"
BATCH_ID_RE = re.compile(r"batch_[0-9a-f]{32}")
MAX_LIST_LIMIT = 100


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def batch_object(batch: Batch, counts: store.Counts) -> BatchObject:
    return BatchObject(
        id=batch.id,
        endpoint=batch.endpoint,
        input_file_id=batch.input_file_id,
        completion_window=batch.completion_window,
        status=batch.status,
        output_file_id=batch.output_file_id,
        error_file_id=batch.error_file_id,
        created_at=int(batch.created_at.timestamp()),
        in_progress_at=_ts(batch.in_progress_at),
        expires_at=_ts(batch.expires_at),
        finalizing_at=_ts(batch.finalizing_at),
        completed_at=_ts(batch.completed_at),
        expired_at=_ts(batch.expired_at),
        cancelling_at=_ts(batch.cancelling_at),
        cancelled_at=_ts(batch.cancelled_at),
        request_counts=RequestCounts(total=batch.total, completed=counts.completed, failed=counts.failed),
        metadata=batch.meta,
        usage=_usage(batch.usage),
    )


def _usage(summed: dict[str, int] | None) -> BatchUsage | None:
    """A batch's usage as OpenAI's batch object tells it."""
    if summed is None:
        return None
    tokens_in, tokens_out = summed.get("input_tokens", 0), summed.get("output_tokens", 0)
    return BatchUsage(input_tokens=tokens_in, output_tokens=tokens_out, total_tokens=tokens_in + tokens_out,
                      input_tokens_details=BatchInputTokensDetails(cached_tokens=summed.get("cached_input_tokens", 0)),
                      output_tokens_details=OutputTokensDetails(reasoning_tokens=summed.get("reasoning_tokens", 0)))


def batch_or_404(session: Session, batch_id: str, tenant: str) -> Batch:
    """The caller's batch, or 404 (another tenant's batch is indistinguishable from a missing one)."""
    well_formed = BATCH_ID_RE.fullmatch(batch_id) is not None
    batch = store.get_batch(session, batch_id=batch_id, tenant=tenant) if well_formed else None
    if batch is None:
        raise OpenAIError(404, f"No such Batch object: {batch_id if well_formed else '(malformed id)'}",
                          code="not_found", param="batch_id")
    return batch


def _current(session: Session, batch: Batch) -> BatchObject:
    """The batch as it is now, ended first if its last job has ended. Its lines are counted once: an
    open batch's counts also say whether it can end (once every job has ended they cannot change)."""
    counts = store.batch_counts(session, batch_id=batch.id)
    if batch.status in BatchStatus.OPEN and not counts.unfinished and finish_if_done(batch.id):
        session.expire_all()
        batch = store.get_batch(session, batch_id=batch.id) or batch
    return batch_object(batch, counts)


@router.post("/v1/batches", responses=openai_errors(400, 401, 404, 422, 429, 503))
def create(
    body: BatchCreate, background: BackgroundTasks, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> BatchObject:
    """One job per line of the input file. A line whose method, url or body is wrong fails alone (it is
    in the error file when the batch ends); the others run."""
    input_file = file_or_404(session, body.input_file_id, tenant)
    if input_file.purpose != "batch":
        raise OpenAIError(400, f"file {input_file.id} is not a batch input file (purpose '{input_file.purpose}')",
                          param="input_file_id", code="invalid_file")
    # A batch is one submission: refused (429) while the tenant is over its rate, or while its unfinished
    # batch lines and this file's would pass tenant_max_batch_jobs_in_flight. Its lines do not count against
    # the jobs-in-flight quota of live submissions, and their plans wait behind live ones on the broker.
    admission(tenant, settings).check_rate()
    # Its output and error files are written when it ends, whatever the quota then: the room is asked now,
    # counting what the tenant's running batches will write, under the lock uploads take (and batches).
    lock_tenant(session, tenant=tenant, scope="files")
    try:
        check_batch_jobs_in_flight(session, tenant, settings, lines=input_file.lines)
    except BatchTooLarge as exc:
        raise OpenAIError(400, f"file {input_file.id} cannot be run as a batch: {exc}", param="input_file_id",
                          code="invalid_file", headers=NO_RETRY) from exc
    check_file_quota(session, tenant, settings, files=2, size=0, what="with a batch's output and error files",
                     param="input_file_id")
    try:
        batch, job_ids = create_batch(session, tenant=tenant, input_file=input_file, endpoint=body.endpoint,
                                      completion_window=body.completion_window, metadata=body.metadata,
                                      settings=settings)
    except BatchFileError as exc:  # read again now: a limit lowered since the upload (a redeploy), say
        raise OpenAIError(400, f"file {input_file.id} cannot be run as a batch: {exc}; upload it again "
                          "within the current limits", param="input_file_id", code="invalid_file",
                          headers=NO_RETRY) from exc
    session.commit()  # the batch and every job are durable before any message is sent
    background.add_task(_enqueue, job_ids)
    try:
        return _current(session, batch)
    except Exception as exc:  # a database outage now (else 503 with Retry-After): a retry would make a 2nd batch
        log.warning("batch %s: created, but could not be read back: %s", batch.id, type(exc).__name__)
        raise OpenAIError(503, f"batch {batch.id} was created but could not be read back "
                          f"({type(exc).__name__}); it runs: GET /v1/batches/{batch.id} has it",
                          code="batch_read_failed", headers=NO_RETRY) from exc


def _enqueue(job_ids: list[str]) -> None:
    """After the answer: one message per job (tens of ms each), at the batch priority (behind live
    submissions' plans). If this process dies first, or the broker is down, the jobs are still stored
    with no ``enqueued_at`` and the reconciler sends them."""
    from conductor.tasks.send import enqueue_plan

    for job_id in job_ids:
        if not enqueue_plan(job_id, background=True):
            return


@router.get("/v1/batches", responses=openai_errors(400, 401, 422, 503))
def list_batches(
    session: SessionDep,
    tenant: TenantDep,
    after: Annotated[str | None, Query(pattern=BATCH_ID_RE.pattern)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 20,
) -> BatchList:
    """Newest first; pass the last id of a page as `after` for the next."""
    batches = store.list_batches(session, tenant=tenant, after=after, limit=limit + 1)
    page = [_current(session, b) for b in batches[:limit]]
    return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                     has_more=len(batches) > limit)


@router.get("/v1/batches/{batch_id}", responses=openai_errors(401, 404, 503))
def get_batch(batch_id: str, session: SessionDep, tenant: TenantDep) -> BatchObject:
    return _current(session, batch_or_404(session, batch_id, tenant))


RESULTS_RESPONSE: dict[int | str, dict[str, Any]] = {200: {
    "description": "one JSON line per input line, in input order",
    "content": {JSONL: {"schema": {"type": "string"}}}}}


@router.get("/v1/batches/{batch_id}/results", response_class=Response,
            responses={**openai_errors(401, 404, 409, 410, 503), **RESULTS_RESPONSE})
def results(batch_id: str, session: SessionDep, tenant: TenantDep) -> Response:
    """Every line's result once the batch has ended, in input order: the output file's lines (successes)
    and the error file's (refused lines, failed and cancelled jobs) merged -- the same lines, so a
    client needs one request instead of two file downloads and a merge. 409 while the batch runs; 410
    when one of its files was deleted."""
    batch = batch_or_404(session, batch_id, tenant)
    current = _current(session, batch)
    if current.status in BatchStatus.OPEN:
        raise OpenAIError(409, f"batch {batch_id} is {current.status}: its results exist once it ends; poll "
                          f"GET /v1/batches/{batch_id} until its status is completed, cancelled or expired",
                          code="batch_not_ended", param="batch_id", headers=NO_RETRY)
    by_id: dict[str, bytes] = {}
    for file_id in (current.output_file_id, current.error_file_id):
        if file_id is None:
            continue
        file = store.get_file(session, file_id=file_id, tenant=tenant)
        if file is None:
            raise OpenAIError(410, f"the batch's file {file_id} was deleted, and its results with it",
                              code="file_deleted", param="batch_id")
        for line in file.content.splitlines():
            if line.strip():
                by_id[json.loads(line)["custom_id"]] = line
    order = store.custom_ids(session, batch_id=batch.id)
    return Response(b"".join(by_id[c] + b"\n" for c in order if c in by_id), media_type=JSONL)


@router.post("/v1/batches/{batch_id}/cancel", responses=openai_errors(401, 404, 409, 503))
def cancel(batch_id: str, session: SessionDep, tenant: TenantDep) -> BatchObject:
    """Cancels the jobs not yet ended; the batch ends `cancelled`, its output file holding what finished."""
    batch = batch_or_404(session, batch_id, tenant)
    if batch.status == BatchStatus.IN_PROGRESS:
        session.rollback()  # no transaction held open while the jobs are cancelled
        cancel_batch(batch.id)
        session.expire_all()
        batch = batch_or_404(session, batch_id, tenant)
    elif batch.status != BatchStatus.CANCELLING:
        raise OpenAIError(409, f"batch {batch.id} is {batch.status}; only a batch in progress can be cancelled",
                          code="conflict", headers=NO_RETRY)
    return _current(session, batch)
