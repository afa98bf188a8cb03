"""Access list -> the exact messages a worker is sent.

Earlier steps reach a worker as prior conversation turns: each visible step's subtask as a user turn
and its answer as an assistant turn, then the worker's own subtask. The overall task goes in the
system message so every worker knows what the job is for; nothing else is added.
"""

from __future__ import annotations

from collections.abc import Sequence

from conductor.pool.base import Message

WORKER_SYSTEM = (
    "You are one worker in a multi-model workflow. Earlier workers' subtasks and answers that you may "
    "see appear as prior turns. Do only the subtask you are given, completely and concisely.\n\n"
    "The overall task:\n{task}"
)


def worker_messages(
    *,
    task: str,
    visible: Sequence[tuple[str, str]],
    instruction: str,
    inherited: Sequence[Message] = (),
) -> list[Message]:
    """``visible`` is the (subtask, answer) of each step the access list grants, in step order.

    ``inherited`` is the context a recursive (child) job received from its parent step.
    """
    messages = [Message("system", WORKER_SYSTEM.format(task=task)), *inherited]
    for subtask, answer in visible:
        messages.append(Message("user", subtask))
        messages.append(Message("assistant", answer))
    messages.append(Message("user", instruction))
    return messages


def turns_as_messages(turns: Sequence[tuple[str, str]]) -> list[Message]:
    out: list[Message] = []
    for subtask, answer in turns:
        out += [Message("user", subtask), Message("assistant", answer)]
    return out
