"""Data access for files, batches and their lines. Every read takes the tenant, so another tenant's file
or batch is simply not found; the one state change (a batch ending) is a conditional update."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.orm import QueryableAttribute, defer
from sqlmodel import Session, col, select

from conductor.store.models import (
    IN_FLIGHT_SQL,
    Batch,
    BatchRequest,
    BatchStatus,
    DeletedFile,
    Job,
    JobStatus,
    StoredFile,
)

_CONTENT = cast("QueryableAttribute[Any]", StoredFile.content)


def insert_file(session: Session, *, file: StoredFile) -> StoredFile:
    session.add(file)
    session.flush()
    return file


def get_file(session: Session, *, file_id: str, tenant: str) -> StoredFile | None:
    """The file's record; its content (up to ``batch_max_file_bytes``) is read only when used."""
    stmt = select(StoredFile).where(StoredFile.id == file_id, StoredFile.tenant == tenant)
    return session.exec(stmt.options(defer(_CONTENT))).first()


def file_usage(session: Session, *, tenant: str) -> tuple[int, int]:
    """(files, bytes) the tenant's files take."""
    row = session.execute(sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(StoredFile.size_bytes), 0))
                          .where(col(StoredFile.tenant) == tenant)).one()
    return int(row[0]), int(row[1])


def open_batches(session: Session, *, tenant: str) -> int:
    """The tenant's batches still running: each will write its output and error files when it ends."""
    return int(session.execute(sa.select(sa.func.count()).select_from(Batch).where(
        col(Batch.tenant) == tenant, col(Batch.status).in_(BatchStatus.OPEN))).scalar_one())


def unfinished_lines(session: Session, *, tenant: str) -> int:
    """The tenant's batch lines whose job has not ended (the partial index of unfinished top-level jobs
    serves it: one entry per live job and unfinished line, whatever the tenant's history)."""
    stmt = sa.select(sa.func.count()).select_from(Job).where(
        col(Job.tenant) == tenant, sa.text(IN_FLIGHT_SQL), col(Job.batch_id).is_not(None))
    return int(session.execute(stmt).scalar_one())


DELETED_FILE_KEPT_S = 7 * 24 * 3600.0
"""How long a deleted file's place in its tenant's list is kept (``DeletedFile``), so a list paged with it
as the cursor goes on; later such a cursor is refused, naming ``after``."""


class UnknownCursor(LookupError):
    """A list's ``after`` is no file of the tenant's (nor one it deleted within ``DELETED_FILE_KEPT_S``)."""


def delete_file(session: Session, *, file_id: str, tenant: str) -> bool:
    """Deletes the file and its content, keeping where it stood in the tenant's list (``DeletedFile``)."""
    deleted = session.execute(
        sa.delete(StoredFile).where(col(StoredFile.id) == file_id, col(StoredFile.tenant) == tenant)
        .returning(col(StoredFile.created_at))
    ).first()
    if deleted is None:
        return False
    session.add(DeletedFile(id=file_id, tenant=tenant, created_at=deleted[0]))
    return True


def purge_deleted_files(session: Session, *, now: datetime, limit: int = 1000) -> int:
    """Forgets up to ``limit`` deleted files' places kept past ``DELETED_FILE_KEPT_S``; returns how many.
    Rows another transaction holds are skipped, never waited for."""
    old = (sa.select(col(DeletedFile.id))
           .where(col(DeletedFile.deleted_at) <= now - timedelta(seconds=DELETED_FILE_KEPT_S))
           .limit(limit).with_for_update(skip_locked=True).scalar_subquery())
    result = session.execute(sa.delete(DeletedFile).where(col(DeletedFile.id).in_(old)))
    return int(getattr(result, "rowcount", 0) or 0)


def list_files(
    session: Session, *, tenant: str, purpose: str | None, after: str | None, limit: int, newest_first: bool = True
) -> list[StoredFile]:
    """``after`` is the id of the last file of the previous page (a cursor): one of the tenant's files, or
    one it deleted within ``DELETED_FILE_KEPT_S`` (the list goes on from where it stood), else
    ``UnknownCursor``. The records only: a page of a hundred files must not read a gigabyte of their
    content."""
    stmt = select(StoredFile).where(StoredFile.tenant == tenant).options(defer(_CONTENT))
    if purpose is not None:
        stmt = stmt.where(StoredFile.purpose == purpose)
    if after is not None:
        cursor: StoredFile | DeletedFile | None = get_file(session, file_id=after, tenant=tenant)
        if cursor is None:
            cursor = session.exec(select(DeletedFile).where(DeletedFile.id == after,
                                                            DeletedFile.tenant == tenant)).first()
        if cursor is None:
            raise UnknownCursor(after)
        # a row comparison: an index scan of ix_stored_file_tenant_created_id starts at the cursor (the
        # equivalent OR of two comparisons cannot start one)
        position = sa.tuple_(col(StoredFile.created_at), col(StoredFile.id))
        at = sa.tuple_(cursor.created_at, cursor.id)
        stmt = stmt.where(position < at if newest_first else position > at)
    order = [col(StoredFile.created_at), col(StoredFile.id)]
    stmt = stmt.order_by(*(c.desc() for c in order)) if newest_first else stmt.order_by(*order)
    return list(session.exec(stmt.limit(limit)))


def insert_batch(session: Session, *, batch: Batch) -> Batch:
    session.add(batch)
    session.flush()
    return batch


