"""Data access for jobs, steps and attempts. Every state change is a conditional update, so a
duplicated or redelivered message can never move a row backwards or run finished work twice."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache, lru_cache
from typing import Any, NamedTuple, cast

import sqlalchemy as sa
from pydantic_core import PydanticUndefined
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, aggregate_order_by
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import QueryableAttribute, defer
from sqlmodel import Session, col, select

from conductor.context import PlannedStep
from conductor.errors import ErrorType
from conductor.store.db import ONE_TRANSACTION, in_id_order
from conductor.store.direct import Direct
from conductor.store.metrics import add_late_usage
from conductor.store.models import (
    LIVE_IN_FLIGHT_SQL,
    QUEUED_SQL,
    Job,
    JobStatus,
    Step,
    StepAttempt,
    StepStatus,
    UTCDateTime,
    utcnow,
)

# The tables, for the hot path's prebuilt Core statements (no ORM layer, built once per process).
JOB: sa.Table = Job.__table__  # type: ignore[attr-defined]
STEP: sa.Table = Step.__table__  # type: ignore[attr-defined]
ATTEMPT: sa.Table = StepAttempt.__table__  # type: ignore[attr-defined]


def get_job(session: Session, *, job_id: str, tenant: str | None = None) -> Job | None:
    """A job by id; with ``tenant`` given, another tenant's job is simply not found."""
    stmt = select(Job).where(Job.id == job_id)
    if tenant is not None:
        stmt = stmt.where(Job.tenant == tenant)
    return session.exec(stmt).first()


def job_exists(session: Session, *, job_id: str, tenant: str) -> bool:
    """Whether the tenant has this job, reading its id only."""
    return session.execute(sa.select(col(Job.id)).where(col(Job.id) == job_id, col(Job.tenant) == tenant)).first() \
        is not None


def get_job_by_idempotency_key(session: Session, *, tenant: str, key: str) -> Job | None:
    return session.exec(select(Job).where(Job.tenant == tenant, Job.idempotency_key == key)).first()


@dataclass(frozen=True)
class JobFilter:
    """What ``GET /v1/jobs`` may filter on; every field narrows the list, None means any."""

    statuses: tuple[str, ...] = ()
    batch_id: str | None = None
    """Only the jobs of this batch (``POST /v1/batches``): one per input line."""
    meta_key: str | None = None
    meta_value: str | None = None
    """With ``meta_key``: the metadata value as text (``"3"`` matches 3, ``"true"`` matches true)."""
    created_after: datetime | None = None
    """Inclusive: jobs created at or after this instant."""
    created_before: datetime | None = None
    """Exclusive, so consecutive windows [a, b), [b, c) hold every job exactly once."""


def list_jobs(
    session: Session, *, tenant: str, where: JobFilter = JobFilter(), after: Job | None = None, limit: int = 50
) -> list[Job]:
    """The tenant's top-level jobs, newest first, in the stable order (created_at, id) descending;
    ``after`` (keyset pagination) is the last job of the previous page.

    A status filter walks that status's range of ``ix_job_tenant_status_created``, so a rare status
    does not walk the tenant's whole history. Several statuses are listed one range each, merged: a
    single scan over all of them could not return them in (created_at, id) order, so Postgres would walk
    the tenant's index instead. A metadata filter on Postgres: ``_by_metadata``."""
    postgres = session.get_bind().dialect.name == "postgresql"
    conditions = [col(Job.tenant) == tenant, col(Job.parent_job_id).is_(None)]
    if where.batch_id is not None:
        conditions.append(col(Job.batch_id) == where.batch_id)
    if where.created_after is not None:
        conditions.append(col(Job.created_at) >= where.created_after)
    if where.created_before is not None:
        conditions.append(col(Job.created_at) < where.created_before)
    if after is not None:
        conditions.append(_older_than(after.created_at, after.id))
    statuses = sorted(set(where.statuses))
    if where.meta_key is not None and postgres:
        return _by_metadata(session, conditions, statuses, where, limit)
    if where.meta_key is not None:
        conditions.append(_sqlite_meta_condition(where.meta_key, where.meta_value))
    if len(statuses) > 1:
        return _jobs(session, _page(conditions, statuses, limit))
    stmt = select(Job).where(*conditions, *(col(Job.status) == status for status in statuses))
    return list(session.exec(stmt.order_by(*_NEWEST_FIRST).limit(limit).options(*_LIST_DEFERRED)))


_NEWEST_FIRST = (col(Job.created_at).desc(), col(Job.id).desc())
PROBE_ROWS = 1000
"""How many of the newest jobs (of the other filters) a metadata filter on Postgres reads first."""
RARE_IN_PROBE = 3
"""Fewer matches than this among them: the value is rare enough (under 0.3 %) for the GIN index to find
its jobs faster than walking on (measured at 1.6M jobs: docs/benchmarks.md, "Queries at scale")."""


def _by_metadata(session: Session, conditions: list[Any], statuses: list[str], where: JobFilter,
                 limit: int) -> list[Job]:
    """A metadata filter on Postgres. Its GIN index answers ``?`` and ``@>`` but the planner cannot tell a
    rare key or value from a common one (its statistics, a sample of 100 whole documents, are too coarse),
    and either wrong guess is costly at scale: walking the tenant's jobs for a value none has (0.8 s at 1.6M
    jobs), or fetching and sorting every job with a value 2 % have (0.24 s, where the walk finds a page in
    2,500 rows). So the newest
    ``PROBE_ROWS`` jobs are read first (their ids and whether each matches): a page is found there, or the
    walk goes on from the last of them, through the GIN index only when the value was rare among them."""
    exact = _meta_exact(where)
    probe = session.execute(_page(conditions, statuses, PROBE_ROWS, exact.label("hit"))).all()
    hits = [row.id for row in probe if row.hit]
    if len(hits) >= limit or len(probe) < PROBE_ROWS:
        return _jobs(session, sa.select(col(Job.id)).where(col(Job.id).in_(hits[:limit])))
    last = probe[-1]
    rare = _meta_indexed(where) if len(hits) < RARE_IN_PROBE else []
    rest = _page([*conditions, _older_than(last.created_at, last.id), exact, *rare], statuses, limit - len(hits))
    return _jobs(session, sa.union_all(sa.select(col(Job.id)).where(col(Job.id).in_(hits)),
                                       sa.select(rest.subquery().c.id)))


def _older_than(created_at: datetime, job_id: str) -> Any:
    """After this job in the list's order: a row comparison, which an index scan can start from."""
    return sa.tuple_(col(Job.created_at), col(Job.id)) < sa.tuple_(created_at, job_id)


def _page(conditions: list[Any], statuses: list[str], limit: int, *extra: Any) -> Any:
    """The ids (and created_at, and ``extra``) of the first ``limit`` jobs matching, newest first."""
    if len(statuses) <= 1:
        return (sa.select(col(Job.id), col(Job.created_at), *extra)
                .where(*conditions, *(col(Job.status) == status for status in statuses))
                .order_by(*_NEWEST_FIRST).limit(limit))
    ranges = [sa.select(col(Job.id), col(Job.created_at), *extra).where(*conditions, col(Job.status) == status)
              .order_by(*_NEWEST_FIRST).limit(limit).subquery() for status in statuses]
    merged = sa.union_all(*(sa.select(*r.c) for r in ranges)).subquery()
    return sa.select(*merged.c).order_by(merged.c.created_at.desc(), merged.c.id.desc()).limit(limit)


def _jobs(session: Session, ids: Any) -> list[Job]:
    """The jobs whose ids ``ids`` (a SELECT whose first column is a job id) returns, newest first."""
    stmt = select(Job).where(col(Job.id).in_(sa.select(next(iter(ids.subquery().c)))))
    return list(session.exec(stmt.order_by(*_NEWEST_FIRST).options(*_LIST_DEFERRED)))


_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
"""A metadata value's text that can stand for a JSON number. Postgres writes numbers without an exponent,
so none is accepted (nor needed) here."""


def _meta_exact(where: JobFilter) -> Any:
    """Postgres: the key present (whatever its value, JSON null too), or its value equal as text (``->>``:
    ``"5"`` matches 5 and "5", ``"true"`` matches true)."""
    assert where.meta_key is not None
    value = JOB.c.metadata[where.meta_key]
    return value.is_not(None) if where.meta_value is None else value.as_string() == where.meta_value


def _meta_indexed(where: JobFilter) -> list[Any]:
    """Conditions the GIN index on ``metadata`` answers (``?``, ``@>``), each true for every job
    ``_meta_exact`` matches (which still decides)."""
    assert where.meta_key is not None
    metadata = sa.type_coerce(JOB.c.metadata, JSONB)
    if where.meta_value is None or where.meta_value[:1] in ("{", "["):  # an object or array: the key only
        return [metadata.has_key(where.meta_key)]
    key = json.dumps(where.meta_key)
    docs = [f"{{{key}: {json.dumps(where.meta_value)}}}"]  # the value as a JSON string
    if where.meta_value in ("true", "false") or (len(where.meta_value) <= 100
                                                 and _JSON_NUMBER.fullmatch(where.meta_value)):
        docs.append(f"{{{key}: {where.meta_value}}}")  # or as the boolean or number it spells
    return [sa.or_(*(metadata.contains(sa.cast(sa.literal(doc, sa.Text), JSONB)) for doc in docs))]


