"""Webhook deliveries of a job: every attempt, its status code, latency and error."""

from __future__ import annotations

from fastapi import APIRouter

from conductor.service.deps import SessionDep, TenantDep, job_or_404
from conductor.service.problems import problems
from conductor.service.schemas import Delivery, DeliveryAttempt, DeliveryList
from conductor.store import webhooks as store
from conductor.store.models import DeliveryStatus

router = APIRouter()


@router.get("/v1/jobs/{job_id}/deliveries", responses=problems(401, 404, 503))
def job_deliveries(job_id: str, session: SessionDep, tenant: TenantDep) -> DeliveryList:
    """The webhook deliveries of the caller's job (one per ended top-level job with a webhook URL)."""
    job = job_or_404(session, job_id, tenant)
    rows = store.deliveries_for_job(session, job_id=job.id)
    attempts = store.attempts_for(session, delivery_ids=[r.id for r in rows])
    data = [
        Delivery(
            id=r.id,
            type=r.event_type,
            url=r.url,
            status=DeliveryStatus(r.status),
            next_attempt_at=r.next_attempt_at if r.status == DeliveryStatus.PENDING else None,
            created_at=r.created_at,
            finished_at=r.finished_at,
            deferrals=r.deferrals,
            attempts=[
                DeliveryAttempt(n=a.n, started_at=a.started_at, finished_at=a.finished_at,
                                status_code=a.status_code, latency_ms=a.latency_ms, error=a.error)
                for a in attempts if a.delivery_id == r.id
            ],
        )
        for r in rows
    ]
    return DeliveryList(data=data, count=len(data))
