"""Engines and sessions. One engine (one connection pool) per database URL per process."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlmodel import Session, create_engine

from conductor.settings import get_settings

T = TypeVar("T")
log = logging.getLogger(__name__)


ONE_TRANSACTION = "conductor_one_transaction"
"""``Session.info`` key of a ``transaction`` session: the Connection whose transaction the body runs in,
the same from its first statement to the commit (``store.jobs._core`` runs its statements there)."""

_HOT_PATH: ContextVar[bool] = ContextVar("conductor_hot_path", default=False)
"""Set while ``transaction`` runs: connections checked out for the step hot path are not probed."""


DATABASE_AWAY: tuple[type[Exception], ...] = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)
"""What "the database cannot be reached now" raises: the server down or refusing, a dropped connection, or
no pooled connection free within the pool's timeout (a stalled database holding every connection). Work
meeting one is left for a retry or the reconciler, never failed as a bug."""

UNREACHABLE_SQLSTATES = ("57P01", "57P02", "57P03", "53300")
"""Postgres's answers that it is going away or not there yet: admin shutdown (a stop, fast or immediate),
crash shutdown, cannot connect now (starting up, shutting down), and too many connections (every process
reconnecting at once after a restart, until their pools settle). Class 08 (connection exception) counts too."""


SQLITE_UNREACHABLE = (sqlite3.SQLITE_CANTOPEN,)
"""The embedded store's (SQLite's) only outage, by primary result code: its file cannot be opened (its
directory gone, any ``SQLITE_CANTOPEN_*``). Its other errors carry no SQLSTATE but are answers of a live
database — ``database is locked`` past the busy timeout is SQLite's lock timeout, a missing column a schema
out of date, a disk I/O error or a read-only directory a disk to look at — and are raised like Postgres's
lock timeout, never logged as an outage."""


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database cannot be reached now: a ``DATABASE_AWAY`` error that is not an SQL
    error the server answered. True for no pooled connection within the pool's timeout, a connection lost
    (SQLAlchemy invalidated it), refused or never answered (Postgres's driver gives no SQLSTATE), the server's
    shutdown and start-up answers, and an embedded SQLite file that cannot be opened; False for a deadlock, a
    lock or statement timeout, a serialization failure, SQLite's other errors (``SQLITE_UNREACHABLE``) —
    ``OperationalError`` too, but the work of a live server, which a caller that only logs an outage must
    not hide."""
    if not isinstance(exc, DATABASE_AWAY):
        return False
    if isinstance(exc, sa_exc.TimeoutError) or getattr(exc, "connection_invalidated", False):
        return True
    orig = getattr(exc, "orig", None)
    if isinstance(orig, sqlite3.Error):  # the embedded store: a file, never "away" but when it cannot be opened
        return (getattr(orig, "sqlite_errorcode", 0) & 0xFF) in SQLITE_UNREACHABLE  # extended codes: low byte
    sqlstate = getattr(orig, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in UNREACHABLE_SQLSTATES


def in_id_order(id_column: Any, *where: Any) -> sa.ColumnElement[bool]:
    """``id IN (SELECT id … WHERE <where> ORDER BY id FOR NO KEY UPDATE)``: an ``UPDATE`` of several rows
    whose condition this is locks them in one order, ids ascending, whatever plan it gets. A plain ``UPDATE
    … WHERE <where>`` locks rows in the order its plan visits them (a sequential scan: where their current
    versions lie in the table; an index or bitmap scan: where each row was first written, or in index
    order), so two statements over the same rows could each hold one the other waits for: a deadlock,
    which Postgres breaks after ``deadlock_timeout`` (1 s) by aborting one of them. Every statement or
    transaction that locks several rows of one table takes them by id (docs/architecture.md, "Lock
    order"). SQLite, whose writers take the database's lock one at a time, drops the ``FOR UPDATE``."""
    return id_column.in_(sa.select(id_column).where(*where).order_by(id_column).with_for_update(key_share=True))


def driver_reason(exc: BaseException) -> str:
    """The first line of the database driver's own message for an SQLAlchemy error (what went wrong:
    refused connection, unknown table, ...), never the statement or its parameters; else the type's name."""
    orig = getattr(exc, "orig", None)
    text = str(orig).strip() if orig is not None else ""
    return text.splitlines()[0] if text else type(orig or exc).__name__


def get_engine(url: str | None = None) -> Engine:
    """The process's engine for ``url`` (default: ``CONDUCTOR_DATABASE_URL``): one connection pool per
    database per process, of at most ``db_pool_size + db_max_overflow`` connections.

    A connection is probed with a round trip when it is checked out (so the API and the reconciler never
    use one that died with a Postgres restart), except on the step hot path: ``transaction`` skips the
    probe and instead retries its transaction once when the connection turns out dead (SQLAlchemy then
    invalidates the whole pool, so the retry gets a fresh connection)."""
    return _engine(url or get_settings().database_url)


def reserved_engine(url: str | None = None) -> Engine:
    """One Postgres connection of this process's own, outside the shared pool, for the lease heartbeat: a
    pool that 1,000 greenlets hold (or a stall holds) must not keep the heartbeat from renewing the leases
    of steps still running, or they lapse and are re-run elsewhere (paid twice). SQLite (embedded mode):
    the shared engine."""
    url = url or get_settings().database_url
    return _engine(url) if url.startswith("sqlite") else _engine(url, reserved=True)


def clear_engines() -> None:
    """Forgets every engine (after the settings changed, e.g. embedded mode pointing at its own file)."""
    _engine.cache_clear()


_expected_users = 0
"""How many threads or greenlets of this process may hold a connection at once (a worker's slots plus
its own threads); 0 when unknown. Set by ``expect_concurrent_users``."""


def expect_concurrent_users(users: int) -> None:
    """Sizes this process's pools for ``users`` concurrent holders: up to the process's cap
    (``db_pool_size + db_max_overflow``), every connection opened stays open. Without it, a worker of 16
    threads on a pool of 10 closed a connection whenever it returned the eleventh and opened a new one
    (a new Postgres backend, its statements unprepared) for a later step: ≈15 % of its steps/s
    (docs/benchmarks.md). The cap, and so the sum to keep under ``max_connections``, is unchanged. Call
    before the first statement (a worker does at ``worker_init``); engines made earlier are forgotten."""
    global _expected_users
    _expected_users = max(0, users)
    clear_engines()


def pool_sizes() -> tuple[int, int]:
    """(connections kept open, more opened under load and closed when returned) for this process."""
    settings = get_settings()
    cap = settings.db_pool_size + settings.db_max_overflow
    kept = min(max(settings.db_pool_size, _expected_users), cap)
    return kept, cap - kept


@lru_cache(maxsize=8)
def _engine(url: str, reserved: bool = False) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, hide_parameters=True)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    settings = get_settings()
    connect_args: dict[str, object] = {"connect_timeout": settings.db_connect_timeout_s}
    if not settings.db_synchronous_commit:
        connect_args["options"] = "-c synchronous_commit=off"
    kept, overflow = (1, 0) if reserved else pool_sizes()
    # hide_parameters: a failed statement's error (logged, and raised to callers) never shows its values,
    # which hold webhook signing secrets, tasks and answers
    engine = create_engine(url, pool_size=kept, max_overflow=overflow, pool_timeout=settings.db_pool_timeout_s,
                           connect_args=connect_args, hide_parameters=True)
    dialect = engine.dialect

    def probe(dbapi_connection, _record, _proxy) -> None:  # type: ignore[no-untyped-def]
        if _HOT_PATH.get():
            return
        try:
            dialect.do_ping(dbapi_connection)
        except Exception as exc:  # dead: the pool discards it and checks out another
            raise DisconnectionError(f"connection probe failed ({type(exc).__name__})") from exc

    event.listen(engine, "checkout", probe)
    return engine


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


