"""``conductor export-rollouts``: GRPO training data for the conductor from rewarded jobs.

Each line is one sampled workflow in TRL's conversational prompt-completion form:
``{"prompt": [messages], "completion": [{"role": "assistant", "content": workflow text}], "reward": r,
...}``; the lines of one prompt are consecutive (a GRPO group). ``prompt`` is exactly what the
planner model was sent (rebuilt from the stored job by the one prompt builder); extra columns
(``answer``, ``category``, ...) reach TRL reward functions as keyword arguments.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, TextIO

from conductor.evaluation.dataset import Item
from conductor.planning.planner import job_limits
from conductor.planning.prompt import build_planner_messages
from conductor.pool.base import Message
from conductor.pool.config import PoolConfig
from conductor.settings import Settings
from conductor.store.models import Job


def rollout_rows(jobs: list[Job], items: dict[str, Item], settings: Settings) -> list[dict[str, Any]]:
    """One row per job that a planner model planned; grouped by prompt, in first-seen order."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for job in jobs:
        if job.planner_raw is None or job.reward is None:
            continue  # template or explicit workflows: no model wrote them
        prompt = planner_prompt(job, settings)
        prompt_id = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]
        meta = (job.meta or {}).get("eval", {})
        item = items.get(meta.get("item", ""))
        groups[prompt_id].append(
            {
                "prompt": prompt,
                "completion": [{"role": "assistant", "content": job.planner_raw}],
                "reward": job.reward,
                "prompt_id": prompt_id,
                "item_id": meta.get("item"),
                "category": meta.get("category"),
                "answer": item.answer if item else None,
                "format_valid": job.format_valid,
                "planner_attempts": job.planner_attempts,
                "job_id": job.id,
            }
        )
    return [row for rows in groups.values() for row in rows]


def planner_prompt(job: Job, settings: Settings) -> list[dict[str, str]]:
    """The planner's first-turn messages for this job, as the engine built them."""
    pool = PoolConfig.model_validate(job.pool_config)
    max_steps, max_depth = job_limits(job, settings)
    context = [Message(m["role"], m["content"]) for m in (job.context or [])] or None
    messages = build_planner_messages(
        job.task, pool, max_steps=max_steps, allow_conductor=job.depth < max_depth, context=context,
        nested=job.depth > 0,
    )
    return [m.as_dict() for m in messages]


def write_rows(rows: list[dict[str, Any]], target: Path | TextIO) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if isinstance(target, Path):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    else:
        target.write(text)
        target.flush()


def export_rollouts(options: Any, target: Path | TextIO, *, err: TextIO) -> int:
    """Samples ``options.samples`` workflows per item from the pool's planner at the given temperature
    (each one an ordinary, scored, rewarded job), then writes their rows. Returns the row count."""
    from conductor.evaluation.runner import run_eval
    from conductor.store import evals as store
    from conductor.store.db import session_scope

    run = run_eval(options, out=err, err=err)
    with session_scope() as s:
        jobs = store.rewarded_jobs(s, eval_run=run.run_id)
    rows = rollout_rows(jobs, {item.id: item for item in run.items}, run.settings)
    write_rows(rows, target)
    return len(rows)
