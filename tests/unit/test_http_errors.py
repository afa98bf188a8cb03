"""The one place that decides which HTTP outcome is retryable and how long a 429 asks us to wait."""

from __future__ import annotations

import email.utils

import pytest

from conductor.pool.errors import AuthError, BadRequest, ProviderTimeout, RateLimited, ServerError
from conductor.pool.http_errors import error_for_status, parse_retry_after, scrub

NOW = 1_800_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": " 2.5 "}, 2.5),
        ({"retry-after": email.utils.formatdate(NOW + 30, usegmt=True)}, 30.0),
        ({"retry-after": email.utils.formatdate(NOW - 30, usegmt=True)}, 0.0),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after": "soon"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str] | None, expected: float | None) -> None:
    assert parse_retry_after(headers, now=NOW) == expected


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, BadRequest),
        (404, BadRequest),
        (413, BadRequest),
        (422, BadRequest),
        (401, AuthError),
        (403, AuthError),
        (408, ProviderTimeout),
        (429, RateLimited),
        (500, ServerError),
        (502, ServerError),
        (529, ServerError),
    ],
)
def test_status_to_type(status: int, expected: type) -> None:
    err = error_for_status(status, "detail", where="openai agent 'a'")
    assert type(err) is expected
    assert err.status == status
    assert str(err) == f"openai agent 'a': HTTP {status}: detail"


def test_header_beats_a_body_hint_and_the_body_hint_fills_in() -> None:
    with_header = error_for_status(429, "x", where="w", headers={"retry-after": "3"}, fallback_retry_after=9)
    without = error_for_status(429, "x", where="w", headers={}, fallback_retry_after=9)
    assert isinstance(with_header, RateLimited) and with_header.retry_after == 3
    assert isinstance(without, RateLimited) and without.retry_after == 9


def test_scrub_removes_the_secret_and_bounds_the_length() -> None:
    text = scrub("key sk-123 rejected " + "x" * 1000, "sk-123")
    assert "sk-123" not in text
    assert "[redacted]" in text
    assert len(text) < 400
