"""OpenAI-style chat as a Conductor job: a conversation becomes a task with context, a finished job
becomes a ``chat.completion``.

The last user message is the task. Every earlier message (system and developer messages included)
becomes the job's ``context``: the prior turns each worker sees after its system message, and that the
planner sees as earlier work -- the same way a recursive step hands its visible steps to a child job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from conductor.errors import Rejection
from conductor.openai_wire import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    CompletionTokensDetails,
    CompletionUsage,
    FinishReason,
    JobRef,
    ModelObject,
    PromptTokensDetails,
)
from conductor.pool.config import PoolConfig, template_refs
from conductor.settings import Settings
from conductor.store.models import Job
from conductor.submission import MAX_PLANNER_CHARS, JobCreate, Limits
from conductor.workflow import CONDUCTOR_AGENT

MODEL_PREFIX = f"{CONDUCTOR_AGENT}/"
MODELS_CREATED = 1_767_225_600  # 2026-01-01: a fixed timestamp, the models are not created at run time


class ChatRequestError(ValueError):
    """A chat request that cannot become a job; ``param`` names the offending field, ``kind`` says why."""

    def __init__(self, message: str, *, param: str, code: str, kind: Rejection = Rejection.MALFORMED):
        super().__init__(message)
        self.param, self.code, self.kind = param, code, kind


@dataclass(frozen=True)
class ChatJob:
    """What ``create_job`` needs for a chat request."""

    body: JobCreate
    context: list[dict[str, str]]


def planner_for_model(model: str) -> str:
    """``conductor`` -> the pool's planner; ``conductor/<planner>`` -> that planner. The planner is checked
    against the pool when the job is created."""
    if model == CONDUCTOR_AGENT:
        return CONDUCTOR_AGENT
    if model.startswith(MODEL_PREFIX) and len(model) > len(MODEL_PREFIX):
        return model[len(MODEL_PREFIX):]
    raise ChatRequestError(
        f"The model '{model}' does not exist: use 'conductor' or 'conductor/<planner>' (GET /v1/models lists them)",
        param="model",
        code="model_not_found",
        kind=Rejection.NOT_FOUND,
    )


def chat_job(request: ChatCompletionRequest, settings: Settings) -> ChatJob:
    """The job a chat request asks for; refuses conversations that do not end with a user turn, and
    ``store: false`` and log probabilities, which cannot be honoured."""
    if request.store is False:
        raise ChatRequestError(
            "store=false cannot be honoured: every chat completion is a job, stored with its steps for audit "
            "and read back with GET /v1/jobs/{id}; omit store or set it to true",
            param="store", code="unsupported_parameter",
        )
    for name, asked in (("logprobs", request.logprobs), ("top_logprobs", request.top_logprobs)):
        if asked:
            raise ChatRequestError(
                f"{name} cannot be given: the answer is written by a workflow of models, some of which give "
                "no log probabilities; omit it (or send false / 0)",
                param=name, code="unsupported_parameter",
            )
    turns = [(m.role, m.text()) for m in request.messages]
    cap = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    return conversation_job(request.model, turns, request.metadata, settings, param="messages",
                            max_answer_tokens=cap)


def conversation_job(model: str, turns: Sequence[tuple[str, str]], metadata: dict[str, str] | None,
                     settings: Settings, *, param: str, system: str | None = None,
                     max_answer_tokens: int | None = None) -> ChatJob:
    """The job a conversation of (role, text) turns asks for, chat's or a response's (``param``: where the
    turns are in the request, for errors): the last turn, a user turn, is the task; the others, in order,
    its context (developer turns as system turns, empty turns left out), after ``system`` if given (a
    response's ``instructions``). ``max_answer_tokens`` (chat's ``max_completion_tokens``/``max_tokens``,
    a response's ``max_output_tokens``) caps the answering step's output (``limits.max_answer_tokens``)."""
    planner = planner_for_model(model)
    last_role, task = turns[-1]
    if last_role != "user" or not task.strip():
        raise ChatRequestError(
            "the last message must be a non-empty user message: it is the task",
            param=f"{param}.{len(turns) - 1}",
            code="invalid_messages",
        )
    leading = [("system", system)] if system else []
    context = [{"role": "system" if role == "developer" else role, "content": text}
               for role, text in [*leading, *turns[:-1]] if text]
    total = sum(len(m["content"]) for m in context) + len(task)
    if total > settings.max_task_chars:
        raise ChatRequestError(
            f"the conversation has {total} characters; the limit is {settings.max_task_chars}",
            param=param,
            code="context_length_exceeded",
        )
    try:
        body = JobCreate(
            task=task,
            planner=None if planner == CONDUCTOR_AGENT else planner,
            metadata=dict(metadata or {}),
            limits=Limits(max_answer_tokens=max_answer_tokens),
        )
    except ValidationError as exc:  # what the chat request admits and a job does not (a planner name too long)
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first["loc"] else "body"
        if field == "planner":
            raise ChatRequestError(
                f"The model '{model}' does not exist: a planner name has at most "
                f"{MAX_PLANNER_CHARS} characters", param="model", code="model_not_found", kind=Rejection.NOT_FOUND,
            ) from exc
        raise ChatRequestError(f"{field}: {first['msg']}", param=field, code="invalid_request") from exc
    return ChatJob(body=body, context=context)


def completion(job: Job, model: str, answer_finish_reason: str | None = None) -> ChatCompletion:
    """A succeeded job as a ``chat.completion``; usage counts every call of the job, the planner's too.
    ``answer_finish_reason``: why the step whose output is the answer stopped (``store.answer_finish_reasons``)."""
    return ChatCompletion(
        id=job.id,
        created=int(job.created_at.timestamp()),
        model=model,
        choices=[Choice(message=AssistantMessage(content=job.answer or ""),
                        finish_reason=finish_reason(answer_finish_reason))],
        usage=usage(job),
        conductor=job_ref(job),
    )


def finish_reason(answer_finish_reason: str | None) -> FinishReason:
    """``length`` when the answering step was cut at its token limit, ``content_filter`` when its provider
    withheld the answer (every provider reports these in OpenAI's words), else ``stop``."""
    if answer_finish_reason == "length":
        return "length"
    return "content_filter" if answer_finish_reason == "content_filter" else "stop"


def usage(job: Job) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=job.input_tokens,
        completion_tokens=job.output_tokens,
        total_tokens=job.input_tokens + job.output_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=job.cached_input_tokens,
                                                  cache_write_tokens=job.cache_write_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=job.reasoning_tokens),
    )


def job_ref(job: Job, step: dict[str, Any] | None = None) -> JobRef:
    ended = job.finished_at is not None
    return JobRef(
        job_id=job.id,
        status=job.status,
        cost_usd=round(job.cost_usd, 8) if ended else None,
        calls=job.calls if ended else None,
        step=step,
    )


def model_list(pool: PoolConfig) -> list[ModelObject]:
    """``conductor`` (the pool's planner), then ``conductor/<planner>`` for each template and agent."""
    names = [CONDUCTOR_AGENT, *(MODEL_PREFIX + ref for ref in [*template_refs(), *pool.agents])]
    return [ModelObject(id=name, created=MODELS_CREATED) for name in names]
