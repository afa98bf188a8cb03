"""The migration history stays one line: parallel branches that each added a revision on the same
parent would leave two heads, and `conductor migrate` (upgrade to "head") would refuse to run."""

from __future__ import annotations

from alembic.script import ScriptDirectory

from conductor.migrations.migrate import alembic_config


def test_one_head_and_every_revision_reachable_from_it() -> None:
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    heads = script.get_heads()
    assert len(heads) == 1, f"migrations have several heads {heads}: set the newer one's down_revision"
    reachable = {rev.revision for rev in script.walk_revisions("base", heads[0])}
    every = {rev.revision for rev in script.walk_revisions()}
    assert reachable == every


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