def _sqlite_meta_condition(key: str, value: str | None) -> Any:
    """SQLite's: the job's metadata entries (``json_each``), so any key is found (a JSON path cannot name
    one holding a double quote, and a path to a missing key is JSON null there). A real number compares by
    value (SQLite writes 15 digits); an object or array as SQLite writes it (no spaces)."""
    entry = sa.func.json_each(JOB.c.metadata).table_valued("key", "value", "type").alias("entry")
    conditions = [entry.c.key == key]
    if value is not None:
        as_text = sa.case((entry.c.type.in_(("true", "false")), entry.c.type),
                          (entry.c.type != "null", sa.cast(entry.c.value, sa.Text)))
        match = as_text == value
        if len(value) <= 100 and _JSON_NUMBER.fullmatch(value):
            match = sa.or_(match, sa.and_(entry.c.type == "real", entry.c.value == float(value)))
        conditions.append(match)
    return sa.exists(sa.select(sa.literal(1)).select_from(entry).where(*conditions))


def _deferred(*columns: Any) -> tuple[Any, ...]:
    return tuple(defer(cast("QueryableAttribute[Any]", c)) for c in columns)


_LIST_DEFERRED = _deferred(Job.pool_config, Job.context, Job.request_workflow, Job.planner_raw, Job.planner_error,
                           Job.answer, Job.error_message)
"""What a page of jobs leaves unread (a summary shows none of it): up to 200 rows of workflows, contexts
and answers would be read to show 200-character tasks. Read when accessed."""

_STEP_DEFERRED = _deferred(Step.instruction, Step.messages, Step.output, Step.error)


def get_steps(session: Session, *, job_id: str, light: bool = False) -> list[Step]:
    """Every step of the job, in order; ``light`` leaves its texts (instruction, messages, output,
    error) unread: a status poll needs none of them."""
    stmt = select(Step).where(Step.job_id == job_id).order_by(col(Step.index))
    return list(session.exec(stmt.options(*_STEP_DEFERRED) if light else stmt))


def step_agents(session: Session, *, keys: Sequence[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """The agent of each (job id, step index)."""
    if not keys:
        return {}
    pairs = sa.tuple_(col(Step.job_id), col(Step.index)).in_([tuple(k) for k in keys])
    rows = session.execute(sa.select(col(Step.job_id), col(Step.index), col(Step.agent)).where(pairs))
    return {(job_id, index): agent for job_id, index, agent in rows}


def get_step(session: Session, *, job_id: str, index: int) -> Step | None:
    return session.exec(select(Step).where(Step.job_id == job_id, Step.index == index)).first()


def get_steps_by_id(session: Session, *, step_ids: Sequence[int]) -> list[Step]:
    if not step_ids:
        return []
    return list(session.exec(select(Step).where(col(Step.id).in_(step_ids))))


def get_attempts(session: Session, *, step_ids: Sequence[int]) -> list[StepAttempt]:
    if not step_ids:
        return []
    stmt = select(StepAttempt).where(col(StepAttempt.step_id).in_(step_ids)).order_by(
        col(StepAttempt.step_id), col(StepAttempt.n)
    )
    return list(session.exec(stmt))


def count_jobs_in_flight(session: Session, *, tenant: str) -> int:
    """The tenant's top-level jobs that have not ended, a batch's lines not counted (``LIVE_IN_FLIGHT_SQL``).
    On Postgres one row of ``tenant_in_flight``, which a trigger on ``job`` keeps in the transaction of
    every change (migrations 0011, 0020); elsewhere a count over the partial index ``ix_job_tenant_in_flight``."""
    direct = _core(session)
    stmt = _in_flight_counter_stmt() if direct.postgres else _count_in_flight_stmt()
    return int(direct.execute(stmt, {"p_tenant": tenant}).scalar_one())


TENANT_IN_FLIGHT = sa.table("tenant_in_flight", sa.column("tenant", sa.String()), sa.column("jobs", sa.Integer()))
"""Postgres only (migrations 0011, 0020): each tenant's unfinished top-level jobs that are not a batch's
lines, kept by triggers on ``job``."""


def _tenant_in_flight(tenant: sa.BindParameter[str]) -> sa.ColumnElement[int]:
    """The tenant's row of ``tenant_in_flight`` (0 when it has none yet)."""
    c = TENANT_IN_FLIGHT.c
    return sa.func.coalesce(sa.select(c.jobs).where(c.tenant == tenant).scalar_subquery(), 0)


@cache
def _in_flight_counter_stmt() -> sa.Select[Any]:
    return sa.select(_tenant_in_flight(sa.bindparam("p_tenant", type_=sa.String())))


@cache
def _count_in_flight_stmt() -> sa.Select[Any]:
    tenant = sa.bindparam("p_tenant", type_=sa.String())
    return sa.select(sa.func.count()).select_from(JOB).where(JOB.c.tenant == tenant, sa.text(LIVE_IN_FLIGHT_SQL))


def lock_tenant(session: Session, *, tenant: str, scope: str = "tenant") -> None:
    """Serializes quota checks of one tenant until the transaction ends (Postgres; SQLite, which runs
    one writer at a time, needs none). ``scope`` names the quota: checks of different quotas (jobs in
    flight, ``files``) do not wait for each other."""
    if session.get_bind().dialect.name == "postgresql":
        _core(session).execute(_lock_tenant_stmt(), {"p_key": f"conductor-{scope}:{tenant}"})


@cache
def _lock_tenant_stmt() -> sa.Select[Any]:
    return sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(sa.bindparam("p_key", type_=sa.String()))))


def count_tree_steps(session: Session, *, root_job_id: str) -> int:
    """Steps of every job in the tree rooted at ``root_job_id``."""
    tree = sa.select(col(Job.id)).where(sa.or_(col(Job.id) == root_job_id, col(Job.root_job_id) == root_job_id))
    stmt = sa.select(sa.func.count()).select_from(Step).where(col(Step.job_id).in_(tree))
    return int(session.execute(stmt).scalar_one())


def get_children(session: Session, *, job_id: str) -> list[Job]:
    return list(session.exec(select(Job).where(Job.parent_job_id == job_id)))


def transition_job(
    session: Session,
    *,
    job_id: str,
    from_: Sequence[str],
    to: str,
    plan_claim: int | None = None,
    added: Sequence[str] = (),
    **values: Any,
) -> bool:
    """Moves a job to ``to`` only from one of ``from_`` (and, with ``plan_claim``, only if that planning
    claim is still the current one); returns whether this caller won. ``values`` are plain column values,
    set -- or, for the columns named in ``added``, added to what the column holds: the statement is
    prebuilt per (from, to, columns)."""
    params = {"p_job_id": job_id, "p_claim": plan_claim, "p_now": utcnow(), **{f"v_{k}": v for k, v in values.items()}}
    stmt = _transition_stmt(tuple(str(f) for f in from_), str(to), plan_claim is not None, tuple(sorted(values)),
                            tuple(sorted(added)))
    return _rowcount(_core(session).execute(stmt, params)) == 1


@lru_cache(maxsize=64)
def _transition_stmt(from_: tuple[str, ...], to: str, fenced: bool, keys: tuple[str, ...],
                     added: tuple[str, ...] = ()) -> sa.Update:
    j = JOB
    where = [j.c.id == sa.bindparam("p_job_id", type_=sa.String()), sa.or_(*(j.c.status == f for f in from_))]
    if fenced:
        where.append(j.c.plan_claims == sa.bindparam("p_claim"))

    def value(k: str) -> Any:
        given = sa.bindparam(f"v_{k}", type_=j.c[k].type)
        return j.c[k] + given if k in added else given

    return sa.update(j).where(*where).values(status=to, updated_at=sa.bindparam("p_now", type_=UTCDateTime()),
                                             **{k: value(k) for k in keys})


PLANNER_USAGE = ("planner_input_tokens", "planner_output_tokens", "planner_cost_usd", "planner_calls",
                 "planner_cached_input_tokens", "planner_reasoning_tokens", "planner_cache_write_tokens")
"""A job's planner usage columns: added to, never set, as more than one planning claim may have paid."""
PLANNER_TOTALS = {"planner_input_tokens": "input_tokens", "planner_output_tokens": "output_tokens",
                  "planner_cost_usd": "cost_usd", "planner_calls": "calls",
                  "planner_cached_input_tokens": "cached_input_tokens", "planner_reasoning_tokens": "reasoning_tokens",
                  "planner_cache_write_tokens": "cache_write_tokens"}
"""Each planner usage column and the job total it is part of."""


class LostUsage(NamedTuple):
    added: bool
    carry_up: bool
    """The job had ended and is a child job: its parent's recursive step (and ended ancestors) need it too."""


def add_lost_planner_usage(session: Session, *, job_id: str, claim: int, usage: Mapping[str, Any]) -> LostUsage:
    """A planning whose plan was not recorded (the job was cancelled while the planner ran, or the
    reconciler re-drove it and a newer claim took over) still paid for its planner calls: they are added
    to the job's planner usage, and to its totals when the job has ended (a job still going sums them
    when it ends). Not when the plan is this claim's own, recorded by a commit whose reply was lost (the
    job holds this claim and has steps): that usage is in already."""
    j, st = JOB, STEP
    ended = j.c.status.in_(list(JobStatus.TERMINAL))
    values: dict[str, Any] = {}
    for k in PLANNER_USAGE:
        amount = sa.literal(usage.get(k, 0), type_=j.c[k].type)
        values[k] = j.c[k] + amount
        total = PLANNER_TOTALS[k]
        values[total] = j.c[total] + sa.case((ended, amount), else_=sa.literal(0, type_=j.c[k].type))
    planned_here = sa.and_(j.c.plan_claims == claim,
                           sa.exists(sa.select(st.c.id).where(st.c.job_id == job_id)))
    stmt = (sa.update(j).where(j.c.id == job_id, sa.not_(planned_here)).values(values)
            .returning(j.c.status, j.c.parent_job_id, j.c.tenant, j.c.planner, j.c.metrics_rolled_up_at))
    row = session.execute(stmt).first()
    if row is None:
        return LostUsage(added=False, carry_up=False)
    if row[4] is not None:  # the job was folded into the metrics rollup already
        add_late_usage(session, tenant=row[2], series="job", labels=(row[0], row[3]),
                       input_tokens=usage["planner_input_tokens"], output_tokens=usage["planner_output_tokens"],
                       cost_usd=usage["planner_cost_usd"],
                       cached_input_tokens=usage.get("planner_cached_input_tokens", 0),
                       reasoning_tokens=usage.get("planner_reasoning_tokens", 0),
                       cache_write_tokens=usage.get("planner_cache_write_tokens", 0))
    return LostUsage(added=True, carry_up=row[0] in JobStatus.TERMINAL and row[1] is not None)


