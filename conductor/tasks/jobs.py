"""Thin tasks: take ids, call the engine, send what it says is due next."""

from __future__ import annotations

import logging
import socket
import threading
from typing import Any

from celery import Task

from conductor.engine import Dispatch, Taker, finalize_job, plan_job, run_step, run_taken
from conductor.settings import Settings, get_settings
from conductor.tasks.app import FINALIZE_TASK, PLAN_TASK, RECONCILE_TASK, RUN_STEP_TASK, STEPS_QUEUE, app
from conductor.tasks.send import send, step_label

log = logging.getLogger(__name__)


def _worker_name(task: Task) -> str:
    hostname = task.request.hostname or socket.gethostname()
    return f"{hostname}/{threading.current_thread().name}"[:128]


@app.task(name=PLAN_TASK, bind=True)
def plan(self: Task, job_id: str) -> None:
    settings = get_settings()
    take = _taker(self, settings)
    _run_on(self, plan_job(job_id, settings=settings, take=take), take)


@app.task(name=RUN_STEP_TASK, bind=True)
def run_step_task(self: Task, job_id: str, index: int) -> None:
    settings = get_settings()
    take = _taker(self, settings)
    _run_on(self, run_step(job_id, index, worker=_worker_name(self), task_id=self.request.id, settings=settings,
                           take=take), take)


def _taker(task: Task, settings: Settings) -> Taker | None:
    """This task's slot, for an outcome to claim one of the steps it makes ready (a step whose queue this
    worker consumes) in its own transaction; None when ``worker_continue_steps`` is off."""
    if not settings.worker_continue_steps:
        return None
    consumed = _consumed_queues(task)
    queues = settings.step_queues
    return Taker(worker=_worker_name(task), task_id=task.request.id, settings=settings,
                 runs=lambda _job, _index, agent: queues.get(agent, STEPS_QUEUE) in consumed)


def _run_on(task: Task, due: Dispatch, take: Taker | None = None) -> None:
    """Sends what ``due`` names, except one ready step this worker can run itself: that one runs here, in
    this task's slot, and so on down the chain (``Settings.worker_continue_steps``). Its siblings are sent
    first, so parallel steps still start at once on any worker. A step the outcome already claimed for this
    slot (``due.taken``) is that one; otherwise the first ready step this worker consumes is claimed here."""
    settings = get_settings()
    consumed = _consumed_queues(task)
    while True:
        taken, due.taken = due.taken, None
        if taken is not None:
            send(due)
            log.info("task %s continues with %s (claimed with the outcome that made it ready; no message)",
                     task.request.id, step_label(taken.job_id, taken.index, taken.agent))
            due = run_taken(taken, settings=settings, take=take)
            continue
        mine = _step_to_continue(due, consumed, settings) if settings.worker_continue_steps else None
        if mine is None:
            send(due)
            return
        due.steps.remove(mine)
        send(due)
        job_id, index = mine
        log.info("task %s continues with %s (made ready here; no message)", task.request.id,
                 step_label(job_id, index, due.agents.get(mine)))
        take = take or _taker(task, settings)
        due = run_step(job_id, index, worker=_worker_name(task), task_id=task.request.id, settings=settings,
                       take=take)


def _consumed_queues(task: Task) -> set[str]:
    """The queues this worker takes messages from (``-Q``; every declared queue when not narrowed)."""
    return set(task.app.amqp.queues.consume_from)


def _step_to_continue(due: Dispatch, consumed: set[str], settings: Settings) -> tuple[str, int] | None:
    """The first ready step whose queue this worker consumes: running it here is what a worker of that
    queue would do after taking its message."""
    for key in due.steps:
        agent = due.agents.get(key)
        if agent is None and settings.step_queues:
            continue  # its queue is unknown here: send it, and the sender looks it up
        if settings.step_queues.get(agent or "", STEPS_QUEUE) in consumed:
            return key
    return None


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
