"""One connection pool per database per process, and what happens to its connections when their server
side dies (as after a Postgres restart): a probed checkout replaces a dead connection before use; the
hot path's ``transaction`` skips the probe and runs its body once more on a fresh connection."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import expect_concurrent_users, get_engine, pool_sizes, session_scope, transaction
from tests.integration.harness import start_worker


def _kill_pooled_connections(engine: sa.Engine, n: int) -> list[int]:
    """Checks out ``n`` connections, returns them to the pool, then terminates their backends."""
    conns = [engine.connect() for _ in range(n)]
    pids = [int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()) for c in conns]
    for c in conns:
        c.close()
    outsider = sa.create_engine(engine.url, poolclass=sa.NullPool)  # not one of the pool's own
    with outsider.connect() as killer:
        for pid in pids:
            assert killer.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar_one()
    outsider.dispose()
    return pids


def test_every_caller_of_one_url_shares_one_pool() -> None:
    settings = get_settings()
    assert get_engine() is get_engine(settings.database_url)
    assert get_engine().pool.size() == settings.db_pool_size  # type: ignore[attr-defined]


def _backends(engine: sa.Engine, n: int) -> set[int]:
    """Holds ``n`` connections at once (as ``n`` busy threads would), returns them; their backend pids."""
    conns = [engine.connect() for _ in range(n)]
    try:
        return {int(c.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()) for c in conns}
    finally:
        for c in conns:
            c.close()


def test_a_pool_sized_for_its_users_keeps_every_connection_it_opened() -> None:
    settings = get_settings()
    cap = settings.db_pool_size + settings.db_max_overflow
    users = settings.db_pool_size + 6
    get_engine().dispose()
    try:
        # Sized by default, the connections past db_pool_size are closed when returned and new backends
        # are started for the next burst.
        expect_concurrent_users(0)
        first, second = _backends(get_engine(), users), _backends(get_engine(), users)
        assert len(first) == len(second) == users
        assert len(first & second) == settings.db_pool_size
        get_engine().dispose()

        expect_concurrent_users(users)
        assert pool_sizes() == (users, cap - users)
        first, second = _backends(get_engine(), users), _backends(get_engine(), users)
        assert first == second and len(first) == users  # the same backends serve the next burst

        expect_concurrent_users(cap + 100)  # never past the process's cap
        assert pool_sizes() == (cap, 0)
        expect_concurrent_users(1)  # never below db_pool_size
        assert pool_sizes() == (settings.db_pool_size, settings.db_max_overflow)
    finally:
        get_engine().dispose()
        expect_concurrent_users(0)


def test_a_worker_sizes_its_pool_for_its_slots(proc_env: dict[str, str]) -> None:
    settings = get_settings()
    slots = settings.db_pool_size + 6  # Celery's, plus 2 local slots for parallel steps (tasks/alongside.py)
    worker = start_worker({**proc_env, "CONDUCTOR_WORKER_LOCAL_SLOTS": "2"}, "poolsize", queues="maintenance",
                          concurrency=slots)
    try:
        # one per slot: the lease heartbeat has a connection of its own, outside the pool
        worker.wait_for_log(f"database pool: keeps {slots + 2} connections open for {slots + 2} slots", timeout=10)
    finally:
        worker.stop()


def test_a_dead_pooled_connection_is_replaced_before_use() -> None:
    engine = get_engine()
    engine.dispose()
    dead = _kill_pooled_connections(engine, 3)
    for _ in range(3):  # every dead one would be handed out in turn
        with session_scope() as s:
            pid = int(s.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        assert pid not in dead


def test_the_hot_path_skips_the_probe_and_retries_once_on_a_dead_connection() -> None:
    engine = get_engine()
    engine.dispose()
    dead = _kill_pooled_connections(engine, 1)
    runs: list[int] = []

    def body(s: Session) -> int:
        runs.append(1)
        return int(s.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())

    pid = transaction(body)
    assert pid not in dead
    assert len(runs) == 2  # not probed: the first run met the dead connection, the retry a fresh one


def test_a_dead_connection_met_by_a_direct_statement_is_retried_the_same_way() -> None:
    """The hot path's prebuilt statements run on the driver's cursor (conductor/store/direct.py); a dead
    connection must still surface as SQLAlchemy's invalidating error, so ``transaction`` retries."""
    job_id = new_job_row()
    engine = get_engine()
    engine.dispose()
    _kill_pooled_connections(engine, 1)
    runs: list[int] = []
    raised: list[BaseException] = []

    def body(s: Session) -> str | None:
        runs.append(1)
        try:
            head = store.lock_job(s, job_id=job_id)
        except BaseException as exc:
            raised.append(exc)
            raise
        return head.status if head is not None else None

    assert transaction(body) == "queued"
    assert len(runs) == 2
    # SQLAlchemy's own error, the connection invalidated: not the driver's error that a rollback happened
    # to replace.
    assert len(raised) == 1 and isinstance(raised[0], sa.exc.OperationalError)
    assert raised[0].connection_invalidated


