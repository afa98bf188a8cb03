"""The replay reuse rule: which steps of a replayed workflow keep the original's outputs."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.planning.planner import make_plan
from conductor.pool.config import load_pool
from conductor.replay import reusable
from conductor.settings import Settings
from conductor.store.models import Job, Step, StepStatus
from conductor.workflow import Workflow, WorkflowError
from tests.conftest import TESTS


def workflow(agents: list[str], access: list[Any]) -> Workflow:
    pairs = enumerate(zip(agents, access, strict=True))
    return Workflow.model_validate(
        {"steps": [{"agent": a, "instruction": f"part {i}", "access_list": acc} for i, (a, acc) in pairs]}
    )


def original(wf: Workflow, failed: tuple[int, ...] = ()) -> dict[int, Step]:
    return {
        i: Step(id=100 + i, job_id="orig", index=i, agent=st.agent, instruction=st.instruction,
                access_list=wf.resolved_access(i), output=f"out {i}",
                status=StepStatus.FAILED if i in failed else StepStatus.SUCCEEDED)
        for i, st in enumerate(wf.steps)
    }


# 0 <- 1 <- 2 <- 4, and 3 reads only 0: the shape of the integration test.
ACCESS: list[Any] = [[], [0], [0, 1], [0], [2, 3]]
BEFORE = workflow(["a", "b", "c", "d", "a"], ACCESS)


def test_from_step_with_a_swapped_agent_reruns_only_what_depends_on_it() -> None:
    after = workflow(["a", "b", "d", "d", "a"], ACCESS)
    reused = reusable(after, original(BEFORE), from_step=2, unchanged_agent=lambda _: True)
    assert sorted(reused) == [0, 1, 3]
    assert [reused[i].id for i in (0, 1, 3)] == [100, 101, 103]


def test_from_step_alone_reruns_that_step_even_unchanged() -> None:
    assert sorted(reusable(BEFORE, original(BEFORE), from_step=3, unchanged_agent=lambda _: True)) == [0, 1, 2]


def test_an_override_before_from_step_reruns_it_and_its_dependents() -> None:
    after = workflow(["a", "c", "c", "d", "a"], ACCESS)
    assert sorted(reusable(after, original(BEFORE), from_step=4, unchanged_agent=lambda _: True)) == [0, 3]


def test_all_access_depends_on_every_earlier_step() -> None:
    before = workflow(["a", "b", "c"], [[], [], "all"])
    assert sorted(reusable(before, original(before), from_step=1, unchanged_agent=lambda _: True)) == [0]


def test_a_step_that_did_not_succeed_runs_again_with_its_dependents() -> None:
    reused = reusable(BEFORE, original(BEFORE, failed=(1,)), from_step=3, unchanged_agent=lambda _: True)
    assert sorted(reused) == [0]


def test_an_agent_whose_pool_entry_changed_runs_again() -> None:
    reused = reusable(BEFORE, original(BEFORE), from_step=4, unchanged_agent=lambda agent: agent != "d")
    assert sorted(reused) == [0, 1, 2]


def test_a_replanned_workflow_reuses_only_matching_steps() -> None:
    after = workflow(["a", "b", "c"], [[], [0], [0]])  # step 2 reads [0] now, not [0, 1]
    assert sorted(reusable(after, original(BEFORE), from_step=4, unchanged_agent=lambda _: True)) == [0, 1]


def test_with_a_capped_answer_a_step_changing_role_runs_again() -> None:
    """``max_answer_tokens`` cuts the last step's output only: a step is reused only if it answers in both
    workflows or in neither (and what reads a step that runs again runs again)."""
    shorter = workflow(["a", "b", "c"], [[], [0], [0, 1]])  # the original's steps 0-2; step 2 now answers
    assert sorted(reusable(shorter, original(BEFORE), from_step=4, unchanged_agent=lambda _: True,
                           answer_capped=True)) == [0, 1]
    assert sorted(reusable(shorter, original(BEFORE), from_step=4, unchanged_agent=lambda _: True)) == [0, 1, 2]
    longer = workflow(["a", "b", "c", "d", "a", "b"], [*ACCESS, [4]])  # the original's answer (4) is read by 5
    assert sorted(reusable(longer, original(BEFORE), from_step=5, unchanged_agent=lambda _: True,
                           answer_capped=True)) == [0, 1, 2, 3]
    assert sorted(reusable(longer, original(BEFORE), from_step=5, unchanged_agent=lambda _: True)) == [0, 1, 2, 3, 4]
    same = reusable(BEFORE, original(BEFORE), from_step=2, unchanged_agent=lambda _: True, answer_capped=True)
    assert sorted(same) == [0, 1, 3]  # the same length: nothing changes role, the rule is as without a cap


def test_a_replay_plans_the_original_workflow_under_the_limits_it_was_accepted_with() -> None:
    # accepted (202) with the original's own size; the server's limits lowered since must not fail it later
    pool = load_pool(TESTS / "pools" / "sim.yaml").model_dump(mode="json")
    steps = [{"agent": "a", "instruction": "x" * 30, "access_list": list(range(i))} for i in range(6)]
    settings = Settings(max_steps=5, max_instruction_chars=20)
    replay = Job(id="r" * 32, tenant="t", task="t", planner="conductor", pool_config=pool,
                 request_workflow={"steps": steps}, replay_of="o" * 32, replay_replan=False)
    assert len(make_plan(replay, settings=settings).workflow.steps) == 6
    fresh = Job(id="f" * 32, tenant="t", task="t", planner="conductor", pool_config=pool,
                request_workflow={"steps": steps})
    with pytest.raises(WorkflowError):  # a new job still meets today's limits
        make_plan(fresh, settings=settings)


def test_a_cached_input_price_alone_leaves_an_agent_unchanged() -> None:
    from conductor.pool.config import PoolConfig
    from conductor.replay import _same_agent

    def pool(price: dict[str, float], model: str = "m") -> PoolConfig:
        return PoolConfig.model_validate({"planner": "template:single", "agents": {
            "a": {"provider": "sim", "model": model, "price": price}, "b": {"provider": "sim"}}})

    before = pool({"input_per_mtok": 1.0})
    cached = pool({"input_per_mtok": 1.0, "cached_input_per_mtok": 0.2})
    assert _same_agent(before, cached, "a") and _same_agent(before, cached, "conductor")
    # under a cost budget the input and output prices bound how long an answer may be: they count
    repriced = pool({"input_per_mtok": 2.0})
    assert not _same_agent(before, repriced, "a") and not _same_agent(before, repriced, "conductor")
    other_model = pool({"input_per_mtok": 1.0}, model="m2")
    assert not _same_agent(before, other_model, "a") and not _same_agent(before, other_model, "conductor")
    assert _same_agent(before, other_model, "b")
