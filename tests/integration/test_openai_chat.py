"""The official ``openai`` client, unchanged, against the API: chat completions (plain and streamed) run
real jobs on the Celery workers (sim pool), ``models.list()``, and the OpenAI error shape."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from conductor.store import jobs as jobs_store
from conductor.store.db import session_scope
from conductor.store.keys import revoke_key
from tests.integration.conftest import new_key
from tests.integration.harness import start_api, wait_terminal

SIM_ANSWER = "[a] Solve the task and give the final answer."  # template:single runs agent a


@pytest.fixture(scope="module")
def key(api: str) -> str:
    return new_key("tenant-chat")


@pytest.fixture(scope="module")
def oai(api: str, key: str, workers: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def http(api: str, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        yield c


def test_chat_completion_runs_a_job_with_earlier_turns_as_context(oai: openai.OpenAI, http: httpx.Client) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": [{"type": "text", "text": "And times 3?"}]},
    ]
    raw = oai.chat.completions.with_raw_response.create(model="conductor", messages=messages)
    reply = raw.parse()

    assert reply.object == "chat.completion"
    assert raw.headers["conductor-job-id"] == reply.id
    assert reply.model == "conductor"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == SIM_ANSWER
    assert reply.choices[0].finish_reason == "stop"

    job = http.get(f"/v1/jobs/{reply.id}").json()
    assert job["status"] == "succeeded" and job["task"] == "And times 3?"
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == job["usage"]["input_tokens"] > 0
    assert reply.usage.completion_tokens == job["usage"]["output_tokens"] > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # The worker saw the earlier turns, in order, between its system message and its own instruction.
    step = http.get(f"/v1/jobs/{reply.id}/steps").json()["data"][0]
    assert step["messages"][1:4] == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert "And times 3?" in step["messages"][0]["content"]
    assert step["messages"][-1] == {"role": "user", "content": step["instruction"]}


def test_a_long_message_is_accepted_and_its_parts_are_limited(oai: openai.OpenAI, http: httpx.Client) -> None:
    question = "Summarise the following notes in one line. " + "The quick brown fox jumps over the lazy dog. " * 40
    reply = oai.chat.completions.create(model="conductor", messages=[{"role": "user", "content": question}])
    assert http.get(f"/v1/jobs/{reply.id}").json()["task"] == question
    # A list of parts is limited to 64 parts (each part's text only by the request's size).
    parts: list[Any] = [{"type": "text", "text": f"part {i} " * 20} for i in range(64)]
    reply = oai.chat.completions.create(model="conductor", messages=[{"role": "user", "content": parts}])
    assert http.get(f"/v1/jobs/{reply.id}").json()["status"] == "succeeded"
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model="conductor", messages=[{"role": "user", "content": [*parts, parts[0]]}])
    assert "64" in str(refused.value)


def test_model_names_a_planner(oai: openai.OpenAI, http: httpx.Client) -> None:
    reply = oai.chat.completions.create(model="conductor/template:pev", messages=[{"role": "user", "content": "x"}])
    job = http.get(f"/v1/jobs/{reply.id}").json()
    assert job["planner"] == "template:pev"
    assert [s["agent"] for s in job["workflow"]["steps"]] == ["a", "b", "c"]
    assert reply.choices[0].message.content == job["answer"]
    assert reply.model == "conductor/template:pev"


def test_stream_sends_progress_then_the_answer_then_done(oai: openai.OpenAI, http: httpx.Client, api: str,
                                                         key: str) -> None:
    chunks = list(oai.chat.completions.create(
        model="conductor/template:fanout",
        messages=[{"role": "user", "content": "compare"}],
        stream=True,
        stream_options={"include_usage": True},
    ))
    job_id = chunks[0].id
    assert {c.id for c in chunks} == {job_id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    job = http.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and text == job["answer"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # Progress: every step's move to succeeded came as an extension field before the answer.
    progress = [(c.model_extra or {}).get("conductor") for c in chunks]
    succeeded = {p["step"]["index"] for p in progress if p and p.get("step") and p["step"]["status"] == "succeeded"}
    assert succeeded == {s["index"] for s in job["workflow"]["steps"]} == {0, 1, 2, 3}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == job["usage"]["input_tokens"]
    assert usage.completion_tokens == job["usage"]["output_tokens"]

    # On the wire: SSE data lines, the last one [DONE].
    with httpx.stream("POST", f"{api}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "conductor", "messages": [{"role": "user", "content": "y"}], "stream": True},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"


def test_max_completion_tokens_caps_the_answer(oai: openai.OpenAI, http: httpx.Client) -> None:
    """``max_completion_tokens`` (or ``max_tokens``) reaches the answering step's call, which the sim agent
    ends there with ``length``, as a provider does: the reply is cut and says so. The steps before the
    answering one keep their agents' limits."""
    messages = [{"role": "user", "content": "Say hello at length. " * 5}]
    for cap in ({"max_completion_tokens": 4}, {"max_tokens": 4}, {"max_tokens": 1000, "max_completion_tokens": 4}):
        reply = oai.chat.completions.create(model="conductor", messages=messages, **cap)  # type: ignore[call-overload]
        job = http.get(f"/v1/jobs/{reply.id}").json()
        assert reply.choices[0].finish_reason == "length" and job["limits"]["max_answer_tokens"] == 4
        assert reply.choices[0].message.content == job["answer"] and 0 < len(job["answer"]) <= 16
    fanned = oai.chat.completions.create(model="conductor/template:fanout", messages=messages, max_tokens=4)
    steps = http.get(f"/v1/jobs/{fanned.id}/steps").json()["data"]
    assert [st["finish_reason"] for st in steps] == ["stop"] * (len(steps) - 1) + ["length"]
    assert fanned.choices[0].finish_reason == "length"
    roomy = oai.chat.completions.create(model="conductor", messages=messages, max_completion_tokens=1000)
    assert roomy.choices[0].finish_reason == "stop"


