"""Prebuilt statements run on the driver's cursor (conductor/store/direct.py) answer exactly what
SQLAlchemy's own execution answers: the same rows, with the same types (UTC timestamps, parsed JSON,
floats), the same row counts and the same exception types."""

from __future__ import annotations

from datetime import UTC

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from conductor.engine import plan_job
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import get_engine, session_scope
from conductor.store.direct import Direct, Rows
from conductor.store.models import StepAttempt
from conductor.submission import JobCreate, create_job


def planned_job() -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({
            "task": "direct", "limits": {"max_cost_usd": 2.5},
            "workflow": {"model_ids": ["a", "b"], "subtasks": ["one", "two"], "access_lists": [[], [0]]}}),
            tenant="direct", settings=get_settings())
    plan_job(job.id, settings=get_settings())
    return job.id


def both(s: Session, stmt: sa.Executable, params: dict[str, object]) -> tuple[Rows, sa.CursorResult[object]]:
    direct = Direct(s).execute(stmt, params)
    assert isinstance(direct, Rows)  # Postgres: the cursor path was taken, not SQLAlchemy's
    return direct, s.connection().execute(stmt, params)


def test_reads_answer_what_sqlalchemy_answers() -> None:
    job_id = planned_job()
    with Session(get_engine()) as s:
        direct, orm = both(s, store._read_step_input_stmt(True), {"p_job_id": job_id, "p_index": 1})
        row, expected = direct.first(), orm.first()
        assert row is not None and expected is not None
        assert tuple(row) == tuple(expected)
        assert [type(v) for v in row] == [type(v) for v in expected]
        assert row[5].tzinfo is not None and row[5].utcoffset() == UTC.utcoffset(None)  # created_at
        assert row[3]["max_cost_usd"] == 2.5  # the job's limits, parsed JSON
        assert row[10] == [0]  # the access list, parsed JSON
        assert row[13] is False  # not batch work (a live top-level job)
        assert row[14] == 1  # the job's last step index: the answering step's (max_answer_tokens)
        assert row[15] == [["one", None]]  # step 0's subtask and (not yet) answer, aggregated as JSON
        direct, orm = both(s, store._step_heads_stmt(), {"p_job_id": job_id})
        assert [tuple(r) for r in direct] == [tuple(r) for r in orm] and len(direct.rows) == 2
        direct, _ = both(s, store._lock_job_stmt(), {"p_job_id": "0" * 32})
        assert direct.first() is None and direct.rows == []


def test_updates_report_their_row_counts_and_returned_rows() -> None:
    job_id = planned_job()
    with session_scope() as s:
        moved = Direct(s).execute(store._mark_queued_stmt(True), {"p_job_id": job_id, "p_indices": [1],
                                                                  "p_now": store.utcnow()})
        assert isinstance(moved, Rows) and moved.scalars() == [1]  # one array parameter: the cursor path
        seen = Direct(s).execute(store._visible_outputs_stmt(), {"p_job_id": job_id, "p_indices": [0, 1]})
        assert not isinstance(seen, Rows)  # an expanding IN: SQLAlchemy's path, the same interface
        assert [tuple(r) for r in seen] == [("one", None), ("two", None)]
        heads = store.step_heads(s, job_id=job_id)
        assert [h.status for h in heads] == ["queued", "queued"]
    with session_scope() as s:
        assert store.transition_job(s, job_id=job_id, from_=["running"], to="running", workflow_source="x")
        assert not store.transition_job(s, job_id=job_id, from_=["queued"], to="running")
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.workflow_source == "x"


def test_errors_arrive_as_sqlalchemy_errors_and_roll_back() -> None:
    job_id = planned_job()
    with pytest.raises(sa.exc.IntegrityError, match=r"(?i)foreign key"), session_scope() as s:
        assert store.claim_planning_job(s, job_id=job_id) is None  # running: not claimable, a no-op
        store.transition_job(s, job_id=job_id, from_=["running"], to="running", workflow_source="rolled back")
        store.open_attempt(s, step_id=-1, n=1, worker="w")  # no such step: the foreign key refuses it
    with session_scope() as s:  # nothing of that transaction was written, and the pool is usable
        job = store.get_job(s, job_id=job_id)
        assert job is not None and job.status == "running" and job.workflow_source != "rolled back"


def test_the_connection_is_kept_only_for_a_single_transaction_session() -> None:
    from conductor.store.db import transaction

    def body(s: Session) -> bool:
        first = store._core(s)
        return store._core(s) is first and first.connection is s.connection()

    assert transaction(body)
    job_id = planned_job()
    with session_scope() as s:  # may commit midway: the next transaction may run on another connection
        before = store._core(s)
        assert store.lock_job(s, job_id=job_id) is not None
        s.commit()
        after = store._core(s)
        assert after is not before and after.connection is s.connection()
        assert store.lock_job(s, job_id=job_id) is not None


def test_a_pipeline_answers_each_statement_and_raises_the_first_error_as_sqlalchemy_would() -> None:
    job_id = planned_job()
    with session_scope() as s:
        lock, heads = Direct(s).execute_pipelined([(store._lock_job_stmt(), {"p_job_id": job_id}),
                                                   (store._step_heads_stmt(), {"p_job_id": job_id})])
        assert isinstance(lock, Rows) and lock.first() is not None and lock.first()[0] == job_id  # type: ignore[index]
        assert [r[0] for r in heads] == [0, 1]
    with pytest.raises(sa.exc.IntegrityError, match=r"(?i)foreign key"), session_scope() as s:
        Direct(s).execute_pipelined([(store._lock_job_stmt(), {"p_job_id": job_id}),
                                     (store._open_attempt_stmt(), {"p_step_id": -1, "p_n": 1, "p_worker": "w",
                                                                   "p_now": store.utcnow()})])
    with session_scope() as s:  # rolled back; the pool's connection is usable
        assert store.lock_job(s, job_id=job_id) is not None


def test_a_transaction_commits_its_direct_and_orm_writes_together_or_neither() -> None:
    from conductor.store.db import transaction

    job_id = planned_job()
    with session_scope() as s:
        step = store.get_step(s, job_id=job_id, index=0)
        assert step is not None and step.id is not None
        step_id = step.id

    def body(s: Session, source: str, n: int, fail: bool) -> bool:
        assert store.transition_job(s, job_id=job_id, from_=["running"], to="running", workflow_source=source)
        s.add(StepAttempt(step_id=step_id, n=n, worker="orm"))  # the ORM's, left for the commit to flush
        if fail:
            raise RuntimeError("the body failed")
        return True

    assert transaction(lambda s: body(s, "both", 98, False))
    with pytest.raises(RuntimeError):
        transaction(lambda s: body(s, "neither", 99, True))
    with session_scope() as s:
        job = store.get_job(s, job_id=job_id)
        attempts = store.get_attempts(s, step_ids=[step_id])
    assert job is not None and job.workflow_source == "both"
    assert [a.n for a in attempts] == [98]
