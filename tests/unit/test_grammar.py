from __future__ import annotations

import json

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
    variants = capped["anyOf"]
    assert len(variants) == 5
    for n, variant in enumerate(variants, start=1):
        assert variant["properties"].keys() == schema["properties"].keys()
        for name in ("model_ids", "subtasks", "access_lists"):
            assert variant["properties"][name]["minItems"] == variant["properties"][name]["maxItems"] == n


def test_a_real_llama_cpp_grammar_compiles_from_the_tied_schema() -> None:
    from llama_cpp import LlamaGrammar

    pool = PoolConfig.model_validate({"agents": {"a": {"provider": "sim"}, "b": {"provider": "sim"}}})
    grammar = LlamaGrammar.from_json_schema(json.dumps(grammar_schema(workflow_json_schema(pool, 5, True))))
    rules = grammar._grammar  # the GBNF llama.cpp compiled: one alternative per step count, each naming the keys
    assert all(f"alternative-{n - 1}-model-ids-kv" in rules for n in range(1, 6)) and "alternative-5" not in rules
    assert '\\"conductor\\"' in rules and '\\"a\\"' in rules  # the agent names are the only choices
    # step numbers are the only integers (llama-cpp-python's grammar ignores minimum/maximum: any integer)
    assert "integral-part" not in rules and 'access-lists-item-0-item ::= "0" | "1" | "2" | "3" | "4"' in rules


def test_other_schemas_are_only_capped() -> None:
    schema = {"type": "object", "properties": {"x": {"type": "string", "maxLength": 5000}}}
    assert grammar_schema(schema) == {"type": "object", "properties": {"x": {"type": "string", "maxLength": 500}}}
