"""The one Celery app. Every setting here is a reliability decision; the reason sits beside it."""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from conductor.settings import Settings, get_settings

PLANNER_QUEUE = "planner"
STEPS_QUEUE = "steps"


def celery_config(settings: Settings) -> dict[str, object]:
    # A message may sit unacknowledged on Redis this long before Redis hands it to another worker.
    # It must exceed the longest step (lease + hard limit), or a slow step would get a second copy.
    visibility_timeout = int(settings.step_lease_s + settings.step_soft_time_limit_s + 120)
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
        "task_queues": (Queue(PLANNER_QUEUE), Queue(STEPS_QUEUE)),
        "task_default_queue": STEPS_QUEUE,
        "task_routes": {
            "conductor.plan": {"queue": PLANNER_QUEUE},
            "conductor.run_step": {"queue": STEPS_QUEUE},
            "conductor.finalize": {"queue": STEPS_QUEUE},
            "conductor.reconcile": {"queue": STEPS_QUEUE},
        },
        # State lives in Postgres; results are not read from Celery, so none are stored there.
        "task_ignore_result": True,
        "result_expires": 3600,
        "broker_transport_options": {"visibility_timeout": visibility_timeout},
        "result_backend_transport_options": {"visibility_timeout": visibility_timeout},
        "broker_connection_retry_on_startup": True,
        # Publishing from the API must fail fast when Redis is down: the job is already committed and
        # the reconciler enqueues it later, so the client gets its 202 instead of a hung request.
        "task_publish_retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5},
        "worker_hijack_root_logger": False,
        "task_soft_time_limit": settings.step_soft_time_limit_s,
        "task_time_limit": settings.step_soft_time_limit_s + 60,
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "beat_schedule": {
            # A pass that could not run in its interval (no worker up) is dropped, not piled up.
            "reconcile": {
                "task": "conductor.reconcile",
                "schedule": settings.reconcile_interval_s,
                "options": {"expires": settings.reconcile_interval_s},
            },
        },
    }


def create_app(settings: Settings | None = None) -> Celery:
    app = Celery("conductor", include=["conductor.tasks.jobs"])
    app.conf.update(celery_config(settings or get_settings()))
    return app


app = create_app()
