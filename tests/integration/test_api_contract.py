"""Promises the API makes: idempotency, tenant isolation, size limits, cancellation, failure semantics."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import new_key
from tests.integration.harness import wait_terminal


def wf(model_ids: list[str], access: list[Any]) -> dict[str, Any]:
    return {"model_ids": model_ids, "subtasks": [f"part {i}" for i in range(len(model_ids))], "access_lists": access}


def run(client: httpx.Client, model_ids: list[str], access: list[Any]) -> dict[str, Any]:
    created = client.post("/v1/jobs", json={"task": "t", "workflow": wf(model_ids, access)})
    assert created.status_code == 202, created.text
    return wait_terminal(client, created.json()["id"])


def test_idempotency_key_returns_the_same_job(client: httpx.Client) -> None:
    body = {"task": "idempotent task", "workflow": wf(["a"], [[]])}
    first = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "key-1"})
    again = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "key-1"})
    assert first.status_code == again.status_code == 202
    assert first.json()["id"] == again.json()["id"]
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    job_id = first.json()["id"]
    assert first.headers["Location"] == again.headers["Location"] == f"/v1/jobs/{job_id}"
    assert first.headers["content-type"] == "application/json"
    assert first.json() == {"id": job_id, "status": "queued", "enqueued": True, "links": {
        "self": f"/v1/jobs/{job_id}", "steps": f"/v1/jobs/{job_id}/steps", "events": f"/v1/jobs/{job_id}/events",
        "trace": f"/ui/jobs/{job_id}"}}
    other = client.post("/v1/jobs", json={**body, "task": "different"}, headers={"Idempotency-Key": "key-1"})
    assert other.status_code == 422 and other.json()["errors"][0]["loc"] == ["header", "Idempotency-Key"]
    assert wait_terminal(client, first.json()["id"])["status"] == "succeeded"


def test_another_tenants_job_is_not_found(client: httpx.Client, api: str) -> None:
    job_id = client.post("/v1/jobs", json={"task": "tenant a's secret", "workflow": wf(["a"], [[]])}).json()["id"]
    with httpx.Client(base_url=api, headers={"Authorization": f"Bearer {new_key('tenant-b')}"}) as other:
        assert other.get(f"/v1/jobs/{job_id}").status_code == 404
        assert other.get(f"/v1/jobs/{job_id}/steps").status_code == 404
        assert other.post(f"/v1/jobs/{job_id}/cancel").status_code == 404
        assert job_id not in [j["id"] for j in other.get("/v1/jobs").json()["data"]]
        # The same idempotency key in another tenant is another job.
        body = {"task": "t", "workflow": wf(["a"], [[]])}
        mine = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "shared"}).json()["id"]
        theirs = other.post("/v1/jobs", json=body, headers={"Idempotency-Key": "shared"}).json()["id"]
        assert mine != theirs
    assert job_id in [j["id"] for j in client.get("/v1/jobs").json()["data"]]


def test_oversize_body_is_413(client: httpx.Client) -> None:
    r = client.post("/v1/jobs", content=b'{"task": "' + b"x" * 1_100_000 + b'"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.headers["content-type"].startswith("application/problem+json")


def test_oversize_chunked_body_is_413_without_a_length(client: httpx.Client) -> None:
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"task": "'
        for _ in range(40):
            yield b"x" * 65_536
        yield b'"}'

    r = client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert r.headers["content-type"].startswith("application/problem+json")


def test_retry_after_429_then_500_then_success(client: httpx.Client) -> None:
    job = run(client, ["flaky"], [[]])
    assert job["status"] == "succeeded"
    [step] = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    errors = [(a["n"], (a["error"] or {}).get("type")) for a in step["attempts"]]
    assert errors == [(1, "rate_limited"), (2, "server_error"), (3, None)]
    assert step["output"] == "[flaky] part 0" and job["usage"]["calls"] == 3


def test_a_step_that_always_fails_fails_the_job_and_skips_the_rest(client: httpx.Client) -> None:
    job = run(client, ["broken", "a", "b"], [[], [0], [1]])
    assert job["status"] == "failed"
    assert job["error"]["step"] == 0 and job["error"]["type"] == "server_error"
    assert "step 0 failed" in job["error"]["message"] and "gave up after 4 attempts" in job["error"]["message"]
    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    assert [s["status"] for s in steps] == ["failed", "skipped", "skipped"]
    assert len(steps[0]["attempts"]) == 4 and steps[0]["output"] is None


def test_a_bad_request_is_not_retried(client: httpx.Client) -> None:
    job = run(client, ["refuses"], [[]])
    assert job["status"] == "failed" and "not retryable, after 1 attempt" in job["error"]["message"]


def test_cancel_mid_run(client: httpx.Client) -> None:
    created = client.post("/v1/jobs", json={"task": "t", "workflow": wf(["slow", "a"], [[], [0]])})
    job_id = created.json()["id"]
    deadline = time.monotonic() + 30
    while True:  # wait until step 0's call is in flight (an attempt exists), then cancel
        steps = client.get(f"/v1/jobs/{job_id}/steps").json()["data"]
        if steps and steps[0]["attempts"]:
            break
        assert time.monotonic() < deadline, "step 0 never started"
        time.sleep(0.05)
    r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    # The slow call finishes after the cancel; its answer must be dropped, and step 1 must never start.
    steps = client.get(f"/v1/jobs/{job_id}/steps").json()["data"]
    while not steps[0]["attempts"] or steps[0]["attempts"][-1]["finished_at"] is None:
        assert time.monotonic() < deadline, "the running attempt never finished"
        time.sleep(0.1)
        steps = client.get(f"/v1/jobs/{job_id}/steps").json()["data"]
    time.sleep(0.5)
    steps = client.get(f"/v1/jobs/{job_id}/steps").json()["data"]
    assert [s["status"] for s in steps] == ["cancelled", "cancelled"]
    assert steps[0]["output"] is None and steps[1]["attempts"] == []
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "cancelled" and job["answer"] is None
    # The dropped call was still paid for: its usage is on the step and in the job's totals.
    assert steps[0]["usage"]["input_tokens"] > 0 and steps[0]["usage"]["output_tokens"] > 0
    assert job["usage"]["input_tokens"] == steps[0]["usage"]["input_tokens"] and job["usage"]["calls"] == 1
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 409


def test_token_budget_refuses_the_step_that_would_exceed_it(client: httpx.Client) -> None:
    # step 0: 61 tokens in (the tenant's cache scope among them), 3 out; step 1 would send 66 more
    body = {"task": "t", "workflow": wf(["a", "b", "c"], [[], [0], [1]]), "limits": {"max_tokens": 67}}
    job = wait_terminal(client, client.post("/v1/jobs", json=body).json()["id"])
    assert job["status"] == "failed" and job["error"]["type"] == "budget_exceeded", job
    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    failed = steps[job["error"]["step"]]
    assert failed["status"] == "failed" and failed["attempts"] == [] and "token budget 67" in failed["error"]["message"]
    assert steps[0]["status"] == "succeeded"  # the budget admitted the first step
    assert job["usage"]["input_tokens"] + job["usage"]["output_tokens"] <= 67


def test_deadline_fails_the_job_clearly(client: httpx.Client) -> None:
    body = {"task": "t", "workflow": wf(["slow", "a"], [[], [0]]), "limits": {"deadline_s": 1}}
    job = wait_terminal(client, client.post("/v1/jobs", json=body).json()["id"])
    assert job["status"] == "failed" and job["error"]["type"] == "deadline_exceeded", job
    assert "deadline of 1" in job["error"]["message"]


def test_events_stream_follows_the_job_to_its_end(client: httpx.Client) -> None:
    created = client.post("/v1/jobs", json={"task": "t", "workflow": wf(["a", "b"], [[], [0]])})
    events: list[tuple[str, dict[str, Any]]] = []
    with client.stream("GET", f"/v1/jobs/{created.json()['id']}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        kind = ""
        for line in stream.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((kind, json.loads(line.removeprefix("data: "))))
    job_states = [e["status"] for k, e in events if k == "job"]
    assert job_states[-1] == "succeeded" and events[-1][1]["answer"] == "[b] part 1"
    step1 = [e["status"] for k, e in events if k == "step" and e["index"] == 1]
    assert step1[-1] == "succeeded" and step1 == sorted(set(step1), key=step1.index)  # no repeats
    order = [(e["index"], e["status"]) for k, e in events if k == "step"]
    first_step1_running = next(i for i, ev in enumerate(order) if ev[0] == 1 and ev[1] in ("running", "succeeded"))
    assert order.index((0, "succeeded")) < first_step1_running  # the chain's order is visible in the stream


def test_requests_per_minute_are_shared_by_all_steps_of_an_agent(client: httpx.Client) -> None:
    # Agent `limited` allows 2 requests per minute across every worker: of three parallel steps two
    # get a token at once; the third is told to come back in ~30 s, which the 5 s deadline forbids.
    body = {"task": "t", "workflow": wf(["limited", "limited", "limited"], [[], [], []]), "limits": {"deadline_s": 5}}
    job = wait_terminal(client, client.post("/v1/jobs", json=body).json()["id"])
    # The job fails at once. A call in flight at that moment ends its step as skipped, and what it
    # finishes is still counted on the step and in the job's usage: wait until both granted calls are.
    def granted() -> list[dict[str, Any]]:
        steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
        return [s for s in steps if s["status"] != "failed"]

    deadline = time.monotonic() + 30
    while not all(s["usage"]["output_tokens"] > 0 for s in granted()) and time.monotonic() < deadline:
        time.sleep(0.1)
    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    [refused] = [s for s in steps if s["status"] == "failed"]
    assert [a["error"]["type"] for a in refused["attempts"]] == ["rate_limit_timeout"]
    others = [s for s in steps if s is not refused]
    assert all(s["status"] in ("succeeded", "skipped") and s["usage"]["output_tokens"] > 0 for s in others), steps
    ended = client.get(f"/v1/jobs/{job['id']}").json()
    assert ended["usage"]["output_tokens"] == sum(s["usage"]["output_tokens"] for s in others)
    assert job["status"] == "failed" and job["error"]["type"] == "deadline_exceeded"


def test_a_misconfigured_agent_fails_the_job_instead_of_hanging(client: httpx.Client) -> None:
    job = run(client, ["misconfigured"], [[]])
    assert job["status"] == "failed" and job["error"]["type"] == "config_error", job
    assert "base_url" in job["error"]["message"]


def test_a_body_built_to_fail_everywhere_gets_a_short_answer(client: httpx.Client, api: str) -> None:
    """A refusal lists at most 20 problems and says how many more; it is never the size of the body."""
    forward = {"task": "t", "workflow": {"steps": [
        {"agent": "a", "instruction": "x", "access_list": [1] * 10_000}]}}
    many_keys = {"task": "t", **{f"k{i}": 0 for i in range(20_000)}}
    bad_steps = {"task": "t", "workflow": {"steps": [
        {"agent": "nobody", "instruction": "", "access_list": [7] * 10}] * 5}}
    for body in (forward, many_keys, bad_steps):
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 422 and len(r.content) < 20_000, (r.status_code, len(r.content))
    assert "10000 entries" in client.post("/v1/jobs", json=forward).json()["detail"]
    errors = client.post("/v1/jobs", json=bad_steps).json()["errors"]
    assert len(errors) == 21 and "40 more" in errors[-1]["msg"]  # 12 problems in each of 5 steps: 20 shown

    with httpx.Client(base_url=api, timeout=30) as anonymous:  # no key: 401, before the body is judged
        r = anonymous.post("/v1/jobs", json=many_keys)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text


def test_a_body_that_is_not_json_is_401_without_a_key_and_422_with_one(client: httpx.Client, api: str) -> None:
    """FastAPI parses JSON before any dependency runs; the key is still judged first."""
    junk, json_type = b"{not json", {"Content-Type": "application/json"}
    with httpx.Client(base_url=api, timeout=30) as anonymous:
        r = anonymous.post("/v1/jobs", content=junk, headers=json_type)
        assert r.status_code == 401 and r.json()["title"] == "Unauthorized", r.text
        r = anonymous.post("/v1/chat/completions", content=junk, headers=json_type)
        assert r.status_code == 401 and "error" in r.json(), r.text  # in OpenAI's error shape there
    r = client.post("/v1/jobs", content=junk, headers=json_type)
    assert r.status_code == 422 and r.json()["errors"][0]["loc"][0] == "body", r.text
    r = client.post("/v1/chat/completions", content=junk, headers=json_type)
    assert r.status_code in (400, 422) and "error" in r.json(), r.text


def test_a_refused_body_with_an_unknown_key_is_401_not_a_list_of_its_fields(client: httpx.Client, api: str) -> None:
    """POST /v1/jobs looks its key up in the endpoint, after FastAPI has validated the body: a wrong key
    (not a missing one) got the body's field-by-field 422. A refused body's key is now looked up first,
    on every /v1/ route and whichever way the body was refused (invalid fields, JSON that does not parse)."""
    invalid = {"task": 5, "limits": {"max_steps": "x"}}
    junk, json_type = b"{not json", {"Content-Type": "application/json"}
    wrong = {"Authorization": "Bearer cq_" + "x" * 40}
    with httpx.Client(base_url=api, timeout=30, headers=wrong) as stranger:
        for r in (stranger.post("/v1/jobs", json=invalid),
                  stranger.post("/v1/jobs", content=junk, headers=json_type)):
            assert r.status_code == 401, r.text
            assert r.json()["detail"] == "unknown or revoked API key" and "errors" not in r.json(), r.text
        for path in ("/v1/responses", "/v1/chat/completions"):  # was 400 'could not be read as JSON'
            r = stranger.post(path, content=junk, headers=json_type)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    r = client.post("/v1/jobs", json=invalid)  # a valid key still gets the fields named
    assert r.status_code == 422 and {tuple(e["loc"]) for e in r.json()["errors"]} == {
        ("body", "task"), ("body", "limits", "max_steps")}, r.text
    r = client.post(f"/v1/jobs/{run(client, ['a'], [[]])['id']}/replay", json={"from_step": "x"})
    assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body", "from_step"], r.text
    r = client.post("/v1/responses", content=junk, headers=json_type)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text


def test_a_refusal_looks_a_key_up_only_where_no_dependency_found_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused body's key is looked up by the refusal on POST /v1/jobs (its key is looked up in the
    endpoint, which a refused body never reaches) and for a body that does not parse (refused before any
    dependency), once; not again on a route whose tenant dependency found it before the body was judged.
    In process, to count the refusal's lookups; the database and key are real."""
    from fastapi.testclient import TestClient

    from conductor.service import app as service_app

    looked_up: list[str | None] = []
    known_key = service_app._known_key
    monkeypatch.setattr(service_app, "_known_key", lambda settings, authorization: (
        looked_up.append(authorization), known_key(settings, authorization))[1])
    headers = {"Authorization": f"Bearer {new_key('tenant-refusal-lookups')}"}
    with TestClient(service_app.create_app()) as http:
        r = http.post("/v1/jobs/nope/replay", json={"from_step": "x"}, headers=headers)
        assert r.status_code == 422 and looked_up == [], (r.text, looked_up)
        r = http.post("/v1/jobs", json={"task": 5}, headers=headers)
        assert r.status_code == 422 and looked_up == [headers["Authorization"]], (r.text, looked_up)
        looked_up.clear()  # a body that does not parse is refused before any dependency runs: looked up once
        r = http.post("/v1/responses", content=b"{not json", headers={**headers, "Content-Type": "application/json"})
        assert r.status_code == 400 and looked_up == [headers["Authorization"]], (r.text, looked_up)


