"""Batches, wire-compatible with OpenAI's Batch API: a JSONL file of requests becomes one ordinary job per
line; when every job has ended, an output file (the successes) and an error file (the rest) are written.

- Upload (``parse_input``) checks what the whole file depends on: size, line count, one JSON object per
  line, a unique ``custom_id`` on each. A file failing these is refused, naming the line.
- Creation (``create_batch``) turns each line into a job in one transaction with the batch: a line whose
  method, url or body is wrong fails alone and goes to the error file.
- Ending (``finish_if_done``) is idempotent and needs no message: the API checks when a batch is read,
  and the reconciler checks every open batch on each pass, so a batch whose last job ended while no one
  was looking is still finished.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import DataError
from sqlalchemy.sql import Executable
from sqlmodel import Session

from conductor.chat import ChatRequestError, chat_job, completion, job_ref
from conductor.engine import cancel_job
from conductor.errors import Rejection
from conductor.openai_wire import (
    BatchLineError,
    BatchOutputLine,
    BatchResponse,
    ChatCompletionRequest,
    ResponseCreateRequest,
    jsonl_lines,
)
from conductor.pool.base import storable_escaped
from conductor.responses import response_job, response_object, response_row
from conductor.settings import Settings
from conductor.store import batches as store
from conductor.store import jobs as jobs_store
from conductor.store import responses as responses_store
from conductor.store.db import session_scope
from conductor.store.models import (
    Batch,
    BatchRequest,
    BatchStatus,
    Job,
    JobStatus,
    OpenAIResponse,
    StoredFile,
    utcnow,
)
from conductor.submission import JobCreate, SubmissionError, create_job, unstorable
from conductor.workflow import CONDUCTOR_AGENT, MAX_REPORTED_ERRORS

log = logging.getLogger(__name__)

CHAT_ENDPOINT = "/v1/chat/completions"
RESPONSES_ENDPOINT = "/v1/responses"
JOBS_ENDPOINT = "/v1/jobs"
OPENAI_ENDPOINTS = (CHAT_ENDPOINT, RESPONSES_ENDPOINT)
"""The endpoints whose lines name a ``model`` (an unknown one is ``model_not_found``) and whose answer's
finish reason shows in the line's body (``finish_reason: length``; a response ``incomplete``)."""
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
MAX_CUSTOM_ID_CHARS = 512
MAX_FILENAME_CHARS = 255
"""A batch input file's name is stored cut to this."""
MAX_UPLOAD_FILENAME_CHARS = 1_000
"""The longest file name ``POST /v1/files`` takes (longer: refused, 400 ``param: file``), the route's own check of
the names the parser reads. A plain ``filename=`` within it always is (at most 4 bytes a character), but
the multipart parser (python-multipart) refuses any part's header line over 4,224 bytes before the route
sees it, and an RFC 2231 ``filename*=`` percent-encodes each byte in three: such a name of ~350 characters
is refused there already, as the parser's refusal (``problems.unreadable_form``), which names the header
line, not this limit."""


class BatchFileError(ValueError):
    """An input file that cannot be used at all; ``line`` (1-based) names where, when one line is why."""

    def __init__(self, message: str, *, code: str, line: int | None = None, kind: Rejection = Rejection.MALFORMED):
        super().__init__(f"line {line}: {message}" if line is not None else message)
        self.code, self.line, self.kind = code, line, kind


@dataclass(frozen=True)
class InputLine:
    line: int
    custom_id: str
    request: dict[str, Any]


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


# --- upload -----------------------------------------------------------------------------------------


