"""OpenAI's Responses API as Conductor jobs: a request becomes a job as a chat conversation does
(``chat.conversation_job``), and a job, with its ``openai_response`` row, becomes a ``response`` object.

The response's id is the job's. Its status follows the job's: ``queued`` → ``queued``, ``planning`` and
``running`` → ``in_progress``, ``succeeded`` → ``completed`` (``incomplete`` when the answering step was
cut at its token limit or withheld by its provider), ``failed`` → ``failed``, ``cancelled`` → ``cancelled``.
"""

from __future__ import annotations

from typing import Any, Literal

from conductor.chat import ChatJob, ChatRequestError, conversation_job, job_ref
from conductor.errors import ErrorType
from conductor.openai_wire import (
    MAX_CHAT_MESSAGES,
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseCreateRequest,
    ResponseErrorBody,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
)
from conductor.settings import Settings
from conductor.store.models import Job, JobStatus, OpenAIResponse

_STATUSES: dict[str, ResponseStatus] = {
    JobStatus.QUEUED: "queued",
    JobStatus.PLANNING: "in_progress",
    JobStatus.RUNNING: "in_progress",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.CANCELLED: "cancelled",
}
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
"""The answering step's finish reason (``store.answer_finish_reasons``) that makes a response incomplete."""
_RATE_LIMITED = {ErrorType.RATE_LIMITED, ErrorType.RATE_LIMIT_TIMEOUT}
"""Job error types told as ``rate_limit_exceeded``; every other is a ``server_error`` (its type says which)."""


def response_job(request: ResponseCreateRequest, settings: Settings,
                 previous: tuple[Job, OpenAIResponse] | None = None) -> ChatJob:
    """The job a response request asks for: the input's last message (a user message; a string input is
    one) is the task, the instructions and the earlier messages its context. ``store: false`` is refused:
    every response is a job, kept with its steps for audit and read back by id.

    ``previous`` (the whole rows of ``previous_response_id``'s response, a completed or incomplete one):
    its input items and its answer come first, before this input, as OpenAI chains responses; its
    instructions do not (OpenAI documents that they are not carried over: a new request sends its own).
    The whole conversation is held to the limits of one request's input (``MAX_CHAT_MESSAGES`` items,
    ``max_task_chars`` characters with the instructions), so a chain cannot grow a job past them."""
    if request.store is False:
        raise ChatRequestError(
            "store=false cannot be honoured: every response is a job, stored with its steps and read back "
            "with GET /v1/responses/{id}; omit store or set it to true",
            param="store", code="unsupported_parameter",
        )
    turns = request.turns()
    if previous is not None:
        carried = continued_turns(*previous)
        turns = [*carried, *turns]
        _check_chain(turns, len(carried), previous[0].id, request.instructions, settings)
    return conversation_job(request.model, turns, request.metadata, settings, param="input",
                            system=request.instructions, max_answer_tokens=request.max_output_tokens)


def _check_chain(turns: list[tuple[str, str]], carried: int, previous_id: str, instructions: str | None,
                 settings: Settings) -> None:
    """Refuses a continued conversation past one request's input limits, saying how much the chain brought."""
    chars = sum(len(text) for _, text in turns) + len(instructions or "")
    carried_chars = sum(len(text) for _, text in turns[:carried])
    if len(turns) > MAX_CHAT_MESSAGES:
        over = (f"{len(turns)} items ({carried} of them from previous response {previous_id}); the limit is "
                f"{MAX_CHAT_MESSAGES}")
    elif chars > settings.max_task_chars:
        over = (f"{chars} characters with the instructions ({carried_chars} of them from previous response "
                f"{previous_id}); the limit is {settings.max_task_chars} (CONDUCTOR_MAX_TASK_CHARS)")
    else:
        return
    raise ChatRequestError(
        f"the conversation continued from previous_response_id would have {over}: start a new conversation "
        f"(without previous_response_id), sending in input only what it needs",
        param="previous_response_id", code="context_length_exceeded",
    )


def continued_turns(job: Job, row: OpenAIResponse) -> list[tuple[str, str]]:
    """What a response continuing this one (``previous_response_id``) begins with: this response's input
    items (its own chain's included: they lead its context), then its answer as an assistant turn."""
    return [*((item["role"], item["content"][0]["text"]) for item in input_items(job, row)),
            ("assistant", job.answer or "")]


