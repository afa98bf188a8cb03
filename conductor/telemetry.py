"""OpenTelemetry traces of jobs, with the GenAI semantic conventions.

When a top-level job ends, its trace is built from the stored rows and exported: a span for the job
(``invoke_agent conductor``), one for planning, one per step (``chat {model}``, with provider, model,
tokens, finish reason) and one per attempt under it; a recursive step holds its child job's spans.
Times are the ones Postgres recorded, so the trace matches the database exactly, whichever workers
ran the steps, and the step path pays nothing while it runs.

Off unless ``CONDUCTOR_OTEL_ENDPOINT`` is set (OTLP over HTTP) or a tracer provider is installed with
:func:`use_tracer_provider`; without the ``otel`` extra installed everything here is a no-op. Prompt
and answer text are exported only with ``CONDUCTOR_OTEL_CAPTURE_CONTENT=true``.
"""

from __future__ import annotations

import json
import logging
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from conductor.settings import Settings, get_settings
from conductor.store import jobs as store
from conductor.store.db import session_scope
from conductor.store.models import Job, JobStatus, Step, StepAttempt, StepStatus

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

TRACER_NAME = "conductor"
MAX_TREE_DEPTH = 6
# gen_ai.provider.name values of the semantic conventions; other providers keep their pool name.
PROVIDER_NAMES = {"openai": "openai", "anthropic": "anthropic", "gemini": "gcp.gemini"}
CONDUCTOR_AGENT = "conductor"


@dataclass
class _State:
    tracer: Tracer | None = None
    capture_content: bool = False
    configured: bool = False


_state = _State()
_lock = threading.Lock()
_trace_id: ContextVar[int | None] = ContextVar("conductor_trace_id", default=None)


def use_tracer_provider(provider: Any, *, capture_content: bool = False) -> None:
    """Trace into ``provider`` (an SDK ``TracerProvider``): for tests and for hosts that set up
    OpenTelemetry themselves. ``None`` turns tracing off."""
    with _lock:
        _state.tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None
        _state.capture_content = capture_content
        _state.configured = True


def configure(settings: Settings) -> bool:
    """Sets up the OTLP exporter once per process from the settings; True when tracing is on."""
    with _lock:
        if _state.configured:
            return _state.tracer is not None
        _state.configured = True
        if not settings.otel_endpoint:
            return False
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            log.warning("CONDUCTOR_OTEL_ENDPOINT is set but OpenTelemetry is not installed: "
                        "pip install 'conductor-queue[otel]'; tracing is off")
            return False
        provider = TracerProvider(
            resource=Resource.create({"service.name": settings.otel_service_name}), id_generator=job_trace_ids()
        )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otel_endpoint)))
        _state.tracer = provider.get_tracer(TRACER_NAME)
        _state.capture_content = settings.otel_capture_content
        return True


def job_ended(job_id: str) -> None:
    """Exports the finished job's trace (for a child job: nothing; its root job's trace holds it).
    Never raises: a tracing problem must not fail the job."""
    if not configure(get_settings()):
        return
    tracer = _state.tracer
    if tracer is None:
        return
    try:
        with session_scope() as s:
            job = store.get_job(s, job_id=job_id)
            if job is None or job.parent_job_id is not None or job.status not in JobStatus.TERMINAL:
                return
            token = _trace_id.set(int(job.id, 16) if _is_hex128(job.id) else None)
            try:
                _JobTrace(s, tracer, _state.capture_content).job(job, parent=None, depth=0)
            finally:
                _trace_id.reset(token)
    except Exception:
        log.exception("exporting the trace of job %s failed", job_id)


def _ns(ts: datetime | None) -> int | None:
    return int(ts.timestamp() * 1_000_000_000) if ts is not None else None


def _is_hex128(value: str) -> bool:
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value)