def new_job_row() -> str:
    from conductor.submission import JobCreate, create_job

    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "pool test"}), tenant="pool",
                            settings=get_settings())
    return job.id


@contextmanager
def every_pooled_connection_held(monkeypatch: Any) -> Iterator[None]:
    """Every connection of this process's shared pool checked out (a stall, or 1,000 greenlets on 30
    connections), with a pool timeout short enough for a test; then the default engines again."""
    from conductor.store.db import clear_engines

    monkeypatch.setenv("CONDUCTOR_DB_POOL_TIMEOUT_S", "0.2")
    get_settings.cache_clear()
    clear_engines()
    kept, overflow = pool_sizes()
    held = [get_engine().connect() for _ in range(kept + overflow)]
    try:
        yield
    finally:
        for conn in held:
            conn.close()
        monkeypatch.delenv("CONDUCTOR_DB_POOL_TIMEOUT_S")
        get_settings.cache_clear()
        clear_engines()


def planned_one_step_job(task: str) -> str:
    from conductor.engine import plan_job
    from conductor.submission import JobCreate, create_job

    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": task, "workflow": {
            "model_ids": ["a"], "subtasks": ["x"], "access_lists": [[]]}}), tenant="pool", settings=get_settings())
    plan_job(job.id, settings=get_settings())
    return job.id


def test_a_step_meeting_a_full_pool_is_left_queued_not_failed(monkeypatch: Any) -> None:
    """Every pooled connection busy past the pool's timeout (a stalled database, 1,000 greenlets on 30
    connections) is the database being away: the claim raises and the step stays queued for a re-send.
    Before, SQLAlchemy's pool TimeoutError was taken for a bug and the step was failed (and its job)."""
    from conductor import engine as engine_module
    from conductor.engine import run_step

    job_id = planned_one_step_job("full pool")
    failed_as_bugs: list[str] = []
    real = engine_module._fail_unclaimable
    monkeypatch.setattr(engine_module, "_fail_unclaimable",  # a spy: records, then does what it does
                        lambda job_id, *a, **k: failed_as_bugs.append(job_id) or real(job_id, *a, **k))
    with every_pooled_connection_held(monkeypatch), pytest.raises(sa.exc.TimeoutError):
        run_step(job_id, 0, worker="w", task_id=None, settings=get_settings())
    assert failed_as_bugs == []
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        row = store.get_job(s, job_id=job_id)
    assert step is not None and step.status == "queued" and step.attempts == 0
    assert row is not None and row.status == "running"


def test_the_lease_heartbeat_renews_while_every_pooled_connection_is_busy(monkeypatch: Any) -> None:
    """The heartbeat has a connection of its own: with the shared pool held by 1,000 greenlets (or a
    stall), it still renews the leases of steps that are running. Before, it waited in that pool, timed
    out, and the leases lapsed: the reconciler re-ran steps still running (paid twice)."""
    from datetime import timedelta

    from conductor.lease import Heartbeat
    from conductor.store.models import Step, utcnow

    job_id = new_job_row()
    with session_scope() as s:  # a step this process runs: its lease about to lapse
        step = Step(job_id=job_id, index=0, agent="a", instruction="x", access_list=[], status="running",
                    lease_owner="hb-owner", lease_expires_at=utcnow() + timedelta(seconds=1), attempts=1)
        s.add(step)
        s.flush()
        assert step.id is not None
        step_id = step.id
    heartbeat = Heartbeat(30.0)
    with every_pooled_connection_held(monkeypatch), heartbeat.holding(step_id, "hb-owner"):
        assert heartbeat.beat() == 1  # renewed on its own connection
    with session_scope() as s:
        renewed = s.execute(sa.text("SELECT lease_expires_at > now() + interval '20 seconds' FROM step "
                                    "WHERE id = :i"), {"i": step_id}).scalar_one()
    assert renewed


def test_a_paid_answer_is_recorded_once_the_database_is_back(monkeypatch: Any) -> None:
    """The outcome transaction of a step whose call was paid for meets the database away (here: no pooled
    connection free in time, once): it is tried again while the lease holds, and the answer is kept.
    Before, the error left the step running until its lease lapsed, and the call was made (and paid) again."""
    from conductor.engine import run_step
    from conductor.store import db

    job_id = planned_one_step_job("record me")
    real = store.lock_job_and_record
    faults: list[str] = []

    def away_once(*args: Any, **kwargs: Any) -> Any:  # the injected fault, at the outcome's first statement
        if not faults:
            faults.append("pool timeout")
            raise sa.exc.TimeoutError("QueuePool limit of size 10 overflow 20 reached, connection timed out")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "lock_job_and_record", away_once)
    monkeypatch.setattr(db, "PATIENCE_FIRST_WAIT_S", 0.05)
    run_step(job_id, 0, worker="w", task_id=None, settings=get_settings())
    assert faults == ["pool timeout"]
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        row = store.get_job(s, job_id=job_id)
    assert step is not None and step.status == "succeeded" and step.attempts == 1
    assert row is not None and row.status == "succeeded" and row.answer == step.output
