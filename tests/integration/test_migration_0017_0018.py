"""Migrations 0017 (indexes, built CONCURRENTLY) and 0018 (job.webhook_url_from_default guessed for jobs
stored before 0016) on a database at 0016 that already holds jobs, as every deployment that upgrades;
then the downgrade. Runs on a database of its own, created and dropped here."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from alembic import command

from conductor.migrations.migrate import alembic_config, upgrade
from conductor.store.models import utcnow
from tests.integration.harness import scratch_database

NEW_INDEXES = {"ix_job_batch_status", "ix_job_tenant_status_created", "ix_job_metadata", "ix_job_queued",
               "ix_batch_tenant_created_id", "ix_stored_file_tenant_created_id"}


@pytest.fixture
def url() -> Iterator[str]:
    with scratch_database("mig_0018") as scratch:
        yield scratch


JOB = ("INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, limits, metadata, "
       "cancel_requested, planner_attempts, planner_input_tokens, planner_output_tokens, planner_cost_usd, "
       "planner_calls, input_tokens, output_tokens, cost_usd, calls, webhook_url, webhook_url_from_default, "
       "created_at, updated_at) SELECT {id}, :tenant, 'succeeded', 't', 'sim', '{{}}', 'x', 0, '{{}}', '{{}}', "
       "false, 0, 0, 0, 0, 0, 0, 0, 0, 0, :url, :marked, :at, :at FROM generate_series(1, :n) AS i")


def _jobs(conn: sa.Connection, prefix: str, tenant: str, url: str | None, *, at: object, n: int = 1,
          marked: bool | None = None) -> None:
    conn.execute(sa.text(JOB.format(id=f"'{prefix}' || i")),
                 {"tenant": tenant, "url": url, "marked": marked, "at": at, "n": n})


def _flags(conn: sa.Connection) -> dict[str, bool | None]:
    rows = conn.execute(sa.text("SELECT id, webhook_url_from_default FROM job WHERE id NOT LIKE 'many%'")).all()
    return {job_id: flag for job_id, flag in rows}


def _indexes(conn: sa.Connection) -> dict[str, bool]:
    rows = conn.execute(sa.text(
        "SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
        "JOIN pg_class t ON t.oid = i.indrelid WHERE t.relname IN ('job', 'batch', 'stored_file')")).all()
    return {name: valid for name, valid in rows}


def test_the_upgrade_guesses_the_flag_for_jobs_from_before_0016_and_builds_the_indexes(url: str) -> None:
    upgrade(url, "0016_webhook_url_from_default")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    old, later = utcnow() - timedelta(days=2), utcnow() - timedelta(days=1)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO tenant_settings (tenant, webhook_url, updated_at) VALUES "
                                 "('alpha', 'https://a.example/default', now()), ('beta', NULL, now())"))
            _jobs(conn, "old-default-", "alpha", "https://a.example/default", at=old)  # used the default: true
            _jobs(conn, "old-own-", "alpha", "https://a.example/own", at=old)  # named another URL: stays NULL
            _jobs(conn, "old-none-", "alpha", None, at=old)
            _jobs(conn, "old-beta-", "beta", "https://b.example/x", at=old)  # beta has no default
            _jobs(conn, "old-gamma-", "gamma", "https://a.example/default", at=old)  # no settings at all
            # more than one batch of 10,000 ids: every batch is updated
            _jobs(conn, "many", "alpha", "https://a.example/default", at=old, n=10_050)
            # after 0016 was deployed: the first job that used the default was marked at submit, and a job
            # left unmarked from then on named its URL itself (equal to the default or not)
            _jobs(conn, "new-marked-", "alpha", "https://a.example/default", at=later, marked=True)
            _jobs(conn, "new-named-", "alpha", "https://a.example/default", at=later + timedelta(hours=1))
            _jobs(conn, "new-own-", "alpha", "https://a.example/own", at=later + timedelta(hours=1))
        with engine.connect() as conn:
            assert "ix_job_batch_id" in _indexes(conn)
        upgrade(url)
        with engine.connect() as conn:
            assert _flags(conn) == {"old-default-1": True, "old-own-1": None, "old-none-1": None, "old-beta-1": None,
                                    "old-gamma-1": None, "new-marked-1": True, "new-named-1": None, "new-own-1": None}
            assert conn.execute(sa.text("SELECT count(*) FROM job WHERE id LIKE 'many%' "
                                        "AND webhook_url_from_default")).scalar() == 10_050
            indexes = _indexes(conn)
            assert set(indexes) >= NEW_INDEXES and all(indexes[name] for name in NEW_INDEXES)
            assert "ix_job_batch_id" not in indexes  # replaced by ix_job_batch_status, its prefix
            assert conn.execute(sa.text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_job_queued'")
                                ).scalar() == ("CREATE INDEX ix_job_queued ON public.job USING btree (enqueued_at, "
                                               "created_at) WHERE ((status)::text = 'queued'::text)")
        command.downgrade(alembic_config(url), "0016_webhook_url_from_default")
        with engine.connect() as conn:
            indexes = _indexes(conn)
            assert not NEW_INDEXES & set(indexes) and "ix_job_batch_id" in indexes
        upgrade(url)  # and up again
        with engine.connect() as conn:
            assert set(_indexes(conn)) >= NEW_INDEXES
    finally:
        engine.dispose()


def test_an_index_left_invalid_by_an_interrupted_build_is_built_again(url: str) -> None:
    """CREATE INDEX CONCURRENTLY that fails midway leaves an invalid index behind; re-running the migration
    drops and builds it rather than stopping at "already exists" or keeping it unusable."""
    upgrade(url, "0016_webhook_url_from_default")
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE INDEX ix_job_queued ON job (enqueued_at)")
            conn.exec_driver_sql("UPDATE pg_index SET indisvalid = false WHERE indexrelid = 'ix_job_queued'::regclass")
        upgrade(url)
        with engine.connect() as conn:
            assert _indexes(conn)["ix_job_queued"] is True
            assert "created_at" in conn.execute(sa.text(
                "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_job_queued'")).scalar()
    finally:
        engine.dispose()
