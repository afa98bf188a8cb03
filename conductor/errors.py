"""The stored error types, and the base of the engine's own (domain) errors.

Every ``error_type`` written to a job, step or attempt row is an :class:`ErrorType` value: one
snake_case vocabulary a client can switch on, never a Python class name. Exceptions carry their type as
the class attribute ``error_type``; provider errors (``conductor.pool.errors``) and domain errors (here)
are separate hierarchies, and neither knows about HTTP: the service maps them to status codes.
"""

from __future__ import annotations

from enum import StrEnum


class Rejection(StrEnum):
    """Why a request was refused before anything was stored: the domain's words. Only ``conductor.service``
    maps them to HTTP status codes (``service/problems.py``)."""

    MALFORMED = "malformed"
    """The request itself cannot be read (a bad header, a file that is not JSONL)."""
    NOT_FOUND = "not_found"
    """It names something that does not exist (a model)."""
    CONFLICT = "conflict"
    """It does not fit the current state of what it names (replaying a job that has not ended)."""
    TOO_LARGE = "too_large"
    """It passes a size limit."""
    INVALID = "invalid"
    """It is well formed but asks for something this service refuses (unknown pool, invalid workflow)."""


class ErrorType(StrEnum):
    # the provider call failed
    PROVIDER_ERROR = "provider_error"  # any other provider failure
    PROVIDER_TIMEOUT = "provider_timeout"
    SERVER_ERROR = "server_error"  # provider HTTP 5xx, dropped connection, malformed body
    RATE_LIMITED = "rate_limited"  # provider HTTP 429
    RATE_LIMIT_TIMEOUT = "rate_limit_timeout"  # our own per-agent limiter had no slot in time
    RATE_LIMITER_UNAVAILABLE = "rate_limiter_unavailable"
    BAD_REQUEST = "bad_request"
    AUTH_ERROR = "auth_error"
    QUOTA_EXHAUSTED = "provider_quota_exhausted"  # a 429 meaning the account is out of quota or credit
    CONFIG_ERROR = "config_error"
    # the job's own limits
    BUDGET_EXCEEDED = "budget_exceeded"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    QUOTA_EXCEEDED = "quota_exceeded"  # the tenant's quota (e.g. steps per job tree) left no room
    # execution
    WORKER_LOST = "worker_lost"  # an attempt (or a planning) whose worker died mid-way
    STEP_ABANDONED = "step_abandoned"  # a step re-claimed more often than the attempt limit allows
    STEP_FAILED = "step_failed"  # a failed step recorded without a type of its own
    CHILD_JOB_FAILED = "child_job_failed"
    INTERNAL_ERROR = "internal_error"
    # planning
    PLANNER_ERROR = "planner_error"
    INVALID_WORKFLOW = "invalid_workflow"
    # by request
    CANCELLED = "cancelled"


LEGACY_ERROR_TYPES: dict[str, ErrorType] = {
    "ProviderError": ErrorType.PROVIDER_ERROR,
    "RetryableError": ErrorType.PROVIDER_ERROR,
    "FatalError": ErrorType.PROVIDER_ERROR,
    "ProviderTimeout": ErrorType.PROVIDER_TIMEOUT,
    "ServerError": ErrorType.SERVER_ERROR,
    "RateLimited": ErrorType.RATE_LIMITED,
    "RateLimitTimeout": ErrorType.RATE_LIMIT_TIMEOUT,
    "RateLimiterUnavailable": ErrorType.RATE_LIMITER_UNAVAILABLE,
    "BadRequest": ErrorType.BAD_REQUEST,
    "AuthError": ErrorType.AUTH_ERROR,
    "ConfigError": ErrorType.CONFIG_ERROR,
    "BudgetExceeded": ErrorType.BUDGET_EXCEEDED,
    "DeadlineExceeded": ErrorType.DEADLINE_EXCEEDED,
    "WorkerLost": ErrorType.WORKER_LOST,
    "StepAbandoned": ErrorType.STEP_ABANDONED,
    "InternalError": ErrorType.INTERNAL_ERROR,
}
"""What releases before the ErrorType vocabulary stored (Python class names), for the data migration."""


class ConductorError(Exception):
    """A failure of the job itself rather than of a provider: its limits, its workers, a bug.

    ``retryable`` is False: another attempt at the same call cannot help.
    """

    error_type: ErrorType = ErrorType.INTERNAL_ERROR
    retryable = False


class BudgetExceeded(ConductorError):
    """The job's max_tokens or max_cost_usd leaves no room for this step."""

    error_type = ErrorType.BUDGET_EXCEEDED


class DeadlineExceeded(ConductorError):
    """The job's deadline_s has passed (or would, before another attempt could start)."""

    error_type = ErrorType.DEADLINE_EXCEEDED


class StepAbandoned(ConductorError):
    """The step's worker died mid-call more often than the attempt limit allows."""

    error_type = ErrorType.STEP_ABANDONED


class InternalError(ConductorError):
    """An unexpected exception around a provider call: a bug, recorded instead of looping."""

    error_type = ErrorType.INTERNAL_ERROR
