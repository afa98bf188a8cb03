"""``conductor migrate``: apply the Alembic migrations shipped inside the package."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.util.exc import CommandError

HERE = Path(__file__).parent
LOCK_KEY = 0x636F6E6475637471  # "conductq"
"""The Postgres advisory lock (``pg_advisory_lock``) every migration of a database holds while it runs:
two ``conductor migrate`` at once (two deploys, a Compose restart) would otherwise both create the same
types and tables, and the second fail half-way. The second waits, then finds nothing left to do."""

UNMAPPED_TABLES = frozenset({"tenant_in_flight"})
"""Tables the migrations keep that no model declares (0011's per-tenant counts, kept by triggers on
Postgres): ``alembic revision --autogenerate`` must not propose dropping them."""


def objects_for(dialect: str) -> Callable[[Any, str | None, str, bool, Any], bool]:
    """env.py's autogenerate filter for a database of ``dialect``: everything but UNMAPPED_TABLES and the
    models' indexes built only on another dialect (``Index(...).ddl_if(dialect="postgresql")``, such as
    the GIN index on job metadata, which the embedded SQLite store never has)."""

    def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
        if type_ == "table" and name in UNMAPPED_TABLES:
            return False
        only = getattr(getattr(obj, "_ddl_if", None), "dialect", None) if type_ == "index" else None
        return only is None or only == dialect

    return include_object


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


class NewerStoreError(Exception):
    """The database is at a revision this package does not have: a newer conductor-queue migrated it.
    The message reads after the store's name: "<store> was written by a newer release ..."."""


def schema_revisions(database_url: str) -> tuple[set[str], set[str], set[str]]:
    """The database's current revisions, this package's heads, and every revision this package has."""
    import sqlalchemy as sa
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    engine = sa.create_engine(database_url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            current = set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
    script = ScriptDirectory.from_config(alembic_config(database_url))
    return current, set(script.get_heads()), {s.revision for s in script.walk_revisions()}


def is_behind(database_url: str) -> bool:
    """True when upgrade() has work to do: the database is at an older revision of this package's, or at
    none (not when it is at the head, nor at a revision only a newer release has)."""
    current, heads, known = schema_revisions(database_url)
    return current != heads and current <= known


def newer_store_error(database_url: str) -> NewerStoreError | None:
    """A NewerStoreError naming the database's revisions that this package's migrations do not include,
    or None when it has none."""
    from importlib.metadata import PackageNotFoundError, version

    current, heads, known = schema_revisions(database_url)
    unknown = sorted(current - known)
    if not unknown:
        return None
    try:
        release = f"conductor-queue {version('conductor-queue')}"
    except PackageNotFoundError:
        release = "this conductor-queue"
    return NewerStoreError(
        f"was written by a newer release of conductor-queue (its schema is at revision {', '.join(unknown)}; "
        f"{release} knows revisions up to {', '.join(sorted(heads))}): upgrade conductor-queue to use it"
    )


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrates the database to ``revision``; NewerStoreError when it is at a revision this package lacks
    (Alembic's own error is "Can't locate revision identified by ...", as a traceback); on Postgres,
    lock_waits.MigrationLockTimeout when a revision timed out on a lock at each of its tries (the schema
    is then at the revision before it)."""
    try:
        command.upgrade(alembic_config(database_url), revision)
    except CommandError as exc:
        newer = newer_store_error(database_url)
        if newer is not None:
            raise newer from exc
        raise
