"""Alembic environment: the same Settings and metadata as the service."""

from __future__ import annotations

import sys
import time

from alembic import context
from sqlalchemy import Connection, engine_from_config, make_url, pool, text
from sqlmodel import SQLModel

import conductor.store.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from conductor.migrations import lock_waits
from conductor.migrations.migrate import LOCK_KEY, objects_for
from conductor.settings import get_settings

config = context.config
LOCK_POLL_S = 0.5
url = config.get_main_option("sqlalchemy.url") or get_settings().database_url
target_metadata = SQLModel.metadata


def run_offline() -> None:
    dialect = make_url(url).get_dialect().name
    context.configure(url=url, target_metadata=target_metadata, include_object=objects_for(dialect), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def lock_migrations(connection: Connection) -> None:
    """On Postgres, waits for any other migration of this database, then holds the session-level advisory
    lock LOCK_KEY until the connection closes (NullPool: when this run ends, even by an error). Committed
    before Alembic starts, so Alembic's own transactions run inside the lock. The embedded SQLite store
    is locked by conductor.embedded instead (a file lock in its data directory).

    The wait is a try every LOCK_POLL_S with no transaction open between tries, not a blocking
    ``pg_advisory_lock``: a transaction waiting on the lock is one that the other run's ``CREATE INDEX
    CONCURRENTLY`` (0017) must wait out, which Postgres ends as a deadlock."""
    if connection.dialect.name != "postgresql":
        return
    waiting = False
    while True:
        held = connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": LOCK_KEY}).scalar()
        connection.commit()
        if held:
            return
        if not waiting:
            print("conductor: another migration of this database is running; waiting for it to finish",
                  file=sys.stderr)
            waiting = True
        time.sleep(LOCK_POLL_S)


def run_online() -> None:
    engine = engine_from_config({"sqlalchemy.url": url}, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with engine.connect() as connection:
        lock_migrations(connection)
        # A transaction per revision: in one for all, a long upgrade held the locks of its first
        # revision (ACCESS EXCLUSIVE on `job`, say) until its last, and a failure undid every one.
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            include_object=objects_for(connection.dialect.name),
            render_as_batch=url.startswith("sqlite"),
            transaction_per_migration=True,
        )
        # On Postgres every statement waits for a lock at most CONDUCTOR_MIGRATION_LOCK_TIMEOUT_S (a
        # statement queued for ACCESS EXCLUSIVE queues every later query on its table behind it); a revision
        # that timed out is rolled back and tried again (lock_waits.py). Each try reads where the schema is.
        def migrate() -> None:
            with context.begin_transaction():
                context.run_migrations()

        lock_waits.run(engine, connection, migrate, lambda: set(context.get_context().get_current_heads()),
                       lock_waits.LockPolicy.from_settings(), revision_target())


def revision_target() -> object:
    """The revision upgrade or downgrade goes to; None for commands that go nowhere (``alembic check``)."""
    try:
        return context.get_revision_argument()
    except KeyError:
        return None


if context.is_offline_mode():
    run_offline()
else:
    run_online()
