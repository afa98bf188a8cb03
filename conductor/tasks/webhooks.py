"""The webhook delivery task (queue ``webhooks``): one attempt per message; the engine's outbox row and
the reconciler make sure an ended job's webhook is sent even when a message is lost."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from kombu.exceptions import OperationalError as BrokerAway

from conductor.settings import get_settings
from conductor.store.models import Job, Step
from conductor.tasks.app import DELIVER_WEBHOOK_TASK, app
from conductor.tasks.send import schedule_webhook_retry, send_webhooks
from conductor.webhooks.deliver import deliver

log = logging.getLogger(__name__)


def job_payload(job: Job, steps: list[Step]) -> dict[str, Any]:
    """A webhook's ``data``: the job exactly as ``GET /v1/jobs/{id}`` shows it. That shape is defined once,
    with the API's response models (pure pydantic, no FastAPI) — the one place tasks read from service."""
    from conductor.service.views import job_view

    return job_view(job, steps).model_dump(mode="json")


@app.task(name=DELIVER_WEBHOOK_TASK, bind=True)
def deliver_webhook(self: Task, delivery_id: str) -> None:
    outcome = deliver(delivery_id, settings=get_settings(), render=job_payload)
    if outcome.wake is not None:
        send_webhooks([outcome.wake])
    if outcome.retry_in is not None:
        try:
            schedule_webhook_retry(delivery_id, outcome.retry_in)
        except BrokerAway as exc:  # the row holds the attempt's due time and no message: the reconciler sends it
            log.warning("delivery %s: its retry in %.1f s is not sent (broker away: %s); the reconciler sends it "
                        "when due", delivery_id, outcome.retry_in, exc)


__all__ = ["deliver_webhook"]
