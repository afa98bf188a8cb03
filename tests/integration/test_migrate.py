"""``conductor migrate`` on a database of its own (created and dropped here, named after the test
database): concurrent runners, and the schema it leaves against the models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from conductor.migrations.migrate import upgrade
from tests.integration.harness import scratch_database
from tests.migrating import (
    assert_downgrades_to_base_and_upgrades_again,
    assert_schema_is_the_models,
    revisions,
    run_together,
)


@pytest.fixture
def fresh_url() -> Iterator[str]:
    with scratch_database("fresh") as url:
        yield url


def test_two_migrations_of_one_empty_database_at_once_both_succeed(
        fresh_url: str, proc_env: dict[str, str]) -> None:
    # without a lock the second died half-way: duplicate key value violates "pg_type_typname_nsp_index"
    env = {**proc_env, "CONDUCTOR_DATABASE_URL": fresh_url}
    done = run_together("from conductor.cli import main", "sys.exit(main(['migrate']))", count=3, env=env)
    for result in done:
        assert result.returncode == 0 and "latest revision" in result.stdout, result.stderr
    current, heads = revisions(fresh_url)
    assert current == heads


def test_each_migration_commits_on_its_own(fresh_url: str) -> None:
    # in one transaction for all, a long upgrade held ACCESS EXCLUSIVE on `job` from its first migration
    # to its last; seen here as a failing migration taking the ones before it down with it
    upgrade(fresh_url, "0014_sealed_webhook_secret")
    engine = sa.create_engine(fresh_url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:  # 0016's column, already there: 0016 fails
            conn.exec_driver_sql("ALTER TABLE job ADD COLUMN webhook_url_from_default boolean")
        with pytest.raises(sa.exc.ProgrammingError, match="webhook_url_from_default"):
            upgrade(fresh_url)
        assert revisions(fresh_url)[0] == {"0015_previous_webhook_secret"}
        with engine.connect() as conn:
            assert "previous_webhook_secret" in {c["name"] for c in sa.inspect(conn).get_columns("tenant_settings")}
    finally:
        engine.dispose()


def test_a_full_downgrade_and_upgrade_again(fresh_url: str) -> None:
    assert_downgrades_to_base_and_upgrades_again(fresh_url)


def test_the_migrated_schema_is_the_models_for_autogenerate(fresh_url: str) -> None:
    # tenant_in_flight (0011, kept by triggers, not a model): autogenerate proposed to drop it
    upgrade(fresh_url)
    assert_schema_is_the_models(fresh_url)
