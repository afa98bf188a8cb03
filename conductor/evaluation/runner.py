"""``conductor eval``: every (item, planner) pair becomes an ordinary job in the embedded store; each
finished job is scored, its reward stored on its row, and the tables printed and written.

With ``router`` among the planners the items are split per category: on the fit split every worker
agent answers alone (``single:AGENT``), the lookup table is fitted on those scores, and every planner
-- the router included -- is then measured on the other split only, so no planner is scored on the
data the router was fitted on.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from conductor.evaluation.dataset import DatasetError, Item, load_dataset
from conductor.evaluation.planners import PlannerSpec, PlannerSpecError, parse_planners, request_fields
from conductor.evaluation.progress import ProgressBar
from conductor.evaluation.report import render, write
from conductor.evaluation.results import JobResult, Phase, evaluate_job
from conductor.evaluation.router import Router, fit_router, split_items

POLL_S = 0.2
DEFAULT_CONCURRENCY = 4
LOCAL_CONCURRENCY = 1
"""A local model runs one call at a time: more jobs in flight would only queue for it and blur latency."""
EVAL_METADATA_KEY = "eval"


class EvalError(Exception):
    """A one-line reason an evaluation cannot run."""


@dataclass(frozen=True)
class EvalOptions:
    dataset: str
    planners: str
    pool: str | None = None
    data_dir: Path | None = None
    out: Path | None = None
    limit: int | None = None
    per_category: int | None = None
    categories: tuple[str, ...] = ()
    fit_fraction: float = 0.5
    concurrency: int | None = None
    samples: int = 1
    planner_temperature: float | None = None
    title: str | None = None


@dataclass
class _Pending:
    item: Item
    planner: str
    phase: Phase
    sample: int
    fields: dict[str, Any]


@dataclass
class EvalRun:
    run_id: str
    results: list[JobResult]
    router: Router | None
    out_dir: Path
    table: str
    settings: Any
    items: list[Item] = field(default_factory=list)


def select_items(options: EvalOptions) -> list[Item]:
    try:
        items = load_dataset(options.dataset)
    except DatasetError as exc:
        raise EvalError(str(exc)) from exc
    if options.categories:
        items = [i for i in items if i.category in options.categories]
    if options.per_category is not None:
        kept: dict[str, int] = {}
        chosen = []
        for item in items:
            if kept.get(item.category, 0) < options.per_category:
                kept[item.category] = kept.get(item.category, 0) + 1
                chosen.append(item)
        items = chosen
    if options.limit is not None:
        items = items[: options.limit]
    if not items:
        raise EvalError("no dataset items left after --categories / --per-category / --limit")
    return items


def run_eval(options: EvalOptions, *, out: TextIO | None = None, err: TextIO | None = None) -> EvalRun:
    out = out or sys.stdout
    err = err or sys.stderr
    from conductor.embedded import EmbeddedError, embedded_session

    items = select_items(options)
    run_id = f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    pool = _pool_argument(options, run_id)
    try:
        with embedded_session(pool, data_dir=options.data_dir, err=err) as session:
            try:
                specs = parse_planners(options.planners, session.pool)
            except PlannerSpecError as exc:
                raise EvalError(str(exc)) from exc
            concurrency = options.concurrency or _default_concurrency(session.pool)
            pump = _JobPump(session, run_id, concurrency=concurrency, err=err)
            router: Router | None = None
            eval_items = items
            notes = [f"Dataset `{options.dataset}`, pool `{session.pool.name}`, run `{run_id}`."]
            if any(s.kind == "router" for s in specs):
                fit_items, eval_items = split_items(items, options.fit_fraction)
                if not fit_items or not eval_items:
                    raise EvalError("the router needs at least two items per category (one to fit, one to test)")
                print(f"fitting the router on {len(fit_items)} items x {len(session.pool.worker_names)} agents",
                      file=err, flush=True)
                fit_jobs = [
                    _Pending(item, f"single:{agent}", "fit", 0, request_fields(PlannerSpec(f"single:{agent}",
                             "single", agent)))
                    for item in fit_items
                    for agent in session.pool.worker_names
                ]
                fit_results = pump.run(fit_jobs, label="fit jobs")
                router = fit_router(fit_results, session.pool.worker_names)
                notes.append(
                    f"Router fitted on {len(fit_items)} items; every planner is measured on the other "
                    f"{len(eval_items)} items."
                )
            else:
                fit_results = []
            jobs = [
                _Pending(item, spec.label, "eval", sample, _fields(spec, item, router))
                for item in eval_items
                for spec in specs
                for sample in range(options.samples)
            ]
            results = fit_results + pump.run(jobs, label="jobs")
            settings = session.settings
            out_dir = options.out or session.directory / "evals" / run_id
    except EmbeddedError as exc:
        raise EvalError(str(exc)) from exc
    title = options.title or f"Evaluation {run_id}"
    labels = [s.label for s in specs]
    table = render(results, title=title, router=router, notes=notes, planners=labels)
    meta = {"run": run_id, "dataset": options.dataset, "pool": pool, "planners": labels,
            "items": len(items), "eval_items": len(eval_items), "samples": options.samples}
    write(out_dir, results, table, meta=meta, router=router, planners=labels)
    out.write(table)
    out.flush()
    print(f"results: {out_dir} (results.jsonl, table.md, summary.json); every job's trace: "
          f"conductor trace JOB_ID --data-dir {settings.data_dir}", file=err, flush=True)
    return EvalRun(run_id, results, router, out_dir, table, settings, items)


def _fields(spec: PlannerSpec, item: Item, router: Router | None) -> dict[str, Any]:
    routed = router.agent_for(item.category) if router is not None and spec.kind == "router" else None
    return request_fields(spec, routed_agent=routed)


def _default_concurrency(pool: Any) -> int:
    local = any(agent.provider == "local" for agent in pool.agents.values())
    return LOCAL_CONCURRENCY if local else DEFAULT_CONCURRENCY


def _pool_argument(options: EvalOptions, run_id: str) -> str | None:
    """The pool to use; with a planner temperature, a copy of the pool file with that temperature."""
    if options.planner_temperature is None:
        return options.pool
    from conductor.evaluation.pools import with_planner_temperature

    return str(with_planner_temperature(options.pool, options.planner_temperature, tag=run_id,
                                        data_dir=options.data_dir))


class _JobPump:
    """Keeps at most ``concurrency`` jobs in flight, scores each as it ends, stores its reward."""

    def __init__(self, session: Any, run_id: str, *, concurrency: int, err: TextIO):
        self.session = session
        self.run_id = run_id
        self.concurrency = max(1, concurrency)
        self.err = err

    def run(self, pending: list[_Pending], *, label: str) -> list[JobResult]:
        from conductor.engine import cancel_job

        queue = list(reversed(pending))
        in_flight: dict[str, _Pending] = {}
        results: list[JobResult] = []
        bar = ProgressBar(len(pending), self.err, label=label)
        bar.draw(running=0, force=True)
        try:
            while queue or in_flight:
                while queue and len(in_flight) < self.concurrency:
                    job = queue.pop()
                    in_flight[self._submit(job)] = job
                for job_id, result in self._collect(in_flight):
                    del in_flight[job_id]
                    results.append(result)
                    bar.advance(correct=result.correct, running=len(in_flight))
                self.session.reconcile_if_due()
                bar.draw(running=len(in_flight))
                if in_flight:
                    time.sleep(POLL_S)
        except KeyboardInterrupt:
            bar.close()
            for job_id in in_flight:
                cancel_job(job_id)
            print(f"\ncancelled {len(in_flight)} running jobs\nconductor: interrupted", file=self.err, flush=True)
            sys.stdout.flush()
            os._exit(130)  # a model call in flight cannot be interrupted; see embedded._watch
        bar.close()
        return results

    def _submit(self, job: _Pending) -> str:
        from conductor.store import evals as store
        from conductor.store.db import session_scope
        from conductor.submission import JobCreate

        metadata = {EVAL_METADATA_KEY: {"run": self.run_id, "item": job.item.id, "category": job.item.category,
                                        "planner": job.planner, "phase": job.phase, "sample": job.sample}}
        job_id = self.session.submit(JobCreate(task=job.item.prompt, metadata=metadata, **job.fields))
        with session_scope() as s:
            store.tag_job(s, job_id=job_id, eval_run=self.run_id)
        return job_id

    def _collect(self, in_flight: dict[str, _Pending]) -> list[tuple[str, JobResult]]:
        from conductor.store import evals as store
        from conductor.store import jobs as job_store
        from conductor.store.db import session_scope
        from conductor.store.models import JobStatus

        with session_scope() as s:
            rows = store.jobs_by_id(s, job_ids=list(in_flight))
            ended = {job_id: job for job_id, job in rows.items() if job.status in JobStatus.TERMINAL}
            agents = {job_id: [st.agent for st in job_store.get_steps(s, job_id=job_id)] for job_id in ended}
        done = []
        for job_id, job in ended.items():
            pending = in_flight[job_id]
            result = evaluate_job(job, item=pending.item, planner=pending.planner, phase=pending.phase,
                                  run=self.run_id, agents=agents[job_id], sample=pending.sample)
            with session_scope() as s:
                store.set_reward(s, job_id=job_id, reward=result.reward)
            done.append((job_id, result))
        return done
