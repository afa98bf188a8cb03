"""Webhooks end to end: the API, Celery worker processes, Postgres and Redis are real; the receiver is a
loopback HTTP server that checks every signature with the ``standardwebhooks`` library, unchanged."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa
from cryptography.fernet import Fernet
from standardwebhooks import Webhook

from conductor.settings import get_settings
from conductor.store.db import get_engine
from tests.integration.conftest import new_key
from tests.integration.harness import Proc, start_api, start_worker, wait_terminal
from tests.integration.webhook_receiver import Received, Receiver, serve_receiver, silent_receiver

pytestmark = pytest.mark.integration

TWO_STEPS = {"model_ids": ["a", "b"], "subtasks": ["draft", "polish"], "access_lists": [[], [0]]}
SLOW = {"model_ids": ["slow"], "subtasks": ["take your time"], "access_lists": [[]]}
FAILING = {"model_ids": ["refuses"], "subtasks": ["no"], "access_lists": [[]]}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with serve_receiver() as r:
        yield r


SECRETS_KEY = Fernet.generate_key().decode()


@pytest.fixture(scope="module")
def hook_env(proc_env: dict[str, str]) -> dict[str, str]:
    """The receiver is on loopback, so loopback is allowed; retries come after 0.5 s instead of minutes; a
    tenant has at most 2 attempts in flight (the webhooks worker has 4 slots).
    Secrets are sealed at rest here (``CONDUCTOR_SECRETS_KEY``); the other webhook tests store them as given."""
    return {**proc_env, "CONDUCTOR_WEBHOOK_ALLOW_LOOPBACK": "true", "CONDUCTOR_WEBHOOK_BACKOFF_S": "[0.5, 0.5, 0.5]",
            "CONDUCTOR_WEBHOOK_TIMEOUT_S": "5", "CONDUCTOR_RECONCILE_STALE_S": "0",
            "CONDUCTOR_WEBHOOK_TENANT_MAX_IN_FLIGHT": "2",
            "CONDUCTOR_SECRETS_KEY": SECRETS_KEY, "CONDUCTOR_WEBHOOK_DENIED_TARGETS": DENIED,
            "CONDUCTOR_ALLOWED_HOSTS": "127.0.0.1,localhost,api.example.com"}


DENIED = "93.184.215.0/24, flower.example.com"
"""This deployment's own public address and names, as an operator lists them (the loopback receiver stays
allowed: CONDUCTOR_WEBHOOK_ALLOW_LOOPBACK)."""


@pytest.fixture(scope="module")
def hook_api(hook_env: dict[str, str]) -> Iterator[str]:
    proc, url = start_api(hook_env)
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def step_worker(hook_env: dict[str, str]) -> Iterator[Proc]:
    proc = start_worker(hook_env, "wh-steps", queues="planner,steps", concurrency=4)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def hook_worker(hook_env: dict[str, str], step_worker: Proc) -> Iterator[Callable[[], Proc]]:
    """The ``webhooks`` queue's own worker; a test may stop it (``stop_hook_worker``) and start it again."""
    procs = [start_worker(hook_env, "wh-hooks", queues="webhooks", concurrency=4)]

    def current() -> Proc:
        if procs[-1].popen.poll() is not None:
            procs.append(start_worker(hook_env, "wh-hooks", queues="webhooks", concurrency=4))
        return procs[-1]

    yield current
    for p in procs:
        p.stop()


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conductor.cli", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@dataclass
class Tenant:
    name: str
    client: httpx.Client
    secret: str


@pytest.fixture
def tenant(request: pytest.FixtureRequest, hook_api: str, hook_env: dict[str, str],
           hook_worker: Callable[[], Proc]) -> Iterator[Tenant]:
    name = f"hooks-{request.node.name[:40]}-{time.monotonic_ns()}"
    shown = cli("webhooks", "secret", "--tenant", name, env=hook_env)
    assert shown.returncode == 0, shown.stderr
    secret = shown.stdout.strip().splitlines()[-1]
    key = new_key(name)
    with httpx.Client(base_url=hook_api, headers={"Authorization": f"Bearer {key}"}, timeout=30) as c:
        yield Tenant(name, c, secret)


