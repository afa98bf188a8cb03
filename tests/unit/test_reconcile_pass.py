"""A reconciler pass on a migrated SQLite file: trace-viewer sessions past their expiry are deleted, so
keys that never sign in again leave no rows behind (signing in again drops a key's own expired ones; the
same delete runs on Postgres in tests/integration/test_trace_viewer.py), and one job's fault does not cost
the pass its other work."""

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
from conductor.store.models import UiSession, utcnow
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
