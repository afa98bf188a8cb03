"""Tracing configured by settings alone: a Celery worker with CONDUCTOR_OTEL_ENDPOINT exports the trace of
the job it finished over OTLP/HTTP (protobuf) to a collector on loopback, trace id = job id, no content."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from conductor.engine import plan_job
from conductor.settings import get_settings
from conductor.store.db import session_scope
from conductor.submission import JobCreate, create_job
from conductor.tasks.send import send
from tests.integration.harness import agent_queue, free_port, start_worker

QUEUE = "steps-obs-otel"


class Collector(BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf":
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            Collector.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces"
    server.shutdown()


@pytest.fixture
def own_queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """The job's one step goes to a queue only the tracing worker consumes (the session's workers don't trace)."""
    with agent_queue(monkeypatch, "c", QUEUE) as mapping:
        yield mapping


def test_a_worker_exports_the_finished_jobs_trace_over_otlp(
    collector: str, own_queue: dict[str, str], proc_env: dict[str, str], workers: object
) -> None:
    env = {**proc_env, "CONDUCTOR_STEP_QUEUES": json.dumps(own_queue), "CONDUCTOR_OTEL_ENDPOINT": collector,
           "CONDUCTOR_OTEL_SERVICE_NAME": "conductor-test", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    tracer = start_worker(env, "obs-otel", queues=QUEUE, concurrency=2)
    try:
        settings = get_settings()
        with session_scope() as s:
            job, _ = create_job(s, JobCreate.model_validate(
                {"task": "trace me", "workflow": {"model_ids": ["c"], "subtasks": ["secret instruction"],
                                                  "access_lists": [[]]}}), tenant="otlp", settings=settings)
        send(plan_job(job.id, settings=settings))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not Collector.received:
            time.sleep(0.1)
        assert Collector.received, tracer.tail()
    finally:
        tracer.stop()

    spans = [(rs.resource, sp) for req in Collector.received for rs in req.resource_spans
             for ss in rs.scope_spans for sp in ss.spans]
    assert {sp.trace_id.hex() for _, sp in spans} == {job.id}
    service = {a.key: a.value.string_value for a in spans[0][0].attributes}["service.name"]
    assert service == "conductor-test"
    step = next(sp for _, sp in spans if sp.name == "chat sim-c")
    attrs = {a.key: a.value for a in step.attributes}
    assert attrs["gen_ai.operation.name"].string_value == "chat"
    assert attrs["gen_ai.provider.name"].string_value == "sim"
    assert attrs["gen_ai.request.model"].string_value == "sim-c"
    assert attrs["gen_ai.usage.input_tokens"].int_value > 0
    assert attrs["gen_ai.usage.output_tokens"].int_value > 0
    wire = b"".join(req.SerializeToString() for req in Collector.received)
    assert b"secret instruction" not in wire and b"trace me" not in wire  # no prompt text unless enabled
