"""The public shapes of the REST API (API.md): what every route returns, as typed pydantic models.

Table rows are never returned as they are; ``views.py`` builds these from them. The OpenAPI schema the
server publishes is generated from these models, and the schemathesis test checks every response
against it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, PlainSerializer, WithJsonSchema

from conductor.store.models import DeliveryStatus, JobStatus, StepStatus


def _iso(ts: datetime) -> str:
    return ts.isoformat()


Timestamp = Annotated[
    datetime,
    PlainSerializer(_iso, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
"""An aware UTC timestamp, written as ``datetime.isoformat()`` gives it (``…+00:00``)."""


class Links(BaseModel):
    self: str = Field(description="this job")
    steps: str = Field(description="its steps, with every attempt")
    events: str = Field(description="its server-sent event stream")
    trace: str = Field(description="its page in the trace viewer (HTML: graph, timeline, messages)")


class ErrorInfo(BaseModel):
    """Why a job, step or attempt failed. ``type`` is one of the stored error types (``ErrorType``)."""

    type: str = Field(description="snake_case error type, e.g. provider_timeout, budget_exceeded, worker_lost")
    message: str | None


class JobError(ErrorInfo):
    step: int | None = Field(default=None, description="index of the step whose failure failed the job")


class ParentRef(BaseModel):
    job_id: str
    step_index: int | None


class WorkflowStep(BaseModel):
    index: int
    agent: str
    instruction: str
    access_list: list[int]


class WorkflowPublic(BaseModel):
    steps: list[WorkflowStep]
    source: str = Field(description="planner | request | fallback | replay")
    format_valid: bool | None
    planner_error: str | None
    planner_attempts: int


class PlannerUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cost_usd: float
    calls: int
    cached_input_tokens: int = Field(description="of input_tokens, those read from the providers' prompt caches")
    reasoning_tokens: int = Field(description="of output_tokens, the models' reasoning")
    cache_write_tokens: int = Field(description="of input_tokens, those written to the providers' prompt caches")


class JobUsage(PlannerUsage):
    """Totals for the whole job, the planner's share included (and shown apart in ``planner``)."""

    planner: PlannerUsage


class ReplaySettings(BaseModel):
    """How a replay differs from its original (``POST /v1/jobs/{id}/replay``)."""

    from_step: int | None = Field(description="steps that do not depend on it keep the original's outputs; "
                                  "null: every step ran again")
    agents: dict[str, str] = Field(description="step index -> agent overrides")
    replan: bool


class JobPublic(BaseModel):
    """``GET /v1/jobs/{id}``."""

    id: str
    status: JobStatus
    task: str
    pool: str
    planner: str
    depth: int
    parent: ParentRef | None
    workflow: WorkflowPublic | None
    answer: str | None
    error: JobError | None
    usage: JobUsage
    replay_of: str | None = Field(description="the job this one replays, or null")
    replay: ReplaySettings | None
    limits: dict[str, Any]
    metadata: dict[str, Any]
    batch_id: str | None = None
    """The batch (``POST /v1/batches``) this job is a line of."""
    created_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None
    links: Links


class JobRef(BaseModel):
    """A job's id and status, where to find the rest: the answer to ``POST /v1/jobs/{id}/cancel``."""

    id: str
    status: JobStatus
    links: Links


class JobAccepted(JobRef):
    """``POST /v1/jobs``: ``enqueued`` is false when the broker was unreachable (the job is stored and
    the reconciler sends it later)."""

    enqueued: bool


class ReplayAccepted(JobAccepted):
    """``POST /v1/jobs/{id}/replay``: the new job, linked to the one it replays."""

    replay_of: str


class JobSummary(BaseModel):
    """One job in ``GET /v1/jobs``: the task is cut to its first 200 characters."""

    id: str
    status: JobStatus
    task: str
    pool: str
    batch_id: str | None
    replay_of: str | None
    metadata: dict[str, Any]
    created_at: Timestamp
    finished_at: Timestamp | None
    links: Links


