"""The official ``openai`` client, unchanged, against the Responses API: background responses polled to
their end and cancelled, responses waited for, streamed events (raw and through the SDK's own stream
accumulator), input items, tenant isolation and the OpenAI error shape; real jobs on the Celery workers
(sim pool), as the chat completion tests run them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from conductor.quotas import STREAMS_KEY
from conductor.settings import get_settings
from conductor.store.db import session_scope
from conductor.store.keys import revoke_key
from tests.integration.conftest import new_key
from tests.integration.harness import start_api, wait_terminal
from tests.response_cases import check_the_lean_read_is_the_whole_rows

ENDED = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture(scope="module")
def key(api: str) -> str:
    return new_key("tenant-responses")


@pytest.fixture(scope="module")
def oai(api: str, key: str, workers: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def http(api: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        yield c


def _polled(oai: openai.OpenAI, response_id: str, timeout: float = 90) -> Any:
    """Polls as a background client does. The timeout only keeps a broken run from hanging."""
    deadline = time.monotonic() + timeout
    while True:
        response = oai.responses.retrieve(response_id)
        if response.status in ENDED or time.monotonic() > deadline:
            return response
        time.sleep(0.2)


def test_a_background_response_is_queued_at_once_and_polled_to_its_end(oai: openai.OpenAI,
                                                                       http: httpx.Client) -> None:
    raw = oai.responses.with_raw_response.create(
        model="conductor", input="What is 6 x 7?", instructions="Answer in French.", background=True,
        metadata={"team": "search"},
    )
    created = raw.parse()
    assert created.status in ("queued", "in_progress") and created.output == [] and created.usage is None
    assert created.background is True and created.object == "response"
    assert raw.headers["conductor-job-id"] == created.id == (created.model_extra or {})["conductor"]["job_id"]

    done = _polled(oai, created.id)
    job = http.get(f"/v1/jobs/{created.id}").json()
    assert done.status == "completed" and job["status"] == "succeeded"
    assert done.output_text == job["answer"] != ""
    assert done.model == "conductor" and done.background is True and done.completed_at is not None
    assert done.instructions == "Answer in French." and done.metadata == {"team": "search"}
    assert job["metadata"] == {"team": "search"} and job["task"] == "What is 6 x 7?"
    assert done.usage is not None
    assert done.usage.input_tokens == job["usage"]["input_tokens"] > 0
    assert done.usage.output_tokens == job["usage"]["output_tokens"] > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    # The instructions reached the worker as a system turn before its own instruction.
    step = http.get(f"/v1/jobs/{created.id}/steps").json()["data"][0]
    assert {"role": "system", "content": "Answer in French."} in step["messages"]
    items = oai.responses.input_items.list(created.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "What is 6 x 7?")]  # type: ignore[union-attr]


def test_a_response_waited_for_takes_message_items_and_names_a_planner(oai: openai.OpenAI,
                                                                      http: httpx.Client) -> None:
    response = oai.responses.create(
        model="conductor/template:pev",
        input=[{"role": "developer", "content": "Use metric units."},
               {"role": "user", "content": [{"type": "input_text", "text": "How far is it?"}]},
               {"role": "assistant", "content": "From where?"},
               {"role": "user", "content": "From Paris to Lyon."}],
    )
    assert response.status == "completed" and response.background is False
    job = http.get(f"/v1/jobs/{response.id}").json()
    assert job["planner"] == "template:pev" and job["task"] == "From Paris to Lyon."
    assert response.output_text == job["answer"] and response.model == "conductor/template:pev"
    steps = http.get(f"/v1/jobs/{response.id}/steps").json()["data"]
    assert steps[0]["messages"][1:4] == [{"role": "system", "content": "Use metric units."},
                                         {"role": "user", "content": "How far is it?"},
                                         {"role": "assistant", "content": "From where?"}]
    asc = oai.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.role for i in asc.data] == ["system", "user"] and asc.has_more  # type: ignore[union-attr]
    rest = oai.responses.input_items.list(response.id, order="asc", after=asc.last_id)
    assert [i.role for i in rest.data] == ["assistant", "user"] and not rest.has_more  # type: ignore[union-attr]


def test_the_stream_sends_the_sdks_event_sequence(oai: openai.OpenAI, http: httpx.Client) -> None:
    events = list(oai.responses.create(model="conductor/template:fanout", input="compare", stream=True))
    names = [e.type for e in events]
    assert names[0] == "response.created" and names[1] == "response.in_progress"
    answer = names.index("response.output_item.added")
    assert set(names[1:answer]) == {"response.in_progress"}
    assert names[answer:] == ["response.output_item.added", "response.content_part.added",
                              "response.output_text.delta", "response.output_text.done",
                              "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    response_id = events[0].response.id  # type: ignore[union-attr]
    job = http.get(f"/v1/jobs/{response_id}").json()
    final = events[-1].response  # type: ignore[union-attr]
    assert job["status"] == "succeeded" and final.output_text == job["answer"]
    assert final.usage is not None and final.usage.input_tokens == job["usage"]["input_tokens"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == job["answer"]
    # Progress: each step's move to succeeded came as an in_progress event's extension field.
    steps = [(e.response.model_extra or {})["conductor"]["step"] for e in events  # type: ignore[union-attr]
             if e.type == "response.in_progress"]
    succeeded = {s["index"] for s in steps if s and s["status"] == "succeeded"}
    assert succeeded == {s["index"] for s in job["workflow"]["steps"]} == {0, 1, 2, 3}

    # The SDK's accumulating helper checks the events' consistency (ids, indexes, output items) itself.
    with oai.responses.stream(model="conductor", input="y") as stream:
        for _ in stream:
            pass
        accumulated = stream.get_final_response()
    assert accumulated.status == "completed"
    assert accumulated.output_text == http.get(f"/v1/jobs/{accumulated.id}").json()["answer"] != ""


def test_previous_response_id_continues_the_conversation(oai: openai.OpenAI, http: httpx.Client) -> None:
    """As OpenAI chains responses: the new response's job sees the previous response's input and answer
    before its own input, and not the previous instructions (OpenAI does not carry them over); a third
    response sees the whole chain. Its input items are the whole conversation (the items used to generate
    it, as OpenAI lists them)."""
    first = oai.responses.create(model="conductor", input="What is 6 x 7?", instructions="Answer in French.")
    second = oai.responses.create(model="conductor", input="And times 2?", previous_response_id=first.id,
                                  instructions="Be brief.")
    assert second.status == "completed" and second.previous_response_id == first.id
    assert second.instructions == "Be brief." and first.previous_response_id is None
    assert oai.responses.retrieve(second.id).previous_response_id == first.id
    job = http.get(f"/v1/jobs/{second.id}").json()
    assert job["task"] == "And times 2?" and second.output_text == job["answer"]
    # What the worker's provider call was sent (the step's recorded messages): the earlier turn, then the task.
    messages = http.get(f"/v1/jobs/{second.id}/steps").json()["data"][0]["messages"]
    assert messages[1:4] == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "What is 6 x 7?"},
                             {"role": "assistant", "content": first.output_text}]
    assert not any("Answer in French." in m["content"] for m in messages)
    items = oai.responses.input_items.list(second.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [  # type: ignore[union-attr]
        ("user", "What is 6 x 7?"), ("assistant", first.output_text), ("user", "And times 2?")]

    streamed = list(oai.responses.create(model="conductor", input="And minus 1?", previous_response_id=second.id,
                                         stream=True))
    third = streamed[-1].response  # type: ignore[union-attr]
    assert streamed[-1].type == "response.completed" and third.previous_response_id == second.id
    messages = http.get(f"/v1/jobs/{third.id}/steps").json()["data"][0]["messages"]
    assert messages[1:5] == [{"role": "user", "content": "What is 6 x 7?"},
                             {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "And times 2?"},
                             {"role": "assistant", "content": second.output_text}]


def test_previous_response_id_must_be_a_completed_response_of_the_tenant(oai: openai.OpenAI, api: str,
                                                                          http: httpx.Client) -> None:
    done = oai.responses.create(model="conductor", input="mine")
    chat = oai.chat.completions.create(model="conductor", messages=[{"role": "user", "content": "x"}])
    other_key = new_key("tenant-responses-other")
    with (openai.OpenAI(base_url=f"{api}/v1", api_key=other_key, max_retries=0) as other,
          pytest.raises(openai.NotFoundError) as theirs):
        other.responses.create(model="conductor", input="y", previous_response_id=done.id,
                               metadata={"chained": "refused"})
    for unknown in (theirs, *(_refused(oai, openai.NotFoundError, previous) for previous in (chat.id, "nope"))):
        assert unknown.value.code == "previous_response_not_found"
        assert unknown.value.param == "previous_response_id"
    running = oai.responses.create(model="conductor/slow", input="z", background=True)
    waiting = _refused(oai, openai.BadRequestError, running.id)
    assert waiting.value.param == "previous_response_id" and waiting.value.code == "previous_response_not_completed"
    assert "wait for it to end" in waiting.value.message
    oai.responses.cancel(running.id)
    cancelled = _refused(oai, openai.BadRequestError, running.id)
    assert "is cancelled" in cancelled.value.message and "no answer" in cancelled.value.message
    refused = {"meta_key": "chained", "meta_value": "refused"}
    assert http.get("/v1/jobs", params=refused).json()["data"] == []
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {other_key}"}, timeout=30) as theirs_http:
        listed = theirs_http.get("/v1/jobs", params=refused)  # the other tenant's refused request made none either
    assert listed.status_code == 200 and listed.json()["data"] == []


def _refused(oai: openai.OpenAI, error: type[openai.APIStatusError], previous: str) -> Any:
    with pytest.raises(error) as refused:
        oai.responses.create(model="conductor", input="y", previous_response_id=previous,
                             metadata={"chained": "refused"})
    return refused


def test_a_chain_is_held_to_the_input_limit(proc_env: dict[str, str], key: str, workers: Any) -> None:
    """The whole conversation a chain builds counts against CONDUCTOR_MAX_TASK_CHARS, as one input does:
    each turn fits, the continued conversation would not, and the refusal says what the chain brought."""
    proc, url = start_api({**proc_env, "CONDUCTOR_MAX_TASK_CHARS": "400"})
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            first = client.responses.create(model="conductor", input="a" * 250)
            assert first.status == "completed"
            with pytest.raises(openai.BadRequestError) as long:
                client.responses.create(model="conductor", input="b" * 150, previous_response_id=first.id)
    finally:
        proc.stop()
    assert long.value.code == "context_length_exceeded" and long.value.param == "previous_response_id"
    assert f"from previous response {first.id}" in long.value.message and "the limit is 400" in long.value.message


@pytest.fixture(scope="module")
def failing_api(proc_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An API whose default pool has one agent, whose every call fails: its jobs fail at their step."""
    pool = tmp_path_factory.mktemp("failing") / "failing.yaml"
    pool.write_text("planner: template:single\nfallback: template:single\nagents:\n"
                    "  broken: {provider: sim, options: {always_fail: true, error: server}}\n")
    proc, url = start_api({**proc_env, "CONDUCTOR_POOL_FILE": str(pool)})
    yield url
    proc.stop()


