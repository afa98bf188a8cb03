"""A failure after a chat completion's job or a batch was saved is answered so that the official ``openai``
client, unchanged and with its default retries, does not send the request again: a retry would start a
second job (or batch) that is paid for too. The API runs in-process (``TestClient`` is the SDK's HTTP
client) so the database can fail at that exact point; everything else is real (Postgres, Redis)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.exc import OperationalError

from conductor.batches import cancel_batch
from conductor.engine import cancel_job
from conductor.service.app import create_app
from conductor.service.routes import batches as batches_route
from conductor.service.routes import openai_chat
from conductor.settings import get_settings
from conductor.store.db import get_engine
from tests.integration.conftest import new_key

LOST = OperationalError("SELECT job.status FROM job", {}, Exception("server closed the connection unexpectedly"))


@pytest.fixture
def http() -> Iterator[TestClient]:
    with TestClient(create_app(), raise_server_exceptions=False) as client:
        yield client


def _sdk(http: TestClient, key: str) -> openai.OpenAI:
    # max_retries=2 is the SDK's default: what a user gets without configuring anything
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=2)


def _ids(table: str, tenant: str) -> list[str]:
    with get_engine(get_settings().database_url).connect() as conn:
        return [r[0] for r in conn.execute(sa.text(f"SELECT id FROM {table} WHERE tenant = :t"), {"t": tenant})]


def test_a_chat_completion_whose_wait_fails_is_answered_once_and_names_its_job(
    http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = "tenant-chat-wait-lost"
    calls = 0

    async def lost(*_: Any, **__: Any) -> None:
        nonlocal calls
        calls += 1
        raise LOST

    monkeypatch.setattr(openai_chat, "_wait_for_end", lost)
    client = _sdk(http, new_key(tenant))

    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="conductor", messages=[{"role": "user", "content": "What is 2+2?"}])

    (job_id,) = _ids("job", tenant)  # one job: the SDK did not send the request again
    assert calls == 1
    assert err.value.status_code == 503
    assert err.value.response.headers["x-should-retry"] == "false"
    assert err.value.response.headers["conductor-job-id"] == job_id
    assert err.value.code == "job_wait_failed"
    assert f"GET /v1/jobs/{job_id}" in err.value.message
    cancel_job(job_id)


def test_a_batch_that_cannot_be_read_back_after_its_commit_is_created_once(
    http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = "tenant-batch-read-lost"
    client = _sdk(http, new_key(tenant))
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "conductor", "messages": [{"role": "user", "content": f"Item {i}"}]}}
             for i in range(3)]
    upload = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")

    def lost(*_: Any, **__: Any) -> None:
        raise LOST

    monkeypatch.setattr(batches_route, "_current", lost)
    with pytest.raises(openai.APIStatusError) as err:
        client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")

    (batch_id,) = _ids("batch", tenant)  # one batch, one job per line: not created again by a retry
    assert len(_ids("job", tenant)) == 3
    assert err.value.status_code == 503
    assert err.value.response.headers["x-should-retry"] == "false"
    assert f"GET /v1/batches/{batch_id}" in err.value.message
    monkeypatch.undo()
    assert client.batches.retrieve(batch_id).id == batch_id  # the batch is there, as the error said
    cancel_batch(batch_id)


def test_a_file_that_no_longer_fits_the_limits_is_a_400_not_a_retried_500(
    http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file uploaded under one limit and run as a batch under a lower one (a redeploy lowered
    CONDUCTOR_BATCH_MAX_LINES): the re-read at create time refused it with an unhandled error, a 500 the
    SDK sent twice more, and the file could never become a batch."""
    tenant = "tenant-batch-limit-lowered"
    client = _sdk(http, new_key(tenant))
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/jobs", "body": {"task": f"Item {i}"}}
             for i in range(5)]
    uploaded = client.files.create(file=("five.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    monkeypatch.setenv("CONDUCTOR_BATCH_MAX_LINES", "2")
    get_settings.cache_clear()
    requests: list[str] = []
    real_send = http.send

    def counted(request: Any, **kwargs: Any) -> Any:
        requests.append(str(request.url))
        return real_send(request, **kwargs)

    monkeypatch.setattr(http, "send", counted)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(input_file_id=uploaded.id, endpoint="/v1/jobs", completion_window="24h")
    finally:
        monkeypatch.delenv("CONDUCTOR_BATCH_MAX_LINES")
        get_settings.cache_clear()
    assert err.value.code == "invalid_file" and err.value.param == "input_file_id"
    assert "more than 2 requests" in err.value.message and "upload it again" in err.value.message
    assert len([u for u in requests if u.endswith("/v1/batches")]) == 1  # not retried
    assert _ids("batch", tenant) == []
