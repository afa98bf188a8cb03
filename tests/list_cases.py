"""Lists checked the same way on Postgres (tests/integration/test_job_list.py, test_batch_reads.py) and on
SQLite (tests/unit/test_lists_sqlite.py): ``list_jobs``'s metadata filter (Postgres adds conditions its GIN
index answers, which must never drop a job the exact condition matches) and several statuses listed a
range each and merged, across pages, with jobs created at the same instant; batches and files paged by a
cursor among rows created at the same instant."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

from sqlmodel import select

from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import Job, utcnow

METADATA: list[dict[str, Any]] = [
    {"group": "x", "n": 5},
    {"group": "y", "n": "5"},
    {"n": 5.5, "tag": None},
    {"vip": True, "o": {"a": 1}},
    {},
    {"f": 0.12345678901234568, "big": 12345678901234567890},
    {"s": 'hello "world" \\ ?'},
    {"it's \"odd\"": "v", "n": -3},
]

# (meta_key, meta_value, the indexes in METADATA of the jobs it matches): as text, "5" matches 5 and "5"
EVERYWHERE: list[tuple[str, str | None, set[int]]] = [
    ("group", None, {0, 1}),
    ("tag", None, {2}),  # a key whose value is JSON null is present
    ("tag", "null", set()),  # but has no text
    ("vip", "true", {3}),
    ("vip", "false", set()),
    ("group", "x", {0}),
    ("n", None, {0, 1, 2, 7}),
    ("n", "5", {0, 1}),
    ("n", "5.5", {2}),
    ("n", "-3", {7}),
    ("n", "6", set()),
    ("f", "0.12345678901234568", {5}),
    ("s", 'hello "world" \\ ?', {6}),
    ("it's \"odd\"", None, {7}),
    ("it's \"odd\"", "v", {7}),
    ("vip", None, {3}),
    ("o", None, {3}),
    ("absent", None, set()),
    ("absent", "x", set()),
]
POSTGRES_ONLY: list[tuple[str, str | None, set[int]]] = [
    ("o", '{"a": 1}', {3}),  # an object as Postgres writes it (SQLite: '{"a":1}')
    ("big", "12345678901234567890", {5}),  # beyond 64 bits: SQLite keeps it as a real
]
SQLITE_ONLY: list[tuple[str, str | None, set[int]]] = [
    ("o", '{"a":1}', {3}),
    ("n", "5.50", {2}),  # a real number compares by value
]


def _insert(tenant: str, jobs: list[dict[str, Any]]) -> list[str]:
    ids = []
    with session_scope() as s:
        for job in jobs:
            row = Job(tenant=tenant, task="t", pool="default", planner="template", **job)
            s.add(row)
            ids.append(row.id)
    return ids


def _walk(tenant: str, where: store.JobFilter, limit: int) -> list[str]:
    seen: list[str] = []
    after: Job | None = None
    while True:
        with session_scope() as s:
            page = store.list_jobs(s, tenant=tenant, where=where, after=after, limit=limit)
            s.expunge_all()
        seen += [j.id for j in page]
        if len(page) < limit:
            return seen
        after = page[-1]


def check_metadata_filter(*, postgres: bool) -> None:
    """Also with Postgres's probe of the newest jobs cut to one or three (``store.PROBE_ROWS``), so pages
    are completed past it, through the GIN index (a value rare in the probe) or walking on."""
    tenant = f"meta-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    ids = _insert(tenant, [{"meta": m, "created_at": now - timedelta(seconds=i)} for i, m in enumerate(METADATA)])
    probe_rows = store.PROBE_ROWS
    try:
        for store.PROBE_ROWS in (probe_rows, 1, 3):
            for key, value, expected in EVERYWHERE + (POSTGRES_ONLY if postgres else SQLITE_ONLY):
                for limit in (100, 1, 2):
                    where = store.JobFilter(meta_key=key, meta_value=value)
                    assert _walk(tenant, where, limit) == [ids[i] for i in sorted(expected)], (key, value, limit)
    finally:
        store.PROBE_ROWS = probe_rows


def check_a_common_value_past_the_probe() -> None:
    """Postgres: matches past the probe are found whether the value was rare in it (the GIN index) or not."""
    tenant = f"meta-common-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    metadata = [{"kind": "a" if i % 3 else "b", "n": i} for i in range(30)]
    ids = _insert(tenant, [{"meta": m, "created_at": now - timedelta(seconds=i)} for i, m in enumerate(metadata)])
    probe_rows = store.PROBE_ROWS
    try:
        for store.PROBE_ROWS in (4, 10):
            for value in ("a", "b"):
                expected = [ids[i] for i, m in enumerate(metadata) if m["kind"] == value]
                for limit in (4, 7, 50):
                    assert _walk(tenant, store.JobFilter(meta_key="kind", meta_value=value), limit) == expected
                    assert _walk(tenant, store.JobFilter(meta_key="kind", meta_value=value,
                                                         statuses=("queued", "failed")), limit) == expected
    finally:
        store.PROBE_ROWS = probe_rows


def check_several_statuses_across_pages() -> None:
    tenant = f"statuses-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    statuses = ["succeeded", "failed", "cancelled", "queued", "failed", "succeeded", "cancelled", "failed"]
    jobs = []
    for i in range(40):  # pairs created at the same instant: the id orders them
        jobs.append({"status": statuses[i % len(statuses)], "created_at": now - timedelta(seconds=i // 2)})
    ids = _insert(tenant, jobs)
    _insert(tenant, [{"status": "failed", "parent_job_id": ids[0], "created_at": now}])  # a child: not listed
    newest_first = sorted(range(len(jobs)), key=lambda i: (jobs[i]["created_at"], ids[i]), reverse=True)
    for wanted in (("failed", "cancelled"), ("cancelled", "queued", "succeeded"), ("failed",)):
        expected = [ids[i] for i in newest_first if jobs[i]["status"] in wanted]
        seen = _walk(tenant, store.JobFilter(statuses=wanted), 3)
        assert seen == expected, wanted


def check_batch_and_file_pages_with_equal_created_at() -> None:
    """Batches (newest first) and files (either way) page by (created_at, id): a cursor among rows
    created at the same instant neither skips nor repeats one."""
    from conductor.store import batches as batch_store
    from conductor.store.models import Batch, StoredFile

    tenant = f"pages-{uuid.uuid4().hex[:8]}"
    now = utcnow()
    instants = [now - timedelta(seconds=i // 3) for i in range(11)]  # threes created at the same instant
    with session_scope() as s:
        for at in instants:
            s.add(Batch(id=f"batch_{uuid.uuid4().hex}", tenant=tenant, endpoint="/v1/jobs", input_file_id="f",
                        completion_window="24h", created_at=at))
            s.add(StoredFile(id=f"file-{uuid.uuid4().hex}", tenant=tenant, purpose="batch", filename="f",
                             size_bytes=1, content=b"x", created_at=at))
    with session_scope() as s:
        batches = sorted(s.exec(select(Batch).where(Batch.tenant == tenant)), key=lambda b: (b.created_at, b.id),
                         reverse=True)
        files = sorted(s.exec(select(StoredFile).where(StoredFile.tenant == tenant)),
                       key=lambda f: (f.created_at, f.id), reverse=True)
        expected_batches, expected_files = [b.id for b in batches], [f.id for f in files]

    def walk(page_of: Any) -> list[str]:
        seen: list[str] = []
        after: str | None = None
        while True:
            with session_scope() as s:
                page = [row.id for row in page_of(s, after)]
            seen += page
            if len(page) < 2:
                return seen
            after = page[-1]

    assert walk(lambda s, after: batch_store.list_batches(s, tenant=tenant, after=after, limit=2)) == expected_batches
    for newest_first in (True, False):
        listed = walk(lambda s, after: batch_store.list_files(s, tenant=tenant, purpose=None, after=after, limit=2,
                                                              newest_first=newest_first))  # noqa: B023
        assert listed == (expected_files if newest_first else expected_files[::-1])