def submit(client: httpx.Client, **body: Any) -> str:
    r = client.post("/v1/jobs", json={"task": "webhook test", **body})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


def settled_deliveries(client: httpx.Client, job_id: str, timeout: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    data: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        r = client.get(f"/v1/jobs/{job_id}/deliveries")
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        if data and all(d["status"] != "pending" for d in data):
            return data
        time.sleep(0.1)
    raise AssertionError(f"deliveries of {job_id} did not settle: {data}")


def verified(secret: str, got: Received) -> dict[str, Any]:
    """The receiver's side: the reference verifier checks the signature over the raw body."""
    payload: dict[str, Any] = Webhook(secret).verify(got.body, got.headers)
    return payload


def test_signed_webhook_is_retried_after_a_500_with_the_same_webhook_id(
    tenant: Tenant, receiver: Receiver
) -> None:
    url = receiver.on("/retry", 500, 200)
    job_id = submit(tenant.client, workflow=TWO_STEPS, webhook_url=url)
    job = wait_terminal(tenant.client, job_id)

    first, second = receiver.wait_for("/retry", 2)
    assert (first.answered, second.answered) == (500, 200)
    assert first.headers["webhook-id"] == second.headers["webhook-id"]
    assert first.body == second.body  # a retry is the same message
    for got in (first, second):
        event = verified(tenant.secret, got)
        assert event["type"] == "job.succeeded"
        assert event["data"]["id"] == job_id and event["data"]["answer"] == job["answer"] == "[b] polish"
        assert event["data"]["status"] == "succeeded" and event["timestamp"] == job["finished_at"]

    [delivery] = settled_deliveries(tenant.client, job_id)
    assert delivery["id"] == first.headers["webhook-id"]
    assert delivery["status"] == "delivered" and delivery["url"] == url and delivery["type"] == "job.succeeded"
    assert [a["status_code"] for a in delivery["attempts"]] == [500, 200]
    assert [a["n"] for a in delivery["attempts"]] == [1, 2]
    assert delivery["attempts"][0]["error"] == "HTTP 500" and delivery["attempts"][1]["error"] is None
    assert all(a["latency_ms"] is not None for a in delivery["attempts"])
    assert len(receiver.at("/retry")) == 2  # nothing after the 2xx


def test_a_tenant_whose_receiver_never_answers_holds_two_slots_and_another_tenant_is_delivered_meanwhile(
    tenant: Tenant, receiver: Receiver, hook_api: str, hook_env: dict[str, str]
) -> None:
    """Five jobs of one tenant end with a webhook to a receiver that accepts and never answers, on a webhooks
    worker of four slots: two attempts go out (its cap), the other three are put off, and another tenant's
    webhook goes out at once instead of waiting behind them."""
    other_name = f"{tenant.name}-other"
    shown = cli("webhooks", "secret", "--tenant", other_name, env=hook_env)
    assert shown.returncode == 0, shown.stderr
    other_secret = shown.stdout.strip().splitlines()[-1]
    other = httpx.Client(base_url=hook_api, headers={"Authorization": f"Bearer {new_key(other_name)}"}, timeout=30)
    with other, silent_receiver() as silent:
        greedy = [submit(tenant.client, workflow=TWO_STEPS, webhook_url=silent.url) for _ in range(5)]
        silent.wait_for_connections(2)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # every one of the five has been taken up: sent, or put off
            rows = [d for job_id in greedy for d in tenant.client.get(f"/v1/jobs/{job_id}/deliveries").json()["data"]]
            if sum(d["deferrals"] for d in rows) >= 3:
                break
            time.sleep(0.1)
        fair_job = submit(other, workflow=TWO_STEPS, webhook_url=receiver.on("/fair", 200))
        [got] = receiver.wait_for("/fair", 1)
        assert verified(other_secret, got)["data"]["id"] == fair_job
        assert len(silent.held) == 2  # before: four (every slot), and the other tenant's webhook waited 5 s
        [fair] = settled_deliveries(other, fair_job)
    assert fair["status"] == "delivered" and fair["deferrals"] == 0
    delivered_at = datetime.fromisoformat(fair["attempts"][0]["finished_at"])
    # the silent receiver gone, each of the five makes its own attempts (refused) and fails: none is lost,
    # and being put off counted as no attempt
    ended = [d for job_id in greedy for d in settled_deliveries(tenant.client, job_id)]
    assert [d["status"] for d in ended] == ["failed"] * 5
    assert all([a["n"] for a in d["attempts"]] == [1, 2, 3, 4] for d in ended), ended
    assert sum(d["deferrals"] for d in ended) >= 3
    first_ends = sorted(datetime.fromisoformat(d["attempts"][0]["finished_at"]) for d in ended)
    assert delivered_at < first_ends[0]  # delivered while the first two attempts were still in flight


def test_410_disables_the_url_for_the_tenant(tenant: Tenant, receiver: Receiver, hook_env: dict[str, str]) -> None:
    url = receiver.on("/gone", 410)
    first_job = submit(tenant.client, workflow=TWO_STEPS, webhook_url=url)
    [delivery] = settled_deliveries(tenant.client, first_job)
    assert delivery["status"] == "disabled"
    assert [a["status_code"] for a in delivery["attempts"]] == [410]

    second_job = submit(tenant.client, workflow=TWO_STEPS, webhook_url=url)
    [skipped] = settled_deliveries(tenant.client, second_job)
    assert skipped["status"] == "disabled"
    assert skipped["attempts"][0]["status_code"] is None and "410 Gone" in skipped["attempts"][0]["error"]
    assert len(receiver.at("/gone")) == 1  # the second job's webhook was never sent

    enabled = cli("webhooks", "enable", "--tenant", tenant.name, url, env=hook_env)
    assert enabled.returncode == 0, enabled.stderr
    receiver.on("/gone", 204)
    third_job = submit(tenant.client, workflow=TWO_STEPS, webhook_url=url)
    assert settled_deliveries(tenant.client, third_job)[0]["status"] == "delivered"
    assert len(receiver.at("/gone")) == 2


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/hook",
                                 "http://[::ffff:10.0.0.1]/hook", "http://0xa9fea9fe/hook"])
