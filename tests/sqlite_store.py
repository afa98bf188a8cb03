"""A migrated SQLite store in a temporary directory, with the in-memory broker: the unit tier's database
for the engine and the reconciler (what ``conductor run`` uses), no services needed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from conductor.migrations.migrate import upgrade
from conductor.settings import Settings, get_settings
from conductor.store.db import clear_engines, get_engine


@contextmanager
def sqlite_store(directory: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Iterator[Settings]:
    """Settings pointing at a fresh, migrated ``store.sqlite3`` in ``directory`` (plus ``env``, as
    ``CONDUCTOR_*`` variables) until the block ends; then its engines are closed."""
    url = f"sqlite:///{directory / 'store.sqlite3'}"
    monkeypatch.setenv("CONDUCTOR_DATABASE_URL", url)
    monkeypatch.setenv("CONDUCTOR_BROKER_URL", "memory://")  # no Redis: the rate limiter stands aside
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    upgrade(url)
    try:
        yield get_settings()
    finally:
        get_engine(url).dispose()
        clear_engines()
        get_settings.cache_clear()
