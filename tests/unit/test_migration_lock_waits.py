"""conductor/migrations/lock_waits.py without Postgres: the messages an operator reads, which targets are
tried once, and SQLite left alone (tests/integration/test_migration_lock_waits.py runs it on Postgres)."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from conductor.migrations.lock_waits import (
    Holder,
    LockPolicy,
    gave_up_message,
    is_relative,
    run,
    waiting_message,
)
from conductor.settings import Settings

POLICY = LockPolicy(timeout_s=5, tries=10, retry_wait_s=10)
REPORT = Holder("job", 4242, "idle in transaction", 185.2, "SELECT *\n  FROM job\n WHERE tenant = 'a'")


def test_the_defaults_bound_a_stall_to_a_few_seconds_and_give_up_after_ten_tries() -> None:
    s = Settings()
    assert (s.migration_lock_timeout_s, s.migration_lock_tries, s.migration_lock_retry_wait_s) == (5.0, 10, 10.0)


def test_the_progress_line_names_the_revision_the_lock_its_holder_and_the_next_try() -> None:
    assert waiting_message("0019_metrics_rollup", REPORT, POLICY, 2) == (
        "conductor: migration 0019_metrics_rollup is waiting for a lock on job held by pid 4242 (idle in "
        "transaction for 3 min 5 s: SELECT * FROM job WHERE tenant = 'a'); rolled back so that queries go on, "
        "try 2 of 10 in 10 s")


def test_giving_up_is_one_line_saying_what_holds_the_lock_where_the_schema_is_and_what_to_do() -> None:
    message = gave_up_message("0019_metrics_rollup", REPORT, POLICY, 10, {"0018_backfill_url_from_default"})
    assert message == (
        "migration 0019_metrics_rollup could not get a lock on job in 10 tries of 5 s: pid 4242 (idle in "
        "transaction for 3 min 5 s: SELECT * FROM job WHERE tenant = 'a') holds it; the schema stays at "
        "0018_backfill_url_from_default. To go on, end that transaction (SELECT pg_terminate_backend(4242)) or "
        "wait for it to finish, then run conductor migrate again")
    unknown = gave_up_message(None, None, POLICY, 1, set())
    assert "\n" not in unknown and "pg_stat_activity" in unknown and "stays at base (empty)" in unknown


def test_a_long_query_is_cut_and_row_locks_are_named_as_such() -> None:
    long = Holder("transactionid", 7, "active", None, "UPDATE job SET x = 1 WHERE " + "a AND " * 100)
    assert len(long.describe()) < 160 and long.describe().endswith("...)")
    assert long.lock() == "a row lock"
    assert Holder("virtualxid", 7, None, None, None).describe() == "pid 7 (state unknown)"


@pytest.mark.parametrize(("target", "relative"), [
    ("head", False), ("0019_metrics_rollup", False), ("base", False), (("head",), False),
    ("-1", True), ("+2", True), ("head-1", True), ("0017_scale_indexes+1", True),
])
def test_a_target_counted_from_the_current_revision_is_tried_once(target: object, relative: bool) -> None:
    assert is_relative(target) is relative


def test_sqlite_runs_the_migration_once_with_nothing_set(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'store.db'}", poolclass=sa.NullPool)
    runs: list[int] = []
    try:
        with engine.connect() as conn:
            run(engine, conn, lambda: runs.append(1), lambda: set(), POLICY, "head")
    finally:
        engine.dispose()
    assert runs == [1]