@cache
def _claim_planning_stmt() -> sa.Update:
    j = JOB
    now = sa.bindparam("p_now", type_=UTCDateTime())
    return (sa.update(j).where(j.c.id == sa.bindparam("p_job_id", type_=sa.String()), j.c.status == JobStatus.QUEUED)
            .values(status=JobStatus.PLANNING, updated_at=now, started_at=sa.func.coalesce(j.c.started_at, now),
                    plan_claims=j.c.plan_claims + 1)
            .returning(j.c.plan_claims))


def claim_planning_job(session: Session, *, job_id: str) -> tuple[int, Job] | None:
    """queued -> planning; returns this claim's number (the fencing token) and the job as it is now, from
    one ``UPDATE … RETURNING`` (no second read), or None if the job is not queued. The Job is built with
    ``model_construct``: it is for reading and must never be added to a session."""
    row = _core(session).execute(_claim_planning_job_stmt(), {"p_job_id": job_id, "p_now": utcnow()}).first()
    if row is None:
        return None
    attrs = _job_attributes()
    return int(row[0]), Job.model_construct(**dict(zip(attrs, row[1:], strict=True)))


@cache
def _job_attributes() -> tuple[str, ...]:
    return tuple(attr for attr, _ in _columns(Job))


@cache
def _claim_planning_job_stmt() -> sa.Update:
    j = JOB
    return _claim_planning_stmt().returning(*[j.c[column] for _, column in _columns(Job)])


def update_job(session: Session, *, job_id: str, **values: Any) -> None:
    session.execute(sa.update(Job).where(col(Job.id) == job_id).values(updated_at=utcnow(), **values))


def insert_job(session: Session, *, job: Job) -> None:
    """Inserts a new job row with one Core ``INSERT`` (no unit of work: the submit path's ORM flush cost
    more CPU than the rest of the insert). ``job`` stays a plain object outside the session; its values,
    defaults included, are what was stored.

    Columns that are None are left out (they are nullable without a server default, so the row is the
    same): the full row has 51 parameters, and psycopg re-parses a query of more than 50 on every
    execution instead of caching its conversion (``MAX_CACHED_STATEMENT_PARAMS``), 6 % of the API's CPU
    per submit. A new job has about 25 non-null columns, in a handful of combinations."""
    values = _job_values(job)
    _core(session).execute(_insert_job_stmt(tuple(values)), values)


def insert_job_admitted(session: Session, *, job: Job, max_in_flight: int, commit: bool = False,
                        then: Sequence[tuple[sa.Executable, Mapping[str, Any]]] = ()) -> bool:
    """``insert_job`` under the tenant's in-flight quota: inserts only while the tenant has fewer than
    ``max_in_flight`` unfinished top-level jobs; False (nothing inserted) when it has that many.

    Strict under concurrency: on Postgres the tenant's lock (``lock_tenant``, held until commit) and the
    insert that counts are sent together in one pipeline, so the lock is held for the server's work and
    the commit, not for client round trips. Taken one statement at a time, every submission of a busy
    tenant queued behind a lock whose holder first had to be scheduled (and get its process's GIL) for
    each of three round trips: at 200 req/s, 58 backends waiting on it (docs/benchmarks.md, api).

    ``commit``: commits the caller's transaction in the same round trip (``Direct.execute_pipelined``),
    for a caller whose next step would be its commit; the tenant's lock is then never held across a
    client round trip.

    ``then``: statements of the job's transaction sent after the insert in the same pipeline (rows that
    belong to the job, e.g. ``store.responses.response_insert``); each must insert nothing when the job's
    row was not (``WHERE EXISTS`` the job), since they run whether it was admitted or not."""
    values = _job_values(job)
    params = {**values, "p_tenant": job.tenant, "p_max_in_flight": max_in_flight}
    direct = _core(session)
    insert = (_insert_job_admitted_stmt(tuple(values), direct.postgres), params)
    if direct.postgres:
        lock = (_lock_tenant_stmt(), {"p_key": f"conductor-tenant:{job.tenant}"})
        _, inserted, *_ = direct.execute_pipelined([lock, insert, *then], commit=commit)
    else:  # SQLite runs one writer at a time: no lock needed
        inserted, *_ = direct.execute_pipelined([insert, *then], commit=commit)
    return inserted.first() is not None


@lru_cache(maxsize=64)
def _insert_job_admitted_stmt(columns: tuple[str, ...], counted: bool) -> sa.Insert:
    """``INSERT INTO job (…) SELECT :values WHERE <in flight> < :max RETURNING id``. ``counted`` (Postgres):
    <in flight> is the tenant's ``tenant_in_flight`` row (one row, whatever the tenant has in flight: a
    count read one index entry and heap tuple per job, 6 ms at 12,000, under the tenant's lock). Else a
    count that stops at the limit."""
    limit = sa.bindparam("p_max_in_flight", type_=sa.Integer())
    tenant = sa.bindparam("p_tenant", type_=sa.String())
    if counted:
        under = _tenant_in_flight(tenant) < limit
    else:
        in_flight = (sa.select(sa.literal_column("1")).select_from(JOB)
                     .where(JOB.c.tenant == tenant, sa.text(LIVE_IN_FLIGHT_SQL)).limit(limit).subquery("in_flight"))
        under = sa.select(sa.func.count()).select_from(in_flight).scalar_subquery() < limit
    row = sa.select(*[sa.bindparam(c, type_=JOB.c[c].type) for c in columns]).where(under)
    return sa.insert(JOB).from_select(list(columns), row).returning(JOB.c.id)


