"""Data access for evaluation runs: tagging jobs with their run, storing rewards, reading them back."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlmodel import Session, col, select

from conductor.store.models import Job, Step


def tag_job(session: Session, *, job_id: str, eval_run: str) -> None:
    session.execute(sa.update(Job).where(col(Job.id) == job_id).values(eval_run=eval_run))


def set_reward(session: Session, *, job_id: str, reward: float) -> None:
    session.execute(sa.update(Job).where(col(Job.id) == job_id).values(reward=reward))


def jobs_by_id(session: Session, *, job_ids: Sequence[str]) -> dict[str, Job]:
    if not job_ids:
        return {}
    return {job.id: job for job in session.exec(select(Job).where(col(Job.id).in_(list(job_ids))))}


def step_counts(session: Session, *, job_ids: Sequence[str]) -> dict[str, int]:
    if not job_ids:
        return {}
    stmt = (
        select(Step.job_id, sa.func.count())
        .where(col(Step.job_id).in_(list(job_ids)))
        .group_by(col(Step.job_id))
    )
    return {job_id: int(count) for job_id, count in session.exec(stmt)}


def rewarded_jobs(session: Session, *, eval_run: str) -> list[Job]:
    """The run's top-level jobs that carry a reward, oldest first."""
    stmt = (
        select(Job)
        .where(Job.eval_run == eval_run, col(Job.reward).is_not(None), col(Job.parent_job_id).is_(None))
        .order_by(col(Job.created_at))
    )
    return list(session.exec(stmt))
