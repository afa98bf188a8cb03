"""A chat completion's finish_reason says why its answer ended, in the words the official clients know."""

from __future__ import annotations

import typing

import openai.types.chat.chat_completion as wire
import pytest

from conductor.chat import finish_reason


@pytest.mark.parametrize(
    ("step_reason", "expected"),
    [("stop", "stop"), ("length", "length"), ("content_filter", "content_filter"), ("tool_calls", "stop"),
     ("child_succeeded", "stop"), (None, "stop"), ("unknown", "stop")],
)
def test_the_answering_steps_reason_becomes_the_completions(step_reason: str | None, expected: str) -> None:
    assert finish_reason(step_reason) == expected


def test_every_reason_we_send_is_one_the_openai_sdk_models() -> None:
    sdk = set(typing.get_args(wire.Choice.model_fields["finish_reason"].annotation))
    assert {finish_reason(r) for r in ("stop", "length", "content_filter")} <= sdk
