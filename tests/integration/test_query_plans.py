"""The indexes of migration 0017 exist after ``conductor migrate``, the models declare exactly what the
migrations build, and the reads they are for use them: on a database of its own filled with a few thousand
rows and analyzed, EXPLAIN of each statement the store sends names the index (not a timing: the figures at
1.6M jobs are in docs/benchmarks.md, "Queries at scale")."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from conductor.migrations.migrate import upgrade
from conductor.store import batches, webhooks
from conductor.store import jobs as store
from conductor.store.models import utcnow
from tests.integration.harness import scratch_database

FILL = """
INSERT INTO tenant_settings (tenant, webhook_url, updated_at) VALUES ('t', 'https://hooks.example/t', now());
INSERT INTO job (id, tenant, status, task, pool, pool_config, planner, depth, planner_attempts,
                 planner_input_tokens, planner_output_tokens, planner_cost_usd, planner_calls, input_tokens,
                 output_tokens, cost_usd, calls, limits, metadata, webhook_url, cancel_requested, plan_claims,
                 plan_resends, replay_replan, created_at, updated_at, enqueued_at, finished_at)
SELECT md5('j' || i), CASE WHEN i % 10 = 0 THEN 'other' ELSE 't' END,
       CASE WHEN i % 20 = 0 THEN 'cancelled'  -- another tenant's many cancelled jobs
            WHEN i <= 4000 AND i % 2 = 1 THEN 'queued'  -- a backlog of 2,000
            WHEN i % 500 = 3 THEN 'cancelled' WHEN i % 50 = 7 THEN 'failed' ELSE 'succeeded' END,
       't', 'default', '{}', 'template', 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, '{}',
       jsonb_build_object('project', 'p' || (i % 20), 'run', i),
       CASE WHEN i % 2 = 0 THEN 'https://hooks.example/t' END, false, 1, 0, false,
       now() - i * interval '20 s', now() - i * interval '20 s' + interval '5 s',
       now() - i * interval '20 s',
       CASE WHEN i > 4000 OR i % 2 = 0 THEN now() - i * interval '20 s' + interval '5 s' END
FROM generate_series(1, 8000) AS i;
INSERT INTO batch (id, tenant, status, endpoint, input_file_id, completion_window, total, created_at)
SELECT 'batch_' || md5('b' || i), 't', CASE WHEN i = 1 THEN 'in_progress' ELSE 'completed' END, '/v1/jobs', 'f',
       '24h', CASE WHEN i = 1 THEN 400 ELSE 1 END, now() - i * interval '1 hour'
FROM generate_series(1, 3000) AS i;
UPDATE job SET batch_id = 'batch_' || md5('b1') WHERE id IN (SELECT md5('j' || i) FROM generate_series(5001, 5390) i);
INSERT INTO batch_request (batch_id, line, custom_id, job_id)
SELECT 'batch_' || md5('b1'), i, 'r' || i, CASE WHEN i <= 390 THEN md5('j' || (5000 + i)) END
FROM generate_series(1, 400) AS i;
INSERT INTO stored_file (id, tenant, purpose, filename, size_bytes, lines, content, created_at)
SELECT 'file-' || md5('f' || i), 't', 'batch', 'in.jsonl', 2, 1, '\\x7b7d'::bytea, now() - i * interval '1 min'
FROM generate_series(1, 3000) AS i;
INSERT INTO step (job_id, index, agent, instruction, access_list, access_all, status, input_tokens, output_tokens,
                  cost_usd, attempts, reserved_usd, reserved_tokens, resends, output)
SELECT md5('j' || i), k, 'a', 'part ' || k, CASE WHEN k = 0 THEN '[]' ELSE jsonb_build_array(k - 1) END, false,
       'succeeded', 10, 20, 0.001, 1, 0, 0, 0, 'out ' || k
