"""Fuzzed API input (schemathesis 4) against the live API over HTTP: nothing a client sends gets a 5xx.

The OpenAPI schema is the one the server publishes, built from the same code. Every case carries a real
API key, so generated input reaches validation, the job store and the enqueue path instead of stopping at
the 401. About half of the cases that take a ``job_id`` are pointed at a real job of the caller's tenant,
so reads, cancels and event streams run against stored rows, not only 404s (streams get a finished job,
whose stream ends at once). Jobs created here are enqueued to this run's Redis db, where the session's
workers (started by earlier modules, if any ran) may run them: generated reads and cancels then meet jobs
queued, running or ended, depending on the order the modules ran in, and none of those may give a 5xx.

``CONDUCTOR_FUZZ_EXAMPLES`` raises the number of generated cases per operation for a deeper local run.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from conductor.service.app import create_app
from tests.integration.conftest import new_key

pytestmark = pytest.mark.integration

MAX_EXAMPLES = int(os.environ.get("CONDUCTOR_FUZZ_EXAMPLES", "30"))

# Valid and invalid data; the coverage phase adds the boundaries (empty task, limit 0 and 201, wrong types).
FUZZ_CONFIG = {
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES},
    "phases": {"examples": {"enabled": True}, "coverage": {"enabled": True}, "fuzzing": {"enabled": True}},
}
FUZZ_SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
    database=None,
)

# Loaded eagerly so pytest parametrizes by operation: schemathesis's fixture-based (lazy) loader fails
# under pytest 9 ("'Function' object has no attribute '_nodeid'").
schema = schemathesis.openapi.from_dict(create_app().openapi(), config=schemathesis.Config.from_dict(FUZZ_CONFIG))


@pytest.fixture(scope="module")
def auth_headers(api: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {new_key('tenant-fuzz')}"}


@dataclass(frozen=True)
class SeededJobs:
    live: list[str]  # not ended when seeded (a session worker may run them meanwhile)
    finished: list[str]  # cancelled up front: their event streams end at once
    files: list[str]  # a batch input file
    batches: list[str]  # in progress when seeded


@pytest.fixture(scope="module")
def seeded_jobs(api: str, auth_headers: dict[str, str]) -> SeededJobs:
    """Real jobs of the fuzzing tenant, for the generated reads and cancels to hit."""
    workflow = {"model_ids": ["a", "b"], "subtasks": ["draft it", "check it"], "access_lists": [[], "all"]}
    ids = []
    with httpx.Client(base_url=api, headers=auth_headers, timeout=30) as c:
        for n in range(4):
            r = c.post("/v1/jobs", json={"task": f"seeded job {n}", "workflow": workflow})
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        finished = ids[3:]
        for job_id in finished:
            assert c.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        line = {"custom_id": "seed", "method": "POST", "url": "/v1/jobs", "body": {"task": "t", "workflow": workflow}}
        upload = c.post("/v1/files", data={"purpose": "batch"}, files={"file": ("seed.jsonl", json.dumps(line))})
        assert upload.status_code == 200, upload.text
        batch = c.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/jobs",
                                            "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
    return SeededJobs(live=ids[:3], finished=finished, files=[upload.json()["id"]], batches=[batch.json()["id"]])


# Operations whose response streams for as long as the job runs: a live job would hold the request open.
STREAMING_SUFFIXES = ("/events",)


def _point_at_real_job(case: Any, seeded: SeededJobs) -> None:
    """Swaps about half of the generated job, file and batch ids (in paths, and a batch's
    ``input_file_id``) for real ones. Derived from the generated value rather than drawn with
    ``schema.given``, because extra strategies switch schemathesis's coverage phase off."""
    for name, pool in (("job_id", seeded.live), ("file_id", seeded.files), ("batch_id", seeded.batches)):
        generated = (case.path_parameters or {}).get(name)
        if not isinstance(generated, str):
            continue
        n = zlib.crc32(generated.encode())
        if n % 2 == 0:
            if name == "job_id" and case.operation.path.endswith(STREAMING_SUFFIXES):
                pool = seeded.finished
            case.path_parameters[name] = pool[(n // 2) % len(pool)]
    file_id = case.body.get("input_file_id") if isinstance(case.body, dict) else None
    # Only a value the schema allows is swapped: a negative case stays as invalid as it was generated.
    if isinstance(file_id, str) and 1 <= len(file_id) <= 64 and zlib.crc32(file_id.encode()) % 2 == 0:
        case.body["input_file_id"] = seeded.files[0]


@schema.parametrize()
@FUZZ_SETTINGS
def test_no_server_errors(case: Any, api: str, auth_headers: dict[str, str], seeded_jobs: SeededJobs) -> None:
    """Whatever arrives, the API answers 2xx or 4xx, never 5xx; and input its schema calls invalid is refused."""
    _point_at_real_job(case, seeded_jobs)
    case.call_and_validate(
        base_url=api, headers=auth_headers, checks=[not_a_server_error, negative_data_rejection], timeout=30
    )


# Values valid JSON and valid per the schema's types that PostgreSQL cannot store: NUL characters in text
# and JSONB, unpaired UTF-16 surrogates (not encodable as UTF-8) in the free-form objects, Infinity/NaN
# (Python's json accepts them) in JSONB, and a URL whose normalized form (IDNA,
# percent-encoding) outgrows the 2048-character column although the input was under pydantic's 2083.
# They are the client's mistake: a 4xx naming the field, never a 5xx that says "retry".
UNSTORABLE_INPUT = [
    pytest.param("GET", "/v1/jobs/%00", None, id="nul-in-job-id"),
    pytest.param("GET", "/v1/jobs/%00/steps", None, id="nul-in-job-id-steps"),
    pytest.param("GET", "/v1/jobs/%00/events", None, id="nul-in-job-id-events"),
    pytest.param("POST", "/v1/jobs/%00/cancel", None, id="nul-in-job-id-cancel"),
    pytest.param("GET", "/v1/jobs?status=%00", None, id="nul-in-status-filter"),
    pytest.param("POST", "/v1/jobs", '{"task": "a\\u0000b"}', id="nul-in-task"),
    pytest.param("POST", "/v1/jobs", '{"task": "t", "metadata": {"k": "\\u0000"}}', id="nul-in-metadata"),
    pytest.param("POST", "/v1/jobs", '{"task": "t", "metadata": {"k\\ud800": "v"}}', id="lone-surrogate-in-metadata"),
    pytest.param("POST", "/v1/jobs", '{"task": "t", "metadata": {"k": 1e400}}', id="infinity-in-metadata"),
    pytest.param("POST", "/v1/jobs", '{"task": "t", "metadata": {"k": NaN}}', id="nan-in-metadata"),
    pytest.param(
        "POST",
        "/v1/jobs",
        '{"task": "t", "workflow": {"model_ids": ["a"], "subtasks": ["x\\u0000"], "access_lists": [[]]}}',
        id="nul-in-workflow",
    ),
    pytest.param(
        "POST",
        "/v1/jobs",
        '{"task": "t", "workflow": {"model_ids": ["a"], "subtasks": ["x\\udbfd"], "access_lists": [[]]}}',
        id="lone-surrogate-in-workflow",
    ),
    pytest.param("POST", "/v1/jobs", '{"task": "t", "webhook_url": "https://a.example/' + "\u00f6" * 600 + '"}',
                 id="webhook-url-longer-than-column-once-encoded"),
]


# The same on the OpenAI-compatible routes: a 4xx in the OpenAI error shape.
UNSTORABLE_OPENAI_INPUT = [
    pytest.param("GET", "/v1/files/%00", None, id="nul-in-file-id"),
    pytest.param("GET", "/v1/files/%00/content", None, id="nul-in-file-id-content"),
    pytest.param("GET", "/v1/batches/%00", None, id="nul-in-batch-id"),
    pytest.param("POST", "/v1/batches/%00/cancel", None, id="nul-in-batch-id-cancel"),
    pytest.param("GET", "/v1/batches?after=%00", None, id="nul-in-batch-cursor"),
    pytest.param("GET", "/v1/models/%00", None, id="nul-in-model"),
    pytest.param("POST", "/v1/batches", '{"input_file_id": "f", "endpoint": "/v1/jobs", "completion_window": "24h", '
                 '"metadata": {"k": "\\u0000"}}', id="nul-in-batch-metadata"),
    pytest.param("POST", "/v1/chat/completions", '{"model": "conductor", "messages": [{"role": "user", '
                 '"content": "a\\u0000"}]}', id="nul-in-chat-message"),
    pytest.param("POST", "/v1/chat/completions", '{"model": "conductor", "messages": [{"role": "user", '
                 '"content": [{"type": "text", "text": "\\udbfd"}]}]}', id="lone-surrogate-in-chat-part"),
    pytest.param("POST", "/v1/chat/completions", '{"model": "conductor\\u0000", "messages": [{"role": "user", '
                 '"content": "x"}]}', id="nul-in-chat-model"),
    pytest.param("GET", "/v1/responses/%00", None, id="nul-in-response-id"),
    pytest.param("POST", "/v1/responses/%00/cancel", None, id="nul-in-response-id-cancel"),
    pytest.param("GET", "/v1/responses/%00/input_items", None, id="nul-in-response-id-input-items"),
    pytest.param("POST", "/v1/responses", '{"model": "conductor", "input": "a\\u0000"}', id="nul-in-response-input"),
    pytest.param("POST", "/v1/responses", '{"model": "conductor", "input": "x", "instructions": "\\udbfd"}',
                 id="lone-surrogate-in-response-instructions"),
    pytest.param("POST", "/v1/responses", '{"model": "conductor", "input": [{"role": "user", "content": '
                 '[{"type": "input_text", "text": "\\u0000"}]}]}', id="nul-in-response-input-part"),
]


@pytest.mark.parametrize(("method", "url", "body"), UNSTORABLE_OPENAI_INPUT)
def test_unstorable_input_is_a_client_error_on_openai_routes(
    method: str, url: str, body: str | None, api: str, auth_headers: dict[str, str]
) -> None:
    headers = {**auth_headers, "Content-Type": "application/json"}
    with httpx.Client(base_url=api, headers=headers, timeout=30) as c:
        r = c.request(method, url, content=body.encode() if body else None)
    assert 400 <= r.status_code < 500, f"{method} {url} -> {r.status_code} {r.text}"
    assert r.headers["content-type"] == "application/json"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("method", "url", "body"), UNSTORABLE_INPUT)
def test_unstorable_input_is_a_client_error(
    method: str, url: str, body: str | None, api: str, auth_headers: dict[str, str]
) -> None:
    headers = {**auth_headers, "Content-Type": "application/json"}
    with httpx.Client(base_url=api, headers=headers, timeout=30) as c:
        r = c.request(method, url, content=body.encode() if body else None)
    assert 400 <= r.status_code < 500, f"{method} {url} -> {r.status_code} {r.text}"
    assert r.headers["content-type"].startswith("application/problem+json")


@schema.exclude(path="/healthz").parametrize()
@FUZZ_SETTINGS
def test_responses_conform_to_schema(case: Any, api: str, auth_headers: dict[str, str]) -> None:
    """Every status code, content type and body the API sends is one its OpenAPI schema declares."""
    case.call_and_validate(
        base_url=api,
        headers=auth_headers,
        checks=[status_code_conformance, content_type_conformance, response_schema_conformance],
        timeout=30,
    )
