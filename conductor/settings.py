"""The one place every setting lives: environment variables prefixed ``CONDUCTOR_`` and ``.env``."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_RESULT_BACKEND = "redis://127.0.0.1:6379/1"
SHIPPED_POOLS_DIR = Path(__file__).parent / "pools"
DEFAULT_POOL_FILE = SHIPPED_POOLS_DIR / "research.yaml"


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "conductor-queue"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CONDUCTOR_", env_file=".env", extra="ignore")

    database_url: str = DEFAULT_DATABASE_URL
    broker_url: str = DEFAULT_BROKER_URL
    result_backend: str = DEFAULT_RESULT_BACKEND
    pool_file: Path = DEFAULT_POOL_FILE
    pools_dir: Path | None = None
    """Where named pools (``"pool": "NAME"`` -> ``NAME.yaml``) are looked up first; then beside the
    default pool file, then the shipped pools."""
    data_dir: Path = Field(default_factory=_default_data_dir)
    auth_required: bool = True

    # Input limits: every request is checked against these before anything is stored.
    max_task_chars: int = Field(default=100_000, ge=1)
    max_steps: int = Field(default=5, ge=1, le=50)
    max_depth: int = Field(default=2, ge=0, le=5)
    max_instruction_chars: int = Field(default=20_000, ge=1)
    max_body_bytes: int = Field(default=1_000_000, ge=1024)
    max_metadata_bytes: int = Field(default=16_384, ge=0)

    # Execution: how long a step may hold its claim before the reconciler may hand it to another worker.
    step_lease_s: float = Field(default=600.0, gt=0)
    step_soft_time_limit_s: float = Field(default=540.0, gt=0)
    step_max_attempts: int = Field(default=4, ge=1, le=20)
    retry_backoff_base_s: float = Field(default=1.0, ge=0)
    retry_backoff_max_s: float = Field(default=60.0, ge=0)
    provider_timeout_s: float = Field(default=300.0, gt=0)
    rate_limit_wait_s: float = Field(default=60.0, ge=0)
    """How long a step waits for its agent's shared requests-per-minute bucket before the attempt fails
    as rate limited (and is retried after the time the bucket says)."""
    # How often the reconciler runs and how old unfinished work must be before it is re-driven.
    reconcile_interval_s: float = Field(default=15.0, gt=0)
    reconcile_stale_s: float = Field(default=30.0, ge=0)

    api_key_pepper: str = ""
    """Keyed into every API-key hash; set it in production so a leaked table alone verifies nothing."""

    # Client side (``conductor submit``): where the API is and which key to send.
    api_url: str = "http://127.0.0.1:8000"
    api_key: str | None = None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Settings loaded once per process; tests call ``get_settings.cache_clear()`` after changing env."""
    return Settings()
