"""Every benchmark runs for seconds (``--quick``) and writes well-formed JSON and a markdown table.
Only the shape of the output is checked: timings are never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import ROOT

NAMES = ["engine", "overhead", "throughput", "makespan", "concurrency", "api", "tokens", "publish"]
EXPECTED_KEYS = {
    "engine": {"wall_ms_per_step", "cpu_ms_per_step", "statements_per_step"},
    "overhead": {"conductor", "conductor_brokered", "asyncio", "celery", "langgraph"},
    "throughput": {"steps_per_s", "jobs_per_s", "window_s", "failed"},
    "makespan": {"shapes", "latency_ms"},
    "concurrency": {"peak_in_flight", "wall_s", "peak_rss_bytes", "succeeded"},
    "api": {"runs"},
    "tokens": {"workflows", "encoder"},
    "publish": {"cpu_ms_per_message", "runs"},
}


@pytest.mark.parametrize("name", NAMES)
def test_benchmark_smoke(name: str, tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT),
           "CONDUCTOR_BENCH_BROKER_URL": os.environ.get("CONDUCTOR_TEST_BENCH_BROKER", "redis://127.0.0.1:6379/3")}
    done = subprocess.run([sys.executable, "-m", "bench", name, "--quick", "--json-dir", str(tmp_path),
                           "--docs", str(docs)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # a clean exit: no object left to clean up while the interpreter shuts down (the Celery peer's results)
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["name"] == name and data["command"].startswith(f"python -m bench {name}")
    assert {"cpu", "cores", "python", "postgres"} <= set(data["machine"])
    assert EXPECTED_KEYS[name] <= set(data), sorted(data)
    text = docs.read_text()
    section = text[text.index(f"<!-- bench:{name} -->"):text.index(f"<!-- /bench:{name} -->")]
    assert f"python -m bench {name}" in section and "\n|---|" in section
    if name == "api":
        assert data["runs"] and all({"latency", "accepted", "errors", "api_cpu_ms_per_request"} <= set(run)
                                    for run in data["runs"])
    if name == "overhead":  # CPU per job, for each shape, from the orchestrators' own processes
        assert all(isinstance(shape["cpu_ms_per_job"], float) and shape["cpu_ms_per_job"] >= 0
                   for run in ("conductor", "conductor_brokered") for shape in data[run].values())
    if name in ("throughput", "concurrency", "makespan"):
        assert data.get("failed", 0) == 0 and data.get("succeeded", 1) > 0
