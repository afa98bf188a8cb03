"""``store.db.unreachable``: which database errors a task logs as an outage (one warning line, the
reconciler recovers) and which it must raise (the work of a live server, a bug to see)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg.errors as pg
import pytest
import sqlalchemy as sa
import sqlalchemy.exc as sa_exc

from conductor.store.db import unreachable


def wrapped(orig: Exception) -> sa_exc.OperationalError:
    return sa_exc.OperationalError("SELECT 1", {}, orig)


@pytest.mark.parametrize("orig", [pg.AdminShutdown("stop"), pg.CrashShutdown("crash"),
                                  pg.CannotConnectNow("starting up"), pg.TooManyConnections("too many clients"),
                                  pg.ConnectionFailure("lost"), pg.OperationalError("connection refused")])
def test_the_server_away_starting_or_full_is_an_outage(orig: Exception) -> None:
    assert unreachable(wrapped(orig))


@pytest.mark.parametrize("orig", [pg.LockNotAvailable("lock timeout"), pg.QueryCanceled("statement timeout"),
                                  pg.DeadlockDetected("deadlock"), pg.SerializationFailure("serialization")])
def test_what_a_live_server_answered_is_not(orig: Exception) -> None:
    assert not unreachable(wrapped(orig))


def test_errors_not_of_the_database_are_not() -> None:
    assert not unreachable(ValueError("a bug"))
    assert unreachable(sa_exc.TimeoutError("QueuePool limit reached"))


def sqlite_error(path: str, statement: str, *, lock: bool = False) -> sa_exc.DBAPIError:
    """The error SQLAlchemy raises for ``statement`` on the SQLite file at ``path`` (the embedded store),
    another connection holding the write lock when ``lock`` (no busy wait: ``timeout=0``)."""
    engine = sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": 0})
    holder = sqlite3.connect(path) if lock else None
    try:
        if holder is not None:
            holder.execute("BEGIN IMMEDIATE")
        with engine.begin() as c:
            c.exec_driver_sql(statement)
    except sa_exc.DBAPIError as exc:
        return exc
    finally:
        if holder is not None:
            holder.close()
        engine.dispose()
    raise AssertionError(f"{statement!r} did not fail")


def test_an_embedded_store_whose_file_cannot_be_opened_is_an_outage(tmp_path: Path) -> None:
    exc = sqlite_error(str(tmp_path / "gone" / "conductor.db"), "SELECT 1")
    assert isinstance(exc, sa_exc.OperationalError)
    assert unreachable(exc)


def test_what_a_live_embedded_store_answered_is_not(tmp_path: Path) -> None:
    """SQLite's errors carry no SQLSTATE: a lock held past the busy timeout ('database is locked', its lock
    timeout) and a schema out of date are raised, not logged as the database away."""
    path = str(tmp_path / "conductor.db")
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE job (id TEXT)")
    locked = sqlite_error(path, "INSERT INTO job VALUES ('a')", lock=True)
    assert "database is locked" in str(locked.orig)
    assert not unreachable(locked)
    assert not unreachable(sqlite_error(path, "SELECT status FROM job"))
