"""The tables: every fact an auditor needs about a job and each of its steps."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from enum import StrEnum, nonmember
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Column, Field, SQLModel

from conductor.statuses import JobStatus as JobStatus  # re-exported: the store's callers import it here
from conductor.statuses import StepStatus as StepStatus

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timestamps are UTC everywhere. Postgres keeps the zone; SQLite (embedded mode) drops it, so values
    read back get UTC attached, and naive values are refused on write rather than guessed."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime: store timezone-aware UTC timestamps (use utcnow())")
        return value

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


def _ts(nullable: bool = True) -> Any:
    return Field(default=None, sa_column=Column(UTCDateTime(), nullable=nullable))


def _json(default: Any = None, nullable: bool = True) -> Any:
    if default is None:
        return Field(default=None, sa_column=Column(JSONType, nullable=nullable))
    return Field(default_factory=default, sa_column=Column(JSONType, nullable=nullable))


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_key"

    id: str = Field(default_factory=new_id, primary_key=True)
    tenant: str = Field(index=True, max_length=128)
    prefix: str = Field(max_length=16, index=True)
    key_hash: str = Field(max_length=128, unique=True)
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    revoked_at: datetime | None = _ts()


class UiSession(SQLModel, table=True):
    """A browser's sign-in to the trace viewer: only a keyed hash of its random token is stored (as for
    API keys), so the table cannot be turned into working cookies. Ends at ``expires_at``, at logout, or
    when its key is revoked."""

    __tablename__ = "ui_session"

    token_hash: str = Field(primary_key=True, max_length=64)
    key_id: str = Field(index=True, max_length=32)
    tenant: str = Field(max_length=128)
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    expires_at: datetime = _ts(nullable=False)


IN_FLIGHT_SQL = "parent_job_id IS NULL AND status IN ('queued', 'planning', 'running')"
"""A top-level job that has not ended, as SQL with literal statuses: a partial index serves a query only
when the planner can match its predicate, which a bound parameter would prevent."""
LIVE_IN_FLIGHT_SQL = IN_FLIGHT_SQL + " AND batch_id IS NULL"
"""What the tenant's jobs-in-flight quota counts: unfinished top-level jobs that are not a batch's lines (a
batch is bounded by its own quota, ``tenant_max_batch_jobs_in_flight``, so it never holds up the tenant's live
submissions). Kept on Postgres by the triggers of migration 0020; counted elsewhere (the partial index of
``IN_FLIGHT_SQL`` serves it: the predicate implies the index's)."""
QUEUED_SQL = "status = 'queued'"
"""A job waiting for its planner, as SQL with a literal status (a partial index's predicate, as above)."""
TOP_LEVEL_SQL = "parent_job_id IS NULL"
"""A job of its own, not a recursive step's child: what ``GET /v1/jobs`` lists."""
NOT_ROLLED_UP_SQL = "metrics_rolled_up_at IS NULL"
"""A job or webhook delivery whose numbers are not yet in ``metrics_rollup`` (``conductor.store.metrics``):
what a scrape still aggregates row by row, found by a partial index of that predicate."""
PENDING_DELIVERY_SQL = "status = 'pending'"
"""A webhook delivery not yet settled: its tenant's attempts in flight and deliveries waiting are counted
among these (``store.webhooks.claim_delivery``)."""
PARKED_DELIVERY_SQL = "status = 'pending' AND parked_at IS NOT NULL"
"""A webhook delivery waiting in its tenant's line (``store.webhooks.wake_next_parked``)."""


class Job(SQLModel, table=True):
    __tablename__ = "job"
    __table_args__ = (
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_job_tenant_idempotency_key"),
        sa.Index("ix_job_status_updated", "status", "updated_at"),
        sa.Index("ix_job_tenant_created_id", "tenant", "created_at", "id"),  # GET /v1/jobs pages by these
        # The per-tenant in-flight quota counts these under its lock: only unfinished top-level jobs are in
        # the index, so the count does not grow with a tenant's history.
        sa.Index("ix_job_tenant_in_flight", "tenant", postgresql_where=sa.text(IN_FLIGHT_SQL),
                 sqlite_where=sa.text(IN_FLIGHT_SQL)),
        # A batch's counts (one per status) and whether it has a job still running (migration 0017)
        sa.Index("ix_job_batch_status", "batch_id", "status"),
        # GET /v1/jobs?status=…: a status's own range, newest first, so a rare one does not walk the tenant
        sa.Index("ix_job_tenant_status_created", "tenant", "status", "created_at", "id",
                 postgresql_where=sa.text(TOP_LEVEL_SQL), sqlite_where=sa.text(TOP_LEVEL_SQL)),
        # GET /v1/jobs?meta_key=…[&meta_value=…] on Postgres (`?`, `@>`); SQLite has no such index
        sa.Index("ix_job_metadata", "metadata", postgresql_using="gin").ddl_if(dialect="postgresql"),
        # The reconciler's queued jobs never sent (enqueued_at NULL) and sent longest ago, without reading
        # or sorting the whole queued backlog each pass
        sa.Index("ix_job_queued", "enqueued_at", "created_at", postgresql_where=sa.text(QUEUED_SQL),
                 sqlite_where=sa.text(QUEUED_SQL)),
        # A scrape aggregates only the jobs not yet rolled up (unfinished, or ended recently), and the rollup
        # takes the oldest ended ones first: neither reads the rest of the history.
        sa.Index("ix_job_metrics_unrolled", "finished_at", postgresql_where=sa.text(NOT_ROLLED_UP_SQL),
                 sqlite_where=sa.text(NOT_ROLLED_UP_SQL)),
    )

    id: str = Field(default_factory=new_id, primary_key=True)
    tenant: str = Field(index=True, max_length=128)
    status: str = Field(default=JobStatus.QUEUED, max_length=16)
    task: str = Field(sa_column=Column(sa.Text, nullable=False))
    pool: str = Field(max_length=128)
    pool_config: dict[str, Any] = _json(dict, nullable=False)
    """Snapshot of the pool at submit time (no secrets: only env var names), so the run and any replay
    use exactly the agents, prices and limits the job was accepted with."""
    planner: str = Field(max_length=128)
    depth: int = 0
    parent_job_id: str | None = Field(default=None, foreign_key="job.id", index=True)
    parent_step_index: int | None = None
    root_job_id: str | None = Field(default=None, index=True)
    context: list[dict[str, Any]] | None = _json()
    """For a child job: the (subtask, answer) turns its parent step could see."""
    request_workflow: dict[str, Any] | None = _json()
    workflow_source: str | None = Field(default=None, max_length=16)
    format_valid: bool | None = None
    planner_raw: str | None = Field(default=None, sa_column=Column(sa.Text))
    planner_error: str | None = Field(default=None, sa_column=Column(sa.Text))
    planner_attempts: int = 0
    plan_claims: int = 0
    plan_resends: int = 0
    """How often the reconciler re-sent this job's plan message (it backs off exponentially)."""
    """How many times a planner worker took this job: a fencing token for planning (a worker whose
    claim was superseded records nothing) and the cap on re-driving a planning that keeps dying."""
    answer: str | None = Field(default=None, sa_column=Column(sa.Text))
    error_type: str | None = Field(default=None, max_length=64)
    error_message: str | None = Field(default=None, sa_column=Column(sa.Text))
    error_step: int | None = None
    planner_input_tokens: int = 0
    planner_output_tokens: int = 0
    planner_cost_usd: float = 0.0
    planner_calls: int = 0
    planner_cached_input_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    planner_reasoning_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    planner_cache_write_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    calls: int = 0
    cached_input_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Of ``input_tokens``, those read from the providers' prompt caches (the planner's too)."""
    reasoning_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Of ``output_tokens``, the models' reasoning (the planner's too)."""
    cache_write_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Of ``input_tokens``, those written to the providers' prompt caches (the planner's too)."""
    limits: dict[str, Any] = _json(dict, nullable=False)
    meta: dict[str, Any] = Field(default_factory=dict, sa_column=Column("metadata", JSONType, nullable=False))
    webhook_url: str | None = Field(default=None, max_length=2048)
    webhook_url_from_default: bool | None = None
    """True when ``webhook_url`` is the tenant's default (the request named none): a replay then sends to
    the default as it is at the replay. None otherwise (left out of the insert)."""
    idempotency_key: str | None = Field(default=None, max_length=255)
    request_hash: str | None = Field(default=None, max_length=64)
    cancel_requested: bool = False
    batch_id: str | None = Field(default=None, max_length=64)
    """The batch this job is a line of (``POST /v1/batches``), if any (indexed by ``ix_job_batch_status``)."""
    eval_run: str | None = Field(default=None, max_length=64, index=True)
    """The ``conductor eval`` / ``export-rollouts`` run that submitted this job (details in metadata)."""
    reward: float | None = None
    """Its GRPO reward once scored: 0 unparseable workflow, 0.5 valid workflow but wrong answer, 1 correct."""
    replay_of: str | None = Field(default=None, foreign_key="job.id", index=True)
    """The job this one replays (``POST /v1/jobs/{id}/replay``)."""
    replay_from_step: int | None = None
    """Steps that do not depend on this one (and are unchanged) reuse the original's outputs; None
    re-runs every step."""
    replay_agents: dict[str, str] | None = _json()
    """Step index (as text) -> agent: the replay's overrides of the workflow's agents."""
    replay_replan: bool = False
    """Whether the replay asked the planner again instead of reusing the original workflow."""
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    enqueued_at: datetime | None = _ts()
    """When the plan message reached the broker; NULL means the outbox still owes it."""
    started_at: datetime | None = _ts()
    planned_at: datetime | None = _ts()
    finished_at: datetime | None = _ts()
    metrics_rolled_up_at: datetime | None = _ts()
    """When this job's numbers (and its steps' and attempts') were added to ``metrics_rollup``: set once,
    in the same transaction, long enough after the job ended that nothing writes to those rows any more."""


class Step(SQLModel, table=True):
    __tablename__ = "step"
    __table_args__ = (
        sa.UniqueConstraint("job_id", "index", name="uq_step_job_index"),
        sa.Index("ix_step_status_queued", "status", "queued_at"),
    )

    id: int | None = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="job.id", index=True)
    index: int
    agent: str = Field(max_length=128)
    instruction: str = Field(sa_column=Column(sa.Text, nullable=False))
    access_list: list[int] = _json(list, nullable=False)
    """Resolved: ``"all"`` is stored as the explicit indices."""
    access_all: bool = False
    status: str = Field(default=StepStatus.PENDING, max_length=16)
    provider: str | None = Field(default=None, max_length=32)
    model: str | None = Field(default=None, max_length=256)
    messages: list[dict[str, Any]] | None = _json()
    output: str | None = Field(default=None, sa_column=Column(sa.Text))
    finish_reason: str | None = Field(default=None, max_length=64)
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    cached_input_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Of ``input_tokens``, those read from the provider's prompt cache (priced at the agent's cached price)."""
    reasoning_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Of ``output_tokens``, the model's reasoning."""
    cache_write_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Of ``input_tokens``, those written to the provider's prompt cache (priced at the agent's write price)."""
    latency_ms: int | None = None
    attempts: int = 0
    error_type: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, sa_column=Column(sa.Text))
    celery_task_id: str | None = Field(default=None, max_length=64)
    reserved_usd: float = Field(default=0.0, sa_column_kwargs={"server_default": "0"})
    reserved_tokens: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """What this step may still spend, held against the job's budgets from its claim until its outcome
    is recorded (a recursive step: its child job's whole allowance). Zero once the step has ended."""
    resends: int = 0
    """How often the reconciler re-sent this step's message (it backs off exponentially)."""
    child_job_id: str | None = Field(default=None, max_length=32)
    reused_from: int | None = Field(default=None, foreign_key="step.id")
    """A replayed step that did not run again: the original step whose messages and output it copies."""
    lease_owner: str | None = Field(default=None, max_length=128)
    lease_expires_at: datetime | None = _ts()
    resent_at: datetime | None = _ts()
    """When the reconciler last re-sent this step after its lease expired (a dead worker's step): the first
    re-send after an expiry goes at once, later ones back off like a queued step's (``resends``)."""
    queued_at: datetime | None = _ts()
    started_at: datetime | None = _ts()
    finished_at: datetime | None = _ts()


class StepAttempt(SQLModel, table=True):
    __tablename__ = "step_attempt"
    __table_args__ = (sa.UniqueConstraint("step_id", "n", name="uq_attempt_step_n"),)

    id: int | None = Field(default=None, primary_key=True)
    step_id: int = Field(foreign_key="step.id", index=True)
    n: int
    worker: str | None = Field(default=None, max_length=128)
    started_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    finished_at: datetime | None = _ts()
    latency_ms: int | None = None
    error_type: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, sa_column=Column(sa.Text))


