"""Workflows: the planner's output, validated, and the dependency graph it implies.

A workflow is a list of steps. Step ``i`` names an agent, gives it an instruction and an access list:
the earlier steps whose (instruction, output) pairs it sees. The access list is also the dependency
graph: step ``i`` may start once every step in its access list has finished, and the last step's
output is the answer.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

CONDUCTOR_AGENT = "conductor"
"""Reserved agent name: the planner itself, i.e. a recursive step that runs a child job."""

AccessList = list[int] | Literal["all"]


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent: str
    instruction: str
    access_list: AccessList = Field(default_factory=list)


class Workflow(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: list[Step]

    def resolved_access(self, index: int) -> list[int]:
        """The explicit, sorted indices step ``index`` may see (``"all"`` expanded)."""
        access = self.steps[index].access_list
        if access == "all":
            return list(range(index))
        return sorted(set(access))

    @property
    def dependencies(self) -> list[list[int]]:
        return [self.resolved_access(i) for i in range(len(self.steps))]

    def to_lists(self) -> dict[str, list[Any]]:
        """The paper's three-list form."""
        return {
            "model_ids": [s.agent for s in self.steps],
            "subtasks": [s.instruction for s in self.steps],
            "access_lists": [s.access_list for s in self.steps],
        }


@dataclass(frozen=True)
class FieldError:
    loc: tuple[str | int, ...]
    msg: str

    def as_dict(self) -> dict[str, Any]:
        return {"loc": list(self.loc), "msg": self.msg}

    def __str__(self) -> str:
        return f"{'.'.join(str(p) for p in self.loc)}: {self.msg}"


class WorkflowError(ValueError):
    """A workflow that cannot run; ``errors`` says exactly which field is wrong and why."""

    def __init__(self, errors: Sequence[FieldError]):
        self.errors = list(errors)
        super().__init__("; ".join(str(e) for e in self.errors))


def parse_workflow(
    raw: Mapping[str, Any],
    *,
    agents: Iterable[str],
    max_steps: int,
    max_instruction_chars: int = 20_000,
    allow_conductor: bool = True,
    loc: tuple[str | int, ...] = ("workflow",),
) -> Workflow:
    """Accepts the three-list form or ``{"steps": [...]}`` and returns a valid Workflow or raises.

    Every problem found is reported, each with its location, so the caller (a user or the planner
    being re-asked) can fix all of them at once.
    """
    steps_raw = _steps_from_raw(raw, loc)
    known = set(agents)
    if allow_conductor:
        known.add(CONDUCTOR_AGENT)
    errors: list[FieldError] = []
    if not steps_raw:
        raise WorkflowError([FieldError(loc, "a workflow needs at least one step")])
    if len(steps_raw) > max_steps:  # said at once: the steps of a list this long are not worth checking
        raise WorkflowError([FieldError(loc, f"{len(steps_raw)} steps given; at most {max_steps} are allowed")])
    steps: list[Step] = []
    for i, item in enumerate(steps_raw):
        step, step_errors = _check_step(i, item, known, max_instruction_chars, allow_conductor, loc)
        errors.extend(step_errors)
        if step is not None:
            steps.append(step)
    if errors:
        raise WorkflowError(capped(errors, loc))
    return Workflow(steps=steps)


MAX_REPORTED_ERRORS = 20
"""Problems one refusal lists; past that it says how many more there are (a body built to fail on every
item must not make an error the size of itself)."""


def capped(errors: Sequence[FieldError], loc: tuple[str | int, ...]) -> list[FieldError]:
    if len(errors) <= MAX_REPORTED_ERRORS:
        return list(errors)
    more = len(errors) - MAX_REPORTED_ERRORS
    return [*errors[:MAX_REPORTED_ERRORS], FieldError(loc, f"... and {more} more problems like these")]


