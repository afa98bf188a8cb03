"""The OpenAI wire shapes this service speaks (chat completions, models, files, batches), as pydantic
models: the API's request and response models, and the lines of batch output files. One place, so a
chat completion returned over HTTP and one written to a batch output file are the same object.

Only what the official ``openai`` client reads is modelled; the names and types follow its own
models (``openai.types``). Conductor's extensions are named ``conductor`` and documented in docs/api.md.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conductor.submission import MAX_LIMIT_TOKENS, unstorable

MAX_CHAT_MESSAGES = 512
MAX_CONTENT_PARTS = 64
MAX_METADATA_PAIRS = 16
MAX_MODEL_CHARS = 256
MAX_RESPONSE_ID_CHARS = 64
"""A ``previous_response_id`` longer than this is no response's (a response's id is its job's, 32 hex digits)."""

MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
Metadata = dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]]
"""OpenAI's metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512."""
MAX_STOP_SEQUENCES = 4

FinishReason = Literal["stop", "length", "content_filter"]
"""Why the answer ended: ``length`` cut at a token limit, ``content_filter`` withheld by the provider."""


# --- chat completions: request ----------------------------------------------------------------------


class TextPart(BaseModel):
    """A ``{"type": "text", "text": …}`` content part; images, audio and files are not accepted."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. ``name``: accepted and not used

    role: Literal["system", "developer", "user", "assistant"]
    # The limit is on the parts of a list; a string's length is bounded by the request's size limit.
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = Field(default=False, strict=True)  # null as false: the clients' types admit it


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. The sampling parameters a client commonly sends are accepted and
    not used: each worker of the workflow runs with its own pool settings. Anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS, description="`conductor` or `conductor/<planner>`")
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_CHAT_MESSAGES)
    stream: bool | None = Field(default=False, strict=True)  # null as false (openai-python's Optional[Literal[False]])
    stream_options: StreamOptions | None = None
    metadata: Metadata | None = Field(
        default=None, max_length=MAX_METADATA_PAIRS, description="Stored as the job's metadata."
    )
    n: Literal[1] | None = None
    user: str | None = Field(default=None, max_length=512)
    max_completion_tokens: int | None = Field(
        default=None, ge=1, le=MAX_LIMIT_TOKENS, strict=True,
        description="Caps the answer: the answering step's output (the job's `limits.max_answer_tokens`).")
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_LIMIT_TOKENS, strict=True,
                                   description="As `max_completion_tokens`, which wins when both are sent.")
    # Accepted for compatibility, not used (each step runs with its agent's own settings).
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, strict=True)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, strict=True)
    seed: int | None = Field(default=None, strict=True)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    # Also accepted and not used, as ``/v1/responses`` accepts them (agent frameworks send them as set in
    # their model settings): each step runs with its agent's own settings.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    parallel_tool_calls: bool | None = Field(default=None, strict=True)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    tools: Annotated[list[Any], Field(max_length=0)] | None = Field(default=None, description="Only `[]`.")
    tool_choice: Literal["none", "auto"] | None = None
    # Accepted only where they ask for nothing this API cannot give (``chat.chat_job`` says why otherwise).
    store: bool | None = Field(default=None, strict=True,
                               description="Must not be false: every completion is a stored job.")
    logprobs: bool | None = Field(default=None, strict=True, description="Must not be true.")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True, description="Only 0.")

    @field_validator("model", "messages", "metadata", "user", "stop")
    @classmethod
    def _storable(cls, v: Any) -> Any:
        """Text Postgres cannot store (NUL, lone surrogates) is refused with its field, not at the database."""
        _refuse_unstorable(v)
        return v


def _refuse_unstorable(value: Any) -> None:
    plain = [m.model_dump() if isinstance(m, BaseModel) else m for m in value] if isinstance(value, list) else value
    problem = unstorable(plain)
    if problem:
        raise ValueError(problem)


# --- chat completions: response ---------------------------------------------------------------------


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason = "stop"
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Of ``prompt_tokens``, those the providers read from their prompt caches."""
    cache_write_tokens: int = 0
    """Of ``prompt_tokens``, those the providers wrote to their prompt caches."""


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """Of ``completion_tokens``, the models' reasoning."""


