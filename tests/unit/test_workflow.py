"""Workflow validation: every mistake is a clear, located error."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.workflow import MAX_REPORTED_ERRORS, WorkflowError, critical_path, parse_workflow, used_fields

AGENTS = ["a", "b", "c"]


def errors_of(raw: Any, **kw: Any) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(WorkflowError) as info:
        parse_workflow(raw, agents=AGENTS, max_steps=kw.pop("max_steps", 5), **kw)
    return [(e.loc, e.msg) for e in info.value.errors]


def lists(model_ids: list[Any], access: list[Any]) -> dict[str, Any]:
    return {"model_ids": model_ids, "subtasks": [f"s{i}" for i in range(len(model_ids))], "access_lists": access}


def test_valid_three_lists_and_steps_forms_agree() -> None:
    a = parse_workflow(lists(["a", "b", "c"], [[], [0], "all"]), agents=AGENTS, max_steps=5)
    b = parse_workflow(
        {"steps": [{"agent": "a", "instruction": "s0"}, {"agent": "b", "instruction": "s1", "access_list": [0]},
                   {"agent": "c", "instruction": "s2", "access_list": "all"}]},
        agents=AGENTS,
        max_steps=5,
    )
    assert a == b
    assert a.dependencies == [[], [0], [0, 1]]


def test_all_in_a_list_is_all() -> None:
    wf = parse_workflow(lists(["a", "b"], [[], ["all"]]), agents=AGENTS, max_steps=5)
    assert wf.steps[1].access_list == "all" and wf.resolved_access(1) == [0]


def test_forward_reference() -> None:
    [(loc, msg)] = errors_of(lists(["a", "b"], [[1], []]))
    assert loc == ("workflow", "steps", 0, "access_list", 0) and "forward reference" in msg


def test_self_reference() -> None:
    [(loc, msg)] = errors_of(lists(["a", "b"], [[], [1]]))
    assert loc == ("workflow", "steps", 1, "access_list", 0) and "cannot see itself" in msg


def test_out_of_range_index() -> None:
    [(_, msg)] = errors_of(lists(["a", "b"], [[], [-1]]))
    assert "out of range" in msg
    [(_, msg)] = errors_of(lists(["a", "b"], [[], [7]]))
    assert "later step 7" in msg


def test_unknown_agent_names_the_known_ones() -> None:
    [(loc, msg)] = errors_of(lists(["zz"], [[]]))
    assert loc == ("workflow", "steps", 0, "agent") and "unknown agent 'zz'" in msg and "a, b, c" in msg


def test_conductor_refused_at_the_depth_cap() -> None:
    [(_, msg)] = errors_of(lists(["conductor"], [[]]), allow_conductor=False)
    assert "recursion depth limit" in msg
    assert parse_workflow(lists(["conductor"], [[]]), agents=AGENTS, max_steps=5).steps[0].agent == "conductor"


def test_too_many_steps() -> None:
    errs = errors_of(lists(["a"] * 6, [[]] * 6))
    assert any("6 steps given; at most 5" in m for _, m in errs)


def test_empty_workflow() -> None:
    assert errors_of(lists([], []))[0][1] == "a workflow needs at least one step"
    assert errors_of({"steps": []})[0][1] == "a workflow needs at least one step"


def test_mismatched_lists_and_missing_fields() -> None:
    [(_, msg)] = errors_of({"model_ids": ["a"], "subtasks": [], "access_lists": [[]]})
    assert "same length" in msg
    errs = errors_of({"model_ids": ["a"]})
    assert {loc[-1] for loc, _ in errs} == {"subtasks", "access_lists"}


def test_bad_types_and_blank_instruction_are_all_reported() -> None:
    errs = errors_of({"steps": [{"agent": "a", "instruction": " ", "access_list": "some"}, "nope"]})
    locs = [loc for loc, _ in errs]
    assert ("workflow", "steps", 0, "instruction") in locs
    assert ("workflow", "steps", 0, "access_list") in locs
    assert ("workflow", "steps", 1) in locs


@pytest.mark.parametrize("blank", ["\u200b\u2060", " \ufeff\t", "\u200d\n"])
def test_an_instruction_of_invisible_characters_is_blank(blank: str) -> None:
    # str.strip keeps zero-width spaces and joiners: a worker would be sent an instruction it cannot see
    [(loc, msg)] = errors_of(lists(["a"], [[]]) | {"subtasks": [blank]})
    assert loc == ("workflow", "steps", 0, "instruction") and "non-empty" in msg


def test_instruction_length_limit() -> None:
    [(_, msg)] = errors_of(lists(["a"], [[]]) | {"subtasks": ["x" * 50]}, max_instruction_chars=10)
    assert "50 characters; at most 10" in msg


@pytest.mark.parametrize("unstorable", ["Fix \u0000 it", "half \ud83d a pair"])
def test_an_instruction_postgres_cannot_store_is_refused(unstorable: str) -> None:
    # a planner's JSON escape decodes to it; stored, the plan's record failed and the planning was re-run
    raw = {"model_ids": ["a", "b"], "subtasks": ["fine", unstorable], "access_lists": [[], []]}
    assert errors_of(raw) == [(("workflow", "steps", 1, "instruction"),
                               "must not contain NUL characters or unpaired surrogates")]


def test_critical_path_of_a_diamond() -> None:
    length, path = critical_path([[], [0], [0], [1, 2]], [1.0, 2.0, 5.0, 1.0])
    assert length == 7.0 and path == [0, 2, 3]


def test_a_workflow_built_to_fail_on_every_item_gets_a_bounded_refusal() -> None:
    with pytest.raises(WorkflowError) as too_many:  # said at once, the steps not walked
        parse_workflow({"steps": [{"agent": "?"}] * 100_000}, agents=["a"], max_steps=5)
    assert [str(e) for e in too_many.value.errors] == ["workflow: 100000 steps given; at most 5 are allowed"]
    with pytest.raises(WorkflowError) as long_list:
        parse_workflow({"steps": [{"agent": "a", "instruction": "x", "access_list": [1] * 300_000}]},
                       agents=["a"], max_steps=5)
    assert len(long_list.value.errors) == 1 and "300000 entries" in str(long_list.value)
    with pytest.raises(WorkflowError) as bad:
        parse_workflow({"steps": [{"agent": "?", "instruction": "", "access_list": [9] * 60}] * 5},
                       agents=["a"], max_steps=5)
    assert len(bad.value.errors) == MAX_REPORTED_ERRORS + 1 and "and 290 more" in str(bad.value.errors[-1])
    assert len(str(bad.value)) < 3_000


@pytest.mark.parametrize("raw", [
    {"steps": [{"agent": "a", "instruction": "x"}], "junk": "x"},
    {"model_ids": ["a"], "subtasks": ["x"], "access_lists": [[]], "reasoning": "kept?"},
])
def test_fields_a_workflow_does_not_use_are_refused_not_stored(raw: dict[str, Any]) -> None:
    with pytest.raises(WorkflowError, match="unexpected fields"):
        parse_workflow(raw, agents=["a"], max_steps=5)


def test_a_workflow_stored_before_unused_fields_were_refused_still_plans() -> None:
    stored = {"steps": [{"agent": "a", "instruction": "x", "access_list": []}], "notes": "accepted then"}
    assert len(parse_workflow(used_fields(stored), agents=["a"], max_steps=5).steps) == 1
    lists = {"model_ids": ["a"], "subtasks": ["x"], "access_lists": [[]], "reasoning": "accepted then"}
    assert parse_workflow(used_fields(lists), agents=["a"], max_steps=5).steps[0].agent == "a"
    repeated = {"model_ids": ["a", "a"], "subtasks": ["x", "y"], "access_lists": [[], [0] * 100]}
    assert parse_workflow(used_fields(repeated), agents=["a"], max_steps=5).steps[1].access_list == [0]


def test_a_refusal_quotes_request_values_cut() -> None:
    with pytest.raises(WorkflowError) as refused:
        parse_workflow({"steps": [{"agent": "x" * 1_000_000, "instruction": "go", "access_list": ["y" * 500_000]}]},
                       agents=["a"], max_steps=5)
    assert len(str(refused.value)) < 1_000 and "xxx..." in str(refused.value)
