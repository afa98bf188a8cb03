"""Geometry for the trace viewer: the workflow as a layered graph, and the timeline of steps and
attempts. Pure functions of the stored rows; the templates only draw what this computes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from conductor.store.models import Job, Step, StepAttempt

NODE_W, NODE_H = 180, 64
COL_GAP, ROW_GAP = 70, 26
PAD = 16
TIMELINE_W = 720
LABEL_W = 150
ROW_H = 22


@dataclass(frozen=True)
class GraphNode:
    index: int
    agent: str
    status: str
    x: int
    y: int
    detail: str


@dataclass(frozen=True)
class GraphEdge:
    src: int
    dst: int
    path: str


@dataclass(frozen=True)
class Graph:
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    width: int
    height: int


def layers(dependencies: Sequence[Sequence[int]]) -> list[int]:
    """Each step's column: one past the deepest step it depends on (dependencies point backwards)."""
    out: list[int] = []
    for deps in dependencies:
        out.append(1 + max((out[d] for d in deps if 0 <= d < len(out)), default=-1))
    return out


def workflow_graph(steps: Sequence[Step]) -> Graph:
    cols = layers([st.access_list for st in steps])
    rows_used: dict[int, int] = {}
    pos: dict[int, tuple[int, int]] = {}
    nodes = []
    for st, col in zip(steps, cols, strict=True):
        row = rows_used.get(col, 0)
        rows_used[col] = row + 1
        x, y = PAD + col * (NODE_W + COL_GAP), PAD + row * (NODE_H + ROW_GAP)
        pos[st.index] = (x, y)
        tokens = st.input_tokens + st.output_tokens
        detail = f"{tokens} tok · ${st.cost_usd:.4f}" + (f" · {st.latency_ms} ms" if st.latency_ms is not None else "")
        nodes.append(GraphNode(st.index, st.agent, st.status, x, y, detail))
    edges = []
    for st in steps:
        for dep in st.access_list:
            if dep in pos:
                (x1, y1), (x2, y2) = pos[dep], pos[st.index]
                sx, sy, ex, ey = x1 + NODE_W, y1 + NODE_H // 2, x2, y2 + NODE_H // 2
                mid = (sx + ex) // 2
                edges.append(GraphEdge(dep, st.index, f"M{sx},{sy} C{mid},{sy} {mid},{ey} {ex - 6},{ey}"))
    width = PAD * 2 + (max(cols, default=0) + 1) * (NODE_W + COL_GAP) - COL_GAP
    height = PAD * 2 + max(rows_used.values(), default=1) * (NODE_H + ROW_GAP) - ROW_GAP
    return Graph(nodes, edges, width, height)


@dataclass(frozen=True)
class Bar:
    x: float
    width: float
    kind: str
    """'planning', 'waiting' (queued, not yet claimed), 'attempt', 'failed' (an attempt that erred)."""
    title: str


@dataclass
class TimelineRow:
    label: str
    bars: list[Bar] = field(default_factory=list)


@dataclass(frozen=True)
class Timeline:
    rows: list[TimelineRow]
    width: int
    height: int
    total_s: float
    ticks: list[tuple[float, str]]


def timeline(job: Job, steps: Sequence[Step], attempts: Sequence[StepAttempt], now: datetime) -> Timeline:
    """Bars on one time axis from the job's creation: planning, then for each step its wait in the
    queue and each attempt (failed attempts apart)."""
    t0 = job.created_at
    ends = [t for t in [job.finished_at, job.planned_at, *(s.finished_at for s in steps),
                        *(a.finished_at for a in attempts)] if t is not None]
    total = max([(t - t0).total_seconds() for t in ends] + [0.001])
    if job.finished_at is None:
        total = max(total, (now - t0).total_seconds())
    scale = TIMELINE_W / total

    def bar(start: datetime | None, end: datetime | None, kind: str, title: str) -> Bar | None:
        if start is None:
            return None
        a = (start - t0).total_seconds()
        b = ((end or now) - t0).total_seconds()
        return Bar(round(LABEL_W + a * scale, 1), round(max(1.0, (b - a) * scale), 1), kind,
                   f"{title}: {a:.3f}s → {b:.3f}s ({(b - a) * 1000:.0f} ms)")

    rows = []
    planning = TimelineRow("planning")
    queued = bar(job.created_at, job.started_at or job.finished_at, "waiting", "queued for a planner")
    if queued:
        planning.bars.append(queued)
    plan_bar = bar(job.started_at, job.planned_at or job.finished_at, "planning", "planning")
    if plan_bar:
        planning.bars.append(plan_bar)
    rows.append(planning)
    for st in steps:
        row = TimelineRow(f"{st.index} · {st.agent}")
        wait = bar(st.queued_at, st.started_at or st.finished_at, "waiting", "queued") if st.queued_at else None
        if wait:
            row.bars.append(wait)
        mine = [a for a in attempts if a.step_id == st.id]
        for a in mine:
            kind = "failed" if a.error_type else "attempt"
            label = f"attempt {a.n}" + (f" ({a.error_type})" if a.error_type else "")
            made = bar(a.started_at, a.finished_at, kind, label)
            if made:
                row.bars.append(made)
        if not mine and st.started_at:  # a recursive step: its child job ran in between
            made = bar(st.started_at, st.finished_at, "attempt", "child job")
            if made:
                row.bars.append(made)
        rows.append(row)
    step_s = _tick_step(total)
    ticks = [(round(LABEL_W + t * scale, 1), f"{t:g}s") for t in _frange(0, total, step_s)]
    return Timeline(rows, LABEL_W + TIMELINE_W + PAD, len(rows) * ROW_H + 28, total, ticks)


def _tick_step(total: float) -> float:
    for step in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600):
        if total / step <= 8:
            return step
    return total / 8


def _frange(start: float, stop: float, step: float) -> list[float]:
    out, n = [], 0
    while start + n * step <= stop + 1e-9:
        out.append(round(start + n * step, 6))
        n += 1
    return out
