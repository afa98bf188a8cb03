"""``conductor submit --batch --wait``'s poll: an API that fails for a moment (unreachable, 429, 5xx) is
polled again, up to a limit, instead of ending a wait on a batch that goes on. The API is the network
edge here (httpx's MockTransport); the client code is ours, unchanged."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conductor.batch_submit import BatchSubmitError, wait, write_results

COUNTS = {"total": 2, "completed": 0, "failed": 0}


def api(answers: Iterator[httpx.Response | Exception]) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.Client(base_url="http://api", transport=httpx.MockTransport(handle))


def batch(status: str, completed: int = 0) -> httpx.Response:
    return httpx.Response(200, json={"id": "batch_1", "status": status,
                                     "request_counts": {**COUNTS, "completed": completed}})


def test_a_wait_outlasts_a_few_failed_polls() -> None:
    answers = iter([batch("in_progress"), httpx.Response(503, json={"title": "Database unavailable"}),
                    httpx.ConnectError("refused"), httpx.Response(429, json={"error": {"message": "slow down"}}),
                    batch("completed", completed=2)])
    out = io.StringIO()
    with api(answers) as client:
        ended = wait(client, "batch_1", out=out, poll_s=0.001)
    assert ended["status"] == "completed"
    said = out.getvalue()
    assert "API answered 503: Database unavailable; polling again" in said  # problem+json read, not dumped
    assert "cannot reach the API" in said and "API answered 429: slow down" in said
    assert said.rstrip().endswith("2/2 (0 failed) completed")


def test_a_wait_gives_up_after_its_patience_and_a_client_error_at_once() -> None:
    with api(iter([httpx.Response(503, json={"title": "Database unavailable"})] * 3)) as client, \
            pytest.raises(BatchSubmitError, match="gave up after 0s of failed tries"):
        wait(client, "batch_1", out=io.StringIO(), poll_s=0.001, patience_s=0)
    with api(iter([httpx.Response(404, json={"error": {"message": "No such Batch object: batch_1"}})])) as client, \
            pytest.raises(BatchSubmitError, match="API answered 404: No such Batch object"):
        wait(client, "batch_1", out=io.StringIO(), poll_s=0.001)


def test_the_results_are_asked_for_again_after_a_failure(tmp_path: Path) -> None:
    lines = ('{"custom_id": "a", "response": {"status_code": 200}, "error": null}\n'
             '{"custom_id": "b", "response": null, "error": {"code": "batch_cancelled"}}\n')
    answers = iter([httpx.Response(502, text="bad gateway"), httpx.Response(200, text=lines)])
    out, target = io.StringIO(), tmp_path / "results.jsonl"
    with api(answers) as client:
        assert write_results(client, {"id": "batch_1"}, target, out=out, retry_s=0.001) == (1, 1)
    assert target.read_text() == lines
    assert "API answered 502: bad gateway; asking for its results again" in out.getvalue()