def insert_request(session: Session, *, request: BatchRequest) -> None:
    """Added to the session; written with the next flush (one round trip for many lines)."""
    session.add(request)


def get_batch(session: Session, *, batch_id: str, tenant: str | None = None) -> Batch | None:
    stmt = select(Batch).where(Batch.id == batch_id)
    if tenant is not None:
        stmt = stmt.where(Batch.tenant == tenant)
    return session.exec(stmt).first()


def list_batches(session: Session, *, tenant: str, after: str | None, limit: int) -> list[Batch]:
    """Newest first; ``after`` is the id of the last batch of the previous page (a cursor)."""
    stmt = select(Batch).where(Batch.tenant == tenant)
    if after is not None:
        cursor = get_batch(session, batch_id=after, tenant=tenant)
        if cursor is None:
            return []
        # a row comparison, as list_files: the scan of ix_batch_tenant_created_id starts at the cursor
        stmt = stmt.where(sa.tuple_(col(Batch.created_at), col(Batch.id)) < sa.tuple_(cursor.created_at, cursor.id))
    return list(session.exec(stmt.order_by(col(Batch.created_at).desc(), col(Batch.id).desc()).limit(limit)))


def batches_to_end(session: Session, *, limit: int = 200) -> list[str]:
    """Open batches the reconciler can end now: every cancelling one (its cancellation is re-driven) and
    every one in progress with no job left running. Only those are read, so a backlog of long batches
    still running cannot crowd a finished one out of the pass."""
    running = (
        sa.select(sa.literal(1))
        .select_from(Job)
        .where(col(Job.batch_id) == col(Batch.id), col(Job.status).in_(list(JobStatus.UNFINISHED)))
    )
    stmt = select(Batch.id).where(
        sa.or_(col(Batch.status) == BatchStatus.CANCELLING,
               sa.and_(col(Batch.status) == BatchStatus.IN_PROGRESS, ~running.exists()))
    )
    return list(session.exec(stmt.order_by(col(Batch.created_at)).limit(limit)))


@dataclass(frozen=True)
class Counts:
    total: int
    completed: int
    failed: int
    unfinished: int


def batch_counts(session: Session, *, batch_id: str) -> Counts:
    """Lines whose job succeeded (completed), lines that failed (refused, or their job failed or was
    cancelled), and lines whose job has not ended yet. Counted from the batch's jobs by status (an
    index-only count on ``ix_job_batch_status``) plus its lines refused at creation (no job): one
    statement, not a join of every line to its job (a 50,000-line batch: 745 -> 6 ms per poll)."""
    jobs = (sa.select(col(Job.status), sa.func.count()).where(col(Job.batch_id) == batch_id)
            .group_by(col(Job.status)))
    refused = (sa.select(sa.cast(sa.null(), sa.String), sa.func.count()).select_from(BatchRequest)
               .where(col(BatchRequest.batch_id) == batch_id, col(BatchRequest.job_id).is_(None)))
    by_status: dict[str | None, int] = {}
    for status, n in session.execute(sa.union_all(jobs, refused)).all():
        by_status[status] = by_status.get(status, 0) + int(n)
    total = sum(by_status.values())
    completed = by_status.get(JobStatus.SUCCEEDED, 0)
    failed = by_status.get(None, 0) + by_status.get(JobStatus.FAILED, 0) + by_status.get(JobStatus.CANCELLED, 0)
    return Counts(total=total, completed=completed, failed=failed, unfinished=total - completed - failed)


def has_unfinished_jobs(session: Session, *, batch_id: str) -> bool:
    """Whether a job of the batch has not ended: what ending it waits for (an index probe, not a count)."""
    running = sa.select(sa.literal(1)).select_from(Job).where(
        col(Job.batch_id) == batch_id, col(Job.status).in_(list(JobStatus.UNFINISHED)))
    return bool(session.execute(sa.select(running.exists())).scalar())


def batch_lines(session: Session, *, batch_id: str) -> list[tuple[BatchRequest, Job | None]]:
    stmt = (
        select(BatchRequest, Job)
        .join(Job, col(Job.id) == col(BatchRequest.job_id), isouter=True)
        .where(BatchRequest.batch_id == batch_id)
        .order_by(col(BatchRequest.line))
    )
    return [(request, job) for request, job in session.exec(stmt)]


def custom_ids(session: Session, *, batch_id: str) -> list[str]:
    """The batch's lines' ``custom_id``s in input order."""
    stmt = select(BatchRequest.custom_id).where(BatchRequest.batch_id == batch_id).order_by(col(BatchRequest.line))
    return list(session.exec(stmt))


def unfinished_job_ids(session: Session, *, batch_id: str) -> list[str]:
    stmt = select(Job.id).where(Job.batch_id == batch_id, col(Job.status).not_in(list(JobStatus.TERMINAL)))
    return list(session.exec(stmt))


def transition_batch(session: Session, *, batch_id: str, from_: Collection[str], to: str, **values: Any) -> bool:
    """Moves a batch to ``to`` only from one of ``from_``; returns whether this caller won."""
    result = session.execute(
        sa.update(Batch)
        .where(col(Batch.id) == batch_id, col(Batch.status).in_(list(from_)))
        .values(status=to, **values)
    )
    return int(getattr(result, "rowcount", 0) or 0) == 1


def expired_open_batch_ids(session: Session, *, now: datetime) -> list[str]:
    stmt = select(Batch.id).where(Batch.status == BatchStatus.IN_PROGRESS, col(Batch.expires_at) < now)
    return list(session.exec(stmt.limit(200)))