def parse_input(content: bytes, settings: Settings) -> list[InputLine]:
    """The requests of a batch input file; refuses the file when it cannot be used as a whole."""
    if len(content) > settings.batch_max_file_bytes:
        # (an upload reads at most one byte past the limit: the file's whole size is not known here)
        raise BatchFileError(f"the file is over the limit of {settings.batch_max_file_bytes} bytes",
                             code="file_too_large", kind=Rejection.TOO_LARGE)
    try:
        text = content.decode("utf-8-sig")  # a byte-order mark (as Windows tools write) is not line 1's JSON
    except UnicodeDecodeError as exc:  # (the offset counts the byte-order mark the codec took off)
        skipped = 3 if content.startswith(b"\xef\xbb\xbf") else 0
        raise BatchFileError(f"the file is not UTF-8 (byte {exc.start + skipped})", code="invalid_encoding") from exc
    lines: list[InputLine] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(jsonl_lines(text), start=1):
        if not raw.strip():
            continue
        if len(lines) == settings.batch_max_lines:
            raise BatchFileError(f"more than {settings.batch_max_lines} requests; split the file",
                                 code="too_many_requests", line=number, kind=Rejection.TOO_LARGE)
        item = _json_object(raw, number)
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
            raise BatchFileError(f"'custom_id' must be a string of 1-{MAX_CUSTOM_ID_CHARS} characters",
                                 code="invalid_custom_id", line=number)
        if unstorable(custom_id):
            raise BatchFileError(f"'custom_id' {unstorable(custom_id)}", code="invalid_custom_id", line=number)
        if custom_id in seen:
            raise BatchFileError(f"duplicate custom_id '{custom_id}' (first on line {seen[custom_id]})",
                                 code="duplicate_custom_id", line=number)
        seen[custom_id] = number
        lines.append(InputLine(line=number, custom_id=custom_id, request=item))
    if not lines:
        raise BatchFileError("the file holds no requests (one JSON object per line)", code="empty_file")
    return lines


def _json_object(raw: str, number: int) -> dict[str, Any]:
    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        item = json.loads(raw, parse_constant=refuse_constant)
    except ValueError as exc:
        raise BatchFileError(f"not valid JSON ({exc})", code="invalid_json", line=number) from exc
    except RecursionError as exc:  # not a ValueError: nesting deeper than the parser's recursion limit
        raise BatchFileError("nested too deeply to parse", code="invalid_json", line=number) from exc
    if not isinstance(item, dict):
        raise BatchFileError("each line must be a JSON object", code="invalid_json", line=number)
    return item


def store_input_file(session: Session, *, tenant: str, filename: str, content: bytes, settings: Settings,
                     lines: list[InputLine] | None = None) -> StoredFile:
    """Stores a batch input file; ``lines``: its ``parse_input``, when the caller parsed it already."""
    lines = parse_input(content, settings) if lines is None else lines
    file = StoredFile(
        id=new_file_id(),
        tenant=tenant,
        purpose="batch",
        filename=(filename or "batch.jsonl")[:MAX_FILENAME_CHARS],
        size_bytes=len(content),
        lines=len(lines),
        content=content,
    )
    return store.insert_file(session, file=file)


# --- creation ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineJob:
    body: JobCreate
    context: list[dict[str, str]] | None
    response: ResponseCreateRequest | None = None
    """A ``/v1/responses`` line's request: its job gets a response row, as the route's does."""


class LineError(ValueError):
    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def create_batch(
    session: Session,
    *,
    tenant: str,
    input_file: StoredFile,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, str] | None,
    settings: Settings,
) -> tuple[Batch, list[str]]:
    """Inserts the batch, its lines and one job per good line (not committed). Returns the batch and the
    ids of the jobs to enqueue once committed."""
    now = utcnow()
    lines = parse_input(input_file.content, settings)
    batch = store.insert_batch(session, batch=Batch(
        id=new_batch_id(),
        tenant=tenant,
        endpoint=endpoint,
        input_file_id=input_file.id,
        completion_window=completion_window,
        meta=metadata,
        total=len(lines),
        created_at=now,
        in_progress_at=now,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
    ))
    job_ids: list[str] = []
    for item in lines:
        request = BatchRequest(batch_id=batch.id, line=item.line, custom_id=item.custom_id)
        try:
            wanted = line_job(item, endpoint, settings)
            with session.begin_nested():  # a line the database refuses must not undo the others
                job, _ = create_job(session, wanted.body, tenant=tenant, settings=settings,
                                    context=wanted.context, batch_id=batch.id, then=_response_row_of(wanted))
            request.job_id = job.id
            job_ids.append(job.id)
        except LineError as exc:
            request.error_code, request.error = exc.code, f"line {item.line}: {exc}"
        except SubmissionError as exc:  # a chat or response line's unknown conductor/<planner>: as the route says it
            unknown_model = exc.title == "Unknown planner" and endpoint in OPENAI_ENDPOINTS
            code = "model_not_found" if unknown_model else "invalid_request"
            request.error_code, request.error = code, f"line {item.line}: {exc}"
        except DataError:
            request.error_code, request.error = "invalid_body", f"line {item.line}: a value cannot be stored"
        if request.error is not None:
            # (it may name the line's own keys: a NUL or a lone surrogate there failed the whole batch's flush)
            request.error = storable_escaped(request.error)
        if request.error is not None and len(request.error) > MAX_LINE_ERROR_CHARS:
            cut = " ... (error cut at 1,000 characters)"
            request.error = request.error[:MAX_LINE_ERROR_CHARS - len(cut)] + cut
        store.insert_request(session, request=request)
    session.flush()
    return batch, job_ids


