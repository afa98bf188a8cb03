"""A Celery worker survives its Redis going away under a running task, reconnects, and goes on consuming.

The worker runs as deployed (``conductor worker``: a supervisor and its Celery worker), with its broker on a
redis-server this module starts on a free port, so it is stopped and started again without touching any
other test's Redis. A job's step runs (its message unacknowledged: ``task_acks_late``) when that Redis is
SIGKILLed (its queues lost) or shut down with a save (its queues and the unacknowledged message kept); it
comes back a few seconds later. The Celery worker must be the same process afterwards — not one the
supervisor restarted after kombu's ``AttributeError: 'NoneType' object has no attribute 'hostname'`` ended
it as "Unrecoverable error" (conductor/tasks/transport.py) — the running job must end, and a job submitted
once Redis is back must be run by it. With the save, the task's late acknowledgement must reach the Redis
that came back (its entry in the unacked hash gone), or the message would be delivered again once its
visibility timeout passed.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
import sqlalchemy as sa

from conductor.store.db import get_engine
from tests.integration.conftest import new_key
from tests.integration.harness import Proc, free_port, start_api, start_worker, wait_terminal

DOWN_S = 3.0


class OwnRedis:
    """A redis-server of this test's own on a free loopback port, data in ``dir`` (saved only when asked)."""

    def __init__(self, dir: Path) -> None:
        self.port = free_port()
        self.dir = dir
        self.proc: Proc | None = None

    def url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=5)

    def start(self) -> None:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir)]
        self.proc = Proc("outage-redis", argv, {})
        deadline = time.monotonic() + 30
        while True:
            try:
                self.client().ping()
                return
            except redis.RedisError:
                assert self.proc.popen.poll() is None, f"redis-server exited:\n{self.proc.tail()}"
                assert time.monotonic() < deadline, f"redis-server did not answer:\n{self.proc.tail()}"
                time.sleep(0.05)

    def stop(self, how: str) -> None:
        """``kill``: SIGKILL, everything it held is lost; ``save``: SHUTDOWN SAVE, its data comes back."""
        assert self.proc is not None
        if how == "kill":
            self.proc.kill(signal.SIGKILL)
        else:
            subprocess.run(["redis-cli", "-p", str(self.port), "shutdown", "save"], check=False, capture_output=True)
            self.proc.popen.wait(timeout=30)
        self.proc.stop()
        with pytest.raises(redis.ConnectionError):  # the fault really happened: nothing answers
            self.client().ping()

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    server = OwnRedis(tmp_path)
    server.start()
    yield server
    server.close()


def celery_worker_pid(supervisor: Proc) -> int:
    """The Celery worker ``conductor worker`` runs as its child (Linux: read from /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[1]) == supervisor.popen.pid:
            children.append(int(stat.parent.name))
    assert len(children) == 1, f"conductor worker has children {children}:\n{supervisor.tail()}"
    return children[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def step_statuses(job_id: str) -> list[str]:
    with get_engine().connect() as conn:
        return list(conn.execute(sa.text("SELECT status FROM step WHERE job_id = :j ORDER BY index"),
                                 {"j": job_id}).scalars())


def submit(client: httpx.Client, agent: str) -> str:
    r = client.post("/v1/jobs", json={"task": f"outage {agent}",
                                       "workflow": {"model_ids": [agent], "subtasks": ["s"], "access_lists": [[]]}})
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize(("pool", "how"), [("threads", "kill"), ("threads", "save"), ("gevent", "kill")])
def test_a_worker_survives_its_redis_going_away_under_a_running_task(
        pool: str, how: str, own_redis: OwnRedis, proc_env: dict[str, str]) -> None:
    """A gevent worker acknowledges a task the moment it ends, here while Redis is away: one warning line, not
    kombu's "Couldn't ack" with a traceback. Its log still holds one traceback an outage: Celery's green
    remote-control loop dies on the lost connection, printed by gevent, and starts again on reconnection."""
    env = {**proc_env, "CONDUCTOR_BROKER_URL": own_redis.url(0), "CONDUCTOR_RESULT_BACKEND": own_redis.url(1)}
    worker = start_worker(env, f"outage-{pool}-{how}", queues="planner,steps,maintenance", concurrency=4, pool=pool)
    api: Proc | None = None
    try:
        api, url = start_api(env)
        celery_pid = celery_worker_pid(worker)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {new_key('outage')}"},
                          timeout=30) as client:
            running = submit(client, "slow")  # one step of 2.5 s, run in its plan task's slot (continued)
            deadline = time.monotonic() + 60
            while step_statuses(running) != ["running"]:
                assert time.monotonic() < deadline, f"the step never ran:\n{worker.tail()}"
                time.sleep(0.05)
            assert own_redis.client().hlen("unacked") == 1  # the plan message the step runs under
            own_redis.stop(how)
            if how == "save":  # it comes back with what it held, the unacknowledged message too
                assert (own_redis.dir / "dump.rdb").stat().st_size > 0
            time.sleep(DOWN_S)  # the task's call goes on; the consumer tries to reconnect
            own_redis.start()
            assert wait_terminal(client, running)["status"] == "succeeded"
            after = submit(client, "a")  # only this worker consumes: it must have reconnected
            assert wait_terminal(client, after)["status"] == "succeeded"
            if how == "save":
                # the task acknowledged its message on the channel of the lost connection, once Redis was back
                deadline = time.monotonic() + 30
                while own_redis.client().hlen("unacked"):
                    assert time.monotonic() < deadline, f"the message was never acknowledged:\n{worker.tail()}"
                    time.sleep(0.1)
        log = worker.log_path.read_text(errors="replace")
        assert "Unrecoverable error" not in log, worker.tail(120)
        assert "Couldn't ack" not in log, worker.tail(120)
        if pool == "threads":
            assert "Traceback" not in log, worker.tail(120)  # an outage is told in a line or two, not a traceback
        assert "the Celery worker exited" not in log, worker.tail(120)  # the supervisor's restart
        assert alive(celery_pid) and celery_worker_pid(worker) == celery_pid, worker.tail(120)
    finally:
        if api is not None:
            api.stop()
        worker.stop()
