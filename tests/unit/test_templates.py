"""Template planners produce the topologies they are named for, within the step limit."""

from __future__ import annotations

import pytest

from conductor.planning.templates import TEMPLATES, template_workflow
from conductor.workflow import parse_workflow

AGENTS = ["x", "y", "z"]


def shape(name: str, max_steps: int = 5) -> list[list[int]]:
    return template_workflow(name, AGENTS, max_steps).dependencies


def test_single() -> None:
    assert shape("template:single") == [[]]


def test_fanout_is_parallel_attempts_then_an_aggregator() -> None:
    assert shape("fanout") == [[], [], [], [0, 1, 2]]
    assert shape("fanout", max_steps=2) == [[], [0]]


def test_pev_is_a_chain_where_the_verifier_sees_plan_and_solution() -> None:
    assert shape("pev") == [[], [0], [0, 1]]
    assert [s.agent for s in template_workflow("pev", AGENTS, 5).steps] == AGENTS


def test_moa_layers_fit_the_step_limit() -> None:
    assert shape("moa", max_steps=5) == [[], [], [], [0, 1, 2]]
    wf = template_workflow("moa", AGENTS, 9)
    assert wf.dependencies == [[], [], [], [0, 1, 2], [0, 1, 2], [0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("max_steps", [1, 2, 3, 5])
def test_every_template_is_a_valid_workflow(name: str, max_steps: int) -> None:
    wf = template_workflow(name, AGENTS, max_steps)
    assert len(wf.steps) <= max_steps
    again = parse_workflow(wf.model_dump(), agents=AGENTS, max_steps=max_steps)
    assert again == wf


def test_unknown_template() -> None:
    with pytest.raises(ValueError, match="unknown template planner 'template:nope'"):
        template_workflow("template:nope", AGENTS, 5)
