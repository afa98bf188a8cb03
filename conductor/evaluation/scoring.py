"""Answer text -> correct or not, by the item's scorer.

Models wrap answers in prose, so each scorer first finds the answer: the text after the last
``Answer:`` (or ``final answer is``) marker when there is one, else the last non-empty line; for code,
the fenced Python block that defines the entry point.
"""

from __future__ import annotations

import math
import re
import secrets
from dataclasses import dataclass

from conductor.evaluation.dataset import LETTERS, Item
from conductor.evaluation.sandbox import run_python

_MARKER = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:)\s*", re.I)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
_ASIDE = re.compile(r"\([^()]*\)|\[[^\[\]]*\]")
_FRAC = re.compile(r"\\d?frac\s*\{\s*([-+]?\d+(?:\.\d+)?)\s*\}\s*\{\s*(\d+(?:\.\d+)?)\s*\}")
_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.S | re.I)
_OPEN_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*)\Z", re.S | re.I)
_LETTER_PATTERNS = (
    # {L}: the allowed letters, upper case only (a bare "a" or "I" is a word, not a choice); bracketed
    # letters ("(b)") and those after "option" may be lower case. In order: after "answer", after
    # "option"/"choice", alone on a line, opening a line ("B) Nitrogen"), in brackets anywhere.
    r"(?i:answer)\s*(?i:is|:)?\s*(?:[\(\[]\s*(?i:({L}))\s*[\)\]]|\**\s*({L})\b)",
    r"\b(?i:option|choice)\s*(?:[\(\[]\s*(?i:({L}))\s*[\)\]]|\**(?i:({L}))\b)",
    r"^\s*[\(\[*]*({L})[\)\].:*]*\s*$",
    r"^\s*[\(\[*]*({L})[\)\].:]",
    r"[\(\[](?i:({L}))[\)\]]",
)
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
    """The chosen letter: the answer's line first (where the prompt asks for ``Answer: <letter>``), then the
    whole text; the last match of the first pattern that matches, with only the item's letters allowed."""
    allowed = f"[{LETTERS[:choices]}]"
    patterns = [re.compile(p.replace("{L}", allowed), re.M) for p in _LETTER_PATTERNS]
    for where in (final_answer_span(text), text):
        for pattern in patterns:
            found = [next(g for g in m.groups() if g) for m in pattern.finditer(where)]
            if found:
                return found[-1].upper()
    span = final_answer_span(text)  # "Answer: I think it's B": the span's last capital letter that is a choice
    loose = re.findall(rf"\b({allowed})\b", span)
    return loose[-1] if loose else None


def _choice(item: Item, text: str) -> Score:
    got = extract_letter(text, len(item.choices) if item.choices else len(LETTERS))
    return Score(got == (item.answer or "").strip().upper(), got)


def extract_number(text: str) -> float | None:
    """The number the answer states (``1,234``, ``-3.5``, ``2e3``, ``3/4``, ``\\frac{3}{4}`` are read).

    After an ``Answer:`` marker: the first number of its line, leaving out parenthesized asides and
    anything before a last ``=`` (``Answer: 1081 (47 * 23)``, ``Answer: 91 cm^2``, ``answer is 47 * 23 =
    1081`` are 1081, 91, 1081); a marker stating no number is no answer. Without a marker: the same rule
    on the last line, else the text's last number."""
    markers = list(_MARKER.finditer(text))
    stated = _stated_number(final_answer_span(text))
    if stated is not None or markers:
        return stated
    found = _NUMBER.findall(_latex_plain(text))
    return _to_float(found[-1]) if found else None


def _stated_number(span: str) -> float | None:
    span = _latex_plain(span)
    outside = _ASIDE.sub(" ", span)
    if outside.strip(_STRIP_PUNCT + " "):  # an aside is read only when it is all there is: "Answer: (3/4)"
        span = outside
    found = _NUMBER.search(span.rsplit("=", 1)[-1])
    return _to_float(found.group(0)) if found else None


def _latex_plain(text: str) -> str:
    """``\\frac{a}{b}`` as ``a/b``; ``\\boxed{x}`` as ``x``."""
    return _BOXED.sub(r"\1", _FRAC.sub(r"\1/\2", text))


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


SOLUTION_FILE = "solution.py"


def tests_program(tests: str, done_marker: str) -> str:
    """The program that checks an answer: the answer's module is loaded under its own name -- its
    ``if __name__ == "__main__"`` block (its own ``unittest.main()``, ``sys.exit(main())``, an ``input()``
    demo) does not run -- then the item's tests run, then ``done_marker`` is printed. Exiting 0 without
    the marker (the answer calling ``sys.exit`` or ``os._exit`` while loading) is not a pass."""
    return (
        "import runpy as _runpy\n"
        f"globals().update({{k: v for k, v in _runpy.run_path({SOLUTION_FILE!r}, run_name='solution').items()"
        " if not k.startswith('__')})\n"
        f"# --- tests ---\n{tests}\n"
        f"print({done_marker!r})\n"
    )


def _python_tests(item: Item, text: str) -> Score:
    code = extract_code(text, item.entry_point)
    if not code.strip():
        return Score(False, None, "no code in the answer")
    marker = f"conductor-eval-tests-done-{secrets.token_hex(8)}"
    result = run_python(tests_program(item.tests or "", marker), timeout_s=item.timeout_s,
                        files={SOLUTION_FILE: code})
    if result.passed and marker in result.output:
        return Score(True, "code", "tests passed")
    why = ("timed out" if result.timed_out else f"exit {result.returncode}" if not result.passed
           else "exit 0 before the tests ran")
    return Score(False, "code", f"tests failed ({why}): {result.output.strip()[-300:]}")