def test_a_body_json_cannot_read_is_401_without_a_key_and_a_clear_refusal_with_one(
    client: httpx.Client, api: str
) -> None:
    """Bodies whose parse raises something other than a JSON syntax error (bytes that are not UTF-8
    inside a string, nesting deeper than the parser recurses) or a multipart body the form parser refuses:
    FastAPI answered them 400 'There was an error parsing the body' before any key was asked for."""
    json_type = {"Content-Type": "application/json"}
    not_utf8 = b'{"task": "\xff"}'
    too_deep = b'{"task": "t", "metadata": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
    broken_form = {"Content-Type": "multipart/form-data"}
    with httpx.Client(base_url=api, timeout=30) as anonymous:
        for path in ("/v1/jobs", "/v1/chat/completions", "/v1/batches"):
            for body in (not_utf8, too_deep):
                r = anonymous.post(path, content=body, headers=json_type)
                assert r.status_code == 401, (path, r.text)
        r = anonymous.post("/v1/files", content=b"garbage", headers=broken_form)
        assert r.status_code == 401, r.text
    for body, why in ((not_utf8, "not valid UTF-8"), (too_deep, "nested too deeply")):
        r = client.post("/v1/jobs", content=body, headers=json_type)
        assert r.status_code == 422 and r.json()["errors"][0]["loc"] == ["body"], r.text
        assert why in r.json()["detail"], r.text
        r = client.post("/v1/chat/completions", content=body, headers=json_type)
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text  # OpenAI's shape there


