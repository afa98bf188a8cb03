"""The conductor prompt: the one module that says what the planner model is asked and how.

The system message depends only on the pool, so every job planned against the same pool starts
with byte-identical tokens and a serving engine's prefix cache (vLLM, llama.cpp) reuses them. All
per-job text -- the task, a recursive call's context, the step limit and whether the conductor may
call itself -- goes into the user message that follows it.
"""

from __future__ import annotations

import json
from typing import Any

from conductor.pool.base import Message
from conductor.pool.config import PoolConfig
from conductor.workflow import CONDUCTOR_AGENT

MAX_SUBTASK_CHARS = 2000
"""Longest instruction the structured-output schema admits (grammars only terminate with bounds)."""

OUTPUT_FORMAT = '{"model_ids": [...], "subtasks": [...], "access_lists": [...]}'

_ROLE_INTRO = """\
You are the Conductor. You coordinate a pool of worker models to solve a task. You do not solve \
the task yourself: you write a short workflow of steps, and each step is run by one worker."""

_RULES = f"""\
How a workflow runs:
- Each step gives one worker one instruction (a subtask). Write it so that worker can act on it \
alone: what to do, what to produce, what to check.
- Every worker is shown the user's task. Besides it, a step sees only its own instruction and the \
steps in its access list: [] means nothing else, [0, 2] means the instructions and answers of steps \
0 and 2, "all" means every earlier step. An access list may only name earlier steps (steps are \
numbered from 0). So an instruction says what this step must do with the task (its role), and need \
not repeat the task.
- Steps that do not depend on each other run in parallel.
- The last step's output is the final answer the user receives, so the last step must produce the \
complete answer and see the steps it needs.
- You may choose "{CONDUCTOR_AGENT}" (yourself) for a step only when the request says it is \
allowed. Such a step plans and runs its own workflow, seeing the steps in its access list; use it \
to check or correct earlier work.
- Use as few steps as the task needs, never more than the request allows.

Output format: answer with exactly one JSON object and nothing else:
{OUTPUT_FORMAT}
- model_ids: for each step, the worker's name exactly as listed above.
- subtasks: for each step, its instruction.
- access_lists: for each step, [], a list of earlier step numbers, or "all".
The three lists have one entry per step, in the same order."""


def build_planner_messages(
    task: str,
    pool: PoolConfig,
    *,
    max_steps: int,
    allow_conductor: bool,
    context: list[Message] | None = None,
    nested: bool = False,
    scope: str = "",
) -> list[Message]:
    """The static system prompt for ``pool``, then one user message with everything job-specific.
    ``context``: a recursive step's visible earlier work (``nested``), or a chat's earlier turns; ``scope``:
    the tenant's prompt cache scope (``context.cache_scope``), the user message's first line."""
    return [
        Message(role="system", content=system_prompt(pool)),
        Message(
            role="user",
            content=scope + _request(task, max_steps=max_steps, allow_conductor=allow_conductor, context=context,
                                     nested=nested),
        ),
    ]


def build_reask_message(error: str) -> Message:
    """The follow-up turn after an unusable answer: what was wrong and the format to answer in."""
    return Message(
        role="user",
        content=(
            f"Your previous answer could not be used: {error}\n"
            f"Fix exactly these problems and answer again with only the JSON object {OUTPUT_FORMAT}, "
            "keeping the three lists the same length."
        ),
    )


def system_prompt(pool: PoolConfig) -> str:
    """Role, numbered workers, rules, output format and examples: identical for every job of a pool."""
    return "\n\n".join([_ROLE_INTRO, _worker_list(pool), _RULES, _examples(pool.worker_names)])


def workflow_json_schema(pool: PoolConfig, max_steps: int, allow_conductor: bool) -> dict[str, Any]:
    """The schema a constrained decoder enforces: every array and string is bounded so it terminates."""
    names = [*pool.worker_names, *([CONDUCTOR_AGENT] if allow_conductor else [])]
    earlier_steps = max(max_steps - 1, 0)
    access_list = {
        "anyOf": [
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": earlier_steps},
                "maxItems": earlier_steps,
            },
            {"type": "string", "enum": ["all"], "maxLength": 3},
        ]
    }
    return {
        "type": "object",
        "properties": {
            "model_ids": _bounded_array(
                {"type": "string", "enum": names, "maxLength": max(len(n) for n in names)}, max_steps
            ),
            "subtasks": _bounded_array(
                {"type": "string", "minLength": 1, "maxLength": MAX_SUBTASK_CHARS}, max_steps
            ),
            "access_lists": _bounded_array(access_list, max_steps),
        },
        "required": ["model_ids", "subtasks", "access_lists"],
        "additionalProperties": False,
    }


