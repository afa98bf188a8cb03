"""The reconciler's queued jobs, read in ``ix_job_queued`` (migration 0017) on a migrated SQLite store: the
ones whose plan was never sent, and the ones sent longest ago first, never another status's."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import Job, utcnow
from tests.sqlite_store import sqlite_store


def test_never_enqueued_and_stuck_queued_jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = utcnow()
    with sqlite_store(tmp_path, monkeypatch), session_scope() as s:
        def job(status: str, enqueued_s: float | None, created_s: float = 600) -> str:
            row = Job(tenant="t", task="t", pool="default", planner="template", status=status,
                      created_at=now - timedelta(seconds=created_s),
                      enqueued_at=None if enqueued_s is None else now - timedelta(seconds=enqueued_s))
            s.add(row)
            return row.id

        never = job("queued", None)
        job("queued", None, created_s=0.5)  # committed a moment ago: being published now
        job("planning", None)
        sent = [job("queued", ago) for ago in (50, 400, 90)]
        job("queued", 5)  # sent just now
        job("running", 500)
        s.flush()
        assert store.jobs_never_enqueued(s, older_than=now - timedelta(seconds=2)) == [never]
        stuck = store.jobs_stuck_queued(s, older_than=now - timedelta(seconds=30))
        assert [j.id for j in stuck] == [sent[1], sent[2], sent[0]]  # sent longest ago first
        # only what the pass uses: not the rows, whose task and workflow may be a megabyte each
        assert [(type(j).__name__, j.plan_resends) for j in stuck] == [("QueuedJob", 0)] * 3
        assert [j.id for j in store.jobs_stuck_queued(s, older_than=now - timedelta(seconds=30), limit=1)] == [sent[1]]