def test_models_list(oai: openai.OpenAI) -> None:
    ids = [m.id for m in oai.models.list()]
    assert ids[0] == "conductor"
    assert {"conductor/template:single", "conductor/template:pev", "conductor/a"} <= set(ids)
    assert oai.models.retrieve("conductor/template:pev").id == "conductor/template:pev"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-5")


def test_settings_agent_frameworks_send_are_accepted_and_what_cannot_be_honoured_is_refused(
    oai: openai.OpenAI,
) -> None:
    user: Any = [{"role": "user", "content": "settings"}]
    # before: each was a 400 ("Extra inputs are not permitted"), as openai-agents sends them from its settings
    done = oai.chat.completions.create(
        model="conductor", messages=user, store=True, service_tier="auto", reasoning_effort="low",
        verbosity="medium", parallel_tool_calls=False, safety_identifier="user-7", prompt_cache_key="k",
        tools=[], tool_choice="none", logprobs=False, top_logprobs=0,
    )
    assert done.choices[0].message.content == SIM_ANSWER
    refused: dict[str, dict[str, Any]] = {
        "store": {"store": False},
        "logprobs": {"logprobs": True},
        "top_logprobs": {"top_logprobs": 2},
    }
    for param, extra in refused.items():
        with pytest.raises(openai.BadRequestError) as no:
            oai.chat.completions.create(model="conductor", messages=user, **extra)
        assert no.value.param == param and no.value.code == "unsupported_parameter", (param, no.value.body)
        assert "omit it" in no.value.message or "omit store" in no.value.message
    tool: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as tools:
        oai.chat.completions.create(model="conductor", messages=user, tools=[tool])
    assert "tools" in (tools.value.param or "") + tools.value.message


def test_errors_have_the_openai_shape(oai: openai.OpenAI, api: str, http: httpx.Client) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        oai.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    with pytest.raises(openai.NotFoundError) as no_planner:
        oai.chat.completions.create(model="conductor/nope", messages=[{"role": "user", "content": "x"}])
    assert no_planner.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as last_turn:
        oai.chat.completions.create(model="conductor", messages=[{"role": "assistant", "content": "x"}])
    assert last_turn.value.param == "messages.0"
    with pytest.raises(openai.BadRequestError) as invalid:
        oai.chat.completions.create(model="conductor", messages=[])
    assert invalid.value.type == "invalid_request_error" and invalid.value.param == "messages"
    with pytest.raises(openai.AuthenticationError) as denied, openai.OpenAI(
        base_url=f"{api}/v1", api_key="cq_wrong", max_retries=0
    ) as stranger:
        stranger.models.list()
    assert denied.value.code == "invalid_api_key"

    with pytest.raises(openai.BadRequestError) as stops:  # OpenAI's limits: 4 stop sequences, metadata 64/512
        oai.chat.completions.create(model="conductor", messages=[{"role": "user", "content": "x"}],
                                    stop=["a", "b", "c", "d", "e"])
    assert stops.value.param == "stop" or "stop" in stops.value.message
    with pytest.raises(openai.BadRequestError) as meta:
        oai.chat.completions.create(model="conductor", messages=[{"role": "user", "content": "x"}],
                                    metadata={"k": "v" * 513})
    assert "metadata" in (meta.value.param or "") + meta.value.message
    huge = http.post("/v1/chat/completions", json={"model": "conductor", "messages": [
        {"role": "user", "content": [{"type": "image_url"}] * 64}]})
    assert huge.status_code == 400 and len(huge.content) < 20_000, len(huge.content)  # 20 of its errors said

    r = httpx.post(f"{api}/v1/chat/completions", json={"model": "conductor", "messages": "x"})
    body = r.json()
    assert r.status_code == 401 and r.headers["content-type"] == "application/json"
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    # The rest of the API keeps problem+json.
    r = httpx.get(f"{api}/v1/jobs")
    assert r.status_code == 401 and r.headers["content-type"].startswith("application/problem+json")