def used_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Only the fields a workflow is read from (``steps``, else the three lists), with repeated access-list
    entries merged. For workflows stored before fields beside them and access lists longer than their
    step could list were refused: a job accepted then still plans as it would have."""
    if not isinstance(raw, Mapping):
        return raw
    if "steps" in raw:
        steps = raw["steps"]
        if isinstance(steps, list):
            steps = [{**st, "access_list": _merged(st["access_list"])}
                     if isinstance(st, Mapping) and "access_list" in st else st for st in steps]
        return {"steps": steps}
    used = {k: v for k, v in raw.items() if k in ("model_ids", "subtasks", "access_lists")}
    if isinstance(used.get("access_lists"), list):
        used["access_lists"] = [_merged(acc) for acc in used["access_lists"]]
    return used


def _merged(access: Any) -> Any:
    """An access list of step indices with repeats merged (as parsing merges them); anything else as is."""
    if isinstance(access, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in access):
        return sorted(set(access))
    return access


def _steps_from_raw(raw: Mapping[str, Any], loc: tuple[str | int, ...]) -> list[Any]:
    if not isinstance(raw, Mapping):
        raise WorkflowError([FieldError(loc, "must be an object with 'steps' or the three lists")])
    if "steps" in raw:
        if len(raw) > 1:
            extra = ", ".join(sorted(str(k)[:64] for k in raw if k != "steps")[:10])
            raise WorkflowError([FieldError(loc, f"unexpected fields beside 'steps': {extra}")])
        steps = raw["steps"]
        if not isinstance(steps, list):
            raise WorkflowError([FieldError((*loc, "steps"), "must be a list")])
        return steps
    names = ("model_ids", "subtasks", "access_lists")
    missing = [n for n in names if n not in raw]
    if missing:
        raise WorkflowError(
            [FieldError((*loc, n), "field required (give 'steps' or all three lists)") for n in missing]
        )
    if len(raw) > len(names):
        extra = ", ".join(sorted(str(k)[:64] for k in raw if k not in names)[:10])
        raise WorkflowError([FieldError(loc, f"unexpected fields beside the three lists: {extra}")])
    lists = [raw[n] for n in names]
    for n, value in zip(names, lists, strict=True):
        if not isinstance(value, list):
            raise WorkflowError([FieldError((*loc, n), "must be a list")])
    lengths = {n: len(v) for n, v in zip(names, lists, strict=True)}
    if len(set(lengths.values())) != 1:
        detail = ", ".join(f"{n} has {k}" for n, k in lengths.items())
        raise WorkflowError([FieldError(loc, f"the three lists must have the same length ({detail})")])
    return [
        {"agent": a, "instruction": s, "access_list": acc}
        for a, s, acc in zip(*lists, strict=True)
    ]


def _check_step(
    i: int,
    item: Any,
    known: set[str],
    max_chars: int,
    allow_conductor: bool,
    loc: tuple[str | int, ...],
) -> tuple[Step | None, list[FieldError]]:
    here = (*loc, "steps", i)
    if not isinstance(item, Mapping):
        return None, [FieldError(here, "must be an object with agent, instruction, access_list")]
    errors: list[FieldError] = []
    unexpected = set(item) - {"agent", "instruction", "access_list"}
    if unexpected:
        named = ", ".join(sorted(str(k)[:64] for k in unexpected)[:10])
        errors.append(FieldError(here, f"unexpected fields: {named}{' ...' if len(unexpected) > 10 else ''}"))
    agent = item.get("agent")
    if not isinstance(agent, str) or not agent:
        errors.append(FieldError((*here, "agent"), "must be a non-empty agent name"))
    elif agent not in known:
        if agent == CONDUCTOR_AGENT and not allow_conductor:
            msg = "the conductor may not call itself here: the recursion depth limit is reached"
        else:
            msg = f"unknown agent '{_shown(agent)}'; known agents: {', '.join(sorted(known))}"
        errors.append(FieldError((*here, "agent"), msg))
    instruction = item.get("instruction")
    if not isinstance(instruction, str) or _blank(instruction):
        errors.append(FieldError((*here, "instruction"), "must be a non-empty string (more than spaces and "
                                 "invisible characters)"))
    elif len(instruction) > max_chars:
        errors.append(FieldError((*here, "instruction"), f"{len(instruction)} characters; at most {max_chars}"))
    elif not _storable(instruction):
        # a planner's JSON escape (\u0000, half of a surrogate pair) decodes to what Postgres cannot store
        errors.append(FieldError((*here, "instruction"), "must not contain NUL characters or unpaired surrogates"))
    access, access_errors = _check_access(i, item.get("access_list", []), (*here, "access_list"))
    errors.extend(access_errors)
    if errors:
        return None, errors
    return Step(agent=str(agent), instruction=str(instruction), access_list=access), []


def _storable(text: str) -> bool:
    """Whether Postgres text can hold ``text``: no NUL, no unpaired surrogate."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _blank(text: str) -> bool:
    """Only white space and format characters (zero-width spaces and joiners, which ``str.strip`` keeps)."""
    return not "".join(ch for ch in text if unicodedata.category(ch) != "Cf").strip()


