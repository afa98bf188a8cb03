"""Access list -> the exact messages a worker is sent.

Earlier steps reach a worker as prior conversation turns: each visible step's subtask as a user turn
and its answer as an assistant turn, then the worker's own subtask. The overall task goes in the
system message so every worker knows what the job is for, after the tenant's cache scope (``cache_scope``)
when there is one; nothing else is added.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from conductor.pool.base import Message

WORKER_SYSTEM = (
    "You are one worker in a multi-model workflow. Earlier workers' subtasks and answers that you may "
    "see appear as prior turns. Do only the subtask you are given, completely and concisely.\n\n"
    "{scope}The overall task:\n{task}"
)


def cache_scope(tenant: str) -> str:
    """The line a tenant's prompts carry ahead of the first text the tenant wrote (the task): providers cache
    prompt prefixes per account, and every tenant's calls go through the deployment's accounts, so without it
    a tenant whose prompt starts like another's (the same document) would read the other's cached prefix and
    see it in its usage (cached tokens) and timing: that someone sent it minutes ago. The text before it is
    the same for every tenant (still shared); everything after it is cached for this tenant alone. A hash, so
    the tenant's name is not sent to the provider; not secret: another tenant cannot put it in its prompts,
    which start with its own."""
    digest = hashlib.sha256(b"conductor-queue cache scope\0" + tenant.encode()).hexdigest()[:16]
    return f"[cache scope {digest}]\n"


def worker_messages(
    *,
    task: str,
    visible: Sequence[tuple[str, str]],
    instruction: str,
    inherited: Sequence[Message] = (),
    scope: str = "",
) -> list[Message]:
    """``visible`` is the (subtask, answer) of each step the access list grants, in step order.

    ``inherited`` is the context a recursive (child) job received from its parent step; ``scope`` the job's
    tenant's ``cache_scope`` (empty: none, ``prompt_cache_scope: shared``).
    """
    messages = [Message("system", WORKER_SYSTEM.format(task=task, scope=scope)), *inherited]
    for subtask, answer in visible:
        messages.append(Message("user", subtask))
        messages.append(Message("assistant", answer))
    messages.append(Message("user", instruction))
    return messages


MAX_CACHE_POINTS = 4
"""Anthropic's limit on prompt-cache breakpoints per request."""


class PlannedStep(NamedTuple):
    """What ``cache_points`` needs of each step of a job."""

    agent: str
    access_list: Sequence[int]
    reused: bool = False
    """A replay copied it from the original job: it does not run (its original ran, in that job)."""


def cache_points(index: int, workflow: Sequence[PlannedStep], *, inherited: int) -> tuple[int, ...]:
    """Where step ``index``'s messages (``worker_messages``) end a prefix another step of its job on the same
    agent sends too, and runs before or after it: the indices of those prefixes' last messages, ascending, at
    most ``MAX_CACHE_POINTS`` (the longest kept). ``workflow``: every step of the job, by index.

    Two steps' messages agree up to the system message, the ``inherited`` context and the turns of the steps
    their access lists (in step order) start with in common: after ``k`` such steps the prefix ends at message
    ``inherited + 2k`` (0 is the system message). A provider that caches prompt prefixes on request
    (Anthropic) is asked to cache exactly these: a step marks what it shares with a step before it (to read
    it; a step a replay reused ran in the original job, whose write may still be fresh) and with one after it
    (to write it for that one). Calls sent together read none of each other's writes, and a write costs
    more than plain input, so a prefix shared only with steps that may run at the same time (neither sees the
    other, even through other steps) is not marked, and a step does not write a prefix for a later step that
    a step running beside it writes too, or writes longer, for that one (of equal ones, the first by index
    writes)."""
    sent = [PlannedStep(step.agent, sorted(step.access_list), step.reused) for step in workflow]
    agent = sent[index].agent
    earlier = _ancestors(index, workflow)
    points: set[int] = set()
    for other, step in enumerate(sent):
        if other == index or step.agent != agent:
            continue
        shared = _shared(sent[index].access_list, step.access_list)
        if other in earlier:
            points.add(inherited + 2 * shared)  # it wrote this prefix before this step starts
        elif not step.reused and index in _ancestors(other, workflow) and not any(
                not beside.reused and beside.agent == agent and first != index and first not in earlier
                and index not in _ancestors(first, workflow) and first in _ancestors(other, workflow)
                and (longer := _shared(beside.access_list, step.access_list)) >= shared
                and (longer > shared or first < index)
                for first, beside in enumerate(sent)):
            points.add(inherited + 2 * shared)  # no step running beside this one writes it for that one
    return tuple(sorted(points)[-MAX_CACHE_POINTS:])


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many steps two sorted access lists start with in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _ancestors(index: int, workflow: Sequence[PlannedStep]) -> set[int]:
    """The steps that end before step ``index`` starts: those it sees, and those they see, transitively."""
    found: set[int] = set()
    todo = list(workflow[index].access_list)
    while todo:
        step = todo.pop()
        if step not in found and 0 <= step < len(workflow):
            found.add(step)
            todo.extend(workflow[step].access_list)
    return found


def turns_as_messages(turns: Sequence[tuple[str, str]]) -> list[Message]:
    out: list[Message] = []
    for subtask, answer in turns:
        out += [Message("user", subtask), Message("assistant", answer)]
    return out
