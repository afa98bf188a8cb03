"""Template planners: fixed topologies over the pool, no model call. Baselines and fallbacks."""

from __future__ import annotations

from collections.abc import Callable

from conductor.workflow import Step, Workflow


def single(agents: list[str], max_steps: int) -> Workflow:
    return Workflow(steps=[Step(agent=agents[0], instruction="Solve the task and give the final answer.")])


def fanout(agents: list[str], max_steps: int, width: int = 3) -> Workflow:
    """``width`` independent attempts on different agents, then one aggregator that sees them all."""
    if max_steps < 2:
        return single(agents, max_steps)
    width = max(1, min(width, max_steps - 1))
    steps = [
        Step(
            agent=agents[i % len(agents)],
            instruction=f"Attempt {i + 1}: solve the task independently and give your final answer.",
        )
        for i in range(width)
    ]
    steps.append(
        Step(
            agent=agents[0],
            instruction="Compare the attempts above, resolve disagreements and give the single best final answer.",
            access_list="all",
        )
    )
    return Workflow(steps=steps)


def pev(agents: list[str], max_steps: int) -> Workflow:
    """Planner -> executor -> verifier, the chain the research reports for hard coding tasks."""
    if max_steps < 3:
        return single(agents, max_steps)
    pick = [agents[i % len(agents)] for i in range(3)]
    return Workflow(
        steps=[
            Step(agent=pick[0], instruction="Plan: break the task into concrete steps and name the pitfalls."),
            Step(agent=pick[1], instruction="Execute the plan above and produce a complete solution.", access_list=[0]),
            Step(
                agent=pick[2],
                instruction="Verify the solution against the task and the plan; fix any error and output "
                "the final, corrected solution in full.",
                access_list=[0, 1],
            ),
        ]
    )


def moa(agents: list[str], max_steps: int, proposers: int = 3, layers: int = 1) -> Workflow:
    """Mixture-of-Agents: parallel proposers, ``layers`` of refiners that see the previous layer, an aggregator."""
    if max_steps < 2:
        return single(agents, max_steps)
    proposers = max(1, min(proposers, max_steps - 1))
    while proposers * (1 + layers) + 1 > max_steps and layers > 0:
        layers -= 1
    steps: list[Step] = []
    previous: list[int] = []
    for layer in range(1 + layers):
        current = []
        for p in range(proposers):
            text = (
                f"Proposer {p + 1}: answer the task."
                if layer == 0
                else f"Layer {layer + 1}, proposer {p + 1}: improve on the answers above and answer the task."
            )
            steps.append(Step(agent=agents[p % len(agents)], instruction=text, access_list=list(previous)))
            current.append(len(steps) - 1)
        previous = current
    steps.append(
        Step(
            agent=agents[0],
            instruction="Aggregate the answers above into one best final answer.",
            access_list=list(previous),
        )
    )
    return Workflow(steps=steps)


TEMPLATES: dict[str, Callable[[list[str], int], Workflow]] = {
    "single": single,
    "fanout": fanout,
    "pev": pev,
    "moa": moa,
}


def template_workflow(name: str, agents: list[str], max_steps: int) -> Workflow:
    """``name`` is ``template:X`` or ``X``."""
    key = name.removeprefix("template:")
    if key not in TEMPLATES:
        raise ValueError(f"unknown template planner '{name}'; known: {', '.join(TEMPLATES)}")
    return TEMPLATES[key](agents, max_steps)
