"""``conductor migrate`` next to a long transaction on ``job`` (a slow report, an idle-in-transaction client):
0019 adds a column to job, which needs ACCESS EXCLUSIVE, and every query on job that comes after its lock
request queues behind it. Run on a database of its own at 0018, created and dropped here, with a short
``CONDUCTOR_MIGRATION_LOCK_TIMEOUT_S``. What is asserted is read from pg_locks and pg_stat_activity, and the
waits below only keep a broken run from hanging."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import sqlalchemy as sa

from conductor import cli
from conductor.migrations.migrate import upgrade
from conductor.settings import get_settings
from tests.integration.harness import scratch_database
from tests.migrating import revisions

BEFORE, AFTER = "0018_backfill_url_from_default", "0019_metrics_rollup"
LOCK_TIMEOUT_S = 2.0
T = TypeVar("T")


@pytest.fixture
def url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("CONDUCTOR_MIGRATION_LOCK_TIMEOUT_S", str(LOCK_TIMEOUT_S))
    monkeypatch.setenv("CONDUCTOR_MIGRATION_LOCK_TRIES", "10")
    monkeypatch.setenv("CONDUCTOR_MIGRATION_LOCK_RETRY_WAIT_S", "0.2")
    get_settings.cache_clear()
    try:
        with scratch_database("lock_waits") as scratch:
            upgrade(scratch, BEFORE)
            yield scratch
    finally:
        get_settings.cache_clear()


class Background:
    """``fn`` on a thread of its own; ``pid``: the Postgres backend it said it runs on, if it does."""

    def __init__(self, fn: Callable[[Background], Any]):
        self.error: BaseException | None = None
        self.pid: int | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[Background], Any]) -> None:
        try:
            fn(self)
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def join(self) -> None:
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "did not end"


def until(check: Callable[[], T | None], what: Callable[[], str], timeout: float = 30) -> T:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(what())
        time.sleep(0.05)


def _waiting(observer: sa.Connection, pid: int | None) -> list[tuple[str, str, list[int]]]:
    """The locks backend ``pid`` waits for: (mode, table or lock type, the backends it waits behind)."""
    if pid is None:
        return []
    return [tuple(r) for r in observer.execute(sa.text(  # type: ignore[misc]
        "SELECT mode, coalesce(relation::regclass::text, locktype), pg_blocking_pids(pid) FROM pg_locks "
        "WHERE pid = :pid AND NOT granted"), {"pid": pid}).all()]


def _migration_waiting_on_job(observer: sa.Connection) -> int | None:
    return observer.execute(sa.text(
        "SELECT pid FROM pg_locks WHERE relation = 'job'::regclass AND mode = 'AccessExclusiveLock' "
        "AND NOT granted")).scalar()


def _holds_job(observer: sa.Connection, pid: int) -> bool:
    return bool(observer.execute(sa.text(
        "SELECT count(*) FROM pg_locks WHERE pid = :pid AND relation = 'job'::regclass AND granted"),
        {"pid": pid}).scalar())


def _pid(conn: sa.Connection) -> int:
    return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())


def _select_jobs(engine: sa.Engine) -> Callable[[Background], None]:
    def run(me: Background) -> None:
        with engine.connect() as conn:
            me.pid = _pid(conn)
            conn.exec_driver_sql("SELECT count(*) FROM job").scalar()

    return run


def _migrate(url: str) -> Callable[[Background], None]:
    return lambda _: upgrade(url, AFTER)


def test_queries_on_job_are_not_held_behind_a_migration_waiting_for_a_long_transaction_and_it_goes_on_after(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    blocker = engine.connect()
    observer = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    threads: list[Background] = []
    try:
        blocker_pid = _pid(blocker)
        blocker.exec_driver_sql("LOCK TABLE job IN ACCESS SHARE MODE")  # what any SELECT on job in it takes
        threads.append(migration := Background(_migrate(url)))
        migration_pid = until(lambda: _migration_waiting_on_job(observer),
                              lambda: f"the migration did not wait for job (it ended: {migration.error!r})")
        threads.append(reader := Background(_select_jobs(engine)))
        # (1) a plain SELECT on job that came after the migration's lock request: it may queue behind the
        # request, but only until the request times out, not for as long as the blocker lasts. Before
        # lock_timeout it waited behind the migration, which waited behind the blocker, until the blocker ended.
        until(reader.done.is_set, lambda: (
            f"the SELECT on job still waits while pid {blocker_pid} holds its lock: waits for "
            f"{_waiting(observer, reader.pid)} (the migration is pid {migration_pid}: "
            f"waits for {_waiting(observer, migration_pid)})"))
        assert reader.error is None
        assert _holds_job(observer, blocker_pid) and not migration.done.is_set()
        # (2) once the blocker's transaction ends, a next try of the revision succeeds
        blocker.commit()
        migration.join()
        assert migration.error is None
        assert revisions(url)[0] == {AFTER}
        err = capsys.readouterr().err
        assert f"migration {AFTER} is waiting for a lock on job held by pid {blocker_pid} (idle in transaction" in err
        assert "LOCK TABLE job IN ACCESS SHARE MODE" in err  # the holder's query, as pg_stat_activity shows it
        assert "try 2 of 10" in err
    finally:
        blocker.rollback()
        blocker.close()
        for thread in threads:
            thread.join()
        observer.close()
        engine.dispose()


def test_a_lock_held_through_every_try_fails_the_migration_naming_its_holder_and_leaves_the_schema_before(
        url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONDUCTOR_DATABASE_URL", url)
    monkeypatch.setenv("CONDUCTOR_MIGRATION_LOCK_TRIES", "3")
    get_settings.cache_clear()
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    blocker = engine.connect()
    try:
        blocker_pid = _pid(blocker)
        blocker.exec_driver_sql("SELECT id FROM job LIMIT 1").all()  # a report left open
        assert cli.main(["migrate"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert sum("rolled back so that queries go on" in line for line in err) == 2  # tries 2 and 3
        assert err[-1].startswith(f"conductor: migration {AFTER} could not get a lock on job in 3 tries of 2 s: "
                                  f"pid {blocker_pid} (idle in transaction for ")
        assert err[-1].endswith(f"SELECT id FROM job LIMIT 1) holds it; the schema stays at {BEFORE}. To go on, "
                                f"end that transaction (SELECT pg_terminate_backend({blocker_pid})) or wait for it "
                                "to finish, then run conductor migrate again")
        assert _holds_job(blocker, blocker_pid)  # it never let go
        blocker.rollback()
        assert revisions(url)[0] == {BEFORE}
        with engine.connect() as conn:  # 0019's transaction rolled back whole: no table, no column
            assert conn.exec_driver_sql("SELECT to_regclass('metrics_rollup')").scalar() is None
            assert "metrics_rolled_up_at" not in {c["name"] for c in sa.inspect(conn).get_columns("job")}
    finally:
        blocker.rollback()
        blocker.close()
        engine.dispose()


def test_an_index_build_waits_out_an_older_transaction_without_a_lock_timeout_and_queries_go_on(
        url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """0019 builds its indexes CONCURRENTLY after its columns' commit: a build waits for every older
    transaction with a snapshot, by design. Under lock_timeout it failed after 2 s and left an invalid
    index; it must wait instead, and while it does, queries and writes on job are not held."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    old = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    observer = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    threads: list[Background] = []
    try:
        old_pid = _pid(old)  # and a snapshot, held to the end of its transaction; no lock on job
        threads.append(migration := Background(_migrate(url)))

        def building() -> tuple[int, Any, float] | None:
            row = observer.execute(sa.text(
                "SELECT a.pid, a.query_start, extract(epoch FROM now() - a.query_start)::float8 "
                "FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted "
                "AND l.locktype = 'virtualxid' WHERE a.query LIKE 'CREATE INDEX CONCURRENTLY%'")).first()
            return None if row is None else (row[0], row[1], row[2])

        pid, started, _ = until(building, lambda: f"no index build waits (the migration: {migration.error!r})")
        # the same statement still waits after three lock timeouts (Postgres's clock): none applies to it
        waited = until(lambda: (b := building()) and b[2] > 3 * LOCK_TIMEOUT_S and b,
                       lambda: f"the index build stopped waiting: {building()}, {migration.error!r}")
        assert waited[:2] == (pid, started)
        threads.append(reader := Background(_select_jobs(engine)))
        until(reader.done.is_set, lambda: f"a SELECT on job waits behind the build: {_waiting(observer, reader.pid)}")
        assert reader.error is None and not migration.done.is_set()
        old.rollback()
        migration.join()
        assert migration.error is None
        assert revisions(url)[0] == {AFTER}
        assert observer.execute(sa.text(
            "SELECT bool_and(i.indisvalid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname IN ('ix_job_metrics_unrolled', 'ix_webhook_delivery_metrics_unrolled')")).scalar()
        err = capsys.readouterr().err
        assert "rolled back" not in err  # one try
        assert f"index build is waiting for the transaction of pid {old_pid} (idle in transaction" in err
    finally:
        old.rollback()
        old.close()
        for thread in threads:
            thread.join()
        observer.close()
        engine.dispose()


