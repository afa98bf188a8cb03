"""Turning a client's request into a committed job: validation with field-level reasons, limits,
pool resolution, idempotency. Shared by the API, the CLI and embedded mode."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, UrlConstraints, field_validator
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from conductor.errors import Rejection
from conductor.planning.planner import effective_limits
from conductor.pool.config import PoolConfig, PoolError, check_planner_ref, load_pool, resolve_pool_path
from conductor.settings import SHIPPED_POOLS_DIR, Settings
from conductor.store import jobs as store
from conductor.store.models import Job, utcnow
from conductor.store.webhooks import default_webhook_url
from conductor.webhooks.targets import UnsafeTarget, check_url, denied_of
from conductor.workflow import CONDUCTOR_AGENT, FieldError, WorkflowError, parse_workflow

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from sqlalchemy.sql import Executable

    from conductor.quotas import Admission

log = logging.getLogger(__name__)
MAX_IDEMPOTENCY_KEY_CHARS = 255
MAX_URL_CHARS = 2048
"""The longest ``webhook_url``, as given and once normalized (IDNA, percent-encoding): the column's width."""
MAX_PLANNER_CHARS = 128
MAX_JSON_DEPTH = 32
"""How deeply ``workflow`` and ``metadata`` may nest. Deeper input is refused (422) before anything
walks it recursively (serializing a few hundred levels fails inside pydantic)."""


MAX_LIMIT_COST_USD = 1_000_000.0
MAX_LIMIT_TOKENS = 1_000_000_000
"""The largest budgets a job may ask for: finite, and within what the store's counters hold (a recursive
step reserves its child's whole allowance in a 32-bit column)."""


class Limits(BaseModel):
    """Numbers are strict (``strict=True`` here and on the OpenAI routes' numeric and boolean fields): JSON's
    ``true`` and ``"5"`` are not numbers, though pydantic's lax mode reads them as 1 and 5 (a schema-violating
    request the API accepted, found by the schemathesis test)."""

    model_config = ConfigDict(extra="forbid")

    max_steps: int | None = Field(default=None, ge=1, le=50, strict=True)
    max_depth: int | None = Field(default=None, ge=0, le=5, strict=True)
    max_cost_usd: float | None = Field(default=None, gt=0, le=MAX_LIMIT_COST_USD, allow_inf_nan=False, strict=True)
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_LIMIT_TOKENS, strict=True)
    max_answer_tokens: int | None = Field(default=None, gt=0, le=MAX_LIMIT_TOKENS, strict=True)
    """The answering step's (the last step's) output cap, below its agent's ``max_tokens``: the OpenAI
    routes' ``max_output_tokens`` / ``max_completion_tokens``. Other steps and the planner keep theirs."""
    deadline_s: float | None = Field(default=None, gt=0, le=7 * 24 * 3600, strict=True)


class JobCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(min_length=1, description="The job: a question, a coding task, a research brief.")
    pool: str | None = Field(default=None, max_length=64)
    planner: str | None = Field(default=None, max_length=MAX_PLANNER_CHARS)
    workflow: dict[str, Any] | None = None
    limits: Limits = Field(default_factory=Limits)
    webhook_url: Annotated[HttpUrl, UrlConstraints(max_length=MAX_URL_CHARS)] | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("task")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be blank")
        return v

    @field_validator("workflow", "metadata", mode="before")
    @classmethod
    def _shallow(cls, v: Any) -> Any:
        if nesting_depth(v) > MAX_JSON_DEPTH:
            raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        return v

    @field_validator("task", "pool", "planner", "workflow", "metadata")
    @classmethod
    def _storable(cls, v: Any) -> Any:
        """Text Postgres cannot store (NUL, lone surrogates) or JSON it rejects (NaN, Infinity) is refused
        here, with its location, instead of failing in the database."""
        problem = unstorable(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("webhook_url")
    @classmethod
    def _url_fits(cls, v: HttpUrl | None) -> HttpUrl | None:
        if v is not None and len(str(v)) > MAX_URL_CHARS:
            raise ValueError(f"longer than {MAX_URL_CHARS} characters once encoded")
        return v


def nesting_depth(value: Any) -> int:
    """How many objects/arrays deep ``value`` goes, walked without recursion (stops past the limit)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                return depth
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def unstorable(value: Any) -> str | None:
    """Why ``value`` cannot be stored as text/JSON, or None."""
    if isinstance(value, str):
        if "\x00" in value:
            return "must not contain NUL characters"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "must be valid Unicode (no unpaired surrogates)"
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "must not contain NaN or Infinity"
    if isinstance(value, dict):
        for key, item in value.items():
            problem = unstorable(key) or unstorable(item)
            if problem:
                return problem
    if isinstance(value, list):
        for item in value:
            problem = unstorable(item)
            if problem:
                return problem
    return None


class SubmissionError(ValueError):
    """A request that cannot become a job; ``kind`` says why (the service maps it to an HTTP status)."""

    def __init__(self, kind: Rejection, title: str, errors: list[FieldError]):
        self.kind = kind
        self.title = title
        self.errors = errors
        super().__init__(f"{title}: " + "; ".join(str(e) for e in errors))


class IdempotencyConflict(ValueError):
    """The Idempotency-Key was used before with a different request body."""


def pools_dirs(settings: Settings, *, local: bool = False) -> list[Path]:
    """Where named pools are found. API clients (tenants) may name only the default pool and the pools
    in ``CONDUCTOR_POOLS_DIR`` — the ones the operator published; the CLI and ``conductor run`` (the
    operator) also reach the pools beside the default pool file and the shipped ones."""
    published = [settings.pools_dir] if settings.pools_dir else []
    return [*published, settings.pool_file.parent, SHIPPED_POOLS_DIR] if local else published


def resolve_pool(name: str | None, settings: Settings, *, local: bool = False) -> PoolConfig:
    if name is None or name == settings.pool_file.stem:
        path = settings.pool_file
    else:
        path = resolve_pool_path(
            name, default_file=settings.pool_file, pools_dirs=pools_dirs(settings, local=local), allow_path=local
        )
    try:
        return load_pool(path)
    except PoolError:
        if local:
            raise
        log.exception("pool %r is invalid", name)
        raise PoolError(f"pool '{name or path.stem}' is misconfigured on the server; its operator's log "
                        "has the details") from None


def request_hash(body: JobCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def validate_request(body: JobCreate, settings: Settings, *, allow_pool_path: bool = False) -> PoolConfig:
    """Every check that can reject a request, before anything is stored."""
    if len(body.task) > settings.max_task_chars:
        raise SubmissionError(
            Rejection.TOO_LARGE,
            "Task too large",
            [FieldError(("body", "task"), f"{len(body.task)} characters; the limit is {settings.max_task_chars}")],
        )
    if len(json.dumps(body.metadata)) > settings.max_metadata_bytes:
        raise SubmissionError(
            Rejection.TOO_LARGE, "Metadata too large",
            [FieldError(("body", "metadata"), f"over {settings.max_metadata_bytes} bytes")],
        )
    try:
        pool = resolve_pool(body.pool, settings, local=allow_pool_path)
    except PoolError as exc:
        raise SubmissionError(Rejection.INVALID, "Unknown pool", [FieldError(("body", "pool"), str(exc))]) from exc
    planner = body.planner or CONDUCTOR_AGENT
    try:
        check_planner_ref(planner, pool.agents)
    except ValueError as exc:
        refused = [FieldError(("body", "planner"), str(exc))]
        raise SubmissionError(Rejection.INVALID, "Unknown planner", refused) from exc
    if body.webhook_url is not None:
        try:
            check_url(str(body.webhook_url), allow_loopback=settings.webhook_allow_loopback,
                      denied=denied_of(settings))
        except UnsafeTarget as exc:
            refused = [FieldError(("body", "webhook_url"), str(exc))]
            raise SubmissionError(Rejection.INVALID, "Webhook target refused", refused) from exc
    if body.workflow is not None:
        max_steps, max_depth = effective_limits(body.limits.max_steps, body.limits.max_depth, settings)
        try:
            parse_workflow(
                body.workflow,
                agents=pool.worker_names,
                max_steps=max_steps,
                max_instruction_chars=settings.max_instruction_chars,
                allow_conductor=max_depth > 0,
                loc=("body", "workflow"),
            )
        except WorkflowError as exc:
            raise SubmissionError(Rejection.INVALID, "Invalid workflow", exc.errors) from exc
    return pool


def create_job(
    session: Session,
    body: JobCreate,
    *,
    tenant: str,
    settings: Settings,
    idempotency_key: str | None = None,
    allow_pool_path: bool = False,
    context: list[dict[str, Any]] | None = None,
    admit: Admission | None = None,
    batch_id: str | None = None,
    publishing: bool = False,
    commit: bool = False,
    then: Callable[[Job], Sequence[tuple[Executable, Mapping[str, Any]]]] | None = None,
) -> tuple[Job, bool]:
    """Validates and inserts the job (not yet committed). Returns (job, created); with a repeated
    Idempotency-Key and the same body, the earlier job and False.

    ``context`` is prior conversation (chat completions: the turns before the last user message);
    ``batch_id`` links the job to the batch whose line it is.
    ``admit`` (the API's quotas) runs after validation, only for a request that would create a job,
    and may raise to refuse it.
    ``publishing``: the caller sends the plan message right after its commit
    (``enqueue_plan(job.id, recorded=True)``), so ``enqueued_at`` is written with the row instead of in a
    transaction of its own; should that send fail, ``enqueue_plan`` clears it again.
    ``commit`` (with ``admit``): the insert commits the session's transaction in its own round trip, for a
    caller that would commit right after (the tenant's lock is then held only while the server works).
    ``then(job)``: statements inserting rows that belong to the new job, sent with its insert (in the same
    pipeline under ``admit``: ``store.insert_job_admitted``), so that a commit there commits them too."""
    digest = request_hash(body)
    if idempotency_key is not None:
        if not 1 <= len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_CHARS:
            raise SubmissionError(
                Rejection.MALFORMED, "Bad Idempotency-Key",
                [FieldError(("header", "Idempotency-Key"), "must be 1-255 characters")],
            )
        existing = store.get_job_by_idempotency_key(session, tenant=tenant, key=idempotency_key)
        if existing is not None:
            return _replayed(existing, digest)
    pool = validate_request(body, settings, allow_pool_path=allow_pool_path)
    # Never added to a session (``insert_job`` is one Core INSERT), so it is built without the ORM's
    # instrumentation: model_construct fills in the same defaults at a fifth of the CPU (0.38 -> 0.08 ms).
    webhook_url = str(body.webhook_url) if body.webhook_url else default_webhook_url(session, tenant=tenant)
    job = Job.model_construct(
        tenant=tenant,
        task=body.task,
        pool=pool.name,
        pool_config=pool.model_dump(mode="json"),
        planner=body.planner or CONDUCTOR_AGENT,
        request_workflow=body.workflow,
        limits=body.limits.model_dump(mode="json"),
        meta=body.metadata,
        webhook_url=webhook_url,
        webhook_url_from_default=True if webhook_url is not None and not body.webhook_url else None,
        idempotency_key=idempotency_key,
        request_hash=digest,
        context=context or None,
        batch_id=batch_id,
        enqueued_at=utcnow() if publishing else None,
    )
    try:
        companions = then(job) if then is not None else ()
        if admit is None:
            store.insert_job(session, job=job)
            for statement, params in companions:
                session.connection().execute(statement, dict(params))
        else:  # the rate first; the in-flight quota is the insert's own condition (it takes the tenant's lock)
            admit.check_rate()
            if not store.insert_job_admitted(session, job=job, max_in_flight=admit.max_in_flight, commit=commit,
                                             then=companions):
                raise admit.refused(session)
    except IntegrityError:
        # Two requests with one key raced; the other one committed first.
        session.rollback()
        existing = store.get_job_by_idempotency_key(session, tenant=tenant, key=idempotency_key or "")
        if existing is None:
            raise
        return _replayed(existing, digest)
    return job, True


def _replayed(existing: Job, digest: str) -> tuple[Job, bool]:
    if existing.request_hash != digest:
        raise IdempotencyConflict(
            "this Idempotency-Key was already used with a different request body; use a new key"
        )
    return existing, False