def test_private_and_metadata_targets_are_refused_at_submit(tenant: Tenant, url: str) -> None:
    before = len(tenant.client.get("/v1/jobs").json()["data"])
    r = tenant.client.post("/v1/jobs", json={"task": "t", "webhook_url": url})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["title"] == "Webhook target refused"
    assert problem["errors"][0]["loc"] == ["body", "webhook_url"]
    assert len(tenant.client.get("/v1/jobs").json()["data"]) == before  # no job, so nothing will ever be sent


@pytest.mark.parametrize("url", ["http://93.184.215.14:5555/api/worker/shutdown/celery@w1",
                                 "http://[::ffff:93.184.215.14]:5555/x", "https://flower.example.com/api",
                                 "https://api.example.com/v1/jobs"])
def test_the_deployments_own_targets_are_refused_at_submit_and_by_the_cli(tenant: Tenant, hook_env: dict[str, str],
                                                                         url: str) -> None:
    """``CONDUCTOR_WEBHOOK_DENIED_TARGETS`` and the API's own name (``CONDUCTOR_ALLOWED_HOSTS``): public targets,
    but this deployment's (its Flower, its API), refused as a private one is: no job; nor as a tenant's
    default URL."""
    r = tenant.client.post("/v1/jobs", json={"task": "t", "webhook_url": url})
    assert r.status_code == 422, r.text
    problem = r.json()
    assert problem["title"] == "Webhook target refused" and problem["errors"][0]["loc"] == ["body", "webhook_url"]
    assert "this deployment's own" in problem["errors"][0]["msg"]
    refused = cli("webhooks", "url", "--tenant", tenant.name, url, env=hook_env)
    assert refused.returncode != 0 and "this deployment's own" in refused.stderr
    # (every other test of this module delivers to its loopback receiver with the same settings)


