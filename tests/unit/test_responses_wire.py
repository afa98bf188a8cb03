"""A job as OpenAI's Responses API tells it: the response object and the stream events validate against the
installed ``openai`` SDK's own models (strictly: ``model_validate``, not the lenient construction the client
uses), for every status a job can be in; and the request takes the input shapes the SDK sends."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai.types.responses as sdk
import pytest
from openai import omit
from pydantic import ValidationError

from conductor.openai_wire import ResponseCreateRequest
from conductor.responses import input_items, response_job, response_object
from conductor.service.routes.openai_responses import ResponseEvents, _progress
from conductor.settings import Settings
from conductor.store.models import Job, OpenAIResponse
from tests.response_cases import check_the_lean_read_is_the_whole_rows
from tests.sqlite_store import sqlite_store

T0 = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)
T1 = datetime(2026, 11, 25, 9, 1, tzinfo=UTC)


def _job(status: str, **fields: Any) -> Job:
    ended = status in ("succeeded", "failed", "cancelled")
    base: dict[str, Any] = dict(id="0" * 32, status=status, created_at=T0, finished_at=T1 if ended else None,
                                answer="42" if status == "succeeded" else None, error_type=None, error_message=None,
                                input_tokens=10, output_tokens=5, cost_usd=0.001, calls=2, cached_input_tokens=6,
                                reasoning_tokens=3, task="What is 6 x 7?",
                                context=[{"role": "system", "content": "Be brief."}], meta={"team": "x"})
    return Job.model_construct(**{**base, **fields})


ROW = OpenAIResponse(job_id="0" * 32, model="conductor", background=True, instructions=True)


@pytest.mark.parametrize(
    ("status", "reason", "fields", "expected"),
    [("queued", None, {}, "queued"), ("planning", None, {}, "in_progress"), ("running", None, {}, "in_progress"),
     ("succeeded", "stop", {}, "completed"), ("succeeded", "length", {}, "incomplete"),
     ("succeeded", "content_filter", {}, "incomplete"),
     ("failed", None, {"error_type": "budget_exceeded", "error_message": "no room"}, "failed"),
     ("failed", None, {"error_type": "rate_limited", "error_message": "429"}, "failed"),
     ("cancelled", None, {"error_type": "cancelled", "error_message": "the job was cancelled"}, "cancelled")],
)
def test_every_job_status_is_a_response_the_sdk_validates(status: str, reason: str | None, fields: dict[str, Any],
                                                          expected: str) -> None:
    wire = response_object(_job(status, **fields), ROW, reason).model_dump(mode="json")
    parsed = sdk.Response.model_validate(json.loads(json.dumps(wire)))
    assert parsed.status == expected and parsed.id == "0" * 32 and parsed.background is True
    assert parsed.instructions == "Be brief." and parsed.metadata == {"team": "x"}
    assert (parsed.model_extra or {})["conductor"]["job_id"] == "0" * 32
    if expected in ("completed", "incomplete"):
        assert parsed.output_text == "42"
        assert parsed.usage is not None and parsed.usage.total_tokens == 15
        assert parsed.usage.input_tokens_details.cached_tokens == 6  # parts of the totals, as OpenAI counts them
        assert parsed.usage.output_tokens_details.reasoning_tokens == 3
    else:
        assert parsed.output == [] and parsed.output_text == ""
    assert (parsed.completed_at is not None) == (expected == "completed")
    if expected == "incomplete":
        assert parsed.incomplete_details is not None
        assert parsed.incomplete_details.reason == {"length": "max_output_tokens"}.get(reason or "", reason)
    if expected == "failed":
        assert parsed.error is not None and parsed.error.type == fields["error_type"]
        limited = fields["error_type"] == "rate_limited"
        assert parsed.error.code == ("rate_limit_exceeded" if limited else "server_error")
    else:
        assert parsed.error is None


def test_the_answer_events_validate_against_the_sdks_event_models() -> None:
    final = response_object(_job("succeeded"), ROW, "stop")
    events = ResponseEvents("0" * 32, "t", Settings(), None)
    kinds = {
        "response.output_item.added": sdk.ResponseOutputItemAddedEvent,
        "response.content_part.added": sdk.ResponseContentPartAddedEvent,
        "response.output_text.delta": sdk.ResponseTextDeltaEvent,
        "response.output_text.done": sdk.ResponseTextDoneEvent,
        "response.content_part.done": sdk.ResponseContentPartDoneEvent,
        "response.output_item.done": sdk.ResponseOutputItemDoneEvent,
        "response.completed": sdk.ResponseCompletedEvent,
    }
    sent = [_sse(e) for e in events._answer(final)]
    assert [name for name, _ in sent] == list(kinds)
    assert [data["sequence_number"] for _, data in sent] == list(range(len(kinds)))
    for name, data in sent:
        assert kinds[name].model_validate(data).type == name
    assert sent[2][1]["delta"] == "42" and sent[-1][1]["response"]["output"][0]["content"][0]["text"] == "42"
    sdk.ResponseErrorEvent.model_validate(_sse(events.error("job_timeout", "still running"))[1])


def test_a_job_ended_by_the_streams_first_read_still_streams_its_answer_once() -> None:
    """The first events tell a response under way (no output, usage or error), whatever the job's state by
    then: the SDK's own accumulator (``responses.stream()``) refuses an output item met twice."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState

    job = _job("succeeded")
    final = response_object(job, ROW, "stop")
    events = ResponseEvents(job.id, "t", Settings(), None)
    sent = [events.event("response.created", response=_progress(final, job)),
            events.event("response.in_progress", response=_progress(final, job, {"index": 0, "status": "succeeded"})),
            *events._answer(final)]
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for name, data in map(_sse, sent):
        if name == "response.created":
            assert data["response"]["output"] == [] and data["response"]["usage"] is None
            assert data["response"]["status"] == "in_progress"
        state.handle_event(construct_type(type_=sdk.ResponseStreamEvent, value=data))  # type: ignore[arg-type]
    assert state._completed_response is not None and state._completed_response.output_text == "42"


