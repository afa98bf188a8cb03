"""Data access for jobs, steps and attempts. Every state change is a conditional update, so a
duplicated or redelivered message can never move a row backwards or run finished work twice."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, col, select

from conductor.store.models import Job, JobStatus, Step, StepAttempt, StepStatus, utcnow


def get_job(session: Session, *, job_id: str, tenant: str | None = None) -> Job | None:
    """A job by id; with ``tenant`` given, another tenant's job is simply not found."""
    stmt = select(Job).where(Job.id == job_id)
    if tenant is not None:
        stmt = stmt.where(Job.tenant == tenant)
    return session.exec(stmt).first()


def get_job_by_idempotency_key(session: Session, *, tenant: str, key: str) -> Job | None:
    return session.exec(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key)).first()


def list_jobs(session: Session, *, tenant: str, status: str | None = None, limit: int = 50) -> list[Job]:
    stmt = select(Job).where(Job.tenant == tenant, col(Job.parent_job_id).is_(None))
    if status:
        stmt = stmt.where(Job.status == status)
    return list(session.exec(stmt.order_by(col(Job.created_at).desc()).limit(limit)))


def get_steps(session: Session, *, job_id: str) -> list[Step]:
    return list(session.exec(select(Step).where(Step.job_id == job_id).order_by(col(Step.index))))


def get_step(session: Session, *, job_id: str, index: int) -> Step | None:
    return session.exec(select(Step).where(Step.job_id == job_id, Step.index == index)).first()


def get_attempts(session: Session, *, step_ids: Sequence[int]) -> list[StepAttempt]:
    if not step_ids:
        return []
    stmt = select(StepAttempt).where(col(StepAttempt.step_id).in_(step_ids)).order_by(
        col(StepAttempt.step_id), col(StepAttempt.n)
    )
    return list(session.exec(stmt))


def get_children(session: Session, *, job_id: str) -> list[Job]:
    return list(session.exec(select(Job).where(Job.parent_job_id == job_id)))


def transition_job(
    session: Session,
    *,
    job_id: str,
    from_: Sequence[str],
    to: str,
    plan_claim: int | None = None,
    **values: Any,
) -> bool:
    """Moves a job to ``to`` only from one of ``from_`` (and, with ``plan_claim``, only if that planning
    claim is still the current one); returns whether this caller won."""
    stmt = sa.update(Job).where(col(Job.id) == job_id, col(Job.status).in_(list(from_)))
    if plan_claim is not None:
        stmt = stmt.where(col(Job.plan_claims) == plan_claim)
    return _rowcount(session.execute(stmt.values(status=to, updated_at=utcnow(), **values))) == 1


def claim_planning(session: Session, *, job_id: str) -> int | None:
    """queued -> planning; returns this claim's number (the fencing token), or None if not queued."""
    won = transition_job(
        session,
        job_id=job_id,
        from_=[JobStatus.QUEUED],
        to=JobStatus.PLANNING,
        started_at=sa.func.coalesce(col(Job.started_at), utcnow()),
        plan_claims=col(Job.plan_claims) + 1,
    )
    if not won:
        return None
    return int(session.execute(sa.select(col(Job.plan_claims)).where(col(Job.id) == job_id)).scalar_one())


def update_job(session: Session, *, job_id: str, **values: Any) -> None:
    session.execute(sa.update(Job).where(col(Job.id) == job_id).values(updated_at=utcnow(), **values))


def insert_steps(session: Session, *, steps: Sequence[Step]) -> None:
    session.add_all(steps)
    session.flush()


def mark_steps_queued(session: Session, *, job_id: str, indices: Sequence[int]) -> list[int]:
    """pending -> queued for each index; returns the indices this caller moved (and must dispatch)."""
    won = []
    now = utcnow()
    for index in indices:
        stmt = (
            sa.update(Step)
            .where(col(Step.job_id) == job_id, col(Step.index) == index, col(Step.status) == StepStatus.PENDING)
            .values(status=StepStatus.QUEUED, queued_at=now)
        )
        if _rowcount(session.execute(stmt)) == 1:
            won.append(index)
    return won


