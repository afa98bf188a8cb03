"""FastAPI dependencies every route shares: settings, a database session, the caller's tenant."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlmodel import Session

from conductor.service.problems import KEY_FOUND, Problem, UnknownKey
from conductor.settings import Settings, get_settings
from conductor.store import jobs as store
from conductor.store.db import get_engine
from conductor.store.keys import tenant_for_key
from conductor.store.models import Job

DEFAULT_TENANT = "default"
JOB_ID_RE = re.compile(r"[0-9a-f]{32}")


async def settings_dep() -> Settings:
    """``async``: it does no I/O, and a sync dependency would cost every request a thread-pool hop."""
    return get_settings()


SettingsDep = Annotated[Settings, Depends(settings_dep)]


def session_dep(settings: SettingsDep) -> Iterator[Session]:
    with Session(get_engine(settings.database_url), expire_on_commit=False) as session:
        yield session


SessionDep = Annotated[Session, Depends(session_dep)]


def bearer_key(settings: Settings, authorization: str | None) -> str | None:
    """The API key the request carries (None when the server requires none); 401 without one."""
    if not settings.auth_required:
        return None
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Problem(401, "Unauthorized", "send 'Authorization: Bearer <key>'; create one with "
                      "'conductor keys create --tenant NAME'", headers={"WWW-Authenticate": "Bearer"})
    return key.strip()


def resolve_tenant(session: Session, settings: Settings, authorization: str | None) -> str:
    key = bearer_key(settings, authorization)
    if key is None:
        return DEFAULT_TENANT
    tenant = tenant_for_key(session, key=key, pepper=settings.api_key_pepper)
    if tenant is None:
        raise UnknownKey()  # counted against the client's address by the error handlers
    return tenant


def key_found(request: Request) -> None:
    """Note on the request that its key was found (``problems.KEY_FOUND``)."""
    setattr(request.state, KEY_FOUND, True)


def tenant_dep(
    request: Request, session: SessionDep, settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> str:
    tenant = resolve_tenant(session, settings, authorization)
    key_found(request)
    # End the lookup's transaction now: its connection goes back to the pool instead of being held while
    # the request waits for a thread to run its endpoint. Held, a burst of requests that passed
    # authentication pinned every pooled connection while new ones waited for one on every thread: the
    # API stalled until the pool timeout (docs/benchmarks.md, api).
    session.commit()
    return tenant


TenantDep = Annotated[str, Depends(tenant_dep)]


def job_id_or_404(session: Session, job_id: str, tenant: str) -> str:
    """The caller's job's id, or 404 as ``job_or_404``, reading only the id (a job's task and context can
    each be 100,000 characters; an event stream needs neither)."""
    if not (JOB_ID_RE.fullmatch(job_id) and store.job_exists(session, job_id=job_id, tenant=tenant)):
        shown = job_id if JOB_ID_RE.fullmatch(job_id) else "(malformed id)"
        raise Problem(404, "Job not found", f"no job {shown} for this API key")
    return job_id


def job_or_404(session: Session, job_id: str, tenant: str) -> Job:
    """The caller's job, or 404 (another tenant's job is indistinguishable from a missing one)."""
    job = store.get_job(session, job_id=job_id, tenant=tenant) if JOB_ID_RE.fullmatch(job_id) else None
    if job is None:
        shown = job_id if JOB_ID_RE.fullmatch(job_id) else "(malformed id)"
        raise Problem(404, "Job not found", f"no job {shown} for this API key")
    return job
