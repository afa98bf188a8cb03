"""Alembic environment: the same Settings and metadata as the service."""

from __future__ import annotations

import sys

from alembic import context
from sqlalchemy import Connection, engine_from_config, pool, text
from sqlmodel import SQLModel

import conductor.store.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from conductor.migrations.migrate import LOCK_KEY, include_object
from conductor.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().database_url
target_metadata = SQLModel.metadata


def run_offline() -> None:
    context.configure(url=url, target_metadata=target_metadata, include_object=include_object, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def lock_migrations(connection: Connection) -> None:
    """On Postgres, waits for any other migration of this database, then holds the session-level advisory
    lock LOCK_KEY until the connection closes (NullPool: when this run ends, even by an error). Committed
    before Alembic starts, so Alembic's own transactions run inside the lock. The embedded SQLite store
    is locked by conductor.embedded instead (a file lock in its data directory)."""
    if connection.dialect.name != "postgresql":
        return
    if not connection.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": LOCK_KEY}).scalar():
        print("conductor: another migration of this database is running; waiting for it to finish", file=sys.stderr)
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": LOCK_KEY})
    connection.commit()


def run_online() -> None:
    engine = engine_from_config({"sqlalchemy.url": url}, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with engine.connect() as connection:
        lock_migrations(connection)
        # A transaction per revision: in one for all, a long upgrade held the locks of its first
        # revision (ACCESS EXCLUSIVE on `job`, say) until its last, and a failure undid every one.
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            include_object=include_object,
            render_as_batch=url.startswith("sqlite"),
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
