"""The OpenAI-compatible facade on real processes: what waiting server-side costs a chat completion, and
how long a batch takes end to end.

Starts one API and one Celery worker (threads pool) against the local Postgres and Redis (the test
database and Redis db 5 by default), with a pool of sim agents of known latency planned by
``template:single`` (one step), and reports with the official ``openai`` client:
- a chat completion's latency next to the same job through ``POST /v1/jobs`` + polling every 0.1 s;
- a streamed completion's time to its first chunk and to ``[DONE]``;
- a batch of N chat lines: upload to ``completed`` and the output file read.
Timings are printed, never asserted.

    .venv/bin/python -m bench.openai_compat [--repeat 10] [--latency-ms 200] [--batch 50]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("CONDUCTOR_DATABASE_URL", os.environ.get(
    "CONDUCTOR_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/conductor_test"))
os.environ.setdefault("CONDUCTOR_BROKER_URL", "redis://127.0.0.1:6379/5")
os.environ.setdefault("CONDUCTOR_RESULT_BACKEND", "redis://127.0.0.1:6379/6")

from conductor.store.db import session_scope  # noqa: E402
from conductor.store.keys import create_key  # noqa: E402
from tests.integration.harness import start_api, start_worker, wait_terminal  # noqa: E402

FINAL = ("completed", "failed", "expired", "cancelled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--latency-ms", type=int, default=200)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()

    pool = Path(os.environ.get("TMPDIR", "/tmp")) / "conductor-bench-openai.yaml"
    pool.write_text(yaml.safe_dump({"planner": "template:single",
                                    "agents": {"s0": {"provider": "sim", "options": {"latency_ms": args.latency_ms}}}}))
    env = {**os.environ, "CONDUCTOR_POOL_FILE": str(pool), "CONDUCTOR_AUTH_REQUIRED": "true",
           "CONDUCTOR_TENANT_SUBMITS_PER_MINUTE": "100000", "CONDUCTOR_TENANT_MAX_JOBS_IN_FLIGHT": "100000"}
    with session_scope() as s:
        _, key = create_key(s, tenant="bench-openai")

    print(f"starting API and a worker (threads, concurrency {args.concurrency}); step latency "
          f"{args.latency_ms} ms ...", flush=True)
    worker = start_worker(env, "bench", concurrency=args.concurrency)
    api, url = start_api(env)
    messages = [{"role": "user", "content": "bench"}]
    try:
        with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client, \
                httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            chat, polled, first, done = [], [], [], []
            for _ in range(args.repeat):
                started = time.perf_counter()
                client.chat.completions.create(model="conductor", messages=messages)  # type: ignore[arg-type]
                chat.append(time.perf_counter() - started)

                started = time.perf_counter()
                job_id = http.post("/v1/jobs", json={"task": "bench"}).json()["id"]
                assert wait_terminal(http, job_id)["status"] == "succeeded"
                polled.append(time.perf_counter() - started)

                started = time.perf_counter()
                stream = client.chat.completions.create(model="conductor", messages=messages,  # type: ignore[arg-type]
                                                        stream=True)
                for n, _chunk in enumerate(stream):
                    if n == 0:
                        first.append(time.perf_counter() - started)
                done.append(time.perf_counter() - started)
            print(f"chat completion          median {statistics.median(chat) * 1000:6.0f} ms  "
                  f"(min {min(chat) * 1000:.0f}, max {max(chat) * 1000:.0f}; n={args.repeat})")
            print(f"POST /v1/jobs + poll     median {statistics.median(polled) * 1000:6.0f} ms  "
                  f"(min {min(polled) * 1000:.0f}, max {max(polled) * 1000:.0f})")
            print(f"stream: first chunk      median {statistics.median(first) * 1000:6.0f} ms; "
                  f"[DONE] median {statistics.median(done) * 1000:.0f} ms")

            lines = "".join(json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": "conductor", "messages": messages}}) + "\n"
                            for n in range(args.batch))
            started = time.perf_counter()
            uploaded = client.files.create(file=("bench.jsonl", lines.encode()), purpose="batch")
            batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            created = time.perf_counter() - started
            while batch.status not in FINAL:
                time.sleep(0.2)
                batch = client.batches.retrieve(batch.id)
            output = client.files.content(batch.output_file_id or "").text.splitlines()
            wall = time.perf_counter() - started
            print(f"batch of {args.batch}: upload + create {created * 1000:.0f} ms; {batch.status} with "
                  f"{len(output)} output lines after {wall:.2f} s (ideal with {args.concurrency} slots: "
                  f"{-(-args.batch // args.concurrency) * args.latency_ms / 1000:.2f} s of step time)")
    finally:
        api.stop()
        worker.stop()


if __name__ == "__main__":
    main()
