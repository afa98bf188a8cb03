"""The LLM planner: ask a model for a workflow, re-ask once with the exact error, else fall back.

A planner answer is either accepted as it is or rejected with a message the model can act on; it
is never repaired by guessing. Provider errors are not handled here: they propagate unchanged so
the caller's one retry policy decides about them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from conductor.planning.base import PlannerUsage, PlanResult
from conductor.planning.parse import PlannerFormatError, parse_planner_output
from conductor.planning.prompt import build_planner_messages, build_reask_message, workflow_json_schema
from conductor.pool.base import CallOptions, Completion, Message, Provider
from conductor.pool.config import DEFAULT_TEMPERATURE, PoolConfig, Price
from conductor.workflow import Workflow, WorkflowError, parse_workflow

PLANNER_MAX_TOKENS = 1024
"""The research conductor's completion budget."""
MAX_PLANNER_ATTEMPTS = 2
"""The first answer plus one re-ask that quotes the validation error."""


def plan_with_model(
    task: str,
    pool: PoolConfig,
    provider: Provider,
    planner_agent: str,
    *,
    max_steps: int,
    max_instruction_chars: int,
    allow_conductor: bool,
    fallback: Callable[[], Workflow],
    context: list[Message] | None = None,
    nested: bool = False,
    max_tokens: int = PLANNER_MAX_TOKENS,
    timeout_s: float = CallOptions.timeout_s,
    usage: PlannerUsage | None = None,
    before_call: Callable[[list[Message], PlannerUsage], int] | None = None,
    scope: str = "",
) -> PlanResult:
    """Plans ``task`` with the model behind ``provider``; ``planner_agent`` names its pool entry; ``scope``:
    the tenant's prompt cache scope (``context.cache_scope``).

    A planner that is not an entry of ``pool`` (a dedicated conductor endpoint) is called with
    the default agent settings and no price.
    """
    agent = pool.agents.get(planner_agent)
    price = agent.billing if agent else Price()
    use_schema = provider.supports_json_schema and (agent.structured_output if agent else True)
    options = CallOptions(
        temperature=agent.temperature if agent else DEFAULT_TEMPERATURE,
        max_tokens=max_tokens,
        timeout_s=agent.timeout_s if agent and agent.timeout_s else timeout_s,
        json_schema=workflow_json_schema(pool, max_steps, allow_conductor) if use_schema else None,
    )
    messages = build_planner_messages(
        task, pool, max_steps=max_steps, allow_conductor=allow_conductor, context=context, nested=nested,
        scope=scope,
    )
    usage = usage if usage is not None else PlannerUsage()  # the caller's, to add to across its retries

    def accept(completion: Completion) -> Workflow:
        raw = parse_planner_output(completion.text, pool.worker_names)
        return parse_workflow(
            raw,
            agents=pool.worker_names,
            max_steps=max_steps,
            max_instruction_chars=max_instruction_chars,
            allow_conductor=allow_conductor,
        )

    raw_text = ""
    error = ""
    for attempt in range(1, MAX_PLANNER_ATTEMPTS + 1):
        # the caller's rate limit and budget: it waits for a slot and says how many tokens this call may
        # write (or raises, e.g. BudgetExceeded)
        call = options if before_call is None else replace(
            options, max_tokens=min(options.max_tokens, before_call(messages, usage)))
        completion = provider.complete(messages, call)
        _add_usage(usage, completion, price)
        raw_text = completion.text
        try:
            workflow = accept(completion)
        except (PlannerFormatError, WorkflowError) as exc:
            error = _describe(exc, completion, call.max_tokens)  # the limit this call had (a budget may lower it)
            messages = [*messages, Message(role="assistant", content=raw_text), build_reask_message(error)]
            continue
        return PlanResult(
            workflow=workflow,
            source="planner",
            format_valid=True,
            planner=planner_agent,
            raw_text=raw_text,
            attempts=attempt,
            usage=usage,
        )
    return PlanResult(
        workflow=fallback(),
        source="fallback",
        format_valid=False,
        planner=planner_agent,
        raw_text=raw_text,
        error=error,
        attempts=MAX_PLANNER_ATTEMPTS,
        usage=usage,
    )


def _describe(exc: ValueError, completion: Completion, max_tokens: int) -> str:
    if completion.finish_reason == "length":
        return f"{exc} (the answer was cut off at the {max_tokens}-token limit; answer more briefly)"
    return str(exc)


def _add_usage(usage: PlannerUsage, completion: Completion, price: Price) -> None:
    usage.input_tokens += completion.input_tokens
    usage.output_tokens += completion.output_tokens
    usage.cached_input_tokens += completion.cached_input_tokens
    usage.reasoning_tokens += completion.reasoning_tokens
    usage.cache_write_tokens += completion.cache_write_tokens
    usage.cost_usd += price.cost(completion.input_tokens, completion.output_tokens, completion.cached_input_tokens,
                                 completion.cache_write_tokens, completion.cache_write_1h_tokens)
    usage.calls += 1
    usage.latency_ms += completion.latency_ms