def claim_step(
    session: Session, *, job_id: str, index: int, worker: str, lease_s: float, task_id: str | None
) -> Step | None:
    """queued -> running (or re-take a running step whose lease expired: its worker died).

    ``worker`` must be unique per claim: it is the fencing token every later write of this attempt
    checks, so a worker that lost its lease can no longer record anything.
    Returns the claimed step, or None when the step is finished, running elsewhere, or not due.
    """
    now = utcnow()
    claimable = sa.or_(
        col(Step.status) == StepStatus.QUEUED,
        sa.and_(
            col(Step.status) == StepStatus.RUNNING,
            col(Step.child_job_id).is_(None),
            col(Step.lease_expires_at) < now,
        ),
    )
    stmt = (
        sa.update(Step)
        .where(col(Step.job_id) == job_id, col(Step.index) == index, claimable)
        .values(
            status=StepStatus.RUNNING,
            lease_owner=worker,
            lease_expires_at=now + timedelta(seconds=lease_s),
            started_at=sa.func.coalesce(col(Step.started_at), now),
            celery_task_id=task_id,
        )
    )
    if _rowcount(session.execute(stmt)) != 1:
        return None
    step = get_step(session, job_id=job_id, index=index)
    if step is not None:
        session.refresh(step)
    return step


WORKER_LOST = "WorkerLost"


def close_lost_attempts(session: Session, *, step_id: int) -> int:
    """Attempts still open when a step is re-claimed belonged to a worker that died mid-call."""
    result = session.execute(
        sa.update(StepAttempt)
        .where(col(StepAttempt.step_id) == step_id, col(StepAttempt.finished_at).is_(None))
        .values(
            finished_at=utcnow(),
            error_type=WORKER_LOST,
            error="the worker running this attempt stopped before it finished (its lease expired)",
        )
    )
    return _rowcount(result)


def start_attempt(session: Session, *, step: Step, worker: str, lease_s: float) -> StepAttempt:
    """Opens attempt n+1 and extends the lease to cover it."""
    assert step.id is not None
    n = int(
        session.execute(
            sa.select(sa.func.coalesce(sa.func.max(StepAttempt.n), 0)).where(col(StepAttempt.step_id) == step.id)
        ).scalar_one()
    ) + 1
    attempt = StepAttempt(step_id=step.id, n=n, worker=worker)
    session.add(attempt)
    session.execute(
        sa.update(Step)
        .where(col(Step.id) == step.id)
        .values(attempts=n, lease_expires_at=utcnow() + timedelta(seconds=lease_s))
    )
    session.flush()
    return attempt


def finish_attempt(
    session: Session, *, attempt_id: int, latency_ms: int, error_type: str | None = None, error: str | None = None
) -> None:
    session.execute(
        sa.update(StepAttempt)
        .where(col(StepAttempt.id) == attempt_id)
        .values(finished_at=utcnow(), latency_ms=latency_ms, error_type=error_type, error=error)
    )


def finish_step(
    session: Session, *, step_id: int, to: str, from_: Sequence[str], lease_owner: str | None = None, **values: Any
) -> bool:
    """Records a step's one final outcome; a second completion of the same step changes nothing, and
    with ``lease_owner`` neither does a worker whose claim was taken over."""
    stmt = sa.update(Step).where(col(Step.id) == step_id, col(Step.status).in_(list(from_)))
    if lease_owner is not None:
        stmt = stmt.where(col(Step.lease_owner) == lease_owner)
    stmt = stmt.values(status=to, finished_at=utcnow(), lease_expires_at=None, **values)
    return _rowcount(session.execute(stmt)) == 1


def add_unrecorded_usage(
    session: Session, *, step_id: int, job_id: str, input_tokens: int, output_tokens: int, cost_usd: float
) -> None:
    """A call whose answer was dropped (the job was cancelled or failed meanwhile, or another worker took
    the step over) was still paid for: its usage is added to the step, and to the job's totals when the
    job has already ended (a running job's totals are summed from its steps when it ends)."""
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "cost_usd": cost_usd}
    session.execute(
        sa.update(Step)
        .where(col(Step.id) == step_id)
        .values({getattr(Step, k): getattr(Step, k) + v for k, v in usage.items()})
    )
    session.execute(
        sa.update(Job)
        .where(col(Job.id) == job_id, col(Job.status).in_(list(JobStatus.TERMINAL)))
        .values({getattr(Job, k): getattr(Job, k) + v for k, v in usage.items()})  # the call is an attempt: counted
    )


