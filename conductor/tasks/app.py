"""The one Celery app. Every setting here is a reliability decision; the reason sits beside it."""

from __future__ import annotations

import logging
import warnings
from typing import Any

from celery import Celery, bootsteps
from celery.exceptions import CPendingDeprecationWarning
from celery.signals import worker_init, worker_ready
from kombu import Queue

from conductor.settings import Settings, get_settings
from conductor.tasks import transport

log = logging.getLogger(__name__)
transport.install()  # one Redis client per broker channel (conductor/tasks/transport.py)

PLANNER_QUEUE = "planner"
STEPS_QUEUE = "steps"
MAINTENANCE_QUEUE = "maintenance"
"""The reconciler's own queue: a pass never waits behind a backlog of steps (which is exactly when
recovery is needed). Give it a consumer of its own (compose runs one) or a worker with a free slot."""
WEBHOOKS_QUEUE = "webhooks"
"""Webhook deliveries wait on receivers; their own queue keeps a slow receiver off the step workers."""
QUEUES = (PLANNER_QUEUE, STEPS_QUEUE, MAINTENANCE_QUEUE, WEBHOOKS_QUEUE)
RECONCILE_EXPIRES_INTERVALS = 4

# Tasks are sent by name (``send.py``), so sending never imports the module that defines them.
PLAN_TASK = "conductor.plan"
RUN_STEP_TASK = "conductor.run_step"
FINALIZE_TASK = "conductor.finalize"
RECONCILE_TASK = "conductor.reconcile"
DELIVER_WEBHOOK_TASK = "conductor.deliver_webhook"


def all_queues(settings: Settings) -> tuple[str, ...]:
    """The fixed queues plus the per-agent step queues of ``CONDUCTOR_STEP_QUEUES``."""
    return (*QUEUES, *sorted(set(settings.step_queues.values()) - set(QUEUES)))


BROKER_MAX_CONNECTIONS = 200
"""Redis connections per pool of a process; Redis's own limit (maxclients) is 10,000."""


def celery_config(settings: Settings) -> dict[str, object]:
    # A message may sit unacknowledged on Redis this long before Redis hands it to another worker.
    # It exceeds the longest step, so a slow step rarely gets a second copy (whose claim is refused
    # anyway while the step's lease is renewed).
    visibility_timeout = int(settings.step_lease_s + settings.step_max_duration_s() + 120)
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.result_backend,
        # JSON only: a pickle payload from the broker would be code execution.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        # Ack after the task ran, and re-queue if the worker process died mid-task: with the claim and
        # lease in Postgres, a redelivered message for a finished step does nothing.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # Steps run for minutes: a worker takes one message per free slot, never a backlog it can't serve.
        "worker_prefetch_multiplier": 1,
        "task_queues": tuple(Queue(name) for name in all_queues(settings)),
        "task_default_queue": STEPS_QUEUE,
        "task_routes": {
            PLAN_TASK: {"queue": PLANNER_QUEUE},
            RUN_STEP_TASK: {"queue": STEPS_QUEUE},
            FINALIZE_TASK: {"queue": STEPS_QUEUE},
            RECONCILE_TASK: {"queue": MAINTENANCE_QUEUE},
            DELIVER_WEBHOOK_TASK: {"queue": WEBHOOKS_QUEUE},
        },
        # State lives in Postgres; results are not read from Celery, so none are stored there.
        "task_ignore_result": True,
        "result_expires": 3600,
        # max_connections: the Redis connections of one channel's pool (kombu's default is 10). A gevent
        # worker acks and publishes from hundreds of greenlets at once; past the limit redis-py refuses
        # instead of waiting (MaxConnectionsError: a lost ack, a step left to the reconciler).
        "broker_transport_options": {"visibility_timeout": visibility_timeout,
                                     "max_connections": BROKER_MAX_CONNECTIONS},
        "result_backend_transport_options": {"visibility_timeout": visibility_timeout},
        "broker_connection_retry_on_startup": True,
        # A worker that loses Redis keeps running its tasks and reconnects (conductor/tasks/transport.py
        # keeps kombu's close of the lost connection from ending the process). Its running steps are not
        # cancelled: each holds its claim and lease in Postgres, and its outcome is fenced by that claim, so
        # cancelling would only throw away a call already paid for (and a thread cannot be cancelled). Its
        # message, unacknowledged, is acknowledged once Redis is back, or delivered again after the
        # visibility timeout and refused by the claim. Celery 6 turns this on by default: kept off here.
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # Publishing from the API must fail fast when Redis is down: the job is already committed and
        # the reconciler enqueues it later, so the client gets its 202 instead of a hung request.
        "task_publish_retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5},
        "worker_hijack_root_logger": False,
        # No Celery time limits: they are inert on the threads pool, and under prefork a soft limit
        # fires inside a legitimate retry loop. Every wait in a step is bounded by the engine itself
        # (provider timeout, rate-limit wait, retry policy, the job's deadline), and a step past
        # ``Settings.step_max_duration_s`` loses its lease (conductor/lease.py): one story on any pool.
        # Task events (3 per task, published in batches by ``BatchedTaskEvents`` below) are what Flower
        # shows; off, a busy worker takes more steps/s (docs/benchmarks.md), and a running Flower switches
        # them on again every few seconds.
        "worker_send_task_events": settings.worker_task_events,
        "task_send_sent_event": settings.task_sent_events,
        "beat_schedule": {
            # On its own queue a pass does not wait behind steps. One that still finds no consumer for a
            # few intervals (none is up) is dropped rather than piled up: the next one does its work.
            "reconcile": {
                "task": RECONCILE_TASK,
                "schedule": settings.reconcile_interval_s,
                "options": {"queue": MAINTENANCE_QUEUE,
                            "expires": settings.reconcile_interval_s * RECONCILE_EXPIRES_INTERVALS},
            },
        },
    }


