"""Tasks that meet Postgres away log one warning line and end: the reconciler (or its next pass) recovers
what they leave. They raised the driver's error for Celery to log as "raised unexpected" with its traceback,
at every task of an outage (the chaos soak with Postgres restarts, bench/soak.py --service-chaos). An error
the server answers (here a lock timeout, an ``OperationalError`` too) still raises.

Run in this process as a worker's task would run, the database URL a loopback port nothing listens on (a
Postgres that is down: the connection is refused), as test_broker_away does with the broker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from conductor.settings import get_settings
from conductor.store.db import get_engine, session_scope
from conductor.submission import JobCreate, create_job
from conductor.tasks.jobs import finalize, plan, reconcile, run_step_task
from tests.integration.harness import free_port


@contextmanager
def database_at(url: str) -> Iterator[str]:
    """The process's database URL is ``url`` until the block ends (its engine is a new one: one per URL)."""
    saved = get_settings().database_url
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONDUCTOR_DATABASE_URL", url)
        get_settings.cache_clear()
        try:
            yield url
        finally:
            mp.setenv("CONDUCTOR_DATABASE_URL", saved)
            get_settings.cache_clear()


def new_job(workflow_steps: int = 1) -> str:
    settings = get_settings()
    body = {"task": "database away", "workflow": {"model_ids": ["a"] * workflow_steps,
                                                  "subtasks": [f"s{i}" for i in range(workflow_steps)],
                                                  "access_lists": [[]] + [[i] for i in range(workflow_steps - 1)]}}
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate(body), tenant="database-away", settings=settings)
    return str(job.id)


def test_tasks_that_find_the_database_away_log_one_line_and_end(caplog: pytest.LogCaptureFixture) -> None:
    job_id = new_job()
    dead = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/conductor"
    runs = {
        "plan": lambda: plan.run(job_id),
        "run_step": lambda: run_step_task.run(job_id, 0),
        "finalize": lambda: finalize.run(job_id),
        "reconcile": lambda: reconcile.run(),
    }
    with database_at(dead):
        for name, run in runs.items():
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="conductor"):
                run()  # no OperationalError out of the task (it raised for Celery to log with its traceback)
            records = [r for r in caplog.records if r.name.startswith("conductor")]
            assert not [r for r in records if r.exc_info], f"{name} logged a traceback"
            (warning,) = records
            message = warning.getMessage()
            assert warning.levelno == logging.WARNING and "the database is away" in message, (name, message)
            assert "Connection refused" in message, (name, message)  # the driver's reason, in the line
            assert ("next pass" if name == "reconcile" else "the reconciler") in message, (name, message)
            if name != "reconcile":
                assert job_id in message, (name, message)
    with session_scope() as s:  # nothing was done: the job waits, queued, for the reconciler's re-send
        assert s.execute(sa.text("SELECT status FROM job WHERE id = :j"), {"j": job_id}).scalar_one() == "queued"


def test_a_database_error_of_a_live_server_still_raises_out_of_a_task() -> None:
    """A lock timeout is an ``OperationalError`` (SQLSTATE 55P03), as a refused connection is, but the server
    answered it: a task must not pass it off as the database being away."""
    job_id = new_job()
    url = sa.make_url(get_settings().database_url)
    impatient = url.update_query_dict({"options": "-c lock_timeout=200"}).render_as_string(hide_password=False)
    with get_engine().connect() as holder:
        holder.execute(sa.text("SELECT id FROM job WHERE id = :j FOR UPDATE"), {"j": job_id})  # the claim waits on it
        with database_at(impatient), pytest.raises(sa.exc.OperationalError) as raised:
            plan.run(job_id)
        holder.rollback()
    assert getattr(raised.value.orig, "sqlstate", None) == "55P03", raised.value
