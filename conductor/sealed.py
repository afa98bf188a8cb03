"""Secrets the service must read back (webhook signing secrets: it signs with them) are stored sealed
with ``CONDUCTOR_SECRETS_KEY`` (Fernet: AES-128-CBC with HMAC-SHA256), so a leaked database or backup
does not let anyone forge webhooks. Several comma-separated keys rotate: the first seals, any opens.

Without a key, values are stored as given (the service warns at start). A value stored before a key was
set still opens (it has no ``SEALED_PREFIX``); it is sealed, as is one sealed with a key that is no longer
the first, the next time it is read for a delivery or by ``conductor webhooks reseal``.

Rotating: add the new key *second* on every process; then put it first everywhere; run ``conductor
webhooks reseal`` (or let deliveries re-seal); then drop the old key."""

from __future__ import annotations

from functools import lru_cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from conductor.settings import get_settings

SEALED_PREFIX = "fernet:"
SECRETS_KEY_WARNING = (
    "CONDUCTOR_SECRETS_KEY is empty: webhook signing secrets are stored in plaintext, so a leaked "
    "database signs webhooks. Set it to a Fernet key (python -c \"from cryptography.fernet import Fernet; "
    "print(Fernet.generate_key().decode())\") on the API and every worker"
)


class SealError(ValueError):
    """A sealed value that cannot be opened: the key is missing or not the one it was sealed with."""


@lru_cache(maxsize=4)
def _boxes(keys: str) -> tuple[MultiFernet, Fernet] | None:
    """Every key (to open) and the first (to seal); None without keys."""
    parts = [k.strip() for k in keys.split(",") if k.strip()]
    if not parts:
        return None
    try:
        each = [Fernet(k.encode()) for k in parts]
    except ValueError as exc:
        raise SealError("CONDUCTOR_SECRETS_KEY must be Fernet keys (32 url-safe base64 bytes each), "
                        "comma-separated") from exc
    return MultiFernet(each), each[0]


def _box(keys: str | None) -> MultiFernet | None:
    boxes = _boxes(get_settings().secrets_key if keys is None else keys)
    return None if boxes is None else boxes[0]


def seal(value: str, keys: str | None = None) -> str:
    box = _box(keys)
    return value if box is None else SEALED_PREFIX + box.encrypt(value.encode()).decode()


def needs_sealing(stored: str, keys: str | None = None) -> bool:
    """Whether ``stored`` should be written again: a key is set and the value is plaintext or sealed with
    a key other than the first (a rotation in progress)."""
    boxes = _boxes(get_settings().secrets_key if keys is None else keys)
    if boxes is None:
        return False
    if not stored.startswith(SEALED_PREFIX):
        return True
    try:
        boxes[1].decrypt(stored[len(SEALED_PREFIX):].encode())
    except InvalidToken:
        return True
    return False


def unseal(stored: str, keys: str | None = None) -> str:
    if not stored.startswith(SEALED_PREFIX):
        return stored  # stored before a key was set
    box = _box(keys)
    if box is None:
        raise SealError("a stored secret is sealed but CONDUCTOR_SECRETS_KEY is not set: set the key it was "
                        "sealed with on this process")
    try:
        return box.decrypt(stored[len(SEALED_PREFIX):].encode()).decode()
    except InvalidToken as exc:
        raise SealError("a stored secret does not open with CONDUCTOR_SECRETS_KEY: add the key it was sealed "
                        "with (keys are comma-separated; the first seals, any opens)") from exc