FROM generate_series(1, 4000) AS i, generate_series(0, 4) AS k;
"""


@pytest.fixture(scope="module")
def engine() -> Iterator[sa.Engine]:
    with scratch_database("plans") as url:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        try:
            upgrade(url)
            with engine.begin() as conn:
                conn.connection.driver_connection.execute(FILL)  # type: ignore[union-attr]  (no parameters: % as is)
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql("VACUUM ANALYZE")
            yield engine
        finally:
            engine.dispose()


def _plans(engine: sa.Engine, call: Callable[[Session], Any]) -> list[dict[str, Any]]:
    """The plan of every SELECT ``call`` sends, explained with the same parameters."""
    sent: list[tuple[str, Any]] = []

    def seen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        sent.append((statement, parameters))

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        with Session(engine) as session:
            call(session)
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    plans = []
    with engine.connect() as conn:
        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        for statement, parameters in sent:
            if statement.lstrip().upper().startswith("SELECT"):
                cursor.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
                plans.append(cursor.fetchone()[0][0]["Plan"])
    return plans


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _indexes(plan: dict[str, Any]) -> set[str]:
    return {node["Index Name"] for node in _nodes(plan) if "Index Name" in node}


def _seq_scans(plan: dict[str, Any]) -> set[str]:
    return {node["Relation Name"] for node in _nodes(plan) if node["Node Type"] == "Seq Scan"}


def test_the_new_indexes_exist_after_migrate(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT c.relname, i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid")).all()
    found = {name: (valid, definition) for name, valid, definition in rows}
    expected = {
        "ix_job_batch_status": "(batch_id, status)",
        "ix_job_tenant_status_created": "(tenant, status, created_at, id) WHERE (parent_job_id IS NULL)",
        "ix_job_metadata": "USING gin (metadata)",
        "ix_job_queued": "(enqueued_at, created_at) WHERE ((status)::text = 'queued'::text)",
        "ix_batch_tenant_created_id": "(tenant, created_at, id)",
        "ix_stored_file_tenant_created_id": "(tenant, created_at, id)",
    }
    for name, definition in expected.items():
        assert name in found and found[name][0], name
        assert found[name][1].endswith(definition), found[name][1]
    assert "ix_job_batch_id" not in found


def test_batch_counts_use_the_batch_status_index(engine: sa.Engine) -> None:
    batch_id = "batch_" + _md5("b1")
    [plan] = _plans(engine, lambda s: batches.batch_counts(s, batch_id=batch_id))
    assert "ix_job_batch_status" in _indexes(plan) and "job" not in _seq_scans(plan), json.dumps(plan)
    [plan] = _plans(engine, lambda s: batches.has_unfinished_jobs(s, batch_id=batch_id))
    assert _indexes(plan) == {"ix_job_batch_status"}, json.dumps(plan)


def test_a_rare_status_and_several_statuses_use_the_status_index(engine: sa.Engine) -> None:
    for statuses in (("cancelled",), ("failed", "cancelled"), ("queued", "cancelled", "failed")):
        where = store.JobFilter(statuses=statuses)
        [plan] = _plans(engine, lambda s, where=where: store.list_jobs(s, tenant="t", where=where, limit=21))
        assert "ix_job_tenant_status_created" in _indexes(plan) and not _seq_scans(plan), (statuses, plan)


def test_a_metadata_key_no_recent_job_has_is_found_through_the_gin_index(engine: sa.Engine) -> None:
    where = store.JobFilter(meta_key="nokey")
    probe, rest = _plans(engine, lambda s: store.list_jobs(s, tenant="t", where=where, limit=21))
    assert "ix_job_tenant_created_id" in _indexes(probe) and "ix_job_metadata" in _indexes(rest), rest
    where = store.JobFilter(meta_key="run", meta_value="7")  # one job has it
    probe, rest = _plans(engine, lambda s: store.list_jobs(s, tenant="t", where=where, limit=21))
    assert "ix_job_metadata" in _indexes(rest) and "job" not in _seq_scans(rest), rest


def test_the_reconcilers_queued_jobs_use_the_queued_index(engine: sa.Engine) -> None:
    now = utcnow()
    [plan] = _plans(engine, lambda s: store.jobs_stuck_queued(s, older_than=now - timedelta(seconds=30)))
    assert _indexes(plan) == {"ix_job_queued"} and plan["Node Type"] == "Limit", json.dumps(plan)
    assert not any(node["Node Type"] == "Sort" for node in _nodes(plan))  # read in the index's order
    [plan] = _plans(engine, lambda s: store.jobs_never_enqueued(s, older_than=now))
    assert _indexes(plan) == {"ix_job_queued"}, json.dumps(plan)


def test_batch_and_file_pages_start_at_the_cursor_in_their_index(engine: sa.Engine) -> None:
    after_batch, after_file = "batch_" + _md5("b1500"), "file-" + _md5("f1500")
    _cursor, plan = _plans(engine, lambda s: batches.list_batches(s, tenant="t", after=after_batch, limit=21))
    assert "ix_batch_tenant_created_id" in _indexes(plan) and not _seq_scans(plan), json.dumps(plan)
    _cursor, plan = _plans(engine, lambda s: batches.list_files(s, tenant="t", purpose=None, after=after_file,
                                                                limit=21))
    assert "ix_stored_file_tenant_created_id" in _indexes(plan) and not _seq_scans(plan), json.dumps(plan)


def test_the_webhook_backfill_reads_its_window_from_the_status_index(engine: sa.Engine) -> None:
    from conductor.reconcile import WEBHOOK_BACKFILL_S

    since = utcnow() - timedelta(seconds=WEBHOOK_BACKFILL_S)
    [plan] = _plans(engine, lambda s: webhooks.ended_jobs_without_delivery(s, since=since))
    assert "ix_job_status_updated" in _indexes(plan) and "job" not in _seq_scans(plan), json.dumps(plan)


def _md5(text: str) -> str:
    import hashlib

    return hashlib.md5(text.encode()).hexdigest()



def test_the_step_claim_reads_its_jobs_steps_by_index_and_its_last_index_from_the_key(engine: sa.Engine) -> None:
    """The claim statement (``read_step_input``) reads the job's other steps in scalar subqueries (what
    they spent and hold, how many wait, the last index — the answering step's —, the visible outputs):
    each looks the job's rows up by ``job_id`` in an index, never scanning the step table; and the last
    index is read from the end of ``uq_step_job_index`` (job_id, index), one entry, not by aggregating
    the job's rows. Which of the two job_id indexes the sums use is the planner's choice (on this data
    ``ix_step_job_id``): not pinned."""
    [plan] = _plans(engine, lambda s: store.read_step_input(s, job_id=_md5("j7"), index=2))
    shown = json.dumps(plan)
    assert "step" not in _seq_scans(plan), shown
    scans = [node for node in _nodes(plan) if node.get("Index Name") in ("uq_step_job_index", "ix_step_job_id")]
    assert len(scans) >= 6, shown  # the claimed row, spent, spent_usd, unstarted, last, visible
    assert all("job_id" in node["Index Cond"] for node in scans), shown
    # the claimed row is read from uq_step_job_index too, by (job_id, index = ...): not that one
    ends = [node for node in scans if node["Index Name"] == "uq_step_job_index"
            and "index =" not in node["Index Cond"]]
    assert ends, shown
    limited = [node for node in _nodes(plan) if node["Node Type"] == "Limit"
               and any(scan in ends for scan in _nodes(node))]
    assert limited, shown  # max(index) as the key's last entry (a Limit 1 over the index), no Aggregate
