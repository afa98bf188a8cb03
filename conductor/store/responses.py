"""The jobs created through OpenAI's Responses API (``POST /v1/responses``): their ``openai_response`` rows."""

from __future__ import annotations

from sqlmodel import Session, select

from conductor.store.models import Job, OpenAIResponse


def insert_response(session: Session, *, response: OpenAIResponse) -> None:
    """Adds the row to the session's transaction: the caller commits it with its job."""
    session.add(response)


def get_response(session: Session, *, job_id: str, tenant: str) -> tuple[Job, OpenAIResponse] | None:
    """The tenant's job and its response row; None when either is missing (another tenant's job, or a job
    made by ``POST /v1/jobs``, chat completions or a batch, is not a response)."""
    row = session.exec(
        select(Job, OpenAIResponse).join(OpenAIResponse, OpenAIResponse.job_id == Job.id)  # type: ignore[arg-type]
        .where(Job.id == job_id, Job.tenant == tenant)
    ).first()
    return None if row is None else (row[0], row[1])
