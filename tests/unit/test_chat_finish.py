"""A chat completion's finish_reason says why its answer ended, in the words the official clients know; its
usage, with the cached and reasoning details, is what the official client reads."""

from __future__ import annotations

import json
import typing
from datetime import UTC, datetime

import openai.types.chat.chat_completion as wire
import pytest

from conductor.chat import completion, finish_reason
from conductor.store.models import Job


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


def test_the_usage_details_are_what_the_openai_sdk_reads() -> None:
    job = Job.model_construct(id="0" * 32, status="succeeded", created_at=datetime(2026, 11, 28, tzinfo=UTC),
                              finished_at=datetime(2026, 11, 28, 0, 1, tzinfo=UTC), answer="42", input_tokens=1200,
                              output_tokens=300, cost_usd=0.01, calls=3, cached_input_tokens=900, reasoning_tokens=120)
    body = json.loads(completion(job, "conductor", "stop").model_dump_json())
    parsed = wire.ChatCompletion.model_validate(body)  # strictly, not the client's lenient construction
    assert parsed.usage is not None
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens, parsed.usage.total_tokens) == (1200, 300, 1500)
    assert parsed.usage.prompt_tokens_details is not None and parsed.usage.completion_tokens_details is not None
    assert parsed.usage.prompt_tokens_details.cached_tokens == 900
    assert parsed.usage.completion_tokens_details.reasoning_tokens == 120