def _bounded_array(items: dict[str, Any], max_steps: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": max_steps}


def _worker_list(pool: PoolConfig) -> str:
    lines = ["Workers:"]
    for i, name in enumerate(pool.worker_names):
        description = " ".join(pool.agents[name].description.split())
        lines.append(f"{i}. {name} — {description}" if description else f"{i}. {name}")
    return "\n".join(lines)


def _examples(names: list[str]) -> str:
    """Few-shot workflows of the three typical topologies, written with this pool's own workers."""

    def pick(i: int) -> str:
        return names[i % len(names)]

    single = {
        "model_ids": [pick(0)],
        "subtasks": ["Answer the task directly: give the answer and one sentence of justification."],
        "access_lists": [[]],
    }
    chain = {
        "model_ids": [pick(0), pick(1), pick(2)],
        "subtasks": [
            "Plan a solution to the task; do not write code yet. Describe the algorithm, its complexity "
            "and the edge cases (empty input, touching intervals).",
            "Implement the plan above as complete, runnable Python. Output only the code.",
            "Check the implementation against the task, the plan and the edge cases by tracing small "
            "inputs. Fix any bug and output the final, complete code.",
        ],
        "access_lists": [[], [0], [0, 1]],
    }
    parallel = {
        "model_ids": [pick(1), pick(2), pick(0)],
        "subtasks": [
            "Answer the task independently: argue from the evidence and commit to one conclusion.",
            "Answer the task independently: weigh at least three candidate explanations before concluding.",
            "Two analysts answered the task above. Compare their reasoning, resolve disagreements and "
            "give one final, well-supported answer.",
        ],
        "access_lists": [[], [], "all"],
    }
    return "\n\n".join(
        [
            "Examples (illustrations only: choose the workers that fit your task).",
            _example("An easy question needs one step.", "What is the capital of Australia?", single),
            _example(
                "A hard coding problem: plan, implement, verify.",
                "Write a function that returns the minimum number of meeting rooms for a list of intervals.",
                chain,
            ),
            _example(
                "An analysis question: independent attempts, then an aggregator that sees them all.",
                "Why did the 2008 financial crisis spread from US housing to global banks?",
                parallel,
            ),
        ]
    )


def _example(title: str, task: str, workflow: dict[str, Any]) -> str:
    return f"{title}\nTask: {task}\n{json.dumps(workflow, ensure_ascii=False)}"


def _request(task: str, *, max_steps: int, allow_conductor: bool, context: list[Message] | None,
             nested: bool = False) -> str:
    parts: list[str] = []
    if context and nested:
        parts.append(
            "You were called as a step of a larger workflow. The earlier work you may see, oldest first:\n\n"
            + "\n\n".join(_context_turn(m) for m in context)
            + "\n\nCheck or correct that work, or answer directly with a single step. Every step of your "
            "workflow is shown this earlier work too, whatever its access list."
        )
    elif context:
        parts.append(
            "The conversation so far, oldest first:\n\n"
            + "\n\n".join(_context_turn(m) for m in context)
            + "\n\nEvery step of your workflow is shown this conversation too, whatever its access list."
        )
    parts.append(f"Task:\n{task}")
    if allow_conductor:
        recursion = f'You may choose "{CONDUCTOR_AGENT}" (yourself) for a step.'
    else:
        recursion = (
            f'Do not choose "{CONDUCTOR_AGENT}": the recursion limit is reached; use listed workers only.'
        )
    parts.append(f"Limits: at most {max_steps} steps. {recursion}")
    parts.append("Write the workflow now as the JSON object.")
    return "\n\n".join(parts)


_CONTEXT_LABELS = {"user": "Instruction", "assistant": "Answer", "system": "Note"}


def _context_turn(message: Message) -> str:
    return f"[{_CONTEXT_LABELS[message.role]}]\n{message.content}"