MAX_LINE_ERROR_CHARS = 1_000
"""A refused line's error as stored and written to the batch's error file."""


def _response_row_of(wanted: LineJob) -> Callable[[Job], list[tuple[Executable, dict[str, Any]]]] | None:
    """A ``/v1/responses`` line's job is a response too (``GET /v1/responses/{id}`` reads it): its response
    row, inserted with the job as the route inserts it."""
    asked = wanted.response
    if asked is None:
        return None
    return lambda job: [responses_store.response_insert(response_row(job.id, asked))]


def line_job(item: InputLine, endpoint: str, settings: Settings) -> LineJob:
    """The job one input line asks for, or ``LineError`` saying why it cannot be run."""
    req = item.request
    if req.get("method") != "POST":
        raise LineError("'method' must be \"POST\"", "invalid_method")
    if req.get("url") != endpoint:
        raise LineError(f"'url' must be the batch's endpoint \"{endpoint}\"", "invalid_url")
    body = req.get("body")
    if not isinstance(body, dict):
        raise LineError("'body' must be a JSON object", "invalid_body")
    if len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")) > \
            settings.max_body_bytes:
        # UTF-8 bytes, as the live route counts its request body (escaped, one emoji counted 12)
        raise LineError(f"'body' is over {settings.max_body_bytes} bytes", "body_too_large")
    extra = set(req) - {"custom_id", "method", "url", "body"}
    if extra:
        raise LineError(f"unknown field(s) {', '.join(sorted(extra)[:10])}", "invalid_request")
    try:
        if endpoint == CHAT_ENDPOINT:
            chat = ChatCompletionRequest.model_validate(body)
            if chat.stream:
                raise LineError("'stream' is not available in a batch", "invalid_body")
            made = chat_job(chat, settings)
            return LineJob(body=made.body, context=made.context)
        if endpoint == RESPONSES_ENDPOINT:
            asked = ResponseCreateRequest.model_validate(body)
            if asked.stream:
                raise LineError("'stream' is not available in a batch", "invalid_body")
            if asked.previous_response_id is not None:
                raise LineError("'previous_response_id' is not available in a batch: send the conversation in "
                                "'input'", "invalid_body")
            made = response_job(asked, settings)
            # (a line is not a background request: it is answered in the batch's output file)
            return LineJob(body=made.body, context=made.context, response=asked.model_copy(update={"background": None}))
        return LineJob(body=JobCreate.model_validate(body), context=None)
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
                            for e in exc.errors()[:MAX_REPORTED_ERRORS])
        if exc.error_count() > MAX_REPORTED_ERRORS:
            reasons += f"; ... and {exc.error_count() - MAX_REPORTED_ERRORS} more"
        raise LineError(f"invalid body: {reasons}", "invalid_body") from exc
    except ChatRequestError as exc:
        raise LineError(str(exc), exc.code) from exc


# --- ending -----------------------------------------------------------------------------------------


def finish_if_done(batch_id: str) -> bool:
    """When every job of an open batch has ended: writes its output and error files and ends it
    (completed, cancelled or expired), all in one transaction. Safe to call any number of times, from
    anywhere: exactly one caller writes the files. Returns whether this call ended the batch."""
    with session_scope() as s:
        batch = store.get_batch(s, batch_id=batch_id)
        if batch is None or batch.status not in BatchStatus.OPEN:
            return False
        if store.has_unfinished_jobs(s, batch_id=batch_id):
            return False
        now = utcnow()
        final = _final_status(batch)
        stamps = {"finalizing_at": now, f"{final}_at": now}
        if not store.transition_batch(s, batch_id=batch_id, from_=BatchStatus.OPEN, to=final, **stamps):
            return False  # another caller ended it first
        output, errors, usage = render_results(s, batch)
        ids: dict[str, Any] = {"usage": usage}
        for kind, lines, purpose in (("output", output, "batch_output"), ("error", errors, "batch_output")):
            if not lines:
                continue
            content = "".join(line + "\n" for line in lines).encode()
            file = store.insert_file(s, file=StoredFile(
                id=new_file_id(), tenant=batch.tenant, purpose=purpose, filename=f"{batch.id}_{kind}.jsonl",
                size_bytes=len(content), lines=len(lines), content=content,
            ))
            ids[f"{kind}_file_id"] = file.id
        store.transition_batch(s, batch_id=batch_id, from_=[final], to=final, **ids)
    log.info("batch %s %s", batch_id, final)
    return True


