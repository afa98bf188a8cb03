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
_THINK_LINE = re.compile(r"^[ \t]*<think>", re.M)
_THINK_END_LINE = re.compile(r"^[ \t]*</think>|</think>[ \t]*$", re.M)
_OBJECT_LINE = re.compile(r"^[ \t]*\{", re.M)
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
    body, unclosed = _strip_think(text)
    if not body.strip() and unclosed is None:
        raise PlannerFormatError(
            f"nothing follows the </think> block; give the workflow after it as {_expected()}"
        )
    try:
        # a workflow complete before a last <think> left open is the answer (the reasoning after it was
        # cut off); without one, the open block's text is read too (a model may answer inside it)
        lists = _find_lists(body, pool_names)
    except PlannerFormatError as exc:
        if unclosed is None:
            raise
        try:
            lists = _find_lists(body + unclosed, pool_names)
        except PlannerFormatError as inner:
            raise PlannerFormatError(
                "the <think> block is never closed and no complete workflow follows it "
                f"(was the answer cut off?): {inner}"
            ) from exc
    lengths = {name: len(lists[name]) for name in LIST_NAMES}
    if len(set(lengths.values())) != 1:
        detail = ", ".join(f"{name} has {n}" for name, n in lengths.items())
        raise PlannerFormatError(f"the three lists must have one entry per step, the same length ({detail})")
    lists["model_ids"] = _resolve_model_ids(lists["model_ids"], pool_names)
    return lists


def _expected() -> str:
    return "three lists: model_ids, subtasks and access_lists"


def _strip_think(text: str) -> tuple[str, str | None]:
    """The text without its reasoning blocks, and the text of a last block left open (None if none).

    A reasoning block is a ``<think>`` that opens a line (only white space before it on its line) up to
    its ``</think>``: dropped wherever it stands (a draft workflow inside one is not the answer), while a
    ``<think>`` inside a line -- a subtask about reasoning tags -- is text. Some chat templates put
    ``<think>`` into the prompt, so the answer starts inside the block and only the closing tag appears in
    the output: everything before a first ``</think>`` with no ``<think>`` before it is reasoning too.
    """
    ending = _THINK_END_LINE.search(text)  # a </think> alone at its line's start or end, as reasoning ends
    opening = _THINK_LINE.search(text)
    if ending is not None and (opening is None or opening.start() > ending.start()):
        text = text[ending.end() :]
    kept: list[str] = []
    i = 0
    for match in _THINK_LINE.finditer(text):
        if match.start() < i:
            continue  # inside a block already dropped
        kept.append(text[i : match.start()])
        close = text.find(_THINK_CLOSE, match.end())
        if close == -1:
            return "".join(kept), text[match.end() :]
        i = close + len(_THINK_CLOSE)
    kept.append(text[i:])
    return "".join(kept), None


def _find_lists(body: str, pool_names: list[str]) -> dict[str, list[Any]]:
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
        if name in found and _comparable(name, value, pool_names) != _comparable(name, found[name], pool_names):
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


def _comparable(name: str, value: list[Any], pool_names: list[str]) -> Any:
    """``model_ids`` as agent names (``[0, 1]`` and ``["gpt-5", "claude"]`` are the same list)."""
    if name != "model_ids":
        return value
    try:
        return _resolve_model_ids(value, pool_names)
    except PlannerFormatError:
        return value


def _json_workflow(body: str) -> dict[str, list[Any]] | None:
    """The last JSON object in ``body`` holding all three keys (values judged later) among those that open
    a line: an object inside a line is an example in prose or inside a subtask's string."""
    decoder = json.JSONDecoder(strict=False)
    last: dict[str, Any] | None = None
    for match in _OBJECT_LINE.finditer(body):
        try:
            value, _ = decoder.raw_decode(body, match.end() - 1)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict) and all(name in value for name in LIST_NAMES):
            last = value
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
