"""Dataflow scheduling honours every access-list edge and never delays a step for a non-dependency.

A discrete-event simulation drives ``ready_steps`` exactly as the engine does (dispatch whatever became
ready after each completion) over random DAGs and random step durations, and checks:
- no step starts before every step in its access list finished;
- every step runs exactly once;
- each step starts exactly when its last dependency finished (nothing independent holds it back),
  so the makespan equals the critical path.
"""

from __future__ import annotations

import heapq

from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.workflow import critical_path, ready_steps


@st.composite
def dags(draw: st.DrawFn, max_steps: int) -> tuple[list[list[int]], list[float]]:
    n = draw(st.integers(min_value=1, max_value=max_steps))
    deps = [sorted(draw(st.sets(st.integers(0, i - 1), max_size=i))) if i else [] for i in range(n)]
    durations = draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    return deps, [d / 10 for d in durations]


def simulate(deps: list[list[int]], durations: list[float]) -> tuple[dict[int, float], dict[int, float]]:
    start: dict[int, float] = {}
    finish: dict[int, float] = {}
    events: list[tuple[float, int]] = []
    now = 0.0
    while True:
        for i in ready_steps(deps, done=finish.keys(), started=start.keys()):
            assert i not in start, f"step {i} dispatched twice"
            start[i] = now
            heapq.heappush(events, (now + durations[i], i))
        if not events:
            break
        now, i = heapq.heappop(events)
        finish[i] = now
    return start, finish


def check(deps: list[list[int]], durations: list[float]) -> None:
    start, finish = simulate(deps, durations)
    assert set(start) == set(range(len(deps))), "some step never ran"
    for i, ds in enumerate(deps):
        for d in ds:
            assert finish[d] <= start[i], f"edge {d}->{i} violated"
        assert start[i] == max((finish[d] for d in ds), default=0.0), f"step {i} waited for a non-dependency"
    length, _ = critical_path(deps, durations)
    assert abs(max(finish.values()) - length) < 1e-9


@settings(max_examples=300, deadline=None)
@given(dags(max_steps=5))
def test_random_dags_up_to_5_steps(dag: tuple[list[list[int]], list[float]]) -> None:
    check(*dag)


@settings(max_examples=100, deadline=None)
@given(dags(max_steps=50))
def test_random_dags_up_to_50_steps(dag: tuple[list[list[int]], list[float]]) -> None:
    check(*dag)


def test_the_n_graph_that_no_chain_chord_tree_can_express() -> None:
    # 2 depends on 0 only; 3 on 0 and 1. A series-parallel canvas must make 2 wait for 1 or 3 wait longer.
    deps = [[], [], [0], [0, 1]]
    start, _ = simulate(deps, [1.0, 5.0, 1.0, 1.0])
    assert start[2] == 1.0 and start[3] == 5.0