class _JobTrace:
    def __init__(self, session: Any, tracer: Tracer, capture_content: bool):
        self.s, self.tracer, self.capture = session, tracer, capture_content

    def job(self, job: Job, parent: Span | None, depth: int) -> None:
        from opentelemetry import trace

        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": CONDUCTOR_AGENT,
            "gen_ai.agent.id": job.id,
            "gen_ai.conversation.id": job.root_job_id or job.id,
            "gen_ai.usage.input_tokens": job.input_tokens,
            "gen_ai.usage.output_tokens": job.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": job.cached_input_tokens,
            "gen_ai.usage.cache_creation.input_tokens": job.cache_write_tokens,
            "conductor.usage.reasoning_tokens": job.reasoning_tokens,
            "conductor.job.id": job.id,
            "conductor.job.status": job.status,
            "conductor.job.depth": job.depth,
            "conductor.tenant": job.tenant,
            "conductor.pool": job.pool,
            "conductor.cost_usd": job.cost_usd,
            "conductor.calls": job.calls,
        }
        if job.error_type:
            attrs["error.type"] = job.error_type
        ctx = trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span(f"invoke_agent {CONDUCTOR_AGENT}", context=ctx, start_time=_ns(job.created_at),
                                      attributes=attrs)
        self._status(span, job.status == JobStatus.SUCCEEDED or job.status == JobStatus.CANCELLED, job.error_message)
        self.planning(job, span)
        steps = store.get_steps(self.s, job_id=job.id)
        attempts = store.get_attempts(self.s, step_ids=[st.id for st in steps if st.id is not None])
        for st in steps:
            self.step(job, st, [a for a in attempts if a.step_id == st.id], span, depth)
        span.end(end_time=_ns(job.finished_at))

    def planning(self, job: Job, parent: Span) -> None:
        from opentelemetry import trace

        if job.started_at is None:
            return
        agent = job.pool_config.get("agents", {}).get(job.planner, {}) if isinstance(job.pool_config, dict) else {}
        attrs: dict[str, Any] = {
            # A model planner's calls are chats; a template or the request's own workflow is not a model call.
            "gen_ai.operation.name": "chat" if job.planner_calls else "invoke_agent",
            "gen_ai.agent.name": job.planner,
            "gen_ai.usage.input_tokens": job.planner_input_tokens,
            "gen_ai.usage.output_tokens": job.planner_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": job.planner_cached_input_tokens,
            "gen_ai.usage.cache_creation.input_tokens": job.planner_cache_write_tokens,
            "conductor.usage.reasoning_tokens": job.planner_reasoning_tokens,
            "conductor.job.id": job.id,
            "conductor.workflow.source": job.workflow_source or "",
            "conductor.workflow.format_valid": bool(job.format_valid),
            "conductor.planner.attempts": job.planner_attempts,
            "conductor.cost_usd": job.planner_cost_usd,
        }
        if agent.get("provider"):
            attrs["gen_ai.provider.name"] = PROVIDER_NAMES.get(agent["provider"], agent["provider"])
        if agent.get("model"):
            attrs["gen_ai.request.model"] = agent["model"]
        if job.planner_error:
            attrs["conductor.planner.error"] = job.planner_error[:1000]
        if self.capture and job.planner_raw:
            attrs["gen_ai.output.messages"] = _messages([{"role": "assistant", "content": job.planner_raw}])
        end = job.planned_at or job.finished_at
        span = self.tracer.start_span(f"plan {job.planner}", context=trace.set_span_in_context(parent),
                                      start_time=_ns(job.started_at), attributes=attrs)
        self._status(span, job.planned_at is not None, job.error_message)
        span.end(end_time=_ns(end))

    def step(self, job: Job, st: Step, attempts: list[StepAttempt], parent: Span, depth: int) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        if st.started_at is None:
            return  # never ran (skipped or cancelled before it started)
        recursive = st.agent == CONDUCTOR_AGENT
        agent = job.pool_config.get("agents", {}).get(st.agent, {}) if isinstance(job.pool_config, dict) else {}
        requested = agent.get("model") or st.model or st.agent
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent" if recursive else "chat",
            "gen_ai.provider.name": PROVIDER_NAMES.get(st.provider or "", st.provider or agent.get("provider", "")),
            "gen_ai.request.model": job.planner if recursive else requested,
            "gen_ai.usage.input_tokens": st.input_tokens,
            "gen_ai.usage.output_tokens": st.output_tokens,
            "gen_ai.usage.cache_read.input_tokens": st.cached_input_tokens,
            "gen_ai.usage.cache_creation.input_tokens": st.cache_write_tokens,
            "conductor.usage.reasoning_tokens": st.reasoning_tokens,
            "conductor.job.id": job.id,
            "conductor.step.index": st.index,
            "conductor.step.agent": st.agent,
            "conductor.step.status": st.status,
            "conductor.step.access_list": list(st.access_list),
            "conductor.step.attempts": st.attempts,
            "conductor.cost_usd": st.cost_usd,
        }
        if st.model and not recursive:
            attrs["gen_ai.response.model"] = st.model
        if st.finish_reason:
            attrs["gen_ai.response.finish_reasons"] = [st.finish_reason]
        if agent.get("temperature") is not None:
            attrs["gen_ai.request.temperature"] = float(agent["temperature"])
        if agent.get("max_tokens") is not None:
            attrs["gen_ai.request.max_tokens"] = int(agent["max_tokens"])
        if st.error_type:
            attrs["error.type"] = st.error_type
        if self.capture:
            if st.messages:
                attrs["gen_ai.input.messages"] = _messages(st.messages)
            if st.output is not None:
                attrs["gen_ai.output.messages"] = _messages([{"role": "assistant", "content": st.output}])
        name = f"invoke_agent {CONDUCTOR_AGENT}" if recursive else f"chat {requested}"
        kind = SpanKind.INTERNAL if recursive else SpanKind.CLIENT
        span = self.tracer.start_span(name, context=trace.set_span_in_context(parent), kind=kind,
                                      start_time=_ns(st.started_at), attributes=attrs)
        self._status(span, st.status == StepStatus.SUCCEEDED, st.error)
        for a in attempts:
            self.attempt(st, a, span)
        if recursive and st.child_job_id and depth < MAX_TREE_DEPTH:
            child = store.get_job(self.s, job_id=st.child_job_id)
            if child is not None:
                self.job(child, span, depth + 1)
        span.end(end_time=_ns(st.finished_at))

    def attempt(self, st: Step, a: StepAttempt, parent: Span) -> None:
        from opentelemetry import trace

        attrs: dict[str, Any] = {"conductor.step.index": st.index, "conductor.attempt.n": a.n,
                                 "conductor.attempt.worker": a.worker or ""}
        if a.error_type:
            attrs["error.type"] = a.error_type
        span = self.tracer.start_span(f"attempt {a.n}", context=trace.set_span_in_context(parent),
                                      start_time=_ns(a.started_at), attributes=attrs)
        self._status(span, a.error_type is None, a.error)
        span.end(end_time=_ns(a.finished_at or st.finished_at))

    @staticmethod
    def _status(span: Span, ok: bool, message: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if not ok:
            span.set_status(Status(StatusCode.ERROR, (message or "")[:500]))


def _messages(messages: list[dict[str, Any]]) -> str:
    """Messages as the GenAI conventions' JSON: role plus text parts."""
    return json.dumps(
        [{"role": m.get("role"), "parts": [{"type": "text", "content": m.get("content", "")}]} for m in messages]
    )


def job_trace_ids() -> Any:
    """An SDK ``IdGenerator`` whose trace ids equal the job id (both are 128-bit hex), so a job's trace
    is found by its id; span ids stay random."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

    class JobTraceIds(IdGenerator):
        def __init__(self) -> None:
            self._random = RandomIdGenerator()

        def generate_span_id(self) -> int:
            return self._random.generate_span_id()

        def generate_trace_id(self) -> int:
            return _trace_id.get() or self._random.generate_trace_id()

    return JobTraceIds()
