"""Answer text -> correct or not, by the item's scorer.

Models wrap answers in prose, so each scorer first finds the answer: the text after the last
``Answer:`` (or ``final answer is``) marker when there is one, else the last non-empty line; for code,
the fenced Python block that defines the entry point.
"""

from __future__ import annotations

import ast
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
_DECORATION = " \t*_#$`\\[]{}"
_EXPONENT = re.compile(r"\^\s*\{?\s*[-+]?\d+\s*\}?|(?<=[A-DF-Za-df-z])\d+\b|[²³¹⁰⁴-⁹]+")
"""Digits that are a unit's exponent, not the answer: ``cm^2``, ``m^{3}``, ``cm2``, ``m²`` (not the
``e3`` of ``2.5e3``)."""
_SPAN_LETTER = r"^[\s*_(\[]*({L})(?:[)\].:,;!*_]|\s|$)"
_ANSWER_LETTER = r"(?i:answer)\s*(?i:is|:)?\s*(?:[\(\[]\s*(?i:({L}))\s*[\)\]]|\**\s*({L})\b)"
_LETTER_PATTERNS = (
    # {L}: the allowed letters, upper case only (a bare "a" or "I" is a word, not a choice); bracketed
    # letters ("(b)") and those after "option" may be lower case. In order: after "option"/"choice",
    # alone on a line, opening a line ("B) Nitrogen"), in brackets anywhere.
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
    """The part of ``text`` that states the answer: after the last ``Answer:`` / ``answer is`` / ``final
    answer is`` marker, its first line with more than decoration (``**Answer:**`` then ``1081`` on a line
    below is 1081); without a marker, the last non-empty line."""
    markers = list(_MARKER.finditer(text))
    if markers:
        for line in text[markers[-1].end() :].splitlines():
            if line.strip(_DECORATION):
                return line.strip()
    lines = [line for line in text.splitlines() if line.strip(_DECORATION)]
    return lines[-1].strip() if lines else ""


def normalize(text: str) -> str:
    return " ".join(text.strip(_STRIP_PUNCT).lower().split())


def _exact(item: Item, text: str) -> Score:
    got = normalize(final_answer_span(text))
    return Score(got == normalize(item.answer or ""), got or None)


def extract_letter(text: str, choices: int = len(LETTERS)) -> str | None:
    """The chosen letter, with only the item's letters allowed: the letter opening the answer's span
    (``Answer: B, not option C`` is B; a lone lower-case ``b.`` too); else the last ``answer is X`` in the
    text; else, on the span and then the whole text, ``option X``, a letter alone on a line, one opening a
    line, one in brackets (the last match of the first pattern that matches); else the span's last capital
    choice letter (``Answer: I think it's B``)."""
    allowed = f"[{LETTERS[:choices]}]"
    span = final_answer_span(text)
    opening = re.match(_SPAN_LETTER.replace("{L}", allowed), span)
    if opening is None and len(span.strip(_STRIP_PUNCT + "()[]")) == 1:
        opening = re.match(_SPAN_LETTER.replace("{L}", allowed), span.upper())
    if opening:
        return opening.group(1).upper()
    stated = [next(g for g in m.groups() if g) for m in re.finditer(_ANSWER_LETTER.replace("{L}", allowed), text)]
    if stated:
        return stated[-1].upper()
    patterns = [re.compile(p.replace("{L}", allowed), re.M) for p in _LETTER_PATTERNS]
    for where in (span, text):
        for pattern in patterns:
            found = [next(g for g in m.groups() if g) for m in pattern.finditer(where)]
            if found:
                return found[-1].upper()
    loose = re.findall(rf"\b({allowed})\b", span)
    return loose[-1] if loose else None


def _choice(item: Item, text: str) -> Score:
    got = extract_letter(text, len(item.choices) if item.choices else len(LETTERS))
    return Score(got == (item.answer or "").strip().upper(), got)


def extract_number(text: str) -> float | None:
    """The number the answer states: ``1,234``, ``-3.5``, ``2e3``, ``3/4`` and ``\\frac{3}{4}`` are read.

    - The last ``\\boxed{…}`` holding a number, where there is one (how math models mark their answer).
    - Else the last number of the answer's span (``final_answer_span``), leaving out parenthesized asides
      and the exponents of units: ``1081 (47 * 23)``, ``91 cm^2``, ``15% of 360 is 54`` are 1081, 91, 54.
    - An ``Answer:`` line that states no number is no answer ("Answer: I cannot tell (maybe 1?)"): the
      reasoning's numbers do not stand in for it. After a marker in prose ("the answer is simple: …"),
      and without any marker, the text's last number is taken instead."""
    plain = _latex_plain(text, boxed=False)
    boxed = [n for n in (_number_in(b) for b in _BOXED.findall(plain)) if n is not None]
    if boxed:
        return boxed[-1]
    span = final_answer_span(plain)
    stated = _number_in(span)
    if stated is not None:
        return stated
    markers = list(_MARKER.finditer(plain))
    if markers and span:
        line_start = plain.rfind("\n", 0, markers[-1].start()) + 1
        if not re.search(r"\w", plain[line_start : markers[-1].start()]):  # an answer line, not prose
            return None
    found = _NUMBER.findall(_EXPONENT.sub(" ", plain))
    return _to_float(found[-1]) if found else None


def _number_in(span: str) -> float | None:
    """The last number of ``span`` outside its asides (inside them when that is all there is: ``(3/4)``)."""
    span = _EXPONENT.sub(" ", span)
    outside = span
    while True:  # innermost first: "5050 (n(n+1)/2 with n = 100)"
        shorter = _ASIDE.sub(" ", outside)
        if shorter == outside:
            break
        outside = shorter
    if not re.search(r"\w", outside):
        outside = span  # "(3/4)": the aside is the answer
    found = _NUMBER.findall(outside)
    return _to_float(found[-1]) if found else None


def _latex_plain(text: str, *, boxed: bool = True) -> str:
    """``\\frac{a}{b}`` as ``a/b``; with ``boxed``, ``\\boxed{x}`` as ``x``."""
    text = _FRAC.sub(r"\1/\2", text)
    return _BOXED.sub(r"\1", text) if boxed else text


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


def without_main_block(code: str) -> str:
    """``code`` without its top-level ``if __name__ == "__main__":`` blocks (an answer's own tests, a
    demo reading ``input()``, ``sys.exit(main())``), every other line as written. Code that does not
    parse is returned as it is (running it reports the syntax error)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code
    drop: set[int] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_check(node.test) and node.end_lineno is not None:
            drop.update(range(node.lineno, node.end_lineno + 1))
    if not drop:
        return code
    return "".join(line for n, line in enumerate(code.splitlines(keepends=True), start=1) if n not in drop)


def _is_main_check(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def tests_program(code: str, tests: str, done_marker: str) -> str:
    """The program that checks an answer, run as ``__main__`` (so ``doctest.testmod()`` and
    ``unittest.main()`` in an item's tests see the answer): the answer without its main block, then the
    item's tests, then ``done_marker`` printed. The tests ending the program themselves with exit code
    0 (``unittest.main()``) count as finished; the answer exiting 0 while it loads (before the tests run)
    prints no marker and is not a pass."""
    return (
        f"{without_main_block(code)}\n\n"
        "# --- tests ---\n"
        "try:\n"
        f"    exec(compile({tests!r}, '<tests>', 'exec'))\n"
        "except SystemExit as _tests_exit:\n"
        "    if _tests_exit.code not in (0, None):\n"
        "        raise\n"
        f"print({done_marker!r})\n"
    )


def _python_tests(item: Item, text: str) -> Score:
    code = extract_code(text, item.entry_point)
    if not code.strip():
        return Score(False, None, "no code in the answer")
    marker = f"conductor-eval-tests-done-{secrets.token_hex(8)}"
    result = run_python(tests_program(code, item.tests or "", marker), timeout_s=item.timeout_s)
    if result.passed and marker in result.output:
        return Score(True, "code", "tests passed")
    why = ("timed out" if result.timed_out else f"exit {result.returncode}" if not result.passed
           else "exit 0 before the tests ran")
    return Score(False, "code", f"tests failed ({why}): {result.output.strip()[-300:]}")
