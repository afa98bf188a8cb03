"""Public shapes of jobs and steps (API.md). Table rows are never returned as they are."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlmodel import Session

from conductor.store import jobs as store
from conductor.store.models import Job, Step, StepAttempt

MAX_TREE_DEPTH = 6


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts else None


def job_view(job: Job, steps: list[Step], *, base_url: str = "") -> dict[str, Any]:
    return {
        "id": job.id,
        "status": job.status,
        "task": job.task,
        "pool": job.pool,
        "planner": job.planner,
        "depth": job.depth,
        "parent": (
            {"job_id": job.parent_job_id, "step_index": job.parent_step_index} if job.parent_job_id else None
        ),
        "workflow": (
            {
                "steps": [
                    {"index": st.index, "agent": st.agent, "instruction": st.instruction,
                     "access_list": st.access_list}
                    for st in steps
                ],
                "source": job.workflow_source,
                "format_valid": job.format_valid,
                "planner_error": job.planner_error,
                "planner_attempts": job.planner_attempts,
            }
            if job.workflow_source
            else None
        ),
        "answer": job.answer,
        "error": (
            {"type": job.error_type, "message": job.error_message, "step": job.error_step}
            if job.error_type
            else None
        ),
        "usage": {
            "input_tokens": job.input_tokens,
            "output_tokens": job.output_tokens,
            "cost_usd": round(job.cost_usd, 8),
            "calls": job.calls,
            "planner": {
                "input_tokens": job.planner_input_tokens,
                "output_tokens": job.planner_output_tokens,
                "cost_usd": round(job.planner_cost_usd, 8),
                "calls": job.planner_calls,
            },
        },
        "limits": job.limits,
        "metadata": job.meta,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "links": job_links(job.id, base_url),
    }


def job_links(job_id: str, base_url: str = "") -> dict[str, str]:
    root = f"{base_url}/v1/jobs/{job_id}"
    return {"self": root, "steps": f"{root}/steps", "events": f"{root}/events"}


def step_view(step: Step, attempts: list[StepAttempt]) -> dict[str, Any]:
    return {
        "index": step.index,
        "agent": step.agent,
        "instruction": step.instruction,
        "access_list": step.access_list,
        "access_all": step.access_all,
        "status": step.status,
        "provider": step.provider,
        "model": step.model,
        "messages": step.messages,
        "output": step.output,
        "finish_reason": step.finish_reason,
        "usage": {
            "input_tokens": step.input_tokens,
            "output_tokens": step.output_tokens,
            "cost_usd": round(step.cost_usd, 8),
        },
        "latency_ms": step.latency_ms,
        "attempts": [
            {
                "n": a.n,
                "worker": a.worker,
                "started_at": _iso(a.started_at),
                "finished_at": _iso(a.finished_at),
                "latency_ms": a.latency_ms,
                "error": ({"type": a.error_type, "message": a.error} if a.error_type else None),
            }
            for a in attempts
        ],
        "error": ({"type": step.error_type, "message": step.error} if step.error_type else None),
        "child_job_id": step.child_job_id,
        "celery_task_id": step.celery_task_id,
        "queued_at": _iso(step.queued_at),
        "started_at": _iso(step.started_at),
        "finished_at": _iso(step.finished_at),
    }


def steps_tree(session: Session, job_id: str, depth: int = 0) -> list[dict[str, Any]]:
    """Steps with each recursive step's child job (and its steps) nested under it."""
    steps = store.get_steps(session, job_id=job_id)
    attempts = store.get_attempts(session, step_ids=[s.id for s in steps if s.id is not None])
    out = []
    for st in steps:
        view = step_view(st, [a for a in attempts if a.step_id == st.id])
        if st.child_job_id and depth < MAX_TREE_DEPTH:
            child = store.get_job(session, job_id=st.child_job_id)
            if child is not None:
                view["child"] = {
                    "job_id": child.id,
                    "status": child.status,
                    "depth": child.depth,
                    "workflow_source": child.workflow_source,
                    "answer": child.answer,
                    "steps": steps_tree(session, child.id, depth + 1),
                }
        out.append(view)
    return out