PATIENCE_FIRST_WAIT_S = 0.5
PATIENCE_LONGEST_WAIT_S = 8.0


def patiently(body: Callable[[Session], T], *, within_s: float) -> T:
    """``transaction(body)``, tried again while the database is away (``DATABASE_AWAY``: down, or every
    pooled connection busy) for up to ``within_s`` seconds, waiting 0.5 s doubling to 8 s between tries.
    For what must not be lost once paid for: a step's outcome, a plan (the heartbeat keeps the claim alive
    meanwhile; a try after the lease lapsed is fenced off like any late outcome)."""
    deadline = time.monotonic() + within_s
    wait = PATIENCE_FIRST_WAIT_S
    while True:
        try:
            return transaction(body)
        except DATABASE_AWAY as exc:
            if time.monotonic() + wait > deadline:
                raise
            log.warning("database away (%s: %s); recording again in %.1f s", type(exc).__name__,
                        driver_reason(exc), wait)
            time.sleep(wait)
            wait = min(wait * 2, PATIENCE_LONGEST_WAIT_S)


def transaction(body: Callable[[Session], T], *, url: str | None = None, reserved: bool = False) -> T:
    """Runs ``body`` in one transaction without probing its connection first, and commits; when the
    connection was dead (the database restarted), runs it once more on a fresh one. ``body`` must be
    safe to run twice: the step functions are conditional updates fenced by the claim's owner."""
    for attempt in (1, 2):
        try:
            hot = _HOT_PATH.set(True)
            try:
                # The transaction is the Connection's; the Session only carries it (and serves a body that
                # uses the ORM, joined to that transaction). Committing on the Connection skips the
                # Session's own transaction bookkeeping, ~8 % of a step worker's CPU when it was the
                # Session that began, committed and closed each of the two transactions of a step.
                with (reserved_engine(url) if reserved else get_engine(url)).connect() as conn:
                    conn.begin()
                    with Session(bind=conn, expire_on_commit=False) as session:
                        session.info[ONE_TRANSACTION] = conn
                        try:
                            result = body(session)
                            session.flush()  # what an ORM-using body added and did not flush itself
                            conn.commit()
                            return result
                        except BaseException:
                            conn.rollback()
                            raise
            finally:
                _HOT_PATH.reset(hot)
        except DBAPIError as exc:
            if attempt == 2 or not exc.connection_invalidated:
                raise
            log.warning("database connection lost (%s); retrying the transaction once", type(exc.orig).__name__)
    raise AssertionError("unreachable")