def _final_status(batch: Batch) -> str:
    if batch.status == BatchStatus.CANCELLING:
        return BatchStatus.EXPIRED if batch.expired_at is not None else BatchStatus.CANCELLED
    return BatchStatus.COMPLETED


BATCH_USAGE = ("input_tokens", "output_tokens", "cached_input_tokens", "reasoning_tokens")
"""A batch's usage: the sums of these job totals over its lines' jobs (a refused line has none)."""


def render_results(session: Session, batch: Batch) -> tuple[list[str], list[str], dict[str, int]]:
    """(output lines, error lines) in input order, each a ``BatchOutputLine`` as JSON, and the batch's usage
    (``BATCH_USAGE``) as its jobs' totals are now: every call of a line's job, its planner's too."""
    output: list[str] = []
    errors: list[str] = []
    usage = dict.fromkeys(BATCH_USAGE, 0)
    expired = batch.expired_at is not None
    lines = store.batch_lines(session, batch_id=batch.id)
    answers_tell = batch.endpoint in OPENAI_ENDPOINTS
    reasons = jobs_store.answer_finish_reasons(session, batch_id=batch.id) if answers_tell else {}
    rows = responses_store.batch_responses(session, batch_id=batch.id) if batch.endpoint == RESPONSES_ENDPOINT else {}
    for request, job in lines:
        line = _result_line(batch, request, job, expired=expired, reasons=reasons, rows=rows)
        (output if line.error is None else errors).append(line.model_dump_json())
        for name in BATCH_USAGE if job is not None else ():
            usage[name] += getattr(job, name)
    return output, errors, usage


def _result_line(batch: Batch, request: BatchRequest, job: Job | None, *, expired: bool,
                 reasons: dict[str, str | None], rows: dict[str, OpenAIResponse]) -> BatchOutputLine:
    line_id = f"batch_req_{uuid.uuid4().hex}"
    if job is None:
        error = BatchLineError(code=request.error_code or "invalid_request", message=request.error or "")
        return BatchOutputLine(id=line_id, custom_id=request.custom_id, response=None, error=error)
    row = rows.get(job.id)
    if batch.endpoint == RESPONSES_ENDPOINT and row is None:  # (inserted with its job: never seen)
        log.error("batch %s: line %s's job %s has no response row", batch.id, request.line, job.id)
        error = BatchLineError(code="server_error", message=f"the response of job {job.id} was not stored; "
                                                            f"GET /v1/jobs/{job.id} has the job")
        return BatchOutputLine(id=line_id, custom_id=request.custom_id, response=None, error=error)
    if job.status == JobStatus.SUCCEEDED:
        if batch.endpoint == CHAT_ENDPOINT:
            body = completion(job, model_of(job), reasons.get(job.id)).model_dump(mode="json")
        elif row is not None:
            body = response_object(job, row, reasons.get(job.id)).model_dump(mode="json")
        else:
            body = job_result(job)
        response = BatchResponse(status_code=200, request_id=job.id, body=body)
        return BatchOutputLine(id=line_id, custom_id=request.custom_id, response=response, error=None)
    if job.status == JobStatus.CANCELLED and _ended_by_the_batch(batch, job):
        # As OpenAI's Batch API: a request the batch's cancel or window stopped has no response, only an
        # error coded batch_cancelled / batch_expired (what it did before is at its job)
        why = "its completion window expired" if expired else "the batch was cancelled"
        error = BatchLineError(code="batch_expired" if expired else "batch_cancelled",
                               message=f"this request was not finished before {why}; job {job.id}: "
                                       f"GET /v1/jobs/{job.id}")
        return BatchOutputLine(id=line_id, custom_id=request.custom_id, response=None, error=error)
    code = "job_cancelled" if job.status == JobStatus.CANCELLED else "job_failed"
    message = job.error_message or job.status
    if row is not None:  # a response line: the response, failed or cancelled, as GET /v1/responses/{id} has it
        body = response_object(job, row).model_dump(mode="json")
    else:
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": job.error_type},
                "conductor": job_ref(job).model_dump(mode="json")}
    response = BatchResponse(status_code=500 if code == "job_failed" else 409, request_id=job.id, body=body)
    return BatchOutputLine(id=line_id, custom_id=request.custom_id, response=response,
                           error=BatchLineError(code=code, message=message))


