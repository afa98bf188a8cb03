"""Standard Webhooks signatures: ``v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`` under the
tenant's ``whsec_<base64 key>`` secret, exactly as the ``standardwebhooks`` verifiers expect."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Sequence

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # the spec asks for 24-64 random bytes


class BadSecret(ValueError):
    """A stored secret that is not ``whsec_`` + base64."""


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def _key(secret: str) -> bytes:
    if not secret.startswith(SECRET_PREFIX):
        raise BadSecret("a webhook secret starts with 'whsec_'")
    try:
        return base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
    except ValueError as exc:
        raise BadSecret("a webhook secret is 'whsec_' followed by base64") from exc


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    signed = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def headers(secret: str, msg_id: str, timestamp: int, body: bytes, *, also: Sequence[str] = ()) -> dict[str, str]:
    """The three Standard Webhooks headers. ``also``: more secrets that sign too (the one a rotation
    replaced, while it lasts): the signatures are space-separated, and a verifier accepts any that matches."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(s, msg_id, timestamp, body) for s in (secret, *also)),
    }