def _shown(value: str, limit: int = 64) -> str:
    """A value from the request, as quoted in a refusal: cut, so the refusal stays short."""
    return value if len(value) <= limit else value[:limit] + "..."


MAX_ACCESS_ENTRIES = 64
"""Entries an access list may have beyond its step's index (repeats are allowed and merged)."""


def _check_access(
    i: int, access: Any, loc: tuple[str | int, ...]
) -> tuple[AccessList, list[FieldError]]:
    if access == "all" or access == ["all"]:
        return "all", []
    if access is None:
        return [], []
    if not isinstance(access, list):
        return [], [FieldError(loc, 'must be a list of earlier step indices, [] or "all"')]
    if len(access) > max(i, MAX_ACCESS_ENTRIES):
        return [], [FieldError(loc, f"{len(access)} entries; step {i} has {i} earlier steps to list")]
    errors: list[FieldError] = []
    for k, ref in enumerate(access):
        if isinstance(ref, bool) or not isinstance(ref, int):
            errors.append(FieldError((*loc, k), f"{_shown(repr(ref))} is not a step index"))
        elif ref == i:
            errors.append(FieldError((*loc, k), f"step {i} cannot see itself"))
        elif ref > i:
            errors.append(FieldError((*loc, k), f"step {i} cannot see later step {ref} (forward reference)"))
        elif ref < 0:
            errors.append(FieldError((*loc, k), f"index {ref} is out of range (indices start at 0)"))
    return (sorted(set(access)) if not errors else []), errors


# --- the dependency graph -------------------------------------------------------------------------


def ready_steps(
    dependencies: Sequence[Sequence[int]], done: Iterable[int], started: Iterable[int]
) -> list[int]:
    """Steps not yet started whose every dependency is done: what the scheduler dispatches next.

    Dispatching exactly this set after each completion gives a makespan equal to the critical path:
    a step waits for its own dependencies and for nothing else.
    """
    done_set, started_set = set(done), set(started)
    return [
        i
        for i, deps in enumerate(dependencies)
        if i not in started_set and i not in done_set and all(d in done_set for d in deps)
    ]


def critical_path(dependencies: Sequence[Sequence[int]], durations: Sequence[float]) -> tuple[float, list[int]]:
    """Length and steps of the longest duration-weighted path: the best possible makespan."""
    finish: list[float] = []
    via: list[int | None] = []
    for i, deps in enumerate(dependencies):
        best = max(deps, key=lambda d: finish[d], default=None)
        finish.append(durations[i] + (finish[best] if best is not None else 0.0))
        via.append(best)
    if not finish:
        return 0.0, []
    last = max(range(len(finish)), key=lambda i: finish[i])
    length = finish[last]
    end: int | None = last
    path: list[int] = []
    while end is not None:
        path.append(end)
        end = via[end]
    return length, path[::-1]
