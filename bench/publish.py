"""Publishing ready steps: the CPU one message costs the process that sends it (a worker, after each
step that makes others ready). ``conductor.tasks.send.send`` — one message per step on one producer —
side by side with the same messages sent as one Celery group (how they were sent before), into the
benchmark's Redis; nothing consumes them (the broker database is flushed afterwards).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from bench.env import Result, flush_broker, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=300, help="dispatches of --fanout ready steps each")
    p.add_argument("--fanout", type=int, default=3, help="ready steps per dispatch")


def run(args: argparse.Namespace) -> Result:
    from celery import group

    from conductor.engine import Dispatch
    from conductor.tasks.app import RUN_STEP_TASK, STEPS_QUEUE, app
    from conductor.tasks.send import send

    rounds = 20 if args.quick else args.rounds
    steps = [("f" * 32, i) for i in range(args.fanout)]

    def via_send() -> None:
        send(Dispatch(steps=steps, agents={key: "z" for key in steps}))

    def via_group() -> None:
        group(app.signature(RUN_STEP_TASK, key, immutable=True).set(queue=STEPS_QUEUE) for key in steps).apply_async()

    def cpu_ms_per_message(fn: Callable[[], None]) -> float:
        fn()  # warm up: connections, the producer pool
        start = time.process_time()
        for _ in range(rounds):
            fn()
        return (time.process_time() - start) / (rounds * len(steps)) * 1000

    flush_broker()
    try:
        results: dict[str, list[float]] = {"send": [], "group": []}
        for _ in range(3):  # alternating, so a drift of the machine's speed hits both alike
            results["send"].append(cpu_ms_per_message(via_send))
            results["group"].append(cpu_ms_per_message(via_group))
    finally:
        flush_broker()
    best = {k: round(min(v), 3) for k, v in results.items()}
    md = table(["path", "CPU ms per message (best of 3)", "all three"],
               [["`send()`: one message per step, one producer", best["send"],
                 ", ".join(f"{v:.3f}" for v in results["send"])],
                ["the same as one Celery group", best["group"], ", ".join(f"{v:.3f}" for v in results["group"])]])
    md += (f"\n\n{rounds} dispatches of {len(steps)} ready steps each, in this process, to the benchmark's Redis; "
           "CPU from `time.process_time` (the publishing process only; Redis's own CPU is not counted).")
    cmd = "python -m bench publish --quick" if args.quick else \
        f"python -m bench publish --rounds {args.rounds} --fanout {args.fanout}"
    return Result("publish", cmd, {"cpu_ms_per_message": best, "runs": results, "rounds": rounds,
                                   "fanout": len(steps)}, md)
