"""The ``conductor`` CLI as a user runs it: keys, submit --wait, status, trace, cancel, migrate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conductor.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_keys_submit_wait_status_trace(proc_env: dict[str, str], api: str, client: httpx.Client,
                                       tmp_path: Path) -> None:
    created = cli("keys", "create", "--tenant", "cli-user", env=proc_env)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    assert key.startswith("cq_") and len(key) > 30

    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps({"model_ids": ["a", "b"], "subtasks": ["draft", "polish"],
                                    "access_lists": [[], [0]]}))
    env = {**proc_env, "CONDUCTOR_API_URL": api, "CONDUCTOR_API_KEY": key}
    done = cli("submit", "write a haiku", "--workflow", str(workflow), "--wait", env=env)
    assert done.returncode == 0, done.stderr
    job_id, answer = done.stdout.strip().splitlines()[0], done.stdout.strip().splitlines()[-1]
    assert answer == "[b] polish"
    assert "succeeded" in done.stderr  # progress lines

    status = cli("status", job_id, env=env)
    assert status.returncode == 0 and json.loads(status.stdout)["answer"] == "[b] polish"

    trace = cli("trace", job_id, env=env)
    assert trace.returncode == 0, trace.stderr
    assert "1 <- 0   b" in trace.stdout and "[0] a (sim:" in trace.stdout and "critical path: 0 -> 1" in trace.stdout
    assert trace.stdout.count("attempt 1 on ") == 2 and "attempt 1 on -" not in trace.stdout  # the operator's view
    steps = json.loads(cli("trace", job_id, "--json", env=env).stdout)
    assert [s["output"] for s in steps] == ["[a] draft", "[b] polish"]

    again = cli("cancel", job_id, env=env)
    assert again.returncode == 1 and again.stderr.strip() == f"conductor: job {job_id} already ended (succeeded)"


def test_errors_are_one_line_and_non_zero(proc_env: dict[str, str]) -> None:
    missing = cli("trace", "no-such-job", env=proc_env)
    assert missing.returncode == 1 and missing.stderr.startswith("conductor: no job 'no-such-job'")
    assert "postgresql+psycopg://" in missing.stderr and "Traceback" not in missing.stderr
    down = cli("submit", "x", env={**proc_env, "CONDUCTOR_API_URL": "http://127.0.0.1:1"})
    assert down.returncode == 1 and "is 'conductor serve' running?" in down.stderr
    bad_db = cli("migrate", env={**proc_env, "CONDUCTOR_DATABASE_URL": "postgresql+psycopg://nobody:secret@127.0.0.1:1/x"})
    assert bad_db.returncode == 1 and "check CONDUCTOR_DATABASE_URL" in bad_db.stderr
    assert "secret" not in bad_db.stderr
    no_workers = cli("serve", "--workers", "0", env=proc_env)
    assert no_workers.returncode == 2 and "--workers must be at least 1" in no_workers.stderr


def test_migrate_is_idempotent(proc_env: dict[str, str]) -> None:
    result = cli("migrate", env=proc_env)
    assert result.returncode == 0 and "latest revision" in result.stdout


def test_a_revoked_key_is_refused(proc_env: dict[str, str], api: str) -> None:
    key = cli("keys", "create", "--tenant", "short-lived", env=proc_env).stdout.strip().splitlines()[-1]
    assert httpx.get(f"{api}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    listed = cli("keys", "list", "--tenant", "short-lived", env=proc_env)
    assert listed.returncode == 0 and key[:10] in listed.stdout and key not in listed.stdout
    revoked = cli("keys", "revoke", key[:10], env=proc_env)
    assert revoked.returncode == 0 and "revoked 1 key" in revoked.stdout
    assert httpx.get(f"{api}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    again = cli("keys", "revoke", key[:10], env=proc_env)
    assert again.returncode == 1 and "no active key" in again.stderr