class StoredFile(SQLModel, table=True):
    """A file of the OpenAI-compatible Files API: a batch's input (validated JSONL) or its output/errors."""

    __tablename__ = "stored_file"
    __table_args__ = (sa.Index("ix_stored_file_tenant_created_id", "tenant", "created_at", "id"),)  # listing

    id: str = Field(primary_key=True, max_length=64)
    tenant: str = Field(index=True, max_length=128)
    purpose: str = Field(max_length=32)
    filename: str = Field(max_length=255)
    size_bytes: int
    lines: int = 0
    content: bytes = Field(sa_column=Column(sa.LargeBinary, nullable=False))
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))


class DeletedFile(SQLModel, table=True):
    """Where a deleted file stood in its tenant's list of files, kept ``DELETED_FILE_KEPT_S`` (7 days): a
    list paged with it as the cursor (a client deleting files as it pages through them, as the SDK's
    auto-paging does) goes on from there instead of ending early."""

    __tablename__ = "deleted_file"
    __table_args__ = (sa.Index("ix_deleted_file_deleted_at", "deleted_at"),)

    id: str = Field(primary_key=True, max_length=64)
    tenant: str = Field(max_length=128)
    created_at: datetime = _ts(nullable=False)
    deleted_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))


class BatchStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    CANCELLING = "cancelling"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    OPEN = nonmember(frozenset({"in_progress", "cancelling"}))
    """Still waiting for jobs; the others are final."""