def test_a_failed_job_is_a_failed_response_with_its_error(failing_api: str, key: str, http: httpx.Client,
                                                          workers: Any) -> None:
    with openai.OpenAI(base_url=f"{failing_api}/v1", api_key=key, max_retries=0) as client:
        response = client.responses.create(model="conductor", input="x")
        events = list(client.responses.create(model="conductor", input="x", stream=True))
    job = http.get(f"/v1/jobs/{response.id}").json()
    assert job["status"] == "failed" and response.status == "failed" and response.output == []
    assert response.error is not None and response.error.code == "server_error"
    assert response.error.type == job["error"]["type"] and response.error.message == job["error"]["message"]
    assert response.usage is not None and response.usage.input_tokens == job["usage"]["input_tokens"]
    # Streamed, it ends with response.failed (no output items), carrying the same error.
    assert (events[0].type, events[-1].type) == ("response.created", "response.failed")
    assert not any(e.type.startswith("response.output") for e in events)
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None and failed.error.type == job["error"]["type"]


def test_an_answer_cut_at_its_token_limit_is_an_incomplete_response(proc_env: dict[str, str], key: str,
                                                                    http: httpx.Client, workers: Any,
                                                                    tmp_path: Path) -> None:
    """An API whose one agent may write 4 tokens: the sim agent stops there, as a provider does, with
    finish_reason ``length``; the response is ``incomplete`` (``max_output_tokens``), its answer as cut."""
    pool = tmp_path / "short.yaml"
    pool.write_text("planner: template:single\nfallback: template:single\nagents:\n"
                    "  terse: {provider: sim, max_tokens: 4}\n")
    proc, url = start_api({**proc_env, "CONDUCTOR_POOL_FILE": str(pool)})
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            response = client.responses.create(model="conductor", input="Say hello at length. " * 5)
            events = list(client.responses.create(model="conductor", input="Say hello at length. " * 5,
                                                  stream=True))
    finally:
        proc.stop()
    job = http.get(f"/v1/jobs/{response.id}").json()
    assert job["status"] == "succeeded"
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.completed_at is None
    assert response.output_text == job["answer"] != "" and response.output[0].status == "incomplete"
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == http.get(  # type: ignore[union-attr]
        f"/v1/jobs/{events[0].response.id}").json()["answer"]  # type: ignore[union-attr]


