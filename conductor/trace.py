"""A stored job rendered for a terminal: the workflow as a graph, then each step's timing, usage and output."""

from __future__ import annotations

from sqlmodel import Session

from conductor.store import jobs as store
from conductor.store.models import Job, Step
from conductor.workflow import critical_path

PREVIEW_CHARS = 400


def render_trace(session: Session, job: Job, *, indent: str = "", full: bool = False) -> str:
    steps = store.get_steps(session, job_id=job.id)
    attempts = store.get_attempts(session, step_ids=[s.id for s in steps if s.id is not None])
    lines = [
        f"{indent}job {job.id}  status={job.status}  depth={job.depth}  pool={job.pool}  planner={job.planner}",
        f"{indent}workflow: source={job.workflow_source}  format_valid={job.format_valid}"
        + (f"  planner_error={job.planner_error!r}" if job.planner_error else ""),
        f"{indent}usage: {job.input_tokens} in{_details(job)} / {job.output_tokens} out tokens, "
        f"${job.cost_usd:.6f}, {job.calls} calls" + (f", {_elapsed(job)}" if job.finished_at else ""),
    ]
    if steps:
        lines.append(f"{indent}graph:")
        lines += [f"{indent}  {line}" for line in graph_lines(steps)]
        durations = [(s.latency_ms or 0) / 1000 for s in steps]
        length, path = critical_path([s.access_list for s in steps], durations)
        lines.append(f"{indent}critical path: {' -> '.join(map(str, path))} ({length:.2f}s of step latency)")
    for st in steps:
        tries = [a for a in attempts if a.step_id == st.id]
        lines.append(
            f"{indent}[{st.index}] {st.agent} ({st.provider or '-'}:{st.model or '-'})  {st.status}  "
            f"{st.latency_ms if st.latency_ms is not None else '-'} ms  "
            f"{st.input_tokens} in{_details(st)} / {st.output_tokens} out  ${st.cost_usd:.6f}  attempts={len(tries)}"
        )
        lines.append(f"{indent}    sees: {st.access_list or 'nothing'}   instruction: {_clip(st.instruction, full)}")
        if st.celery_task_id:  # operator-only: the API and the viewer never show hosts or task ids
            lines.append(f"{indent}    celery task: {st.celery_task_id}")
        for a in tries:
            took = f"{a.latency_ms} ms" if a.latency_ms is not None else "unfinished"
            lines.append(f"{indent}    attempt {a.n} on {a.worker or '-'}: {took}"
                         + (f"  {a.error_type}: {_clip(a.error or '', full)}" if a.error_type else ""))
        if st.error:
            lines.append(f"{indent}    error: {st.error}")
        if st.output is not None:
            lines.append(f"{indent}    output: {_clip(st.output, full)}")
        if st.child_job_id:
            child = store.get_job(session, job_id=st.child_job_id)
            if child is not None:
                lines.append(f"{indent}    child job:")
                lines.append(render_trace(session, child, indent=indent + "      ", full=full))
    if job.error_message:
        lines.append(f"{indent}error: {job.error_type}: {job.error_message}")
    if job.answer is not None and not job.parent_job_id:
        lines.append(f"{indent}answer: {_clip(job.answer, full)}")
    return "\n".join(lines)


def graph_lines(steps: list[Step]) -> list[str]:
    """One line per step: ``2 <- 0, 1`` with the agent, roots marked."""
    out = []
    for st in steps:
        deps = ", ".join(map(str, st.access_list)) if st.access_list else "(root)"
        out.append(f"{st.index} <- {deps}   {st.agent}")
    return out


def _elapsed(job: Job) -> str:
    if not job.finished_at:
        return ""
    return f"{(job.finished_at - job.created_at).total_seconds():.2f}s wall"


def _clip(text: str, full: bool) -> str:
    flat = text.replace("\n", " ⏎ ")
    return flat if full or len(flat) <= PREVIEW_CHARS else flat[:PREVIEW_CHARS] + " …"


def _details(usage: Job | Step) -> str:
    """The cached input (read and written) and reasoning output of a job's or step's tokens, when there are any."""
    parts = [f"{usage.cached_input_tokens} cached"] if usage.cached_input_tokens else []
    parts += [f"{usage.cache_write_tokens} written to cache"] if usage.cache_write_tokens else []
    parts += [f"{usage.reasoning_tokens} reasoning"] if usage.reasoning_tokens else []
    return f" ({', '.join(parts)})" if parts else ""
