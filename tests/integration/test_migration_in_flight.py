"""Migrations 0011 and 0020 on a database that already holds jobs (every deployment that upgrades): the tenants'
in-flight rows start from a count of their unfinished top-level jobs, and downgrading removes what it
added. Runs on a database of its own, created and dropped here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from alembic import command

from conductor.migrations.migrate import alembic_config, upgrade
from conductor.settings import get_settings
from tests.integration.harness import scratch_database


@pytest.fixture
def url() -> Iterator[str]:
    with scratch_database("migration") as scratch:  # beside the test database (a fixed name met other runs)
        yield scratch


def _job(conn: sa.Connection, job_id: str, tenant: str, status: str, parent: str | None = None,
         batch: str | None = None) -> None:
    conn.execute(sa.text(
        "INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, limits, metadata, "
        "cancel_requested, planner_attempts, planner_input_tokens, planner_output_tokens, planner_cost_usd, "
        "planner_calls, input_tokens, output_tokens, cost_usd, calls, parent_job_id, batch_id, created_at, "
        "updated_at) VALUES (:id, :tenant, :status, 't', 'sim', '{}', 'x', 0, '{}', '{}', false, 0, 0, 0, 0, 0, "
        "0, 0, 0, 0, :parent, :batch, now(), now())"),
        {"id": job_id, "tenant": tenant, "status": status, "parent": parent, "batch": batch})


def _rows(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {t: n for t, n in conn.exec_driver_sql("SELECT tenant, jobs FROM tenant_in_flight").all() if n}


def test_the_upgrade_counts_the_jobs_already_in_flight_and_the_downgrade_removes_its_parts(url: str) -> None:
    upgrade(url, "0010_in_flight_index")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            for i, status in enumerate(["queued", "planning", "running", "succeeded", "failed", "cancelled"]):
                _job(conn, f"a{i}", "alpha", status)
            _job(conn, "b0", "beta", "running")
            _job(conn, "b1", "beta", "running", parent="b0")  # a nested run: not a job of its own
            _job(conn, "c0", "gamma", "succeeded")
        upgrade(url)
        with engine.begin() as conn:
            rows = dict(conn.exec_driver_sql("SELECT tenant, jobs FROM tenant_in_flight").all())
            assert rows == {"alpha": 3, "beta": 1}
            _job(conn, "c1", "gamma", "queued")  # and the triggers keep it from here
            conn.exec_driver_sql("UPDATE job SET status = 'succeeded' WHERE id = 'a0'")
        with engine.connect() as conn:
            rows = dict(conn.exec_driver_sql("SELECT tenant, jobs FROM tenant_in_flight").all())
            assert rows == {"alpha": 2, "beta": 1, "gamma": 1}
        command.downgrade(alembic_config(url), "0010_in_flight_index")
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT to_regclass('tenant_in_flight')").scalar() is None
            assert conn.execute(sa.text(
                "SELECT count(*) FROM pg_trigger WHERE tgname LIKE 'job_in_flight%'")).scalar() == 0
            assert conn.execute(sa.text(
                "SELECT count(*) FROM pg_proc WHERE proname LIKE 'conductor_tenant_in_flight%'")).scalar() == 0
    finally:
        engine.dispose()


def test_0020_leaves_a_batchs_lines_out_of_the_count_and_its_downgrade_counts_them_again(url: str) -> None:
    upgrade(url, "0019_metrics_rollup")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            _job(conn, "a0", "alpha", "queued")
            _job(conn, "a1", "alpha", "running", batch="batch_1")
            _job(conn, "a2", "alpha", "queued", batch="batch_1")
            _job(conn, "b0", "beta", "planning", batch="batch_2")  # a tenant with only a batch running
        assert _rows(engine) == {"alpha": 3, "beta": 1}  # 0011's count: every unfinished top-level job
        upgrade(url)
        assert _rows(engine) == {"alpha": 1}
        with engine.begin() as conn:  # and the triggers leave lines out from here
            _job(conn, "a3", "alpha", "queued", batch="batch_1")
            conn.exec_driver_sql("UPDATE job SET status = 'succeeded' WHERE id IN ('a1', 'b0')")
            _job(conn, "a4", "alpha", "queued")
        assert _rows(engine) == {"alpha": 2}
        command.downgrade(alembic_config(url), "0019_metrics_rollup")
        assert _rows(engine) == {"alpha": 4}  # a0, a2, a3, a4
        with engine.begin() as conn:
            conn.exec_driver_sql("UPDATE job SET status = 'failed' WHERE id = 'a2'")
        assert _rows(engine) == {"alpha": 3}
    finally:
        engine.dispose()


def test_0020_beside_a_transaction_that_locked_a_job_row_and_then_writes_it(
        url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step outcome's shape: the job's row locked (SELECT ... FOR UPDATE: ROW SHARE on job), then the job
    written (ROW EXCLUSIVE). 0020 must wait for that transaction, never deadlock with it: a lock it held on
    job while asking for a stronger one (SHARE ROW EXCLUSIVE, then DROP TRIGGER's ACCESS EXCLUSIVE) was one
    the outcome's UPDATE waited for while the migration waited for the outcome's ROW SHARE."""
    monkeypatch.setenv("CONDUCTOR_MIGRATION_LOCK_TIMEOUT_S", "20")
    get_settings.cache_clear()
    upgrade(url, "0019_metrics_rollup")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    errors: list[BaseException] = []
    migration = threading.Thread(target=lambda: _catching(errors, lambda: upgrade(url)), daemon=True)
    try:
        with engine.begin() as conn:
            _job(conn, "a0", "alpha", "running")
        with engine.connect() as outcome, engine.connect().execution_options(isolation_level="AUTOCOMMIT") as obs:
            outcome.exec_driver_sql("SELECT id FROM job WHERE id = 'a0' FOR UPDATE").all()
            migration.start()
            deadline = time.monotonic() + 30
            while not obs.exec_driver_sql(
                    "SELECT count(*) FROM pg_locks WHERE relation = 'job'::regclass AND mode = 'AccessExclusiveLock' "
                    "AND NOT granted").scalar() and time.monotonic() < deadline:
                time.sleep(0.05)
            outcome.exec_driver_sql("UPDATE job SET status = 'succeeded' WHERE id = 'a0'")  # raised DeadlockDetected
            outcome.commit()
        migration.join(timeout=60)
        assert not migration.is_alive() and errors == []
        assert _rows(engine) == {}
    finally:
        engine.dispose()
        get_settings.cache_clear()


def _catching(errors: list[BaseException], fn: Callable[[], object]) -> None:
    try:
        fn()
    except BaseException as exc:
        errors.append(exc)
