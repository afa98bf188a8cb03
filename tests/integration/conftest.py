from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import sqlalchemy as sa

from conductor.settings import get_settings
from conductor.store.db import get_engine, session_scope
from conductor.store.keys import create_key
from tests.integration.harness import Proc, start_api, start_worker

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def pools_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Named pools written by tests (e.g. pointing at a loopback planner) are found here."""
    path = tmp_path_factory.mktemp("pools")
    os.environ["CONDUCTOR_POOLS_DIR"] = str(path)
    get_settings.cache_clear()
    return path


@pytest.fixture(scope="session")
def proc_env(pools_dir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "CONDUCTOR_POOLS_DIR": str(pools_dir),
            ANTHROPIC_KEY_ENV: ANTHROPIC_TEST_KEY}


ANTHROPIC_KEY_ENV = "CONDUCTOR_TEST_ANTHROPIC_KEY"
ANTHROPIC_TEST_KEY = "sk-ant-loopback-test"
"""The key the workers present to a loopback Anthropic server (a pool's ``api_key_env``)."""


@pytest.fixture(scope="session", autouse=True)
def clean_state() -> None:
    get_settings.cache_clear()
    settings = get_settings()
    with get_engine(settings.database_url).begin() as conn:
        # tenant_settings too: a tenant's webhook secret left by an earlier session (sealed with a key this
        # one does not set) made a later session's deliveries for that tenant fail
        conn.execute(sa.text("TRUNCATE batch_request, batch, stored_file, step_attempt, step, job, api_key, "
                             "metrics_rollup, tenant_settings "
                             "RESTART IDENTITY CASCADE"))
    redis.Redis.from_url(settings.broker_url).flushdb()


@pytest.fixture(scope="session")
def workers(proc_env: dict[str, str]) -> Iterator[list[Proc]]:
    procs = [start_worker(proc_env, "w1", concurrency=8)]
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="session")
def api(proc_env: dict[str, str]) -> Iterator[str]:
    proc, url = start_api(proc_env)
    yield url
    proc.stop()


def new_key(tenant: str) -> str:
    with session_scope() as s:
        _, key = create_key(s, tenant=tenant, pepper=get_settings().api_key_pepper)
    return key


@pytest.fixture(scope="session")
def client(api: str, workers: list[Proc]) -> Iterator[httpx.Client]:
    key = new_key("tenant-a")
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        yield c