def test_max_output_tokens_caps_the_answer(oai: openai.OpenAI, http: httpx.Client) -> None:
    """``max_output_tokens`` reaches the answering step's call (the sim agent stops there with ``length``, as
    a provider does): the response is ``incomplete`` (``max_output_tokens``), its answer as cut, and echoes
    the cap. Only the answering step is cut; a cap the answer fits under leaves it completed."""
    long = "Say hello at length. " * 5
    response = oai.responses.create(model="conductor", input=long, max_output_tokens=4)
    job = http.get(f"/v1/jobs/{response.id}").json()
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.max_output_tokens == 4
    assert response.output_text == job["answer"] and 0 < len(job["answer"]) <= 16
    assert oai.responses.retrieve(response.id).max_output_tokens == 4

    events = list(oai.responses.create(model="conductor/template:fanout", input=long, max_output_tokens=4,
                                       stream=True))
    assert events[-1].type == "response.incomplete"
    steps = http.get(f"/v1/jobs/{events[0].response.id}/steps").json()["data"]  # type: ignore[union-attr]
    assert [st["finish_reason"] for st in steps] == ["stop"] * (len(steps) - 1) + ["length"]

    roomy = oai.responses.create(model="conductor", input=long, max_output_tokens=1000)
    assert roomy.status == "completed" and roomy.max_output_tokens == 1000
    assert oai.responses.create(model="conductor", input=long).max_output_tokens is None