class CompletionUsage(BaseModel):
    """The job's totals (every call, the planner's too)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class JobRef(BaseModel):
    """Conductor's extension on chat completions: the job behind the answer."""

    job_id: str
    status: str
    cost_usd: float | None = None
    calls: int | None = None
    step: dict[str, Any] | None = Field(default=None, description="On stream progress chunks: the step that changed.")


class ChatCompletion(BaseModel):
    id: str = Field(description="The job id (also in the `Conductor-Job-Id` header).")
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    conductor: JobRef


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    conductor: JobRef | None = None


# --- responses: request ----------------------------------------------------------------------------

ResponseStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled", "incomplete"]


class InputTextPart(BaseModel):
    """An ``input_text`` part, or an ``output_text`` part of an earlier answer sent back as input (its
    ``annotations`` and ``logprobs`` ignored); images, files and audio are not accepted."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(BaseModel):
    """A message item of ``input``, as the SDK sends it: ``{"role", "content"}`` with ``"type": "message"``
    or without; an earlier response's output message (``id``, ``status``, ``phase``) is accepted as is.
    Other items (tool calls and their outputs, reasoning, item references) are refused."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[InputTextPart], Field(max_length=MAX_CONTENT_PARTS)]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ResponseCreateRequest(BaseModel):
    """``POST /v1/responses``. Like chat completions, sampling parameters a client commonly sends are
    accepted and not used (each worker runs with its pool settings); anything else is refused."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS, description="`conductor` or `conductor/<planner>`")
    input: str | Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)] = Field(
        description="The task, or messages whose last (a user message) is the task and the rest its context.")
    instructions: str | None = Field(default=None, description="A system message before the input.")
    background: bool | None = Field(default=False, strict=True,
                                    description="Answer at once (`queued`); poll for the end.")
    stream: bool | None = Field(default=False, strict=True)
    store: bool | None = Field(default=True, strict=True,
                               description="Must not be false: every response is a stored job.")
    metadata: Metadata | None = Field(
        default=None, max_length=MAX_METADATA_PAIRS, description="Stored as the job's metadata."
    )
    previous_response_id: str | None = Field(
        default=None, max_length=MAX_RESPONSE_ID_CHARS,
        description="Continue that response: its input and answer come before this input (not its instructions).")
    max_output_tokens: int | None = Field(
        default=None, ge=1, le=MAX_LIMIT_TOKENS, strict=True,
        description="Caps the answer: the answering step's output (the job's `limits.max_answer_tokens`).")
    # Accepted for compatibility, not used (each step runs with its agent's own settings).
    temperature: float | None = Field(default=None, ge=0, le=2, strict=True)
    top_p: float | None = Field(default=None, ge=0, le=1, strict=True)
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    parallel_tool_calls: bool | None = Field(default=None, strict=True)
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None
    tools: Annotated[list[Any], Field(max_length=0)] | None = Field(default=None, description="Only `[]`.")
    include: Annotated[list[Any], Field(max_length=0)] | None = Field(
        default=None, description="Only `[]` (the OpenAI Agents SDK sends it on every call).")
    tool_choice: Literal["none", "auto"] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_messages_only(cls, v: Any) -> Any:
        """An item or part this API cannot take is refused by its place and type, before pydantic would
        report it against every member of the union (``input.str: Input should be a valid string``)."""
        for n, item in enumerate(v if isinstance(v, list) else []):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind not in (None, "message"):
                raise ValueError(f"input.{n}: items of type {kind!r} are not accepted: only messages "
                                 f"({{role, content}}) of text")
            parts = item.get("content") if isinstance(item, dict) else None
            for p, part in enumerate(parts if isinstance(parts, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("input_text", "output_text"):
                    raise ValueError(f"input.{n}.content.{p}: content parts of type {kind!r} are not accepted: "
                                     f"only input_text (and an earlier answer's output_text)")
        return v

    @field_validator("model", "input", "instructions", "metadata", "user")
    @classmethod
    def _storable(cls, v: Any) -> Any:
        _refuse_unstorable(v)
        return v

    def turns(self) -> list[tuple[str, str]]:
        """(role, text) of the input's messages, in order (a string is one user message)."""
        return [("user", self.input)] if isinstance(self.input, str) else [(m.role, m.text()) for m in self.input]


