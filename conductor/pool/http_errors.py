"""HTTP outcomes -> our typed provider errors; shared by every SDK-backed provider.

Each provider unpacks its own SDK's exception (status, headers, the server's message) and hands the
pieces here, so which status is retryable is decided in one place.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from conductor.pool.errors import (
    AuthError,
    BadRequest,
    ProviderError,
    ProviderTimeout,
    QuotaExhausted,
    RateLimited,
    ServerError,
)

MAX_DETAIL_CHARS = 300
QUOTA_CODES = frozenset({"insufficient_quota"})
"""Error codes a 429 carries when the account is out of quota or credit, not merely rate limited."""
REDACTED = "[redacted]"


def parse_retry_after(headers: Mapping[str, str] | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``retry-after`` (delta-seconds or an HTTP-date)."""
    if not headers:
        return None
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


def scrub(text: str, secret: str | None) -> str:
    """Removes the API key from a message a server or SDK produced, and keeps it short."""
    if secret:
        text = text.replace(secret, REDACTED)
    if len(text) > MAX_DETAIL_CHARS:
        text = text[:MAX_DETAIL_CHARS] + "..."
    return text


def error_for_status(
    status: int,
    detail: str,
    *,
    where: str,
    headers: Mapping[str, str] | None = None,
    fallback_retry_after: float | None = None,
    secret: str | None = None,
    code: str | None = None,
) -> ProviderError:
    """The typed error for an HTTP error status.

    A 429's wait comes from the ``retry-after`` headers, else from ``fallback_retry_after`` (a hint the
    provider put in the body).
    """
    message = f"{where}: HTTP {status}: {scrub(detail, secret) or 'no detail'}"
    if status == 429 and code in QUOTA_CODES:
        return QuotaExhausted(f"{message} (the account's quota is used up; not retried: check its plan and "
                              "billing, or use another key)", status=status)
    if status == 429:
        wait = parse_retry_after(headers)
        if wait is None:
            wait = fallback_retry_after
        return RateLimited(message, retry_after=wait, status=status)
    if status in (401, 403):
        return AuthError(message, status=status)
    if status == 408:
        return ProviderTimeout(message, status=status)
    if status >= 500:
        return ServerError(message, status=status)
    # 400, 404, 422 and the rest of 4xx: the request itself is wrong, so retrying cannot help.
    return BadRequest(message, status=status)


def timed_out(where: str, timeout_s: float) -> ProviderTimeout:
    return ProviderTimeout(f"{where}: no response within {timeout_s:g}s")


def connection_failed(where: str, detail: str, *, secret: str | None = None) -> ServerError:
    return ServerError(f"{where}: connection failed: {scrub(detail, secret)}")


def malformed_response(where: str, detail: str, *, secret: str | None = None) -> ServerError:
    """A 2xx whose body is not the shape the provider promises: retryable, the next reply may be fine."""
    return ServerError(f"{where}: malformed response body: {scrub(detail, secret)}")


def map_sdk_error(
    exc: Exception,
    sdk: ModuleType,
    *,
    where: str,
    timeout_s: float,
    secret: str | None,
    detail: Callable[[Any], str],
) -> ProviderError:
    """One mapping for the SDKs generated alike (``openai``, ``anthropic``): each exposes APITimeoutError,
    APIConnectionError, APIStatusError and APIResponseValidationError. ``detail`` extracts the server's
    own message from an APIStatusError (the body layouts differ)."""
    if isinstance(exc, sdk.APITimeoutError):  # before APIConnectionError: it is a subclass
        return timed_out(where, timeout_s)
    if isinstance(exc, sdk.APIConnectionError):
        return connection_failed(where, str(exc.__cause__ or exc), secret=secret)
    if isinstance(exc, sdk.APIStatusError):
        code = getattr(exc, "code", None)
        return error_for_status(
            exc.status_code, detail(exc), where=where, headers=exc.response.headers, secret=secret,
            code=code if isinstance(code, str) else None,
        )
    if isinstance(exc, sdk.APIResponseValidationError | json.JSONDecodeError):
        # JSONDecodeError: a 2xx that says JSON but is not (the SDK's json.loads raised).
        return malformed_response(where, f"{type(exc).__name__}: {exc}", secret=secret)
    if isinstance(exc, ValueError):
        return BadRequest(f"{where}: the SDK refused the request: {scrub(str(exc), secret)}")
    return ProviderError(f"{where}: {type(exc).__name__}: {scrub(str(exc), secret)}")
