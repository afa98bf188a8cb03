"""Engine transitions on a real Postgres, driven directly: a job tree's total fan-out is capped, and a
child left running by a parent whose worker died before cancelling it is ended by the reconciler."""

from __future__ import annotations

from conductor.engine import plan_job, run_step
from conductor.reconcile import reconcile_once
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import JobStatus, StepStatus, utcnow
from conductor.submission import JobCreate, create_job

TWO_RECURSIVE = {"model_ids": ["conductor", "conductor"], "subtasks": ["one", "two"], "access_lists": [[], []]}


def new_job(**body: object) -> str:
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "tree test", **body}), tenant="tree",
                            settings=get_settings())
        return job.id


def start_child(job_id: str, index: int) -> str:
    dispatch = run_step(job_id, index, worker="w", task_id=None, settings=get_settings())
    [child_id] = dispatch.plan
    return child_id


def test_a_job_tree_cannot_fan_out_past_its_step_limit() -> None:
    settings = get_settings().model_copy(update={"max_tree_steps": 3})
    root = new_job(workflow=TWO_RECURSIVE, limits={"max_depth": 1})
    plan_job(root, settings=settings)
    first, second = start_child(root, 0), start_child(root, 1)
    assert plan_job(first, settings=settings).steps == [(first, 0)]  # 2 + 1 steps: within the limit
    plan_job(second, settings=settings)  # 3 + 1: over it

    with session_scope() as s:
        refused = store.get_job(s, job_id=second)
        parent = store.get_job(s, job_id=root)
        assert refused is not None and parent is not None
        assert refused.status == JobStatus.FAILED and refused.error_type == "quota_exceeded"
        assert "limit of 3" in (refused.error_message or "")
        assert store.get_steps(s, job_id=second) == []  # nothing of it was inserted, nothing ran
        assert parent.status == JobStatus.FAILED and parent.error_step == 1
        assert store.count_tree_steps(s, root_job_id=root) == 3


def test_children_of_a_parent_that_ended_without_cancelling_them_are_cancelled_by_the_reconciler() -> None:
    settings = get_settings()
    root = new_job(workflow=TWO_RECURSIVE, limits={"max_depth": 1})
    plan_job(root, settings=settings)
    child = start_child(root, 0)
    plan_job(child, settings=settings)  # the child is running: its step is queued
    # What fail_job commits before it cancels the children, and then its worker dies.
    with session_scope() as s:
        assert store.transition_job(s, job_id=root, from_=[JobStatus.RUNNING], to=JobStatus.FAILED,
                                    error_type="step_failed", error_message="crashed after", finished_at=utcnow())
        store.close_open_steps(s, job_id=root, to=StepStatus.SKIPPED)

    report, _ = reconcile_once(settings)

    assert report["orphans_cancelled"] >= 1
    with session_scope() as s:
        orphan = store.get_job(s, job_id=child)
        assert orphan is not None and orphan.status == JobStatus.CANCELLED
        assert [st.status for st in store.get_steps(s, job_id=child)] == [StepStatus.CANCELLED]
    # The cancelled child's queued step never runs.
    assert run_step(child, 0, worker="late", task_id=None, settings=settings).steps == []
    with session_scope() as s:
        step = store.get_step(s, job_id=child, index=0)
        assert step is not None and step.status == StepStatus.CANCELLED and step.attempts == 0
