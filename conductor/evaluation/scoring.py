"""Answer text -> correct or not, by the item's scorer.

Models wrap answers in prose, so each scorer first finds the answer: the text after the last
``Answer:`` (or ``final answer is``) marker when there is one, else the last non-empty line; for code,
the fenced Python block that defines the entry point.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from conductor.evaluation.dataset import LETTERS, Item
from conductor.evaluation.sandbox import run_python

_MARKER = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:)\s*", re.I)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*)\Z", re.S | re.I)
_EXPLICIT_LETTER = [
    re.compile(r"answer\s*(?:is|:)?\s*[\(\[*]*\s*([A-J])\b", re.I),
    re.compile(r"\b(?:option|choice)\s*[\(\[*]*([A-J])\b", re.I),
    re.compile(r"^\s*[\(\[*]*([A-J])[\)\].:*]*\s*$", re.M),
    re.compile(r"^\s*[\(\[*]*([A-J])[\)\].:]", re.M),
]
_STRIP_PUNCT = " \t\n.,;:!?\"'`*"


@dataclass(frozen=True)
class Score:
    correct: bool
    extracted: str | None
    """What the scorer read as the answer (None: nothing recognisable)."""
    detail: str = ""


def score(item: Item, answer: str | None) -> Score:
    text = answer or ""
    if item.scorer == "exact":
        return _exact(item, text)
    if item.scorer == "choice":
        return _choice(item, text)
    if item.scorer == "numeric":
        return _numeric(item, text)
    return _python_tests(item, text)


def final_answer_span(text: str) -> str:
    """The part of ``text`` that states the answer."""
    markers = list(_MARKER.finditer(text))
    if markers:
        tail = text[markers[-1].end() :].strip()
        if tail:
            return tail.splitlines()[0]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalize(text: str) -> str:
    return " ".join(text.strip(_STRIP_PUNCT).lower().split())


def _exact(item: Item, text: str) -> Score:
    got = normalize(final_answer_span(text))
    return Score(got == normalize(item.answer or ""), got or None)


def extract_letter(text: str, choices: int = len(LETTERS)) -> str | None:
    allowed = LETTERS[:choices]
    for pattern in _EXPLICIT_LETTER:
        found = [m.group(1).upper() for m in pattern.finditer(text) if m.group(1).upper() in allowed]
        if found:
            return found[-1]
    return None


def _choice(item: Item, text: str) -> Score:
    got = extract_letter(text, len(item.choices) if item.choices else len(LETTERS))
    return Score(got == (item.answer or "").strip().upper(), got)


def extract_number(text: str) -> float | None:
    """The last number in the answer span (``1,234``, ``-3.5``, ``2e3``, ``3/4`` are read)."""
    for span in (final_answer_span(text), text):
        found = _NUMBER.findall(span)
        if found:
            return _to_float(found[-1])
    return None


def _to_float(token: str) -> float | None:
    token = token.replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            top, bottom = token.split("/")
            return float(top) / float(bottom) if float(bottom) else None
        return float(token)
    except ValueError:
        return None


def _numeric(item: Item, text: str) -> Score:
    got = extract_number(text)
    expected = float(item.answer or "nan")
    if got is None:
        return Score(False, None)
    ok = math.isclose(got, expected, rel_tol=0.0, abs_tol=item.tolerance)
    return Score(ok, f"{got:g}")


def extract_code(text: str, entry_point: str | None = None) -> str:
    """The answer's Python: the last fenced block defining ``entry_point`` (else every block joined,
    else an unclosed block, else the whole text)."""
    blocks = _FENCE.findall(text)
    if not blocks:
        opened = _OPEN_FENCE.search(text)
        return opened.group(1) if opened else text
    if entry_point:
        defining = [b for b in blocks if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", b)]
        if defining:
            return str(defining[-1])
    return "\n\n".join(blocks)


def _python_tests(item: Item, text: str) -> Score:
    code = extract_code(text, item.entry_point)
    if not code.strip():
        return Score(False, None, "no code in the answer")
    result = run_python(f"{code}\n\n# --- tests ---\n{item.tests}\n", timeout_s=item.timeout_s)
    if result.passed:
        return Score(True, "code", "tests passed")
    why = "timed out" if result.timed_out else f"exit {result.returncode}"
    return Score(False, "code", f"tests failed ({why}): {result.output.strip()[-300:]}")
