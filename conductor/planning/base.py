"""What every planner returns, and the source labels the trace records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from conductor.errors import BudgetExceeded
from conductor.pool.base import storable_escaped
from conductor.workflow import Workflow

WorkflowSource = Literal["planner", "request", "fallback", "replay"]


@dataclass
class PlannerUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    calls: int = 0
    latency_ms: int = 0
    cached_input_tokens: int = 0
    """Of ``input_tokens``, those the provider read from its prompt cache."""
    reasoning_tokens: int = 0
    """Of ``output_tokens``, the model's reasoning."""
    cache_write_tokens: int = 0
    """Of ``input_tokens``, those written to the provider's prompt cache."""


@dataclass
class PlanResult:
    workflow: Workflow
    source: WorkflowSource
    format_valid: bool
    """False when the planner's own output never validated (the workflow is then the fallback's)."""
    planner: str
    """What produced the workflow: an agent name or ``template:NAME``."""
    raw_text: str | None = None
    """The planner model's last raw output, kept for audit (never contains secrets: it is model text)."""
    error: str | None = None
    """Why the planner's output was rejected, when it was."""
    attempts: int = 0
    usage: PlannerUsage = field(default_factory=PlannerUsage)

    def __post_init__(self) -> None:
        # the refusal quotes the planner's output (an unknown agent's name): stored as the job's planner_error
        if self.error is not None:
            self.error = storable_escaped(self.error)


class PlanningOverBudget(BudgetExceeded):
    """The job's budget has no room for a planner call; ``usage``: what the planning's calls before it
    spent (the job counts it when it fails)."""

    def __init__(self, message: str, usage: PlannerUsage):
        super().__init__(message)
        self.usage = usage
