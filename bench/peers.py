"""The same DAGs of no-op steps on three peers, for the overhead benchmark:

- asyncio in one process, dataflow scheduled, nothing persisted: the floor;
- a bare Celery canvas (chain / chord of no-op tasks) on the same Redis broker, one threads worker:
  the substrate Conductor Queue publishes on;
- LangGraph with its Postgres checkpointer on the same Postgres (a durable in-process graph), when
  ``langgraph`` and ``langgraph-checkpoint-postgres`` are installed.

Each returns, per run, the hop times: from a step's last dependency finishing (or the run's start)
to the step finishing, in seconds.
"""

from __future__ import annotations

import asyncio
import operator
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Annotated, Any, TypedDict

from bench.env import ROOT, child_env


def hops_from(deps: Sequence[Sequence[int]], finished: dict[int, float], start: float) -> list[float]:
    return [finished[i] - max((finished[d] for d in ds), default=start) for i, ds in enumerate(deps)]


# --- asyncio: the floor ---------------------------------------------------------------------------


async def _run_async(deps: Sequence[Sequence[int]]) -> tuple[float, dict[int, float]]:
    finished: dict[int, float] = {}
    events = [asyncio.Event() for _ in deps]

    async def step(i: int) -> None:
        for d in deps[i]:
            await events[d].wait()
        await asyncio.sleep(0)  # the no-op "call"
        finished[i] = time.perf_counter()
        events[i].set()

    start = time.perf_counter()
    await asyncio.gather(*(step(i) for i in range(len(deps))))
    return start, finished


def asyncio_hops(deps: Sequence[Sequence[int]]) -> tuple[list[float], float]:
    start, finished = asyncio.run(_run_async(deps))
    return hops_from(deps, finished, start), max(finished.values()) - start


# --- bare Celery ----------------------------------------------------------------------------------


@contextmanager
def celery_worker(concurrency: int = 8) -> Iterator[Any]:
    """A worker of the no-op app (``bench.celery_noop``) on the benchmarks' broker: yields the app and the
    worker's process id."""
    from bench.celery_noop import app
    from tests.integration.harness import Proc

    app.control.purge()
    argv = [sys.executable, "-m", "celery", "-A", "bench.celery_noop", "worker", "-P", "threads", "-c",
            str(concurrency), "-Q", "noop", "--loglevel", "warning", "-n", f"noop{os.getpid()}@%h"]
    proc = Proc("bench-celery-noop", argv, {**child_env(), "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(timeout=0.5):
            if time.monotonic() > deadline or proc.popen.poll() is not None:
                raise RuntimeError(f"no-op worker not ready:\n{proc.tail()}")
        yield _Worker(app, proc.popen.pid)
    finally:
        _release_results(app)
        proc.stop()


class _Worker:
    """The no-op app, and its worker's process id (for its CPU time)."""

    def __init__(self, app: Any, pid: int):
        self.app = app
        self.pid = pid


def _release_results(app: Any) -> None:
    """Stops waiting on every result still registered with the result backend (a chain's or chord's
    inner results, which nothing calls ``get()`` on). Left alone, each unsubscribes from Redis in its
    ``__del__`` while the interpreter shuts down, and prints "Exception ignored in AsyncResult.__del__"."""
    backend = app.backend
    for mapping in getattr(backend, "_pending_results", ()):
        for waiters in list(mapping.values()):
            for result in list(waiters.values()):
                backend.remove_pending_result(result)


def celery_hops(shape: str, deps: Sequence[Sequence[int]]) -> tuple[list[float], float] | None:
    """A canvas for the shapes a canvas can express (chains, a chord, a diamond); None otherwise."""
    from celery import chain, chord

    from bench.celery_noop import join, noop

    n = len(deps)
    start = time.time()
    if all((i - 1 in d) if i else not d for i, d in enumerate(deps)):  # a chain runs them in this order
        sig = chain(noop.si([]), *[noop.s() for _ in range(n - 1)]) if n > 1 else noop.si([])
        stamps = sig.apply_async().get(timeout=60)
        finished = dict(enumerate(stamps))
    elif shape == "fanout4+1":
        stamps = chord([noop.si([]) for _ in range(n - 1)], join.s()).apply_async().get(timeout=60)
        finished = dict(enumerate(stamps))
    elif shape == "diamond":
        # 0, then 1 and 2 in parallel, then 3: chain(noop, chord([noop, noop], join)).
        stamps = chain(noop.si([]), chord([noop.s(), noop.s()], join.s())).apply_async().get(timeout=60)
        finished = {0: stamps[0], 1: stamps[1], 2: stamps[2], 3: stamps[3]}
    else:
        return None
    return hops_from(deps, finished, start), max(finished.values()) - start


# --- LangGraph with the Postgres checkpointer -----------------------------------------------------


class _State(TypedDict):
    stamps: Annotated[dict[int, float], lambda a, b: {**a, **b}]
    trail: Annotated[list[int], operator.add]


def langgraph_available() -> str | None:
    """None when usable, else why not."""
    try:
        import langgraph  # noqa: F401
        from langgraph.checkpoint.postgres import PostgresSaver  # noqa: F401
    except ImportError as exc:
        return f"not installed ({exc.name})"
    return None


@contextmanager
def langgraph_saver() -> Iterator[Any]:
    from langgraph.checkpoint.postgres import PostgresSaver

    url = os.environ["CONDUCTOR_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://")
    with PostgresSaver.from_conn_string(url) as saver:
        saver.setup()
        yield saver


def langgraph_hops(saver: Any, deps: Sequence[Sequence[int]], run: str) -> tuple[list[float], float]:
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(_State)
    for i in range(len(deps)):
        def node(state: _State, i: int = i) -> dict[str, Any]:
            return {"stamps": {i: time.time()}, "trail": [i]}
        graph.add_node(f"s{i}", node)
    used = {d for ds in deps for d in ds}
    for i, ds in enumerate(deps):
        if not ds:
            graph.add_edge(START, f"s{i}")
        elif len(ds) == 1:
            graph.add_edge(f"s{ds[0]}", f"s{i}")
        else:
            graph.add_edge([f"s{d}" for d in ds], f"s{i}")
        if i not in used:
            graph.add_edge(f"s{i}", END)
    compiled = graph.compile(checkpointer=saver)
    start = time.time()
    out = compiled.invoke({"stamps": {}, "trail": []}, {"configurable": {"thread_id": run}})
    done = time.time()
    finished = {int(k): float(v) for k, v in out["stamps"].items()}
    # A node's stamp is taken when it runs; its checkpoint is written after the superstep. The last
    # step's hop therefore ends at invoke's return, which includes the final checkpoint.
    last = len(deps) - 1
    finished[last] = max(finished[last], done) if last not in used else finished[last]
    return hops_from(deps, finished, start), done - start
