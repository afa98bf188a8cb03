"""One evaluated job: its item, planner, outcome, score, reward and costs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from conductor.evaluation.dataset import Item
from conductor.evaluation.scoring import Score, score
from conductor.store.models import Job, JobStatus

Phase = Literal["fit", "eval"]
REWARD_UNPARSEABLE = 0.0
REWARD_VALID_WRONG = 0.5
REWARD_CORRECT = 1.0


def grpo_reward(*, format_valid: bool | None, correct: bool) -> float:
    """The research's GRPO reward: 0 for a workflow that never parsed (the job then ran a fallback or
    nothing), 0.5 for a valid workflow with a wrong answer, 1 for a correct answer."""
    if not format_valid:
        return REWARD_UNPARSEABLE
    return REWARD_CORRECT if correct else REWARD_VALID_WRONG


@dataclass
class JobResult:
    run: str
    phase: Phase
    item_id: str
    category: str
    planner: str
    job_id: str
    status: str
    correct: bool
    reward: float
    extracted: str | None
    detail: str
    input_tokens: int
    output_tokens: int
    cost_usd: float
    latency_s: float
    steps: int
    format_valid: bool | None
    workflow_source: str | None
    sample: int = 0
    error: str | None = None
    agents: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def evaluate_job(
    job: Job, *, item: Item, planner: str, phase: Phase, run: str, agents: list[str], sample: int = 0
) -> JobResult:
    """Scores a finished job. A job that did not succeed has no answer and is wrong."""
    succeeded = job.status == JobStatus.SUCCEEDED
    result = score(item, job.answer) if succeeded else Score(False, None, f"job {job.status}")
    started = job.started_at or job.created_at
    latency = (job.finished_at - started).total_seconds() if job.finished_at and started else 0.0
    return JobResult(
        run=run,
        phase=phase,
        item_id=item.id,
        category=item.category,
        planner=planner,
        job_id=job.id,
        status=job.status,
        correct=result.correct,
        reward=grpo_reward(format_valid=job.format_valid, correct=result.correct),
        extracted=result.extracted,
        detail=result.detail,
        input_tokens=job.input_tokens,
        output_tokens=job.output_tokens,
        cost_usd=job.cost_usd,
        latency_s=max(0.0, latency),
        steps=len(agents),
        format_valid=job.format_valid,
        workflow_source=job.workflow_source,
        sample=sample,
        error=job.error_message if not succeeded else None,
        agents=agents,
    )
