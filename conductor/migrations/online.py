"""Index builds that leave a live database taking writes, for revisions to call (0017, 0019): on Postgres an
index is built ``CONCURRENTLY`` outside the revision's transaction (``outside_transaction``), and one that
an interrupted build left invalid is dropped and built again when the revision is re-run; SQLite (embedded
mode) builds it plainly. Revisions that ran depend on this behaviour: change it only by adding options.

Inside ``outside_transaction`` statements run without the migration's ``lock_timeout``
(conductor/migrations/lock_waits.py): a concurrent build waits for every older transaction by design, and
blocks no reads or writes while it does; a timeout would fail it late and leave an invalid index."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from alembic import op


def postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


@contextmanager
def outside_transaction() -> Iterator[None]:
    """Around concurrent builds: CREATE INDEX CONCURRENTLY cannot run inside a transaction, so on Postgres
    each statement commits alone, with no ``lock_timeout`` (restored after)."""
    if not postgres():
        yield
        return
    with op.get_context().autocommit_block(), _without_lock_timeout():
        yield


@contextmanager
def _without_lock_timeout() -> Iterator[None]:
    if op.get_context().as_sql:
        yield
        return
    bind = op.get_bind()
    before = bind.execute(sa.text("SELECT current_setting('lock_timeout')")).scalar()
    bind.execute(sa.text("SELECT set_config('lock_timeout', '0', false)"))
    try:
        yield
    finally:
        bind.execute(sa.text("SELECT set_config('lock_timeout', :before, false)"), {"before": before})


def create_index(name: str, table: str, columns: list[str], *, where: str | None = None,
                 postgres_only: bool = False, **options: Any) -> None:
    """``where``: a partial index's predicate, as SQL with literals (a bound parameter could not match it)."""
    kw: dict[str, Any] = dict(options)
    if where is not None:
        kw.update(postgresql_where=sa.text(where), sqlite_where=sa.text(where))
    if postgres():
        valid = None if op.get_context().as_sql else op.get_bind().execute(sa.text(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = :name AND pg_table_is_visible(c.oid)"), {"name": name}).scalar()
        if valid:
            return
        if valid is not None:  # left invalid by an interrupted CONCURRENTLY build
            op.drop_index(name, table_name=table, postgresql_concurrently=True)
        op.create_index(name, table, columns, postgresql_concurrently=True, **kw)
    elif not postgres_only:
        op.create_index(name, table, columns, **kw)


def drop_index(name: str, table: str, *, postgres_only: bool = False) -> None:
    if postgres():
        op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
    elif not postgres_only:
        op.drop_index(name, table_name=table, if_exists=True)