class JobList(BaseModel):
    """``GET /v1/jobs``: newest first, ordered by (created_at, id); ``next`` continues after this page."""

    data: list[JobSummary]
    count: int = Field(description="jobs on this page")
    has_more: bool
    next: str | None = Field(description="the next page (same filters, after this page's last job), or null")


class MessagePublic(BaseModel):
    role: str
    content: str


class StepUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cost_usd: float
    cached_input_tokens: int = Field(description="of input_tokens, those read from the provider's prompt cache")
    reasoning_tokens: int = Field(description="of output_tokens, the model's reasoning")
    cache_write_tokens: int = Field(description="of input_tokens, those written to the provider's prompt cache")


class AttemptPublic(BaseModel):
    n: int
    started_at: Timestamp
    finished_at: Timestamp | None
    latency_ms: int | None
    error: ErrorInfo | None


class ChildJob(BaseModel):
    """A recursive step's child job, with its own steps nested (down to the requested depth; past it,
    or past the answer's step cap, ``steps`` is null and ``links.steps`` pages through them)."""

    job_id: str
    status: JobStatus
    depth: int
    workflow_source: str | None
    answer: str | None
    steps: list[StepPublic] | None
    links: Links


class StepRef(BaseModel):
    job_id: str
    index: int


class StepPublic(BaseModel):
    index: int
    agent: str
    instruction: str
    access_list: list[int] = Field(description="resolved: 'all' is shown as the explicit indices")
    access_all: bool
    status: StepStatus
    provider: str | None
    model: str | None
    messages: list[MessagePublic] | None = Field(description="exactly what the worker was sent")
    output: str | None
    finish_reason: str | None
    usage: StepUsage
    latency_ms: int | None
    attempts: list[AttemptPublic]
    error: ErrorInfo | None
    child_job_id: str | None
    reused: bool = Field(description="a replay's step copied from the original instead of run")
    reused_from: StepRef | None = Field(description="the step whose messages and output it copies")
    queued_at: Timestamp | None
    started_at: Timestamp | None
    finished_at: Timestamp | None
    child: ChildJob | None = None


class StepList(BaseModel):
    data: list[StepPublic]
    count: int
    total: int = Field(description="this job's steps in all (the page is data)")
    next: str | None = Field(description="the next page of this job's steps, or null")


class JobEvent(BaseModel):
    """``event: job`` on ``GET /v1/jobs/{id}/events``."""

    id: str
    status: JobStatus
    answer: str | None
    error: ErrorInfo | None


class StepEvent(BaseModel):
    """``event: step`` on ``GET /v1/jobs/{id}/events``."""

    index: int
    agent: str
    status: StepStatus
    attempts: int
    latency_ms: int | None
    child_job_id: str | None


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class DeliveryAttempt(BaseModel):
    """One attempt of a webhook delivery."""

    n: int = Field(description="1 for the first attempt; every attempt repeats the delivery's webhook-id")
    started_at: Timestamp
    finished_at: Timestamp | None
    status_code: int | None = Field(description="the receiver's HTTP status; null when no answer came")
    latency_ms: int | None
    error: str | None = Field(description="why the attempt did not deliver (HTTP status, timeout, refusal)")


class Delivery(BaseModel):
    """A webhook delivery: the event a job's end owes its webhook URL, and every attempt to send it."""

    id: str = Field(description="the webhook-id header: the same on every retry, for de-duplication")
    type: Literal["job.succeeded", "job.failed", "job.cancelled"]
    url: str
    status: DeliveryStatus
    next_attempt_at: Timestamp | None = Field(description="when the next attempt is due; null once settled")
    created_at: Timestamp
    finished_at: Timestamp | None
    deferrals: int = Field(description="times a due attempt was put off, not made, because the tenant already "
                                       "had CONDUCTOR_WEBHOOK_TENANT_MAX_IN_FLIGHT attempts in flight; not "
                                       "attempts (the retry schedule does not count them)")
    attempts: list[DeliveryAttempt]


class DeliveryList(BaseModel):
    data: list[Delivery]
    count: int


ChildJob.model_rebuild()