class Batch(SQLModel, table=True):
    """One job per input line; when every job has ended its output and error files are written."""

    __tablename__ = "batch"
    __table_args__ = (
        sa.Index("ix_batch_status", "status"),
        sa.Index("ix_batch_tenant_created_id", "tenant", "created_at", "id"),  # GET /v1/batches pages by these
    )

    id: str = Field(primary_key=True, max_length=64)
    tenant: str = Field(index=True, max_length=128)
    status: str = Field(default=BatchStatus.IN_PROGRESS, max_length=16)
    endpoint: str = Field(max_length=64)
    input_file_id: str = Field(max_length=64)
    completion_window: str = Field(max_length=16)
    meta: dict[str, Any] | None = Field(default=None, sa_column=Column("metadata", JSONType, nullable=True))
    total: int = 0
    output_file_id: str | None = Field(default=None, max_length=64)
    error_file_id: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    in_progress_at: datetime | None = _ts()
    expires_at: datetime | None = _ts()
    finalizing_at: datetime | None = _ts()
    completed_at: datetime | None = _ts()
    expired_at: datetime | None = _ts()
    cancelling_at: datetime | None = _ts()
    cancelled_at: datetime | None = _ts()
    usage: dict[str, int] | None = _json()
    """Its jobs' tokens (``BATCH_USAGE``), summed when it ended; None before."""