@pytest.mark.parametrize("length", [2049, 3000])
def test_a_webhook_url_over_2048_characters_is_refused_naming_that_limit(tenant: Tenant, length: int) -> None:
    url = "https://hooks.example.com/" + "a" * (length - len("https://hooks.example.com/"))
    r = tenant.client.post("/v1/jobs", json={"task": "t", "webhook_url": url})
    assert r.status_code == 422, r.text
    [problem] = r.json()["errors"]
    assert problem["loc"] == ["body", "webhook_url"] and "2048 characters" in problem["msg"], problem  # docs/api.md


def test_failed_and_cancelled_jobs_send_their_events(tenant: Tenant, receiver: Receiver) -> None:
    url = receiver.on("/ends", 200)
    failed = submit(tenant.client, workflow=FAILING, webhook_url=url)
    cancelled = submit(tenant.client, workflow=SLOW, webhook_url=url)
    assert tenant.client.post(f"/v1/jobs/{cancelled}/cancel").status_code == 202
    assert wait_terminal(tenant.client, failed)["status"] == "failed"
    events = {verified(tenant.secret, got)["data"]["id"]: verified(tenant.secret, got)
              for got in receiver.wait_for("/ends", 2)}
    assert events[failed]["type"] == "job.failed" and events[failed]["data"]["error"]["type"] == "bad_request"
    assert events[cancelled]["type"] == "job.cancelled" and events[cancelled]["data"]["status"] == "cancelled"


def test_tenant_default_url_is_used_and_deliveries_are_tenant_scoped(
    tenant: Tenant, receiver: Receiver, hook_env: dict[str, str], hook_api: str
) -> None:
    url = receiver.on("/default", 200)
    set_default = cli("webhooks", "url", "--tenant", tenant.name, url, env=hook_env)
    assert set_default.returncode == 0 and set_default.stdout.strip() == url, set_default.stderr
    job_id = submit(tenant.client, workflow=TWO_STEPS)
    [got] = receiver.wait_for("/default", 1)
    assert verified(tenant.secret, got)["data"]["id"] == job_id

    with httpx.Client(base_url=hook_api, headers={"Authorization": f"Bearer {new_key('hooks-other')}"}) as other:
        r = other.get(f"/v1/jobs/{job_id}/deliveries")
    assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json")
    assert tenant.client.get("/v1/jobs/not-a-job/deliveries").status_code == 404


def test_a_lost_delivery_message_is_sent_by_the_reconciler(
    tenant: Tenant, receiver: Receiver, hook_env: dict[str, str], hook_worker: Callable[[], Proc]
) -> None:
    """The job ends while no webhook worker runs and its message is then lost (the queue emptied): the
    outbox row in Postgres still says it is owed, and one reconciler pass sends it again."""
    url = receiver.on("/lost", 200)
    hook_worker().stop()
    job_id = submit(tenant.client, workflow=TWO_STEPS, webhook_url=url)
    wait_terminal(tenant.client, job_id)
    broker = redis.Redis.from_url(get_settings().broker_url)
    deadline = time.monotonic() + 10
    while not broker.llen("webhooks") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert broker.delete("webhooks") == 1  # the message is lost
    hook_worker()  # a webhooks worker again, with nothing to consume
    [pending] = tenant.client.get(f"/v1/jobs/{job_id}/deliveries").json()["data"]
    assert pending["status"] == "pending" and pending["attempts"] == []

    deadline = time.monotonic() + 30
    while not receiver.at("/lost") and time.monotonic() < deadline:
        reconciled = cli("reconcile", env=hook_env)
        assert reconciled.returncode == 0, reconciled.stderr
        time.sleep(1)
    [got] = receiver.wait_for("/lost", 1)
    assert got.headers["webhook-id"] == pending["id"]
    assert settled_deliveries(tenant.client, job_id)[0]["status"] == "delivered"


