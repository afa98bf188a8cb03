"""Sends what the engine says is due. A failed send is not lost: the rows say what is due, and the
reconciler re-sends it."""

from __future__ import annotations

import logging

from celery import group

from conductor.engine import Dispatch
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import utcnow

log = logging.getLogger(__name__)


def send(dispatch: Dispatch) -> None:
    from conductor.tasks.jobs import finalize, plan, run_step_task

    for job_id in dispatch.plan:
        plan.apply_async((job_id,))
        with session_scope() as s:
            store.update_job(s, job_id=job_id, enqueued_at=utcnow())
    if dispatch.steps:
        # Independent ready steps go out together as one group: each runs as soon as a worker is free.
        group(run_step_task.si(job_id, index) for job_id, index in dispatch.steps).apply_async()
    for job_id in dispatch.finalize:
        finalize.apply_async((job_id,))


def enqueue_plan(job_id: str) -> bool:
    """Used by the API after the job row is committed; False when the broker is unreachable."""
    try:
        send(Dispatch(plan=[job_id]))
    except Exception as exc:  # any broker/connection failure: the outbox (reconciler) takes over
        log.warning("job %s accepted but not yet enqueued (%s: %s); the reconciler will send it",
                    job_id, type(exc).__name__, exc)
        return False
    return True
