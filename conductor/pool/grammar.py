"""JSON schemas as llama.cpp grammars.

- llama.cpp unrolls ``maxLength`` into nested optional rules and rejects the grammar of a string bounded
  much above ~1,000 characters (the process then crashes when sampling): every ``maxLength`` is capped.
- A grammar can do what a JSON schema cannot say: that the workflow's three parallel lists have one
  length. The workflow schema becomes ``anyOf`` one variant per step count, so even a tiny model under
  the grammar cannot emit lists of different lengths (the most common invalid plan seen from it).
"""

from __future__ import annotations

import copy
from typing import Any

GRAMMAR_MAX_STRING_CHARS = 500


PARALLEL_LISTS = ("model_ids", "subtasks", "access_lists")


MAX_ENUMERATED_INTEGERS = 64


def grammar_schema(schema: Any, cap: int = GRAMMAR_MAX_STRING_CHARS) -> Any:
    """``schema`` ready for llama.cpp: lengths capped, small integer ranges enumerated, the workflow's lists
    tied (a copy)."""
    return tie_parallel_lists(enumerate_integers(cap_lengths(schema, cap)))


def enumerate_integers(schema: Any) -> Any:
    """Every integer with a small ``minimum``..``maximum`` range as an ``enum`` of its values (a copy):
    llama-cpp-python's grammar ignores the bounds and admits any integer up to 16 digits, so a plan under
    it could name step -1 or 99 (and cost a re-ask)."""
    if isinstance(schema, dict):
        out = {k: enumerate_integers(v) for k, v in schema.items()}
        low, high = out.get("minimum"), out.get("maximum")
        if (out.get("type") == "integer" and isinstance(low, int) and isinstance(high, int)
                and 0 <= high - low < MAX_ENUMERATED_INTEGERS):
            return {"enum": list(range(low, high + 1))}
        return out
    if isinstance(schema, list):
        return [enumerate_integers(v) for v in schema]
    return schema


def tie_parallel_lists(schema: Any) -> Any:
    """The workflow schema as ``anyOf`` one variant per length n, each list holding exactly n items."""
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    if not all(isinstance(props.get(k), dict) and "maxItems" in props[k] for k in PARALLEL_LISTS):
        return schema
    variants = []
    for n in range(1, min(props[k]["maxItems"] for k in PARALLEL_LISTS) + 1):
        variant = copy.deepcopy(schema)
        for k in PARALLEL_LISTS:
            variant["properties"][k]["minItems"] = variant["properties"][k]["maxItems"] = n
        variants.append(variant)
    return {"anyOf": variants}


def cap_lengths(schema: Any, cap: int = GRAMMAR_MAX_STRING_CHARS) -> Any:
    """``schema`` with every ``maxLength`` capped at ``cap`` (a copy; the input is kept)."""
    if isinstance(schema, dict):
        out = {k: cap_lengths(v, cap) for k, v in schema.items()}
        if isinstance(out.get("maxLength"), int) and out["maxLength"] > cap:
            out["maxLength"] = cap
        return out
    if isinstance(schema, list):
        return [cap_lengths(v, cap) for v in schema]
    return schema