class BatchRequest(SQLModel, table=True):
    """One line of a batch's input: the job it became, or why it could not become one."""

    __tablename__ = "batch_request"
    __table_args__ = (
        sa.UniqueConstraint("batch_id", "line", name="uq_batch_request_line"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_request_custom_id"),
    )

    id: int | None = Field(default=None, primary_key=True)
    batch_id: str = Field(foreign_key="batch.id", index=True, max_length=64)
    line: int
    custom_id: str = Field(max_length=512)
    job_id: str | None = Field(default=None, foreign_key="job.id", index=True)
    error_code: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, sa_column=Column(sa.Text))


class OpenAIResponse(SQLModel, table=True):
    """A job created through ``POST /v1/responses`` (OpenAI's Responses API): what that API echoes on every
    read of the response and the job does not hold. The response's id is the job's."""

    __tablename__ = "openai_response"

    job_id: str = Field(foreign_key="job.id", primary_key=True)
    model: str = Field(max_length=256)
    """As the request named it: ``conductor`` or ``conductor/<planner>``."""
    background: bool
    instructions: bool
    """Whether the request had ``instructions``: they are then the first message of the job's ``context``."""
    previous_response_id: str | None = Field(default=None, max_length=64)
    """The response this one continues (``previous_response_id``): its input and answer lead this job's
    context (after the instructions). Not a foreign key: adding one would lock ``job`` (0022)."""