def _ended_by_the_batch(batch: Batch, job: Job) -> bool:
    """Cancelled by the batch's cancel or expiry, not on its own before it (``POST /v1/jobs/{id}/cancel``)."""
    return batch.cancelling_at is not None and (job.finished_at is None or job.finished_at >= batch.cancelling_at)


def model_of(job: Job) -> str:
    """The chat model name a job was asked for (the inverse of ``chat.planner_for_model``)."""
    return CONDUCTOR_AGENT if job.planner == CONDUCTOR_AGENT else f"{CONDUCTOR_AGENT}/{job.planner}"


def job_result(job: Job) -> dict[str, Any]:
    """A ``/v1/jobs`` line's result: the outcome fields of ``GET /v1/jobs/{id}`` (the full record, with
    its workflow and steps, stays at that route)."""
    return {
        "id": job.id,
        "status": job.status,
        "answer": job.answer,
        "error": ({"type": job.error_type, "message": job.error_message, "step": job.error_step}
                  if job.error_type else None),
        "usage": {"input_tokens": job.input_tokens, "output_tokens": job.output_tokens,
                  "cost_usd": round(job.cost_usd, 8), "calls": job.calls,
                  "cached_input_tokens": job.cached_input_tokens, "reasoning_tokens": job.reasoning_tokens,
                  "cache_write_tokens": job.cache_write_tokens},
        "metadata": job.meta,
        "created_at": job.created_at.isoformat(),
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "links": {"self": f"/v1/jobs/{job.id}", "steps": f"/v1/jobs/{job.id}/steps"},
    }


# --- cancel, expiry, the reconciler's pass ----------------------------------------------------------


def cancel_batch(batch_id: str, *, expired: bool = False) -> bool:
    """in_progress -> cancelling; every job not yet ended is cancelled, then the batch ends (cancelled, or
    expired when its completion window ran out). Returns False when the batch was not in progress."""
    now = utcnow()
    stamps = {"cancelling_at": now, **({"expired_at": now} if expired else {})}
    with session_scope() as s:
        if not store.transition_batch(s, batch_id=batch_id, from_=[BatchStatus.IN_PROGRESS],
                                      to=BatchStatus.CANCELLING, **stamps):
            return False
    drive_cancelling(batch_id)
    return True


def drive_cancelling(batch_id: str) -> bool:
    """Cancels what is left of a cancelling batch and ends it; re-run by the reconciler if interrupted."""
    with session_scope() as s:
        unfinished = store.unfinished_job_ids(s, batch_id=batch_id)
    for job_id in unfinished:
        cancel_job(job_id)
    return finish_if_done(batch_id)


def reconcile_batches() -> dict[str, int]:
    """For the reconciler: expires batches past their window, re-drives cancellations, and ends every open
    batch whose jobs have all ended (its output would otherwise wait for someone to read the batch)."""
    with session_scope() as s:
        past_window = store.expired_open_batch_ids(s, now=utcnow())
    ended = expired = failed = 0
    for batch_id in past_window:
        try:
            if finish_if_done(batch_id):  # its jobs have all ended (by this pass): it completed
                ended += 1
            elif cancel_batch(batch_id, expired=True):
                expired += 1
        except Exception:  # one batch's fault must not stop the others
            failed += 1
            log.exception("expiring batch %s failed; retrying at the next pass", batch_id)
    with session_scope() as s:
        open_ids = store.batches_to_end(s)
    for batch_id in open_ids:
        try:
            with session_scope() as s:
                batch = store.get_batch(s, batch_id=batch_id)
            if batch is None:
                continue
            cancelling = batch.status == BatchStatus.CANCELLING
            ended += int(drive_cancelling(batch_id) if cancelling else finish_if_done(batch_id))
        except Exception:
            failed += 1
            log.exception("ending batch %s failed; retrying at the next pass", batch_id)
    return {"batches_expired": expired, "batches_ended": ended, "batches_failed": failed}
