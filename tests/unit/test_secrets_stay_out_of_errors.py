"""Error messages that reach logs and terminals never carry the secrets they were raised about."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from cryptography.fernet import Fernet
from pydantic import ValidationError

from conductor.settings import Settings
from conductor.store.db import get_engine


def test_a_bad_secrets_key_is_named_not_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    # a typo while rotating keys ("<new key>,oops") printed the whole new key in the startup error
    key = Fernet.generate_key().decode()
    monkeypatch.setenv("CONDUCTOR_SECRETS_KEY", f"{key},oops")
    with pytest.raises(ValidationError) as raised:
        Settings(_env_file=None)  # type: ignore[call-arg]
    text = str(raised.value)
    assert "secrets_key" in text and key not in text and key[:12] not in text


def test_a_failed_statement_does_not_show_its_parameters(tmp_path: Path) -> None:
    # the webhooks worker logs a failed re-seal with its traceback: the statement's values held the secret
    engine = get_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with engine.begin() as connection:
        connection.execute(sa.text("CREATE TABLE t (secret TEXT UNIQUE)"))
        connection.execute(sa.text("INSERT INTO t VALUES (:s)"), {"s": "whsec_c2VjcmV0"})
    with pytest.raises(sa.exc.IntegrityError) as raised, engine.begin() as connection:
        connection.execute(sa.text("INSERT INTO t VALUES (:s)"), {"s": "whsec_c2VjcmV0"})
    assert "whsec_c2VjcmV0" not in str(raised.value) and "hidden" in str(raised.value)
