"""OpenAI-compatible Files: upload a batch input file, read a file's record and its content.

An input file is checked on upload (size, line count, one JSON object per line, unique ``custom_id``s):
one that fails is refused naming the line, so a batch never starts from a file that cannot run.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import Response
from sqlmodel import Session

from conductor.batches import MAX_UPLOAD_FILENAME_CHARS, BatchFileError, parse_input, store_input_file
from conductor.openai_wire import FileDeleted, FileList, FileObject, FilePurpose
from conductor.service.deps import SessionDep, SettingsDep, TenantDep
from conductor.service.openai_errors import OpenAIError, openai_errors
from conductor.service.problems import http_status
from conductor.settings import Settings
from conductor.store import batches as store
from conductor.store.jobs import lock_tenant
from conductor.store.models import StoredFile
from conductor.submission import unstorable

router = APIRouter(tags=["openai"])
FILE_ID_RE = re.compile(r"file-[0-9a-f]{32}")
MAX_LIST_LIMIT = 100
CONTENT_RESPONSE = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}


def file_object(file: StoredFile) -> FileObject:
    return FileObject(
        id=file.id,
        bytes=file.size_bytes,
        created_at=int(file.created_at.timestamp()),
        filename=file.filename,
        purpose="batch_output" if file.purpose == "batch_output" else "batch",
    )


def file_or_404(session: Session, file_id: str, tenant: str) -> StoredFile:
    """The caller's file, or 404 (another tenant's file is indistinguishable from a missing one)."""
    file = store.get_file(session, file_id=file_id, tenant=tenant) if FILE_ID_RE.fullmatch(file_id) else None
    if file is None:
        raise OpenAIError(404, f"No such File object: {file_id if FILE_ID_RE.fullmatch(file_id) else '(malformed id)'}",
                          code="not_found", param="file_id")
    return file


def check_file_quota(session: Session, tenant: str, settings: Settings, *, files: int, size: int, what: str,
                     param: str) -> None:
    """400 ``quota_exceeded`` when ``files`` more files of ``size`` bytes would pass the tenant's quota,
    counting the two files each of its running batches will write. Call under the tenant's files lock
    (``lock_tenant(scope="files")``)."""
    held, used = store.file_usage(session, tenant=tenant)
    running = store.open_batches(session, tenant=tenant)
    if held + 2 * running + files > settings.tenant_max_files or used + size > settings.tenant_max_file_bytes:
        pending = f" and its {running} running batches will write {2 * running} more" if running else ""
        raise OpenAIError(
            400, f"this tenant's {held} files take {used:,} bytes{pending}; {what} it would pass its quota of "
            f"{settings.tenant_max_files:,} files or {settings.tenant_max_file_bytes:,} bytes "
            "(CONDUCTOR_TENANT_MAX_FILES, CONDUCTOR_TENANT_MAX_FILE_BYTES): delete files you no longer need "
            "(DELETE /v1/files/{file_id}) and try again", param=param, code="quota_exceeded")


@router.post("/v1/files", responses=openai_errors(400, 401, 413, 422, 503))
def upload_file(
    file: UploadFile,
    purpose: Annotated[str, Form(max_length=32)],
    session: SessionDep,
    tenant: TenantDep,
    settings: SettingsDep,
    expires_anchor: Annotated[str | None, Form(alias="expires_after[anchor]", max_length=64)] = None,
    expires_seconds: Annotated[str | None, Form(alias="expires_after[seconds]", max_length=64)] = None,
    expires_after: Annotated[str | None, Form(max_length=1024)] = None,
) -> FileObject:
    """A batch input file (`purpose` must be `batch`): JSONL, one request per line,
    `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/responses" | "/v1/jobs", "body"}`.
    Files are kept until deleted: `expires_after` is refused, not ignored."""
    if purpose != "batch":
        raise OpenAIError(400, f"purpose '{purpose}' is not supported here; use 'batch'", param="purpose",
                          code="invalid_purpose")
    if expires_anchor is not None or expires_seconds is not None or expires_after is not None:
        raise OpenAIError(400, "expires_after is not supported: files are kept until deleted (DELETE "
                          "/v1/files/{file_id}); leave it out and delete the file when done with it",
                          param="expires_after", code="unsupported_parameter")
    content = file.file.read(settings.batch_max_file_bytes + 1)
    filename = file.filename or "batch.jsonl"
    if unstorable(filename):
        raise OpenAIError(400, f"filename {unstorable(filename)}", param="file", code="invalid_filename")
    if len(filename) > MAX_UPLOAD_FILENAME_CHARS:  # (a header line past 4,224 bytes: the parser's own 400)
        raise OpenAIError(400, f"the file's name is {len(filename):,} characters; it may be at most "
                          f"{MAX_UPLOAD_FILENAME_CHARS:,} (MAX_UPLOAD_FILENAME_CHARS)", param="file",
                          code="invalid_filename")
    try:  # before any database work: no connection is held while a 10 MB file is read
        lines = parse_input(content, settings)
    except BatchFileError as exc:
        raise OpenAIError(http_status(exc.kind), str(exc), code=exc.code, param="file") from exc
    # The quota check and the insert hold the tenant's files lock until commit (the parse does not), so
    # two uploads cannot both take the last place.
    lock_tenant(session, tenant=tenant, scope="files")
    check_file_quota(session, tenant, settings, files=1, size=len(content), what="with this one",
                     param="file")
    stored = store_input_file(session, tenant=tenant, filename=filename, content=content, settings=settings,
                              lines=lines)
    session.commit()
    return file_object(stored)


@router.get("/v1/files", responses=openai_errors(400, 401, 422, 503))
def list_files(
    session: SessionDep,
    tenant: TenantDep,
    purpose: Annotated[FilePurpose | None, Query()] = None,
    after: Annotated[str | None, Query(pattern=FILE_ID_RE.pattern)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST_LIMIT)] = 20,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> FileList:
    """The tenant's files (batch inputs, and the output and error files of its batches), newest first by
    default; pass the last id of a page as `after` for the next (a file deleted since still serves, for 7
    days: a client may delete the files as it pages through them)."""
    try:
        files = store.list_files(session, tenant=tenant, purpose=purpose, after=after, limit=limit + 1,
                                 newest_first=order == "desc")
    except store.UnknownCursor:
        raise OpenAIError(400, f"after={after} is not one of your files (nor one deleted in the last 7 days): "
                          "pass the last id of the previous page, or leave after out to list from the start",
                          param="after", code="invalid_cursor") from None
    page = [file_object(f) for f in files[:limit]]
    return FileList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                    has_more=len(files) > limit)


@router.get("/v1/files/{file_id}", responses=openai_errors(401, 404, 503))
def get_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileObject:
    return file_object(file_or_404(session, file_id, tenant))


@router.get(
    "/v1/files/{file_id}/content",
    response_class=Response,
    responses={**openai_errors(401, 404, 503), 200: CONTENT_RESPONSE},
)
def get_file_content(file_id: str, session: SessionDep, tenant: TenantDep) -> Response:
    file = file_or_404(session, file_id, tenant)
    return Response(file.content, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{file.id}.jsonl"'})


@router.delete("/v1/files/{file_id}", responses=openai_errors(401, 404, 503))
def delete_file(file_id: str, session: SessionDep, tenant: TenantDep) -> FileDeleted:
    """Deletes the file and its content. A batch created from an input file no longer needs it; a batch's
    output or error file, once deleted, is gone from the batch too (its content answers 404)."""
    file = file_or_404(session, file_id, tenant)
    deleted = store.delete_file(session, file_id=file.id, tenant=tenant)
    session.commit()
    return FileDeleted(id=file.id, deleted=deleted)