def test_a_job_outlasting_the_wait_is_a_504_and_goes_on(proc_env: dict[str, str], key: str, http: httpx.Client,
                                                        workers: Any) -> None:
    """With a 1 s wait, a job whose planner takes longer answers 504 (no retry) naming the job, which
    still ends normally."""
    proc, url = start_api({**proc_env, "CONDUCTOR_CHAT_MAX_WAIT_S": "1", "CONDUCTOR_TENANT_MAX_STREAMS": "1"})
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as late:
                client.chat.completions.create(model="conductor/slow", messages=[{"role": "user", "content": "z"}])
            assert late.value.status_code == 504 and late.value.code == "job_timeout"
            assert late.value.response.headers["x-should-retry"] == "false"
            job_id = late.value.response.headers["conductor-job-id"]
            assert job_id in late.value.message
            stream = client.chat.completions.create(model="conductor/slow", stream=True,
                                                    messages=[{"role": "user", "content": "z"}])
            with pytest.raises(openai.APIError) as streamed:
                list(stream)
            assert "still running" in streamed.value.message
            streamed_job_id = stream.response.headers["conductor-job-id"]

            # A stream holds one of the tenant's stream slots (1 here) until it ends.
            body = {"model": "conductor/slow", "stream": True, "messages": [{"role": "user", "content": "w"}]}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30,
                              headers={"Authorization": f"Bearer {key}"}) as first:
                lines = first.iter_lines()  # kept: a dropped iterator would close the connection
                assert first.status_code == 200 and next(lines).startswith("data: ")
                with pytest.raises(openai.RateLimitError) as crowded:
                    client.chat.completions.create(**body)
                assert crowded.value.code == "rate_limit_exceeded"
                assert int(crowded.value.response.headers["retry-after"]) >= 1
                assert [line for line in lines if line][-1] == "data: [DONE]"
            third = client.chat.completions.create(**body)
            with pytest.raises(openai.APIError):
                list(third)  # admitted again once the first stream had ended (and then outlasted the wait)
            slot_job_ids = [first.headers["conductor-job-id"], third.response.headers["conductor-job-id"]]
    finally:
        proc.stop()
    assert wait_terminal(http, job_id)["status"] == "succeeded"
    assert wait_terminal(http, streamed_job_id)["status"] == "succeeded"
    for other in slot_job_ids:
        assert wait_terminal(http, other)["status"] == "succeeded"



def _job_of(tenant: str) -> Any:
    with session_scope() as s:
        jobs = jobs_store.list_jobs(s, tenant=tenant, limit=1)
    return jobs[0] if jobs else None


def _ended(job_id: str) -> Any:
    for _ in range(600):
        with session_scope() as s:
            job = jobs_store.get_job(s, job_id=job_id)
        if job is not None and job.status in ("succeeded", "failed", "cancelled"):
            return job
        threading.Event().wait(0.1)
    raise AssertionError(f"job {job_id} did not end")


def test_a_revoked_key_ends_the_wait_and_the_stream(api: str, workers: Any) -> None:
    """The key is looked up again every few seconds, as a job event stream does: revoked, a waiting chat completion
    answers 401 and a stream ends with an error event, each naming the job, which goes on to its end."""

    def revoke_once_submitted(tenant: str, key: str) -> None:
        for _ in range(600):
            if _job_of(tenant) is not None:
                with session_scope() as s:
                    revoke_key(s, prefix=key[:10])
                return
            threading.Event().wait(0.05)

    waiting_key = new_key("chat-revoked-wait")
    revoker = threading.Thread(target=revoke_once_submitted, args=("chat-revoked-wait", waiting_key))
    revoker.start()
    with (openai.OpenAI(base_url=f"{api}/v1", api_key=waiting_key, max_retries=0) as client,
          pytest.raises(openai.AuthenticationError) as revoked):
        client.chat.completions.create(model="conductor/slow", messages=[{"role": "user", "content": "z"}])
    revoker.join(30)
    assert revoked.value.code == "invalid_api_key" and "revoked while this request waited" in revoked.value.message
    job_id = revoked.value.response.headers["conductor-job-id"]
    assert job_id in revoked.value.message and _ended(job_id).status == "succeeded"

    streaming_key = new_key("chat-revoked-stream")
    with openai.OpenAI(base_url=f"{api}/v1", api_key=streaming_key, max_retries=0) as client:
        stream = client.chat.completions.create(model="conductor/slow", stream=True,
                                                messages=[{"role": "user", "content": "z"}])
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.role == "assistant"
        with session_scope() as s:
            assert revoke_key(s, prefix=streaming_key[:10]) == 1
        answered = []
        with pytest.raises(openai.APIError) as ended:
            for chunk in chunks:
                answered += [c.delta.content for c in chunk.choices if c.delta.content]
        assert "revoked while this request waited" in ended.value.message and answered == []
    streamed = _job_of("chat-revoked-stream")
    assert streamed is not None and _ended(streamed.id).status == "succeeded"  # it went on without the stream
