"""docker-compose.yml is checked the way CI can without a Docker engine: Compose itself validates and
resolves the file (`docker compose config`, or Debian's `docker-compose config`), and every service
that runs the conductor image runs a command the CLI accepts."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

import pytest
import yaml

from conductor.cli import _parser
from conductor.tasks.app import QUEUES
from tests.integration.harness import ROOT

IMAGE = "conductor-queue:local"


def compose_config(env: dict[str, str] | None = None) -> dict[str, Any]:
    plugin = shutil.which("docker") and subprocess.run(["docker", "compose", "version"],
                                                        capture_output=True).returncode == 0
    if plugin:
        argv = ["docker", "compose", "config"]
    elif shutil.which("docker-compose"):
        argv = ["docker-compose", "config"]
    else:
        pytest.fail("neither 'docker compose' nor 'docker-compose' is installed: run scripts/ensure-tools.sh")
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", **(env or {})})
    assert done.returncode == 0, done.stderr
    config: dict[str, Any] = yaml.safe_load(done.stdout)
    return config


def test_compose_file_is_valid_and_runs_real_cli_commands() -> None:
    services = compose_config()["services"]
    assert {"postgres", "redis", "migrate", "api", "vllm", "planner", "worker", "beat", "flower"} <= set(services)
    parser = _parser()
    for name, svc in services.items():
        if svc.get("image") != IMAGE:
            continue
        command = svc["command"]
        assert command[0] == "conductor", name
        parser.parse_args(command[1:])  # argparse exits (SystemExit) on a command the CLI does not know
        env = svc.get("environment", {})
        assert env.get("CONDUCTOR_DATABASE_URL", "").startswith("postgresql+psycopg://"), name
        assert env.get("CONDUCTOR_BROKER_URL", "").startswith("redis://"), name
    queues = {name: svc["command"][svc["command"].index("--queues") + 1]
              for name, svc in services.items() if "--queues" in svc.get("command", [])}
    consumed = {q for names in queues.values() for q in names.split(",")}
    assert set(QUEUES) <= consumed, f"no service consumes {set(QUEUES) - consumed}"  # a queue nobody serves
    assert queues["planner"] == "planner" and queues["worker"] == "steps"
    assert services["planner"]["network_mode"] == "service:vllm"  # beside the model it calls
    assert "CONDUCTOR_METRICS_TOKEN" in services["api"]["environment"]
    assert "FLOWER_BASIC_AUTH" in services["flower"]["environment"]


def test_what_the_readme_says_comes_from_dot_env_reaches_the_services() -> None:
    """The README says .env gives the broker URLs (an external Redis) and the hosted planner recipe's
    PLANNER_API_KEY: compose used its own Redis whatever .env said, and never passed the planner key."""
    given = {"CONDUCTOR_BROKER_URL": "redis://ext.example:6379/3", "CONDUCTOR_RESULT_BACKEND": "redis://ext.example:6379/4",
             "PLANNER_API_KEY": "pk-test"}
    services = compose_config(given)["services"]
    conductor_services = [svc for svc in services.values() if svc.get("image") == IMAGE]
    assert conductor_services
    for svc in conductor_services:
        assert svc["environment"]["CONDUCTOR_BROKER_URL"] == given["CONDUCTOR_BROKER_URL"]
        assert svc["environment"]["CONDUCTOR_RESULT_BACKEND"] == given["CONDUCTOR_RESULT_BACKEND"]
    assert services["worker"]["environment"]["PLANNER_API_KEY"] == "pk-test"


def test_postgres_admits_every_connection_the_services_may_open() -> None:
    """Each long-running conductor process may open db_pool_size + db_max_overflow connections (a
    worker keeps up to that many open, and one more for its lease heartbeat); together they must fit the
    server's max_connections."""
    from conductor.settings import Settings

    services = compose_config()["services"]
    fields = Settings.model_fields  # the defaults, which compose does not override
    per_process = fields["db_pool_size"].default + fields["db_max_overflow"].default
    using_db = [name for name, svc in services.items()
                if svc.get("image") == IMAGE and svc["command"][1] in ("serve", "worker")]
    command = services["postgres"].get("command", [])
    limit = next((int(arg.split("=", 1)[1]) for arg in command if str(arg).startswith("max_connections=")), 100)
    workers = [name for name in using_db if services[name]["command"][1] == "worker"]
    opened = len(using_db) * per_process + len(workers)  # + each worker's heartbeat connection
    assert opened + 10 <= limit, (using_db, per_process, limit)  # 10: migrate, psql
