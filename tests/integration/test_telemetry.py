"""OpenTelemetry: each finished job's trace, built from its rows, lands in an in-memory exporter with the
GenAI semantic-convention attributes on every step (engine driven in this process on the real Postgres)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from conductor import telemetry
from conductor.engine import Dispatch, finalize_job, plan_job, run_step
from conductor.settings import get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import Step
from conductor.submission import JobCreate, create_job

DIAMOND = {"model_ids": ["a", "b", "c", "d"], "subtasks": ["root", "left", "right", "join"],
           "access_lists": [[], [0], [0], [1, 2]]}


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(id_generator=telemetry.job_trace_ids())
    provider.add_span_processor(SimpleSpanProcessor(memory))
    telemetry.use_tracer_provider(provider)
    yield memory
    telemetry.use_tracer_provider(None)


def run_job(**body: Any) -> str:
    """Submits and runs a job to its end in this process: plan, each step, finalize, as a worker would."""
    settings = get_settings()
    with session_scope() as s:
        job, _ = create_job(s, JobCreate.model_validate({"task": "telemetry test", **body}), tenant="otel",
                            settings=settings)
    due = deque([Dispatch(plan=[job.id])])
    while due:
        d = due.popleft()
        due.extend(plan_job(j, settings=settings) for j in d.plan)
        due.extend(run_step(j, i, worker="test", task_id=None, settings=settings) for j, i in d.steps)
        due.extend(finalize_job(j) for j in d.finalize)
    return job.id


def rows(job_id: str) -> list[Step]:
    with session_scope() as s:
        return store.get_steps(s, job_id=job_id)


def by_name(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [sp for sp in spans if sp.name.startswith(prefix)]


def test_each_step_span_carries_the_genai_attributes_of_its_row(exporter: InMemorySpanExporter) -> None:
    job_id = run_job(workflow=DIAMOND)
    spans = exporter.get_finished_spans()
    [job_span] = [sp for sp in spans if sp.name == "invoke_agent conductor"]
    [planning] = by_name(spans, "plan ")
    steps = sorted(by_name(spans, "chat "), key=lambda sp: (sp.attributes or {})["conductor.step.index"])
    stored = rows(job_id)

    assert job_span.context is not None and job_span.context.trace_id == int(job_id, 16)  # found by job id
    assert job_span.attributes is not None and job_span.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert job_span.attributes["gen_ai.usage.input_tokens"] == sum(st.input_tokens for st in stored)
    assert job_span.attributes["gen_ai.usage.cache_read.input_tokens"] == 4  # the join, agent d (tests/pools/sim.yaml)
    assert (planning.attributes or {})["conductor.workflow.source"] == "request"
    assert planning.parent is not None and planning.parent.span_id == job_span.context.span_id
    assert len(steps) == 4
    for span, st in zip(steps, stored, strict=True):
        a = span.attributes
        assert a is not None
        assert span.name == f"chat sim-{st.agent}" and span.kind == SpanKind.CLIENT
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "sim"
        assert a["gen_ai.request.model"] == st.model == f"sim-{st.agent}"
        assert a["gen_ai.usage.input_tokens"] == st.input_tokens > 0
        assert a["gen_ai.usage.output_tokens"] == st.output_tokens > 0
        assert a["gen_ai.usage.cache_read.input_tokens"] == st.cached_input_tokens == (4 if st.agent == "d" else 0)
        assert a["gen_ai.usage.cache_creation.input_tokens"] == st.cache_write_tokens == (2 if st.agent == "d" else 0)
        assert a["conductor.usage.reasoning_tokens"] == st.reasoning_tokens
        assert a["conductor.step.access_list"] == tuple(st.access_list)
        assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a  # no content by default
        assert span.parent is not None and span.parent.span_id == job_span.context.span_id
        assert st.started_at is not None and span.start_time == int(st.started_at.timestamp() * 1e9)
        assert span.status.status_code == StatusCode.UNSET
    attempts = by_name(spans, "attempt ")
    assert len(attempts) == 4
    assert {a.parent.span_id for a in attempts if a.parent} == {s.context.span_id for s in steps if s.context}


def test_retries_show_as_attempt_spans_and_content_only_when_enabled(exporter: InMemorySpanExporter) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use_tracer_provider(provider, capture_content=True)
    job_id = run_job(workflow={"model_ids": ["a", "flaky"], "subtasks": ["first", "second"],
                               "access_lists": [[], [0]]})
    spans = exporter.get_finished_spans()
    [flaky] = [sp for sp in by_name(spans, "chat ") if (sp.attributes or {})["conductor.step.agent"] == "flaky"]
    tries = sorted((sp for sp in by_name(spans, "attempt ") if sp.parent and flaky.context
                    and sp.parent.span_id == flaky.context.span_id), key=lambda sp: sp.name)
    assert [t.name for t in tries] == ["attempt 1", "attempt 2", "attempt 3"]
    assert [(t.attributes or {}).get("error.type") for t in tries] == ["rate_limited", "server_error", None]
    assert [t.status.status_code for t in tries] == [StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET]
    step = rows(job_id)[1]
    a = flaky.attributes or {}
    sent = json.loads(str(a["gen_ai.input.messages"]))
    assert [(m["role"], m["parts"][0]["content"]) for m in sent] == [
        (m["role"], m["content"]) for m in step.messages or []]
    assert json.loads(str(a["gen_ai.output.messages"]))[0]["parts"][0]["content"] == step.output


def test_a_recursive_step_holds_its_child_jobs_spans(exporter: InMemorySpanExporter) -> None:
    job_id = run_job(workflow={"model_ids": ["a", "conductor"], "subtasks": ["look", "dig deeper"],
                               "access_lists": [[], [0]]}, planner="template:single")
    spans = exporter.get_finished_spans()
    jobs = [sp for sp in spans if "conductor.job.status" in (sp.attributes or {})]
    assert len(jobs) == 2  # one trace: the child job is not exported on its own
    root = next(sp for sp in jobs if sp.parent is None)
    child = next(sp for sp in jobs if sp.parent is not None)
    recursive = next(sp for sp in spans if (sp.attributes or {}).get("conductor.step.agent") == "conductor")
    assert (root.attributes or {})["conductor.job.id"] == job_id
    assert child.parent is not None and recursive.context is not None
    assert child.parent.span_id == recursive.context.span_id
    assert (recursive.attributes or {})["gen_ai.operation.name"] == "invoke_agent"
    assert {sp.context.trace_id for sp in spans if sp.context} == {int(job_id, 16)}