WORKER_OWN_DB_USERS = 0
"""Connections of the shared pool a worker holds besides its slots' (the lease heartbeat has one of its own
outside the pool, ``store.db.reserved_engine``)."""


@worker_init.connect
def _size_db_pool(sender: object = None, **_: object) -> None:
    """A worker keeps a pooled connection per slot (``store.db.expect_concurrent_users``), so that no
    step waits on opening one. The worker's ``-c`` is known here; ``auto`` is resolved later, and such
    a worker keeps the configured sizes."""
    from conductor.store.db import expect_concurrent_users

    slots = getattr(sender, "concurrency", None)
    if not isinstance(slots, int):
        return
    settings = get_settings()
    if settings.worker_continue_steps:  # the local slots that run parallel steps beside the tasks
        slots += settings.worker_local_slots
    expect_concurrent_users(slots + WORKER_OWN_DB_USERS)
    _sized_for.append(slots)


_sized_for: list[int] = []


@worker_ready.connect
def _quiet_connection_loss_notice(**_: object) -> None:
    """Celery warns, at every loss of the broker connection, that Celery 6 will cancel running tasks then
    (``CANCEL_TASKS_BY_DEFAULT``, nine lines), even with the setting chosen: it is chosen (off, in
    ``celery_config``), so the notice is dropped. Added at ``worker_ready``, after Celery's logging set-up
    put its own 'always' filters for its deprecation warnings first."""
    warnings.filterwarnings("ignore", message=r"\s*In Celery 5\.1 we introduced an optional breaking change",
                            category=CPendingDeprecationWarning)


@worker_ready.connect
def _log_db_pool(**_: object) -> None:
    """Says what ``_size_db_pool`` chose, once logging is set up (it is not yet at ``worker_init``)."""
    from conductor.store.db import pool_sizes

    if _sized_for:
        kept, overflow = pool_sizes()
        log.info("database pool: keeps %d connections open for %d slots (+%d opened under load, closed after; "
                 "+1 of the lease heartbeat's own)", kept, _sized_for[-1], overflow)


class BatchedTaskEvents(bootsteps.StartStopStep):
    """Publishes the worker's task events in one message per ``Settings.worker_events_flush_s`` (50 ms)
    instead of one per event. Celery buffers task events (``task-received``, ``-started``, ``-succeeded``:
    three per task) but schedules a flush on the next turn of its event loop for each, so a worker that is
    not saturated published each alone: a Redis ``PUBLISH`` and kombu's message around it, about a third
    of a 1-step job's worker CPU (docs/benchmarks.md). Flower shows them at most that much later; Celery
    still flushes at once when 24 are buffered. Started after Celery's ``Events`` step (so after each new
    dispatcher, on reconnection too) and stopped before it, publishing what is left."""

    requires = ("celery.worker.consumer.events:Events",)

    def start(self, c: Any) -> None:
        dispatcher = c.event_dispatcher
        if c.hub is None or dispatcher is None:
            return  # no event loop (a green pool): Celery publishes each event itself, unbuffered
        dispatcher.on_send_buffered = None  # no flush per event; the timer publishes them
        self._cancel(c)
        c._conductor_events_timer = c.hub.call_repeatedly(get_settings().worker_events_flush_s, c._flush_events)

    def stop(self, c: Any) -> None:
        self._cancel(c)
        if c.event_dispatcher is not None:
            c._flush_events()

    shutdown = stop

    @staticmethod
    def _cancel(c: Any) -> None:
        timer = getattr(c, "_conductor_events_timer", None)
        if timer is not None:
            timer.cancel()
            c._conductor_events_timer = None


class ConductorCelery(Celery):
    """The Celery app whose messages sent by name (``send_task``: every send of ``conductor/tasks/send.py``,
    beat's and embedded mode's) follow ``task_ignore_result`` as a task's own ``apply_async`` does. Celery's
    ``send_task`` otherwise subscribes, on the result backend, to the result channel of each message it
    sends, and the ``AsyncResult`` it returns unsubscribes when collected: two Redis commands per message
    for a result that is never stored, and on a gevent worker a collection inside the hub made the
    unsubscribe raise ``BlockingSwitchOutError`` (a traceback in the log, the channel left subscribed)."""

    def send_task(self, name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        options.setdefault("ignore_result", self.conf.task_ignore_result)
        return super().send_task(name, args, kwargs, **options)


def create_app(settings: Settings | None = None) -> Celery:
    app = ConductorCelery("conductor", include=["conductor.tasks.jobs", "conductor.tasks.webhooks"])
    app.conf.update(celery_config(settings or get_settings()))
    app.steps["consumer"].add(BatchedTaskEvents)
    return app


app = create_app()