@cache
def _columns(model: type[Job] | type[Step], without: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
    """(attribute, column) of each mapped column of ``model`` but ``without`` (``Job.meta`` is the
    ``metadata`` column): what a Core insert of an unsaved object binds."""
    return tuple((prop.key, prop.columns[0].key) for prop in sa.inspect(model).column_attrs
                 if prop.columns[0].key not in without)


def _job_values(job: Job) -> dict[str, Any]:
    """The job's non-None columns (column -> value): what its insert binds."""
    return {column: value for attr, column in _columns(Job) if (value := getattr(job, attr)) is not None}


@lru_cache(maxsize=64)
def _insert_job_stmt(columns: tuple[str, ...]) -> sa.Insert:
    """Prebuilt per set of columns (a handful occur), so the driver's cursor can run it."""
    return sa.insert(JOB).values({c: sa.bindparam(c, type_=JOB.c[c].type) for c in columns})


def insert_steps(session: Session, *, steps: Sequence[Mapping[str, Any]], ids: bool = False) -> dict[int, int]:
    """Inserts a plan's step rows (``new_step_row``) in one Core ``executemany``. Ids are assigned by the
    database and, unless ``ids`` asks for them (index -> id), not read back: the engine addresses steps by
    (job id, index)."""
    if not steps:
        return {}
    columns = _columns(Step, ("id",))  # assigned by the database
    params = [{column: step[attr] for attr, column in columns} for step in steps]
    if not ids:
        session.connection().execute(_insert_step_stmt(), params)
        return {}
    result = session.connection().execute(_insert_step_returning_stmt(), params)
    return {int(index): int(step_id) for step_id, index in result.all()}


@cache
def _insert_step_returning_stmt() -> sa.Insert:
    return sa.insert(STEP).returning(STEP.c.id, STEP.c.index)


def open_attempts(session: Session, *, attempts: Sequence[tuple[int, str, datetime]]) -> dict[int, int]:
    """Opens the first attempt of each (step id, worker, started at) in one ``executemany``; returns
    step id -> attempt id."""
    if not attempts:
        return {}
    result = session.connection().execute(
        _open_first_attempt_stmt(), [{"step_id": step_id, "n": 1, "worker": worker, "started_at": started}
                                     for step_id, worker, started in attempts])
    return {int(step_id): int(attempt_id) for attempt_id, step_id in result.all()}


@cache
def _open_first_attempt_stmt() -> sa.Insert:
    return sa.insert(ATTEMPT).returning(ATTEMPT.c.id, ATTEMPT.c.step_id)


def new_step_row(**values: Any) -> dict[str, Any]:
    """A new step row (attribute -> value), the model's defaults filled in: what ``Step(**values)`` would
    insert, without building an ORM object (about 0.3 ms of CPU each, 5 % of a worker's at full load)."""
    defaults, factories = _step_defaults()
    unknown = values.keys() - defaults.keys() - factories.keys()
    if unknown:
        raise TypeError(f"not a step column: {sorted(unknown)}")
    row = {**defaults, **{attr: make() for attr, make in factories.items() if attr not in values}}
    row.update(values)
    missing = [attr for attr, value in row.items() if value is PydanticUndefined]
    if missing:
        raise TypeError(f"a step needs {missing}")
    return row


@cache
def _step_defaults() -> tuple[dict[str, Any], dict[str, Callable[[], Any]]]:
    """The model's defaults, read once: plain values, and the factories called for each row."""
    defaults: dict[str, Any] = {}
    factories: dict[str, Callable[[], Any]] = {}
    for attr, _ in _columns(Step, ("id",)):
        field = Step.model_fields[attr]
        if field.default_factory is not None:
            factories[attr] = field.default_factory  # type: ignore[assignment]
        else:
            defaults[attr] = field.default
    return defaults, factories


@cache
def _insert_step_stmt() -> sa.Insert:
    return sa.insert(STEP)


def mark_steps_queued(session: Session, *, job_id: str, indices: Sequence[int], commit: bool = False) -> list[int]:
    """pending -> queued for each index, in one statement; returns the indices this caller moved (and must
    dispatch): of two callers marking the same step, exactly one gets it back.

    ``commit``: commits the caller's transaction in the same round trip (``Direct.execute_pipelined``), for
    a caller whose next step would be its commit (the outcome's lock on the job row is then released by
    the server, without waiting for this client again)."""
    if not indices:
        return []
    params = {"p_job_id": job_id, "p_indices": list(indices), "p_now": utcnow()}
    direct = _core(session)
    stmt = _mark_queued_stmt(direct.postgres)
    marked = direct.execute_pipelined([(stmt, params)], commit=True)[0] if commit else direct.execute(stmt, params)
    return sorted(int(i) for i in marked.scalars())


@cache
def _mark_queued_stmt(postgres: bool) -> sa.Update:
    """On Postgres ``index = ANY(:indices)`` (one array parameter: a statement prepared once, on the
    driver's cursor); elsewhere an ``IN`` list SQLAlchemy expands per execution."""
    st = STEP
    listed = (st.c.index == sa.any_(sa.bindparam("p_indices", type_=ARRAY(sa.Integer()))) if postgres
              else st.c.index.in_(sa.bindparam("p_indices", expanding=True)))
    return (
        sa.update(st)
        .where(st.c.job_id == sa.bindparam("p_job_id"), listed, st.c.status == StepStatus.PENDING)
        .values(status=StepStatus.QUEUED, queued_at=sa.bindparam("p_now", type_=UTCDateTime()))
        .returning(st.c.index)
    )


WORKER_LOST = ErrorType.WORKER_LOST


def close_lost_attempts(session: Session, *, step_id: int, keep: int | None = None) -> int:
    """Attempts still open when a step is re-claimed belonged to a worker that died mid-call (all but
    ``keep``, the attempt the new claim opened)."""
    lost = [col(StepAttempt.step_id) == step_id, col(StepAttempt.finished_at).is_(None)]
    if keep is not None:
        lost.append(col(StepAttempt.id) != keep)
    result = session.execute(
        sa.update(StepAttempt)
        .where(*lost)
        .values(
            finished_at=utcnow(),
            error_type=WORKER_LOST,
            error="the worker running this attempt stopped before it finished (its lease expired)",
        )
    )
    return _rowcount(result)


def finish_attempt(
    session: Session, *, attempt_id: int, latency_ms: int, error_type: str | None = None, error: str | None = None
) -> None:
    """Closes an open attempt. Fenced: an attempt already closed (as ``WorkerLost`` when another worker
    took the step over) is not rewritten by the worker that lost it."""
    _core(session).execute(_finish_attempt_stmt(), {"p_id": attempt_id, "p_now": utcnow(), "p_latency": latency_ms,
                                             "p_error_type": error_type, "p_error": error})


@cache
def _finish_attempt_stmt() -> sa.Update:
    a = ATTEMPT
    return (sa.update(a).where(a.c.id == sa.bindparam("p_id"), a.c.finished_at.is_(None))
            .values(finished_at=sa.bindparam("p_now", type_=UTCDateTime()), latency_ms=sa.bindparam("p_latency"),
                    error_type=sa.bindparam("p_error_type", type_=sa.String()),
                    error=sa.bindparam("p_error", type_=sa.Text())))


USAGE_COLUMNS = ("input_tokens", "output_tokens", "cost_usd", "cached_input_tokens", "reasoning_tokens",
                 "cache_write_tokens")
"""A step's (and a job's) usage columns, added to: a step's calls of workers that lost it were paid for too;
the last three are details of the first two (the input read from and written to the prompt cache, the
reasoning part of the output)."""
RELEASED: dict[str, Any] = {"reserved_usd": 0.0, "reserved_tokens": 0}
"""An ended step holds nothing against its job's budgets: what it spent is in its usage columns."""


def finish_step(
    session: Session, *, step_id: int, to: str, from_: Sequence[str], lease_owner: str | None = None, **values: Any
) -> bool:
    """Records a step's one final outcome; a second completion of the same step changes nothing, and
    with ``lease_owner`` neither does a worker whose claim was taken over."""
    stmt = sa.update(Step).where(col(Step.id) == step_id, col(Step.status).in_(list(from_)))
    if lease_owner is not None:
        stmt = stmt.where(col(Step.lease_owner) == lease_owner)
    stmt = stmt.values(status=to, finished_at=utcnow(), lease_expires_at=None, **RELEASED, **values)
    return _rowcount(session.execute(stmt)) == 1


def add_unrecorded_usage(
    session: Session, *, step_id: int, job_id: str, input_tokens: int, output_tokens: int, cost_usd: float,
    cached_input_tokens: int = 0, reasoning_tokens: int = 0, cache_write_tokens: int = 0,
) -> bool:
    """A call whose answer was dropped (the job was cancelled or failed meanwhile, or another worker took
    the step over) was still paid for: its usage is added to the step, and to the job's totals when the
    job has already ended (a running job's totals are summed from its steps when it ends). True when
    the job had ended: a child job's parent then needs it too (``add_usage_to_parent``)."""
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "cost_usd": cost_usd,
             "cached_input_tokens": cached_input_tokens, "reasoning_tokens": reasoning_tokens,
             "cache_write_tokens": cache_write_tokens}
    step = session.execute(
        sa.update(Step)
        .where(col(Step.id) == step_id)
        .values({getattr(Step, k): getattr(Step, k) + v for k, v in usage.items()})
        .returning(col(Step.agent), col(Step.status))
    ).first()
    ended = session.execute(
        sa.update(Job)
        .where(col(Job.id) == job_id, col(Job.status).in_(list(JobStatus.TERMINAL)))
        .values({getattr(Job, k): getattr(Job, k) + v for k, v in usage.items()})  # the call is an attempt: counted
        .returning(col(Job.tenant), col(Job.metrics_rolled_up_at))  # (waits for a fold holding the job row)
    ).first()
    if ended is not None and ended[1] is not None and step is not None:
        add_late_usage(session, tenant=ended[0], series="step", labels=(step[0], step[1]), input_tokens=input_tokens,
                       output_tokens=output_tokens, cost_usd=cost_usd, cached_input_tokens=cached_input_tokens,
                       reasoning_tokens=reasoning_tokens, cache_write_tokens=cache_write_tokens)
    return ended is not None


def add_usage_to_parent(session: Session, *, job_id: str, usage: dict[str, Any]) -> str | None:
    """One level of carrying up usage that job ``job_id`` (a child job) gained after its parent's
    recursive step stopped taking it (the parent ended first and closed the step, or the child's late
    usage came after it ended): under the parent's row lock (so a parent ending meanwhile either sums
    the step with it or has ended and gets it here), adds ``usage`` to the recursive step and, when the
    parent has ended too, to its totals. Returns the parent's id in that case (its own parent needs it
    next), else None."""
    child = session.execute(sa.select(col(Job.parent_job_id), col(Job.parent_step_index))
                            .where(col(Job.id) == job_id)).first()
    if child is None or child[0] is None or child[1] is None:
        return None
    parent_id, index = str(child[0]), int(child[1])
    head = lock_job(session, job_id=parent_id)
    if head is None:
        return None
    added = {k: usage.get(k, 0) for k in USAGE_COLUMNS}
    session.execute(sa.update(Step).where(col(Step.job_id) == parent_id, col(Step.index) == index)
                    .values({getattr(Step, k): getattr(Step, k) + v for k, v in added.items()}))
    if head.status not in JobStatus.TERMINAL:
        return None  # its totals are summed from its steps when it ends
    session.execute(sa.update(Job).where(col(Job.id) == parent_id)
                    .values({getattr(Job, k): getattr(Job, k) + v for k, v in added.items()}))
    return parent_id


def update_step(session: Session, *, step_id: int, **values: Any) -> None:
    session.execute(sa.update(Step).where(col(Step.id) == step_id).values(**values))


def close_open_steps(session: Session, *, job_id: str, to: str) -> int:
    """Marks the job's unfinished steps ``to`` (skipped on failure, cancelled on cancel): pending, queued and
    running ones. A call still running ends with its answer dropped and its usage added to the step and the
    job (``add_unrecorded_usage``); a recursive step's child job is cancelled by the caller. The caller holds
    the job row's lock; the steps are locked by id (``in_id_order``), as the heartbeat locks the running
    ones it renews."""
    unfinished = col(Step.status).in_([StepStatus.PENDING, StepStatus.QUEUED, StepStatus.RUNNING])
    stmt = (
        sa.update(Step)
        .where(in_id_order(col(Step.id), col(Step.job_id) == job_id, unfinished))
        .values(status=to, finished_at=utcnow(), lease_expires_at=None, **RELEASED)
    )
    return _rowcount(session.execute(stmt))


# --- the step hot path: two transactions per step --------------------------------------------------
# A step is claimed in one transaction (read what it needs, claim it, open its attempt) and recorded in
# another (lock the job row, record the outcome, close the attempt, mark the steps that became ready).
# Each reads only the columns it uses: never the whole step list with every message and output.


