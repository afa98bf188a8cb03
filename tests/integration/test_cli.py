"""The ``conductor`` CLI as a user runs it: keys, submit --wait, status, trace, cancel, migrate."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import httpx
import sqlalchemy as sa
from sqlmodel import Session, col

from conductor.settings import Settings
from conductor.store.db import get_engine
from conductor.store.models import Job, utcnow
from conductor.submission import JobCreate, create_job


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
    assert down.returncode == 1 and "is 'conductor serve' running there (CONDUCTOR_API_URL)?" in down.stderr
    bad_db = cli("migrate", env={**proc_env, "CONDUCTOR_DATABASE_URL": "postgresql+psycopg://nobody:secret@127.0.0.1:1/x"})
    assert bad_db.returncode == 1 and "check CONDUCTOR_DATABASE_URL" in bad_db.stderr
    assert "secret" not in bad_db.stderr
    no_workers = cli("serve", "--workers", "0", env=proc_env)
    assert no_workers.returncode == 2 and "--workers must be at least 1" in no_workers.stderr


def test_a_database_problem_is_one_line_saying_what_to_do(proc_env: dict[str, str], tmp_path: Path) -> None:
    down = {**proc_env, "CONDUCTOR_DATABASE_URL": "postgresql+psycopg://nobody:secret@127.0.0.1:1/x?password=s2"}
    empty = {**proc_env, "CONDUCTOR_DATABASE_URL": f"sqlite:///{tmp_path / 'empty.db'}"}
    not_a_url = {**proc_env, "CONDUCTOR_DATABASE_URL": "postgres://nobody:secret@127.0.0.1:1/x"}
    for args, env, says in [
        (("keys", "list"), down, "check that it is up and that CONDUCTOR_DATABASE_URL names it"),
        (("cancel", "0" * 32), down, "check that it is up"),
        (("reconcile",), down, "check that it is up"),
        (("keys", "list"), empty, "run `conductor migrate`"),
        (("webhooks", "secret", "--tenant", "t"), empty, "run `conductor migrate`"),
        (("keys", "list"), not_a_url, "use postgresql+psycopg://"),
    ]:
        done = cli(*args, env=env)
        assert done.returncode == 1 and says in done.stderr, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert "secret" not in done.stderr and "s2" not in done.stderr and "whsec_" not in done.stderr


def test_reconcile_exits_non_zero_when_its_resends_cannot_be_sent(proc_env: dict[str, str], tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'store.db'}"
    env = {**proc_env, "CONDUCTOR_DATABASE_URL": url, "CONDUCTOR_BROKER_URL": "redis://127.0.0.1:1/0"}
    assert cli("migrate", env=env).returncode == 0
    settings = Settings(database_url=url)
    with Session(get_engine(url)) as session:  # a job whose plan message was never sent (its API died)
        job, _ = create_job(session, JobCreate(task="x"), tenant="t", settings=settings, commit=True)
        session.execute(sa.update(Job).where(col(Job.id) == job.id).values(
            enqueued_at=None, created_at=utcnow() - timedelta(minutes=1)))
        session.commit()
    done = cli("reconcile", env=env)
    assert json.loads(done.stdout)["never_enqueued"] == 1
    assert done.returncode == 1 and "is the broker (CONDUCTOR_BROKER_URL) up?" in done.stderr.splitlines()[-1]


def test_a_prefix_two_keys_share_revokes_neither_until_told_which(proc_env: dict[str, str], api: str) -> None:
    # a prefix is cq_ + 7 random characters: two keys may share one, and revoking by it ended both silently
    first = cli("keys", "create", "--tenant", "twin-a", env=proc_env).stdout.strip().splitlines()[-1]
    second = cli("keys", "create", "--tenant", "twin-b", env=proc_env).stdout.strip().splitlines()[-1]
    with get_engine().begin() as conn:  # the collision, made on purpose
        conn.execute(sa.text("UPDATE api_key SET prefix = :p WHERE prefix = :q"), {"p": first[:10], "q": second[:10]})

    def works(key: str) -> bool:
        return httpx.get(f"{api}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code == 200

    refused = cli("keys", "revoke", first[:10], env=proc_env)
    assert refused.returncode == 1 and "nothing revoked: 2 active keys" in refused.stderr
    assert "twin-a, twin-b" in refused.stderr and works(first) and works(second)
    one = cli("keys", "revoke", first[:10], "--tenant", "twin-b", env=proc_env)
    assert one.returncode == 0 and "revoked 1 key" in one.stdout and works(first) and not works(second)
    third = cli("keys", "create", "--tenant", "twin-a", env=proc_env).stdout.strip().splitlines()[-1]
    with get_engine().begin() as conn:  # and one within a tenant: the whole key names it
        conn.execute(sa.text("UPDATE api_key SET prefix = :p WHERE prefix = :q"), {"p": first[:10], "q": third[:10]})
    whole = cli("keys", "revoke", third, env=proc_env)
    assert whole.returncode == 0 and "revoked 1 key" in whole.stdout and works(first) and not works(third)
    rest = cli("keys", "revoke", first[:10], "--all", env=proc_env)
    assert rest.returncode == 0 and "revoked 1 key" in rest.stdout and not works(first)


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