class TenantSettings(SQLModel, table=True):
    """Per-tenant settings the operator manages with ``conductor webhooks``."""

    __tablename__ = "tenant_settings"

    tenant: str = Field(primary_key=True, max_length=128)
    webhook_url: str | None = Field(default=None, max_length=2048)
    """Used for every job of the tenant that names no ``webhook_url`` of its own."""
    webhook_secret: str | None = Field(default=None, max_length=512, repr=False)
    """The ``whsec_…`` signing secret. Kept so workers can sign; never logged or shown in traces. Sealed
    with ``CONDUCTOR_SECRETS_KEY`` when it is set (``fernet:…``, about 170 characters)."""
    secret_created_at: datetime | None = _ts()
    previous_webhook_secret: str | None = Field(default=None, max_length=512, repr=False)
    """The secret a rotation replaced, stored like ``webhook_secret``: it signs too (a second signature)
    until ``previous_secret_expires_at``, so receivers switch without rejecting a delivery."""
    previous_secret_expires_at: datetime | None = _ts()
    updated_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))


class WebhookEndpoint(SQLModel, table=True):
    """A tenant's webhook URL that answered 410 Gone: nothing more is sent to it until re-enabled."""

    __tablename__ = "webhook_endpoint"

    tenant: str = Field(primary_key=True, max_length=128)
    url_hash: str = Field(primary_key=True, max_length=64)
    url: str = Field(max_length=2048)
    disabled_at: datetime | None = _ts()
    disabled_reason: str | None = Field(default=None, sa_column=Column(sa.Text))


class DeliveryStatus(StrEnum):
    PENDING = "pending"  # an attempt is due now or after its backoff
    DELIVERED = "delivered"  # a 2xx answer
    FAILED = "failed"  # every scheduled retry failed, or the target is refused
    DISABLED = "disabled"  # the endpoint answered 410 (now or for an earlier delivery)


class WebhookDelivery(SQLModel, table=True):
    """One event owed to a webhook: written in the transaction that ends the job (an outbox row), so an
    ended job's webhook cannot be lost between the commit and the send. Its id is the ``webhook-id``
    every retry repeats."""

    __tablename__ = "webhook_delivery"
    __table_args__ = (
        sa.Index("ix_webhook_delivery_status_next", "status", "next_attempt_at"),
        sa.Index("ix_webhook_delivery_metrics_unrolled", "finished_at", postgresql_where=sa.text(NOT_ROLLED_UP_SQL),
                 sqlite_where=sa.text(NOT_ROLLED_UP_SQL)),
        # a claim counts its tenant's attempts in flight and deliveries waiting (store.webhooks.claim_delivery)
        sa.Index("ix_webhook_delivery_pending_tenant", "tenant", "lease_expires_at", "next_attempt_at",
                 postgresql_where=sa.text(PENDING_DELIVERY_SQL), sqlite_where=sa.text(PENDING_DELIVERY_SQL)),
        # the oldest of a tenant's parked deliveries, woken when one of its attempts ends
        sa.Index("ix_webhook_delivery_parked", "tenant", "created_at",
                 postgresql_where=sa.text(PARKED_DELIVERY_SQL), sqlite_where=sa.text(PARKED_DELIVERY_SQL)),
    )

    id: str = Field(primary_key=True, max_length=40)
    job_id: str = Field(foreign_key="job.id", unique=True, max_length=32)
    tenant: str = Field(index=True, max_length=128)
    url: str = Field(max_length=2048)
    event_type: str = Field(max_length=32)
    payload: str | None = Field(default=None, sa_column=Column(sa.Text))
    """The exact body sent, frozen at the first attempt so every retry carries the same bytes."""
    status: str = Field(default=DeliveryStatus.PENDING, max_length=16)
    attempts: int = 0
    next_attempt_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime(), nullable=False))
    lease_expires_at: datetime | None = _ts()
    """Set while an attempt is in flight: a duplicate message meanwhile sends nothing."""
    sent_at: datetime | None = _ts()
    """When the message for the next attempt is due at a worker; NULL means none was sent (the
    reconciler sends it when the attempt is due)."""
    resends: int = 0
    deferrals: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    """Times a due attempt was put off, not made, because the tenant already had its most attempts in
    flight (``webhook_tenant_max_in_flight``); not attempts: the backoff schedule does not count them."""
    parked_at: datetime | None = _ts()
    """Set while the delivery waits in its tenant's line, put off for the tenant's cap: when one of the
    tenant's attempts ends, the oldest parked delivery (by ``created_at``) is woken and sent. Cleared by the
    claim that makes its attempt."""
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    finished_at: datetime | None = _ts()
    metrics_rolled_up_at: datetime | None = _ts()
    """When this delivery and its attempts were added to ``metrics_rollup`` (as for ``Job``)."""


