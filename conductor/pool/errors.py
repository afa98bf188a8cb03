"""Typed provider errors: whether to retry depends on the type, never on parsing a message."""

from __future__ import annotations


class ProviderError(Exception):
    """Any failure talking to a model provider."""

    retryable: bool = False

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class RetryableError(ProviderError):
    """Worth another attempt after a backoff."""

    retryable = True


class RateLimited(RetryableError):
    """HTTP 429; ``retry_after`` (seconds) is the provider's own hint when it sent one."""

    def __init__(self, message: str, *, retry_after: float | None = None, status: int | None = 429):
        super().__init__(message, status=status)
        self.retry_after = retry_after


class ProviderTimeout(RetryableError):
    """The request did not complete in time (connect or read)."""


class ServerError(RetryableError):
    """HTTP 5xx, a dropped connection or a malformed response body."""


class FatalError(ProviderError):
    """Retrying cannot help: fix the request, the key or the pool file."""


class BadRequest(FatalError):
    """HTTP 400/404/422: the request (model name, parameters, context length) is wrong."""


class AuthError(FatalError):
    """HTTP 401/403 or a missing API key."""


class ConfigError(FatalError):
    """The pool entry cannot be used as configured (unknown provider, missing package)."""