@dataclass(frozen=True)
class StepInput:
    """What a worker needs to run one step, read in one statement before it claims the step."""

    job_status: str
    task: str
    context: list[dict[str, Any]] | None
    limits: dict[str, Any]
    pool_config: dict[str, Any]
    created_at: datetime
    spent_tokens: int
    spent_cost_usd: float
    agent: str
    instruction: str
    access_list: list[int]
    tenant: str
    unstarted: int
    """This job's steps not yet claimed (pending or queued), this one included while it is queued."""
    visible: list[tuple[str, str]]
    """(subtask, answer) of each step on the access list, in step order."""
    background: bool = False
    """The job is batch work (``batch_work_of``): a child job it starts is too."""
    answers: bool = False
    """This is the job's last step: its output is the job's answer (``limits.max_answer_tokens`` caps it)."""
    index: int = 0
    workflow: list[PlannedStep] = field(default_factory=list)
    """Every step of the job, by index: where prompt prefixes are shared (``context.cache_points``)."""


def read_step_input(session: Session, *, job_id: str, index: int) -> StepInput | None:
    """The job's task, context, limits and pool, what its steps spent or hold reserved so far (the
    budgets count both; this step's own reservation, a dead claim's when it is claimed again, is not
    counted), this step's row and the outputs its access list lets it see. On Postgres the
    outputs come in the same statement (one ``jsonb_agg``); elsewhere in a second one."""
    direct = _core(session)
    row = direct.execute(_read_step_input_stmt(direct.postgres), {"p_job_id": job_id, "p_index": index}).first()
    if row is None:
        return None
    access_list = list(row[10] or [])
    if direct.postgres:
        visible = [(subtask, answer or "") for subtask, answer in row[15] or []]
        workflow = [PlannedStep(str(agent), list(access or []), bool(reused))
                    for agent, access, reused in row[16] or []]
    else:
        visible = visible_outputs(session, job_id=job_id, indices=access_list)
        workflow = workflow_of(session, job_id=job_id)
    return StepInput(row[0], row[1], row[2], row[3] or {}, row[4] or {}, row[5], int(row[6]), float(row[7]),
                     row[8], row[9], access_list, row[11], int(row[12]), visible, bool(row[13]),
                     answers=row[14] == index, index=index, workflow=workflow)


@cache
def _read_step_input_stmt(with_visible: bool) -> sa.Select[Any]:
    j, st, other = JOB, STEP, STEP.alias("other")
    job_id = sa.bindparam("p_job_id", type_=sa.String())
    mine = other.c.job_id == job_id
    # What the other steps hold reserved, not this one: a step claimed again after its worker died still
    # carries the dead claim's reservation, which the new claim replaces (it may have held all the budget).
    itself = other.c.index == sa.bindparam("p_index")
    held = sa.case((itself, 0), else_=other.c.reserved_tokens)
    held_usd = sa.case((itself, 0.0), else_=other.c.reserved_usd)
    spent = sa.select(sa.func.coalesce(sa.func.sum(
        other.c.input_tokens + other.c.output_tokens + held), 0)).where(mine).scalar_subquery()
    spent_usd = sa.select(sa.func.coalesce(sa.func.sum(other.c.cost_usd + held_usd), 0.0)).where(
        mine).scalar_subquery()
    # FILTER, not WHERE: a status condition there let Postgres's generic plan (a statement prepared once)
    # AND the job's index with the status index, a scan of every queued step's entries, dead ones
    # included (2.6 ms at 45,000 finished steps, growing with the table).
    waiting = sa.or_(other.c.status == StepStatus.PENDING, other.c.status == StepStatus.QUEUED)
    unstarted = sa.select(sa.func.count().filter(waiting)).where(mine).scalar_subquery()
    last = sa.select(sa.func.max(other.c.index)).where(mine).scalar_subquery()  # the answering step's index
    columns: list[Any] = [
        j.c.status, j.c.task, j.c.context, j.c.limits, j.c.pool_config, j.c.created_at,
        j.c.planner_input_tokens + j.c.planner_output_tokens + spent,
        j.c.planner_cost_usd + spent_usd,
        st.c.agent, st.c.instruction, st.c.access_list, j.c.tenant, unstarted, batch_work_of(j), last,
    ]
    if with_visible:  # Postgres: [[subtask, answer], …] of the steps on the access list, in step order
        seen = STEP.alias("seen")
        pair = sa.func.jsonb_build_array(seen.c.instruction, seen.c.output)
        columns.append(
            sa.select(sa.func.jsonb_agg(aggregate_order_by(pair, seen.c.index), type_=JSONB))
            .where(seen.c.job_id == job_id,
                   st.c.access_list.op("@>", return_type=sa.Boolean)(sa.func.jsonb_build_array(seen.c.index)))
            .scalar_subquery()
        )
        step = STEP.alias("plan")  # [[agent, access_list, reused], …] of every step, by index
        entry = sa.func.jsonb_build_array(step.c.agent, step.c.access_list, step.c.reused_from.is_not(None))
        columns.append(
            sa.select(sa.func.jsonb_agg(aggregate_order_by(entry, step.c.index), type_=JSONB))
            .where(step.c.job_id == job_id)
            .scalar_subquery()
        )
    return (
        sa.select(*columns)
        .select_from(j.join(st, sa.and_(st.c.job_id == j.c.id, st.c.index == sa.bindparam("p_index"))))
        .where(j.c.id == job_id)
    )


def visible_outputs(session: Session, *, job_id: str, indices: Sequence[int]) -> list[tuple[str, str]]:
    """(subtask, answer) of each listed step, in step order."""
    if not indices:
        return []
    rows = _core(session).execute(_visible_outputs_stmt(), {"p_job_id": job_id, "p_indices": list(indices)})
    return [(r[0], r[1] or "") for r in rows]


def workflow_of(session: Session, *, job_id: str) -> list[PlannedStep]:
    """Every step of the job, by index (``StepInput.workflow``), where one statement cannot aggregate them."""
    st = STEP
    rows = session.execute(sa.select(st.c.agent, st.c.access_list, st.c.reused_from.is_not(None))
                           .where(st.c.job_id == job_id).order_by(st.c.index))
    return [PlannedStep(r[0], list(r[1] or []), bool(r[2])) for r in rows]


@cache
def _visible_outputs_stmt() -> sa.Select[Any]:
    st = STEP
    return (sa.select(st.c.instruction, st.c.output)
            .where(st.c.job_id == sa.bindparam("p_job_id"), st.c.index.in_(sa.bindparam("p_indices", expanding=True)))
            .order_by(st.c.index))


@dataclass(frozen=True)
class ClaimedStep:
    step_id: int
    attempts: int
    """Attempts before this claim: more than 0 means an earlier worker started this step."""
    attempt_id: int | None = None
    """The attempt this claim opened (``open_below``), None when it opened none."""


def claim_step_row(
    session: Session,
    *,
    job_id: str,
    index: int,
    owner: str,
    lease_s: float,
    task_id: str | None,
    count_attempt: bool,
    open_below: int | None = None,
    **values: Any,
) -> ClaimedStep | None:
    """queued -> running (or re-take a running step whose lease expired: its worker died), only while the
    job runs. ``owner`` is unique per claim: the fencing token every later write of this claim checks.
    The same owner may claim again (a retried transaction whose commit did land, its reply lost): that
    re-claim counts no attempt and returns the attempt the landed claim opened, not a second one.

    With ``open_below`` (and ``count_attempt``) the claim also opens the attempt it counted, when fewer
    than ``open_below`` attempts came before it: on Postgres in the same statement (the claim's
    ``UPDATE … RETURNING`` feeds an ``INSERT`` in one ``WITH``), elsewhere in a second one."""
    now = utcnow()
    params = {"p_job_id": job_id, "p_index": index, "p_owner": owner, "p_now": now,
              "p_expires": now + timedelta(seconds=lease_s), "p_task_id": task_id,
              **{f"v_{k}": v for k, v in values.items()}}
    direct = _core(session)
    keys = tuple(sorted(values))
    opens = open_below is not None and count_attempt
    if opens and direct.postgres:
        params["p_open_below"] = open_below
        row = direct.execute(_claim_and_open_stmt(keys), params).first()
        if row is None:
            return None
        return ClaimedStep(step_id=int(row[0]), attempts=int(row[1]) - 1,
                           attempt_id=int(row[2]) if row[2] is not None else None)
    row = direct.execute(_claim_stmt(keys, count_attempt), params).first()
    if row is None:
        return None
    claim = ClaimedStep(step_id=int(row[0]), attempts=int(row[1]) - (1 if count_attempt else 0))
    if open_below is not None and count_attempt and claim.attempts < open_below:
        attempt = {"p_step_id": claim.step_id, "p_n": claim.attempts + 1, "p_owner": owner, "p_now": now}
        opened = direct.execute(_open_new_attempt_stmt(), attempt).scalar()
        if opened is None:  # there already: the attempt this owner's landed claim opened
            opened = direct.execute(_own_attempt_stmt(), attempt).scalar_one()
        return ClaimedStep(claim.step_id, claim.attempts, int(opened))
    return claim


@cache
def _open_new_attempt_stmt() -> sa.Insert:
    """SQLite: opens attempt ``n`` unless it exists (no row returned then)."""
    a = ATTEMPT
    return (sqlite_insert(a)
            .values(step_id=sa.bindparam("p_step_id"), n=sa.bindparam("p_n"),
                    worker=sa.bindparam("p_owner", type_=sa.String()),
                    started_at=sa.bindparam("p_now", type_=UTCDateTime()))
            .on_conflict_do_nothing(index_elements=[a.c.step_id, a.c.n])
            .returning(a.c.id))


@cache
def _own_attempt_stmt() -> sa.Select[Any]:
    """The attempt ``n`` this owner opened already (its claim's commit landed and the claim was re-run)."""
    a = ATTEMPT
    return sa.select(a.c.id).where(a.c.step_id == sa.bindparam("p_step_id"), a.c.n == sa.bindparam("p_n"),
                                   a.c.worker == sa.bindparam("p_owner", type_=sa.String()))


