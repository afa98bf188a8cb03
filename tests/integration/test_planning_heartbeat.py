"""A planner slower than the lease is alive, not lost: its heartbeat keeps the job's planning claim
fresh, so the reconciler (running all along, with a stale-planning bound far shorter than the hang)
never re-drives it. The hanging planner times out per the retry policy and the job falls back to the
template exactly once, planned by one claim; the planner endpoint saw one planner's attempts only."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import yaml

from conductor.engine import plan_job
from conductor.reconcile import reconcile_once
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import JobStatus
from conductor.submission import JobCreate, create_job
from conductor.tasks.send import send
from tests.fakes.http_base import hang
from tests.fakes.openai_server import FakeOpenAIServer

LEASE_S = 1.5
PLANNING_STALE_S = 2.0
PROVIDER_TIMEOUT_S = 5.0  # each planner attempt hangs this long: > lease and > the stale bound
ATTEMPTS = 2


def write_pool(pools_dir: Path, base_url: str) -> None:
    pool = {"planner": "planner", "fallback": "template:single",
            "agents": {"planner": {"provider": "openai_compatible", "model": "conductor", "base_url": base_url},
                       "a": {"provider": "sim"}}}
    (pools_dir / "hanging-planner.yaml").write_text(yaml.safe_dump(pool))


def test_a_planner_hanging_longer_than_the_lease_falls_back_once(pools_dir: Path) -> None:
    settings = get_settings().model_copy(update={
        "step_lease_s": LEASE_S, "planning_stale_s": PLANNING_STALE_S, "provider_timeout_s": PROVIDER_TIMEOUT_S,
        "step_max_attempts": ATTEMPTS, "reconcile_stale_s": 1.0,
    })
    with FakeOpenAIServer(reply=lambda _body: hang(60)) as srv:
        write_pool(pools_dir, srv.base_url)
        with session_scope() as s:
            job, _ = create_job(s, JobCreate(task="plan me slowly", pool="hanging-planner"), tenant="hb",
                                settings=get_settings())
            job_id = job.id
            store.update_job(s, job_id=job_id, enqueued_at=job.created_at)  # as if its plan message was sent
        done = threading.Event()
        passes: list[float] = []  # when each reconciler pass started

        def reconciler() -> None:  # what beat does, every 0.3 s instead of 15 s, while the planner hangs
            while not done.wait(0.3):
                started = time.monotonic()
                _report, dispatch = reconcile_once(settings)
                send(dispatch)
                passes.append(started)

        thread = threading.Thread(target=reconciler)
        thread.start()
        planning_started = time.monotonic()
        try:
            plan_job(job_id, settings=settings)  # this worker's planner: hangs ATTEMPTS x PROVIDER_TIMEOUT_S
        finally:
            planned = time.monotonic()
            done.set()
            thread.join(30)
        calls = len(srv.requests)

    # the reconciler really looked while the planning was older than its stale bound (so a missing
    # heartbeat would have been re-driven): an ordering of events, not a duration of ours
    stale_after = planning_started + max(PLANNING_STALE_S, LEASE_S, settings.reconcile_stale_s)
    assert any(stale_after < t < planned for t in passes), (len(passes), planned - planning_started)
    with session_scope() as s:
        job_row = store.get_job(s, job_id=job_id)
        assert job_row is not None
        assert job_row.plan_claims == 1  # planned by one claim: never re-driven
        assert job_row.status in (JobStatus.RUNNING, JobStatus.SUCCEEDED)
        assert job_row.workflow_source == "fallback" and job_row.planner_attempts == ATTEMPTS
        assert "provider_timeout" in (job_row.planner_error or "")
    assert calls == ATTEMPTS  # one planner's attempts, not a second planner's too
