"""The ``vllm serve`` command line for the conductor model, and what happens where vLLM is missing."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conductor import planner_serve
from conductor.planner_serve import add_arguments, serve, vllm_command

ROOT = Path(__file__).resolve().parents[2]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_defaults_serve_the_model_as_conductor_with_caching_and_structured_output() -> None:
    argv = vllm_command("Qwen/Qwen2.5-7B-Instruct")
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen2.5-7B-Instruct"]
    assert _flag(argv, "--served-model-name") == "conductor"
    assert "--enable-prefix-caching" in argv
    assert _flag(argv, "--structured-outputs-config.backend") == "xgrammar"
    assert _flag(argv, "--max-model-len") == "8192"
    assert _flag(argv, "--gpu-memory-utilization") == "0.9"
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--port") == "8000"
    # Removed from vLLM in 0.12; passing it would stop the server at startup.
    assert not any(a.startswith("--guided-decoding") for a in argv)


def test_options_land_in_their_flags_and_extra_args_come_last() -> None:
    argv = vllm_command(
        "/models/conductor-7b",
        served_name="planner",
        host="0.0.0.0",
        port=9001,
        max_model_len=4096,
        gpu_memory_utilization=0.5,
        structured_outputs_backend="guidance",
        extra_args=["--tensor-parallel-size", "2"],
    )
    assert argv[2] == "/models/conductor-7b"
    assert _flag(argv, "--served-model-name") == "planner"
    assert _flag(argv, "--host") == "0.0.0.0"
    assert _flag(argv, "--port") == "9001"
    assert _flag(argv, "--max-model-len") == "4096"
    assert _flag(argv, "--gpu-memory-utilization") == "0.5"
    assert _flag(argv, "--structured-outputs-config.backend") == "guidance"
    assert argv[-2:] == ["--tensor-parallel-size", "2"]
    assert all(isinstance(a, str) for a in argv)


@pytest.mark.parametrize(
    "kwargs",
    [{"gpu_memory_utilization": 0.0}, {"gpu_memory_utilization": 1.5}, {"max_model_len": 0}],
)
def test_rejects_settings_vllm_would_refuse_later(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        vllm_command("m", **kwargs)


def test_rejects_an_empty_model() -> None:
    with pytest.raises(ValueError, match="model"):
        vllm_command("  ")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_without_vllm_serve_says_how_to_install_it_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(planner_serve.shutil, "which", lambda _name: None)
    monkeypatch.setattr(planner_serve.importlib.util, "find_spec", lambda _name: None)
    monkeypatch.setattr(planner_serve.os, "execv", lambda *_a: pytest.fail("must not exec without vLLM"))
    assert serve(_args()) == 1
    err = capsys.readouterr().err
    assert "pip install 'conductor-queue[gpu]'" in err
    assert "GPU" in err
    assert len(err.strip().splitlines()) == 1


def test_serve_execs_vllm_with_the_built_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(planner_serve.shutil, "which", lambda _name: "/opt/venv/bin/vllm")
    monkeypatch.setattr(planner_serve.os, "execv", lambda path, argv: execs.append((path, argv)))
    serve(_args("--model", "m", "--port", "9000", "--", "--tensor-parallel-size", "2"))
    assert execs == [("/opt/venv/bin/vllm", ["/opt/venv/bin/vllm", *vllm_command(
        "m", port=9000, extra_args=["--tensor-parallel-size", "2"])[1:]])]


def test_serve_falls_back_to_the_module_when_the_script_is_not_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    execs: list[list[str]] = []
    monkeypatch.setattr(planner_serve.shutil, "which", lambda _name: None)
    monkeypatch.setattr(planner_serve.importlib.util, "find_spec", lambda _name: object())
    monkeypatch.setattr(planner_serve.os, "execv", lambda _path, argv: execs.append(argv))
    serve(_args("--model", "m"))
    assert execs[0][:4] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def test_compose_runs_vllm_with_the_same_flags() -> None:
    """docker-compose.yml spells the command out (vLLM's image has no conductor); keep it in step."""
    vllm = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["vllm"]
    argv = [*vllm["entrypoint"], *(str(a) for a in vllm["command"])]
    assert argv == vllm_command(argv[2], host="0.0.0.0")
