"""Typed provider errors: whether to retry depends on the type, never on parsing a message.

Each carries the :class:`~conductor.errors.ErrorType` its attempt is stored under. The engine's own
failures (budgets, deadlines, lost workers) are ``conductor.errors.ConductorError``, not these.
"""

from __future__ import annotations

from conductor.errors import ErrorType
from conductor.pool.base import storable_escaped


class ProviderError(Exception):
    """Any failure talking to a model provider."""

    retryable: bool = False
    error_type: ErrorType = ErrorType.PROVIDER_ERROR

    def __init__(self, message: str, *, status: int | None = None):
        # stored as the attempt's (and a failed step's) error: a provider's error body may carry a NUL or
        # an unpaired surrogate, which failed that record and left the step to its lease
        super().__init__(storable_escaped(message))
        self.status = status


class RetryableError(ProviderError):
    """Worth another attempt after a backoff."""

    retryable = True


class RateLimited(RetryableError):
    """HTTP 429; ``retry_after`` (seconds) is the provider's own hint when it sent one."""

    error_type = ErrorType.RATE_LIMITED

    def __init__(self, message: str, *, retry_after: float | None = None, status: int | None = 429):
        super().__init__(message, status=status)
        self.retry_after = retry_after


class ProviderTimeout(RetryableError):
    """The request did not complete in time (connect or read)."""

    error_type = ErrorType.PROVIDER_TIMEOUT


class ServerError(RetryableError):
    """HTTP 5xx, a dropped connection or a malformed response body."""

    error_type = ErrorType.SERVER_ERROR


class FatalError(ProviderError):
    """Retrying cannot help: fix the request, the key or the pool file."""


class BadRequest(FatalError):
    """HTTP 400/404/422: the request (model name, parameters, context length) is wrong."""

    error_type = ErrorType.BAD_REQUEST


class AuthError(FatalError):
    """HTTP 401/403 or a missing API key."""

    error_type = ErrorType.AUTH_ERROR


class QuotaExhausted(FatalError):
    """A 429 that is not a rate limit: the account's quota or credit is used up (OpenAI's
    ``insufficient_quota``). Waiting does not refill it: fix the billing or the key."""

    error_type = ErrorType.QUOTA_EXHAUSTED


class ConfigError(FatalError):
    """The pool entry cannot be used as configured (unknown provider, missing package)."""

    error_type = ErrorType.CONFIG_ERROR