def _sse(event: str) -> tuple[str, dict[str, Any]]:
    head, data = event.strip().split("\n")
    return head.removeprefix("event: "), json.loads(data.removeprefix("data: "))


def test_the_input_shapes_the_sdk_sends_are_taken_in_order() -> None:
    request = ResponseCreateRequest.model_validate({
        "model": "conductor/template:pev", "instructions": "Answer in French.",
        "input": [{"role": "developer", "content": "Use metric units."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
                  {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "4", "annotations": []}]},
                  {"role": "user", "content": "And times 3?"}],
        "metadata": None, "temperature": None, "max_output_tokens": 500, "tools": [], "store": True,
    })
    made = response_job(request, Settings())
    assert made.body.task == "And times 3?" and made.body.planner == "template:pev"
    assert made.context == [{"role": "system", "content": "Answer in French."},
                            {"role": "system", "content": "Use metric units."},
                            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    job = _job("queued", task=made.body.task, context=made.context)
    items = input_items(job, ROW)  # the instructions are not an input item
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [
        ("system", "Use metric units."), ("user", "2+2?"), ("assistant", "4"), ("user", "And times 3?")]
    for item in items:
        parsed = (sdk.ResponseOutputMessage if item["role"] == "assistant" else sdk.ResponseInputMessageItem)
        parsed.model_validate(item)


@pytest.mark.parametrize("body", [
    {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
    {"input": "x", "tools": [{"type": "web_search"}]},
    {"input": "x", "conversation": "conv_1"},
    {"input": "x", "previous_response_id": "r" * 65},
    {"input": []},
])
def test_what_a_job_cannot_hold_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ResponseCreateRequest.model_validate({"model": "conductor", **body})


@pytest.mark.parametrize(("item", "said"), [
    ({"type": "function_call_output", "call_id": "c", "output": "x"},
     "input.1: items of type 'function_call_output' are not accepted"),
    ({"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": "u"}]},
     "input.1.content.1: content parts of type 'input_image' are not accepted"),
])
def test_an_item_or_part_refused_is_named_by_its_place_and_type(item: dict[str, Any], said: str) -> None:
    with pytest.raises(ValidationError) as refused:
        ResponseCreateRequest.model_validate({"model": "conductor", "input": [{"role": "user", "content": "a"}, item]})
    (error,) = refused.value.errors()  # one error, not one per member of the union
    assert error["loc"] == ("input",) and said in error["msg"]