def test_an_upload_whose_multipart_body_cannot_be_parsed_is_refused_naming_the_cause(
    client: httpx.Client, api: str
) -> None:
    """A keyed upload whose multipart body names no boundary got Starlette's 'Missing boundary in multipart.',
    and one whose file name is ~5,000 characters python-multipart's 'Invalid multipart data.' (a part's
    header line is at most 4,224 bytes): neither said what to send. Now they are the validation refusal
    (400 in the OpenAI shape on /v1/files, as every refused body there; 422 problem+json elsewhere) saying
    why: the parser's refusal names any part's header line over its limit (a long name is one cause, a
    percent-encoded filename* or a long field name others), not the route's own 1,000-character name limit,
    which a name the parser reads is refused by; a name within it is kept."""
    r = client.post("/v1/files", content=b"--x\r\n\r\n--x--\r\n", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 400 and "names no boundary" in r.json()["error"]["message"], r.text
    r = client.post("/ui/login", content=b"--x\r\n\r\n--x--\r\n", headers={"Content-Type": "multipart/form-data"})
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text
    assert "names no boundary" in r.json()["detail"] and r.json()["errors"][0]["loc"] == ["body"], r.text
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/jobs", "body": {"task": "t"}}\n'
    over_the_line = "a part's header line is over 4,224 bytes (for instance the file's name)"
    r = client.post("/v1/files", files={"file": ("x" * 5_000 + ".jsonl", line)}, data={"purpose": "batch"})
    assert r.status_code == 400 and over_the_line in r.json()["error"]["message"], r.text  # past the parser
    assert "1,000" not in r.json()["error"]["message"], r.text  # (not the route's own figure: not its check)
    # any part's header line, not only a long name: an RFC 2231 filename* of 360 characters (12 bytes each,
    # percent-encoded), a field's name of 5,000 characters
    encoded = "%F0%9F%98%80" * 360
    body = (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--b\r\n"
            b"Content-Disposition: form-data; name=\"file\"; filename*=UTF-8''" + encoded.encode() +
            b"\r\nContent-Type: application/jsonl\r\n\r\n" + line + b"\r\n--b--\r\n")
    r = client.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert r.status_code == 400 and over_the_line in r.json()["error"]["message"], r.text
    r = client.post("/v1/files", files={"file": ("a.jsonl", line)}, data={"purpose": "batch", "p" * 5_000: "x"})
    assert r.status_code == 400 and over_the_line in r.json()["error"]["message"], r.text
    for name in ("\u00e9" * 1_500 + ".jsonl", "x" * 1_001):  # read by the parser, past ours
        r = client.post("/v1/files", files={"file": (name, line)}, data={"purpose": "batch"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "file", (len(name), r.text)
        assert "it may be at most 1,000 (MAX_UPLOAD_FILENAME_CHARS)" in r.json()["error"]["message"], r.text
    r = client.post("/v1/files", files={"file": ("\u00e9" * 1_000, line)}, data={"purpose": "batch"})
    assert r.status_code == 200 and r.json()["filename"] == "\u00e9" * 255, r.text  # kept, cut to 255
    with httpx.Client(base_url=api, timeout=30) as anonymous:  # and still: no key, 401 before any of it
        r = anonymous.post("/v1/files", files={"file": ("x" * 5_000, line)}, data={"purpose": "batch"})
        assert r.status_code == 401, r.text


def test_an_overlong_key_posted_to_the_viewers_login_gets_the_login_page_saying_so(api: str) -> None:
    """The form's own validation refused a key over MAX_KEY_CHARS (or none) with a problem+json document,
    shown raw to the person who pasted it."""
    with httpx.Client(base_url=api, timeout=30) as browser:
        for key, says in (("k" * 300, "at most 256 characters"), ("  ", "Paste an API key")):
            r = browser.post("/ui/login", data={"key": key, "next": "/ui/jobs"})
            assert r.status_code == 422 and r.headers["content-type"].startswith("text/html"), r.text
            assert says in r.text and 'action="/ui/login"' in r.text and "set-cookie" not in r.headers, r.text


def test_a_workflow_with_fields_it_does_not_use_is_refused(client: httpx.Client) -> None:
    steps = [{"agent": "a", "instruction": "x", "access_list": []}]
    for workflow in ({"steps": steps, "junk": "x" * 1000}, {**wf(["a"], [[]]), "notes": "kept?"}):
        r = client.post("/v1/jobs", json={"task": "t", "workflow": workflow})
        assert r.status_code == 422 and "unexpected fields" in r.json()["detail"], r.text
    assert client.post("/v1/jobs", json={"task": "t", "workflow": {"steps": steps}}).status_code == 202


def _raw_get(api: str, path: str, headers: dict[str, str], piece: int = 2048) -> bytes:
    """A GET written a ``piece`` at a time with a pause between, so the server's HTTP parser sees the
    headers arrive in many reads (as over a real network), not in one."""
    url = httpx.URL(api)
    lines = [f"GET {path} HTTP/1.1", f"Host: {url.host}:{url.port}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode()
    with socket.create_connection((url.host, url.port), timeout=30) as sock:
        for at in range(0, len(data), piece):
            sock.sendall(data[at:at + piece])
            time.sleep(0.005)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_request_headers_are_limited_by_a_named_setting(client: httpx.Client, api: str) -> None:
    """CONDUCTOR_MAX_HEADER_BYTES (32 KiB): more is a 431 naming it. Before, the only bound was h11's
    16 KiB buffer, enforced only when headers arrived in several reads (a plain-text 400), so whether a
    20 KiB header passed depended on the network, and 100 KB sent at once did."""
    key = client.headers["Authorization"]
    r = client.get("/v1/jobs", headers={"X-Padding": "p" * 40_000})
    assert r.status_code == 431 and "CONDUCTOR_MAX_HEADER_BYTES" in r.json()["detail"], r.text
    r = client.post("/v1/chat/completions", headers={"X-Padding": "p" * 40_000}, json={})
    assert r.status_code == 431 and "CONDUCTOR_MAX_HEADER_BYTES" in r.json()["error"]["message"], r.text
    within = _raw_get(api, "/v1/jobs?limit=1", {"Authorization": key, "X-Padding": "p" * 30_000})
    assert within.startswith(b"HTTP/1.1 200 "), within[:300]
    over = _raw_get(api, "/v1/jobs?limit=1", {"Authorization": key, "X-Padding": "p" * 40_000})
    assert over.startswith(b"HTTP/1.1 431 "), over[:300]


def _answer_to_a_body_never_sent(api: str, path: str, headers: dict[str, str], start: bytes,
                                 declared: int) -> bytes:
    """Sends a request's headers declaring a ``declared``-byte body and only its ``start`` (well-formed
    so far), then reads the answer: one that comes is one the server gave without reading the body (it
    would wait for the rest before parsing it). What came within the socket's timeout otherwise."""
    url = httpx.URL(api)
    lines = [f"POST {path} HTTP/1.1", f"Host: {url.host}:{url.port}", f"Content-Length: {declared}",
             *(f"{k}: {v}" for k, v in headers.items())]
    answer = b""
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + start)
        try:
            while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < int(
                    answer.lower().partition(b"content-length: ")[2].split(b"\r\n")[0] or 0):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        except TimeoutError:
            pass
    return answer


def test_a_body_is_not_read_for_a_caller_without_a_valid_key(client: httpx.Client, api: str) -> None:
    """Every /v1/ route needs a key, so a body sent without one is never read: before, FastAPI read and
    parsed it first (a 10 MB batch upload spooled to disk for anyone) and then answered 401. An upload,
    the one large body, also has its key looked up before it is read; other routes judge a key that
    is present but wrong after the body, as before (the lookup is the endpoint's)."""
    form = {"Content-Type": "multipart/form-data; boundary=b"}
    upload = b'--b\r\nContent-Disposition: form-data; name="file"; filename="q.jsonl"\r\n\r\n' + b"{}\n" * 300
    anonymous = _answer_to_a_body_never_sent(api, "/v1/files", form, upload, 5_000_000)
    assert anonymous.startswith(b"HTTP/1.1 401 "), anonymous[:300]
    assert b"invalid_api_key" in anonymous, anonymous  # in OpenAI's shape there
    wrong_key = _answer_to_a_body_never_sent(api, "/v1/files", {**form, "Authorization": "Bearer cq_wrong"},
                                             upload, 5_000_000)
    assert wrong_key.startswith(b"HTTP/1.1 401 ") and b"revoked" in wrong_key, wrong_key[:300]
    json_body = _answer_to_a_body_never_sent(api, "/v1/jobs", {"Content-Type": "application/json"},
                                             b'{"task": "' + b"t" * 1000, 500_000)
    assert json_body.startswith(b"HTTP/1.1 401 ") and b"Bearer" in json_body, json_body[:300]
    ok = client.post("/v1/files", files={"file": ("q.jsonl", b'{"custom_id": "q", "method": "POST", '
                                         b'"url": "/v1/jobs", "body": {"task": "t"}}')}, data={"purpose": "batch"})
    assert ok.status_code == 200, ok.text


def test_an_upload_whose_key_cannot_be_looked_up_is_503_not_500(monkeypatch: pytest.MonkeyPatch) -> None:
    """The upload's key is looked up in a middleware, outside the app's exception handlers: a database
    away there is answered as the handlers would (503, Retry-After), not as an unexpected error. The API
    runs in-process so the lookup can fail at that point; the database and the key are real."""
    from fastapi.testclient import TestClient
    from sqlalchemy.exc import OperationalError

    from conductor.service import app as service_app

    def away(*_: Any) -> None:
        raise OperationalError("SELECT api_key.tenant", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(service_app, "_known_key", away)
    with TestClient(service_app.create_app(), raise_server_exceptions=False) as http:
        r = http.post("/v1/files", headers={"Authorization": f"Bearer {new_key('tenant-upload-db-away')}"},
                      files={"file": ("q.jsonl", b"{}")}, data={"purpose": "batch"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert r.json()["error"]["code"] == "service_unavailable", r.text
