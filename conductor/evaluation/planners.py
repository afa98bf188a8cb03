"""Planner specs on the ``conductor eval`` command line, and the job request each one makes.

- ``conductor``: the pool's planner (the conductor model, or whatever the pool file names);
- ``planner:AGENT``: the model behind AGENT writes the workflow (any agent of the pool as the conductor);
- ``single:AGENT``: one step on AGENT (an explicit workflow, no planner call);
- ``router``: one step on the agent a lookup table picks for the item's category (see router.py);
- ``fanout``, ``pev``, ``moa`` (or ``template:NAME``): the fixed-topology template planners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from conductor.planning.templates import TEMPLATES, single
from conductor.pool.config import PoolConfig
from conductor.workflow import CONDUCTOR_AGENT

PlannerKind = Literal["conductor", "agent", "single", "router", "template"]
ROUTER = "router"
MAX_PLANNERS = 32


class PlannerSpecError(ValueError):
    """A --planners entry that names no planner of this pool."""


@dataclass(frozen=True)
class PlannerSpec:
    label: str
    """As it appears in the table: ``conductor``, ``single:gpt-5``, ``router``, ``fanout``."""
    kind: PlannerKind
    name: str = ""
    """The agent (agent, single) or the template name (template)."""


def parse_planners(text: str, pool: PoolConfig) -> list[PlannerSpec]:
    specs: list[PlannerSpec] = []
    for raw in (part.strip() for part in text.split(",")):
        if not raw:
            continue
        spec = _parse_one(raw, pool)
        if spec.label not in {s.label for s in specs}:
            specs.append(spec)
    if not specs:
        raise PlannerSpecError("--planners names no planner")
    if len(specs) > MAX_PLANNERS:
        raise PlannerSpecError(f"at most {MAX_PLANNERS} planners per run")
    return specs


def _parse_one(raw: str, pool: PoolConfig) -> PlannerSpec:
    if raw == CONDUCTOR_AGENT:
        return PlannerSpec(label=raw, kind="conductor")
    if raw == ROUTER:
        return PlannerSpec(label=raw, kind="router")
    if raw.startswith("planner:"):
        agent = raw.removeprefix("planner:")
        if agent not in pool.agents:
            known = ", ".join(pool.agents)
            raise PlannerSpecError(f"'{raw}': no agent '{agent}' in pool {pool.name} (agents: {known})")
        return PlannerSpec(label=raw, kind="agent", name=agent)
    if raw.startswith("single:"):
        agent = raw.removeprefix("single:")
        if agent not in pool.worker_names:
            raise PlannerSpecError(
                f"'{raw}': no worker agent '{agent}' in pool {pool.name} (workers: {', '.join(pool.worker_names)})"
            )
        return PlannerSpec(label=raw, kind="single", name=agent)
    template = raw.removeprefix("template:")
    if template in TEMPLATES:
        return PlannerSpec(label=template, kind="template", name=template)
    known = ", ".join([CONDUCTOR_AGENT, "planner:<agent>", "single:<agent>", ROUTER, *TEMPLATES])
    raise PlannerSpecError(f"unknown planner '{raw}'; use one of: {known}")


def single_workflow(agent: str) -> dict[str, Any]:
    """The explicit one-step workflow of ``single:AGENT`` (the same instruction as template:single)."""
    step = single([agent], 1).steps[0]
    return {"steps": [{"agent": agent, "instruction": step.instruction, "access_list": []}]}


def request_fields(spec: PlannerSpec, *, routed_agent: str | None = None) -> dict[str, Any]:
    """The ``JobCreate`` fields that make a job use this planner."""
    if spec.kind == "conductor":
        return {"planner": CONDUCTOR_AGENT}
    if spec.kind == "template":
        return {"planner": f"template:{spec.name}"}
    if spec.kind == "agent":
        return {"planner": spec.name}
    agent = routed_agent if spec.kind == "router" else spec.name
    if not agent:
        raise PlannerSpecError("the router has no agent for this item (it was not fitted)")
    return {"workflow": single_workflow(agent)}