def test_store_false_and_a_last_turn_not_the_users_are_refused_naming_the_field() -> None:
    from conductor.chat import ChatRequestError

    with pytest.raises(ChatRequestError) as unstored:
        response_job(ResponseCreateRequest(model="conductor", input="x", store=False), Settings())
    assert unstored.value.param == "store" and "store=false" in str(unstored.value)
    last = ResponseCreateRequest.model_validate({"model": "conductor", "instructions": "be brief", "input": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})
    with pytest.raises(ChatRequestError) as refused:
        response_job(last, Settings())
    assert refused.value.param == "input.1"  # its place in the input, the instructions not counted


def test_a_continued_response_begins_with_the_previous_input_and_answer_not_its_instructions() -> None:
    from conductor.chat import ChatRequestError

    previous = _job("succeeded", context=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}])
    request = ResponseCreateRequest(model="conductor", input="And times 2?", instructions="Metric units.",
                                    previous_response_id=previous.id)
    job = response_job(request, Settings(), (previous, ROW))
    assert job.body.task == "And times 2?"
    assert job.context == [{"role": "system", "content": "Metric units."}, {"role": "user", "content": "2+2?"},
                           {"role": "assistant", "content": "4"}, {"role": "user", "content": "What is 6 x 7?"},
                           {"role": "assistant", "content": "42"}]
    # The chain is held to one input's item limit (512): 510 earlier turns, the previous task and answer, this one.
    long = _job("succeeded", context=[{"role": "user", "content": f"turn {n}"} for n in range(510)])
    no_instructions = OpenAIResponse(job_id="0" * 32, model="conductor", background=False, instructions=False)
    with pytest.raises(ChatRequestError) as refused:
        response_job(request, Settings(), (long, no_instructions))
    assert refused.value.param == "previous_response_id" and refused.value.code == "context_length_exceeded"
    assert f"513 items (512 of them from previous response {long.id}); the limit is 512" in str(refused.value)
    fits = ResponseCreateRequest(model="conductor", input="And times 2?")
    assert len(response_job(fits, Settings(), (_job("succeeded", context=long.context[1:]), no_instructions))
               .context) == 511


def test_the_lean_state_read_is_the_whole_rows_on_sqlite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with sqlite_store(tmp_path, monkeypatch):
        check_the_lean_read_is_the_whole_rows()


def test_a_slot_lapsing_inside_the_ending_finishes_it_instead_of_taking_one_of_its_numbers() -> None:
    """The ending's numbers are the response's for every later stream (a resume after N sends only the
    ending's events numbered after N). A lapse replacing one of them with an ``error`` event numbered like
    it (as a lapse anywhere else does) made a resume after that error skip the event it replaced: the
    rest of the ending is sent instead, with its own numbers. Before the ending, a lapse is the error."""
    now = datetime.now(UTC)
    job = Job.model_construct(id="a" * 32, status="succeeded", created_at=now, finished_at=now, answer="42",
                              input_tokens=3, output_tokens=1, cost_usd=0.0, calls=1, meta=None, limits={},
                              context=None)
    final = response_object(job, OpenAIResponse(job_id=job.id, model="conductor", background=False,
                                                instructions=False))
    events = ResponseEvents(job.id, "t", Settings(), None, after=3)  # type: ignore[call-arg]
    assert [e.split("\n")[0] for e in events.lapsed("gone")] == ["event: error"]  # before the ending
    events.sequence = 10
    ending = events._send_ending(final)
    first, second = next(ending), next(ending)  # the second is the one held_stream drops on a lapse
    assert '"sequence_number": 10' in first and '"sequence_number": 11' in second
    rest = events.lapsed("gone")
    assert [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in rest] == list(range(11, 17))
    assert rest[-1].startswith("event: response.completed")