def test_cancel_ends_a_background_response(oai: openai.OpenAI, http: httpx.Client) -> None:
    created = oai.responses.create(model="conductor/slow", input="z", background=True)
    cancelled = oai.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.error is None and cancelled.output == []
    assert http.get(f"/v1/jobs/{created.id}").json()["status"] == "cancelled"
    assert oai.responses.retrieve(created.id).status == "cancelled"
    assert oai.responses.cancel(created.id).status == "cancelled"  # again: answered as it is

    finished = oai.responses.create(model="conductor", input="w")
    with pytest.raises(openai.ConflictError) as ended:
        oai.responses.cancel(finished.id)
    assert ended.value.code == "response_already_ended"
    assert ended.value.response.headers["x-should-retry"] == "false"


def test_another_tenant_and_other_jobs_are_not_found(oai: openai.OpenAI, api: str, http: httpx.Client) -> None:
    mine = oai.responses.create(model="conductor", input="mine", background=True)
    with openai.OpenAI(base_url=f"{api}/v1", api_key=new_key("tenant-responses-other"), max_retries=0) as other:
        for read in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.cancel(mine.id),
                     lambda: other.responses.input_items.list(mine.id), lambda: other.responses.delete(mine.id)):
            with pytest.raises(openai.NotFoundError) as hidden:
                read()
            assert hidden.value.code == "response_not_found"
    assert _polled(oai, mine.id).status == "completed"  # untouched by the other tenant's cancel
    chat = oai.chat.completions.create(model="conductor", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(chat.id)  # a job, not a response
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve("nope")


def test_refusals_have_the_openai_shape_and_say_what_to_do(oai: openai.OpenAI, http: httpx.Client) -> None:
    # what the OpenAI Agents SDK sends on every call of an agent without tools: accepted
    done = oai.responses.create(model="conductor", input="kept", include=[], tools=[], parallel_tool_calls=False)
    assert done.status == "completed", done
    with pytest.raises(openai.BadRequestError) as deleted:
        oai.responses.delete(done.id)
    assert deleted.value.code == "response_not_deletable" and "cancel" in deleted.value.message
    assert http.get(f"/v1/jobs/{done.id}").status_code == 200
    with pytest.raises(openai.BadRequestError) as unstored:
        oai.responses.create(model="conductor", input="x", store=False)
    assert unstored.value.param == "store" and "store=false" in unstored.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.responses.create(model="gpt-5", input="x")
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    with pytest.raises(openai.BadRequestError) as last_turn:
        oai.responses.create(model="conductor", input=[{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": "y"}])
    assert last_turn.value.param == "input.1"
    with pytest.raises(openai.BadRequestError) as tools:
        oai.responses.create(model="conductor", input="x", tools=[{"type": "web_search"}])
    assert "tools" in (tools.value.param or "")
    with pytest.raises(openai.BadRequestError) as included:  # extra output data this API does not produce
        oai.responses.create(model="conductor", input="x", include=["message.output_text.logprobs"])
    assert "include" in (included.value.param or "")
    with pytest.raises(openai.BadRequestError) as resumed:
        oai.responses.retrieve(done.id, starting_after=3)  # a resume's number, without stream=true
    assert resumed.value.param == "starting_after" and "stream=true" in resumed.value.message
    with pytest.raises(openai.BadRequestError) as negative:
        oai.responses.retrieve(done.id, stream=True, starting_after=-1)
    assert negative.value.param == "starting_after"
    r = http.post("/v1/responses", json={"model": "conductor", "input": "x", "conversation": "conv_1"})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def _given_back(slots: redis.Redis, tenant: str, within_s: float = 10) -> bool:
    """Whether the tenant holds no stream slot, waiting for it a moment: the server releases a stream's slot
    as its response ends (``SlotStream``), just after the client has read the last event and seen the end."""
    deadline = time.monotonic() + within_s
    while slots.zrange(STREAMS_KEY + tenant, 0, -1):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_stream_refused_at_submission_gives_its_slot_back(api: str, workers: Any) -> None:
    """A stream takes one of the tenant's stream slots before its job is submitted (``submit_holding_slot``,
    shared by chat and responses); a submission refused (here: an unknown model, 404) gives it back at
    once rather than leaving it to expire, for both routes."""
    tenant = "responses-refused-stream"
    slots = redis.Redis.from_url(get_settings().broker_url)
    with openai.OpenAI(base_url=f"{api}/v1", api_key=new_key(tenant), max_retries=0) as client:
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="gpt-5", input="x", stream=True)
        assert slots.zrange(STREAMS_KEY + tenant, 0, -1) == []
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}], stream=True)
        assert slots.zrange(STREAMS_KEY + tenant, 0, -1) == []
        stream = iter(client.responses.create(model="conductor/slow", input="x", stream=True))  # one admitted
        first = next(stream)  # its job exists and its stream is open (the slow planner is still running)
        assert first.type == "response.created"
        assert len(slots.zrange(STREAMS_KEY + tenant, 0, -1)) == 1  # held while it is open
        events = [first, *stream]
    assert events[-1].type == "response.completed"
    assert _given_back(slots, tenant)  # and given back when it ended


