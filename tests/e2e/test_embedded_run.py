"""``conductor run`` as a user runs it: a subprocess, one process, no Postgres, no Redis, no keys.

The subprocess gets a clean environment: no ``CONDUCTOR_*`` variables (the test session points those
at Postgres and Redis) and no provider keys (so the default pool is deterministically ``local``).
Everything it stores lands in the test's own data directory, which the assertions read with sqlite3.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from alembic.script import ScriptDirectory

from tests.conftest import require_llama_cpp

TASK = "Write a Python function is_palindrome(s) that ignores case and punctuation, with two doctest examples."
KEY_VARS = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR_") and k not in KEY_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def conductor(*args: str, cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "conductor.cli", *args],
        cwd=cwd,  # away from the repository: no .env file is picked up
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rows(db: Path, sql: str, *params: Any) -> list[sqlite3.Row]:
    con = sqlite3.connect(db)
    con.row_factory = sqlite3.Row
    try:
        return con.execute(sql, params).fetchall()
    finally:
        con.close()


def only_job(data_dir: Path) -> sqlite3.Row:
    jobs = rows(data_dir / "conductor.sqlite3", "SELECT * FROM job WHERE parent_job_id IS NULL")
    assert len(jobs) == 1
    return jobs[0]


def steps_of(data_dir: Path, job_id: str) -> list[sqlite3.Row]:
    return rows(data_dir / "conductor.sqlite3", 'SELECT * FROM step WHERE job_id = ? ORDER BY "index"', job_id)


# --- the simulated pool: the whole flow in about two seconds ---------------------------------------


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    data_dir = tmp_path_factory.mktemp("embedded") / "data"  # does not exist yet: run creates it
    result = conductor("run", TASK, "--pool", "sim", "--data-dir", str(data_dir), cwd=data_dir.parent)
    return result, data_dir


def test_sim_run_succeeds_and_prints_the_last_steps_output(sim_run: Any) -> None:
    result, data_dir = sim_run
    assert result.returncode == 0, result.stderr
    job = only_job(data_dir)
    steps = steps_of(data_dir, job["id"])
    assert job["status"] == "succeeded"
    assert job["tenant"] == "local"
    assert [s["status"] for s in steps] == ["succeeded"] * len(steps)
    assert len(steps) == 3  # the sim pool plans with template:pev
    assert result.stdout == steps[-1]["output"] + "\n"
    assert job["answer"] == steps[-1]["output"]


def test_sim_run_shows_live_progress_workflow_and_where_the_trace_is(sim_run: Any) -> None:
    result, data_dir = sim_run
    job_id = only_job(data_dir)["id"]
    err = result.stderr
    assert f"store: {data_dir / 'conductor.sqlite3'}" in err
    assert "SIMULATED" in err
    assert "planned by template:pev: 3 steps (source=planner, format_valid=True)" in err
    for i, agent in enumerate(["sim-planner", "sim-coder", "sim-reviewer"]):
        assert re.search(rf"^\s+\d+\.\ds  > step {i} running on {agent}$", err, re.M), err
        assert re.search(rf"^\s+\d+\.\ds  \+ step {i} done on {agent}: \d+\.\ds, \d+ in / \d+ out tokens$", err, re.M)
    assert "  0 <- (root)   sim-planner" in err
    assert "  2 <- 0, 1   sim-reviewer" in err
    assert f"job {job_id} succeeded in" in err
    assert f"conductor trace {job_id} --data-dir {data_dir}" in err


def test_trace_and_status_read_the_embedded_store(sim_run: Any) -> None:
    _, data_dir = sim_run
    job_id = only_job(data_dir)["id"]
    trace = conductor("trace", job_id, "--data-dir", str(data_dir), cwd=data_dir)
    assert trace.returncode == 0, trace.stderr
    assert f"job {job_id}  status=succeeded" in trace.stdout
    for i, agent in enumerate(["sim-planner", "sim-coder", "sim-reviewer"]):
        assert re.search(rf"^\[{i}\] {agent} \(sim:.*\)  succeeded", trace.stdout, re.M), trace.stdout
    status = conductor("status", job_id, "--data-dir", str(data_dir), cwd=data_dir)
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert view["status"] == "succeeded"
    assert len(view["workflow"]["steps"]) == 3


def test_the_printed_env_var_alternative_reads_the_store_too(sim_run: Any) -> None:
    _, data_dir = sim_run
    job_id = only_job(data_dir)["id"]
    url = f"sqlite:///{data_dir / 'conductor.sqlite3'}"
    trace = conductor("trace", job_id, cwd=data_dir, CONDUCTOR_DATABASE_URL=url)
    assert trace.returncode == 0, trace.stderr
    assert "status=succeeded" in trace.stdout


def test_trace_and_status_of_a_store_an_older_release_wrote_migrate_it_first(tmp_path: Path) -> None:
    # said "lacks Conductor Queue's schema (no such column ...): run `conductor migrate`", which has no
    # --data-dir and migrates CONDUCTOR_DATABASE_URL (the default Postgres) instead
    from alembic import command

    from conductor.migrations.migrate import alembic_config

    assert conductor("run", "Say hi.", "--pool", "sim", "--data-dir", str(tmp_path), cwd=tmp_path).returncode == 0
    job_id = only_job(tmp_path)["id"]
    url = f"sqlite:///{tmp_path / 'conductor.sqlite3'}"
    command.downgrade(alembic_config(url), "0011_tenant_in_flight")
    trace = conductor("trace", job_id, "--data-dir", str(tmp_path), cwd=tmp_path)
    assert trace.returncode == 0 and "status=succeeded" in trace.stdout, trace.stderr
    assert rows(tmp_path / "conductor.sqlite3", "SELECT version_num FROM alembic_version")[0][0] == (
        ScriptDirectory.from_config(alembic_config(url)).get_current_head())
    status = conductor("status", job_id, "--data-dir", str(tmp_path), cwd=tmp_path)
    assert status.returncode == 0 and json.loads(status.stdout)["status"] == "succeeded", status.stderr


def test_parallel_steps_run_through_the_embedded_worker(tmp_path: Path) -> None:
    result = conductor(
        "run", "Compare quicksort and mergesort.", "--pool", "sim", "--planner", "template:fanout",
        "--data-dir", str(tmp_path), cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    steps = steps_of(tmp_path, only_job(tmp_path)["id"])
    assert len(steps) == 4
    assert json.loads(steps[3]["access_list"]) == [0, 1, 2]
    # The three independent attempts overlapped: each started before any of them finished.
    starts = sorted(s["started_at"] for s in steps[:3])
    ends = sorted(s["finished_at"] for s in steps[:3])
    assert starts[-1] < ends[0]


def test_a_second_run_reuses_the_store(tmp_path: Path) -> None:
    for _ in range(2):
        result = conductor("run", "Say hi.", "--pool", "sim", "--data-dir", str(tmp_path), cwd=tmp_path)
        assert result.returncode == 0, result.stderr
    assert len(rows(tmp_path / "conductor.sqlite3", "SELECT id FROM job")) == 2


# --- errors: non-zero exit and one line saying why ---------------------------------------------------


def test_unknown_pool_is_one_line_and_non_zero(tmp_path: Path) -> None:
    result = conductor("run", "x", "--pool", "no-such-pool", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "unknown pool 'no-such-pool'" in lines[0]
    assert "local" in lines[0] and "sim" in lines[0]  # the known pools are listed
    assert result.stdout == ""


def test_unusable_data_dir_is_a_clear_message(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = conductor("run", "x", "--pool", "sim", "--data-dir", str(blocker / "data"), cwd=tmp_path)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot use data directory {blocker / 'data'}" in lines[0]
    assert "--data-dir" in lines[0]


def newer_store(data_dir: Path) -> Path:
    """A store a newer release of conductor-queue migrated: at a revision this one does not have."""
    from conductor.migrations.migrate import upgrade

    db = data_dir / "conductor.sqlite3"
    upgrade(f"sqlite:///{db}")
    con = sqlite3.connect(db)
    with con:
        con.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    con.close()
    return db


def test_a_store_from_a_newer_release_says_to_upgrade_the_package(tmp_path: Path) -> None:
    # was a traceback: alembic.util.exc.CommandError: Can't locate revision identified by '9999_...'
    db = newer_store(tmp_path)
    for result in (
        conductor("run", "x", "--pool", "sim", "--data-dir", str(tmp_path), cwd=tmp_path),
        conductor("migrate", cwd=tmp_path, CONDUCTOR_DATABASE_URL=f"sqlite:///{db}"),
    ):
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert f"{db} was written by a newer release of conductor-queue" in last, result.stderr
        assert "9999_from_the_future" in last and "upgrade conductor-queue" in last


def test_a_store_that_cannot_be_migrated_says_why(tmp_path: Path) -> None:
    (tmp_path / "conductor.sqlite3").write_bytes(b"not sqlite at all" * 100)
    result = conductor("run", "x", "--pool", "sim", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "cannot prepare the store" in last and "file is not a database" in last  # was only "DatabaseError"


def test_trace_of_a_missing_store_says_so(tmp_path: Path) -> None:
    result = conductor("trace", "abc", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode != 0
    assert "no embedded store" in result.stderr


def test_a_failed_job_exits_non_zero_with_its_reason(tmp_path: Path) -> None:
    pool = tmp_path / "broken.yaml"
    pool.write_text(
        "planner: template:single\nagents:\n  b: {provider: sim, options: {always_fail: true, error: bad_request}}\n"
    )
    result = conductor("run", "x", "--pool", str(pool), "--data-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("conductor: job ") and " failed: " in last and "bad request" in last
    assert only_job(tmp_path)["status"] == "failed"


def test_local_model_file_missing_is_one_line_before_any_job(tmp_path: Path) -> None:
    require_llama_cpp()
    pool = tmp_path / "mine.yaml"
    missing = tmp_path / "x.gguf"
    pool.write_text(
        f"planner: template:single\nagents:\n  g: {{provider: local, model: m, options: {{model_path: {missing}}}}}\n"
    )
    result = conductor("run", "x", "--pool", str(pool), "--data-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "model file" in last and "does not exist" in last
    assert rows(tmp_path / "conductor.sqlite3", "SELECT id FROM job") == []


# --- the real local model (slow: llama.cpp on the CPU) ------------------------------------------------


DOCTEST_HARNESS = """
import doctest, sys
result = doctest.testmod()
print(f"doctests attempted={result.attempted} failed={result.failed}")
sys.exit(1 if result.failed or result.attempted < 2 else 0)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_demo_answers_its_own_task_and_the_answers_doctests_pass(tmp_path: Path) -> None:
    """`make demo` as a new user runs it: the default (local) pool, the demo's task, and the answer's
    code executed with its own doctests (at least the two the task asks for), which must pass."""
    from conductor.evaluation.sandbox import run_python
    from conductor.evaluation.scoring import extract_code

    result = conductor("run", TASK, "--data-dir", str(tmp_path), cwd=tmp_path, timeout=840)
    assert result.returncode == 0, result.stderr
    assert "pool: local (no OPENAI_API_KEY" in result.stderr  # the default without provider keys
    assert "Qwen2.5-Coder 1.5B Instruct" in result.stderr
    job = only_job(tmp_path)
    steps = steps_of(tmp_path, job["id"])
    assert job["status"] == "succeeded" and steps
    for st in steps:
        assert st["status"] == "succeeded"
        assert st["provider"] == "local" and st["model"] == "qwen2.5-coder-1.5b-instruct-q4_k_m"
        assert st["input_tokens"] > 0 and 0 < st["output_tokens"] <= 512
    assert result.stdout == steps[-1]["output"] + "\n"
    code = extract_code(result.stdout, "is_palindrome")
    assert "def is_palindrome(" in code, result.stdout
    checked = run_python(code + "\n" + DOCTEST_HARNESS, timeout_s=30)
    assert checked.passed, f"{checked.output}\n--- answer ---\n{result.stdout}"
    assert "failed=0" in checked.output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_model_can_plan_the_demo_under_the_grammar(tmp_path: Path) -> None:
    """The local model as the conductor: a real planner call under the JSON-schema grammar, its workflow
    accepted (or replaced by the fallback with the reason recorded), every step run on the model."""
    result = conductor("run", TASK, "--planner", "qwen-coder", "--data-dir", str(tmp_path), cwd=tmp_path,
                       timeout=560)
    assert result.returncode == 0, result.stderr
    job = only_job(tmp_path)
    steps = steps_of(tmp_path, job["id"])
    assert job["planner_calls"] >= 1
    assert job["planner_input_tokens"] > 500  # the conductor prompt lists the workers, rules and examples
    assert job["planner_output_tokens"] > 0 and job["planner_raw"]
    assert (job["workflow_source"], job["format_valid"]) == ("planner", 1) or (
        job["workflow_source"] == "fallback" and job["format_valid"] == 0 and job["planner_error"]
    )
    assert all(st["status"] == "succeeded" and st["output"].strip() for st in steps)
    assert job["input_tokens"] == job["planner_input_tokens"] + sum(s["input_tokens"] for s in steps)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_task_too_long_for_the_local_context_fails_clearly(tmp_path: Path) -> None:
    pool = tmp_path / "small.yaml"
    pool.write_text(
        textwrap.dedent(
            """\
            planner: template:single
            agents:
              g: {provider: local, model: gemma-3-270m-q4_k_m, options: {n_ctx: 512}}
            """
        )
    )
    task = "Summarize this: " + "the quick brown fox jumps over the lazy dog " * 120
    result = conductor("run", task, "--pool", str(pool), "--data-dir", str(tmp_path), cwd=tmp_path, timeout=280)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "task too long for the local model's context" in last
    assert "n_ctx) is 512 tokens" in last
    assert only_job(tmp_path)["status"] == "failed"