@lru_cache(maxsize=32)
def _claim_stmt(keys: tuple[str, ...], count_attempt: bool) -> sa.Update:
    """Built once per set of extra columns: the hot path executes prebuilt statements (building one costs
    more CPU than running it)."""
    st, j = STEP, JOB
    now = sa.bindparam("p_now", type_=UTCDateTime())
    owner = sa.bindparam("p_owner", type_=sa.String())
    claimable = sa.or_(
        st.c.status == StepStatus.QUEUED,
        sa.and_(st.c.status == StepStatus.RUNNING, st.c.child_job_id.is_(None),
                sa.or_(st.c.lease_expires_at < now, st.c.lease_owner == owner)),
    )
    job_id = sa.bindparam("p_job_id", type_=sa.String())
    job_running = sa.exists().where(j.c.id == job_id, j.c.status == JobStatus.RUNNING)
    return (
        sa.update(st)
        .where(st.c.job_id == job_id, st.c.index == sa.bindparam("p_index"), claimable, job_running)
        .values(
            status=StepStatus.RUNNING,
            lease_owner=owner,
            lease_expires_at=sa.bindparam("p_expires", type_=UTCDateTime()),
            started_at=sa.func.coalesce(st.c.started_at, now),
            celery_task_id=sa.bindparam("p_task_id", type_=sa.String()),
            # The same owner again is this claim re-run after its commit landed: no second attempt counted.
            attempts=st.c.attempts + (sa.case((st.c.lease_owner == owner, 0), else_=1) if count_attempt else 0),
            **{k: sa.bindparam(f"v_{k}", type_=st.c[k].type) for k in keys},
        )
        .returning(st.c.id, st.c.attempts)
    )


@lru_cache(maxsize=32)
def _claim_and_open_stmt(keys: tuple[str, ...]) -> sa.Select[Any]:
    """Postgres: ``WITH claimed AS (UPDATE step … RETURNING id, attempts), opened AS (INSERT INTO
    step_attempt SELECT … FROM claimed WHERE attempts < open_below + 1 RETURNING id) SELECT claimed.id,
    claimed.attempts, opened.id``: the claim and its attempt in one round trip. A claim re-run by its owner
    after its commit landed finds its attempt already there (the insert does nothing; the statement's
    snapshot shows the landed one, never the row this statement inserts)."""
    a = ATTEMPT
    owner = sa.bindparam("p_owner", type_=sa.String())
    claimed = _claim_stmt(keys, True).cte("claimed")
    opened = (
        pg_insert(a)
        .from_select(
            ["step_id", "n", "worker", "started_at"],
            sa.select(claimed.c.id, claimed.c.attempts, owner, sa.bindparam("p_now", type_=UTCDateTime()))
            .where(claimed.c.attempts <= sa.bindparam("p_open_below", type_=sa.Integer())),
        )
        .on_conflict_do_nothing(index_elements=[a.c.step_id, a.c.n])
        .returning(a.c.id)
        .cte("opened")
    )
    landed = (sa.select(a.c.id)
              .where(a.c.step_id == claimed.c.id, a.c.n == claimed.c.attempts, a.c.worker == owner)
              .scalar_subquery())
    return sa.select(claimed.c.id, claimed.c.attempts,
                     sa.func.coalesce(sa.select(opened.c.id).scalar_subquery(), landed))


def open_attempt(session: Session, *, step_id: int, n: int, worker: str) -> int:
    """Inserts attempt ``n`` (already counted on the step); returns its id."""
    return int(_core(session).execute(_open_attempt_stmt(), {"p_step_id": step_id, "p_n": n, "p_worker": worker,
                                                        "p_now": utcnow()}).scalar_one())


@cache
def _open_attempt_stmt() -> sa.Insert:
    a = ATTEMPT
    return sa.insert(a).values(
        step_id=sa.bindparam("p_step_id"), n=sa.bindparam("p_n"), worker=sa.bindparam("p_worker"),
        started_at=sa.bindparam("p_now", type_=UTCDateTime())).returning(a.c.id)


def next_attempt(session: Session, *, step_id: int, owner: str, n: int, lease_s: float) -> int | None:
    """Before a retry: counts attempt ``n`` on the step and opens it, only if this claim still holds the
    step and its job still runs; None when cancelled, failed or taken over meanwhile."""
    job_running = sa.exists().where(col(Job.id) == col(Step.job_id), col(Job.status) == JobStatus.RUNNING)
    won = session.execute(
        sa.update(Step)
        .where(col(Step.id) == step_id, col(Step.lease_owner) == owner, col(Step.status) == StepStatus.RUNNING,
               job_running)
        .values(attempts=n, lease_expires_at=utcnow() + timedelta(seconds=lease_s))
    )
    if _rowcount(won) != 1:
        return None
    return open_attempt(session, step_id=step_id, n=n, worker=owner)


@dataclass(frozen=True)
class JobHead:
    """The job columns the outcome transaction needs, read under the job row's lock."""

    id: str
    status: str
    created_at: datetime
    parent_job_id: str | None
    parent_step_index: int | None
    planner_input_tokens: int
    planner_output_tokens: int
    planner_cost_usd: float
    planner_calls: int
    planner_cached_input_tokens: int
    planner_reasoning_tokens: int
    planner_cache_write_tokens: int
    has_webhook: bool = True
    """Whether the job has a webhook URL (set at creation, never changed): without one, its end owes no
    delivery and the outbox insert is skipped."""
    background: bool = False
    """Whether the job is batch work (``batch_work_of``, fixed at creation): the steps it makes ready are sent at
    the batch priority, and never taken by the worker that recorded the outcome."""


def lock_job(session: Session, *, job_id: str) -> JobHead | None:
    """Reads the job's head and locks its row until commit (``SELECT … FOR NO KEY UPDATE``), so two steps
    of one job recording at once are serialized: of two parents of a join finishing together, the second
    sees the first. ``NO KEY``: rows that reference the job (a child job, a step, a delivery) may still be
    inserted meanwhile -- with ``FOR UPDATE`` a recursive step's claim (holding its step row, inserting its
    child job) and a cancel of the job (holding its row, closing that step) deadlocked. SQLite has no row
    locks; its first write takes the database lock, which serializes the same way (embedded mode is one
    process)."""
    row = _core(session).execute(_lock_job_stmt(), {"p_job_id": job_id}).first()
    return JobHead(*row) if row is not None else None


@cache
def _lock_job_stmt() -> sa.Select[Any]:
    j = JOB
    return (sa.select(j.c.id, j.c.status, j.c.created_at, j.c.parent_job_id, j.c.parent_step_index,
                      j.c.planner_input_tokens, j.c.planner_output_tokens, j.c.planner_cost_usd, j.c.planner_calls,
                      j.c.planner_cached_input_tokens, j.c.planner_reasoning_tokens, j.c.planner_cache_write_tokens,
                      j.c.webhook_url.is_not(None).label("has_webhook"), batch_work_of(j).label("background"))
            .where(j.c.id == sa.bindparam("p_job_id")).with_for_update(key_share=True))


@dataclass(frozen=True)
class AttemptEnd:
    """How the attempt a step's outcome closes ended (``finish_attempt``'s arguments)."""

    attempt_id: int
    latency_ms: int
    error_type: str | None = None
    error: str | None = None


def record_step(
    session: Session, *, step_id: int, owner: str, to: str, closing: AttemptEnd | None = None, **values: Any
) -> bool:
    """running -> ``to`` for the claim ``owner`` holds; True also when this claim already recorded it (a
    retried transaction whose first commit landed), False when the step was cancelled or taken over.
    Usage is added to what the step already carries (a call of a worker that lost the step was paid for
    too: ``add_unrecorded_usage``), once: only by the update that ends the step.

    ``closing`` also closes the claim's attempt (fenced like ``finish_attempt``, and whether or not the
    step is still this claim's): on Postgres in the same statement (``WITH closed AS (UPDATE
    step_attempt …) UPDATE step …``), elsewhere in a second one."""
    params = {"p_step_id": step_id, "p_owner": owner, "p_now": utcnow(), **{f"v_{k}": v for k, v in values.items()}}
    direct = _core(session)
    stmt = _record_stmt(str(to), tuple(sorted(values)))
    if closing is not None:
        if direct.postgres:
            params.update(p_id=closing.attempt_id, p_latency=closing.latency_ms, p_error_type=closing.error_type,
                          p_error=closing.error)
            stmt = _record_and_close_stmt(str(to), tuple(sorted(values)))
        else:
            finish_attempt(session, attempt_id=closing.attempt_id, latency_ms=closing.latency_ms,
                           error_type=closing.error_type, error=closing.error)
    return _rowcount(direct.execute(stmt, params)) == 1


@lru_cache(maxsize=32)
def _record_stmt(to: str, keys: tuple[str, ...]) -> sa.Update:
    st = STEP
    running = st.c.status == StepStatus.RUNNING
    usage = {k: sa.case((running, st.c[k] + sa.bindparam(f"v_{k}", type_=st.c[k].type)), else_=st.c[k])
             for k in USAGE_COLUMNS if k in keys}
    rest = {k: sa.bindparam(f"v_{k}", type_=st.c[k].type) for k in keys if k not in USAGE_COLUMNS}
    return (
        sa.update(st)
        .where(st.c.id == sa.bindparam("p_step_id"), st.c.lease_owner == sa.bindparam("p_owner", type_=sa.String()),
               sa.or_(st.c.status == StepStatus.RUNNING, st.c.status == to))
        .values(status=to, finished_at=sa.bindparam("p_now", type_=UTCDateTime()), lease_expires_at=None,
                **RELEASED, **usage, **rest)
    )


@lru_cache(maxsize=32)
def _record_and_close_stmt(to: str, keys: tuple[str, ...]) -> sa.Update:
    """Postgres: the attempt's close as a data-modifying CTE of the step's record (one round trip; the
    statement's row count is the step's)."""
    return _record_stmt(to, keys).add_cte(_finish_attempt_stmt().cte("closed"))


