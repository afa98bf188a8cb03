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
    UNFINISHED = nonmember(frozenset({"queued", "planning", "running"}))  # an index can find these (IN, not NOT IN)


class StepStatus(StrEnum):
    PENDING = "pending"  # waiting for its dependencies
    QUEUED = "queued"  # dependencies done, message sent to the broker
    RUNNING = "running"  # claimed by a worker (or waiting on its child job)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    SKIPPED = "skipped"  # the job failed first: never ran, or its call's answer was dropped (usage kept)
    CANCELLED = "cancelled"
    DONE = nonmember(frozenset({"succeeded", "failed", "skipped", "cancelled"}))


__all__ = ["JobStatus", "StepStatus"]
