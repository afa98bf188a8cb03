"""An evaluation dataset: JSON Lines, one item per line (the format is documented in docs/eval.md).

Each item names how its answer is scored. The prompt a job receives is the question, the lettered
choices when there are any, and one line saying what form the answer should take.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ScorerName = Literal["exact", "choice", "numeric", "python_tests"]
SHIPPED_DATASET = Path(__file__).parent / "data" / "conductor-eval-v1.jsonl"
SHIPPED_NAME = "shipped"
"""``conductor eval shipped`` (and the sim provider's ``dataset: shipped``) mean the shipped file."""
MAX_ITEMS = 100_000
LETTERS = "ABCDEFGHIJ"
ANSWER_HINTS: dict[str, str] = {
    "exact": "End with a line of the form 'Answer: <your answer>'.",
    "choice": "End with a line of the form 'Answer: <letter>'.",
    "numeric": "End with a line of the form 'Answer: <number>'.",
    "python_tests": "Answer with the complete Python code in one ```python block.",
}


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and line."""


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=128)
    category: str = Field(min_length=1, max_length=64)
    question: str = Field(min_length=1, max_length=50_000)
    scorer: ScorerName
    answer: str | None = Field(default=None, max_length=10_000)
    """exact: the expected text; choice: the correct letter; numeric: the expected number."""
    choices: list[str] | None = Field(default=None, min_length=2, max_length=len(LETTERS))
    tolerance: float = Field(default=1e-6, ge=0)
    """numeric: the largest accepted absolute difference from ``answer``."""
    tests: str | None = Field(default=None, max_length=50_000)
    """python_tests: Python run after the answer's code (its main block left out); the item passes if they finish
    and the program exits 0."""
    entry_point: str | None = Field(default=None, max_length=128)
    """python_tests: the function the answer must define (picks the right code block)."""
    reference: str | None = Field(default=None, max_length=50_000)
    """A correct answer as a model would write it; the dataset's own tests check every reference scores."""
    timeout_s: float = Field(default=10.0, gt=0, le=300)

    @model_validator(mode="after")
    def _scorer_fields(self) -> Item:
        if self.scorer == "python_tests":
            if not self.tests:
                raise ValueError("scorer 'python_tests' needs 'tests'")
        elif self.answer is None:
            raise ValueError(f"scorer '{self.scorer}' needs 'answer'")
        if self.scorer == "choice":
            letter = (self.answer or "").strip().upper()
            count = len(self.choices) if self.choices else len(LETTERS)
            if len(letter) != 1 or letter not in LETTERS[:count]:
                raise ValueError(f"choice answer must be one letter of A-{LETTERS[count - 1]}, got {self.answer!r}")
        if self.scorer == "numeric":
            try:
                float(self.answer or "")
            except ValueError as exc:
                raise ValueError(f"numeric answer must be a number, got {self.answer!r}") from exc
        return self

    @property
    def prompt(self) -> str:
        """The task text a job receives."""
        parts = [self.question.strip()]
        if self.choices:
            parts.append("\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(self.choices)))
        parts.append(ANSWER_HINTS[self.scorer])
        return "\n\n".join(parts)


def resolve_dataset_path(name_or_path: str | Path) -> Path:
    return SHIPPED_DATASET if str(name_or_path) == SHIPPED_NAME else Path(name_or_path).expanduser()


def load_dataset(name_or_path: str | Path) -> list[Item]:
    """Every item of the file, validated; the first bad line (or a repeated id) is a DatasetError."""
    path = resolve_dataset_path(name_or_path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read dataset {path}: {exc.strerror or exc}") from exc
    return parse_items(lines, source=str(path))


def parse_items(lines: Iterable[str], *, source: str = "dataset") -> list[Item]:
    items: list[Item] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = Item.model_validate(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{source}:{number}: not JSON ({exc.msg})") from exc
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(item)'}: {e['msg']}" for e in exc.errors()
            )
            raise DatasetError(f"{source}:{number}: {problems}") from exc
        if item.id in seen:
            raise DatasetError(f"{source}:{number}: id '{item.id}' appears twice")
        seen.add(item.id)
        items.append(item)
        if len(items) > MAX_ITEMS:
            raise DatasetError(f"{source}: more than {MAX_ITEMS} items")
    if not items:
        raise DatasetError(f"{source}: no items")
    return items


def find_item(items: Iterable[Item], text: str) -> Item | None:
    """The item whose question occurs in ``text`` (the longest, when several do)."""
    found = [item for item in items if item.question.strip() in text]
    return max(found, key=lambda item: len(item.question), default=None)