# --- responses: the response object and its stream events ---------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """The job's totals (every call, the planner's too); the details are parts of them: the input the
    providers read from their prompt caches, the output that was the models' reasoning."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseErrorBody(BaseModel):
    """A failed response's error: ``code`` one the SDK knows (``rate_limit_exceeded`` or ``server_error``),
    ``type`` the job's error type (docs/api.md, Error types)."""

    code: Literal["server_error", "rate_limit_exceeded"]
    message: str
    type: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ResponseObject(BaseModel):
    """A response as OpenAI's Responses API answers it: the fields its clients read (and require), the
    ones Conductor does not use at their neutral values."""

    id: str = Field(description="The job id (also in the `Conductor-Job-Id` header and `conductor.job_id`).")
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    error: ResponseErrorBody | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    background: bool
    completed_at: int | None = None
    previous_response_id: str | None = None
    store: Literal[True] = True
    max_output_tokens: int | None = None
    """As asked: the cap on the answering step's output (``limits.max_answer_tokens``)."""
    parallel_tool_calls: bool = False
    temperature: None = None
    top_p: None = None
    tool_choice: Literal["auto"] = "auto"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    conductor: JobRef


# --- models -----------------------------------------------------------------------------------------


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conductor"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


# --- errors -----------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorDocument(BaseModel):
    """The error body on the OpenAI-compatible routes: ``{"error": {message, type, param, code}}``."""

    error: ErrorDetail


# --- files ------------------------------------------------------------------------------------------

FilePurpose = Literal["batch", "batch_output"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


# --- batches ----------------------------------------------------------------------------------------

BatchEndpoint = Literal["/v1/chat/completions", "/v1/responses", "/v1/jobs"]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: BatchEndpoint
    completion_window: Literal["24h"]
    metadata: Metadata | None = Field(default=None, max_length=MAX_METADATA_PAIRS)

    @field_validator("metadata")
    @classmethod
    def _storable(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        _refuse_unstorable(v)
        return v


class BatchInputTokensDetails(BaseModel):
    cached_tokens: int = 0


class BatchUsage(BaseModel):
    """OpenAI's ``BatchUsage``: the ``ResponseUsage`` shape without its cache-write details."""

    input_tokens: int
    input_tokens_details: BatchInputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchError(BaseModel):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None
    usage: BatchUsage | None = None
    """Its jobs' tokens, once it has ended (null before)."""


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


_JSONL_BREAK = re.compile(r"\r\n|\r|\n")


def jsonl_lines(text: str) -> list[str]:
    """A JSONL text's lines, ended by "\n", "\r\n" or "\r" (JSON strings cannot hold those unescaped)
    and by nothing else: ``str.splitlines`` also splits at U+2028, U+2029 and U+0085, which a JSON string
    may hold unescaped (``JSON.stringify`` leaves them, and so does a batch's output of an answer)."""
    lines = _JSONL_BREAK.split(text)
    return lines[:-1] if lines and lines[-1] == "" else lines


# --- batch output files -----------------------------------------------------------------------------


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchLineError(BaseModel):
    code: str
    message: str


class BatchOutputLine(BaseModel):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: BatchResponse | None
    error: BatchLineError | None
