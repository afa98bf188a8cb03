"""The metrics rollup on Postgres: passes running at once take different jobs (``SKIP LOCKED``) and count
each once, and a scrape's statements reach the rows not rolled up through the partial indexes, not by
reading the history. Rows come from ``bench.metrics_scale.fill`` (generate_series) under tenants of
their own, removed afterwards."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlmodel import Session

from bench.metrics_scale import fill
from conductor.store.db import get_engine
from conductor.store.metrics import read_aggregates, roll_up_jobs, scrape_statements, settled_jobs
from conductor.store.models import utcnow

TENANTS = 4
PREFIX = "rollup-"


def numbers(tenant: str | None = None) -> dict[tuple[Any, ...], float]:
    """The scrape's store series of the filled tenants, flattened to (series, key...) -> number."""
    with Session(get_engine()) as s:
        agg = read_aggregates(s, tenant=tenant)
    out: dict[tuple[Any, ...], float] = {}
    for name in ("jobs", "steps", "usage", "retries", "attempts", "resends", "webhooks", "webhook_attempts"):
        for row in getattr(agg, name):
            if str(row[0]).startswith(PREFIX):
                labels = tuple(v for v in row if isinstance(v, str))  # a row's key: never a (rounded) sum
                for i, v in enumerate(row):
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        out[(name, *labels, i)] = v
    return out


def assert_same(before: dict[tuple[Any, ...], float], after: dict[tuple[Any, ...], float]) -> None:
    assert before.keys() == after.keys()
    assert {k: (v, after[k]) for k, v in before.items() if not math.isclose(v, after[k], rel_tol=1e-12)} == {}


@pytest.fixture
def filled() -> Iterator[int]:
    """400 ended jobs (4 steps, their attempts, a delivery every other job) of tenants ``rollup-0..3``: the
    only ones a fold can take (the suite's earlier tests' ended jobs are folded first; a fold takes any
    tenant's, and these tests count what folds take)."""
    engine = get_engine()
    while True:
        with Session(engine) as s:
            taken = fold(s, 10_000)
            s.commit()
        if not taken:
            break
    with engine.begin() as conn:
        fill(conn, jobs=400, tenants=TENANTS, in_flight=0, recent=0, tenant_prefix=PREFIX)
    yield 400
    with engine.begin() as conn:
        for stmt in ("DELETE FROM webhook_attempt WHERE delivery_id IN (SELECT id FROM webhook_delivery "
                     "WHERE tenant LIKE 'rollup-%%')",
                     "DELETE FROM webhook_delivery WHERE tenant LIKE 'rollup-%%'",
                     "DELETE FROM step_attempt WHERE step_id IN (SELECT s.id FROM step s JOIN job j ON j.id = s.job_id "
                     "WHERE j.tenant LIKE 'rollup-%%')",
                     "DELETE FROM step WHERE job_id IN (SELECT id FROM job WHERE tenant LIKE 'rollup-%%')",
                     "DELETE FROM job WHERE tenant LIKE 'rollup-%%'",
                     "DELETE FROM metrics_rollup WHERE tenant LIKE 'rollup-%%'"):
            conn.exec_driver_sql(stmt)


def fold(session: Session, limit: int) -> int:
    now = utcnow()
    return roll_up_jobs(session, settled_before=now, abandoned_before=now, limit=limit)


def unrolled() -> int:
    with get_engine().connect() as conn:
        return conn.exec_driver_sql("SELECT count(*) FROM job WHERE tenant LIKE 'rollup-%%' "
                                    "AND metrics_rolled_up_at IS NULL").scalar_one()


def test_two_passes_at_once_take_different_jobs_and_count_each_once(filled: int) -> None:
    before = {t: numbers(t) for t in (None, f"{PREFIX}1")}
    engine = get_engine()
    with Session(engine) as first:
        taken_first = fold(first, 150)  # holds its 150 jobs (and then its rollup rows) until it commits
        assert taken_first == 150
        with Session(engine) as peek:  # another pass's choice skips them, without waiting
            peek.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            now = utcnow()
            assert len(peek.execute(settled_jobs(now, now, 10_000)).scalars().all()) == filled - taken_first
            peek.rollback()
        second: list[int] = []

        def run_second() -> None:
            with Session(engine) as s:
                second.append(fold(s, 10_000))  # skips the first's jobs; waits for its rollup rows
                s.commit()

        thread = threading.Thread(target=run_second)
        thread.start()
        thread.join(timeout=2)
        assert thread.is_alive(), "the second pass should wait for the first's rollup rows"
        first.commit()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert second == [filled - taken_first]
    assert unrolled() == 0
    for tenant, was in before.items():
        assert_same(was, numbers(tenant))


def test_many_passes_at_once_in_small_batches_count_each_job_once(filled: int) -> None:
    before = numbers()
    errors: list[BaseException] = []
    taken: list[int] = []
    start = threading.Barrier(4)

    def passes() -> None:
        try:
            start.wait()
            while True:
                with Session(get_engine()) as s:
                    n = fold(s, 7)
                    s.commit()
                if not n:
                    return
                taken.append(n)
        except BaseException as exc:  # a deadlock or a unique violation would land here
            errors.append(exc)

    threads = [threading.Thread(target=passes) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert sum(taken) == filled and unrolled() == 0
    assert_same(before, numbers())


def explain(conn: Any, statement: Any) -> str:
    sql = str(statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    return "\n".join(conn.exec_driver_sql(f"EXPLAIN {sql.replace('%', '%%')}").scalars())


TABLES = ("job", "step", "step_attempt", "webhook_delivery", "webhook_attempt")


@pytest.fixture
def filled_table() -> Iterator[Any]:
    """20,000 jobs rolled up, 50 ended just now and 50 running (with their steps, attempts and deliveries),
    the session's other jobs and deliveries marked rolled up, statistics taken: in a transaction rolled back
    afterwards, rows, marks and statistics alike. (With 2 % of the jobs not rolled up Postgres rightly reads
    a step table this small whole; at a long history's 0.5 %, or 0.01 %, it does not.)"""
    with get_engine().connect() as conn:
        trans = conn.begin()
        try:
            for table in ("job", "webhook_delivery"):
                conn.exec_driver_sql(f"UPDATE {table} SET metrics_rolled_up_at = now() "
                                     "WHERE metrics_rolled_up_at IS NULL")
            fill(conn, jobs=20_000, tenants=TENANTS, tenant_prefix=PREFIX, rolled_up=True, in_flight=50, recent=50)
            for table in TABLES:
                conn.exec_driver_sql(f"ANALYZE {table}")
            yield conn
        finally:
            trans.rollback()


def test_a_scrape_reads_the_rows_not_rolled_up_through_the_partial_indexes(filled_table: Any) -> None:
    """Every statement of the scrape, all tenants' and one tenant's, finds its jobs or deliveries through
    their partial index and their steps and attempts by key, reading none of the tables whole."""
    for tenant in (None, f"{PREFIX}2"):
        for series, statement in scrape_statements(tenant).items():
            plan = explain(filled_table, statement)
            table = "webhook_delivery" if series.startswith("webhook") else "job"
            index = f"ix_{table}_metrics_unrolled"
            assert index in plan, (series, tenant, plan)
            assert not [t for t in TABLES if f"Seq Scan on {t} " in plan], (series, tenant, plan)


def test_folding_takes_the_oldest_ended_jobs_through_the_partial_index(filled_table: Any) -> None:
    now = utcnow()
    plan = explain(filled_table, settled_jobs(now, now - timedelta(hours=2), 1000))
    assert "ix_job_metrics_unrolled" in plan and "Seq Scan on job " not in plan, plan
