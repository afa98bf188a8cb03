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
    """The text after the reasoning block, and whether that block was left open.

    Some chat templates put ``<think>`` into the prompt, so the answer starts inside the block and
    only the closing tag appears in the output.
    """
    stripped = text.lstrip()
    if stripped.startswith(_THINK_OPEN):
        close = stripped.find(_THINK_CLOSE)
        if close == -1:
            return stripped[len(_THINK_OPEN) :], True
        return stripped[close + len(_THINK_CLOSE) :], False
    close = text.find(_THINK_CLOSE)
    if close != -1 and _THINK_OPEN not in text[:close]:
        return text[close + len(_THINK_CLOSE) :], False
    return text, False


def _find_lists(body: str) -> dict[str, list[Any]]:
    """The first readable list after each name, skipping names that occur inside a list already read."""
    found: dict[str, list[Any]] = {}
    problems: dict[str, str] = {}
    taken: list[tuple[int, int]] = []
    for match in _LIST_NAME_RE.finditer(body):
        name, start = match.group(1), match.end()
        if name in found or any(lo <= match.start() < hi for lo, hi in taken):
            continue
        try:
            end = _list_end(body, start, name)
            found[name] = _read_literal(body[start:end], name)
        except PlannerFormatError as exc:
            problems.setdefault(name, str(exc))
            continue
        taken.append((start, end))
    missing = [name for name in LIST_NAMES if name not in found]
    if missing:
        reasons = [problems.get(name, f"no {name} list found") for name in missing]
        raise PlannerFormatError("; ".join(reasons) + f" (expected {_expected()})")
    return {name: found[name] for name in LIST_NAMES}


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
