"""Webhook signing-secret rotation on the store (SQLite): the replaced secret signs beside the new one
while it lasts, is sealed like the current one, and a secret no key opens never blocks a rotation."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

from conductor.settings import get_settings
from conductor.store import webhooks as store
from conductor.store.db import session_scope
from conductor.store.models import TenantSettings, utcnow
from conductor.webhooks.signing import new_secret
from tests.sqlite_store import sqlite_store

K1, K2 = Fernet.generate_key().decode(), Fernet.generate_key().decode()


@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    with sqlite_store(tmp_path, monkeypatch):
        yield monkeypatch


def use(monkeypatch: pytest.MonkeyPatch, keys: str) -> None:
    monkeypatch.setenv("CONDUCTOR_SECRETS_KEY", keys)
    get_settings.cache_clear()


def stored(tenant: str = "t") -> TenantSettings:
    with session_scope() as s:
        row = s.get(TenantSettings, tenant)
        assert row is not None
        return row


def test_a_rotation_keeps_the_replaced_secret_signing_sealed_until_it_expires(keys: pytest.MonkeyPatch) -> None:
    old, new = new_secret(), new_secret()
    with session_scope() as s:  # stored before any key was set: plaintext
        assert store.set_webhook_secret(s, tenant="t", secret=old) == "none"
    use(keys, K1)
    with session_scope() as s:
        assert store.set_webhook_secret(s, tenant="t", secret=new, keep_previous_s=3600) == "kept"
    row = stored()
    assert (row.previous_webhook_secret or "").startswith("fernet:")  # not left in plaintext beside the new one
    with session_scope() as s:
        assert store.previous_webhook_secret(s, tenant="t") == old
        until = store.previous_secret_expires_at(s, tenant="t")
        assert until is not None and timedelta(minutes=59) < until - utcnow() <= timedelta(hours=1)
    use(keys, f"{K2},{K1}")  # key rotation: delivering seals the replaced secret with the new first key too
    with session_scope() as s:
        assert store.previous_webhook_secret(s, tenant="t") == old
    use(keys, K2)
    with session_scope() as s:
        assert store.previous_webhook_secret(s, tenant="t") == old
        s.get(TenantSettings, "t").previous_secret_expires_at = utcnow() - timedelta(seconds=1)  # type: ignore[union-attr]
    with session_scope() as s:
        assert store.previous_webhook_secret(s, tenant="t") is None
        assert store.previous_secret_expires_at(s, tenant="t") is None


def test_a_secret_no_key_opens_is_replaced_not_kept(keys: pytest.MonkeyPatch) -> None:
    # reseal tells the operator to give such tenants new secrets with --rotate: that must work
    use(keys, K1)
    with session_scope() as s:
        store.set_webhook_secret(s, tenant="t", secret=new_secret())
    use(keys, K2)
    new = new_secret()
    with session_scope() as s:
        assert store.set_webhook_secret(s, tenant="t", secret=new, keep_previous_s=3600) == "unopenable"
        assert store.ensure_webhook_secret(s, tenant="t", new=new_secret()) == new
        assert store.previous_webhook_secret(s, tenant="t") is None
    assert stored().previous_webhook_secret is None


def test_reseal_leaves_a_replaced_secret_it_cannot_open_and_says_so(keys: pytest.MonkeyPatch) -> None:
    use(keys, K1)
    old = new_secret()
    with session_scope() as s:
        store.set_webhook_secret(s, tenant="t", secret=old)
        store.set_webhook_secret(s, tenant="t", secret=new_secret(), keep_previous_s=3600)
    use(keys, K2)  # K1 dropped too early
    with session_scope() as s:
        result = store.reseal_secrets(s)
    assert result.unopened == ["t"] and result.unopened_previous == ["t"]
    use(keys, f"{K2},{K1}")  # given back: both reseal, the replaced secret still signs
    with session_scope() as s:
        result = store.reseal_secrets(s)
        assert result.unopened == [] and result.unopened_previous == [] and result.resealed == 1
        assert store.previous_webhook_secret(s, tenant="t") == old
    use(keys, K2)
    with session_scope() as s:
        assert store.previous_webhook_secret(s, tenant="t") == old  # sealed with K2 now


def test_reseal_drops_an_expired_replaced_secret(keys: pytest.MonkeyPatch) -> None:
    with session_scope() as s:
        store.set_webhook_secret(s, tenant="t", secret=new_secret())
        store.set_webhook_secret(s, tenant="t", secret=new_secret(), keep_previous_s=3600)
        s.get(TenantSettings, "t").previous_secret_expires_at = utcnow() - timedelta(seconds=1)  # type: ignore[union-attr]
    use(keys, K1)
    with session_scope() as s:
        store.reseal_secrets(s)
    assert stored().previous_webhook_secret is None and stored().previous_secret_expires_at is None
