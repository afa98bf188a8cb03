"""A reconciler pass on a migrated SQLite file: trace-viewer sessions past their expiry are deleted, so
keys that never sign in again leave no rows behind (signing in again drops a key's own expired ones; the
same delete runs on Postgres in tests/integration/test_trace_viewer.py), one job's fault does not cost
the pass its other work, and the window in which ended jobs get a missing webhook delivery row."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlmodel import col, select

from conductor.reconcile import reconcile_once
from conductor.settings import Settings
from conductor.store.db import session_scope
from conductor.store.keys import create_key, create_session, delete_expired_sessions, tenant_for_session
from conductor.store.models import DeletedFile, Job, Step, UiSession, utcnow
from tests.sqlite_store import sqlite_store


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    with sqlite_store(tmp_path, monkeypatch) as store_settings:
        yield store_settings


def sessions_of(tenant: str, count: int) -> list[str]:
    with session_scope() as s:
        _, key = create_key(s, tenant=tenant)
        made = [create_session(s, key=key, ttl_s=3600) for _ in range(count)]
    return [m[1] for m in made if m is not None]


def expire(tokens_hashes: list[str]) -> None:
    with session_scope() as s:
        s.execute(sa.update(UiSession).where(col(UiSession.token_hash).in_(tokens_hashes))
                  .values(expires_at=utcnow() - timedelta(seconds=1)))


def stored() -> dict[str, str]:
    with session_scope() as s:
        return {row.token_hash: row.tenant for row in s.exec(select(UiSession)).all()}


def test_a_reconciler_pass_deletes_expired_sessions_and_keeps_live_ones(settings: Settings) -> None:
    live = sessions_of("tenant-a", 2)
    sessions_of("tenant-b", 3)
    b_rows = [h for h, tenant in stored().items() if tenant == "tenant-b"]
    expire(b_rows)
    report, _ = reconcile_once(settings)
    assert report["expired_viewer_sessions"] == 3
    assert sorted(stored().values()) == ["tenant-a", "tenant-a"]
    with session_scope() as s:
        assert [tenant_for_session(s, token=t) for t in live] == ["tenant-a", "tenant-a"]
    report, _ = reconcile_once(settings)  # nothing left to delete
    assert report["expired_viewer_sessions"] == 0


def test_one_pass_deletes_at_most_its_limit(settings: Settings) -> None:
    sessions_of("tenant-c", 5)
    expire(list(stored()))
    with session_scope() as s:
        assert delete_expired_sessions(s, limit=2) == 2
    assert len(stored()) == 3
    with session_scope() as s:
        assert delete_expired_sessions(s, limit=10) == 3
    assert stored() == {}


def test_a_pass_forgets_deleted_files_places_kept_past_a_week(settings: Settings) -> None:
    now = utcnow()
    with session_scope() as s:
        for name, days in (("file-old", 8), ("file-recent", 1)):
            s.add(DeletedFile(id=name, tenant="tenant-f", created_at=now - timedelta(days=30),
                              deleted_at=now - timedelta(days=days)))
    report, _ = reconcile_once(settings)
    assert report["forgotten_deleted_files"] == 1
    with session_scope() as s:
        assert [row.id for row in s.exec(select(DeletedFile)).all()] == ["file-recent"]


def test_an_orphan_that_cannot_be_cancelled_does_not_stop_the_pass(settings: Settings,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from conductor import reconcile
    from conductor.store import jobs as store

    sessions_of("tenant-d", 1)
    expire(list(stored()))
    monkeypatch.setattr(store, "orphaned_children", lambda _s: ["orphan-1", "orphan-2"])

    def cancel(job_id: str) -> bool:  # fault injection: the first orphan's cancel raises (a bug, a bad row)
        if job_id == "orphan-1":
            raise RuntimeError("injected")
        return True

    monkeypatch.setattr(reconcile, "cancel_job", cancel)
    report, _ = reconcile_once(settings)
    assert report["orphans_failed_to_cancel"] == 1 and report["orphans_cancelled"] == 1
    assert report["expired_viewer_sessions"] == 1  # the rest of the pass ran


def test_the_pass_sends_what_it_gathered_before_its_batch_work(settings: Settings,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Expiring batches cancels their jobs one by one; re-sends must not wait behind that."""
    from conductor import reconcile
    from conductor.engine import Dispatch

    order: list[str] = []
    real_batches = reconcile.reconcile_batches

    def batches() -> dict[str, Any]:
        order.append("batches")
        return real_batches()

    monkeypatch.setattr(reconcile, "reconcile_batches", batches)
    sent: list[Dispatch] = []

    def send(d: Dispatch) -> None:
        order.append("send")
        sent.append(d)

    report, dispatch = reconcile_once(settings, send=send)
    assert order == ["send", "batches"] and sent == [dispatch] and "batches_ended" in report