def test_bad_agent_options_fail_before_any_job(tmp_path: Path) -> None:
    pool = tmp_path / "typo.yaml"
    pool.write_text("planner: template:single\nagents:\n  s: {provider: sim, options: {latency: 5}}\n")
    result = conductor("run", "x", "--pool", str(pool), "--data-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("conductor: agent 's': bad options")
    assert rows(tmp_path / "conductor.sqlite3", "SELECT id FROM job") == []


def test_unknown_planner_is_one_line(tmp_path: Path) -> None:
    result = conductor("run", "x", "--pool", "sim", "--planner", "oracle", "--data-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "unknown planner" in last and "'oracle'" in last


@pytest.mark.parametrize(
    ("keys", "planner", "workers"),
    [({"OPENAI_API_KEY": "sk-x"}, "gpt-5-planner", ["gpt-5"]),
     ({"GEMINI_API_KEY": "g", "ANTHROPIC_API_KEY": "a"}, "claude-sonnet-4-planner",
      ["claude-sonnet-4", "gemini-2.5-pro"])],
)
def test_with_provider_keys_the_default_pool_is_the_hosted_models_with_those_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, keys: dict[str, str], planner: str, workers: list[str]
) -> None:
    # the research pool plans on a GPU node (http://planner:8000) and has open models behind vLLM: outside
    # its deployment a job on it failed with one key set (the fallback put a step on a model without one)
    from conductor.embedded import default_pool
    from conductor.pool.config import load_pool

    for var in KEY_VARS:
        monkeypatch.delenv(var, raising=False)
    assert default_pool(data_dir=tmp_path)[0] == "local"
    for var, value in keys.items():
        monkeypatch.setenv(var, value)
    path, why = default_pool(data_dir=tmp_path)
    pool = load_pool(Path(path))
    assert (pool.name, pool.planner, pool.worker_names) == ("hosted", planner, workers)
    # one provider model plans and runs steps: both take their slots from the worker's rpm bucket
    assert pool.agents[planner].bucket(planner) == workers[0] == pool.agents[workers[0]].bucket(workers[0])
    assert all(var in why for var in keys)
    assert Path(path).name == "hosted-" + "-".join(sorted(k.removesuffix("_API_KEY").lower() for k in keys)) + ".yaml"
    assert [p.name for p in (tmp_path / "pools").iterdir()] == [Path(path).name]  # written whole, one per key set


def test_a_run_with_one_provider_key_plans_and_answers_with_that_provider(tmp_path: Path) -> None:
    """The real ``openai`` SDK, pointed at a loopback server by its own OPENAI_BASE_URL, as a user with
    only an OpenAI key runs ``conductor run``."""
    from tests.fakes.openai_server import FakeOpenAIServer

    workflow = json.dumps({"model_ids": ["gpt-5"], "subtasks": ["Multiply and answer."], "access_lists": [[]]})
    with FakeOpenAIServer(api_key="sk-test") as server:
        server.reply_with(lambda body: workflow if body.get("response_format") else "Answer: 42")
        result = conductor("run", "What is 6 times 7?", "--data-dir", str(tmp_path), cwd=tmp_path,
                           OPENAI_API_KEY="sk-test", OPENAI_BASE_URL=server.base_url)
        bodies = server.bodies
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "Answer: 42"
    assert "pool: " in result.stderr and "hosted-openai.yaml (OPENAI_API_KEY set" in result.stderr
    job = only_job(tmp_path)
    assert (job["status"], job["workflow_source"]) == ("succeeded", "planner")
    assert [st["agent"] for st in steps_of(tmp_path, job["id"])] == ["gpt-5"]
    assert [b["model"] for b in bodies] == ["gpt-5", "gpt-5"]  # the plan, then the step


def test_recursive_conductor_steps_complete_on_sqlite(tmp_path: Path) -> None:
    """A step run by the planner itself is a child job; its timestamps come back from SQLite without a
    time zone, which used to crash finalize and leave the parent waiting forever."""
    workflow = '{"model_ids": ["conductor", "w"], "subtasks": ["check", "finish"], "access_lists": [[], [0]]}'
    pool = tmp_path / "nested.yaml"
    pool.write_text(
        textwrap.dedent(
            f"""\
            planner: boss
            agents:
              boss: {{provider: sim, options: {{reply: '{workflow}'}}}}
              w: {{provider: sim, options: {{latency_ms: 20}}}}
            """
        )
    )
    result = conductor("run", "nested", "--pool", str(pool), "--data-dir", str(tmp_path), cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    db = tmp_path / "conductor.sqlite3"
    jobs = rows(db, "SELECT depth, status, workflow_source FROM job ORDER BY depth")
    # depth 0 and 1 plan a recursive step; at the depth limit the same answer is invalid -> fallback.
    assert [(j["depth"], j["status"]) for j in jobs] == [(0, "succeeded"), (1, "succeeded"), (2, "succeeded")]
    assert jobs[2]["workflow_source"] == "fallback"
    assert result.stdout == "[w] finish\n"
    trace = conductor("trace", only_job(tmp_path)["id"], "--data-dir", str(tmp_path), cwd=tmp_path)
    assert trace.stdout.count("child job:") == 2


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_ctrl_c_cancels_the_job_and_exits_at_once(tmp_path: Path, name: str) -> None:
    """Ctrl-C, a kill or a closed terminal: the job is cancelled in the store (left running, a SIGTERM'd
    or SIGHUP'd run's job was picked up and finished by the next run on the data directory)."""
    import signal
    import time

    sig = signal.Signals[name]
    pool = tmp_path / "slow.yaml"
    pool.write_text("planner: template:single\nagents:\n  s: {provider: sim, options: {latency_ms: 30000}}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "conductor.cli", "run", "x", "--pool", str(pool), "--data-dir", str(tmp_path)],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, even under a shell
    )
    db = tmp_path / "conductor.sqlite3"
    deadline = time.monotonic() + 60
    while True:  # wait until the step is running
        assert time.monotonic() < deadline and proc.poll() is None, "the step never started"
        try:
            if rows(db, "SELECT 1 FROM step WHERE status = 'running'"):
                break
        except sqlite3.OperationalError:  # not created or not migrated yet
            pass
        time.sleep(0.1)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)  # well before the 30 s step would finish
    assert proc.returncode == 128 + sig
    assert err.strip().splitlines()[-1] == f"conductor: interrupted ({name})"
    job = only_job(tmp_path)
    assert job["status"] == "cancelled"


def test_a_configured_pool_file_is_the_default(tmp_path: Path) -> None:
    pool = tmp_path / "mine.yaml"
    pool.write_text("planner: template:single\nagents:\n  only: {provider: sim, options: {reply: from my pool}}\n")
    result = conductor("run", "x", "--data-dir", str(tmp_path), cwd=tmp_path, CONDUCTOR_POOL_FILE=str(pool))
    assert result.returncode == 0, result.stderr
    assert f"pool: {pool} (CONDUCTOR_POOL_FILE" in result.stderr
    assert result.stdout == "from my pool\n"
