"""``conductor migrate``: apply the Alembic migrations shipped inside the package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config

HERE = Path(__file__).parent
LOCK_KEY = 0x636F6E6475637471  # "conductq"
"""The Postgres advisory lock (``pg_advisory_lock``) every migration of a database holds while it runs:
two ``conductor migrate`` at once (two deploys, a Compose restart) would otherwise both create the same
types and tables, and the second fail half-way. The second waits, then finds nothing left to do."""

UNMAPPED_TABLES = frozenset({"tenant_in_flight"})
"""Tables the migrations keep that no model declares (0011's per-tenant counts, kept by triggers on
Postgres): ``alembic revision --autogenerate`` must not propose dropping them."""


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """env.py's autogenerate filter: everything but UNMAPPED_TABLES."""
    return not (type_ == "table" and name in UNMAPPED_TABLES)


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)