def test_a_backfill_batch_waiting_on_a_row_lock_is_tried_again_and_continues(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """0018 updates jobs in autocommit batches: a batch that waits on a job row a worker holds keeps the
    rows it updated locked meanwhile, so it is under lock_timeout too; the revision is tried again from its
    start and carries on (updated rows are no longer NULL)."""
    monkeypatch.setenv("CONDUCTOR_MIGRATION_LOCK_TIMEOUT_S", "0.5")
    monkeypatch.setenv("CONDUCTOR_MIGRATION_LOCK_RETRY_WAIT_S", "0.2")
    get_settings.cache_clear()
    with scratch_database("lock_waits_rows") as scratch:
        upgrade(scratch, "0017_scale_indexes")
        engine = sa.create_engine(scratch, poolclass=sa.NullPool)
        holder = engine.connect()
        threads: list[Background] = []
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql("INSERT INTO tenant_settings (tenant, webhook_url, updated_at) "
                                     "VALUES ('alpha', 'https://a.example/default', now())")
                conn.exec_driver_sql(
                    "INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, limits, metadata, "
                    "cancel_requested, planner_attempts, planner_input_tokens, planner_output_tokens, "
                    "planner_cost_usd, planner_calls, input_tokens, output_tokens, cost_usd, calls, webhook_url, "
                    "created_at, updated_at) SELECT 'job' || i, 'alpha', 'succeeded', 't', 'sim', '{}', 'x', 0, "
                    "'{}', '{}', false, 0, 0, 0, 0, 0, 0, 0, 0, 0, 'https://a.example/default', now(), now() "
                    "FROM generate_series(1, 3) AS i")
            holder_pid = _pid(holder)
            holder.exec_driver_sql("SELECT id FROM job WHERE id = 'job2' FOR UPDATE").all()
            threads.append(migration := Background(lambda _: upgrade(scratch, BEFORE)))
            seen = ""

            def retried() -> bool:
                nonlocal seen
                seen += capsys.readouterr().err
                return "try 2 of" in seen

            until(retried, lambda: f"no second try: {seen!r}, {migration.error!r}")
            assert f"migration {BEFORE} is waiting for a row lock held by pid {holder_pid}" in seen
            holder.rollback()
            migration.join()
            assert migration.error is None
            assert revisions(scratch)[0] == {BEFORE}
            with engine.connect() as conn:
                assert conn.exec_driver_sql("SELECT bool_and(webhook_url_from_default) FROM job").scalar()
        finally:
            holder.rollback()
            holder.close()
            for thread in threads:
                thread.join()
            engine.dispose()
            get_settings.cache_clear()
