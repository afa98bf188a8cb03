"""``python -m bench NAME``: run one benchmark (or ``all``), write its JSON and its table.

    python -m bench engine              # run_step in process: wall, CPU and SQL statements per step
    python -m bench overhead            # per-hop p50/p99 vs asyncio, bare Celery, LangGraph
    python -m bench throughput          # steps/s and jobs/s with 0 ms workers
    python -m bench makespan            # makespan / critical path with 1 s workers
    python -m bench concurrency         # 1,000 in-flight 5 s calls: wall time, peak RSS
    python -m bench api                 # POST /v1/jobs p50/p99 at 200 req/s
    python -m bench tokens              # prompt tokens: access lists vs see-everything vs MoA
    python -m bench publish             # CPU per ready-step message published
    python -m bench all --quick         # a seconds-long smoke of each (what CI runs)

Needs the services the tests use (Postgres, Redis); the database is ``CONDUCTOR_TEST_DATABASE_URL``
and the broker ``CONDUCTOR_BENCH_BROKER_URL`` (Redis db 3 by default). Timings are written, never
asserted. ``--code DIR`` runs the API and workers from another checkout (a before/after comparison).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.env import ROOT, publish

NAMES = ("engine", "overhead", "throughput", "makespan", "concurrency", "api", "tokens", "publish")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="name", required=True)
    import importlib

    modules = {name: importlib.import_module(f"bench.{name}") for name in NAMES}
    for name in (*NAMES, "all"):
        c = sub.add_parser(name)
        c.add_argument("--quick", action="store_true", help="a seconds-long smoke run (CI)")
        c.add_argument("--json-dir", type=Path, default=ROOT / ".bench")
        c.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
        c.add_argument("--no-docs", dest="docs", action="store_const", const=None)
        c.add_argument("--pool", default="threads", choices=["threads", "gevent"])
        c.add_argument("--concurrency", type=int, default=16)
        c.add_argument("--code", help="run the API and workers from this checkout instead")
        c.add_argument("--async-commit", action="store_true",
                       help="Postgres synchronous_commit=off for every connection (PGOPTIONS): no fsync wait")
        for mod in ([modules[name]] if name != "all" else []):
            mod.add_arguments(c)
    args = p.parse_args(argv)
    if args.async_commit:
        os.environ["PGOPTIONS"] = "-c synchronous_commit=off"
    names = NAMES if args.name == "all" else (args.name,)
    for name in names:
        mod = modules[name]
        if args.name == "all":  # each benchmark's own defaults
            defaults = argparse.ArgumentParser()
            mod.add_arguments(defaults)
            for k, v in vars(defaults.parse_args([])).items():
                setattr(args, k, v)
        result = mod.run(args)
        path = publish(result, json_dir=args.json_dir, docs=args.docs)
        print(f"## {name}\n{result.markdown}\n(json: {path})\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