def response_row(job_id: str, request: ResponseCreateRequest) -> OpenAIResponse:
    return OpenAIResponse(job_id=job_id, model=request.model, background=bool(request.background),
                          instructions=bool(request.instructions),
                          previous_response_id=request.previous_response_id)


def response_status(job: Job, answer_finish_reason: str | None = None) -> ResponseStatus:
    if job.status == JobStatus.SUCCEEDED and answer_finish_reason in _INCOMPLETE:
        return "incomplete"
    return _STATUSES[job.status]


def output_message(job: Job, status: ResponseStatus) -> OutputMessage:
    """The answer as the response's one output item (``response.output_text`` reads it)."""
    return OutputMessage(id=message_id(job.id), status="incomplete" if status == "incomplete" else "completed",
                         content=[OutputText(text=job.answer or "")])


def message_id(job_id: str) -> str:
    return f"msg_{job_id}"


def response_object(job: Job, row: OpenAIResponse, answer_finish_reason: str | None = None) -> ResponseObject:
    """The response as it stands. Of ``job``'s context only the first message is read, when ``row`` says it
    holds the instructions (``store.responses.get_response_state`` reads only that much)."""
    status = response_status(job, answer_finish_reason)
    ended = job.finished_at is not None and job.status in JobStatus.TERMINAL
    reason = _INCOMPLETE.get(answer_finish_reason or "") if status == "incomplete" else None
    return ResponseObject(
        id=job.id,
        created_at=int(job.created_at.timestamp()),
        status=status,
        model=row.model,
        output=[output_message(job, status)] if status in ("completed", "incomplete") else [],
        usage=usage(job) if ended else None,
        error=error(job) if status == "failed" else None,
        incomplete_details=IncompleteDetails(reason=reason) if reason else None,
        instructions=instructions(job, row),
        metadata=dict(getattr(job, "meta", None) or {}),
        background=row.background,
        completed_at=int(job.finished_at.timestamp()) if status == "completed" and job.finished_at else None,
        previous_response_id=row.previous_response_id,
        max_output_tokens=(getattr(job, "limits", None) or {}).get("max_answer_tokens"),
        conductor=job_ref(job),
    )


def error(job: Job) -> ResponseErrorBody:
    kind = job.error_type or ErrorType.INTERNAL_ERROR
    code: Literal["server_error", "rate_limit_exceeded"] = (
        "rate_limit_exceeded" if kind in _RATE_LIMITED else "server_error")
    return ResponseErrorBody(code=code, message=job.error_message or kind, type=kind)


def usage(job: Job) -> ResponseUsage:
    return ResponseUsage(input_tokens=job.input_tokens, output_tokens=job.output_tokens,
                         total_tokens=job.input_tokens + job.output_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=job.cached_input_tokens,
                                                                 cache_write_tokens=job.cache_write_tokens),
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=job.reasoning_tokens))


def instructions(job: Job, row: OpenAIResponse) -> str | None:
    context = getattr(job, "context", None) or []
    return str(context[0]["content"]) if row.instructions and context else None


def input_items(job: Job, row: OpenAIResponse) -> list[dict[str, Any]]:
    """The input's messages, in order, as OpenAI lists them (the instructions are not an input item; a
    developer message reads back as a system message, as the job's context holds it). A response that
    continues another (``previous_response_id``) lists the whole conversation, as OpenAI does (the items
    used to generate it): the previous responses' inputs and answers, then its own input; each item's id
    is this response's (``msg_<id>_in<n>``)."""
    context = list(job.context or [])[1 if row.instructions else 0:]
    turns = [(str(m["role"]), str(m["content"])) for m in context] + [("user", job.task)]
    return [_item(f"{message_id(job.id)}_in{n}", role, text) for n, (role, text) in enumerate(turns)]


def _item(item_id: str, role: str, text: str) -> dict[str, Any]:
    part = ({"type": "output_text", "text": text, "annotations": []} if role == "assistant"
            else {"type": "input_text", "text": text})
    return {"id": item_id, "type": "message", "role": role, "status": "completed", "content": [part]}