@dataclass(frozen=True)
class StepHead:
    """A step's scheduling and usage columns: what advancing and finalizing read (no messages or output)."""

    index: int
    status: str
    access_list: list[int]
    agent: str
    attempts: int
    input_tokens: int
    output_tokens: int
    cost_usd: float
    error_type: str | None
    error: str | None
    cached_input_tokens: int
    reasoning_tokens: int
    cache_write_tokens: int


def step_heads(session: Session, *, job_id: str) -> list[StepHead]:
    rows = _core(session).execute(_step_heads_stmt(), {"p_job_id": job_id})
    return [_step_head(r) for r in rows]


def _step_head(r: Sequence[Any]) -> StepHead:
    """A ``StepHead`` from a row of ``_head_columns``."""
    return StepHead(r[0], r[1], list(r[2] or []), *r[3:])


@cache
def _step_heads_stmt() -> sa.Select[Any]:
    st = STEP
    return sa.select(*_head_columns(st)).where(st.c.job_id == sa.bindparam("p_job_id")).order_by(st.c.index)


def _head_columns(st: sa.Table) -> tuple[sa.Column[Any], ...]:
    """``StepHead``'s columns, in its order."""
    return (st.c.index, st.c.status, st.c.access_list, st.c.agent, st.c.attempts, st.c.input_tokens,
            st.c.output_tokens, st.c.cost_usd, st.c.error_type, st.c.error, st.c.cached_input_tokens,
            st.c.reasoning_tokens, st.c.cache_write_tokens)


def record_step_and_heads(
    session: Session, *, job_id: str, step_id: int, owner: str, to: str, closing: AttemptEnd, **values: Any
) -> tuple[bool, list[StepHead]]:
    """``record_step`` and then ``step_heads`` of the job (this step as recorded), for a caller that holds
    the job row's lock (``lock_job``): on Postgres one statement, ``WITH closed AS (UPDATE step_attempt
    …), recorded AS (UPDATE step … RETURNING the head) SELECT the recorded head UNION ALL the job's other
    heads``. It starts after the lock was taken, so its snapshot holds every outcome committed before;
    its own update is read back through ``RETURNING`` (a statement does not see its own CTE's writes).
    The heads are empty when nothing was recorded (cancelled or taken over)."""
    direct = _core(session)
    if not direct.postgres:
        if not record_step(session, step_id=step_id, owner=owner, to=to, closing=closing, **values):
            return False, []
        return True, step_heads(session, job_id=job_id)
    stmt, params = _record_and_heads(job_id, step_id, owner, to, closing, values)
    return _recorded_heads(direct.execute(stmt, params).rows)


def lock_job_and_record(
    session: Session, *, job_id: str, step_id: int, owner: str, to: str, closing: AttemptEnd, **values: Any
) -> tuple[JobHead | None, bool, list[StepHead]]:
    """``lock_job`` and then ``record_step_and_heads``. On Postgres both go in one psycopg pipeline: the
    server runs the record right after granting the lock (its snapshot still starts after the lock), so
    the job row's lock is never held across a client round trip between them — the wait for the reply
    and for this process's GIL, which the other steps of the job queue behind."""
    direct = _core(session)
    if not direct.postgres:
        head = lock_job(session, job_id=job_id)
        recorded, heads = record_step_and_heads(session, job_id=job_id, step_id=step_id, owner=owner, to=to,
                                                closing=closing, **values)
        return head, recorded, heads
    lock = (_lock_job_stmt(), {"p_job_id": job_id})
    locked, rows = direct.execute_pipelined([lock, _record_and_heads(job_id, step_id, owner, to, closing, values)])
    row = locked.first()
    return (JobHead(*row) if row is not None else None, *_recorded_heads(rows.rows))


def _record_and_heads(
    job_id: str, step_id: int, owner: str, to: str, closing: AttemptEnd, values: dict[str, Any]
) -> tuple[sa.CompoundSelect, dict[str, Any]]:
    params = {"p_job_id": job_id, "p_step_id": step_id, "p_owner": owner, "p_now": utcnow(),
              "p_id": closing.attempt_id, "p_latency": closing.latency_ms, "p_error_type": closing.error_type,
              "p_error": closing.error, **{f"v_{k}": v for k, v in values.items()}}
    return _record_and_heads_stmt(str(to), tuple(sorted(values))), params


def _recorded_heads(rows: list[tuple[Any, ...]]) -> tuple[bool, list[StepHead]]:
    if not any(r[0] for r in rows):
        return False, []
    heads = sorted((_step_head(r[1:]) for r in rows), key=lambda h: h.index)
    return True, heads


@lru_cache(maxsize=32)
def _record_and_heads_stmt(to: str, keys: tuple[str, ...]) -> sa.CompoundSelect:
    st = STEP
    columns = _head_columns(st)
    recorded = _record_stmt(to, keys).returning(*columns).cte("recorded")
    others = sa.select(sa.false(), *columns).where(st.c.job_id == sa.bindparam("p_job_id", type_=sa.String()),
                                                  st.c.id != sa.bindparam("p_step_id"))
    mine = sa.select(sa.true(), *[recorded.c[c.name] for c in columns])
    return sa.union_all(mine, others).add_cte(_finish_attempt_stmt().cte("closed"))


def step_output(session: Session, *, job_id: str, index: int) -> str | None:
    return session.execute(
        sa.select(col(Step.output)).where(col(Step.job_id) == job_id, col(Step.index) == index)
    ).scalar_one_or_none()


def renew_leases(session: Session, *, held: Sequence[tuple[int, str]], seconds: float) -> int:
    """The heartbeat: extends every listed (step id, owner) lease still held, in one statement, locking the
    steps by id (``in_id_order``: a cancel or failure of their job closes them in the same order)."""
    if not held:
        return 0
    stmt = (
        sa.update(Step)
        .where(in_id_order(col(Step.id), sa.tuple_(col(Step.id), col(Step.lease_owner)).in_(list(held)),
                           col(Step.status) == StepStatus.RUNNING))
        .values(lease_expires_at=utcnow() + timedelta(seconds=seconds))
    )
    return _rowcount(session.execute(stmt))


def renew_planning(session: Session, *, held: Sequence[tuple[str, int]]) -> int:
    """The heartbeat of planners at work: touches every listed (job id, planning claim) still planning
    under that claim, in one statement, locking the jobs by id (``in_id_order``: the reconciler re-drives
    silent plannings in the same order)."""
    if not held:
        return 0
    stmt = (
        sa.update(Job)
        .where(in_id_order(col(Job.id), sa.tuple_(col(Job.id), col(Job.plan_claims)).in_(list(held)),
                           col(Job.status) == JobStatus.PLANNING))
        .values(updated_at=utcnow())
    )
    return _rowcount(session.execute(stmt))


# --- what the reconciler looks for ----------------------------------------------------------------


def running_steps_with_children(session: Session, *, job_id: str) -> list[Step]:
    """The job's recursive steps still waiting for their child job, by id (the order they are settled in)."""
    return list(
        session.exec(
            select(Step).where(
                Step.job_id == job_id, Step.status == StepStatus.RUNNING, col(Step.child_job_id).is_not(None)
            ).order_by(col(Step.id))
        )
    )


def orphaned_children(session: Session, *, limit: int = 100) -> list[str]:
    """Child jobs still going although their parent has ended: the parent failed or was cancelled and
    its worker died before it cancelled them (that cascade runs after the parent's commit)."""
    parent = sa.orm.aliased(Job)
    stmt = (
        sa.select(col(Job.id))
        .join(parent, col(Job.parent_job_id) == parent.id)
        .where(col(Job.status).in_(list(JobStatus.UNFINISHED)), col(parent.status).in_(list(JobStatus.TERMINAL)))
        .limit(limit)
    )
    return list(session.execute(stmt).scalars())


def jobs_never_enqueued(session: Session, *, older_than: datetime, limit: int = 100) -> list[str]:
    """Queued jobs whose plan message was never sent (the outbox owes it): a range of ``ix_job_queued``."""
    stmt = select(Job.id).where(
        sa.text(QUEUED_SQL), col(Job.enqueued_at).is_(None), Job.created_at < older_than
    )
    return list(session.exec(stmt.limit(limit)))


@dataclass(frozen=True)
class QueuedJob:
    """What the reconciler reads of a queued job whose plan message was sent: not the row, whose task and
    workflow may be a megabyte each, read 500 at a time every pass while a backlog waits."""

    id: str
    enqueued_at: datetime
    plan_resends: int


def jobs_stuck_queued(session: Session, *, older_than: datetime, limit: int = 500) -> list[QueuedJob]:
    """Queued jobs whose plan message was sent a while ago but not yet picked up (lost, or waiting), oldest
    first: read in ``ix_job_queued``'s order, not by sorting the whole queued backlog each pass."""
    stmt = (sa.select(JOB.c.id, JOB.c.enqueued_at, JOB.c.plan_resends)
            .where(sa.text(QUEUED_SQL), JOB.c.enqueued_at.is_not(None), JOB.c.enqueued_at < older_than)
            .order_by(JOB.c.enqueued_at).limit(limit))
    return [QueuedJob(*row) for row in session.execute(stmt)]


def batch_work(session: Session, *, job_ids: Sequence[str]) -> set[str]:
    """Those of ``job_ids`` that are batch work (``batch_work_of``: a batch's line, or a child job in a line's
    tree): their messages go at the batch priority."""
    if not job_ids:
        return set()
    stmt = sa.select(JOB.c.id).where(JOB.c.id.in_(list(job_ids)), batch_work_of(JOB))
    return {row[0] for row in session.execute(stmt)}


