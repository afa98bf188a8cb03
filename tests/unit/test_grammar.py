from __future__ import annotations

from conductor.planning.prompt import workflow_json_schema
from conductor.pool.config import PoolConfig
from conductor.pool.grammar import GRAMMAR_MAX_STRING_CHARS, grammar_schema


def _lengths(schema: object) -> list[int]:
    if isinstance(schema, dict):
        own = [schema["maxLength"]] if "maxLength" in schema else []
        return own + [n for v in schema.values() for n in _lengths(v)]
    if isinstance(schema, list):
        return [n for v in schema for n in _lengths(v)]
    return []


def test_the_workflow_schema_is_capped_for_llama_cpp_and_left_intact() -> None:
    pool = PoolConfig.model_validate({"agents": {"a": {"provider": "sim"}}})
    schema = workflow_json_schema(pool, 5, True)
    assert max(_lengths(schema)) > GRAMMAR_MAX_STRING_CHARS  # the planner schema's subtasks are long
    capped = grammar_schema(schema)
    assert _lengths(capped) and max(_lengths(capped)) == GRAMMAR_MAX_STRING_CHARS
    assert max(_lengths(schema)) > GRAMMAR_MAX_STRING_CHARS  # the input is not modified
    assert capped["properties"].keys() == schema["properties"].keys()
