"""``store.db.unreachable``: which database errors a task logs as an outage (one warning line, the
reconciler recovers) and which it must raise (the work of a live server, a bug to see)."""

from __future__ import annotations

import psycopg.errors as pg
import pytest
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
