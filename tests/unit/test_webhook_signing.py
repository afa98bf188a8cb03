"""Signatures made here verify with the ``standardwebhooks`` reference library, used unchanged."""

from __future__ import annotations

import json
import time

import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from conductor.webhooks.deliver import _retry_after, event_body
from conductor.webhooks.signing import headers, new_secret


def test_a_signed_body_verifies_with_the_standardwebhooks_library() -> None:
    secret = new_secret()
    body = event_body("job.succeeded", {"id": "j1", "answer": "42 ✓"}, None).encode()
    signed = headers(secret, "msg_1", int(time.time()), body)
    assert signed["webhook-signature"].startswith("v1,")
    assert Webhook(secret).verify(body, signed) == json.loads(body)


def test_another_secret_or_a_changed_body_does_not_verify() -> None:
    secret = new_secret()
    body = b'{"type":"job.failed"}'
    signed = headers(secret, "msg_2", int(time.time()), body)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, signed)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(b'{"type":"job.succeeded"}', signed)


def test_during_a_rotation_receivers_holding_either_secret_verify() -> None:
    new, previous = new_secret(), new_secret()
    body = b'{"type":"job.succeeded"}'
    signed = headers(new, "msg_3", int(time.time()), body, also=[previous])
    assert len(signed["webhook-signature"].split(" ")) == 2
    for secret in (new, previous):
        assert Webhook(secret).verify(body, signed) == json.loads(body)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, signed)


def test_secrets_are_whsec_and_random() -> None:
    a, b = new_secret(), new_secret()
    assert a.startswith("whsec_") and a != b


def test_retry_after_accepts_seconds_and_http_dates() -> None:
    assert _retry_after("120") == 120.0
    assert _retry_after(None) is None and _retry_after("soon") is None
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: no extra wait
    # headers are read as latin-1, where "²" and "¹" are digits to str.isdigit() but not to float(): the
    # ValueError left the attempt unsettled, re-sent after every lease for ever, even after a 200
    for value in ("\xb2", "1\xb9", "\xb3\xb3"):
        assert _retry_after(value) is None