def _ended_without_delivery(ago: timedelta) -> str:
    from conductor.store.models import Job

    at = utcnow() - ago
    with session_scope() as s:
        job = Job(tenant="tenant-hooks", task="t", pool="default", planner="template", status="succeeded",
                  webhook_url="https://hooks.example/x", created_at=at, updated_at=at, finished_at=at)
        s.add(job)
    return job.id


def _has_delivery(job_id: str) -> bool:
    from conductor.store.models import WebhookDelivery

    with session_scope() as s:
        return s.exec(select(WebhookDelivery).where(WebhookDelivery.job_id == job_id)).first() is not None


def test_the_webhook_backfill_looks_back_ten_minutes_past_its_last_complete_look(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ended job whose delivery row was never written gets one. A process's first pass looks back a day;
    later ones ten minutes before the last pass that wrote all it found, so a gap between passes is still
    looked through, and a pass that found more than its limit does not move that mark."""
    from conductor import reconcile

    monkeypatch.setattr(reconcile, "_backfilled_at", None)
    monkeypatch.setattr(reconcile, "_full_look_at", None)
    hours_ago = _ended_without_delivery(timedelta(hours=3))
    days_ago = _ended_without_delivery(timedelta(hours=30))
    reconcile_once(settings)
    assert _has_delivery(hours_ago) and not _has_delivery(days_ago)

    # Right after a complete pass: ten minutes back (an end recorded 20 minutes ago and committed only now
    # is past the overlap; one 5 minutes ago is within it)
    late, recent = _ended_without_delivery(timedelta(minutes=20)), _ended_without_delivery(timedelta(minutes=5))
    reconcile_once(settings)
    assert _has_delivery(recent) and not _has_delivery(late)

    # ... and the next whole day's look, an hour after the last one, finds it
    monkeypatch.setattr(reconcile, "_full_look_at", utcnow() - timedelta(hours=1, seconds=1))
    reconcile_once(settings)
    assert _has_delivery(late)

    # No pass for two hours: the next one looks back to ten minutes before the last complete one
    monkeypatch.setattr(reconcile, "_backfilled_at", utcnow() - timedelta(hours=2))
    during_gap = _ended_without_delivery(timedelta(hours=1))
    reconcile_once(settings)
    assert _has_delivery(during_gap)

    # More owed than a pass writes: the mark stays, so the next pass looks as far back again
    monkeypatch.setattr(reconcile, "BACKFILL_LIMIT", 2)
    monkeypatch.setattr(reconcile, "_backfilled_at", utcnow() - timedelta(hours=2))
    many = [_ended_without_delivery(timedelta(minutes=90 + i)) for i in range(5)]
    mark = reconcile._backfilled_at
    reconcile_once(settings)
    assert sum(map(_has_delivery, many)) == 2 and reconcile._backfilled_at == mark
    reconcile_once(settings)
    reconcile_once(settings)
    assert all(map(_has_delivery, many)) and reconcile._backfilled_at != mark


def test_backfill_since_is_ten_minutes_before_the_last_complete_look_and_at_most_a_day() -> None:
    from conductor import reconcile

    now = utcnow()
    ten = timedelta(seconds=reconcile.WEBHOOK_BACKFILL_S)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(reconcile, "_backfilled_at", None)
        mp.setattr(reconcile, "_full_look_at", None)
        assert reconcile.backfill_since(now) == now - timedelta(hours=24)
        mp.setattr(reconcile, "_backfilled_at", now - timedelta(seconds=15))
        assert reconcile.backfill_since(now) == now - timedelta(hours=24)  # no whole day's look yet
        mp.setattr(reconcile, "_full_look_at", now - timedelta(hours=1))
        assert reconcile.backfill_since(now) == now - timedelta(hours=24)  # the hourly one is due
        mp.setattr(reconcile, "_full_look_at", now + timedelta(minutes=1))  # a clock stepped back
        assert reconcile.backfill_since(now) == now - timedelta(hours=24)
        mp.setattr(reconcile, "_full_look_at", now - timedelta(minutes=30))
        mp.setattr(reconcile, "_backfilled_at", now - timedelta(seconds=15))
        assert reconcile.backfill_since(now) == now - timedelta(seconds=15) - ten
        mp.setattr(reconcile, "_backfilled_at", now - timedelta(days=3))
        assert reconcile.backfill_since(now) == now - timedelta(hours=24)
        mp.setattr(reconcile, "_backfilled_at", now + timedelta(minutes=1))  # a clock stepped back
        assert reconcile.backfill_since(now) == now - ten


def test_a_batchs_lines_are_re_sent_at_the_batch_priority(settings: Settings) -> None:
    """A batch's plan waits at the lowest priority behind every live plan, so it is often still queued after
    ``reconcile_stale_s``: its re-send must keep that priority, or it would jump the live plans it waits
    behind (and so would a line whose first send was missed)."""
    now = utcnow()
    with session_scope() as s:
        def job(batch_id: str | None, enqueued_s: float | None) -> str:
            row = Job(tenant="t", task="t", pool="default", planner="template", status="queued", batch_id=batch_id,
                      created_at=now - timedelta(seconds=600),
                      enqueued_at=None if enqueued_s is None else now - timedelta(seconds=enqueued_s))
            s.add(row)
            return row.id

        waiting, never = job("batch_1", 400), job("batch_1", None)
        live_waiting, live_never = job(None, 400), job(None, None)
    _, dispatch = reconcile_once(settings)
    assert sorted(dispatch.plan) == sorted([waiting, never, live_waiting, live_never])
    assert dispatch.background == {waiting, never}


def test_batch_work_s_lost_steps_are_re_sent_at_the_batch_priority(settings: Settings) -> None:
    """A batch's step waits at the lowest priority behind every live step, so it is often still queued after
    ``reconcile_stale_s``: its re-send must keep that priority, and so must a step of a line's child job (batch
    work too, though only the line carries ``batch_id``); a live job's step is re-sent at the default one."""
    now = utcnow()
    long_ago = now - timedelta(seconds=600)
    with session_scope() as s:
        def running(batch_id: str | None = None, root: str | None = None) -> str:
            job = Job(tenant="t", task="t", pool="default", planner="template", status="running", batch_id=batch_id,
                      root_job_id=root, parent_job_id=root, parent_step_index=None if root is None else 0,
                      depth=0 if root is None else 1, created_at=long_ago, updated_at=long_ago)
            s.add(job)
            s.flush()
            s.add(Step(job_id=job.id, index=0, agent="a", instruction="x", access_list=[], status="queued",
                       queued_at=long_ago))
            return job.id

        line, live = running("batch_1"), running()
        child, live_child = running(root=line), running(root=live)
    _, dispatch = reconcile_once(settings)
    assert sorted(dispatch.steps) == sorted((j, 0) for j in (line, live, child, live_child))
    assert dispatch.background == {line, child}
