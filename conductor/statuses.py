"""The one definition of job and step statuses (stdlib only, so the CLI can use it without the store)."""

from __future__ import annotations

from enum import StrEnum, nonmember


class JobStatus(StrEnum):
    QUEUED = "queued"
    PLANNING = "planning"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TERMINAL = nonmember(frozenset({"succeeded", "failed", "cancelled"}))


class StepStatus(StrEnum):
    PENDING = "pending"  # waiting for its dependencies
    QUEUED = "queued"  # dependencies done, message sent to the broker
    RUNNING = "running"  # claimed by a worker (or waiting on its child job)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # never ran because the job failed first
    CANCELLED = "cancelled"
    DONE = nonmember(frozenset({"succeeded", "failed", "skipped", "cancelled"}))


__all__ = ["JobStatus", "StepStatus"]
