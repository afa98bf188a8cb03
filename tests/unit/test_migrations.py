"""The migration history stays one line: parallel branches that each added a revision on the same
parent would leave two heads, and `conductor migrate` (upgrade to "head") would refuse to run."""

from __future__ import annotations

from pathlib import Path

from alembic.script import ScriptDirectory

from conductor.embedded import database_url
from conductor.migrations.migrate import alembic_config, upgrade
from tests.migrating import (
    assert_downgrades_to_base_and_upgrades_again,
    assert_schema_is_the_models,
    revisions,
    run_together,
)


def test_one_head_and_every_revision_reachable_from_it() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    heads = script.get_heads()
    assert len(heads) == 1, f"migrations have several heads {heads}: set the newer one's down_revision"
    reachable = {rev.revision for rev in script.walk_revisions("base", heads[0])}
    every = {rev.revision for rev in script.walk_revisions()}
    assert reachable == every


def test_every_column_change_goes_through_batch_alter_table() -> None:
    """SQLite (the embedded store) cannot alter most of a table in place: alembic's ``batch_alter_table``
    recreates it where needed. Every revision changes columns through it, as the earlier ones do: none calls
    ``op.add_column``, ``op.drop_column`` or ``op.alter_column`` directly (those work on SQLite only for the
    changes it can make in place)."""
    import ast

    versions = Path(alembic_config("sqlite://").get_main_option("script_location") or "") / "versions"
    paths = sorted(versions.glob("0*.py"))
    assert len(paths) >= 22, versions
    direct = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "op"
                    and node.func.attr in ("add_column", "drop_column", "alter_column")):
                direct.append(f"{path.name}:{node.lineno} op.{node.func.attr}")
    assert direct == [], "use `with op.batch_alter_table(table) as batch:` for these"


def test_the_in_flight_index_covers_exactly_the_unfinished_statuses() -> None:
    import re

    from conductor.statuses import JobStatus
    from conductor.store.models import IN_FLIGHT_SQL

    listed = set(re.findall(r"'([a-z_]+)'", IN_FLIGHT_SQL))
    assert listed == {s.value for s in JobStatus} - set(JobStatus.TERMINAL)


def test_the_in_flight_triggers_count_exactly_the_unfinished_statuses() -> None:
    import importlib
    import re

    from conductor.store.models import IN_FLIGHT_SQL

    migration = importlib.import_module("conductor.migrations.versions.0011_tenant_in_flight")
    index = set(re.findall(r"'([a-z_]+)'", IN_FLIGHT_SQL))
    for clause in (migration.OLD_IN_FLIGHT, migration.NEW_IN_FLIGHT):
        assert set(re.findall(r"'([a-z_]+)'", clause)) == index
        assert "parent_job_id IS NULL" in clause


def test_two_runs_migrating_one_old_data_dir_at_once_both_succeed(tmp_path: Path) -> None:
    # without the lock the second failed: duplicate column name (or a batch copy of a half-altered table)
    upgrade(database_url(tmp_path), "0005_batches")
    setup = ("from pathlib import Path\nfrom conductor import embedded\n"
             "directory = Path(sys.argv[1])\nsettings = embedded.use_store(directory)")
    done = run_together(setup, "embedded._migrate(settings, directory)", str(tmp_path), count=3)
    for result in done:
        assert result.returncode == 0, result.stderr
    current, heads = revisions(database_url(tmp_path))
    assert current == heads


def test_the_embedded_store_downgrades_to_base_and_upgrades_again(tmp_path: Path) -> None:
    assert_downgrades_to_base_and_upgrades_again(database_url(tmp_path))


def test_the_migrated_embedded_store_is_the_models_for_autogenerate(tmp_path: Path) -> None:
    upgrade(database_url(tmp_path))
    assert_schema_is_the_models(database_url(tmp_path))


def test_sqlite_upgrade_from_0016_guesses_the_default_url_flag_and_builds_the_indexes(tmp_path: Path) -> None:
    """Embedded mode runs the same migrations: 0017's indexes (but the GIN one, Postgres only) and 0018's
    guess (tests/integration/test_migration_0017_0018.py does both on Postgres)."""
    import sqlalchemy as sa

    from conductor.migrations.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'store.sqlite3'}"
    upgrade(url, "0016_webhook_url_from_default")
    engine = sa.create_engine(url)
    insert = sa.text(
        "INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, limits, metadata, "
        "cancel_requested, planner_attempts, planner_input_tokens, planner_output_tokens, planner_cost_usd, "
        "planner_calls, input_tokens, output_tokens, cost_usd, calls, plan_claims, plan_resends, replay_replan, "
        "webhook_url, webhook_url_from_default, created_at, updated_at) VALUES (:id, :tenant, 'succeeded', 't', "
        "'sim', '{}', 'x', 0, '{}', '{}', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, :url, :marked, :at, :at)")
    default = "https://a.example/default"
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenant_settings (tenant, webhook_url, updated_at) VALUES "
                             "('alpha', :u, '2026-11-01 00:00:00')"), {"u": default})
        for job_id, url_, marked, at in [("old-default", default, None, "2026-11-01 00:00:00"),
                                         ("old-own", "https://a.example/own", None, "2026-11-01 00:00:00"),
                                         ("new-marked", default, True, "2026-11-20 00:00:00"),
                                         ("new-named", default, None, "2026-11-21 00:00:00")]:
            conn.execute(insert, {"id": job_id, "tenant": "alpha", "url": url_, "marked": marked, "at": at})
    upgrade(url)
    with engine.connect() as conn:
        flags = dict(conn.execute(sa.text("SELECT id, webhook_url_from_default FROM job")).all())
        indexes = {row[1] for row in conn.execute(sa.text("PRAGMA index_list('job')")).all()}
    engine.dispose()
    assert flags == {"old-default": 1, "old-own": None, "new-marked": 1, "new-named": None}
    assert {"ix_job_batch_status", "ix_job_tenant_status_created", "ix_job_queued"} <= indexes
    assert "ix_job_metadata" not in indexes and "ix_job_batch_id" not in indexes
