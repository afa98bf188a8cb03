"""``conductor migrate``: apply the Alembic migrations shipped inside the package."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

HERE = Path(__file__).parent
LOCK_KEY = 0x636F6E6475637471  # "conductq"
"""The Postgres advisory lock (``pg_advisory_lock``) every migration of a database holds while it runs:
two ``conductor migrate`` at once (two deploys, a Compose restart) would otherwise both create the same
types and tables, and the second fail half-way. The second waits, then finds nothing left to do."""


def alembic_config(database_url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)