def test_a_response_outlasting_the_wait_is_a_504_and_goes_on(proc_env: dict[str, str], key: str,
                                                             http: httpx.Client, workers: Any) -> None:
    """With a 1 s wait, a response waited for (or streamed) whose planner takes longer answers 504 /
    ends with an ``error`` event, naming the response, which still ends normally and can be polled."""
    proc, url = start_api({**proc_env, "CONDUCTOR_CHAT_MAX_WAIT_S": "1"})
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as late:
                client.responses.create(model="conductor/slow", input="z")
            assert late.value.status_code == 504 and late.value.code == "job_timeout"
            assert late.value.response.headers["x-should-retry"] == "false"
            response_id = late.value.response.headers["conductor-job-id"]
            assert f"GET /v1/responses/{response_id}" in late.value.message
            events = list(client.responses.create(model="conductor/slow", input="z", stream=True))
            assert [e.type for e in events][-1] == "error"
            streamed_id = events[0].response.id  # type: ignore[union-attr]
            assert events[-1].code == "job_timeout" and streamed_id in events[-1].message  # type: ignore[union-attr]
            # The error names the resume, and resuming as it says (each resumed stream bounded by the
            # same 1 s wait, so maybe more than once) follows the response to its end with no number used twice.
            resumes = 0
            while events[-1].type == "error":
                resume_at = f"GET /v1/responses/{streamed_id}?stream=true&starting_after={events[-1].sequence_number}"
                assert resume_at in events[-1].message
                assert resumes < 20, "the resumed streams never reached the end"
                resumed = list(client.responses.retrieve(streamed_id, stream=True,
                                                         starting_after=events[-1].sequence_number))
                assert "response.created" not in [e.type for e in resumed]
                events += resumed
                resumes += 1
            assert resumes >= 1 and events[-1].type == "response.completed"
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert events[-1].response.output_text == wait_terminal(http, streamed_id)["answer"] != ""
            assert _polled(client, response_id).status == "completed"
    finally:
        proc.stop()
    assert wait_terminal(http, streamed_id)["status"] == "succeeded"


