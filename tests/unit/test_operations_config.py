"""Deployment facts that are easy to break silently: the reconciler's own queue, Flower's binding and
login, and the warning about an empty API-key pepper."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from conductor import cli
from conductor.settings import get_settings
from conductor.tasks.app import MAINTENANCE_QUEUE, app, celery_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_reconciler_has_its_own_queue_and_waits_there_for_a_consumer() -> None:
    settings = get_settings()
    assert app.amqp.router.route({}, "conductor.reconcile")["queue"].name == MAINTENANCE_QUEUE
    assert app.amqp.router.route({}, "conductor.run_step")["queue"].name == "steps"
    entry = celery_config(settings)["beat_schedule"]["reconcile"]  # type: ignore[index]
    assert entry["options"]["queue"] == MAINTENANCE_QUEUE
    assert entry["options"]["expires"] > settings.reconcile_interval_s  # not dropped after one interval


def test_workers_consume_the_maintenance_queue_by_default() -> None:
    args = cli._parser().parse_args(["worker"])
    assert MAINTENANCE_QUEUE in args.queues.split(",")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    consumers = [svc for svc in compose["services"].values()
                 if "worker" in svc.get("command", []) and MAINTENANCE_QUEUE in " ".join(svc["command"])]
    assert consumers, "no compose service consumes the maintenance queue"


def test_flower_in_compose_listens_on_the_container_address_behind_a_login() -> None:
    flower = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["flower"]
    command = flower["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    assert all(str(p).startswith("127.0.0.1:") for p in flower["ports"])
    assert "FLOWER_BASIC_AUTH" in flower["environment"]


def test_flower_refuses_a_public_address_without_a_login(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    get_settings.cache_clear()
    try:
        assert cli.main(["flower", "--host", "0.0.0.0"]) != 0
    finally:
        get_settings.cache_clear()
    assert "FLOWER_BASIC_AUTH" in capsys.readouterr().err


def test_an_empty_pepper_is_warned_about(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from conductor.service.app import create_app

    monkeypatch.setenv("CONDUCTOR_API_KEY_PEPPER", "")
    get_settings.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            create_app()
        assert any("CONDUCTOR_API_KEY_PEPPER is empty" in r.getMessage() for r in caplog.records)
        caplog.clear()
        monkeypatch.setenv("CONDUCTOR_API_KEY_PEPPER", "s3cret")
        get_settings.cache_clear()
        with caplog.at_level(logging.WARNING):
            create_app()
        assert not any("PEPPER" in r.getMessage() for r in caplog.records)
    finally:
        get_settings.cache_clear()


def test_no_command_shows_the_commands_and_says_why_it_stopped(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert "serve" in out and "worker" in out  # the commands to pick from
    assert err.strip().splitlines() == [
        "conductor: no command given; pick one of the commands above (conductor COMMAND --help)"]
