"""Test-wide settings: every test talks to the test database and an isolated Redis db."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).parent
TEST_ENV = {
    "CONDUCTOR_DATABASE_URL": os.environ.get(
        "CONDUCTOR_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/conductor_test"
    ),
    "CONDUCTOR_BROKER_URL": os.environ.get("CONDUCTOR_TEST_BROKER_URL", "redis://127.0.0.1:6379/5"),
    "CONDUCTOR_RESULT_BACKEND": os.environ.get("CONDUCTOR_TEST_RESULT_BACKEND", "redis://127.0.0.1:6379/6"),
    "CONDUCTOR_POOL_FILE": str(TESTS / "pools" / "sim.yaml"),
    "CONDUCTOR_AUTH_REQUIRED": "true",
    "CONDUCTOR_RETRY_BACKOFF_BASE_S": "0.05",
    "CONDUCTOR_RETRY_BACKOFF_MAX_S": "0.2",
    "CONDUCTOR_RATE_LIMIT_WAIT_S": "0.5",
    "CONDUCTOR_METRICS_TOKEN": "test-metrics-token",
}
os.environ.update(TEST_ENV)


def require_llama_cpp() -> None:
    """Skips a test that needs the ``local`` extra when it is not installed (``make unit`` on a bare venv);
    under CI, where ``make test`` installs it, its absence fails the test instead of hiding it."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("llama_cpp") is not None:
        return
    if os.environ.get("CI"):
        pytest.fail("llama_cpp is not installed but CI is set: `make test` installs the local extra")
    pytest.skip("needs the local extra (llama_cpp)")