def test_a_dropped_stream_resumes_after_its_last_event(api: str, http: httpx.Client, workers: Any) -> None:
    """A client whose stream dropped resumes it with ``retrieve(id, stream=True, starting_after=N)``: the
    events go on from N + 1 (no second ``response.created``) to the answer; the resumed stream holds a
    stream slot and gives it back. The ending keeps the numbers it was first sent with: a resume inside it
    gets only the rest, one after it nothing, and a stream from the start the ending with those numbers."""
    tenant = "responses-resumed-stream"
    slots = redis.Redis.from_url(get_settings().broker_url)
    with openai.OpenAI(base_url=f"{api}/v1", api_key=new_key(tenant), max_retries=0) as client:
        stream = client.responses.create(model="conductor/slow", input="resume me", stream=True)
        first = next(iter(stream))
        assert first.type == "response.created"
        stream.close()  # the connection drops while the slow planner runs
        response_id = first.response.id
        resumed = client.responses.retrieve(response_id, stream=True, starting_after=first.sequence_number)
        rest = list(resumed)
        assert [e.sequence_number for e in rest] == list(range(1, len(rest) + 1))
        names = [e.type for e in rest]
        assert "response.created" not in names and names[0] == "response.in_progress"
        assert names[-7:] == ENDING
        assert rest[-1].response.output_text == client.responses.retrieve(response_id).output_text != ""
        assert _given_back(slots, tenant)  # both streams' slots given back

        ending = rest[-7:]
        inside = list(client.responses.retrieve(response_id, stream=True, starting_after=ending[2].sequence_number))
        assert [(e.type, e.sequence_number) for e in inside] == [(e.type, e.sequence_number) for e in ending[3:]]
        assert "response.output_text.delta" not in [e.type for e in inside]  # the text comes once
        assert list(client.responses.retrieve(response_id, stream=True,
                                              starting_after=ending[-1].sequence_number)) == []
        assert list(client.responses.retrieve(response_id, stream=True, starting_after=10**9)) == []
        again = list(client.responses.retrieve(response_id, stream=True))
        assert [(e.type, e.sequence_number) for e in again] == [("response.created", 0)] + [
            (e.type, e.sequence_number) for e in ending]
        assert again[-1].response.output_text == rest[-1].response.output_text
        assert _given_back(slots, tenant)
    with (openai.OpenAI(base_url=f"{api}/v1", api_key=new_key("responses-other"), max_retries=0) as stranger,
          pytest.raises(openai.NotFoundError)):  # another tenant's response is not found, streamed or not
        list(stranger.responses.retrieve(response_id, stream=True, starting_after=1))
    assert slots.zrange(STREAMS_KEY + "responses-other", 0, -1) == []  # refused before a slot was taken


