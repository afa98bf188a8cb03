"""JSON schemas as llama.cpp grammars: llama.cpp unrolls ``maxLength`` into nested optional rules, and
rejects the grammar of a string bounded much above ~1,000 characters (the process then crashes when
sampling), so schemas sent to it have every ``maxLength`` capped."""

from __future__ import annotations

from typing import Any

GRAMMAR_MAX_STRING_CHARS = 500


def grammar_schema(schema: Any, cap: int = GRAMMAR_MAX_STRING_CHARS) -> Any:
    """``schema`` with every ``maxLength`` capped at ``cap`` (a copy; the input is kept)."""
    if isinstance(schema, dict):
        out = {k: grammar_schema(v, cap) for k, v in schema.items()}
        if isinstance(out.get("maxLength"), int) and out["maxLength"] > cap:
            out["maxLength"] = cap
        return out
    if isinstance(schema, list):
        return [grammar_schema(v, cap) for v in schema]
    return schema
