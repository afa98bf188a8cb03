"""Thin tasks: take ids, call the engine, send what it says is due next."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from celery import Task
from kombu.exceptions import OperationalError as BrokerAway

from conductor.engine import Dispatch, Taken, Taker, finalize_job, holding_taken, plan_job, run_step, run_taken
from conductor.settings import Settings, get_settings
from conductor.store.db import DATABASE_AWAY, driver_reason, unreachable
from conductor.tasks.alongside import THREAD_PREFIX, local_slots
from conductor.tasks.app import FINALIZE_TASK, PLAN_TASK, RECONCILE_TASK, RUN_STEP_TASK, STEPS_QUEUE, app
from conductor.tasks.send import send, step_label

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Slot:
    """What a task's run needs of its Celery request, read once in the task's own thread: the threads
    that run steps beside it (``conductor.tasks.alongside``) cannot read ``task.request``, a thread-local."""

    hostname: str
    task_id: str | None
    consumed: frozenset[str]
    """The queues this worker takes messages from (``-Q``; every declared queue when not narrowed)."""

    @classmethod
    def of(cls, task: Task) -> _Slot:
        return cls(task.request.hostname or socket.gethostname(), task.request.id,
                   frozenset(task.app.amqp.queues.consume_from))

    def worker(self) -> str:
        return f"{self.hostname}/{threading.current_thread().name}"[:128]

    def taker(self, settings: Settings) -> Taker | None:
        """This slot, for an outcome to claim the steps it makes ready whose queues this worker consumes,
        in its own transaction: one to run here, and as many to run beside it as the process has local
        slots free; None when ``worker_continue_steps`` is off."""
        if not settings.worker_continue_steps:
            return None
        queues, consumed = settings.step_queues, self.consumed
        return Taker(worker=self.worker(), task_id=self.task_id, settings=settings,
                     runs=lambda _job, _index, agent: queues.get(agent, STEPS_QUEUE) in consumed,
                     spare=local_slots(settings.worker_local_slots).spare, beside=f"{self.hostname}/{THREAD_PREFIX}")


@contextmanager
def _database_away_is_logged(what: str, recovery: str) -> Iterator[None]:
    """A task that meets Postgres away (``store.db.unreachable``: down, restarting, refusing, every pooled
    connection busy) logs one warning line saying what it was doing and who recovers it, and ends, instead
    of raising the error for Celery to log as "raised unexpected" with its traceback, at every task of an
    outage. Ending is what raising did: the message is acknowledged either way (``task_acks_late`` acks a
    failed task too), and what the task left is in the rows, which the reconciler re-drives (a job still
    queued is re-sent, a planning whose heartbeat stopped re-driven, a step still queued re-sent, one
    claimed re-sent when its lease lapses; docs/architecture.md, Recovery bounds). Any other error,
    ``OperationalError`` from a live server included (a deadlock, a lock timeout), still raises."""
    try:
        yield
    except DATABASE_AWAY as exc:
        if not unreachable(exc):
            raise
        log.warning("%s: the database is away (%s: %s); %s", what, type(exc).__name__, driver_reason(exc), recovery)


@app.task(name=PLAN_TASK, bind=True)
def plan(self: Task, job_id: str) -> None:
    settings = get_settings()
    slot = _Slot.of(self)
    take = slot.taker(settings)
    with _database_away_is_logged(f"task {slot.task_id} planning job {job_id}",
                                  "the reconciler re-drives the job once it is back"):
        _run_on(slot, plan_job(job_id, settings=settings, take=take), take)


@app.task(name=RUN_STEP_TASK, bind=True)
def run_step_task(self: Task, job_id: str, index: int) -> None:
    settings = get_settings()
    slot = _Slot.of(self)
    take = slot.taker(settings)
    with _database_away_is_logged(f"task {slot.task_id} running {step_label(job_id, index, None)}",
                                  "the reconciler re-sends the step once it is back"):
        _run_on(slot, run_step(job_id, index, worker=slot.worker(), task_id=slot.task_id, settings=settings,
                               take=take), take)


def _run_on(slot: _Slot, due: Dispatch, take: Taker | None = None) -> None:
    """Sends what ``due`` names, except the ready steps this worker runs itself: one runs here, in this
    task's slot, and so on down the chain (``Settings.worker_continue_steps``); steps claimed beside it
    (``due.alongside``) start at once on the process's local slots, and the task ends when they have.
    Everything else is sent first, so parallel steps still start at once on any worker. A step the
    outcome already claimed for this slot (``due.taken``) is the one run here; otherwise the first ready
    step this worker consumes is claimed here."""
    beside: list[Future[None]] = []
    try:
        _continue(slot, due, take, beside)
    finally:
        failed = [exc for exc in (future.exception() for future in beside) if exc is not None]
    if failed:
        raise failed[0]


def _continue(slot: _Slot, due: Dispatch, take: Taker | None, beside: list[Future[None]]) -> None:
    settings = get_settings()
    slots = local_slots(settings.worker_local_slots)
    # Claimed to run beside, but the local slots filled up meanwhile: they run here after this task's own
    # chain, their leases kept by the heartbeat while they wait (released, to lapse, if this task raises).
    later: list[tuple[Taken, ExitStack]] = []
    try:
        while True:
            taken, due.taken = due.taken, None
            for step in due.alongside:
                future = slots.start(_run_beside, slot, step)
                if future is None:
                    held = ExitStack()
                    held.enter_context(holding_taken(step, settings))
                    later.append((step, held))
                    continue
                beside.append(future)
                log.info("task %s runs %s beside it (claimed with the transaction that made it ready; no message)",
                         slot.task_id, step_label(step.job_id, step.index, step.agent))
            due.alongside = []
            if taken is None and later:
                taken, held = later.pop(0)
                held.close()  # its run holds the lease from here
            if taken is not None:
                _send_rest(slot, due)
                log.info("task %s continues with %s (claimed with the outcome that made it ready; no message)",
                         slot.task_id, step_label(taken.job_id, taken.index, taken.agent))
                due = run_taken(taken, settings=settings, take=take)
                continue
            mine = _step_to_continue(due, slot.consumed, settings) if settings.worker_continue_steps else None
            if mine is None:
                _send_rest(slot, due)
                return
            due.steps.remove(mine)
            _send_rest(slot, due)
            job_id, index = mine
            log.info("task %s continues with %s (made ready here; no message)", slot.task_id,
                     step_label(job_id, index, due.agents.get(mine)))
            take = take or slot.taker(settings)
            due = run_step(job_id, index, worker=slot.worker(), task_id=slot.task_id, settings=settings, take=take)
    finally:
        for step, held in later:
            log.error("task %s raised before running %s, claimed beside it; its lease lapses and the reconciler "
                      "re-sends it", slot.task_id, step_label(step.job_id, step.index, step.agent))
            held.close()


def _send_rest(slot: _Slot, due: Dispatch) -> None:
    """Sends what ``due`` names besides the step this task runs next. With the broker away (kombu's
    ``OperationalError``, after the publish retries) the rest is left to the reconciler, as the API leaves
    a submission's plan: the rows say what is due (a step queued and not sent is re-sent once its message
    is ``reconcile_stale_s`` overdue, a plan never enqueued at the next pass, a webhook at its due time), and
    the task goes on with its own step, which needs Postgres and its provider, not the broker. Raising here
    instead left that step queued for the reconciler, or claimed until its lease lapsed."""
    try:
        send(due)
    except BrokerAway as exc:
        log.warning("task %s: what it made due is not sent yet (broker away: %s); the reconciler sends it",
                    slot.task_id, exc)


def _run_beside(slot: _Slot, step: Taken) -> None:
    """A local slot's run of a step claimed beside its task's own: that step, and the chain it continues."""
    try:
        _run_on(slot, Dispatch(taken=step), slot.taker(get_settings()))
    except Exception as exc:
        if not unreachable(exc):  # the database away: the task's own warning says it, without a traceback
            log.exception("task %s: the run of %s beside it raised", slot.task_id,
                          step_label(step.job_id, step.index, step.agent))
        raise


def _step_to_continue(due: Dispatch, consumed: frozenset[str], settings: Settings) -> tuple[str, int] | None:
    """The first ready step whose queue this worker consumes: running it here is what a worker of that
    queue would do after taking its message. Not a batch's step (``due.background``): it waits on the broker
    behind live work, as sent."""
    for key in due.steps:
        if key[0] in due.background:
            continue
        agent = due.agents.get(key)
        if agent is None and settings.step_queues:
            continue  # its queue is unknown here: send it, and the sender looks it up
        if settings.step_queues.get(agent or "", STEPS_QUEUE) in consumed:
            return key
    return None


@app.task(name=FINALIZE_TASK, bind=True)
def finalize(self: Task, job_id: str) -> None:
    due: Dispatch | None = None
    with _database_away_is_logged(f"task {self.request.id} finalizing job {job_id}",
                                  "the reconciler finalizes the job once it is back"):
        due = finalize_job(job_id)  # committed: what it made due is in the rows
    if due is None:
        return
    try:
        send(due)
    except BrokerAway as exc:  # as _send_rest: the reconciler sends it (a step queued, a webhook due)
        log.warning("job %s: what its finalize made due is not sent yet (broker away: %s); the reconciler sends "
                    "it", job_id, exc)


@app.task(name=RECONCILE_TASK, bind=True)
def reconcile(self: Task) -> dict[str, Any]:
    from conductor.reconcile import reconcile_once

    with _database_away_is_logged("reconciler pass", "the next pass does its work"):
        report, _ = reconcile_once(get_settings(), send=send)  # sent before the pass's batch work
        return report
    return {"database_away": True}


__all__ = ["Dispatch", "finalize", "plan", "reconcile", "run_step_task"]
