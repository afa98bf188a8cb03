"""The jobs created through OpenAI's Responses API (``POST /v1/responses``): their ``openai_response`` rows."""

from __future__ import annotations

from functools import cache
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session, select

from conductor.store.models import Job, OpenAIResponse

JOB: sa.Table = Job.__table__  # type: ignore[attr-defined]
RESPONSE: sa.Table = OpenAIResponse.__table__  # type: ignore[attr-defined]
STATE_FIELDS = ("id", "status", "created_at", "finished_at", "answer", "error_type", "error_message",
                "input_tokens", "output_tokens", "cost_usd", "calls", "meta", "limits", "cached_input_tokens",
                "reasoning_tokens", "cache_write_tokens")
"""What a response object tells of its job (with the instructions): a poll reads these, not the job's task,
context, pool snapshot or planner output, each of which can be long."""


def response_insert(response: OpenAIResponse) -> tuple[sa.Executable, dict[str, Any]]:
    """The statement inserting ``response``'s row, for ``create_job(then=...)``: sent in the job's insert
    pipeline (the tenant's lock is not held across another round trip), it inserts nothing when the job
    was not (its quota refused it)."""
    return _response_insert_stmt(), {"p_job_id": response.job_id, "p_model": response.model,
                                     "p_background": response.background, "p_instructions": response.instructions,
                                     "p_previous": response.previous_response_id}


@cache
def _response_insert_stmt() -> sa.Insert:
    job_id = sa.bindparam("p_job_id", type_=sa.String())
    row = sa.select(job_id, sa.bindparam("p_model", type_=sa.String()),
                    sa.bindparam("p_background", type_=sa.Boolean()),
                    sa.bindparam("p_instructions", type_=sa.Boolean()),
                    sa.bindparam("p_previous", type_=sa.String())).where(sa.exists().where(JOB.c.id == job_id))
    return sa.insert(RESPONSE).from_select(["job_id", "model", "background", "instructions", "previous_response_id"],
                                           row)


def get_response(session: Session, *, job_id: str, tenant: str) -> tuple[Job, OpenAIResponse] | None:
    """The tenant's job (the whole row) and its response row; None when either is missing (another
    tenant's job, or a job made by ``POST /v1/jobs``, chat completions or a batch's chat or job line, is not a
    response; a ``/v1/responses`` batch line's is)."""
    row = session.exec(
        select(Job, OpenAIResponse).join(OpenAIResponse, OpenAIResponse.job_id == Job.id)  # type: ignore[arg-type]
        .where(Job.id == job_id, Job.tenant == tenant)
    ).first()
    return None if row is None else (row[0], row[1])


def batch_responses(session: Session, *, batch_id: str) -> dict[str, OpenAIResponse]:
    """The response rows of a batch's jobs (its ``/v1/responses`` lines), by job id: one statement."""
    rows = session.exec(
        select(OpenAIResponse).join(Job, OpenAIResponse.job_id == Job.id)  # type: ignore[arg-type]
        .where(Job.batch_id == batch_id)
    ).all()
    return {row.job_id: row for row in rows}


def get_response_state(session: Session, *, job_id: str, tenant: str) -> tuple[Job, OpenAIResponse] | None:
    """As ``get_response``, reading only ``STATE_FIELDS`` of the job and, of its context, the first message
    when it holds the instructions (as ``context``: a list of that one message). One statement; the job
    is built with ``model_construct`` (for reading, never to be added to a session)."""
    row = session.connection().execute(_state_stmt(), {"p_job_id": job_id, "p_tenant": tenant}).first()
    if row is None:
        return None
    fields: dict[str, Any] = dict(zip(STATE_FIELDS, row[:len(STATE_FIELDS)], strict=True))
    model, background, instructions, previous, first = row[len(STATE_FIELDS):]
    job = Job.model_construct(**fields, context=[first] if instructions and first is not None else None)
    return job, OpenAIResponse(job_id=job.id, model=model, background=background, instructions=instructions,
                               previous_response_id=previous)


@cache
def _state_stmt() -> sa.Select[Any]:
    j, r = JOB.c, RESPONSE.c
    columns = [j["metadata"] if name == "meta" else j[name] for name in STATE_FIELDS]
    first = sa.case((r.instructions, j.context[0]), else_=sa.null())
    return (sa.select(*columns, r.model, r.background, r.instructions, r.previous_response_id, first)
            .select_from(JOB.join(RESPONSE, r.job_id == j.id))
            .where(j.id == sa.bindparam("p_job_id", type_=sa.String()),
                   j.tenant == sa.bindparam("p_tenant", type_=sa.String())))
