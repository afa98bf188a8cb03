"""The LLM planner: accept, re-ask once with the exact error, fall back; the prompt and the schema."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

import pytest

from conductor.context import cache_scope
from conductor.planning.conductor_planner import plan_with_model
from conductor.planning.prompt import (
    MAX_SUBTASK_CHARS,
    build_planner_messages,
    build_reask_message,
    workflow_json_schema,
)
from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.config import PoolConfig
from conductor.pool.errors import RateLimited
from conductor.workflow import Step, Workflow


class ScriptedProvider(Provider):
    """The network edge, scripted: each call returns the next reply (or raises it) and records the call."""

    name = "scripted"

    def __init__(self, replies: list[str | Exception], *, supports_json_schema: bool = False):
        self.replies: deque[str | Exception] = deque(replies)
        self.supports_json_schema = supports_json_schema
        self.calls: list[tuple[list[Message], CallOptions]] = []

    def complete(self, messages: list[Message], options: CallOptions) -> Completion:
        self.calls.append((list(messages), options))
        reply = self.replies.popleft()
        if isinstance(reply, Exception):
            raise reply
        return Completion(
            text=reply,
            input_tokens=sum(len(m.content) for m in messages) // 4,
            output_tokens=len(reply) // 4,
            finish_reason="stop",
            model="scripted-conductor",
            latency_ms=7,
        )


def make_pool(**planner: Any) -> PoolConfig:
    return PoolConfig.model_validate(
        {
            "planner": "planner-llm",
            "agents": {
                "planner-llm": {
                    "provider": "sim",
                    "temperature": 0.6,
                    "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0},
                    "description": "Writes workflows.",
                    **planner,
                },
                "coder": {"provider": "sim", "description": "Strong coder."},
                "checker": {"provider": "sim", "description": "Careful verifier."},
            },
        }
    )


FALLBACK = Workflow(steps=[Step(agent="coder", instruction="fallback: answer the task")])
VALID = json.dumps(
    {
        "model_ids": ["coder", "checker"],
        "subtasks": ["Write the function.", "Check the function above and output the final code."],
        "access_lists": [[], "all"],
    }
)
FORWARD_REFERENCE = "model_ids = [0, 1]\nsubtasks = ['Draft', 'Check']\naccess_lists = [[1], []]"


def plan(provider: ScriptedProvider, pool: PoolConfig | None = None, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "max_steps": 5,
        "max_instruction_chars": 20_000,
        "allow_conductor": True,
        "fallback": lambda: FALLBACK,
    }
    options.update(kwargs)
    return plan_with_model("Write is_prime(n).", pool or make_pool(), provider, "planner-llm", **options)


def test_a_valid_first_answer_is_the_workflow() -> None:
    provider = ScriptedProvider([VALID])
    result = plan(provider)
    assert result.source == "planner"
    assert result.format_valid is True
    assert result.attempts == 1
    assert result.planner == "planner-llm"
    assert result.raw_text == VALID
    assert [s.agent for s in result.workflow.steps] == ["coder", "checker"]
    assert result.workflow.steps[1].access_list == "all"
    assert result.usage.calls == 1
    assert result.usage.latency_ms == 7
    _, options = provider.calls[0]
    assert options.temperature == 0.6
    assert options.max_tokens == 1024


def test_an_invalid_answer_is_re_asked_once_with_the_validation_error() -> None:
    provider = ScriptedProvider([FORWARD_REFERENCE, VALID])
    result = plan(provider)
    assert result.source == "planner"
    assert result.format_valid is True
    assert result.attempts == 2
    assert result.raw_text == VALID
    second_messages, _ = provider.calls[1]
    assert second_messages[:2] == provider.calls[0][0]
    assert second_messages[2] == Message(role="assistant", content=FORWARD_REFERENCE)
    reask = second_messages[3]
    assert reask.role == "user"
    assert "step 0 cannot see later step 1 (forward reference)" in reask.content
    assert '{"model_ids": [...], "subtasks": [...], "access_lists": [...]}' in reask.content


def test_unparseable_text_is_re_asked_with_the_format_error() -> None:
    provider = ScriptedProvider(["I would ask the coder to do it.", VALID])
    result = plan(provider)
    assert result.attempts == 2
    assert "no model_ids list found" in provider.calls[1][0][-1].content


def test_an_answer_invalid_twice_falls_back_and_records_why() -> None:
    unknown_agent = json.dumps({"model_ids": ["gpt-9"], "subtasks": ["Do it."], "access_lists": [[]]})
    provider = ScriptedProvider([FORWARD_REFERENCE, unknown_agent])
    result = plan(provider)
    assert result.source == "fallback"
    assert result.format_valid is False
    assert result.workflow == FALLBACK
    assert result.attempts == 2
    assert result.raw_text == unknown_agent
    assert result.error is not None and "unknown agent 'gpt-9'" in result.error
    assert result.usage.calls == 2
    assert len(provider.calls) == 2


def test_conductor_may_only_be_chosen_when_allowed() -> None:
    recursive = json.dumps(
        {"model_ids": ["coder", "conductor"], "subtasks": ["Draft.", "Re-plan."], "access_lists": [[], [0]]}
    )
    allowed = plan(ScriptedProvider([recursive]), allow_conductor=True)
    assert allowed.workflow.steps[1].agent == "conductor"
    refused = plan(ScriptedProvider([recursive, recursive]), allow_conductor=False)
    assert refused.source == "fallback"
    assert refused.error is not None and "recursion depth limit" in refused.error


def test_too_many_steps_is_rejected() -> None:
    three = "model_ids = [0, 0, 1]\nsubtasks = ['a', 'b', 'c']\naccess_lists = [[], [0], 'all']"
    result = plan(ScriptedProvider([three, three]), max_steps=2)
    assert result.source == "fallback"
    assert result.error is not None and "3 steps given; at most 2" in result.error


def test_usage_accumulates_tokens_calls_latency_and_cost_at_the_planner_price() -> None:
    provider = ScriptedProvider([FORWARD_REFERENCE, VALID])
    usage = plan(provider).usage
    first_in = sum(len(m.content) for m in provider.calls[0][0]) // 4
    second_in = sum(len(m.content) for m in provider.calls[1][0]) // 4
    outputs = len(FORWARD_REFERENCE) // 4 + len(VALID) // 4
    assert usage.input_tokens == first_in + second_in
    assert usage.output_tokens == outputs
    assert usage.calls == 2
    assert usage.latency_ms == 14
    assert usage.cost_usd == pytest.approx(((first_in + second_in) * 1.0 + outputs * 2.0) / 1_000_000)


@pytest.mark.parametrize(
    ("supports", "structured", "expect_schema"),
    [(True, True, True), (False, True, False), (True, False, False)],
)
def test_json_schema_is_sent_only_when_the_backend_supports_it_and_the_pool_wants_it(
    supports: bool, structured: bool, expect_schema: bool
) -> None:
    pool = make_pool(structured_output=structured)
    provider = ScriptedProvider([VALID], supports_json_schema=supports)
    plan(provider, pool)
    schema = provider.calls[0][1].json_schema
    if expect_schema:
        assert schema == workflow_json_schema(pool, 5, True)
    else:
        assert schema is None


def test_provider_errors_propagate_unchanged() -> None:
    error = RateLimited("slow down", retry_after=3.0)
    with pytest.raises(RateLimited) as info:
        plan(ScriptedProvider([error]))
    assert info.value is error


def test_a_truncated_answer_says_it_was_cut_off() -> None:
    class Truncating(ScriptedProvider):
        def complete(self, messages: list[Message], options: CallOptions) -> Completion:
            completion = super().complete(messages, options)
            return Completion(**{**completion.__dict__, "finish_reason": "length"})

    result = plan(Truncating(["<think>\nFirst, the coder", "<think>\nStill thinking"]), max_tokens=64)
    assert result.source == "fallback"
    assert result.error is not None
    assert "<think> block is never closed" in result.error
    assert "cut off at the 64-token limit" in result.error


# --- the prompt and the schema ---------------------------------------------------------------------


def test_the_system_prompt_is_the_same_for_every_job_of_a_pool() -> None:
    pool = make_pool()
    first = build_planner_messages("Task one", pool, max_steps=5, allow_conductor=True)
    second = build_planner_messages(
        "A different task", pool, max_steps=3, allow_conductor=False, context=[Message("user", "earlier")]
    )
    assert first[0].role == second[0].role == "system"
    assert first[0].content == second[0].content
    assert [m.role for m in first] == [m.role for m in second] == ["system", "user"]
    assert "Task one" in first[-1].content and "Task one" not in first[0].content


def test_a_tenants_cache_scope_leads_the_user_message_and_leaves_the_system_prompt_shared() -> None:
    pool = make_pool()
    plain = build_planner_messages("Task one", pool, max_steps=5, allow_conductor=True)
    scoped = [build_planner_messages("Task one", pool, max_steps=5, allow_conductor=True, scope=cache_scope(t))
              for t in ("tenant-a", "tenant-b")]
    assert plain[0] == scoped[0][0] == scoped[1][0]  # every tenant's planner calls share the static prefix
    assert [m[1].content for m in scoped] == [cache_scope(t) + plain[1].content for t in ("tenant-a", "tenant-b")]
    assert scoped[0][1].content != scoped[1][1].content


def test_the_system_prompt_numbers_the_workers_and_shows_three_topologies() -> None:
    system = build_planner_messages("t", make_pool(), max_steps=5, allow_conductor=True)[0].content
    assert "Workers:\n0. coder — Strong coder.\n1. checker — Careful verifier.\n\n" in system
    assert "planner-llm" not in system
    assert '"access_lists": [[]]}' in system
    assert '"access_lists": [[], [0], [0, 1]]}' in system
    assert '"access_lists": [[], [], "all"]}' in system
    assert "last step's output is the final answer" in system
    assert "only when the request says it is allowed" in system


def test_the_request_carries_task_context_limits_and_recursion_permission() -> None:
    context = [Message("user", "Implement is_prime."), Message("assistant", "def is_prime(n): ...")]
    user = build_planner_messages(
        "Fix the bug.", make_pool(), max_steps=4, allow_conductor=False, context=context
    )[-1].content
    assert user.index("def is_prime(n): ...") < user.index("Fix the bug.")
    assert "at most 4 steps" in user
    assert 'Do not choose "conductor"' in user
    allowed = build_planner_messages("t", make_pool(), max_steps=5, allow_conductor=True)[-1].content
    assert 'You may choose "conductor"' in allowed


def test_the_request_says_what_its_context_is_and_that_every_step_sees_it() -> None:
    context = [Message("user", "Implement is_prime."), Message("assistant", "def is_prime(n): ...")]
    child = build_planner_messages("Check it.", make_pool(), max_steps=3, allow_conductor=False, context=context,
                                   nested=True)[-1].content
    chat = build_planner_messages("And now in Go?", make_pool(), max_steps=3, allow_conductor=False,
                                  context=context)[-1].content
    assert "called as a step of a larger workflow" in child and "larger workflow" not in chat
    assert chat.startswith("The conversation so far")  # a chat's earlier turns are not a parent's work
    assert all("Every step of your workflow is shown this" in text for text in (child, chat))


def test_reask_message_quotes_the_error() -> None:
    message = build_reask_message("workflow.steps.1.agent: unknown agent 'x'")
    assert message.role == "user"
    assert "workflow.steps.1.agent: unknown agent 'x'" in message.content


def walk(schema: Any, path: str = "$") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(schema, dict):
        found.append((path, schema))
        for key, value in schema.items():
            found.extend(walk(value, f"{path}.{key}"))
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            found.extend(walk(value, f"{path}[{i}]"))
    return found


@pytest.mark.parametrize(("max_steps", "allow_conductor"), [(1, False), (5, True), (12, False)])
def test_every_array_and_string_in_the_schema_is_bounded(max_steps: int, allow_conductor: bool) -> None:
    schema = workflow_json_schema(make_pool(), max_steps, allow_conductor)
    nodes = walk(schema)
    arrays = [(p, n) for p, n in nodes if n.get("type") == "array"]
    strings = [(p, n) for p, n in nodes if n.get("type") == "string"]
    assert len(arrays) == 4 and len(strings) == 3
    for path, node in arrays:
        assert "maxItems" in node, path
        assert node["maxItems"] <= max_steps, path
    for path, node in strings:
        assert "maxLength" in node, path
    assert schema["additionalProperties"] is False
    assert schema["required"] == ["model_ids", "subtasks", "access_lists"]
    assert schema["properties"]["subtasks"]["items"]["maxLength"] == MAX_SUBTASK_CHARS


def test_schema_names_the_agents_and_the_conductor_only_when_allowed() -> None:
    pool = make_pool()
    ids = workflow_json_schema(pool, 5, True)["properties"]["model_ids"]["items"]["enum"]
    assert ids == ["coder", "checker", "conductor"]
    assert "conductor" not in workflow_json_schema(pool, 5, False)["properties"]["model_ids"]["items"]["enum"]
    access = workflow_json_schema(pool, 5, True)["properties"]["access_lists"]["items"]["anyOf"]
    assert access[0]["items"] == {"type": "integer", "minimum": 0, "maximum": 4}
    assert access[1]["enum"] == ["all"]


def test_a_one_worker_pool_still_gets_all_three_examples_with_that_worker() -> None:
    pool = PoolConfig.model_validate({"agents": {"solo": {"provider": "sim"}}})
    system = build_planner_messages("t", pool, max_steps=5, allow_conductor=False)[0].content
    assert "Workers:\n0. solo\n\n" in system
    assert '"model_ids": ["solo", "solo", "solo"]' in system


def test_a_planning_is_kept_alive_for_its_planner_agents_own_timeout() -> None:
    """A planner agent allowed an hour a call (a CPU model) is not taken for stuck after the default."""
    from types import SimpleNamespace

    from conductor.planning.conductor_planner import MAX_PLANNER_ATTEMPTS
    from conductor.planning.planner import longest_planning_s
    from conductor.settings import Settings

    settings = Settings()
    pool = {"planner": "slow-planner", "agents": {"slow-planner": {"provider": "sim", "timeout_s": 3600},
                                                  "quick": {"provider": "sim"}}}
    job: Any = SimpleNamespace(planner="conductor", pool_config=pool)
    assert longest_planning_s(job, settings) == MAX_PLANNER_ATTEMPTS * settings.step_max_duration_s(3600)
    assert longest_planning_s(job, settings) > MAX_PLANNER_ATTEMPTS * settings.step_max_duration_s()
    job.planner = "quick"  # a request naming another agent: its (default) timeout
    assert longest_planning_s(job, settings) == MAX_PLANNER_ATTEMPTS * settings.step_max_duration_s()


def test_a_call_that_answered_before_a_retried_error_is_still_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """First call: an invalid plan (paid). The re-ask: rate limited, so the planning is retried. Then a
    valid plan. All answered calls count, not only those of the last try."""
    from types import SimpleNamespace

    from conductor.planning import planner as planner_module
    from conductor.settings import Settings

    provider = ScriptedProvider([FORWARD_REFERENCE, RateLimited("slow down", retry_after=0.0), VALID])
    monkeypatch.setattr(planner_module, "provider_for", lambda _name, _config: provider)  # the network edge
    monkeypatch.setenv("CONDUCTOR_RETRY_BACKOFF_BASE_S", "0")
    monkeypatch.setenv("CONDUCTOR_RETRY_BACKOFF_MAX_S", "0")
    job: Any = SimpleNamespace(task="write a haiku", context=None, depth=0, tenant="t", limits={},
                               planner_input_tokens=0, planner_output_tokens=0, planner_cost_usd=0.0)
    result = planner_module._plan_with_agent(job, make_pool(), "planner-llm", Settings(), max_steps=5,
                                             allow_conductor=True)
    assert result.source == "planner" and len(provider.calls) == 3
    assert result.usage.calls == 2  # the first (invalid) answer and the last; the rate-limited call had none
    assert result.usage.output_tokens == len(FORWARD_REFERENCE) // 4 + len(VALID) // 4


def planning_job(**fields: Any) -> Any:
    from types import SimpleNamespace

    defaults: dict[str, Any] = {"task": "write a haiku", "context": None, "depth": 0, "tenant": "t", "limits": {},
                                "planner_input_tokens": 0, "planner_output_tokens": 0, "planner_cost_usd": 0.0}
    return SimpleNamespace(**{**defaults, **fields})


def test_a_planner_call_writes_no_more_than_the_budget_has_room_for(monkeypatch: pytest.MonkeyPatch) -> None:
    from conductor.planning import planner as planner_module
    from conductor.settings import Settings

    provider = ScriptedProvider([VALID])
    monkeypatch.setattr(planner_module, "provider_for", lambda _name, _config: provider)  # the network edge
    from conductor.budget import estimate_tokens

    # $1 / $2 per million tokens in / out: the prompt's cost plus $0.0003, room for 150 output tokens
    prompt = sum(estimate_tokens(m.content) for m in build_planner_messages(
        "write a haiku", make_pool(), max_steps=5, allow_conductor=True))
    job = planning_job(limits={"max_cost_usd": prompt * 1e-6 + 0.0003})
    planner_module._plan_with_agent(job, make_pool(), "planner-llm", Settings(), max_steps=5, allow_conductor=True)
    ((_, options),) = provider.calls
    assert 100 <= options.max_tokens <= 150  # not the agent's 4,096
    unlimited = ScriptedProvider([VALID])
    monkeypatch.setattr(planner_module, "provider_for", lambda _name, _config: unlimited)
    planner_module._plan_with_agent(planning_job(), make_pool(), "planner-llm", Settings(), max_steps=5,
                                    allow_conductor=True)
    assert unlimited.calls[0][1].max_tokens == min(make_pool().agents["planner-llm"].max_tokens, 4096)


def test_a_planning_the_budget_cannot_pay_for_fails_with_what_it_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    from conductor.budget import estimate_tokens
    from conductor.planning import planner as planner_module
    from conductor.planning.base import PlanningOverBudget
    from conductor.settings import Settings

    provider = ScriptedProvider([FORWARD_REFERENCE, VALID])  # an invalid plan, then the re-ask
    monkeypatch.setattr(planner_module, "provider_for", lambda _name, _config: provider)
    # room for the first call only: its spend leaves the re-ask (its prompt now longer) nothing
    first_prompt = sum(estimate_tokens(m.content) for m in build_planner_messages(
        "write a haiku", make_pool(), max_steps=5, allow_conductor=True))
    job = planning_job(limits={"max_tokens": first_prompt + 400})
    with pytest.raises(PlanningOverBudget, match="token budget") as refused:
        planner_module._plan_with_agent(job, make_pool(), "planner-llm", Settings(), max_steps=5,
                                        allow_conductor=True)
    assert len(provider.calls) == 1 and refused.value.usage.calls == 1  # the paid call is reported
    assert refused.value.usage.input_tokens > 0


def test_a_cut_off_answer_is_told_the_limit_its_call_had() -> None:
    class CutOff(ScriptedProvider):
        def complete(self, messages: list[Message], options: CallOptions) -> Completion:
            done = super().complete(messages, options)
            return Completion(text=done.text, input_tokens=done.input_tokens, output_tokens=options.max_tokens,
                              finish_reason="length", model=done.model, latency_ms=done.latency_ms)

    provider = CutOff(['{"model_ids": ["coder"], "subtasks": ["trun', '{"model_ids": ["coder"], "sub'])
    result = plan_with_model("t", make_pool(), provider, "planner-llm", max_steps=3, max_instruction_chars=100,
                             allow_conductor=False, fallback=lambda: FALLBACK, before_call=lambda _m, _u: 60)
    assert [options.max_tokens for _, options in provider.calls] == [60, 60]  # the budget's, not the agent's
    assert "cut off at the 60-token limit" in (result.error or "")
