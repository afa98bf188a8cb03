"""Thin tasks: take ids, call the engine, send what it says is due next."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from celery import Task

from conductor.engine import Dispatch, finalize_job, plan_job, run_step
from conductor.settings import get_settings
from conductor.tasks.app import FINALIZE_TASK, PLAN_TASK, RECONCILE_TASK, RUN_STEP_TASK, app
from conductor.tasks.send import send

log = logging.getLogger(__name__)


def _worker_name(task: Task) -> str:
    hostname = task.request.hostname or socket.gethostname()
    return f"{hostname}/{threading.current_thread().name}"[:128]


@app.task(name=PLAN_TASK, bind=True)
def plan(self: Task, job_id: str) -> None:
    send(plan_job(job_id, settings=get_settings()))


@app.task(name=RUN_STEP_TASK, bind=True)
def run_step_task(self: Task, job_id: str, index: int) -> None:
    outcome = run_step(job_id, index, worker=_worker_name(self), task_id=self.request.id, settings=get_settings())
    send(outcome)


@app.task(name=FINALIZE_TASK, bind=True)
def finalize(self: Task, job_id: str) -> None:
    send(finalize_job(job_id))


@app.task(name=RECONCILE_TASK, bind=True)
def reconcile(self: Task) -> dict[str, Any]:
    from conductor.reconcile import reconcile_once

    report, dispatch = reconcile_once(get_settings())
    send(dispatch)
    return report


__all__ = ["Dispatch", "finalize", "plan", "reconcile", "run_step_task"]