def test_an_ended_job_without_a_delivery_row_gets_one_from_the_reconciler(
    tenant: Tenant, receiver: Receiver, hook_env: dict[str, str]
) -> None:
    """Whatever path ended a job, if it left no outbox row, the reconciler writes and sends it."""
    url = receiver.on("/backfill", 200)
    job_id = submit(tenant.client, workflow=TWO_STEPS, webhook_url=url)
    assert settled_deliveries(tenant.client, job_id)[0]["status"] == "delivered"
    with get_engine(get_settings().database_url).begin() as conn:  # as if no delivery had been written
        delivery = conn.execute(sa.text("SELECT id FROM webhook_delivery WHERE job_id = :j"), {"j": job_id}).scalar()
        conn.execute(sa.text("DELETE FROM webhook_attempt WHERE delivery_id = :d"), {"d": delivery})
        conn.execute(sa.text("DELETE FROM webhook_delivery WHERE id = :d"), {"d": delivery})

    deadline = time.monotonic() + 30
    while len(receiver.at("/backfill")) < 2 and time.monotonic() < deadline:
        reconciled = cli("reconcile", env=hook_env)
        assert reconciled.returncode == 0, reconciled.stderr
        time.sleep(1)
    _, again = receiver.wait_for("/backfill", 2)
    assert verified(tenant.secret, again)["data"]["id"] == job_id


def stored_secret(tenant: str) -> str:
    with get_engine(get_settings().database_url).connect() as conn:
        return str(conn.execute(sa.text("SELECT webhook_secret FROM tenant_settings WHERE tenant = :t"),
                                {"t": tenant}).scalar_one())


def test_secrets_are_sealed_at_rest_and_one_stored_before_the_key_still_signs(
    tenant: Tenant, receiver: Receiver, hook_env: dict[str, str]
) -> None:
    sealed = stored_secret(tenant.name)
    assert sealed.startswith("fernet:") and tenant.secret not in sealed and tenant.secret[6:] not in sealed
    assert len(sealed) > 128  # the column was widened for it (migration 0014)

    # A secret written before the key was set (plaintext) still signs, and --rotate seals its successor.
    legacy = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWY="
    with get_engine(get_settings().database_url).begin() as conn:
        conn.execute(sa.text("UPDATE tenant_settings SET webhook_secret = :s WHERE tenant = :t"),
                     {"s": legacy, "t": tenant.name})
    url = receiver.on("/legacy", 200)
    job_id = submit(tenant.client, workflow=TWO_STEPS, webhook_url=url)
    wait_terminal(tenant.client, job_id)
    [got] = receiver.wait_for("/legacy", 1)
    assert verified(legacy, got)["data"]["id"] == job_id
    rotated = cli("webhooks", "secret", "--tenant", tenant.name, "--rotate", env=hook_env)
    assert rotated.returncode == 0, rotated.stderr
    new = rotated.stdout.strip().splitlines()[-1]
    assert new != legacy and stored_secret(tenant.name).startswith("fernet:")
    assert "the previous secret also signs every delivery until" in rotated.stderr
    # while receivers switch, a delivery verifies with the new secret and with the one it replaced
    job_id = submit(tenant.client, workflow=TWO_STEPS, webhook_url=receiver.on("/switching", 200))
    wait_terminal(tenant.client, job_id)
    [got] = receiver.wait_for("/switching", 1)
    assert verified(new, got)["data"]["id"] == verified(legacy, got)["data"]["id"] == job_id
    too_long = cli("webhooks", "secret", "--tenant", tenant.name, "--rotate", "--keep-previous-hours", "1000",
                   env=hook_env)
    assert too_long.returncode == 2 and "between 0 and 720 hours" in too_long.stderr
    assert cli("webhooks", "secret", "--tenant", tenant.name, env=hook_env).stdout.strip().splitlines()[-1] == new

    # A process without the key cannot open it, and says what to set.
    without = cli("webhooks", "secret", "--tenant", tenant.name, env={**hook_env, "CONDUCTOR_SECRETS_KEY": ""})
    assert without.returncode == 1 and new not in without.stdout
    assert without.stderr.startswith("conductor: ") and "CONDUCTOR_SECRETS_KEY is not set" in without.stderr
