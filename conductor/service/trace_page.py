"""What the trace viewer shows of a job, gathered from the store: the job, its graph and timeline, and
each step with its attempts and (for a recursive step) its child job, nested."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlmodel import Session

from conductor.service.ui_layout import Graph, Timeline, timeline, workflow_graph
from conductor.store import jobs as store
from conductor.store.models import Job, Step, StepAttempt

MAX_DEPTH = 6


@dataclass
class StepCard:
    step: Step
    attempts: list[StepAttempt]
    child: JobSection | None = None


@dataclass
class JobSection:
    job: Job
    graph: Graph
    timeline: Timeline
    steps: list[StepCard] = field(default_factory=list)
    depth: int = 0


def job_section(session: Session, job: Job, *, now: datetime, depth: int = 0) -> JobSection:
    steps = store.get_steps(session, job_id=job.id)
    attempts = store.get_attempts(session, step_ids=[st.id for st in steps if st.id is not None])
    section = JobSection(job, workflow_graph(steps), timeline(job, steps, attempts, now), depth=depth)
    for st in steps:
        card = StepCard(st, [a for a in attempts if a.step_id == st.id])
        if st.child_job_id and depth < MAX_DEPTH:
            child = store.get_job(session, job_id=st.child_job_id, tenant=job.tenant)
            if child is not None:
                card.child = job_section(session, child, now=now, depth=depth + 1)
        section.steps.append(card)
    return section
