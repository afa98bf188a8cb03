"""Sends what the engine says is due. A failed send is not lost: the rows say what is due, and the
reconciler re-sends it.

Tasks are sent by name (the constants in ``conductor.tasks.app``): this module never imports the one
that defines them (``conductor.tasks.jobs``, which imports this one to send what a task's run made due).
"""

from __future__ import annotations

import logging
from datetime import timedelta

from conductor.engine import Dispatch
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store import webhooks as webhook_store
from conductor.store.db import session_scope
from conductor.store.models import utcnow
from conductor.tasks.app import DELIVER_WEBHOOK_TASK, FINALIZE_TASK, PLAN_TASK, RUN_STEP_TASK, STEPS_QUEUE, app

log = logging.getLogger(__name__)
BATCH_PRIORITY = 9
"""The messages of batch work (a batch's lines and their child jobs: ``Dispatch.background``): the lowest of
kombu's Redis priorities (0, 3, 6, 9; a worker's BRPOP asks for every queue's priority-0 list first), so a
worker takes every live job's plan and step before a batch's, whatever the batch's size. The plan, each step
(after the plan, after an outcome made it ready) and a finalize message go at it, and so do the reconciler's
re-sends of them (a message lost, still waiting, or never sent). A batch's step is never continued in the
slot of the worker that made it ready (``engine._dispatch_ready``): it goes back to the broker, behind live
work."""
COUNTDOWN_MAX_S = 300.0
"""Webhook retries due within this long wait in the broker as countdown messages. Later ones are sent by
the reconciler when due: a Redis message held past its visibility timeout would be delivered twice, and
Postgres already holds the schedule."""


def send(dispatch: Dispatch) -> None:
    for taken in [dispatch.taken, *dispatch.alongside]:  # a caller's bug: only the slot it was claimed for may run it
        if taken is not None:
            log.error("step %s/%s was claimed for this slot but is not run by it; it re-runs when its lease "
                      "expires", taken.job_id, taken.index)
    for job_id in dispatch.plan:
        app.send_task(PLAN_TASK, (job_id,), argsrepr=f"job={job_id}",
                      priority=BATCH_PRIORITY if job_id in dispatch.background else None)
        with session_scope() as s:
            store.update_job(s, job_id=job_id, enqueued_at=utcnow())
    if dispatch.steps:
        agents = _agents(dispatch)
        queues = get_settings().step_queues
        # Independent ready steps go out one message each on one producer: each runs as soon as a worker is
        # free. (A Celery group of them cost a third more CPU per message and added nothing: Redis has no
        # atomic multi-publish either way, and no result is read from Celery.)
        with app.producer_or_acquire() as producer:
            for job_id, index in dispatch.steps:
                agent = agents.get((job_id, index))
                app.send_task(RUN_STEP_TASK, (job_id, index), producer=producer,
                              argsrepr=step_label(job_id, index, agent), queue=queues.get(agent or "", STEPS_QUEUE),
                              priority=BATCH_PRIORITY if job_id in dispatch.background else None)
    for job_id in dispatch.finalize:
        app.send_task(FINALIZE_TASK, (job_id,), argsrepr=f"job={job_id}",
                      priority=BATCH_PRIORITY if job_id in dispatch.background else None)
    if dispatch.webhooks:
        for delivery_id in dispatch.webhooks:
            app.send_task(DELIVER_WEBHOOK_TASK, (delivery_id,), argsrepr=f"delivery={delivery_id}")
        with session_scope() as s:
            webhook_store.mark_sent(s, delivery_ids=dispatch.webhooks, due_at=utcnow())


def _agents(dispatch: Dispatch) -> dict[tuple[str, int], str]:
    """Each step's agent: the engine names them; only with per-agent queues configured are the ones it
    did not name looked up, so that no step reaches the wrong queue."""
    missing = [key for key in dispatch.steps if key not in dispatch.agents]
    if not missing or not get_settings().step_queues:
        return dispatch.agents
    with session_scope() as s:
        return {**dispatch.agents, **store.step_agents(s, keys=missing)}


def step_label(job_id: str, index: int, agent: str | None) -> str:
    """What Flower and the worker log show as a step task's arguments (the message's real arguments
    stay ``(job_id, index)``)."""
    return f"job={job_id} step={index}" + (f" agent={agent}" if agent else "")


def schedule_webhook_retry(delivery_id: str, delay_s: float) -> None:
    if delay_s > COUNTDOWN_MAX_S:
        return  # the reconciler sends it when it is due
    app.send_task(DELIVER_WEBHOOK_TASK, (delivery_id,), countdown=delay_s, argsrepr=f"delivery={delivery_id}")
    with session_scope() as s:
        webhook_store.mark_sent(s, delivery_ids=[delivery_id], due_at=utcnow() + timedelta(seconds=delay_s))


def send_webhooks(delivery_ids: list[str]) -> None:
    """Sends the messages of deliveries made due now (a parked one woken); if the broker is away, the
    reconciler sends them when due (no message is noted as sent)."""
    try:
        send(Dispatch(webhooks=delivery_ids))
    except Exception as exc:  # any broker failure: the rows say they are due, the reconciler sends them
        log.warning("webhook deliveries %s not yet enqueued (%s); the reconciler will send them", delivery_ids,
                    type(exc).__name__)


def send_webhooks_of(job_id: str) -> None:
    """Sends the webhook a job that just ended (cancelled by the API or CLI) is owed; if the broker is
    down, the reconciler sends it later."""
    with session_scope() as s:
        owed = webhook_store.pending_unsent(s, job_id=job_id)
    if owed:
        send_webhooks(owed)


def enqueue_plan(job_id: str, *, recorded: bool = False, background: bool = False) -> bool:
    """Used by the API after the job row is committed; False when the broker is unreachable.

    ``recorded``: the row was inserted with ``enqueued_at`` already set (``create_job(publishing=True)``),
    so only the message is sent here; if it cannot be, ``enqueued_at`` is cleared so that the reconciler
    sends the job within ``ENQUEUE_GRACE_S``. Should this process die between the commit and the send,
    the job looks sent and is re-sent as a lost message, within ``reconcile_stale_s`` plus an interval.
    ``background``: a batch's line, sent at ``BATCH_PRIORITY``."""
    try:
        if recorded:
            app.send_task(PLAN_TASK, (job_id,), argsrepr=f"job={job_id}",
                          priority=BATCH_PRIORITY if background else None)
        else:
            send(Dispatch(plan=[job_id], background={job_id} if background else set()))
    except Exception as exc:  # any broker/connection failure: the outbox (reconciler) takes over
        log.warning("job %s accepted but not yet enqueued (%s: %s); the reconciler will send it",
                    job_id, type(exc).__name__, exc)
        if recorded:
            _unrecord(job_id)
        return False
    return True


def _unrecord(job_id: str) -> None:
    try:
        with session_scope() as s:
            store.update_job(s, job_id=job_id, enqueued_at=None)
    except Exception as exc:  # the database is away too: the job is re-sent as a lost message instead
        log.warning("job %s: could not clear enqueued_at (%s); the reconciler re-sends it as a lost message",
                    job_id, type(exc).__name__)