def batch_work_of(j: sa.Table | sa.Alias) -> sa.ColumnElement[bool]:
    """Whether job ``j`` is batch work: a batch's line (``batch_id`` set), or a child job whose root is one (a
    child's ``batch_id`` is never set: it is not a line of the batch, but its work is the line's). A live
    top-level job is decided by its own columns; only a child job looks up its root's row (one primary-key
    probe in the same statement): ``CASE`` tests them in order."""
    root = JOB.alias("batch_root")
    return sa.case(
        (j.c.batch_id.is_not(None), sa.true()),
        (j.c.root_job_id.is_(None), sa.false()),
        else_=sa.exists().where(root.c.id == j.c.root_job_id, root.c.batch_id.is_not(None)),
    )


def jobs_stuck_planning(session: Session, *, older_than: datetime, limit: int = 100) -> list[str]:
    """Jobs planning with no sign of life since ``older_than``, by id: the reconciler re-drives them one
    statement each in one transaction, so in the order the heartbeat renews plannings (``renew_planning``)."""
    stmt = select(Job.id).where(Job.status == JobStatus.PLANNING, Job.updated_at < older_than)
    return sorted(session.exec(stmt.limit(limit)))


def running_job_ids(session: Session, *, older_than: datetime, limit: int = 500) -> list[str]:
    """Running jobs, least recently examined first; the reconciler touches each one it examines, so
    with more than ``limit`` running jobs successive passes rotate through all of them. The caller
    commits at once: the touch locks those job rows, which every step outcome of theirs needs; by id
    (``in_id_order``), as an overlapping pass touching the same jobs does."""
    stmt = select(Job.id).where(Job.status == JobStatus.RUNNING, Job.updated_at < older_than)
    ids = list(session.exec(stmt.order_by(col(Job.updated_at)).limit(limit)))
    if ids:
        touched = in_id_order(col(Job.id), col(Job.id).in_(ids))
        session.execute(sa.update(Job).where(touched).values(updated_at=utcnow()))
    return ids


@dataclass(frozen=True)
class OpenStep:
    """What the reconciler reads of a queued or running step: no messages, output or instruction."""

    id: int
    job_id: str
    index: int
    agent: str
    status: str
    queued_at: datetime | None
    resends: int
    lease_expires_at: datetime | None
    resent_at: datetime | None
    child_job_id: str | None


def open_steps(session: Session, *, job_ids: Sequence[str]) -> list[OpenStep]:
    """The queued and running steps of these jobs, in one statement reading only the columns above."""
    if not job_ids:
        return []
    cols = [col(Step.id), col(Step.job_id), col(Step.index), col(Step.agent), col(Step.status),
            col(Step.queued_at), col(Step.resends), col(Step.lease_expires_at), col(Step.resent_at),
            col(Step.child_job_id)]
    stmt = sa.select(*cols).where(
        col(Step.job_id).in_(list(job_ids)), col(Step.status).in_([StepStatus.QUEUED, StepStatus.RUNNING])
    ).order_by(col(Step.job_id), col(Step.index))
    return [OpenStep(*row) for row in session.execute(stmt)]


def note_step_resent(session: Session, *, step_id: int, resends: int, now: datetime) -> bool:
    """Records a queued step's re-send (``queued_at`` = now, ``resends`` + 1) if it is still queued and
    re-sent ``resends`` times, as read: False when a worker claimed it meanwhile (a step never returns to
    queued; there is nothing to re-send) or an overlapping pass re-sent it first."""
    result = session.execute(
        sa.update(Step)
        .where(col(Step.id) == step_id, col(Step.status) == StepStatus.QUEUED, col(Step.resends) == resends)
        .values(queued_at=now, resends=col(Step.resends) + 1)
    )
    return int(getattr(result, "rowcount", 0) or 0) == 1


@dataclass(frozen=True, slots=True)
class StepProgress:
    index: int
    agent: str
    status: str
    attempts: int
    latency_ms: int | None
    child_job_id: str | None


def job_progress(session: Session, *, job_id: str, steps: bool = True) -> tuple[str, list[StepProgress]] | None:
    """The job's status and (``steps``) its steps' progress, in order; None for no such job. One statement
    reading only those columns: every open stream polls it (a job's task, context, pool and planner
    output, and its steps' messages and outputs, can each be long)."""
    rows = session.connection().execute(_progress_stmt(steps), {"p_job_id": job_id}).all()
    if not rows:
        return None
    return str(rows[0][0]), [StepProgress(*row[1:]) for row in rows if steps and row[1] is not None]


@cache
def _progress_stmt(steps: bool) -> sa.Select[Any]:
    j, s = JOB.c, STEP.c
    job_id = sa.bindparam("p_job_id", type_=sa.String())
    if not steps:
        return sa.select(j.status).where(j.id == job_id)
    return (sa.select(j.status, s.index, s.agent, s.status, s.attempts, s.latency_ms, s.child_job_id)
            .select_from(JOB.outerjoin(STEP, s.job_id == j.id)).where(j.id == job_id).order_by(s.index))


OUTCOME_FIELDS = ("id", "status", "created_at", "finished_at", "answer", "error_type", "error_message",
                  "input_tokens", "output_tokens", "cost_usd", "calls", "cached_input_tokens", "reasoning_tokens",
                  "cache_write_tokens")
"""What a stream or a waiting chat completion tells of a job once it has ended."""


def job_outcome(session: Session, *, job_id: str) -> Job | None:
    """The job with only ``OUTCOME_FIELDS`` read (``model_construct``: for reading, never to be added to a
    session); None for no such job."""
    row = session.connection().execute(_outcome_stmt(), {"p_job_id": job_id}).first()
    return None if row is None else Job.model_construct(**dict(zip(OUTCOME_FIELDS, row, strict=True)))


@cache
def _outcome_stmt() -> sa.Select[Any]:
    return sa.select(*[JOB.c[name] for name in OUTCOME_FIELDS]).where(
        JOB.c.id == sa.bindparam("p_job_id", type_=sa.String()))


CHILD_SUCCEEDED = "child_succeeded"
"""The finish reason of a recursive step whose child job succeeded: its output is the child's answer."""
MAX_RECURSION_LEVELS = 6
"""More than any job tree has (``max_depth`` is at most 5)."""


def answer_finish_reasons(
    session: Session, *, job_ids: Sequence[str] = (), batch_id: str | None = None
) -> dict[str, str | None]:
    """Why the last step of each job (the one whose output is its answer) stopped: ``stop``, ``length``
    (cut at its token limit), ``content_filter``, ... A recursive last step answers with its child job's
    answer: its child's reason, followed down the tree. Of these jobs, or of every job of a batch; one
    statement per level of recursion, no messages or outputs read."""
    if batch_id is not None:
        jobs: Any = col(Step.job_id).in_(sa.select(col(Job.id)).where(col(Job.batch_id) == batch_id))
    elif job_ids:
        jobs = col(Step.job_id).in_(list(job_ids))
    else:
        return {}
    level = _last_step_reasons(session, jobs)
    looking = {job_id: job_id for job_id in level}  # a job at this level -> the job asked about
    found: dict[str, str | None] = {}
    for _ in range(MAX_RECURSION_LEVELS):
        deeper: dict[str, str] = {}
        for job_id, asked in looking.items():
            reason, child = level.get(job_id, (None, None))
            if reason == CHILD_SUCCEEDED and child is not None:
                deeper[child] = asked
            else:
                found[asked] = reason
        if not deeper:
            break
        looking, level = deeper, _last_step_reasons(session, col(Step.job_id).in_(list(deeper)))
    return found


def _last_step_reasons(session: Session, jobs: Any) -> dict[str, tuple[str | None, str | None]]:
    """(finish reason, child job id) of the last step of each job selected by ``jobs``."""
    last = (
        sa.select(col(Step.job_id).label("job_id"), sa.func.max(col(Step.index)).label("last"))
        .where(jobs)
        .group_by(col(Step.job_id))
        .subquery()
    )
    stmt = sa.select(col(Step.job_id), col(Step.finish_reason), col(Step.child_job_id)).join(
        last, sa.and_(col(Step.job_id) == last.c.job_id, col(Step.index) == last.c.last))
    return {job_id: (reason, child) for job_id, reason, child in session.execute(stmt)}


def note_lease_resent(session: Session, *, step_id: int, resends: int, now: datetime) -> bool:
    """Records the re-send of a running step whose lease expired (``resent_at`` = now, ``resends`` + 1) if
    its lease is still expired and it was re-sent ``resends`` times, as read: False when a worker claimed it
    meanwhile (a fresh lease) or an overlapping pass re-sent it first."""
    result = session.execute(
        sa.update(Step)
        .where(col(Step.id) == step_id, col(Step.status) == StepStatus.RUNNING, col(Step.lease_expires_at) < now,
               col(Step.resends) == resends)
        .values(resent_at=now, resends=col(Step.resends) + 1)
    )
    return int(getattr(result, "rowcount", 0) or 0) == 1


def _core(session: Session) -> Direct:
    """The session's connection, for the hot path's prebuilt Core statements: on Postgres they run on the
    driver's cursor (``conductor.store.direct``), elsewhere through ``Connection.execute``; either way
    without the ORM's execute layer (autoflush, ORM compile-state lookup, events), which cost as much
    CPU as the statement itself. In a ``transaction`` (one transaction by construction) the connection is
    looked up once: ``Session.connection()`` cost 3 % of a worker's CPU when called per statement."""
    info = session.info
    direct: Direct | None = info.get(_DIRECT)
    if direct is None:
        connection = info.get(ONE_TRANSACTION)
        if connection is None:
            return Direct(session)
        direct = info[_DIRECT] = Direct(connection=connection)
    return direct


_DIRECT = "conductor_direct"


def _rowcount(result: Any) -> int:
    return int(getattr(result, "rowcount", 0) or 0)