def renew_lease(session: Session, *, step_id: int, lease_owner: str, seconds: float) -> bool:
    stmt = (
        sa.update(Step)
        .where(col(Step.id) == step_id, col(Step.lease_owner) == lease_owner, col(Step.status) == StepStatus.RUNNING)
        .values(lease_expires_at=utcnow() + timedelta(seconds=seconds))
    )
    return _rowcount(session.execute(stmt)) == 1


def update_step(session: Session, *, step_id: int, **values: Any) -> None:
    session.execute(sa.update(Step).where(col(Step.id) == step_id).values(**values))


def close_open_steps(
    session: Session, *, job_id: str, to: str, include_running: bool = False, include_waiting: bool = False
) -> int:
    """Marks not-yet-finished steps ``to`` (skipped on failure, cancelled on cancel): pending and queued
    ones; running ones too with ``include_running``; with ``include_waiting``, recursive steps that are
    only waiting on a child job (a step mid-call is left to record what it finishes)."""
    unfinished: sa.ColumnElement[bool] = col(Step.status).in_([StepStatus.PENDING, StepStatus.QUEUED])
    if include_running:
        unfinished = col(Step.status).in_([StepStatus.PENDING, StepStatus.QUEUED, StepStatus.RUNNING])
    elif include_waiting:
        unfinished = sa.or_(
            unfinished, sa.and_(col(Step.status) == StepStatus.RUNNING, col(Step.child_job_id).is_not(None))
        )
    stmt = (
        sa.update(Step)
        .where(col(Step.job_id) == job_id, unfinished)
        .values(status=to, finished_at=utcnow(), lease_expires_at=None)
    )
    return _rowcount(session.execute(stmt))


# --- what the reconciler looks for ----------------------------------------------------------------


def running_steps_with_children(session: Session, *, job_id: str) -> list[Step]:
    return list(
        session.exec(
            select(Step).where(
                Step.job_id == job_id, Step.status == StepStatus.RUNNING, col(Step.child_job_id).is_not(None)
            )
        )
    )


def jobs_never_enqueued(session: Session, *, older_than: datetime, limit: int = 100) -> list[str]:
    stmt = select(Job.id).where(
        Job.status == JobStatus.QUEUED, col(Job.enqueued_at).is_(None), Job.created_at < older_than
    )
    return list(session.exec(stmt.limit(limit)))


def jobs_stuck_queued(session: Session, *, older_than: datetime, limit: int = 500) -> list[Job]:
    """Queued jobs whose plan message was sent a while ago but not yet picked up (lost, or waiting)."""
    stmt = select(Job).where(
        Job.status == JobStatus.QUEUED, col(Job.enqueued_at).is_not(None), col(Job.enqueued_at) < older_than
    )
    return list(session.exec(stmt.order_by(col(Job.enqueued_at)).limit(limit)))


def jobs_stuck_planning(session: Session, *, older_than: datetime, limit: int = 100) -> list[str]:
    stmt = select(Job.id).where(Job.status == JobStatus.PLANNING, Job.updated_at < older_than)
    return list(session.exec(stmt.limit(limit)))


def running_job_ids(session: Session, *, older_than: datetime, limit: int = 500) -> list[str]:
    """Running jobs, least recently examined first; the reconciler touches each one it examines, so
    with more than ``limit`` running jobs successive passes rotate through all of them."""
    stmt = select(Job.id).where(Job.status == JobStatus.RUNNING, Job.updated_at < older_than)
    ids = list(session.exec(stmt.order_by(col(Job.updated_at)).limit(limit)))
    if ids:
        session.execute(sa.update(Job).where(col(Job.id).in_(ids)).values(updated_at=utcnow()))
    return ids


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)
