"""The tables: every fact an auditor needs about a job and each of its steps."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Column, Field, SQLModel

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


class JobStatus:
    QUEUED = "queued"
    PLANNING = "planning"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TERMINAL = (SUCCEEDED, FAILED, CANCELLED)


class StepStatus:
    PENDING = "pending"  # waiting for its dependencies
    QUEUED = "queued"  # dependencies done, message sent to the broker
    RUNNING = "running"  # claimed by a worker (or waiting on its child job)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # never ran because the job failed first
    CANCELLED = "cancelled"
    DONE = (SUCCEEDED, FAILED, SKIPPED, CANCELLED)


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_key"

    id: str = Field(default_factory=new_id, primary_key=True)
    tenant: str = Field(index=True, max_length=128)
    prefix: str = Field(max_length=16, index=True)
    key_hash: str = Field(max_length=128, unique=True)
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    revoked_at: datetime | None = _ts()


class Job(SQLModel, table=True):
    __tablename__ = "job"
    __table_args__ = (
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_job_tenant_idempotency_key"),
        sa.Index("ix_job_status_updated", "status", "updated_at"),
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
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    calls: int = 0
    limits: dict[str, Any] = _json(dict, nullable=False)
    meta: dict[str, Any] = Field(default_factory=dict, sa_column=Column("metadata", JSONType, nullable=False))
    webhook_url: str | None = Field(default=None, max_length=2048)
    idempotency_key: str | None = Field(default=None, max_length=255)
    request_hash: str | None = Field(default=None, max_length=64)
    cancel_requested: bool = False
    created_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    updated_at: datetime = Field(default_factory=utcnow, sa_column=Column(UTCDateTime()))
    enqueued_at: datetime | None = _ts()
    """When the plan message reached the broker; NULL means the outbox still owes it."""
    started_at: datetime | None = _ts()
    planned_at: datetime | None = _ts()
    finished_at: datetime | None = _ts()


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
    latency_ms: int | None = None
    attempts: int = 0
    error_type: str | None = Field(default=None, max_length=64)
    error: str | None = Field(default=None, sa_column=Column(sa.Text))
    celery_task_id: str | None = Field(default=None, max_length=64)
    resends: int = 0
    """How often the reconciler re-sent this step's message (it backs off exponentially)."""
    child_job_id: str | None = Field(default=None, max_length=32)
    lease_owner: str | None = Field(default=None, max_length=128)
    lease_expires_at: datetime | None = _ts()
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