LATENCY_BUCKETS_S: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Step latency histogram buckets, in seconds (provider calls run from tens of milliseconds to minutes). The
rollup keeps one count per bucket (``metrics_rollup.le_…``): changing them needs a migration."""


def latency_bucket_column(bound_s: float) -> str:
    """``metrics_rollup``'s column counting latencies <= ``bound_s``: ``le_50ms`` … ``le_600000ms``."""
    return f"le_{round(bound_s * 1000)}ms"


METRICS_ROLLUP = sa.Table(
    "metrics_rollup",
    SQLModel.metadata,
    # One row per (tenant, series, labels): the sums of every job, step, attempt, delivery and webhook
    # attempt already folded in (conductor.store.metrics). A scrape adds the rows not yet folded.
    sa.Column("tenant", sa.String(128), primary_key=True),
    # 'job' (label_a status, label_b planner), 'step' (agent, status), 'attempt' (agent, outcome), 'webhook'
    # (status, '') or 'webhook_attempt' (outcome, '').
    sa.Column("series", sa.String(16), primary_key=True),
    sa.Column("label_a", sa.String(128), primary_key=True),
    sa.Column("label_b", sa.String(128), primary_key=True),
    sa.Column("n", sa.BigInteger(), nullable=False),
    sa.Column("input_tokens", sa.BigInteger(), nullable=False),
    sa.Column("output_tokens", sa.BigInteger(), nullable=False),
    sa.Column("cost_usd", sa.Float(), nullable=False),
    sa.Column("cached_input_tokens", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Column("reasoning_tokens", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Column("cache_write_tokens", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Column("retries", sa.BigInteger(), nullable=False),
    sa.Column("resends", sa.BigInteger(), nullable=False),
    sa.Column("redrives", sa.BigInteger(), nullable=False),
    sa.Column("latency_count", sa.BigInteger(), nullable=False),
    sa.Column("latency_ms", sa.BigInteger(), nullable=False),
    *(sa.Column(latency_bucket_column(b), sa.BigInteger(), nullable=False) for b in LATENCY_BUCKETS_S),
)


class WebhookAttempt(SQLModel, table=True):
    __tablename__ = "webhook_attempt"
    __table_args__ = (sa.UniqueConstraint("delivery_id", "n", name="uq_webhook_attempt_delivery_n"),)

    id: int | None = Field(default=None, primary_key=True)
    delivery_id: str = Field(foreign_key="webhook_delivery.id", index=True, max_length=40)
    n: int
    started_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    finished_at: datetime | None = _ts()
    status_code: int | None = None
    latency_ms: int | None = None
    error: str | None = Field(default=None, sa_column=Column(sa.Text))
