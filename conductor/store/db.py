"""Engines and sessions. One engine per database URL (and probe choice) per process."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import TypeVar

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, create_engine

from conductor.settings import get_settings

T = TypeVar("T")
log = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def get_engine(url: str | None = None, *, pre_ping: bool = True) -> Engine:
    """``pre_ping`` probes each connection with a round trip before use (the API, the reconciler).

    The step hot path uses an engine without it and instead retries a transaction once when its
    connection turns out dead (``transaction``): after a Postgres restart SQLAlchemy invalidates the
    whole pool on the first such error, so the retry gets a fresh connection."""
    url = url or get_settings().database_url
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {} if get_settings().db_synchronous_commit else {"options": "-c synchronous_commit=off"}
    return create_engine(url, pool_pre_ping=pre_ping, pool_size=10, max_overflow=20, connect_args=connect_args)


def _sqlite_pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with Session(get_engine(url), expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def transaction(body: Callable[[Session], T], *, url: str | None = None) -> T:
    """Runs ``body`` in one transaction on the hot-path engine (no pre-ping) and commits; when the
    connection was dead (the database restarted), runs it once more on a fresh one. ``body`` must be
    safe to run twice: the step functions are conditional updates fenced by the claim's owner."""
    for attempt in (1, 2):
        try:
            with Session(get_engine(url, pre_ping=False), expire_on_commit=False) as session:
                try:
                    result = body(session)
                    session.commit()
                    return result
                except BaseException:
                    session.rollback()
                    raise
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
            log.warning("database connection lost (%s); retrying the transaction once", type(exc.orig).__name__)
    raise AssertionError("unreachable")
