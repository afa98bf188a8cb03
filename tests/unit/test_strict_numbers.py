"""Request bodies take JSON numbers and booleans as JSON has them: pydantic's lax mode read ``true`` as 1,
``"5"`` as 5 and ``"yes"`` as true, so a body its own OpenAPI schema calls invalid was accepted (202 for
``{"task": "t", "limits": {"max_steps": true}}``, found by tests/integration/test_schemathesis.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from conductor.openai_wire import ChatCompletionRequest, ResponseCreateRequest
from conductor.replay import ReplayRequest
from conductor.submission import JobCreate

CHAT = {"model": "conductor", "messages": [{"role": "user", "content": "x"}]}
RESPONSE = {"model": "conductor", "input": "x"}
# (model, a valid body, the path to a field, the field's kind)
FIELDS: list[tuple[type[BaseModel], dict[str, Any], tuple[str, ...], str]] = [
    (JobCreate, {"task": "t"}, ("limits", "max_steps"), "int"),
    (JobCreate, {"task": "t"}, ("limits", "max_depth"), "int"),
    (JobCreate, {"task": "t"}, ("limits", "max_tokens"), "int"),
    (JobCreate, {"task": "t"}, ("limits", "max_answer_tokens"), "int"),
    (JobCreate, {"task": "t"}, ("limits", "max_cost_usd"), "float"),
    (JobCreate, {"task": "t"}, ("limits", "deadline_s"), "float"),
    (ReplayRequest, {}, ("from_step",), "int"),
    (ReplayRequest, {}, ("replan",), "bool"),
    (ChatCompletionRequest, CHAT, ("max_tokens",), "int"),
    (ChatCompletionRequest, CHAT, ("max_completion_tokens",), "int"),
    (ChatCompletionRequest, CHAT, ("seed",), "int"),
    (ChatCompletionRequest, CHAT, ("temperature",), "float"),
    (ChatCompletionRequest, CHAT, ("stream",), "bool"),
    (ChatCompletionRequest, CHAT, ("stream_options", "include_usage"), "bool"),
    (ResponseCreateRequest, RESPONSE, ("max_output_tokens",), "int"),
    (ResponseCreateRequest, RESPONSE, ("top_p",), "float"),
    (ResponseCreateRequest, RESPONSE, ("background",), "bool"),
    (ResponseCreateRequest, RESPONSE, ("store",), "bool"),
]
REFUSED = {"int": [True, "1", 1.5], "float": [True, "1"], "bool": [1, "true", "yes"]}
TAKEN = {"int": [1, None], "float": [1, 0.5, None], "bool": [True, False, None]}


def _body(base: dict[str, Any], path: tuple[str, ...], value: Any) -> str:
    body = json.loads(json.dumps(base))
    *parents, name = path
    at = body
    for key in parents:
        at = at.setdefault(key, {})
    at[name] = value
    return json.dumps(body)


@pytest.mark.parametrize(("model", "base", "path", "kind"), FIELDS, ids=lambda v: ".".join(v) if isinstance(v, tuple)
                         else getattr(v, "__name__", None))
def test_a_number_or_boolean_is_taken_only_as_json_writes_one(model: type[BaseModel], base: dict[str, Any],
                                                               path: tuple[str, ...], kind: str) -> None:
    taken = [True, False] if path == ("replan",) else TAKEN[kind]  # (replan is not nullable)
    for value in REFUSED[kind]:
        with pytest.raises(ValidationError) as refused:
            model.model_validate_json(_body(base, path, value))
        assert refused.value.errors()[0]["loc"][:len(path)] == path, (value, refused.value.errors())
    for value in taken:
        model.model_validate_json(_body(base, path, value))
        model.model_validate(json.loads(_body(base, path, value)))  # (a batch line's body: parsed JSON)
