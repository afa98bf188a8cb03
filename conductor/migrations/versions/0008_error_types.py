"""error_type values are the snake_case ErrorType vocabulary, no longer Python class names

Revision ID: 0008_error_types
Revises: 0007_replay
Create Date: 2026-11-23

Data only: the columns stay ``VARCHAR(64)``. The mapping is written out here (not imported from
``conductor.errors``) so this revision means the same thing whatever the code later becomes.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_error_types"
down_revision = "0007_replay"
branch_labels = None
depends_on = None

TABLES = ("job", "step", "step_attempt")
RENAMED = {
    "ProviderError": "provider_error",
    "RetryableError": "provider_error",
    "FatalError": "provider_error",
    "ProviderTimeout": "provider_timeout",
    "ServerError": "server_error",
    "RateLimited": "rate_limited",
    "RateLimitTimeout": "rate_limit_timeout",
    "RateLimiterUnavailable": "rate_limiter_unavailable",
    "BadRequest": "bad_request",
    "AuthError": "auth_error",
    "ConfigError": "config_error",
    "BudgetExceeded": "budget_exceeded",
    "DeadlineExceeded": "deadline_exceeded",
    "WorkerLost": "worker_lost",
    "StepAbandoned": "step_abandoned",
    "InternalError": "internal_error",
}
# Downgrade: provider_error was three classes before; ProviderError is the one that covers them all.
RESTORED = {new: old for old, new in reversed(RENAMED.items())}


def _rename(mapping: dict[str, str]) -> None:
    for table in TABLES:
        statement = sa.text(f"UPDATE {table} SET error_type = :new WHERE error_type = :old")
        for old, new in mapping.items():
            op.execute(statement.bindparams(old=old, new=new))


def upgrade() -> None:
    _rename(RENAMED)


def downgrade() -> None:
    _rename(RESTORED)
