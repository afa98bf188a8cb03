"""Planner model text -> the raw three-list dict that ``parse_workflow`` validates.

Accepted shapes, as planner models actually write them:

- the research model's three Python lists, ``model_ids = [2, 0]`` / ``subtasks = [...]`` /
  ``access_lists = [[], "all"]``, optionally after a ``<think>...</think>`` block;
- a JSON object with the three keys, bare or inside a code fence, with or without prose around it.

Each list is located by its name followed by ``=`` or ``:``, cut out as a balanced bracket span
(brackets inside string literals do not count) and read with ``json.loads`` or, for Python's
single-quoted strings, ``ast.literal_eval``; nothing is ever executed. ``model_ids`` may hold agent
names or 0-based indices into the numbered worker list of the prompt (``pool_names`` order). The
conductor itself is not numbered: a recursive step names it ``"conductor"``.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

LIST_NAMES = ("model_ids", "subtasks", "access_lists")
_LIST_NAME_RE = re.compile(r"""(?<![\w])["']?(model_ids|subtasks|access_lists)["']?\s*[:=]\s*""")
_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_QUOTES = ("'", '"')
_PREVIEW_CHARS = 40
_LITERAL_RULE = "only quoted strings, numbers and lists are allowed"


class PlannerFormatError(ValueError):
    """The planner's text holds no readable workflow; the message says what is wrong with it."""


def parse_planner_output(text: str, pool_names: list[str]) -> dict[str, list[Any]]:
    """The three lists, of equal length, with integer ``model_ids`` turned into agent names."""
    if not text or not text.strip():
        raise PlannerFormatError(f"the answer is empty; expected the workflow as {_expected()}")
    body, think_unclosed = _strip_think(text)
    if not body.strip() and not think_unclosed:
        raise PlannerFormatError(
            f"nothing follows the </think> block; give the workflow after it as {_expected()}"
        )
    try:
        lists = _find_lists(body)
    except PlannerFormatError as exc:
        if think_unclosed:
            raise PlannerFormatError(
                "the <think> block is never closed and no complete workflow follows it "
                f"(was the answer cut off?): {exc}"
            ) from exc
        raise
    lengths = {name: len(lists[name]) for name in LIST_NAMES}
    if len(set(lengths.values())) != 1:
        detail = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise PlannerFormatError(f"the three lists must have one entry per step, the same length ({detail})")
    lists["model_ids"] = _resolve_model_ids(lists["model_ids"], pool_names)
    return lists


def _expected() -> str:
    return "three lists: model_ids, subtasks and access_lists"


def _strip_think(text: str) -> tuple[str, bool]:
    """The text without its reasoning blocks, and whether the last one was left open.

    Every ``<think>…</think>`` block is dropped wherever it stands (a draft workflow inside one is not the
    answer). Some chat templates put ``<think>`` into the prompt, so the answer starts inside the block and
    only the closing tag appears in the output: everything before a first ``</think>`` that has no
    ``<think>`` before it is reasoning too. A block left open keeps its text (a model that never closes
    it may still have written its answer there); the caller says so if nothing readable is found.
    """
    close = text.find(_THINK_CLOSE)
    opening = text.find(_THINK_OPEN)
    if close != -1 and (opening == -1 or opening > close):
        text = text[close + len(_THINK_CLOSE) :]
    kept: list[str] = []
    i = 0
    while True:
        opening = text.find(_THINK_OPEN, i)
        if opening == -1:
            kept.append(text[i:])
            return "".join(kept), False
        kept.append(text[i:opening])
        close = text.find(_THINK_CLOSE, opening)
        if close == -1:
            return "".join(kept) + text[opening + len(_THINK_OPEN) :], True
        i = close + len(_THINK_CLOSE)


def _find_lists(body: str) -> dict[str, list[Any]]:
    """The three lists from one place: the last JSON object in ``body`` holding all three keys; else each
    name followed by ``=`` or ``:`` and a list (the research model's Python lists), skipping names inside a
    list already read. A name's first list must be readable, and a later different list of the same name
    is refused: a workflow is never pieced together from a draft and prose."""
    whole = _json_workflow(body)
    if whole is not None:
        return whole
    found: dict[str, list[Any]] = {}
    problems: dict[str, str] = {}
    taken: list[tuple[int, int]] = []
    for match in _LIST_NAME_RE.finditer(body):
        name, start = match.group(1), match.end()
        if any(lo <= match.start() < hi for lo, hi in taken):
            continue
        try:
            end = _list_end(body, start, name)
            value = _read_literal(body[start:end], name)
        except PlannerFormatError as exc:
            if name not in found:
                problems.setdefault(name, str(exc))
            continue
        taken.append((start, end))
        if name in problems:
            continue  # its first list was unreadable: that is what the model is told to fix
        if name in found and value != found[name]:
            raise PlannerFormatError(
                f"{name} is given twice, differently ({_preview(repr(found[name]))} and {_preview(repr(value))});"
                " give exactly one workflow"
            )
        found.setdefault(name, value)
    missing = [name for name in LIST_NAMES if name not in found or name in problems]
    if missing:
        reasons = [problems.get(name, f"no {name} list found") for name in missing]
        raise PlannerFormatError("; ".join(reasons) + f" (expected {_expected()})")
    return {name: found[name] for name in LIST_NAMES}


def _json_workflow(body: str) -> dict[str, list[Any]] | None:
    """The last JSON object in ``body`` whose three keys are all present (values judged later)."""
    decoder = json.JSONDecoder(strict=False)
    last: dict[str, Any] | None = None
    i = body.find("{")
    while i != -1:
        try:
            value, end = decoder.raw_decode(body, i)
        except (ValueError, RecursionError):
            i = body.find("{", i + 1)
            continue
        if isinstance(value, dict) and all(name in value for name in LIST_NAMES):
            last = value
            i = body.find("{", end)
        else:
            i = body.find("{", i + 1)
    if last is None:
        return None
    for name in LIST_NAMES:
        if not isinstance(last[name], list):
            raise PlannerFormatError(f"{name} is not a list (found {_preview(json.dumps(last[name]))!r})")
    return {name: last[name] for name in LIST_NAMES}


def _list_end(text: str, start: int, name: str) -> int:
    """Index just past the bracket that closes the list opening at ``start``."""
    if start >= len(text) or text[start] != "[":
        found = text[start:].split("\n", 1)[0]
        raise PlannerFormatError(f"{name} is not a list (found {_preview(found)!r})")
    depth = 0
    i = start
    while i < len(text):
        char = text[i]
        if char in _QUOTES:
            i = _string_end(text, i, name)
            continue
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise PlannerFormatError(
        f"the {name} list starting {_preview(text[start:])!r} is never closed (unbalanced brackets)"
    )


def _string_end(text: str, start: int, name: str) -> int:
    """Index just past the string literal opening at ``start`` (single, double or triple quoted)."""
    quote = text[start] * 3 if text.startswith(text[start] * 3, start) else text[start]
    i = start + len(quote)
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text.startswith(quote, i):
            return i + len(quote)
        else:
            i += 1
    raise PlannerFormatError(f"a string in the {name} list is never closed: {_preview(text[start:])!r}")


def _read_literal(span: str, name: str) -> list[Any]:
    """``span`` is a balanced ``[...]``, so whatever reads it is a list."""
    try:
        value: list[Any] = json.loads(span, strict=False)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(span)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
            # literal_eval's own ValueError text names AST nodes; say what the model can fix instead.
            reason = exc.msg if isinstance(exc, SyntaxError) else _LITERAL_RULE
            raise PlannerFormatError(
                f"{name} is not a valid list literal ({reason}): {_preview(span)!r}"
            ) from exc
    return value


def _resolve_model_ids(model_ids: list[Any], pool_names: list[str]) -> list[Any]:
    """Integer ids become agent names; anything else is left for ``parse_workflow`` to judge."""
    resolved: list[Any] = []
    for i, model_id in enumerate(model_ids):
        if isinstance(model_id, int) and not isinstance(model_id, bool):
            if not 0 <= model_id < len(pool_names):
                raise PlannerFormatError(
                    f"model_ids[{i}] is {model_id}, but the workers are numbered 0 to {len(pool_names) - 1}"
                    ' (the conductor itself is named "conductor", not numbered)'
                )
            resolved.append(pool_names[model_id])
        else:
            resolved.append(model_id)
    return resolved


def _preview(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _PREVIEW_CHARS else flat[:_PREVIEW_CHARS] + "…"