def test_the_sdks_own_resume_of_a_dropped_stream_gets_the_whole_answer(api: str, workers: Any) -> None:
    """``client.responses.stream(response_id=…, starting_after=N)`` (the SDK's resume) asks for the stream from
    the start and drops, on the client, every event numbered up to N: the ending is numbered after every
    number a stream of the response has sent, so none of the answer's events is dropped."""
    key = new_key("responses-sdk-resume")
    with (openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0) as client,
          httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http):
        response_id = client.responses.create(model="conductor/slow", input="resume me", background=True).id
        # a stream of it, resumed once already (numbered past 50), drops after its first event
        stream = client.responses.retrieve(response_id, stream=True, starting_after=50)
        first = next(iter(stream))
        stream.close()
        last = first.sequence_number
        assert last == 51 and first.type == "response.in_progress"
        wait_terminal(http, response_id)  # the rest happened while no one watched
        with client.responses.stream(response_id=response_id, starting_after=last) as resumed:
            rest = list(resumed)
            final = resumed.get_final_response()
        # before: read afresh, the ended job's step events and then its answer were numbered from 1, all at or
        # below N: the client dropped every one, and get_final_response() found no response.completed
        assert [e.type for e in rest] == ENDING and all(e.sequence_number > last for e in rest), rest
        assert final.output_text == http.get(f"/v1/jobs/{response_id}").json()["answer"] != ""


ENDING = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
          "response.output_text.done", "response.content_part.done", "response.output_item.done",
          "response.completed"]


def test_a_revoked_key_ends_the_stream_naming_the_response(api: str, workers: Any) -> None:
    """As a chat stream: the key is looked up again every few seconds; revoked, the stream ends with an
    ``error`` event naming the response, which goes on to its end (read with another key of the tenant)."""
    tenant = "responses-revoked-stream"
    streaming_key = new_key(tenant)
    with openai.OpenAI(base_url=f"{api}/v1", api_key=streaming_key, max_retries=0) as client:
        events = iter(client.responses.create(model="conductor/slow", input="z", stream=True))
        first = next(events)
        assert first.type == "response.created"
        with session_scope() as s:
            assert revoke_key(s, prefix=streaming_key[:10]) == 1
        rest = list(events)
    assert rest[-1].type == "error" and rest[-1].code == "invalid_api_key"  # type: ignore[union-attr]
    response_id = first.response.id  # type: ignore[union-attr]
    assert response_id in rest[-1].message  # type: ignore[union-attr]
    assert not any(e.type.startswith("response.output") for e in rest)
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key(tenant)}"}, timeout=30) as other:
        assert wait_terminal(other, response_id)["status"] == "succeeded"


def test_the_lean_state_read_is_the_whole_rows_on_postgres() -> None:
    check_the_lean_read_is_the_whole_rows()
